// FLOP counting from libtorch's operator calls, and the GEMM peak the bench compares against.
#include <atomic>
#include <chrono>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include "bench/sweep.hpp"

namespace actorpipe::bench {
namespace {

std::atomic<double> counted{0};

int64_t product(c10::IntArrayRef xs, std::size_t from) {
  int64_t p = 1;
  for (auto i = from; i < xs.size(); ++i) {
    p *= xs[i];
  }
  return p;
}

// Forward FLOPs of the ops that carry nearly all of a CNN's work.
std::unique_ptr<at::ObserverContext> count_flops(const at::RecordFunction& fn) {
  std::string name = fn.name();
  auto inputs = fn.inputs();
  double flops = 0;
  if (name == "aten::convolution" && inputs.size() >= 9 && inputs[0].isTensor() &&
      inputs[1].isTensor()) {
    auto x = inputs[0].toTensor().sizes();
    auto w = inputs[1].toTensor().sizes();
    auto stride = inputs[3].toIntVector();
    auto padding = inputs[4].toIntVector();
    auto dilation = inputs[5].toIntVector();
    auto groups = inputs[8].toInt();
    double out_positions = 1;
    for (std::size_t d = 2; d < x.size(); ++d) {
      auto k = w[d];
      auto i = d - 2;
      out_positions *= static_cast<double>(
        (x[d] + 2 * padding[i % padding.size()] - dilation[i % dilation.size()] * (k - 1) - 1) /
          stride[i % stride.size()] +
        1);
    }
    // w: [C_out, C_in / groups, k...]
    flops = 2.0 * static_cast<double>(x[0]) * static_cast<double>(w[0]) * out_positions *
            static_cast<double>(product(w, 1));
    (void)groups;
  } else if ((name == "aten::addmm" && inputs.size() >= 3) ||
             (name == "aten::mm" && inputs.size() >= 2)) {
    auto a = inputs[name == "aten::addmm" ? 1 : 0].toTensor().sizes();
    auto b = inputs[name == "aten::addmm" ? 2 : 1].toTensor().sizes();
    if (a.size() == 2 && b.size() == 2) {
      flops = 2.0 * static_cast<double>(a[0] * a[1] * b[1]);
    }
  }
  if (flops > 0) {
    // C++17 has no fetch_add for atomic<double>.
    auto seen = counted.load();
    while (!counted.compare_exchange_weak(seen, seen + flops)) {
    }
  }
  return nullptr;
}

} // namespace

double training_flops(const layer_list& layers, const torch::Tensor& batch) {
  counted = 0;
  auto handle = at::addGlobalCallback(at::RecordFunctionCallback(count_flops).needsInputs(true));
  {
    torch::NoGradGuard no_grad;
    run_layers(layers, batch);
  }
  at::removeCallback(handle);
  // Backward costs about twice the forward: gradients for inputs and for weights.
  return 3 * counted.load();
}

double gemm_gflops(int threads, c10::ScalarType dtype, int64_t n) {
  auto previous = at::get_num_threads();
  at::set_num_threads(threads);
  auto a = torch::randn({n, n}).to(dtype);
  auto b = torch::randn({n, n}).to(dtype);
  auto c = torch::mm(a, b);
  double best = 1e300;
  for (int r = 0; r < 3; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    c = torch::mm(a, b);
    best =
      std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  at::set_num_threads(previous);
  return 2.0 * static_cast<double>(n * n * n) / best / 1e9;
}

} // namespace actorpipe::bench
