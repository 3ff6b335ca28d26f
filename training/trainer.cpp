#include <actorpipe/training.hpp>

#include <algorithm>
#include <cmath>

#include <torch/torch.h>

namespace actorpipe {
namespace {

constexpr double pi = 3.14159265358979323846;

} // namespace

double cosine_schedule::at(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps) {
    return base_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  }
  auto span = std::max<int64_t>(1, total_steps - warmup_steps);
  auto progress =
    std::min(1.0, static_cast<double>(step - warmup_steps) / static_cast<double>(span));
  return min_lr + 0.5 * (base_lr - min_lr) * (1 + std::cos(pi * progress));
}

eval_result evaluate(pipeline& pipe, const dataset& data, int64_t batch) {
  ACTORPIPE_CHECK(batch >= 1, "evaluation batch (", batch, ") must be >= 1");
  eval_result r;
  int64_t n = data.size();
  if (n == 0) {
    return r;
  }
  double loss_sum = 0;
  int64_t top1 = 0;
  int64_t top5 = 0;
  int64_t count = 0;
  for (int64_t begin = 0; begin < n; begin += batch) {
    auto end = std::min(n, begin + batch);
    auto x = data.images.slice(0, begin, end);
    auto y = data.labels.slice(0, begin, end);
    auto logits = pipe.forward(x);
    if (logits.dim() == 3) {
      // A language model: every position predicts its next token.
      r.tokens = true;
      logits = logits.flatten(0, 1);
      y = y.flatten();
    }
    count += y.size(0);
    loss_sum +=
      torch::nn::functional::cross_entropy(
        logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
        .item<double>();
    auto k = std::min<int64_t>(5, logits.size(1));
    auto best = std::get<1>(logits.topk(k, 1));
    auto hits = best.eq(y.unsqueeze(1));
    top1 += hits.select(1, 0).sum().item<int64_t>();
    top5 += hits.any(1).sum().item<int64_t>();
  }
  r.loss = loss_sum / static_cast<double>(count);
  r.top1 = static_cast<double>(top1) / static_cast<double>(count);
  r.top5 = static_cast<double>(top5) / static_cast<double>(count);
  r.bits = r.loss / std::log(2.0);
  return r;
}

eval_result evaluate(pipeline& pipe, const dataset& data, int64_t batch,
                     const loss_function& loss) {
  ACTORPIPE_CHECK(batch >= 1, "evaluation batch (", batch, ") must be >= 1");
  eval_result r;
  r.classes = false;
  double sum = 0;
  for (int64_t begin = 0; begin < data.size(); begin += batch) {
    auto end = std::min(data.size(), begin + batch);
    auto out = pipe.forward(data.images.slice(0, begin, end));
    sum +=
      loss(out, data.labels.slice(0, begin, end)).item<double>() * static_cast<double>(end - begin);
  }
  r.loss = data.size() > 0 ? sum / static_cast<double>(data.size()) : 0;
  r.bits = r.loss / std::log(2.0);
  return r;
}

std::pair<dataset, dataset> hold_out(const dataset& data, double fraction, uint64_t seed) {
  ACTORPIPE_CHECK(fraction >= 0 && fraction < 1, "the fraction held out (", fraction,
                  ") must be in [0, 1)");
  const auto n = data.size();
  auto held = fraction > 0 ? std::max<int64_t>(1, std::llround(fraction * static_cast<double>(n)))
                           : int64_t{0};
  ACTORPIPE_CHECK(held < n, "holding out ", fraction, " of ", n,
                  " samples leaves none to train on");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ULL + 977);
  auto order = torch::randperm(n, gen, torch::kLong);
  auto kept = std::get<0>(order.slice(0, 0, n - held).sort());
  auto out = std::get<0>(order.slice(0, n - held, n).sort());
  auto part = [&](const torch::Tensor& rows) {
    return dataset{data.images.index_select(0, rows), data.labels.index_select(0, rows)};
  };
  return {part(kept), part(out)};
}

torch::Tensor augment_images(const torch::Tensor& images, const image_augmentation& a,
                             at::Generator& generator) {
  ACTORPIPE_CHECK(images.dim() == 4, "augment_images: images must be [N, C, H, W], not ",
                  images.sizes());
  ACTORPIPE_CHECK(a.pad >= 0, "augment_images: pad (", a.pad, ") must be >= 0");
  const auto n = images.size(0);
  const auto h = images.size(2);
  const auto w = images.size(3);
  auto out = images;
  if (a.pad > 0) {
    const auto p = a.pad;
    // Each image padded with its own darkest value (Fashion-MNIST's background), then cropped.
    auto floor = images.amin({1, 2, 3}, true);
    auto padded = floor.expand({n, images.size(1), h + 2 * p, w + 2 * p}).clone();
    padded.slice(2, p, p + h).slice(3, p, p + w).copy_(images);
    auto offsets = torch::randint(2 * p + 1, {n, 2}, generator, torch::kLong);
    auto o = offsets.accessor<int64_t, 2>();
    out = torch::empty_like(images);
    for (int64_t i = 0; i < n; ++i) {
      out[i].copy_(padded[i].slice(1, o[i][0], o[i][0] + h).slice(2, o[i][1], o[i][1] + w));
    }
  }
  if (a.flip) {
    auto mirror = torch::rand({n}, generator).lt(0.5).view({n, 1, 1, 1});
    out = torch::where(mirror, out.flip({3}), out);
  }
  return out.is_same(images) ? images.clone() : out;
}

dataset_source::dataset_source(std::string name, dataset train, dataset test)
  : name_(std::move(name)), train_(std::move(train)), test_(std::move(test)) {}

void dataset_source::set_augmentation(image_augmentation augmentation) {
  ACTORPIPE_CHECK(augmentation.pad >= 0, name_, ": augmentation pad (", augmentation.pad,
                  ") must be >= 0");
  ACTORPIPE_CHECK(!augmentation.any() || train_.images.dim() == 4, name_,
                  ": only images [N, C, H, W] can be augmented, not ", train_.images.sizes());
  augmentation_ = augmentation;
}

std::pair<torch::Tensor, torch::Tensor> dataset_source::batch(int64_t epoch, int64_t index,
                                                              int64_t batch, uint64_t seed,
                                                              int64_t rank,
                                                              int64_t replicas) const {
  // The order of an epoch is drawn once and reused for its batches.
  if (order_epoch_ != epoch || !order_.defined()) {
    const auto n = train_.size();
    if (shuffle_) {
      order_ = replicas == 1 ? epoch_order(n, seed, epoch)
                             : distributed_order(n, seed, epoch, rank, replicas);
    } else {
      auto padded = (n + replicas - 1) / replicas * replicas;
      order_ = torch::arange(padded, torch::kLong).remainder(n).slice(0, rank, padded, replicas);
    }
    order_epoch_ = epoch;
  }
  auto local = batch / replicas;
  auto index_range = order_.slice(0, index * local, (index + 1) * local);
  auto x = train_.images.index_select(0, index_range);
  if (augmentation_.any()) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(
      ((seed * 1000003ULL + static_cast<uint64_t>(epoch)) * 1000003ULL +
       static_cast<uint64_t>(index)) *
        1009ULL +
      static_cast<uint64_t>(rank) + 7);
    x = augment_images(x, augmentation_, gen);
  }
  return {x, train_.labels.index_select(0, index_range)};
}

void dataset_source::set_shuffle(bool shuffle) {
  shuffle_ = shuffle;
  order_ = torch::Tensor();
}

void dataset_source::set_evaluation_loss(loss_function loss) {
  loss_ = std::move(loss);
}

std::optional<eval_result> dataset_source::evaluate(pipeline& pipe, int64_t batch) const {
  if (test_.size() == 0) {
    return std::nullopt;
  }
  bool classes = !at::isFloatingType(test_.labels.scalar_type());
  if (!classes && loss_) {
    return actorpipe::evaluate(pipe, test_, batch, loss_);
  }
  return actorpipe::evaluate(pipe, test_, batch);
}

namespace {

// A stream's batch `index` is drawn from a generator of its own, seeded by (seed, index) alone.
at::Generator step_generator(uint64_t seed, int64_t index) {
  return at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ULL + static_cast<uint64_t>(index) +
                                                  1);
}

// Every rank draws the whole batch and takes its part.
std::pair<torch::Tensor, torch::Tensor> rank_part(torch::Tensor x, torch::Tensor y, int64_t rank,
                                                  int64_t replicas) {
  if (replicas > 1) {
    x = torch::tensor_split(x, replicas, 0).at(static_cast<std::size_t>(rank));
    y = torch::tensor_split(y, replicas, 0).at(static_cast<std::size_t>(rank));
  }
  return {x, y};
}

} // namespace

synthetic_source::synthetic_source(int64_t channels, int64_t side, int64_t classes)
  : channels_(channels), side_(side), classes_(classes) {
  ACTORPIPE_CHECK(channels >= 1 && side >= 1 && classes >= 1, "synthetic data: channels (",
                  channels, "), side (", side, ") and classes (", classes, ") must be >= 1");
}

std::pair<torch::Tensor, torch::Tensor> synthetic_source::batch(int64_t, int64_t index,
                                                                int64_t batch, uint64_t seed,
                                                                int64_t rank,
                                                                int64_t replicas) const {
  auto gen = step_generator(seed, index);
  auto x = torch::randn({batch, channels_, side_, side_}, gen, torch::TensorOptions());
  auto labels = torch::randint(classes_, {batch}, gen, torch::kLong);
  auto y = torch::nn::functional::one_hot(labels, classes_).to(torch::kFloat);
  return rank_part(x, y, rank, replicas);
}

tensor_file_source::tensor_file_source(std::string path, dataset data, bool shuffle)
  : path_(std::move(path)), data_(std::move(data)), shuffle_(shuffle) {
  ACTORPIPE_CHECK(data_.size() > 0, "tensors:", path_, " holds no samples");
}

std::pair<torch::Tensor, torch::Tensor> tensor_file_source::batch(int64_t, int64_t index,
                                                                  int64_t batch, uint64_t seed,
                                                                  int64_t rank,
                                                                  int64_t replicas) const {
  const auto n = data_.size();
  auto positions = torch::arange(index * batch, (index + 1) * batch, torch::kLong);
  auto rows = positions.remainder(n);
  if (shuffle_) {
    // Each pass over the file in its own order; a batch may straddle two passes.
    auto passes = positions.div(n, "floor");
    const int64_t first = index * batch / n;
    const int64_t last = ((index + 1) * batch - 1) / n;
    for (int64_t pass = first; pass <= last; ++pass) {
      auto mask = passes.eq(pass);
      rows.masked_scatter_(mask, epoch_order(n, seed, pass).index({rows.masked_select(mask)}));
    }
  }
  return rank_part(data_.images.index({rows}), data_.labels.index({rows}), rank, replicas);
}

synthetic_tokens_source::synthetic_tokens_source(int64_t vocabulary, int64_t context)
  : vocabulary_(vocabulary), context_(context) {
  ACTORPIPE_CHECK(vocabulary >= 2 && context >= 1, "synthetic tokens: vocabulary (", vocabulary,
                  ") must be >= 2 and context (", context, ") >= 1");
}

std::pair<torch::Tensor, torch::Tensor> synthetic_tokens_source::batch(int64_t, int64_t index,
                                                                       int64_t batch, uint64_t seed,
                                                                       int64_t rank,
                                                                       int64_t replicas) const {
  auto gen = step_generator(seed, index);
  auto start = torch::randint(vocabulary_, {batch, 1}, gen, torch::kLong);
  auto stride = torch::randint(1, vocabulary_, {batch, 1}, gen, torch::kLong);
  auto positions = torch::arange(context_ + 1, torch::kLong).unsqueeze(0);
  auto sequence = (start + stride * positions).remainder(vocabulary_);
  return rank_part(sequence.slice(1, 0, context_).contiguous(),
                   sequence.slice(1, 1, context_ + 1).contiguous(), rank, replicas);
}

std::string generate_text(pipeline& pipe, const text_corpus& corpus, const std::string& prompt,
                          int64_t length, int64_t context, double temperature, uint64_t seed) {
  ACTORPIPE_CHECK(!prompt.empty(), "generate_text: the prompt is empty");
  ACTORPIPE_CHECK(length >= 0 && context >= 1 && temperature >= 0, "generate_text: length (",
                  length, ") and temperature (", temperature, ") must be >= 0, context (", context,
                  ") >= 1");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto ids = corpus.encode(prompt);
  std::vector<int64_t> tokens(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < length; ++i) {
    auto first = static_cast<int64_t>(tokens.size()) - std::min<int64_t>(context, tokens.size());
    auto window =
      torch::tensor(std::vector<int64_t>(tokens.begin() + first, tokens.end()), torch::kLong)
        .unsqueeze(0);
    auto logits = pipe.forward(window).select(0, 0).select(0, -1).to(torch::kFloat);
    int64_t next = 0;
    if (temperature == 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      auto p = (logits / temperature).softmax(0);
      next = torch::multinomial(p, 1, false, gen).item<int64_t>();
    }
    tokens.push_back(next);
  }
  auto all = torch::tensor(tokens, torch::kLong);
  return corpus.decode(all.slice(0, static_cast<int64_t>(ids.numel())));
}

train_report train_classifier(pipeline& pipe, const dataset& train_set, const dataset& test_set,
                              const train_options& options) {
  return train(pipe, dataset_source(options.dataset, train_set, test_set), options);
}

} // namespace actorpipe
