// State frames' payload (stages/checkpoint.hpp: pack_tensors, unpack_tensors).
#include <cstring>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <actorpipe/errors.hpp>

#include "stages/checkpoint.hpp"

using namespace actorpipe;

namespace {

// The bytes as a receiver holds them: a 64-byte aligned uint8 tensor.
template <class Bytes>
torch::Tensor received(const Bytes& bytes) {
  auto t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

} // namespace

TEST_CASE("packed state comes back as the same tensors, views of the received buffer") {
  stages::tensor_map state{
    {"fc.weight", torch::randn({3, 5})},
    {"fc.bias", torch::randn({3}).to(torch::kBFloat16)},
    {"bn.num_batches_tracked", torch::tensor(7, torch::kLong)},
    {"mask", torch::rand({2, 2}).gt(0.5)},
    {"empty", torch::empty({0, 4})},
    {"optimizer/fc.weight/momentum_buffer", torch::randn({5, 3}).t()}, // not contiguous
    {"ids", torch::randint(100, {4}, torch::kInt)},
    {"half", torch::randn({1}).to(torch::kHalf)},
    {"double", torch::randn({2}, torch::kDouble)},
  };
  auto packed = stages::pack_tensors(state);
  // Every byte is written (the padding too): the same state packs to the same bytes.
  CHECK(packed == stages::pack_tensors(state));
  auto bytes = received(packed);
  auto back = stages::unpack_tensors(bytes, "the test's state");
  REQUIRE(back.size() == state.size());
  for (const auto& [name, t] : state) {
    CAPTURE(name);
    REQUIRE(back.count(name) == 1);
    CHECK((back[name].scalar_type() == t.scalar_type()));
    CHECK((back[name].sizes() == t.sizes()));
    CHECK(torch::equal(back[name], t));
    if (t.numel() > 0) {
      auto* p = static_cast<const char*>(back[name].data_ptr());
      auto* begin = static_cast<const char*>(bytes.data_ptr());
      CHECK((p >= begin && p < begin + bytes.numel()));
      CHECK(reinterpret_cast<std::uintptr_t>(p) % 64 == 0);
    }
  }
  // The views keep the buffer alive.
  bytes = torch::Tensor();
  CHECK(torch::equal(back["fc.weight"], state["fc.weight"]));
}

TEST_CASE("malformed packed state is refused, naming what and why, before anything is read") {
  stages::tensor_map state{{"w", torch::randn({4, 4})}, {"b", torch::randn({4})}};
  auto packed = stages::pack_tensors(state);
  std::vector<char> good(packed.begin(), packed.end());
  auto refuses = [](std::vector<char> bytes, const std::string& why) {
    CAPTURE(why);
    try {
      stages::unpack_tensors(received(bytes), "stage 1's state");
      FAIL("accepted");
    } catch (const pipeline_error& e) {
      CHECK(e.kind() == error_kind::io);
      CHECK(std::string(e.what()).find("stage 1's state is not packed state: " + why) !=
            std::string::npos);
    }
  };
  auto bad = good;
  bad[0] = 'X';
  refuses(bad, "wrong magic");
  refuses(std::vector<char>(good.begin(), good.end() - 5), "'w' is truncated");
  refuses(std::vector<char>(good.begin(), good.begin() + 6), "truncated in the count");
  bad = good;
  bad.push_back(0);
  refuses(bad, "1 bytes after the last tensor");
  // The first tensor ("b": keys are ordered) is at 8: name length, name, then its dtype.
  bad = good;
  bad[8 + 4 + 1] = 100;
  refuses(bad, "'b' has dtype 100");
  bad = good;
  bad[8 + 4 + 1 + 1] = 9;
  refuses(bad, "'b' has dtype 6 and 9 dimensions");
  bad = good;
  int64_t huge = int64_t{1} << 41;
  std::memcpy(bad.data() + 8 + 4 + 1 + 2, &huge, 8);
  refuses(bad, "'b' has a dimension of");
  bad = good;
  int64_t five = 5;
  std::memcpy(bad.data() + 8 + 4 + 1 + 2, &five, 8);
  refuses(bad, "'b' has 16 bytes for shape [5]");
  bad = good;
  uint32_t long_name = 1u << 30;
  std::memcpy(bad.data() + 8, &long_name, 4);
  refuses(bad, "tensor 0's name of 1073741824 bytes");
  CHECK_THROWS_AS(stages::unpack_tensors(torch::zeros({4}), "floats"), pipeline_error);
  // A name of bytes that are not text is quoted escaped: error text is printable UTF-8.
  bad = good;
  bad[8 + 4] = static_cast<char>(0xff); // "b" -> one byte that is no UTF-8
  bad[8 + 4 + 1] = 100;
  refuses(bad, "'\\xff' has dtype 100");
}

TEST_CASE("error messages are printable UTF-8: other bytes and control characters as \\xNN") {
  using actorpipe::detail::printable;
  CHECK(printable("plain text, a\ttab\nand a newline") == "plain text, a\ttab\nand a newline");
  CHECK(printable("caf\xc3\xa9 \xe2\x82\xac \xf0\x9d\x84\x9e") ==
        "caf\xc3\xa9 \xe2\x82\xac \xf0\x9d\x84\x9e");
  CHECK(printable(std::string("a\xff\xfe b")) == "a\\xff\\xfe b");
  CHECK(printable(std::string("nul\0!", 5)) == "nul\\x00!");
  CHECK(printable("bell\a, return\r") == "bell\\x07, return\\x0d");
  CHECK(printable("overlong \xc0\xaf, surrogate \xed\xa0\x80") ==
        "overlong \\xc0\\xaf, surrogate \\xed\\xa0\\x80");
  CHECK(printable("cut \xe2\x82") == "cut \\xe2\\x82");
  CHECK(std::string(pipeline_error("file 'x\xfey'").what()) == "file 'x\\xfey'");
  CHECK(std::string(invalid_argument(std::string("--model '\x80'")).what()) == "--model '\\x80'");
}
