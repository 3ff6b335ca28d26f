#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <set>
#include <thread>

#include <doctest/doctest.h>
#include <torch/torch.h>
#include <zlib.h>

#include <actorpipe/actorpipe.hpp>
#include <actorpipe/training.hpp>

#include "../engine/oracle.hpp"
#include "training/model_setup.hpp"
#include "training/stragglers.hpp"

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

// train() on the toy data sets below: batches of 8, no progress bar.
train_options toy_options() {
  train_options o;
  o.batch = 8;
  o.model = "mlp";
  o.progress = false;
  o.warmup_steps = 1;
  o.eval_batch = 8;
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

TEST_CASE("replicas that resumed from different steps stop with both steps named, and those that "
          "agree train on and meet at the epoch's end") {
  auto root = fresh_dir("resume_agree");
  engine sys;
  torch::manual_seed(3);
  dataset train_set{torch::randn({32, 1, 4, 4}), torch::randint(3, {32})};
  dataset test_set{torch::randn({8, 1, 4, 4}), torch::randint(3, {8})};
  dataset_source data("toy", train_set, test_set);
  // Checkpoints of one run at steps 1 and 2.
  auto layers = test::tiny_mlp(5);
  pipeline writer(sys, layers, partition_uniform(layers.size(), 2), sgd_options(1));
  checkpoint_manifest m;
  m.model = "mlp";
  m.dataset = "toy";
  m.batch_size = 8;
  m.seed = 0;
  std::vector<std::string> dirs;
  for (uint64_t step : {1, 2}) {
    m.step = step;
    m.batch_in_epoch = static_cast<int64_t>(step);
    dirs.push_back(write_checkpoint(writer, (root / std::to_string(step)).string(), m, 1));
  }
  replicated_pipeline replicas(
    sys, [] { return test::tiny_mlp(1); }, partition_uniform(6, 2), sgd_options(1), 2);
  auto run = [&](const std::string& dir0, const std::string& dir1) {
    std::vector<std::future<train_report>> ranks;
    for (int64_t r = 0; r < 2; ++r) {
      auto o = toy_options();
      o.rank = r;
      o.replicas = 2;
      o.resume = r == 0 ? dir0 : dir1;
      ranks.push_back(
        std::async(std::launch::async, [&, r, o] { return train(replicas.replica(r), data, o); }));
    }
    std::vector<std::string> errors;
    std::vector<train_report> reports;
    for (auto& f : ranks) {
      try {
        reports.push_back(f.get());
      } catch (const pipeline_error& e) {
        errors.emplace_back(e.what());
      }
    }
    return std::make_pair(errors, reports);
  };
  auto [errors, none] = run(dirs[0], dirs[1]);
  REQUIRE(errors.size() == 2);
  for (const auto& e : errors) {
    INFO(e);
    CHECK(e.find("the ranks disagree on the step to resume from (rank 0: 1, rank 1: 2)") !=
          std::string::npos);
  }
  auto [ok, reports] = run(dirs[1], dirs[1]);
  REQUIRE(ok.empty());
  REQUIRE(reports.size() == 2);
  for (const auto& report : reports) {
    // 32 samples in batches of 8: steps 3 and 4 remain after step 2.
    REQUIRE(report.steps.size() == 2);
    CHECK(report.steps.front().first == 3);
    CHECK(report.epochs.size() == 1);
  }
  test::check_close(replicas.replica(0).named_parameters(), replicas.replica(1).named_parameters(),
                    0, 0);
  fs::remove_all(root);
}

TEST_CASE("train() feeds replicas in this process from one loop: the losses and parameters of one "
          "pipeline on the whole batch, and per-process options refused") {
  engine sys;
  torch::manual_seed(4);
  dataset train_set{torch::randn({32, 1, 4, 4}), torch::randint(3, {32})};
  dataset test_set{torch::randn({8, 1, 4, 4}), torch::randint(3, {8})};
  dataset_source data("toy", train_set, test_set);
  auto o = toy_options();
  pipeline one(sys, test::tiny_mlp(1), partition_uniform(6, 2), sgd_options(2));
  auto expected = train(one, data, o);
  replicated_pipeline replicas(
    sys, [] { return test::tiny_mlp(1); }, partition_uniform(6, 2), sgd_options(2), 2);
  auto got = train(replicas, data, o);
  REQUIRE(got.steps.size() == expected.steps.size());
  REQUIRE(got.steps.size() == 4);
  for (std::size_t i = 0; i < got.steps.size(); ++i) {
    CAPTURE(i);
    CHECK(got.steps[i].first == expected.steps[i].first);
    CHECK(got.steps[i].second == doctest::Approx(expected.steps[i].second).epsilon(1e-6));
  }
  REQUIRE(got.epochs.size() == 1);
  CHECK(got.epochs[0].test.loss == doctest::Approx(expected.epochs[0].test.loss).epsilon(1e-5));
  for (std::size_t r = 0; r < 2; ++r) {
    test::check_close(replicas.replica(r).named_parameters(), one.named_parameters());
  }
  auto per_process = o;
  per_process.replicas = 2;
  CHECK_THROWS_WITH_AS(train(replicas, data, per_process),
                       doctest::Contains("take each batch whole"), invalid_argument);
  auto cut_anew = o;
  cut_anew.repartition = [](std::size_t parts) { return partition_uniform(6, parts); };
  CHECK_THROWS_WITH_AS(train(replicas, data, cut_anew), doctest::Contains("keep their cut"),
                       invalid_argument);
}

TEST_CASE("train() with overlap_steps submits each step behind the running one: stages start "
          "steps early, the losses and parameters are those without, replicas refuse it") {
  engine sys;
  torch::manual_seed(5);
  dataset train_set{torch::randn({64, 1, 4, 4}), torch::randint(3, {64})};
  dataset test_set{torch::randn({8, 1, 4, 4}), torch::randint(3, {8})};
  dataset_source data("toy", train_set, test_set);
  auto o = toy_options();
  o.epochs = 2;
  o.keep_results = true;
  pipeline plain(sys, test::tiny_mlp(1), partition_uniform(6, 3), sgd_options(2));
  auto expected = train(plain, data, o);
  auto options = sgd_options(2);
  options.overlap_steps = true;
  pipeline overlapping(sys, test::tiny_mlp(1), partition_uniform(6, 3), options);
  auto overlapped = o;
  overlapped.overlap_steps = true;
  auto got = train(overlapping, data, overlapped);
  REQUIRE(got.steps.size() == 16);
  CHECK(got.steps == expected.steps);
  test::check_close(overlapping.named_parameters(), plain.named_parameters(), 0, 0);
  // Every step but each epoch's first started on some stage before the one before was
  // confirmed (the last of an epoch runs alone: the first of the next does not overlap it).
  std::size_t overlapping_steps = 0;
  for (const auto& r : got.results) {
    overlapping_steps += std::any_of(r.stages.begin(), r.stages.end(),
                                     [](const stage_stats& st) { return st.overlapped; });
  }
  CHECK(overlapping_steps >= 7);
  for (const auto& r : expected.results) {
    for (const auto& st : r.stages) {
      CHECK(!st.overlapped);
    }
  }
  replicated_pipeline replicas(
    sys, [] { return test::tiny_mlp(1); }, partition_uniform(6, 2), sgd_options(2), 2);
  CHECK_THROWS_WITH_AS(train(replicas, data, overlapped),
                       doctest::Contains("train_options::overlap_steps is for one pipeline"),
                       invalid_argument);
}

namespace {

// A data set's batches through a source that says whether train() may ask ahead, and that
// records where and in which order it is asked, and whether two asks ever met.
class recording_source : public batch_source {
public:
  recording_source(const dataset_source& data, bool ahead) : data_(data), ahead_(ahead) {}
  std::string name() const override { return data_.name(); }
  int64_t epoch_samples() const override { return data_.epoch_samples(); }
  bool prefetch() const override { return ahead_; }
  std::pair<torch::Tensor, torch::Tensor> batch(int64_t epoch, int64_t index, int64_t batch,
                                                uint64_t seed, int64_t rank,
                                                int64_t replicas) const override {
    CHECK(inside_.fetch_add(1) == 0);                          // never two at once
    std::this_thread::sleep_for(std::chrono::milliseconds(5)); // long enough to meet another
    {
      std::lock_guard<std::mutex> guard(mutex_);
      asked_.emplace_back(epoch, index);
      away_ += std::this_thread::get_id() != loop_;
    }
    auto result = data_.batch(epoch, index, batch, seed, rank, replicas);
    inside_.fetch_sub(1);
    return result;
  }
  std::optional<eval_result> evaluate(pipeline& pipe, int64_t batch) const override {
    CHECK(inside_.load() == 0); // nothing asked ahead runs beside an evaluation
    return data_.evaluate(pipe, batch);
  }
  std::vector<std::pair<int64_t, int64_t>> asked() const {
    std::lock_guard<std::mutex> guard(mutex_);
    return asked_;
  }
  int away() const { return away_; }

private:
  const dataset_source& data_;
  bool ahead_;
  std::thread::id loop_ = std::this_thread::get_id();
  mutable std::atomic<int> inside_{0};
  mutable std::mutex mutex_;
  mutable std::vector<std::pair<int64_t, int64_t>> asked_;
  mutable int away_ = 0;
};

} // namespace

TEST_CASE("train() asks a source that allows it for the next batch while a step runs, one ask "
          "at a time, in order, each batch once: the same losses and parameters as without") {
  engine sys;
  torch::manual_seed(6);
  dataset train_set{torch::randn({48, 1, 4, 4}), torch::randint(3, {48})};
  dataset test_set{torch::randn({8, 1, 4, 4}), torch::randint(3, {8})};
  dataset_source data("toy", train_set, test_set);
  auto o = toy_options();
  o.epochs = 2;
  CHECK(data.prefetch()); // the built-in sources allow it
  recording_source in_turn(data, false), ahead(data, true);
  pipeline plain(sys, test::tiny_mlp(1), partition_uniform(6, 2), sgd_options(2));
  auto expected = train(plain, in_turn, o);
  pipeline prefetched(sys, test::tiny_mlp(1), partition_uniform(6, 2), sgd_options(2));
  auto got = train(prefetched, ahead, o);
  REQUIRE(got.steps.size() == 12);
  CHECK(got.steps == expected.steps);
  test::check_close(prefetched.named_parameters(), plain.named_parameters(), 0, 0);
  REQUIRE(got.epochs.size() == 2);
  CHECK(got.epochs[1].test.loss == expected.epochs[1].test.loss);
  // Each batch once, in order; all but each epoch's first made on another thread.
  CHECK(ahead.asked() == in_turn.asked());
  CHECK(ahead.asked().size() == 12);
  CHECK(in_turn.away() == 0);
  CHECK(ahead.away() == 10);
  // A run that stops early asks for nothing past its last step.
  recording_source stopping(data, true);
  auto three = o;
  three.max_steps = 3;
  pipeline short_run(sys, test::tiny_mlp(1), partition_uniform(6, 2), sgd_options(2));
  train(short_run, stopping, three);
  CHECK(stopping.asked().size() == 3);
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

TEST_CASE("augmentation crops a padded image at a random offset and mirrors about half, "
          "drawn from the seed alone") {
  // 64 distinct 1x6x6 images whose darkest value is -1 (the padding).
  auto images = torch::rand({64, 1, 6, 6}) + torch::arange(64).view({64, 1, 1, 1});
  images.select(2, 0).select(2, 0).fill_(-1);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);

  SUBCASE("nothing asked, nothing changed (a copy)") {
    auto out = augment_images(images, image_augmentation{}, gen);
    CHECK(torch::equal(out, images));
    CHECK_FALSE(out.is_same(images));
  }
  SUBCASE("flip alone gives each image or its mirror, both occurring") {
    auto out = augment_images(images, image_augmentation{0, true}, gen);
    int64_t mirrored = 0;
    for (int64_t i = 0; i < 64; ++i) {
      bool same = torch::equal(out[i], images[i]);
      bool mirror = torch::equal(out[i], images[i].flip({2}));
      CHECK((same || mirror));
      mirrored += mirror ? 1 : 0;
    }
    CHECK(mirrored > 16);
    CHECK(mirrored < 48);
  }
  SUBCASE("pad 2: every image is a 6x6 window of itself padded with -1, at varied offsets") {
    auto out = augment_images(images, image_augmentation{2, false}, gen);
    CHECK(out.sizes() == images.sizes());
    auto padded = torch::constant_pad_nd(images, {2, 2, 2, 2}, -1);
    std::set<std::pair<int64_t, int64_t>> offsets;
    for (int64_t i = 0; i < 64; ++i) {
      bool found = false;
      for (int64_t dy = 0; dy <= 4 && !found; ++dy) {
        for (int64_t dx = 0; dx <= 4 && !found; ++dx) {
          if (torch::equal(out[i], padded[i].slice(1, dy, dy + 6).slice(2, dx, dx + 6))) {
            offsets.insert({dy, dx});
            found = true;
          }
        }
      }
      CHECK(found);
    }
    CHECK(offsets.size() > 10);
  }
  SUBCASE("the same generator seed gives the same batch, another seed another") {
    image_augmentation a{2, true};
    auto g1 = at::make_generator<at::CPUGeneratorImpl>(9);
    auto g2 = at::make_generator<at::CPUGeneratorImpl>(9);
    auto g3 = at::make_generator<at::CPUGeneratorImpl>(10);
    auto x = augment_images(images, a, g1);
    CHECK(torch::equal(x, augment_images(images, a, g2)));
    CHECK_FALSE(torch::equal(x, augment_images(images, a, g3)));
  }
  SUBCASE("bad input is refused") {
    CHECK_THROWS_WITH_AS(augment_images(images.flatten(1), image_augmentation{2, false}, gen),
                         doctest::Contains("images must be [N, C, H, W], not [64, 36]"),
                         actorpipe::invalid_argument);
    CHECK_THROWS_WITH_AS(augment_images(images, image_augmentation{-1, false}, gen),
                         doctest::Contains("pad (-1) must be >= 0"), actorpipe::invalid_argument);
  }
}

TEST_CASE("an augmented data set gives the same batch for the same seed, epoch, index and rank") {
  dataset train;
  train.images = torch::rand({32, 1, 8, 8});
  train.labels = torch::arange(32) % 10;
  dataset_source plain("toy", train, train);
  dataset_source augmented("toy", train, train);
  augmented.set_augmentation(image_augmentation{2, true});
  auto [x, y] = augmented.batch(1, 2, 8, 3, 0, 1);
  auto [px, py] = plain.batch(1, 2, 8, 3, 0, 1);
  CHECK(torch::equal(y, py)); // the same samples, in the same order
  CHECK_FALSE(torch::equal(x, px));
  dataset_source again("toy", train, train);
  again.set_augmentation(image_augmentation{2, true});
  again.batch(0, 0, 8, 3, 0, 1); // another epoch first: draws do not depend on history
  CHECK(torch::equal(again.batch(1, 2, 8, 3, 0, 1).first, x));
  CHECK_FALSE(torch::equal(again.batch(1, 3, 8, 3, 0, 1).first, x));
  CHECK_FALSE(torch::equal(again.batch(1, 2, 8, 4, 0, 1).first, x));

  dataset flat;
  flat.images = torch::rand({4, 5});
  flat.labels = torch::zeros({4}, torch::kLong);
  dataset_source vectors("vectors", flat, flat);
  CHECK_THROWS_WITH_AS(vectors.set_augmentation(image_augmentation{0, true}),
                       doctest::Contains("vectors: only images [N, C, H, W] can be augmented"),
                       actorpipe::invalid_argument);
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

TEST_CASE("the default optimizer is one rule for train and plan: Adam for the gpt, SGD with "
          "momentum 0.9, plain SGD on streams") {
  training::model_args a;
  a.data = "text";
  auto gpt = training::default_optimizer_for(a);
  CHECK(gpt.adam);
  CHECK(gpt.state_tensors() == 2.0);
  a.data = "fashion-mnist";
  auto cnn = training::default_optimizer_for(a);
  CHECK(!cnn.adam);
  CHECK(cnn.momentum == 0.9);
  CHECK(cnn.state_tensors() == 1.0);
  for (const char* stream : {"synthetic", "tensors:/tmp/x.pt"}) {
    CAPTURE(stream);
    a.data = stream;
    auto sgd = training::default_optimizer_for(a);
    CHECK(!sgd.adam);
    CHECK(sgd.momentum == 0.0);
    CHECK(sgd.state_tensors() == 0.0);
  }
  a.data = "synthetic";
  a.model = "gpt";
  CHECK(training::default_optimizer_for(a).state_tensors() == 2.0);
}

namespace {

// Steps of two stages' figures: stage k's forward and backward take ms[k] in all.
std::vector<actorpipe::stage_stats> two_stages(double first, double second) {
  std::vector<actorpipe::stage_stats> s(2);
  s[0].stage = 0;
  s[0].forward_ms = first / 2;
  s[0].backward_ms = first / 2;
  s[1].stage = 1;
  s[1].forward_ms = second / 2;
  s[1].backward_ms = second / 2;
  return s;
}

} // namespace

TEST_CASE("a stage twice as slow as over its first steps is named once, within the steps its "
          "median needs, and again after it was fast again") {
  actorpipe::training::straggler_watch watch(2.0);
  uint64_t step = 0;
  auto observe = [&](double first, double second) {
    return watch.observe(++step, two_stages(first, second));
  };
  CHECK(observe(500, 500).empty()); // the first step warms up: not a usual time
  for (int k = 0; k < 5; ++k) {
    CHECK(observe(10, 10).empty()); // usual: 10 ms each
  }
  CHECK(watch.usual_ms() == std::vector<double>{10, 10});
  for (int k = 0; k < 5; ++k) {
    CHECK(observe(10, 11).empty()); // a little slower: not named
  }
  // Stage 1 becomes 2.5x slower: named at the third such step (the median of the last 5 turns).
  CHECK(observe(10, 25).empty());
  CHECK(observe(10, 25).empty());
  auto found = observe(10, 25);
  REQUIRE(found.size() == 1);
  CHECK(found[0].stage == 1);
  CHECK(found[0].step == 14);
  CHECK(found[0].usual_ms == doctest::Approx(10));
  CHECK(found[0].recent_ms == doctest::Approx(25));
  for (int k = 0; k < 5; ++k) {
    CHECK(observe(10, 25).empty()); // once
  }
  for (int k = 0; k < 5; ++k) {
    CHECK(observe(10, 10).empty()); // fast again
  }
  bool again = false;
  for (int k = 0; k < 5; ++k) {
    again = again || !observe(10, 30).empty();
  }
  CHECK(again);
  actorpipe::training::straggler_watch off(0);
  for (int k = 0; k < 20; ++k) {
    CHECK(off.observe(static_cast<uint64_t>(k), two_stages(10, k < 10 ? 10 : 100)).empty());
  }
}

TEST_CASE("a cut for measured speeds gives a slow node fewer layers, so that the slowest stage "
          "is as fast as it can be") {
  using actorpipe::partition;
  using actorpipe::training::cut_for_speeds;
  // 6 layers of 10 ms in two stages; stage 1's node twice as slow: 4 + 2 layers (40 ms each).
  auto cut = cut_for_speeds(partition{{0, 3, 6}}, {30, 30}, {1, 2}, std::vector<double>(6, 0.0));
  CHECK(cut.bounds == std::vector<std::size_t>{0, 4, 6});
  // Nothing slower: the cut stays.
  CHECK(
    cut_for_speeds(partition{{0, 3, 6}}, {30, 30}, {1, 1}, std::vector<double>(6, 0.0)).bounds ==
    std::vector<std::size_t>{0, 3, 6});
  // Weights share a stage's time: layer 1 is 80% of stage 0's 50 ms (40 ms); stage 0's node 3x
  // slow: layers 0-1 cost 150 there, so layer 1 moves to stage 1 (3 x 10 = 30 against 60).
  cut = cut_for_speeds(partition{{0, 2, 4}}, {50, 20}, {3, 1}, {1, 4, 1, 1});
  CHECK(cut.bounds == std::vector<std::size_t>{0, 1, 4});
  // Three stages: every stage keeps a layer, whatever the speeds.
  cut =
    cut_for_speeds(partition{{0, 1, 2, 3}}, {10, 10, 10}, {100, 1, 1}, std::vector<double>(3, 0.0));
  CHECK(cut.bounds == std::vector<std::size_t>{0, 1, 2, 3});
  CHECK_THROWS_AS(cut_for_speeds(partition{{0, 3, 6}}, {30}, {1, 2}, std::vector<double>(6, 0.0)),
                  actorpipe::invalid_argument);
}
