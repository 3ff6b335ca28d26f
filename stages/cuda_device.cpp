// A stage on a CUDA device: a stream of its own from libtorch's pool, events for hand-offs and
// the device's generator. Compiled in the CUDA build only (ACTORPIPE_WITH_CUDA);
// stages/device.cpp is the CPU line's half.
#include "stages/device.hpp"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h> // recordStream
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <actorpipe/errors.hpp>
#include <actorpipe/torch_compat.hpp>

namespace actorpipe::stages {
namespace {

using c10::cuda::CUDAStream;

// Stage contexts alive per device index (stages_on).
constexpr std::size_t max_devices = 64;
std::array<std::atomic<int>, max_devices> contexts{};

std::atomic<int>& contexts_on(c10::DeviceIndex index) {
  return contexts.at(static_cast<std::size_t>(index));
}

c10::DeviceIndex index_of(c10::Device device) {
  return device.has_index() ? device.index() : c10::cuda::current_device();
}

// memory_tally on a GPU: every tallied allocation alive (its address: the tally's count and its
// bytes). The caching allocator calls on_allocator_trace under its own lock on the thread that
// allocates or frees; this map's lock is taken inside it, never around a call into the
// allocator.
struct tallied_allocations {
  std::mutex mutex;
  std::unordered_map<std::size_t, std::pair<std::shared_ptr<memory::tally_count>, int64_t>> live;
};

tallied_allocations& tallied() {
  static auto* all = new tallied_allocations; // the allocator may call after static destruction
  return *all;
}

void on_allocator_trace(const c10::CachingDeviceAllocator::TraceEntry& e) {
  using action = c10::CachingDeviceAllocator::TraceEntry::Action;
  if (e.action_ == action::ALLOC) {
    if (auto count = memory::allocation_tally::current()) {
      auto bytes = static_cast<int64_t>(e.size_);
      count->add(bytes);
      auto& all = tallied();
      std::lock_guard<std::mutex> lock{all.mutex};
      all.live[e.addr_] = {std::move(count), bytes};
    }
  } else if (e.action_ == action::FREE_REQUESTED) {
    auto& all = tallied();
    std::lock_guard<std::mutex> lock{all.mutex};
    if (auto it = all.live.find(e.addr_); it != all.live.end()) {
      it->second.first->remove(it->second.second);
      all.live.erase(it);
    }
  }
}

void log_once_without_tally(const std::exception& e) {
  std::fprintf(stderr,
               "actorpipe: the CUDA allocator reports no allocations (%s): stashes on GPUs are "
               "counted as 0 bytes\n",
               detail::first_line(e.what()).c_str());
}

const c10::CachingAllocator::Stat& aggregate(const c10::CachingAllocator::StatArray& stats) {
  return stats[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
}

// Recorded on the producing stage's stream after the bundle's tensors were made. A stage keeps
// a ring of them (cuda_context::record), each re-recorded once no bundle holds it.
class cuda_ready_event final : public ready_event {
public:
  explicit cuda_ready_event(c10::DeviceIndex device)
    : device_(device), event_(cudaEventDisableTiming) {}
  void record(const CUDAStream& stream, bool graph_owned) {
    event_.record(stream);
    graph_owned_ = graph_owned;
  }
  void synchronize() const override { event_.synchronize(); }
  // Makes `stream` wait for the event (on the GPU; the host goes on).
  void block(const CUDAStream& stream) const { event_.block(stream); }
  c10::DeviceIndex device() const { return device_; }
  bool graph_owned() const { return graph_owned_; }

private:
  c10::DeviceIndex device_;
  mutable c10::cuda::CUDAEvent event_;
  bool graph_owned_ = false;
};

// One capture at a time in the process (CUDA's rule for captures that share the allocator).
std::mutex& capture_mutex() {
  static std::mutex mutex;
  return mutex;
}

class cuda_graph final : public device_graph {
public:
  void replay() override { graph.replay(); }
  at::cuda::CUDAGraph graph;
};

class cuda_context final : public device_context {
public:
  explicit cuda_context(c10::Device device)
    : device_context(device), index_(device.index()),
      stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())),
      current_(stream_) {
    ++contexts_on(index_);
  }
  ~cuda_context() override { --contexts_on(index_); }
  cuda_context(const cuda_context&) = delete;
  cuda_context& operator=(const cuda_context&) = delete;

  void bind_current_thread() override {
    c10::cuda::set_device(index_);
    c10::cuda::setCurrentCUDAStream(stream_);
  }

  void begin_chunks(std::size_t chunks) override {
    end_chunks();
    if (chunks < 2) {
      return;
    }
    while (chunk_streams_.size() < chunks) {
      chunk_streams_.push_back(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index_));
    }
    c10::cuda::CUDAEvent before(cudaEventDisableTiming);
    before.record(stream_);
    for (std::size_t c = 0; c < chunks; ++c) {
      before.block(chunk_streams_[c]);
    }
    active_chunks_ = chunks;
  }

  void select(std::size_t chunk) override {
    if (active_chunks_ > 0) {
      current_ = chunk_streams_.at(chunk);
      c10::cuda::setCurrentCUDAStream(current_);
    }
  }

  void end_chunks() override {
    for (std::size_t c = 0; c < active_chunks_; ++c) {
      c10::cuda::CUDAEvent done(cudaEventDisableTiming);
      done.record(chunk_streams_[c]);
      done.block(stream_);
    }
    active_chunks_ = 0;
    current_ = stream_;
    c10::cuda::setCurrentCUDAStream(stream_);
  }

  std::shared_ptr<const ready_event> record(bool graph_owned) override {
    // The next event of the ring that no bundle holds (the ring's own reference alone): a
    // receiver lets go of it once its stream waits for it.
    for (std::size_t tried = 0; tried < events_.size(); ++tried) {
      auto& event = events_[(next_event_ + tried) % events_.size()];
      if (event.use_count() == 1) {
        next_event_ = (next_event_ + tried + 1) % events_.size();
        event->record(current_, graph_owned);
        return event;
      }
    }
    events_.push_back(std::make_shared<cuda_ready_event>(index_));
    events_.back()->record(current_, graph_owned);
    return events_.back();
  }

  void adopt(bundle& b) override {
    if (const auto* event = dynamic_cast<const cuda_ready_event*>(b.ready().get())) {
      event->block(current_);
      // A tensor from another GPU is copied here by that GPU's current stream on this thread
      // (libtorch's cross-device copy): it waits too.
      if (event->device() != index_) {
        event->block(c10::cuda::getCurrentCUDAStream(event->device()));
      }
      if (event->graph_owned()) {
        b.set_ready(nullptr);
        return;
      }
    } else if (b.ready()) {
      b.ready()->synchronize();
    }
    for (const auto& t : b.tensors()) {
      if (t.defined() && t.is_cuda()) {
        auto on = t.device().index() == index_
                    ? current_
                    : c10::cuda::getCurrentCUDAStream(t.device().index());
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), on);
      }
    }
    b.set_ready(nullptr);
  }

  void synchronize() override {
    stream_.synchronize();
    for (const auto& chunk : chunk_streams_) {
      chunk.synchronize();
    }
  }

  bool captures_graphs() const override { return true; }

  graph_pool new_graph_pool() override {
    auto id = at::cuda::graph_pool_handle();
    return {id.first, id.second};
  }

  std::unique_ptr<device_graph> capture(graph_pool pool,
                                        const std::function<void()>& body) override {
    std::lock_guard<std::mutex> one_at_a_time{capture_mutex()};
    auto made = std::make_unique<cuda_graph>();
    // Dropout draws from the device's generator: a replay advances it as the eager work would.
    // capture_begin registers the current device's (compat::register_generator).
    c10::cuda::CUDAGuard on_device(index_);
    compat::register_generator(made->graph, at::cuda::detail::getDefaultCUDAGenerator(index_));
    // Thread-local: the other stages' threads go on queueing their own work meanwhile.
    made->graph.capture_begin({pool.first, pool.second}, cudaStreamCaptureModeThreadLocal);
    try {
      body();
    } catch (...) {
      try {
        made->graph.capture_end();
      } catch (...) { // the capture was invalidated: what the body threw says why
      }
      throw;
    }
    made->graph.capture_end();
    return made;
  }

  void begin_timeline(double host_ms) override {
    used_ = 0;
    host_ms_ = host_ms;
    zero_ = mark();
  }

  int mark() override {
    if (used_ == marks_.size()) {
      marks_.push_back(std::make_unique<c10::cuda::CUDAEvent>(cudaEventDefault)); // timed
    }
    marks_[used_]->record(current_);
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
  // The chunk streams (begin_chunks; the first active_chunks_ in use) and the current stream.
  std::vector<CUDAStream> chunk_streams_;
  std::size_t active_chunks_ = 0;
  CUDAStream current_;
  // Timing events, reused step after step; the first `used_` belong to the running step.
  std::vector<std::unique_ptr<c10::cuda::CUDAEvent>> marks_;
  // Hand-off events, made as needed and reused (record).
  std::vector<std::shared_ptr<cuda_ready_event>> events_;
  std::size_t next_event_ = 0;
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

void watch_allocations(c10::Device device) {
  static std::once_flag attached;
  std::call_once(attached, [device] {
    try {
      // The allocator attaches the callback to the devices it has: it starts here first.
      at::empty({1}, at::TensorOptions().device(device));
      c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(on_allocator_trace);
    } catch (const std::exception& e) { // cudaMallocAsync's backend has no trace callback
      log_once_without_tally(e);
    }
  });
}

namespace {
// The caching allocator's count of bytes allocated on a CUDA `device`, over its pools.
c10::CachingAllocator::Stat allocated_stat(c10::Device device) {
  return aggregate(
    c10::cuda::CUDACachingAllocator::getDeviceStats(index_of(device)).allocated_bytes);
}
} // namespace

int64_t peak_allocated_bytes(c10::Device device) {
  return device.is_cuda() ? allocated_stat(device).peak : 0;
}

int64_t allocated_bytes(c10::Device device) {
  return device.is_cuda() ? allocated_stat(device).current : 0;
}

void release_blas_workspaces(c10::Device device) {
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device);
    c10::cuda::device_synchronize();
    at::cuda::clearCublasWorkspaces();
  }
}

void reset_peak_allocated(c10::Device device) {
  if (device.is_cuda()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(index_of(device));
  }
}

int stages_on(c10::Device device) {
  return device.is_cuda() ? contexts_on(index_of(device)).load() : 0;
}

} // namespace cuda
} // namespace actorpipe::stages
