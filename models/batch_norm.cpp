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

torch::Tensor DeferredBatchNorm2dImpl::forward(const torch::Tensor& input) {
  ACTORPIPE_CHECK(input.dim() == 4, "DeferredBatchNorm2d: expected a 4-D input [N, C, H, W], got ",
                  input.sizes());
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
         << ")";
}

std::size_t set_deferred_batch_norm(const layer_list& layers, bool deferred) {
  std::size_t found = 0;
  for (const auto& l : layers) {
    if (auto m = l.module()) {
      for (auto& sub : m->modules(/*include_self=*/true)) {
        if (auto* bn = dynamic_cast<DeferredBatchNorm2dImpl*>(sub.get())) {
          bn->deferred = deferred;
          ++found;
        }
      }
    }
  }
  return found;
}

} // namespace actorpipe
