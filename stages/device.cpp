#include "stages/device.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>

#include <mutex>

#include <actorpipe/errors.hpp>

namespace actorpipe::stages {
namespace {

std::mutex override_mutex;
device_override::factory& overriding() {
  static device_override::factory make;
  return make;
}

class cpu_context final : public device_context {
public:
  cpu_context() : device_context(c10::Device(c10::kCPU)) {}
};

} // namespace

at::Generator default_generator(c10::Device device) {
  if (device.is_cuda()) {
    return cuda::default_generator(device.has_index() ? device.index() : 0);
  }
  return at::detail::getDefaultCPUGenerator();
}

bool built_with_cuda() {
#ifdef ACTORPIPE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
  return built_with_cuda() ? static_cast<int>(torch::cuda::device_count()) : 0;
}

void check_device(c10::Device device, const std::string& who) {
  auto invalid = [&](const std::string& why) {
    return invalid_argument(detail::concat(who, ": device ", device.str(), ": ", why));
  };
  if (device.is_cpu()) {
    return;
  }
  if (!device.is_cuda()) {
    throw invalid("only cpu and cuda devices can hold stages");
  }
  if (!built_with_cuda()) {
    throw invalid("this build of actorpipe has no CUDA (build the CUDA line: ./setup.sh build "
                  "--torch pip, docs/gpu.md)");
  }
  auto count = cuda_device_count();
  if (count == 0) {
    throw invalid("this machine has no CUDA device (or its driver is not loaded)");
  }
  if (device.has_index() && device.index() >= count) {
    throw invalid(detail::concat("this machine has ", count, " CUDA device", count == 1 ? "" : "s",
                                 " (cuda:0",
                                 count > 1 ? detail::concat(" to cuda:", count - 1) : "", ")"));
  }
}

graph_pool device_context::new_graph_pool() {
  throw invalid_argument(detail::concat(device_.str(), ": this device captures no graphs"));
}

std::unique_ptr<device_graph> device_context::capture(graph_pool, const std::function<void()>&) {
  throw invalid_argument(detail::concat(device_.str(), ": this device captures no graphs"));
}

device_override::device_override(factory make) {
  std::lock_guard<std::mutex> lock{override_mutex};
  ACTORPIPE_CHECK(!overriding(), "a device_override is already alive");
  overriding() = std::move(make);
}

device_override::~device_override() {
  std::lock_guard<std::mutex> lock{override_mutex};
  overriding() = nullptr;
}

std::shared_ptr<device_context> make_device_context(c10::Device device) {
  {
    std::lock_guard<std::mutex> lock{override_mutex};
    if (overriding()) {
      return overriding()(device);
    }
  }
  check_device(device, "stage");
  if (device.is_cpu()) {
    return std::make_shared<cpu_context>();
  }
  return cuda::make_context(device.has_index() ? device : c10::Device(c10::kCUDA, 0));
}

memory_tally::memory_tally(c10::Device device)
  : memory_tally(device, std::make_shared<memory::tally_count>()) {}

memory_tally::memory_tally(c10::Device device, std::shared_ptr<memory::tally_count> count)
  : tally_(std::move(count)) {
  if (device.is_cuda()) {
    cuda::watch_allocations(device);
  }
}

#ifndef ACTORPIPE_WITH_CUDA
// The CPU line: check_device refuses CUDA devices before any of these could be reached.
namespace cuda {
std::shared_ptr<device_context> make_context(c10::Device device) {
  check_device(device, "stage");
  return nullptr;
}
at::Generator default_generator(c10::DeviceIndex) {
  return at::detail::getDefaultCPUGenerator();
}
at::Tensor pinned(const at::Tensor& t) {
  return t;
}
void wait_for_current_stream(const at::Tensor&) {}
void wait_for_current_stream(c10::Device) {}
std::string out_of_memory(const std::exception&) {
  return {};
}
void watch_allocations(c10::Device) {}
int64_t peak_allocated_bytes(c10::Device) {
  return 0;
}
int64_t allocated_bytes(c10::Device) {
  return 0;
}
void release_blas_workspaces(c10::Device) {}

void reset_peak_allocated(c10::Device) {}
int stages_on(c10::Device) {
  return 0;
}
} // namespace cuda
#endif

} // namespace actorpipe::stages
