/// \file
/// The device a stage actor computes on, and everything device-specific the layers above need:
/// binding the stage's thread to its device and stream, the events that travel with a hand-off,
/// the random generator that recomputation replays. On the CPU every operation is a no-op; a
/// CUDA device (stages/cuda_device.cpp, built with ACTORPIPE_WITH_CUDA) gives each stage a
/// stream of its own. The scheduler, the actors and comm/ stay device-blind: they call this.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

#include <actorpipe/bundle.hpp>
#include <actorpipe/memory.hpp>

namespace actorpipe::stages {

/// A memory pool of CUDA graphs (CUDA's MempoolId_t): graphs captured into one pool must replay
/// in the order they were captured, never side by side, so each stage has a pool of its own.
using graph_pool = std::pair<unsigned long long, unsigned long long>;

/// Work captured once and run again on the same memory: a CUDA graph (stages/graphs.hpp).
class device_graph {
public:
  virtual ~device_graph() = default;
  /// Queues the captured work again, on the device's current stream.
  virtual void replay() = 0;
};

class device_context {
public:
  virtual ~device_context() = default;

  c10::Device device() const { return device_; }
  bool is_cuda() const { return device_.is_cuda(); }

  /// Makes the calling thread compute on this device and its stream from now on (a stage
  /// actor's thread is its own: called once, before its first action).
  virtual void bind_current_thread() {}

  /// A stage of several chunks (interleaved and V schedules) on a GPU gives each chunk a stream
  /// of its own for a program (pipeline_options::chunk_streams), so that one chunk's forward
  /// and another's backward may run side by side on the device. begin_chunks(n) makes n chunk
  /// streams wait for the stage's stream (the optimizer step before); select(c) makes chunk c's
  /// stream current (record, adopt and mark use the current stream); end_chunks() makes the
  /// stage's stream wait for every chunk stream and current again (for what follows a program:
  /// the replica sync, clipping, the optimizer step). Nothing on the CPU, or for one chunk.
  virtual void begin_chunks(std::size_t /*chunks*/) {}
  virtual void select(std::size_t /*chunk*/) {}
  virtual void end_chunks() {}

  /// An event recorded on the stream after what it has been given so far (null on the CPU):
  /// set it on a bundle before the bundle leaves the stage. `graph_owned`: the bundle's
  /// tensors are a graph's static buffers, which the allocator never reuses while the graph
  /// lives, so the receiver need not mark them as used on its stream. A GPU takes the event
  /// from a ring made once (one CUDA call: the record), reusing one that no bundle holds.
  virtual std::shared_ptr<const ready_event> record(bool /*graph_owned*/ = false) {
    return nullptr;
  }

  /// Takes in a bundle made elsewhere: the stream waits for its event (without blocking the
  /// host), and its device tensors (unless graph-owned) are marked as used on this stream, so
  /// that their memory is not reused before this stream is done with them. The bundle's event
  /// is cleared. On the
  /// CPU the host waits for the event: a GPU stage's output is complete before a CPU stage
  /// copies it (that copy runs on the thread's default stream, which does not wait for the
  /// producer's).
  virtual void adopt(bundle& b) {
    b.synchronize();
    b.set_ready(nullptr);
  }

  /// Blocks until everything queued on the stream (and the chunk streams) is done (before a
  /// report leaves the stage: once per step, never per hop).
  virtual void synchronize() {}

  /// The device's own clock (a GPU runs an action's kernels after the host queued them):
  /// begin_timeline records a mark at `host_ms` on the step's axis; mark() records another
  /// (-1 on the CPU); once synchronised, at_ms(mark) is when the stream reached it on that axis
  /// (-1 when not measured).
  virtual void begin_timeline(double /*host_ms*/) {}
  virtual int mark() { return -1; }
  virtual double at_ms(int /*mark*/) const { return -1; }

  /// CUDA graphs (stages/graphs.hpp): whether this device captures them (a GPU: yes; the
  /// CPU: no, and the two calls below throw).
  virtual bool captures_graphs() const { return false; }
  /// A new pool for one stage's graphs.
  virtual graph_pool new_graph_pool();
  /// Captures what `body` queues on the current stream into a graph of `pool`. The captured
  /// kernels do not run until replay(); one capture at a time in the process; the random
  /// generator is registered so that a replay draws as eager work would. Throws what `body` or
  /// the capture threw (a host synchronisation inside it, say), the capture ended.
  virtual std::unique_ptr<device_graph> capture(graph_pool pool, const std::function<void()>& body);

protected:
  explicit device_context(c10::Device device) : device_(device) {}

private:
  c10::Device device_;
};

/// The context of `device`. Throws actorpipe::invalid_argument naming the device when it does not
/// exist or this build cannot use it ("cuda:1: this machine has 1 CUDA device";
/// "cuda:0: this build of actorpipe has no CUDA").
std::shared_ptr<device_context> make_device_context(c10::Device device);

/// Tests: while alive, make_device_context returns what `make` returns (a device that records
/// its calls and captures "graphs" on the CPU, say); one at a time.
class device_override {
public:
  using factory = std::function<std::shared_ptr<device_context>(c10::Device)>;
  explicit device_override(factory make);
  ~device_override();
  device_override(const device_override&) = delete;
  device_override& operator=(const device_override&) = delete;
};

/// Whether this build can bind stages to CUDA devices, and how many there are here (0 when the
/// build has no CUDA or the machine no GPU).
bool built_with_cuda();
int cuda_device_count();

/// The generator random layers on `device` draw from (dropout): the CPU's or the GPU's default.
at::Generator default_generator(c10::Device device);

/// Checks a device a user named for a stage (as make_device_context does, without making one).
void check_device(c10::Device device, const std::string& who);

/// What the calling thread keeps of what it allocates from now on, for a stage's stash and a
/// layer's profile: a memory::allocation_tally (every buffer it allocates while the tally is
/// alive counts until it is freed, by whichever thread; tallies nest, the innermost counts)
/// which, for a CUDA `device`, also counts the caching allocator's allocations
/// (cuda::watch_allocations).
class memory_tally {
public:
  explicit memory_tally(c10::Device device);
  /// Counting on another tally's `count` (allocation_tally's).
  memory_tally(c10::Device device, std::shared_ptr<memory::tally_count> count);

  int64_t live_bytes() const { return tally_.live_bytes(); }
  int64_t peak_bytes() const { return tally_.peak_bytes(); }
  void reset_peak() { tally_.reset_peak(); }
  const std::shared_ptr<memory::tally_count>& count() const { return tally_.count(); }

private:
  memory::allocation_tally tally_;
};

/// CUDA-only operations that leave the CPU as it is (`cuda_device.cpp` defines them in a CUDA
/// build, `device.cpp` otherwise).
namespace cuda {
/// make_device_context's and default_generator's CUDA halves.
std::shared_ptr<device_context> make_context(c10::Device device);
at::Generator default_generator(c10::DeviceIndex index);
/// Copies `t` (a CPU tensor) into pinned host memory, so that a later copy to a GPU can be
/// non-blocking; `t` itself on the CPU line or when `t` is not on the CPU.
at::Tensor pinned(const at::Tensor& t);
/// Blocks until the calling thread's current stream on `t`'s GPU has done its work, so that a
/// batch the caller made on a GPU is complete before the stages' streams read it; nothing for a
/// tensor on the CPU.
void wait_for_current_stream(const at::Tensor& t);
/// The same for the calling thread's current stream on `device` (nothing for the CPU).
void wait_for_current_stream(c10::Device device);
/// "CUDA out of memory" in the caching allocator's words, with what was asked for; empty when
/// `e` is not a CUDA out-of-memory error.
std::string out_of_memory(const std::exception& e);
/// memory_tally's CUDA half, done once per process: from then on every allocation from the
/// caching allocator counts on the allocating thread's allocation_tally, if it has one, until it
/// is freed (through the allocator's trace callback: a map entry per tallied allocation while it
/// lives, as the CPU allocator keeps). Nothing on the CPU line; where the allocator has no trace
/// callback (PyTorch's cudaMallocAsync backend) it says so once on stderr and counts nothing.
void watch_allocations(c10::Device device);
/// The most bytes the caching allocator held allocated on a CUDA `device` at once (block sizes)
/// since the last reset_peak_allocated; 0 for the CPU.
int64_t peak_allocated_bytes(c10::Device device);
/// The bytes the caching allocator holds allocated on a CUDA `device` now; 0 for the CPU.
int64_t allocated_bytes(c10::Device device);
/// Gives back the workspaces cuBLAS keeps allocated for every thread and stream that multiplied
/// matrices (at::cuda::clearCublasWorkspaces: the next multiplication allocates its own again).
/// Only while nothing computes on the device: the profile, before stages start. Nothing on the
/// CPU line.
void release_blas_workspaces(c10::Device device);
void reset_peak_allocated(c10::Device device);
/// Stage contexts of this process alive on `device` (0 for the CPU).
int stages_on(c10::Device device);
} // namespace cuda

} // namespace actorpipe::stages
