// The tensor frame: round trips, and every kind of malformed input rejected, never trusted.
#include <cstring>
#include <random>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include "comm/bundle_frames.hpp"
#include "comm/wire.hpp"

using namespace actorpipe::comm;

namespace {

frame round_trip(const torch::Tensor& t, frame_kind kind = frame_kind::activation) {
  auto h = describe(kind, 3, 42, 7, 1, t);
  auto bytes = encode_frame(h, t);
  return decode_frame(bytes.data(), bytes.size());
}

std::vector<uint8_t> valid_frame() {
  auto t = torch::arange(24, torch::kFloat).reshape({2, 3, 4});
  return encode_frame(describe(frame_kind::gradient, 1, 9, 2, 0, t), t);
}

template <class T>
void poke(std::vector<uint8_t>& bytes, std::size_t offset, T value) {
  std::memcpy(bytes.data() + offset, &value, sizeof value);
}

} // namespace

TEST_CASE("frames carry every supported dtype and shape, header fields intact") {
  std::vector<torch::Tensor> tensors = {
    torch::randn({5, 3}),
    torch::randn({2, 3, 4, 5}, torch::kDouble),
    torch::randn({7}).to(torch::kHalf),
    torch::randn({3, 3}).to(torch::kBFloat16),
    torch::randint(-100, 100, {4, 2}, torch::kLong),
    torch::randint(-100, 100, {6}, torch::kInt),
    torch::randint(-100, 100, {6}, torch::kShort),
    torch::randint(-100, 100, {6}, torch::kChar),
    torch::randint(0, 255, {9}, torch::kByte),
    torch::rand({4}) > 0.5,
    torch::tensor(3.5),                     // 0-d
    torch::empty({0, 5}),                   // empty
    torch::randn({2, 1, 1, 1, 1, 1, 1, 3}), // 8 dimensions
  };
  for (const auto& t : tensors) {
    CAPTURE(t.sizes());
    CAPTURE(t.scalar_type());
    auto f = round_trip(t);
    CHECK(f.header.stage == 3);
    CHECK(f.header.step == 42);
    CHECK(f.header.microbatch == 7);
    CHECK(f.header.chunk == 1);
    CHECK((f.header.kind == frame_kind::activation));
    CHECK((f.tensor.scalar_type() == t.scalar_type()));
    CHECK(f.tensor.sizes() == t.sizes());
    CHECK(torch::equal(f.tensor, t));
  }
}

TEST_CASE("a non-contiguous tensor crosses as its values") {
  auto t = torch::randn({4, 6}).t();
  REQUIRE_FALSE(t.is_contiguous());
  CHECK(torch::equal(round_trip(t).tensor, t));
}

TEST_CASE("unsupported tensors are refused by the sender") {
  CHECK_THROWS_WITH_AS(
    describe(frame_kind::activation, 0, 0, 0, 0, torch::randn({2}, torch::kComplexFloat)),
    doctest::Contains("cannot cross the wire"), frame_error);
  CHECK_THROWS_WITH(
    describe(frame_kind::activation, 0, 0, 0, 0, torch::randn({1, 1, 1, 1, 1, 1, 1, 1, 1})),
    doctest::Contains("9 dimensions"));
}

TEST_CASE("malformed headers are rejected with what is wrong") {
  auto check = [](std::vector<uint8_t> bytes, const char* message) {
    CAPTURE(message);
    CHECK_THROWS_WITH_AS(decode_frame(bytes.data(), bytes.size()), doctest::Contains(message),
                         frame_error);
  };
  auto base = valid_frame();
  REQUIRE_NOTHROW(decode_frame(base.data(), base.size()));
  auto b = base;
  b[0] = 'X';
  check(b, "magic");
  b = base;
  b[4] = 1;
  check(b, "version 1");
  b = base;
  b[5] = 0;
  check(b, "unknown kind 0");
  b = base;
  b[5] = 77;
  check(b, "unknown kind 77");
  b = base;
  b[6] = 200;
  check(b, "unknown dtype code 200");
  b = base;
  b[7] = 9;
  check(b, "9 dimensions");
  b = base;
  b[23] = 1;
  check(b, "reserved");
  b = base;
  b[22] = 4;
  check(b, "unknown flags");
  b = base;
  b[20] = 1; // part 1 of a bundle of 1
  check(b, "part 1 of a bundle of 1");
  b = base;
  b[20] = 1;
  b[21] = 0;
  check(b, "part 1 of a bundle of 0");
  b = base;
  poke<int64_t>(b, 40, -2);
  check(b, "dimension 0 of size -2");
  b = base;
  poke<int64_t>(b, 40, int64_t{1} << 50);
  check(b, "dimension 0 of size");
  b = base;
  poke<uint64_t>(b, 32, 95); // 24 floats are 96 bytes
  check(b, "does not match its shape");
  b = base;
  poke<int64_t>(b, 40, 4); // shape says 48 floats, payload 96 bytes
  check(b, "does not match its shape");
  b = base;
  b.push_back(0);
  check(b, "1 bytes follow the frame");
  check({}, "empty input");
}

TEST_CASE("a frame over the receiver's limit is refused before anything is allocated") {
  // A header that claims 2^39 floats (2 TiB) and carries nothing.
  auto t = torch::empty({1});
  auto h = describe(frame_kind::activation, 0, 0, 0, 0, t);
  h.shape = {int64_t{1} << 39};
  h.payload_bytes = (uint64_t{1} << 39) * 4;
  auto bytes = encode_header(h);
  CHECK_THROWS_WITH_AS(decode_frame(bytes.data(), bytes.size()),
                       doctest::Contains("exceeds the limit"), frame_error);
  frame_limits small;
  small.max_payload_bytes = 64;
  auto base = valid_frame();
  CHECK_THROWS_WITH_AS(decode_frame(base.data(), base.size(), small),
                       doctest::Contains("exceeds the limit of 64"), frame_error);
}

TEST_CASE("every truncation of a frame is rejected") {
  auto base = valid_frame();
  for (std::size_t n = 1; n < base.size(); ++n) {
    CAPTURE(n);
    CHECK_THROWS_AS(decode_frame(base.data(), n), frame_error);
  }
}

TEST_CASE("fuzz: random corruptions decode or throw frame_error, nothing else") {
  std::mt19937_64 rng(12345);
  auto base = valid_frame();
  int decoded = 0;
  int rejected = 0;
  for (int i = 0; i < 20000; ++i) {
    auto b = base;
    auto flips = 1 + rng() % 4;
    for (std::size_t k = 0; k < flips; ++k) {
      b[rng() % b.size()] = static_cast<uint8_t>(rng());
    }
    if (rng() % 4 == 0) {
      b.resize(rng() % (b.size() + 1));
    }
    try {
      auto f = decode_frame(b.data(), b.size());
      // Whatever decoded is self-consistent.
      CHECK(static_cast<uint64_t>(f.tensor.nbytes()) == f.header.payload_bytes);
      ++decoded;
    } catch (const frame_error&) {
      ++rejected;
    }
  }
  MESSAGE(decoded, " decoded, ", rejected, " rejected");
  CHECK(rejected > 10000);
  CHECK(decoded > 0);
}

TEST_CASE("fuzz: random bytes never pass as a frame") {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 5000; ++i) {
    std::vector<uint8_t> b(rng() % 200);
    for (auto& x : b) {
      x = static_cast<uint8_t>(rng());
    }
    CHECK_THROWS_AS(decode_frame(b.data(), b.size()), frame_error);
  }
}

namespace {

frame_header address(frame_kind kind, uint32_t stage, uint64_t step, int32_t microbatch) {
  frame_header h;
  h.kind = kind;
  h.stage = stage;
  h.step = step;
  h.microbatch = microbatch;
  return h;
}

// The frames of `b` through the byte format and an assembler, in the order given.
std::optional<actorpipe::bundle> through_the_wire(const actorpipe::bundle& b,
                                                  bundle_assembler& assembler) {
  std::optional<actorpipe::bundle> result;
  for (auto& [header, tensor] : bundle_frames(address(frame_kind::activation, 2, 5, 1), b)) {
    auto bytes = encode_frame(header, tensor);
    auto got = assembler.add(decode_frame(bytes.data(), bytes.size()));
    CHECK_FALSE(result.has_value());
    result = std::move(got);
  }
  return result;
}

} // namespace

TEST_CASE("a bundle crosses as its frames and comes back with its dtypes, shapes and flags") {
  bundle_assembler assembler;
  auto h = torch::randn({2, 3, 4}).requires_grad_(true);
  auto mask = torch::rand({2, 3}) > 0.5;
  auto ids = torch::randint(0, 50, {2, 3}, torch::kLong);
  auto side = torch::randn({2, 4});
  auto back = through_the_wire(actorpipe::bundle({h, mask, ids, side}), assembler);
  REQUIRE(back.has_value());
  REQUIRE(back->size() == 4);
  CHECK(torch::equal((*back)[0], h.detach()));
  CHECK((*back)[0].requires_grad());
  CHECK(torch::equal((*back)[1], mask));
  CHECK(torch::equal((*back)[2], ids));
  CHECK(torch::equal((*back)[3], side));
  CHECK_FALSE((*back)[3].requires_grad());
  CHECK(back->differentiable_count() == 1);
  CHECK(assembler.pending() == 0);
  // An empty bundle (no gradients to send back) is one frame.
  auto empty = through_the_wire(actorpipe::bundle{}, assembler);
  REQUIRE(empty.has_value());
  CHECK(empty->empty());
}

TEST_CASE("bundles interleaved on the wire are put together by their addresses") {
  bundle_assembler assembler;
  auto first = bundle_frames(address(frame_kind::activation, 1, 7, 0),
                             actorpipe::bundle({torch::ones({2}), torch::zeros({3})}));
  auto second = bundle_frames(address(frame_kind::activation, 1, 7, 1),
                              actorpipe::bundle({torch::full({2}, 2.0), torch::full({3}, 3.0)}));
  CHECK_FALSE(assembler.add({first[0].first, first[0].second}).has_value());
  CHECK_FALSE(assembler.add({second[0].first, second[0].second}).has_value());
  auto b1 = assembler.add({second[1].first, second[1].second});
  REQUIRE(b1.has_value());
  CHECK(torch::equal((*b1)[0], torch::full({2}, 2.0)));
  CHECK(assembler.pending() == 1);
  // A repeated part is refused, and the bundle it belonged to dropped.
  CHECK_THROWS_WITH_AS(assembler.add({first[0].first, first[0].second}),
                       doctest::Contains("repeats a part"), frame_error);
  CHECK(assembler.pending() == 0);
  // Unfinished bundles of earlier steps are dropped.
  CHECK_FALSE(assembler.add({first[0].first, first[0].second}).has_value());
  assembler.drop_before(8);
  CHECK(assembler.pending() == 0);
}

TEST_CASE("a named bundle crosses with its names, in their order, as one more frame") {
  bundle_assembler assembler;
  auto h = torch::randn({2, 3}).requires_grad_(true);
  auto mask = torch::rand({2, 3}) > 0.5;
  auto named = actorpipe::bundle::named({{"hidden", h}, {"mask", mask}});
  auto frames = bundle_frames(address(frame_kind::activation, 2, 5, 1), named);
  REQUIRE(frames.size() == 3);
  CHECK(frames[2].first.names);
  CHECK(frames[2].first.part == 2);
  auto back = through_the_wire(named, assembler);
  REQUIRE(back.has_value());
  REQUIRE(back->is_named());
  CHECK(back->names() == std::vector<std::string>{"hidden", "mask"});
  CHECK(torch::equal((*back)[0], h.detach()));
  CHECK((*back)[0].requires_grad());
  CHECK(torch::equal((*back)[1], mask));
  // One named tensor is two frames.
  auto one = through_the_wire(actorpipe::bundle::named({{"x", torch::ones({4})}}), assembler);
  REQUIRE(one.has_value());
  CHECK(one->names() == std::vector<std::string>{"x"});
  CHECK(assembler.pending() == 0);
}

TEST_CASE("a names frame that is not the last part, holds no bytes or names too few or too many "
          "tensors is refused") {
  auto named = actorpipe::bundle::named({{"a", torch::ones({2})}, {"b", torch::zeros({2})}});
  auto frames = bundle_frames(address(frame_kind::activation, 0, 1, 0), named);
  SUBCASE("not last") {
    bundle_assembler assembler;
    auto h = frames[2].first;
    h.part = 0;
    CHECK_THROWS_WITH_AS(assembler.add({h, frames[2].second}),
                         doctest::Contains("a names frame must be the last part"), frame_error);
  }
  SUBCASE("not bytes") {
    bundle_assembler assembler;
    auto h = frames[0].first;
    h.names = true;
    h.part = 2;
    CHECK_THROWS_WITH_AS(assembler.add({h, frames[0].second}),
                         doctest::Contains("a names frame must be the last part"), frame_error);
  }
  for (const std::string& text : {std::string("a", 2), std::string("a\0b\0c\0", 6)}) {
    CAPTURE(text.size());
    bundle_assembler assembler;
    auto bytes = torch::empty({static_cast<int64_t>(text.size())}, torch::kByte);
    std::memcpy(bytes.data_ptr(), text.data(), text.size());
    auto h = describe(frame_kind::activation, 0, 1, 0, 0, bytes);
    h.part = 2;
    h.parts = 3;
    h.names = true;
    CHECK_FALSE(assembler.add({frames[0].first, frames[0].second}).has_value());
    CHECK_FALSE(assembler.add({frames[1].first, frames[1].second}).has_value());
    CHECK_THROWS_WITH_AS(assembler.add({h, bytes}), doctest::Contains("a names frame names"),
                         frame_error);
  }
  // On the wire, a frame cannot both need a gradient and hold names.
  auto bytes = encode_frame(frames[0].first, frames[0].second);
  bytes[22] = 3;
  CHECK_THROWS_WITH_AS(decode_frame(bytes.data(), bytes.size()), doctest::Contains("unknown flags"),
                       frame_error);
}

TEST_CASE("what the wire cannot carry is refused by the sender, naming it") {
  CHECK_THROWS_WITH_AS(
    bundle_frames({}, actorpipe::bundle::named({{std::string("a\0b", 3), torch::ones({2})}})),
    doctest::Contains("the name of its tensor 0 holds a 0 byte"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(bundle_frames({}, actorpipe::bundle({torch::ones({2}), torch::Tensor{}})),
                       doctest::Contains("has an undefined tensor 1"), std::invalid_argument);
  std::vector<torch::Tensor> many(256, torch::ones({1}));
  CHECK_THROWS_WITH_AS(bundle_frames({}, actorpipe::bundle(many)),
                       doctest::Contains("256 tensors cannot cross the wire"),
                       std::invalid_argument);
}
