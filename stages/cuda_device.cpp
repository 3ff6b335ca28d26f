// A stage on a CUDA device: a stream of its own from libtorch's pool, events for hand-offs and
// the device's generator. Compiled in the CUDA build only (ACTORPIPE_WITH_CUDA);
// stages/device.cpp is the CPU line's half.
#include "stages/device.hpp"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDACachingAllocator.h> // recordStream
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <actorpipe/errors.hpp>

namespace actorpipe::stages {
namespace {

using c10::cuda::CUDAStream;

// Recorded on the producing stage's stream after the bundle's tensors were made.
class cuda_ready_event final : public ready_event {
public:
  explicit cuda_ready_event(const CUDAStream& stream)
    : device_(stream.device_index()), event_(cudaEventDisableTiming) {
    event_.record(stream);
  }
  void synchronize() const override { event_.synchronize(); }
  // Makes `stream` wait for the event (on the GPU; the host goes on).
  void block(const CUDAStream& stream) const { event_.block(stream); }
  c10::DeviceIndex device() const { return device_; }

private:
  c10::DeviceIndex device_;
  mutable c10::cuda::CUDAEvent event_;
};

class cuda_context final : public device_context {
public:
  explicit cuda_context(c10::Device device)
    : device_context(device), index_(device.index()),
      stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {}

  void bind_current_thread() override {
    c10::cuda::set_device(index_);
    c10::cuda::setCurrentCUDAStream(stream_);
  }

  std::shared_ptr<const ready_event> record() override {
    return std::make_shared<cuda_ready_event>(stream_);
  }

  void adopt(bundle& b) override {
    if (const auto* event = dynamic_cast<const cuda_ready_event*>(b.ready().get())) {
      event->block(stream_);
      // A tensor from another GPU is copied here by that GPU's current stream on this thread
      // (libtorch's cross-device copy): it waits too.
      if (event->device() != index_) {
        event->block(c10::cuda::getCurrentCUDAStream(event->device()));
      }
    } else if (b.ready()) {
      b.ready()->synchronize();
    }
    for (const auto& t : b.tensors()) {
      if (t.defined() && t.is_cuda()) {
        auto on = t.device().index() == index_
                    ? stream_
                    : c10::cuda::getCurrentCUDAStream(t.device().index());
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), on);
      }
    }
    b.set_ready(nullptr);
  }

  void synchronize() override { stream_.synchronize(); }

  void begin_timeline(double host_ms) override {
    used_ = 0;
    host_ms_ = host_ms;
    zero_ = mark();
  }

  int mark() override {
    if (used_ == marks_.size()) {
      marks_.push_back(std::make_unique<c10::cuda::CUDAEvent>(cudaEventDefault)); // timed
    }
    marks_[used_]->record(stream_);
    return static_cast<int>(used_++);
  }

  double at_ms(int mark) const override {
    if (zero_ < 0 || mark < 0 || static_cast<std::size_t>(mark) >= used_) {
      return -1;
    }
    return host_ms_ + marks_[static_cast<std::size_t>(zero_)]->elapsed_time(
                        *marks_[static_cast<std::size_t>(mark)]);
  }

private:
  c10::DeviceIndex index_;
  CUDAStream stream_;
  // Timing events, reused step after step; the first `used_` belong to the running step.
  std::vector<std::unique_ptr<c10::cuda::CUDAEvent>> marks_;
  std::size_t used_ = 0;
  int zero_ = -1;
  double host_ms_ = 0;
};

} // namespace

namespace cuda {

std::shared_ptr<device_context> make_context(c10::Device device) {
  return std::make_shared<cuda_context>(device);
}

at::Generator default_generator(c10::DeviceIndex index) {
  return at::cuda::detail::getDefaultCUDAGenerator(index);
}

at::Tensor pinned(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || t.is_pinned()) {
    return t;
  }
  return t.pin_memory();
}

void wait_for_current_stream(const at::Tensor& t) {
  if (t.defined()) {
    wait_for_current_stream(t.device());
  }
}

void wait_for_current_stream(c10::Device device) {
  if (device.is_cuda()) {
    c10::cuda::getCurrentCUDAStream(device.has_index() ? device.index()
                                                       : c10::cuda::current_device())
      .synchronize();
  }
}

std::string out_of_memory(const std::exception& e) {
  if (const auto* oom = dynamic_cast<const c10::OutOfMemoryError*>(&e)) {
    return detail::first_line(oom->what_without_backtrace());
  }
  return {};
}

} // namespace cuda
} // namespace actorpipe::stages
