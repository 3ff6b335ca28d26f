#include <actorpipe/memory.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include <actorpipe/torch_compat.hpp>
#include <c10/core/CPUAllocator.h>
#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

namespace actorpipe::memory {

namespace {

constexpr std::size_t alignment = 64;       // libtorch's CPU alignment
constexpr std::size_t smallest = 64 * 1024; // smaller buffers: glibc keeps those warm itself
constexpr std::size_t granule = 64 * 1024;  // cached sizes are rounded up to this

thread_local bool warm_thread = false;
// The allocation_tally counting this thread's allocations, if any.
thread_local std::shared_ptr<tally_count> tally = nullptr;

std::size_t default_limit() {
  auto pages = ::sysconf(_SC_PHYS_PAGES);
  auto page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0
           ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) / 4
           : std::size_t{1} << 32;
}

class warm_allocator final : public compat::allocator {
public:
  explicit warm_allocator(c10::Allocator* fallback) : fallback_(fallback) {}

  c10::DataPtr allocate_bytes(std::size_t n) const override {
    if (!tally || n == 0) {
      return allocate_untallied(n);
    }
    // Tallied: the buffer comes back through release, which subtracts it (and hands a
    // libtorch buffer to libtorch's deleter). The context stays the data pointer, as
    // raw_allocate requires.
    auto ptr = allocate_untallied(n);
    void* p = ptr.get();
    auto deleter = ptr.get_deleter();
    ptr.release_context();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      tallied_.emplace(p, tallied{n, tally, deleter == &release ? nullptr : deleter});
    }
    tally->add(static_cast<int64_t>(n));
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DataPtr allocate_untallied(std::size_t n) const {
    if (!warm_thread || n < smallest) {
      return fallback_->allocate(n);
    }
    auto bytes = (n + granule - 1) / granule * granule;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cached_ -= bytes;
        ++hits_;
        live_.emplace(p, bytes);
        return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
      }
      ++misses_;
    }
    // A miss allocates outside the lock.
    void* p = std::aligned_alloc(alignment, bytes);
    if (p == nullptr) {
      throw std::bad_alloc();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      live_.emplace(p, bytes);
    }
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }

  // raw_allocate/raw_deallocate (oneDNN's scratchpads use them) end here too, for buffers of
  // either origin.
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  static void release(void* p);

  void give_back(void* p) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!tallied_.empty()) {
      auto t = tallied_.find(p);
      if (t != tallied_.end()) {
        t->second.counter->remove(static_cast<int64_t>(t->second.bytes));
        auto deleter = t->second.deleter;
        tallied_.erase(t);
        if (deleter != nullptr) {
          lock.unlock();
          deleter(p);
          return;
        }
      }
    }
    auto it = live_.find(p);
    if (it == live_.end()) {
      // Allocated by libtorch's default allocator for a cold thread.
      lock.unlock();
      fallback_->raw_deleter()(p);
      return;
    }
    auto bytes = it->second;
    live_.erase(it);
    if (bytes <= limit_) {
      // Make room by evicting buffers of other sizes: those of the current shapes stay.
      evict_locked(limit_ - bytes, bytes);
      if (cached_ + bytes <= limit_) {
        free_[bytes].push_back(p);
        cached_ += bytes;
        return;
      }
    }
    std::free(p);
  }

  void set_limit(std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = bytes;
    evict_locked(limit_);
  }
  std::size_t limit() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return limit_;
  }
  cache_stats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return {cached_, hits_, misses_};
  }
  void release_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    evict_locked(0);
  }

private:
  // Frees cached buffers, except those of size `keep`, until at most `target` bytes are cached.
  void evict_locked(std::size_t target, std::size_t keep = 0) {
    for (auto& [bytes, blocks] : free_) {
      if (bytes == keep) {
        continue;
      }
      while (cached_ > target && !blocks.empty()) {
        std::free(blocks.back());
        blocks.pop_back();
        cached_ -= bytes;
      }
    }
  }

  struct tallied {
    std::size_t bytes;
    std::shared_ptr<tally_count> counter;
    // libtorch's deleter for a buffer of the fallback; null for a warm one.
    c10::DeleterFnPtr deleter;
  };

  c10::Allocator* fallback_;
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, tallied> tallied_;
  mutable std::unordered_map<std::size_t, std::vector<void*>> free_;
  mutable std::unordered_map<void*, std::size_t> live_;
  mutable std::size_t cached_ = 0;
  mutable std::size_t hits_ = 0;
  mutable std::size_t misses_ = 0;
  std::size_t limit_ = default_limit();
};

// Installed once and never destroyed: tensors may outlive every other static object.
warm_allocator& instance() {
  static auto* allocator = [] {
    auto* a = new warm_allocator(c10::GetDefaultCPUAllocator());
    c10::SetCPUAllocator(a, /*priority=*/1);
    return a;
  }();
  return *allocator;
}

void warm_allocator::release(void* p) {
  instance().give_back(p);
}

} // namespace

void use_warm_memory_on_this_thread() {
  instance();
  warm_thread = true;
}

warm_memory_scope::warm_memory_scope(bool warm) : previous_(warm_thread) {
  if (warm) {
    instance();
  }
  warm_thread = warm;
}

warm_memory_scope::~warm_memory_scope() {
  warm_thread = previous_;
}

void tally_count::add(int64_t bytes) {
  auto now = live_ += bytes;
  auto peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
}

allocation_tally::allocation_tally() : allocation_tally(std::make_shared<tally_count>()) {}

allocation_tally::allocation_tally(std::shared_ptr<tally_count> count)
  : live_(std::move(count)), previous_(tally) {
  instance();
  tally = live_;
}

allocation_tally::~allocation_tally() {
  tally = previous_;
}

std::shared_ptr<tally_count> allocation_tally::current() {
  return tally;
}

void set_cache_limit(std::size_t bytes) {
  instance().set_limit(bytes);
}

std::size_t cache_limit() {
  return instance().limit();
}

cache_stats stats() {
  return instance().stats();
}

void release_cached() {
  instance().release_all();
}

void release_free_heap() {
#ifdef __GLIBC__
  ::malloc_trim(0);
#endif
}

void map_large_allocations(std::size_t bytes) {
#ifdef __GLIBC__
  ::mallopt(M_MMAP_THRESHOLD, static_cast<int>(std::min<std::size_t>(bytes, 32u << 20)));
#endif
}

} // namespace actorpipe::memory
