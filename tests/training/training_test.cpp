#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <doctest/doctest.h>
#include <torch/torch.h>
#include <zlib.h>

#include <actorpipe/actorpipe.hpp>
#include <actorpipe/training.hpp>

#include "../engine/oracle.hpp"

using namespace actorpipe;
namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() /
             ("actorpipe_training_test_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void write_gz(const fs::path& path, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(path.string().c_str(), "wb");
  REQUIRE(f != nullptr);
  gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
}

pipeline_options sgd_options(std::size_t microbatches) {
  pipeline_options o;
  o.microbatches = microbatches;
  o.loss = [](const torch::Tensor& y, const torch::Tensor& t) {
    return torch::nn::functional::cross_entropy(y, t);
  };
  o.optimizer = sgd(0.05, 0.9);
  return o;
}

} // namespace

TEST_CASE("Fashion-MNIST loads as normalised 1x28x28 images with labels 0..9") {
  auto train = load_fashion_mnist(default_fashion_mnist_dir(), true);
  auto test = load_fashion_mnist(default_fashion_mnist_dir(), false);
  CHECK(train.size() == 60000);
  CHECK(test.size() == 10000);
  CHECK(train.images.sizes() == torch::IntArrayRef{60000, 1, 28, 28});
  CHECK(train.labels.min().item<int64_t>() == 0);
  CHECK(train.labels.max().item<int64_t>() == 9);
  CHECK(train.images.mean().item<double>() == doctest::Approx(0.0).epsilon(0.01));
  CHECK(train.images.std().item<double>() == doctest::Approx(1.0).epsilon(0.01));
  // Every class is equally frequent in Fashion-MNIST's training split.
  CHECK(torch::bincount(train.labels).eq(6000).all().item<bool>());
}

TEST_CASE("missing or malformed Fashion-MNIST files are named") {
  auto dir = fresh_dir("idx");
  CHECK_THROWS_WITH_AS(load_fashion_mnist(dir.string(), true),
                       doctest::Contains("train-images-idx3-ubyte.gz' not found; install "
                                         "Debian's package dataset-fashion-mnist"),
                       actorpipe::invalid_argument);
  write_gz(dir / "t10k-images-idx3-ubyte.gz", {0, 0, 8, 1, 0, 0, 0, 1});
  write_gz(dir / "t10k-labels-idx1-ubyte.gz", {0, 0, 8, 1, 0, 0, 0, 1, 3});
  CHECK_THROWS_WITH_AS(load_fashion_mnist(dir.string(), false),
                       doctest::Contains("is not an IDX file of unsigned bytes with 3 dimensions"),
                       actorpipe::pipeline_error);
  write_gz(dir / "t10k-images-idx3-ubyte.gz",
           {0, 0, 8, 3, 0, 0, 0, 1, 0, 0, 0, 28, 0, 0, 0, 28, 7});
  CHECK_THROWS_WITH_AS(load_fashion_mnist(dir.string(), false),
                       doctest::Contains("is truncated: could not read the data (784 bytes)"),
                       actorpipe::pipeline_error);
  fs::remove_all(dir);
}

TEST_CASE("the epoch order is a permutation fixed by seed and epoch") {
  auto a = epoch_order(100, 7, 2);
  CHECK(torch::equal(a, epoch_order(100, 7, 2)));
  CHECK_FALSE(torch::equal(a, epoch_order(100, 7, 3)));
  CHECK_FALSE(torch::equal(a, epoch_order(100, 8, 2)));
  CHECK(torch::equal(std::get<0>(a.sort()), torch::arange(100)));
}

TEST_CASE("the cosine schedule warms up linearly, peaks, and decays to its minimum") {
  cosine_schedule s{0.1, 0.001, 10, 110};
  CHECK(s.at(0) == doctest::Approx(0.01));
  CHECK(s.at(9) == doctest::Approx(0.1));
  CHECK(s.at(10) == doctest::Approx(0.1));
  CHECK(s.at(60) == doctest::Approx(0.001 + 0.5 * 0.099));
  CHECK(s.at(110) == doctest::Approx(0.001));
}

TEST_CASE("a checkpoint written by 2 stages loads into 3 stages, optimizer state included") {
  auto root = fresh_dir("repartition");
  engine sys;
  auto layers = test::tiny_mlp(5);
  pipeline two(sys, layers, partition_uniform(layers.size(), 2), sgd_options(2));
  auto x = torch::randn({8, 1, 4, 4});
  auto t = torch::randint(3, {8});
  two.train_step(x, t);
  checkpoint_manifest m;
  m.model = "mlp";
  m.step = 1;
  auto dir = write_checkpoint(two, root.string(), m, 2);
  CHECK(fs::exists(fs::path(dir) / "stage-0.pt"));
  CHECK(find_checkpoint(root.string()) == dir);
  CHECK(read_manifest(dir).step == 1);

  auto other = test::tiny_mlp(99);
  pipeline three(sys, other, partition_uniform(other.size(), 3), sgd_options(2));
  three.load_state(dir);
  test::check_close(three.named_parameters(), two.named_parameters(), 0, 0);
  // Momentum came along: the next step is the same on both.
  auto a = two.train_step(x, t);
  auto b = three.train_step(x, t);
  CHECK(a.loss == doctest::Approx(b.loss).epsilon(1e-6));
  test::check_close(three.named_parameters(), two.named_parameters(), 1e-5, 1e-7);
  fs::remove_all(root);
}

TEST_CASE("checkpoints keep the newest K and a bad state loads nothing") {
  auto root = fresh_dir("keep");
  engine sys;
  auto layers = test::tiny_mlp(5);
  pipeline pipe(sys, layers, partition_uniform(layers.size(), 2), sgd_options(1));
  checkpoint_manifest m;
  m.model = "mlp";
  for (uint64_t step = 1; step <= 4; ++step) {
    m.step = step;
    write_checkpoint(pipe, root.string(), m, 2);
  }
  CHECK_FALSE(fs::exists(root / "step-2"));
  CHECK(fs::exists(root / "step-3"));
  CHECK(find_checkpoint(root.string()) == (root / "step-4").string());

  // A model with another hidden size cannot take it, and keeps its own parameters.
  torch::manual_seed(1);
  layer_list wrong;
  wrong.emplace_back("flatten", [](const torch::Tensor& x) { return x.flatten(1); });
  wrong.emplace_back("fc1", torch::nn::AnyModule(torch::nn::Linear(16, 8)));
  wrong.emplace_back("fc3", torch::nn::AnyModule(torch::nn::Linear(8, 3)));
  pipeline other(sys, wrong, partition_uniform(3, 2), sgd_options(1));
  auto before = other.named_parameters();
  CHECK_THROWS_WITH_AS(other.load_state((root / "step-4").string()),
                       doctest::Contains("has shape [256] but stage 0 needs [8]"),
                       actorpipe::pipeline_error);
  test::check_close(other.named_parameters(), before, 0, 0);
  CHECK_THROWS_WITH_AS(find_checkpoint((root / "nothing").string()),
                       doctest::Contains("no checkpoint in"), actorpipe::invalid_argument);
  fs::remove_all(root);
}

TEST_CASE("evaluation counts top-1 and top-5 hits") {
  // A fixed "model": logits that rank class (label + k) % 10 at position k.
  layer_list layers;
  layers.emplace_back("oracle", [](const torch::Tensor& x) {
    auto label = x.select(1, 0).to(torch::kLong);
    auto logits = torch::zeros({x.size(0), 10});
    for (int64_t k = 0; k < 10; ++k) {
      logits.scatter_(1, ((label + k) % 10).unsqueeze(1), static_cast<double>(10 - k));
    }
    return logits;
  });
  engine sys;
  pipeline_options o;
  o.microbatches = 2;
  pipeline pipe(sys, layers, partition_uniform(1, 1), o);
  dataset d;
  d.images = torch::tensor({0, 1, 2, 3}, torch::kFloat).unsqueeze(1);
  // Labels: hit at rank 0, rank 3, rank 7, rank 0.
  d.labels = torch::tensor({0, 4, 9, 3}, torch::kLong);
  auto r = evaluate(pipe, d, 3);
  CHECK(r.top1 == doctest::Approx(0.5));
  CHECK(r.top5 == doctest::Approx(0.75));
}

TEST_CASE("text loads as character tokens, holds out the last tenth of every file, and cuts into "
          "next-token windows") {
  auto dir = fresh_dir("text");
  std::ofstream(dir / "a") << "abcdefghij";           // 10 bytes: 9 to train, 1 held out
  std::ofstream(dir / "b") << "0123456789abcdefghij"; // 20 bytes: 18 and 2
  std::ofstream(dir / "b.dat") << "index";            // fortune's index files are skipped
  auto corpus = load_text(dir.string());
  CHECK(corpus.alphabet == "0123456789abcdefghij");
  CHECK(corpus.vocabulary() == 20);
  CHECK(corpus.decode(corpus.train) == "abcdefghi0123456789abcdefgh");
  CHECK(corpus.decode(corpus.validation) == "jij");
  CHECK(corpus.decode(corpus.encode("j0a")) == "j0a");
  CHECK_THROWS_WITH(corpus.encode("a!"), doctest::Contains("byte 33 at offset 1 is not in the "
                                                           "alphabet"));
  auto windows = text_windows(corpus.train, 4);
  REQUIRE(windows.images.sizes() == torch::IntArrayRef({6, 4}));
  CHECK(corpus.decode(windows.images[1]) == "efgh");
  CHECK(corpus.decode(windows.labels[1]) == "fghi");
  CHECK_THROWS_WITH(text_windows(corpus.validation, 3), doctest::Contains("3 tokens hold no "
                                                                          "window of 4"));
  // Not UTF-8: named with the byte.
  std::ofstream(dir / "c", std::ios::binary) << "valid text\xff more";
  CHECK_THROWS_WITH(load_text((dir / "c").string()),
                    doctest::Contains("is not UTF-8 text (byte 10)"));
  CHECK_THROWS_WITH(load_text((dir / "none").string()),
                    doctest::Contains("is neither a file nor a folder"));
  std::ofstream(dir / "d") << "x";
  CHECK_THROWS_WITH(load_text((dir / "d").string()), doctest::Contains("too few to hold out"));
  fs::remove_all(dir);
}

TEST_CASE("a language model's evaluation is per token, in bits, and generation continues a "
          "prompt through the forward-only path") {
  // A fixed "model" over 4 tokens that always predicts the token after the current one.
  layer_list layers;
  layers.emplace_back("next", [](const torch::Tensor& ids) {
    return torch::one_hot((ids + 1) % 4, 4).to(torch::kFloat) * 100;
  });
  engine sys;
  pipeline_options o;
  o.microbatches = 2;
  pipeline pipe(sys, layers, partition_uniform(1, 1), o);
  text_corpus corpus;
  corpus.alphabet = "abcd";
  dataset d;
  d.images = corpus.encode("abcdbcda").view({2, 4});
  d.labels = corpus.encode("bcdacdab").view({2, 4});
  auto r = evaluate(pipe, d, 1);
  CHECK(r.tokens);
  CHECK(r.top1 == 1.0);
  CHECK(r.bits < 1e-6);
  d.labels = corpus.encode("bcdacdaa").view({2, 4}); // one token in 8 wrong by 100 nats
  r = evaluate(pipe, d, 2);
  CHECK(r.top1 == doctest::Approx(7.0 / 8));
  CHECK(r.bits == doctest::Approx(100.0 / 8 / std::log(2.0)).epsilon(1e-4));
  CHECK(generate_text(pipe, corpus, "ab", 6, 3, 0, 1) == "cdabcd");
  CHECK(generate_text(pipe, corpus, "d", 3, 3, 0.5, 1) == "abc"); // sharp: sampling agrees
}

TEST_CASE("synthetic token sequences count by a stride and are the same for every rank") {
  synthetic_tokens_source source(7, 5);
  auto [x, y] = source.batch(0, 3, 4, 1, 0, 1);
  REQUIRE(x.sizes() == torch::IntArrayRef({4, 5}));
  CHECK(torch::equal(x.slice(1, 1, 5), y.slice(1, 0, 4)));
  auto stride = (x.select(1, 1) - x.select(1, 0)).remainder(7);
  CHECK(torch::equal((x.select(1, 4) - x.select(1, 3)).remainder(7), stride));
  CHECK(torch::equal(y.select(1, 4), (x.select(1, 4) + stride).remainder(7)));
  auto [x1, y1] = source.batch(0, 3, 4, 1, 1, 2);
  CHECK(torch::equal(x1, x.slice(0, 2, 4)));
}
