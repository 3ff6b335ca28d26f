/// \file
/// Warm memory for stage threads: a caching CPU allocator that keeps freed tensor buffers and
/// hands them out again, so the activations and gradients of every micro-batch and step, whose
/// shapes recur, land in pages that are already mapped.
///
/// Plain libtorch on glibc gives large buffers back to the kernel when they are freed (munmap,
/// or a trimmed arena) and faults every page in again on the next allocation (docs/memory.md
/// has the measurements). The allocator is installed as libtorch's CPU allocator the first time
/// a thread asks for it, but caches only for such threads: stage threads (on by default,
/// pipeline_options::warm_memory) and threads that call use_warm_memory_on_this_thread().
/// Every other thread, and buffers under 64 KB, go to libtorch's default allocator as before.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace actorpipe::memory {

/// Makes the calling thread's CPU tensors of 64 KB and more come from the cache, and go back to
/// it when freed (by any thread), from now until the thread ends.
void use_warm_memory_on_this_thread();

/// Warm (or cold) memory on the calling thread for the scope's lifetime, then as before: to
/// measure layers as a stage thread runs them, say. Buffers allocated inside go back to the
/// cache when freed, whenever that is.
class warm_memory_scope {
public:
  explicit warm_memory_scope(bool warm = true);
  ~warm_memory_scope();
  warm_memory_scope(const warm_memory_scope&) = delete;
  warm_memory_scope& operator=(const warm_memory_scope&) = delete;

private:
  bool previous_;
};

/// One tally's count: the bytes alive now, and the most alive at once since it began (or since
/// reset_peak). Counted by any thread that allocates or frees.
class tally_count {
public:
  /// `bytes` allocated (raises the peak) or freed.
  void add(int64_t bytes);
  void remove(int64_t bytes) { live_ -= bytes; }
  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  /// The peak from now on: what is alive now, and more when more comes.
  void reset_peak() { peak_.store(live_.load()); }

private:
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
};

/// Counts the CPU tensor memory the calling thread allocates during the tally's lifetime (and,
/// once a stage on a GPU watches it, the CUDA caching allocator's), until it is freed (by any
/// thread): a stage measures what a micro-batch's forward leaves behind for its backward
/// (stage_stats::peak_stash_bytes). Tallies nest; the innermost counts. Works with warm and cold
/// memory alike (it installs the allocator, which then forwards cold threads' buffers to
/// libtorch's).
class allocation_tally {
public:
  allocation_tally();
  /// Counts on `count`, another tally's (kept beyond that tally): a stage's backward counts on
  /// what its forward kept, so that what it frees of that is subtracted and the peak is the
  /// micro-batch's whole.
  explicit allocation_tally(std::shared_ptr<tally_count> count);
  ~allocation_tally();
  allocation_tally(const allocation_tally&) = delete;
  allocation_tally& operator=(const allocation_tally&) = delete;

  /// Bytes allocated on this thread under the tally and not freed yet.
  int64_t live_bytes() const { return live_->live(); }
  /// The most of those alive at once, since the tally began or reset_peak: with live_bytes at
  /// the end, what a computation needed on top of what it left (its temporaries).
  int64_t peak_bytes() const { return live_->peak(); }
  void reset_peak() { live_->reset_peak(); }
  const std::shared_ptr<tally_count>& count() const { return live_; }

  /// The calling thread's innermost tally's count (null: none), for an allocator other than the
  /// CPU's to count on: a stage on a GPU counts the CUDA caching allocator's allocations here
  /// (stages::memory_tally), subtracting each when it is freed.
  static std::shared_ptr<tally_count> current();

private:
  std::shared_ptr<tally_count> live_;
  std::shared_ptr<tally_count> previous_;
};

/// Bytes of free buffers kept at most; a buffer freed beyond it evicts buffers of other sizes
/// (the shapes of a new configuration replace an old one's) or goes back to the system.
/// Default: a quarter of physical memory. 0 keeps nothing.
void set_cache_limit(std::size_t bytes);
std::size_t cache_limit();

struct cache_stats {
  /// Free buffers held now.
  std::size_t cached_bytes = 0;
  /// Allocations served from the cache, and those that went to the system.
  std::size_t hits = 0;
  std::size_t misses = 0;
};
cache_stats stats();

/// Gives every cached buffer back to the system (buffers in use return to the cache later).
void release_cached();

/// Hands the free pages of the C heap back to the kernel (glibc's malloc_trim; nothing
/// elsewhere). After megabytes of short-lived buffers on threads without warm memory (a
/// snapshot's copies and pickles), glibc's rising mmap threshold otherwise leaves them as
/// resident holes between live allocations, and the process grows with every snapshot
/// (BENCHMARKS.md: 1.1 MB per snapshot of a 2 MB state before, none after).
void release_free_heap();

/// From now on, glibc serves every allocation of `bytes` and more (default 1 MB) with a
/// mapping of its own, given back to the kernel when freed (mallopt M_MMAP_THRESHOLD, which
/// also stops glibc from raising the threshold as it does by default; nothing elsewhere). For
/// processes that run no stage but move megabytes through the C heap for ever: `actorpipe node`
/// and a driver of nodes. Without it a soak run's resident memory grew 12-14% over 10,000 steps
/// with ten node losses, 4-6% with it (BENCHMARKS.md). Stage threads' tensors come from warm
/// memory and are not affected; received frames of 1 MB and more are recycled (comm's buffer
/// pool), and smaller ones stay on the heap.
void map_large_allocations(std::size_t bytes = std::size_t{1} << 20);

} // namespace actorpipe::memory
