// The kinds of failure as one table (include/actorpipe/errors.hpp): every enumerator has its row,
// every encoding (name, CAF error code, node wire byte) reads it back, the reaction a run takes is
// the table's; a refusal carries its fields through CAF, and several stages' failures keep
// each one's; and the kind added through the table, disk_full, from its detector to the caller,
// in process and from stages on nodes.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "actors/request_error.hpp"
#include "node_fixtures.hpp"
#include "stages/checkpoint.hpp"

namespace actorpipe::test {
namespace {

// The enumerators of `enum class error_kind` as errors.hpp spells them, in order.
std::vector<std::string> declared_kinds() {
  std::ifstream in(std::string(ACTORPIPE_SOURCE_DIR) + "/include/actorpipe/errors.hpp");
  REQUIRE(in);
  std::stringstream text;
  text << in.rdbuf();
  auto all = text.str();
  auto begin = all.find("enum class error_kind");
  REQUIRE(begin != std::string::npos);
  auto end = all.find("};", begin);
  std::istringstream body(all.substr(begin, end - begin));
  std::vector<std::string> names;
  const std::regex enumerator{R"(^\s*([a-z_]+),\s*$)"};
  std::smatch m;
  for (std::string line; std::getline(body, line);) {
    if (std::regex_match(line, m, enumerator)) {
      names.push_back(m[1]);
    }
  }
  return names;
}

// A folder whose stage-`stage`.pt is /dev/full: writing it runs out of space at once.
std::string folder_on_a_full_disk(const std::string& name, std::size_t stage) {
  REQUIRE_MESSAGE(std::filesystem::exists("/dev/full"), "the test writes to Linux's /dev/full");
  auto dir = temp_dir(name);
  std::filesystem::create_directories(dir);
  std::filesystem::create_symlink("/dev/full", stages::stage_file(dir, stage));
  return dir;
}

// The error of a save to `dir` that must fail.
pipeline_error failed_save(pipeline& pipe, const std::string& dir) {
  try {
    pipe.save_state(dir);
  } catch (const pipeline_error& e) {
    return e;
  }
  FAIL("save_state wrote to a full disk");
  return pipeline_error("");
}

// A save to `dir`, whose stage-`stage`.pt is on a full disk, fails naming that stage and file.
pipeline_error check_disk_full(pipeline& pipe, const std::string& dir, std::size_t stage) {
  auto e = failed_save(pipe, dir);
  INFO(e.what());
  CHECK(e.kind() == error_kind::disk_full);
  CHECK(e.stage() == stage);
  CHECK(std::string(e.what()).find(stages::stage_file(dir, stage)) != std::string::npos);
  CHECK(std::string(e.what()).find("disk is full") != std::string::npos);
  return e;
}

} // namespace

TEST_CASE("every error kind has its row in error_kinds, in the enum's order") {
  auto declared = declared_kinds();
  REQUIRE(declared.size() == error_kind_count);
  for (std::size_t i = 0; i < error_kind_count; ++i) {
    CHECK(declared[i] == error_kinds[i].name);
    CHECK(std::string(to_string(error_kinds[i].kind)) == declared[i]);
  }
}

TEST_CASE("every error kind crosses CAF and the node wire as itself, a newer one as other") {
  for (const auto& row : error_kinds) {
    INFO(row.name);
    CHECK(actors::kind_of_pipeline_error(actors::make_pipeline_error(row.kind, "x")) == row.kind);
    CHECK(nodes::error_kind_from_wire(nodes::error_kind_to_wire(row.kind)) == row.kind);
    CHECK(error_kind_from_number(static_cast<std::size_t>(row.kind)) == row.kind);
  }
  auto newer = static_cast<uint8_t>(error_kind_count);
  CHECK(nodes::error_kind_from_wire(newer) == error_kind::other);
  CHECK(actors::kind_of_pipeline_error(caf::error(static_cast<uint8_t>(newer + 1),
                                                  actors::pipeline_errors)) == error_kind::other);
  CHECK(!error_kind_from_number(error_kind_count));
  CHECK(std::string(to_string(static_cast<error_kind>(newer))) == "other");
}

TEST_CASE("a refusal carries its kind, stage, micro-batch, step and node through CAF") {
  auto e = actors::make_pipeline_error(
    error_details{error_kind::disk_full, 3, 2, 17, "127.0.0.1:7000"}, "stage 3: no room");
  auto d = actors::details_of_pipeline_error(e);
  CHECK(d.kind == error_kind::disk_full);
  CHECK(d.stage == 3u);
  CHECK(d.microbatch == 2);
  CHECK(d.step == 17u);
  CHECK(d.node == "127.0.0.1:7000");
  CHECK(actors::carried_sentence(e) == "stage 3: no room");
  // A refusal of a kind alone leaves the rest empty; CAF's own errors carry no sentence.
  auto bare = actors::details_of_pipeline_error(actors::make_pipeline_error(error_kind::io, "x"));
  CHECK(bare.kind == error_kind::io);
  CHECK(!bare.stage);
  CHECK(!bare.microbatch);
  CHECK(!bare.step);
  CHECK(bare.node.empty());
  CHECK(!actors::carried_sentence(caf::make_error(caf::sec::request_timeout, "not a sentence")));
}

TEST_CASE("a run recovers from the kinds its table says, alone and with replicas") {
  CHECK(reaction_to(error_kind::node_lost, false) == fault_reaction::recover);
  CHECK(reaction_to(error_kind::timeout, false) == fault_reaction::recover);
  CHECK(reaction_to(error_kind::replica_failure, false) == fault_reaction::give_up);
  CHECK(reaction_to(error_kind::replica_failure, true) == fault_reaction::recover);
  CHECK(reaction_to(error_kind::disk_full, true) == fault_reaction::give_up);
  CHECK(reaction_to(error_kind::shape_mismatch, false) == fault_reaction::give_up);
}

TEST_CASE("a file written to a full disk fails as disk_full, naming it and its size") {
  REQUIRE_MESSAGE(std::filesystem::exists("/dev/full"), "the test writes to Linux's /dev/full");
  std::string bytes(1 << 20, 'x');
  try {
    stages::write_bytes("/dev/full", bytes.data(), bytes.size());
    FAIL("write_bytes wrote to /dev/full");
  } catch (const pipeline_error& e) {
    CHECK(e.kind() == error_kind::disk_full);
    CHECK(std::string(e.what()).find("cannot write '/dev/full' (1.0 MB): its disk is full") !=
          std::string::npos);
  }
  // Another failure stays io.
  try {
    stages::write_bytes("/nonexistent-folder/file", bytes.data(), bytes.size());
    FAIL("write_bytes wrote into a folder that does not exist");
  } catch (const pipeline_error& e) {
    CHECK(e.kind() == error_kind::io);
  }
}

TEST_CASE("a checkpoint on a full disk fails as disk_full with its stage, and training goes on") {
  engine sys;
  auto cut = partition_uniform(6, 2);
  pipeline pipe(sys, tiny_mlp(1), cut, local_options());
  pipeline plain(sys, tiny_mlp(1), cut, local_options());
  auto dir = folder_on_a_full_disk("disk-full", 1);
  auto [x, y] = batch(0);
  pipe.train_step(x, y);
  plain.train_step(x, y);
  check_disk_full(pipe, dir, 1);
  // Nothing changed: the next step is plain's.
  auto [x1, y1] = batch(1);
  CHECK(pipe.train_step(x1, y1).loss ==
        doctest::Approx(plain.train_step(x1, y1).loss).epsilon(1e-6));
  std::filesystem::remove_all(dir);
}

TEST_CASE("a save that fails on two stages keeps each stage's failure with its fields") {
  engine sys;
  pipeline pipe(sys, tiny_mlp(1), partition_uniform(6, 2), local_options());
  auto dir = folder_on_a_full_disk("disk-full-both", 0);
  std::filesystem::create_symlink("/dev/full", stages::stage_file(dir, 1));
  auto e = failed_save(pipe, dir);
  INFO(e.what());
  CHECK(e.kind() == error_kind::disk_full);
  REQUIRE(e.failures().size() == 2);
  for (std::size_t stage = 0; stage < 2; ++stage) {
    const auto& part = e.failures()[stage];
    CHECK(part.details.kind == error_kind::disk_full);
    CHECK(part.details.stage == stage);
    CHECK(part.message.find(stages::stage_file(dir, stage)) != std::string::npos);
    CHECK(std::string(e.what()).find(part.message) != std::string::npos);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("a checkpoint of stages on nodes on a full disk fails as disk_full with its stage") {
  node n1(node_config()), n2(node_config());
  engine sys;
  pipeline remote(sys, tiny_remote(), partition_uniform(6, 2),
                  remote_options({n1.address(), n2.address()}));
  auto dir = folder_on_a_full_disk("disk-full-nodes", 0);
  auto [x, y] = batch(0);
  remote.train_step(x, y);
  // The file is written on this side, from the state the node sent; the failure names the node.
  CHECK(check_disk_full(remote, dir, 0).node() == n1.address());
  std::filesystem::remove_all(dir);
}

} // namespace actorpipe::test
