// safetensors files (<actorpipe/safetensors.hpp>): written and read back, save_pretrained
// folders with shards, and damaged files (truncated, lying headers) refused by name, never a
// crash. The Python `safetensors` package reads and writes the other side
// (tests/python/test_models.py, WeightsTest).
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <actorpipe/errors.hpp>
#include <actorpipe/safetensors.hpp>

using namespace actorpipe;
namespace fs = std::filesystem;

namespace {

struct folder {
  fs::path path;
  folder() {
    path = fs::temp_directory_path() / ("actorpipe-st-" + std::to_string(::getpid()) + "-" +
                                        std::to_string(std::random_device{}()));
    fs::create_directories(path);
  }
  ~folder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

named_tensors sample() {
  torch::manual_seed(0);
  return {{"model.embed.weight", torch::randn({7, 5})},
          {"model.norm.weight", torch::ones({5}, torch::kBFloat16)},
          {"model.steps", torch::arange(3, torch::kLong)},
          {"model.mask", torch::tensor({true, false})},
          {"empty", torch::zeros({0, 4})}};
}

std::string bytes_of(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void put(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

// A file of `header` (JSON text) and `data`.
std::string file_of(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int b = 0; b < 8; ++b) {
    out[b] = static_cast<char>((header.size() >> (8 * b)) & 0xff);
  }
  return out + header + data;
}

// Reads `bytes` as a file; true when it was refused with an actorpipe error naming the file.
bool refused(const fs::path& p, const std::string& bytes) {
  put(p, bytes);
  try {
    auto w = read_pretrained(p.string());
    for (const auto& [name, t] : w.tensors) {
      (void)t.sum().item<double>(); // every byte the header gives is readable
    }
    return false;
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()).find(p.string()) != std::string::npos);
    return true;
  } catch (const pipeline_error& e) {
    CHECK(std::string(e.what()).find(p.string()) != std::string::npos);
    return true;
  }
}

} // namespace

TEST_CASE("safetensors: written and read back, every dtype and an empty tensor") {
  folder d;
  auto path = (d.path / "w.safetensors").string();
  auto tensors = sample();
  write_safetensors(path, tensors);
  auto read = read_pretrained(path);
  REQUIRE(read.tensors.size() == tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    CAPTURE(tensors[i].first);
    CHECK(read.tensors[i].first == tensors[i].first); // the file's order is the writer's
    CHECK((read.tensors[i].second.scalar_type() == tensors[i].second.scalar_type()));
    CHECK(torch::equal(read.tensors[i].second, tensors[i].second));
  }
  // The header: 8-byte aligned, with the metadata from_pretrained asks for.
  auto bytes = bytes_of(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  CHECK(n % 8 == 0);
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  CHECK(header["__metadata__"]["format"].get<std::string>() == "pt");
  CHECK(header["model.norm.weight"]["dtype"].get<std::string>() == "BF16");
  // Released pages read back from the file.
  read.release(read.tensors[0].second);
  CHECK(torch::equal(read.tensors[0].second, tensors[0].second));
}

TEST_CASE("safetensors: a save_pretrained folder, in shards past the size and as one file") {
  folder d;
  put(d.path / "config.json", "{\"model_type\": \"llama\"}");
  auto tensors = sample();
  auto out = d.path / "out";
  write_pretrained(out.string(), tensors, 100, d.path.string());
  CHECK(fs::exists(out / "model.safetensors.index.json"));
  CHECK(fs::exists(out / "config.json"));
  auto index = nlohmann::json::parse(bytes_of(out / "model.safetensors.index.json"));
  CHECK(index["weight_map"]["model.embed.weight"].get<std::string>() ==
        "model-00001-of-00002.safetensors");
  CHECK(index["metadata"]["total_size"].get<int64_t>() == 7 * 5 * 4 + 5 * 2 + 3 * 8 + 2);
  auto read = read_pretrained(out.string());
  CHECK(read.config_folder == out.string());
  REQUIRE(read.tensors.size() == tensors.size());
  std::map<std::string, torch::Tensor> by_name(read.tensors.begin(), read.tensors.end());
  for (const auto& [name, t] : tensors) {
    CHECK(torch::equal(by_name.at(name), t));
  }
  // Written again unsharded: the index goes, one file stays.
  write_pretrained(out.string(), tensors);
  CHECK(!fs::exists(out / "model.safetensors.index.json"));
  CHECK(read_pretrained(out.string()).tensors.size() == tensors.size());
}

TEST_CASE("safetensors: damaged files are refused by name") {
  folder d;
  auto p = d.path / "bad.safetensors";
  const std::string data(16, '\1');
  auto entry = [](const std::string& dtype, const std::string& shape, const std::string& offsets) {
    return "{\"t\": {\"dtype\": \"" + dtype + "\", \"shape\": " + shape +
           ", \"data_offsets\": " + offsets + "}}";
  };
  CHECK(refused(p, ""));
  CHECK(refused(p, "1234567"));
  CHECK(refused(p, std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}"));
  CHECK(refused(p, file_of("{\"t\": ", data)));                      // not JSON
  CHECK(refused(p, file_of("[1, 2]", data)));                        // not an object
  CHECK(refused(p, file_of(entry("F33", "[4]", "[0, 16]"), data)));  // no such dtype
  CHECK(refused(p, file_of(entry("F32", "[5]", "[0, 16]"), data)));  // shape lies
  CHECK(refused(p, file_of(entry("F32", "[8]", "[0, 32]"), data)));  // past the end
  CHECK(refused(p, file_of(entry("F32", "[4]", "[16, 0]"), data)));  // backwards
  CHECK(refused(p, file_of(entry("F32", "[-4]", "[0, 16]"), data))); // negative size
  CHECK(refused(p, file_of(entry("F32", "[4611686018427387904, 4]", "[0, 16]"), data)));
  CHECK(refused(p, file_of("{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": "
                           "[0, 16]}, \"b\": {\"dtype\": \"F32\", \"shape\": [2], "
                           "\"data_offsets\": [8, 16]}}",
                           data))); // overlapping
  CHECK(!refused(p, file_of(entry("F32", "[4]", "[0, 16]"), data)));
  CHECK_THROWS_AS(read_pretrained((d.path / "missing").string()), invalid_argument);
  CHECK_THROWS_AS(read_pretrained(d.path.string()), invalid_argument); // no weights in it
  // An index naming a shard that is not there.
  put(d.path / "model.safetensors.index.json",
      "{\"weight_map\": {\"t\": \"model-00001-of-00002.safetensors\"}}");
  CHECK_THROWS_WITH_AS(read_pretrained(d.path.string()), doctest::Contains("not in the folder"),
                       invalid_argument);
}

TEST_CASE("safetensors: any truncation or byte flipped is refused or read, never a crash") {
  folder d;
  auto good = d.path / "good.safetensors";
  write_safetensors(good.string(), sample());
  auto bytes = bytes_of(good);
  auto p = d.path / "fuzzed.safetensors";
  std::mt19937 random(1);
  int refusals = 0;
  for (std::size_t n = 0; n < bytes.size(); n += 7) {
    refusals += refused(p, bytes.substr(0, n)) ? 1 : 0;
  }
  CHECK(refusals > 0);
  for (int round = 0; round < 400; ++round) {
    auto mutated = bytes;
    auto flips = 1 + random() % 4;
    for (unsigned k = 0; k < flips; ++k) {
      // Mostly in the header, where a lie changes what is read.
      auto at = random() % std::min<std::size_t>(mutated.size(), 8 + 400);
      mutated[at] = static_cast<char>(random() % 256);
    }
    refused(p, mutated); // either way, no crash and no read outside the file
  }
}
