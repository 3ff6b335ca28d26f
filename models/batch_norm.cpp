#include <actorpipe/batch_norm.hpp>

#include <torch/torch.h>

#include <actorpipe/errors.hpp>

namespace actorpipe {

DeferredBatchNorm2dImpl::DeferredBatchNorm2dImpl(const torch::nn::BatchNormOptions& o)
  : options(o) {
  reset();
}

void DeferredBatchNorm2dImpl::reset() {
  if (options.affine()) {
    weight = register_parameter("weight", torch::ones({options.num_features()}));
    bias = register_parameter("bias", torch::zeros({options.num_features()}));
  } else {
    weight = register_parameter("weight", torch::Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", torch::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", torch::zeros({options.num_features()}));
    running_var = register_buffer("running_var", torch::ones({options.num_features()}));
    num_batches_tracked = register_buffer("num_batches_tracked", torch::tensor(0, torch::kLong));
  } else {
    running_mean = register_buffer("running_mean", torch::Tensor());
    running_var = register_buffer("running_var", torch::Tensor());
    num_batches_tracked = register_buffer("num_batches_tracked", torch::Tensor());
  }
  discard();
}

namespace {

// Sums over replicas: forward all-reduces the local sums; backward all-reduces the gradient
// (each replica's weighted by its share of the step, then divided by it again, so that the
// replicas' gradient average sees the gradient of the whole batch's loss).
struct all_reduce_sums : torch::autograd::Function<all_reduce_sums> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& local,
                               const c10::intrusive_ptr<batch_norm_sync>& sync) {
    ctx->saved_data["sync"] = c10::IValue::make_capsule(sync);
    auto total = local.contiguous().clone();
    sync->all_reduce_sum(total);
    return total;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list gradients) {
    auto sync =
      c10::static_intrusive_pointer_cast<batch_norm_sync>(ctx->saved_data["sync"].toCapsule());
    double weight = sync->gradient_weight();
    auto total = (gradients[0] * weight).contiguous();
    sync->all_reduce_sum(total);
    total.div_(weight);
    return {total, torch::Tensor()};
  }
};

} // namespace

torch::Tensor DeferredBatchNorm2dImpl::synchronised(const torch::Tensor& input) {
  auto channels = input.size(1);
  auto local_count = static_cast<double>(input.numel() / std::max<int64_t>(1, channels));
  std::vector<int64_t> dims{0, 2, 3};
  auto local = torch::cat({input.sum(dims, false, torch::kDouble),
                           input.square().sum(dims, false, torch::kDouble),
                           torch::full({1}, local_count, input.options().dtype(torch::kDouble))});
  auto total = all_reduce_sums::apply(local, sync);
  auto count = total[2 * channels].item<double>();
  ACTORPIPE_CHECK(count > 0, "DeferredBatchNorm2d: no samples on any replica");
  auto mean = total.slice(0, 0, channels) / count;
  auto var = (total.slice(0, channels, 2 * channels) / count - mean.square()).clamp_min(0);
  if (options.track_running_stats() && !recomputing) {
    torch::NoGradGuard no_grad;
    auto sums = total.detach();
    if (deferred) {
      if (count_ == 0) {
        sum_ = sums.slice(0, 0, channels).clone();
        square_sum_ = sums.slice(0, channels, 2 * channels).clone();
      } else {
        sum_ += sums.slice(0, 0, channels);
        square_sum_ += sums.slice(0, channels, 2 * channels);
      }
      count_ += count;
    } else {
      auto m = mean.detach();
      auto v = var.detach();
      auto unbiased = count > 1 ? v * (count / (count - 1)) : v;
      double factor = count_update();
      running_mean.mul_(1 - factor).add_(m.to(running_mean.scalar_type()), factor);
      running_var.mul_(1 - factor).add_(unbiased.to(running_var.scalar_type()), factor);
    }
  }
  std::vector<int64_t> shape{1, channels, 1, 1};
  auto invstd = (var + options.eps()).rsqrt();
  auto y =
    (input - mean.to(input.scalar_type()).view(shape)) * invstd.to(input.scalar_type()).view(shape);
  if (options.affine()) {
    y = y * weight.view(shape) + bias.view(shape);
  }
  return y;
}

torch::Tensor DeferredBatchNorm2dImpl::forward(const torch::Tensor& input) {
  ACTORPIPE_CHECK(input.dim() == 4, "DeferredBatchNorm2d: expected a 4-D input [N, C, H, W], got ",
                  input.sizes());
  if (sync && is_training()) {
    return synchronised(input);
  }
  bool tracking = options.track_running_stats();
  if (!deferred || !is_training() || !tracking) {
    // Exactly BatchNorm2d's forward.
    double factor = is_training() && tracking ? count_update() : 0.0;
    return torch::batch_norm(input, weight, bias, running_mean, running_var,
                             is_training() || !tracking, factor, options.eps(),
                             at::globalContext().userEnabledCuDNN());
  }
  if (!recomputing) {
    torch::NoGradGuard no_grad;
    auto [var, mean] = torch::var_mean(input.detach(), {0, 2, 3}, /*unbiased=*/false);
    auto n = static_cast<double>(input.numel() / std::max<int64_t>(1, input.size(1)));
    auto s = mean.to(torch::kDouble) * n;
    auto q = (var.to(torch::kDouble) + mean.to(torch::kDouble).square()) * n;
    if (count_ == 0) {
      sum_ = s;
      square_sum_ = q;
    } else {
      sum_ += s;
      square_sum_ += q;
    }
    count_ += n;
  }
  // Normalise by this micro-batch's statistics; running statistics stay untouched.
  return torch::batch_norm(input, weight, bias, /*running_mean=*/{}, /*running_var=*/{},
                           /*training=*/true, /*momentum=*/0.0, options.eps(),
                           at::globalContext().userEnabledCuDNN());
}

void DeferredBatchNorm2dImpl::commit() {
  if (count_ == 0) {
    return;
  }
  torch::NoGradGuard no_grad;
  auto mean = sum_ / count_;
  auto var = (square_sum_ / count_ - mean.square()).clamp_min(0);
  auto unbiased = count_ > 1 ? var * (count_ / (count_ - 1)) : var;
  double factor = count_update();
  running_mean.mul_(1 - factor).add_(mean.to(running_mean.scalar_type()), factor);
  running_var.mul_(1 - factor).add_(unbiased.to(running_var.scalar_type()), factor);
  discard();
}

double DeferredBatchNorm2dImpl::count_update() {
  num_batches_tracked += 1;
  // Without a momentum, a cumulative average (as BatchNorm2d).
  return options.momentum().has_value() ? *options.momentum()
                                        : 1.0 / num_batches_tracked.item<double>();
}

void DeferredBatchNorm2dImpl::discard() {
  sum_.reset();
  square_sum_.reset();
  count_ = 0;
}

void DeferredBatchNorm2dImpl::pretty_print(std::ostream& stream) const {
  stream << "actorpipe::DeferredBatchNorm2d(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=";
  if (options.momentum().has_value()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << options.affine()
         << ", track_running_stats=" << options.track_running_stats() << ", deferred=" << deferred
         << (sync ? ", synchronised" : "") << ")";
}

namespace {

// Calls fn(layer, module) for every module inside `layers`; returns how many DeferredBatchNorm2d
// it met.
template <class Fn>
std::size_t for_each_module(const layer_list& layers, Fn fn) {
  std::size_t found = 0;
  for (const auto& l : layers) {
    if (auto m = l.module()) {
      for (auto& sub : m->modules(/*include_self=*/true)) {
        fn(l, *sub);
        found += dynamic_cast<DeferredBatchNorm2dImpl*>(sub.get()) != nullptr ? 1 : 0;
      }
    }
  }
  return found;
}

} // namespace

std::size_t set_batch_norm_sync(const layer_list& layers,
                                const c10::intrusive_ptr<batch_norm_sync>& sync) {
  return for_each_module(layers, [&](const layer&, torch::nn::Module& m) {
    if (auto* bn = dynamic_cast<DeferredBatchNorm2dImpl*>(&m)) {
      bn->sync = sync;
    }
  });
}

std::size_t set_deferred_batch_norm(const layer_list& layers, bool deferred) {
  return for_each_module(layers, [&](const layer&, torch::nn::Module& m) {
    if (auto* bn = dynamic_cast<DeferredBatchNorm2dImpl*>(&m)) {
      bn->deferred = deferred;
    }
  });
}

std::size_t count_batch_norms(const layer_list& layers) {
  return for_each_module(layers, [](const layer&, torch::nn::Module&) {});
}

std::vector<std::string> local_batch_norms(const layer_list& layers) {
  std::vector<std::string> found;
  for_each_module(layers, [&](const layer& l, torch::nn::Module& m) {
    if (dynamic_cast<DeferredBatchNorm2dImpl*>(&m) == nullptr &&
        m.name().find("BatchNorm") != std::string::npos) {
      auto type = m.name();
      if (type.size() > 4 && type.compare(type.size() - 4, 4, "Impl") == 0) {
        type.resize(type.size() - 4); // torch::nn::BatchNorm1dImpl -> torch::nn::BatchNorm1d
      }
      found.push_back(detail::concat("'", l.name(), "' (", type, ")"));
    }
  });
  return found;
}

} // namespace actorpipe
