#include "stages/precision.hpp"

#include <fstream>
#include <mutex>
#include <sstream>

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/group_norm.h>
#include <ATen/ops/layer_norm.h>
#include <actorpipe/torch_compat.hpp>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace actorpipe::stages {
namespace {

// layer_norm and group_norm under CPU autocast: inputs and affine parameters in float32, the
// output float32 (the next matrix product casts it back to bf16).
at::Tensor layer_norm_fp32(const at::Tensor& input, at::IntArrayRef shape,
                           const c10::optional<at::Tensor>& weight,
                           const c10::optional<at::Tensor>& bias, double eps, bool cudnn) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  using at::autocast::cached_cast;
  return at::layer_norm(cached_cast(at::kFloat, input, c10::DeviceType::CPU), shape,
                        cached_cast(at::kFloat, weight, c10::DeviceType::CPU),
                        cached_cast(at::kFloat, bias, c10::DeviceType::CPU), eps, cudnn);
}

at::Tensor group_norm_fp32(const at::Tensor& input, int64_t groups,
                           const c10::optional<at::Tensor>& weight,
                           const c10::optional<at::Tensor>& bias, double eps, bool cudnn) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  using at::autocast::cached_cast;
  return at::group_norm(cached_cast(at::kFloat, input, c10::DeviceType::CPU), groups,
                        cached_cast(at::kFloat, weight, c10::DeviceType::CPU),
                        cached_cast(at::kFloat, bias, c10::DeviceType::CPU), eps, cudnn);
}

// Registered on first use rather than at static initialisation, so that linking actorpipe
// changes nothing for a program that never asks for bf16.
void register_fp32_norms() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Later libtorch lines list them in CPU autocast's float32 ops already.
    auto op = c10::Dispatcher::singleton().findSchema({"aten::layer_norm", ""});
    if (op && op->hasKernelForDispatchKey(c10::DispatchKey::AutocastCPU)) {
      return;
    }
    static auto* library = new torch::Library(torch::Library::IMPL, "aten",
                                              c10::DispatchKey::AutocastCPU, __FILE__, __LINE__);
    library->impl("layer_norm", TORCH_FN(layer_norm_fp32));
    library->impl("group_norm", TORCH_FN(group_norm_fp32));
  });
}

} // namespace

autocast_scope::autocast_scope(precision_mode mode, c10::DeviceType device)
  : device_(device == c10::DeviceType::CUDA ? device : c10::DeviceType::CPU),
    was_enabled_(compat::autocast_enabled(device_)), was_dtype_(compat::autocast_dtype(device_)),
    enabled_(mode == precision_mode::bf16) {
  if (enabled_) {
    if (device_ == c10::DeviceType::CPU) {
      register_fp32_norms();
    }
    compat::set_autocast_dtype(device_, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  compat::set_autocast_enabled(device_, enabled_);
}

autocast_scope::~autocast_scope() {
  if (enabled_ && at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  compat::set_autocast_enabled(device_, was_enabled_);
  compat::set_autocast_dtype(device_, was_dtype_);
}

at::Tensor boundary_cast(const at::Tensor& t, precision_mode mode, bool last) {
  if (mode != precision_mode::bf16 || !t.defined()) {
    return t;
  }
  if (last) {
    return t.scalar_type() == at::kBFloat16 ? t.to(at::kFloat) : t;
  }
  return t.scalar_type() == at::kFloat ? t.to(at::kBFloat16) : t;
}

namespace {

// The value of the first /proc/cpuinfo line whose key is `key` ("" when there is none).
std::string cpuinfo(const std::string& key) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    auto colon = line.find(':');
    if (colon != std::string::npos && line.rfind(key, 0) == 0) {
      auto value = line.find_first_not_of(" \t", colon + 1);
      return value == std::string::npos ? std::string{} : line.substr(value);
    }
  }
  return {};
}

} // namespace

bool cpu_has_native_bf16() {
  static const bool native = [] {
    std::istringstream flags(cpuinfo("flags"));
    std::string flag;
    while (flags >> flag) {
      if (flag == "avx512_bf16" || flag == "amx_bf16") {
        return true;
      }
    }
    return false;
  }();
  return native;
}

std::string precision_warning(precision_mode mode) {
  if (mode != precision_mode::bf16 || cpu_has_native_bf16()) {
    return {};
  }
  auto model = cpuinfo("model name");
  return "bf16 requested, but " + (model.empty() ? std::string("this CPU") : model) +
         " has no bf16 instructions (avx512_bf16 or amx_bf16): libtorch emulates them, and "
         "bf16 matrix products run several times slower than fp32 here (BENCHMARKS.md)";
}

} // namespace actorpipe::stages
