// Warm memory: the caching CPU allocator of stage threads.
#include <cstring>
#include <thread>

#include <c10/core/CPUAllocator.h>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <actorpipe/memory.hpp>

namespace memory = actorpipe::memory;

namespace {

// Runs f on a fresh thread that uses warm memory (or not), and waits for it.
template <class F>
void on_thread(bool warm, F f) {
  std::thread t([&] {
    if (warm) {
      memory::use_warm_memory_on_this_thread();
    }
    f();
  });
  t.join();
}

} // namespace

TEST_CASE("a warm thread gets its freed buffers back, other threads and small tensors do not") {
  memory::release_cached();
  auto before = memory::stats();
  on_thread(true, [] {
    void* first = nullptr;
    {
      auto t = torch::empty({1 << 18}); // 1 MB
      first = t.data_ptr();
      t.fill_(3);
    }
    CHECK(memory::stats().cached_bytes >= (1u << 20));
    auto again = torch::empty({1 << 18});
    CHECK(again.data_ptr() == first);
    // The values are whatever was there: empty() promises nothing, and math is unchanged.
    auto x = torch::randn({256, 1024});
    auto y = x.clone();
    CHECK(torch::equal(x * 2, y * 2));
  });
  auto after_warm = memory::stats();
  CHECK(after_warm.hits >= before.hits + 1);
  CHECK(after_warm.misses >= before.misses + 1);
  on_thread(false, [] {
    for (int i = 0; i < 3; ++i) {
      auto t = torch::empty({1 << 18});
    }
  });
  on_thread(true, [] {
    for (int i = 0; i < 3; ++i) {
      auto t = torch::empty({1000}); // 4 KB: glibc's business
    }
  });
  auto after = memory::stats();
  CHECK(after.hits == after_warm.hits);
  CHECK(after.misses == after_warm.misses);
}

TEST_CASE("a buffer freed by another thread returns to the cache, and the limit holds") {
  memory::release_cached();
  torch::Tensor escaped;
  on_thread(true, [&] { escaped = torch::ones({1 << 18}); });
  CHECK(escaped.sum().item<float>() == float(1 << 18));
  auto cached = memory::stats().cached_bytes;
  escaped = torch::Tensor(); // freed here, on a cold thread
  CHECK(memory::stats().cached_bytes == cached + (1u << 20));

  auto keep = memory::cache_limit();
  memory::set_cache_limit(3u << 20);
  CHECK(memory::stats().cached_bytes <= (3u << 20));
  on_thread(true, [] {
    { auto a = torch::empty({1 << 18}); } // 1 MB cached
    { auto b = torch::empty({3 << 18}); } // 3 MB: evicts the 1 MB buffer to fit
  });
  CHECK(memory::stats().cached_bytes == (3u << 20));
  memory::set_cache_limit(0);
  CHECK(memory::stats().cached_bytes == 0);
  on_thread(true, [] { auto c = torch::empty({1 << 18}); });
  CHECK(memory::stats().cached_bytes == 0);
  memory::set_cache_limit(keep);
  memory::release_cached();
}

TEST_CASE("raw allocations (as oneDNN makes them) are cached on warm threads only") {
  for (bool warm : {true, false}) {
    CAPTURE(warm);
    memory::release_cached();
    auto before = memory::stats();
    on_thread(warm, [warm] {
      auto* allocator = c10::GetCPUAllocator();
      for (std::size_t bytes : {std::size_t{256}, std::size_t{1} << 20}) {
        void* p = allocator->raw_allocate(bytes);
        REQUIRE(p != nullptr);
        std::memset(p, 1, bytes);
        allocator->raw_deallocate(p);
        // A large block freed on a warm thread comes back to the next raw allocation.
        void* again = allocator->raw_allocate(bytes);
        REQUIRE(again != nullptr);
        std::memset(again, 2, bytes);
        if (warm && bytes >= (std::size_t{1} << 20)) {
          CHECK(again == p);
        }
        allocator->raw_deallocate(again);
      }
    });
    auto after = memory::stats();
    // Warm: the 1 MB block missed once and hit once; the 256-byte one is glibc's. Cold: the
    // cache saw nothing.
    CHECK(after.hits == before.hits + (warm ? 1 : 0));
    CHECK(after.misses == before.misses + (warm ? 1 : 0));
  }
  memory::release_cached();
}

TEST_CASE("a warm memory scope warms a thread for its lifetime only") {
  memory::release_cached();
  on_thread(false, [] {
    auto start = memory::stats();
    {
      memory::warm_memory_scope scope;
      { auto a = torch::empty({1 << 18}); }
      { auto b = torch::empty({1 << 18}); } // the same buffer again
      {
        memory::warm_memory_scope cold(false); // nested: cold inside, warm after
        auto c = torch::empty({1 << 18});
        CHECK(memory::stats().hits == start.hits + 1);
      }
      auto d = torch::empty({1 << 18});
      CHECK(memory::stats().hits == start.hits + 2);
    }
    auto after = memory::stats();
    CHECK(after.misses == start.misses + 1);
    { auto e = torch::empty({1 << 18}); } // cold again
    CHECK(memory::stats().hits == after.hits);
    CHECK(memory::stats().misses == after.misses);
  });
  memory::release_cached();
}

TEST_CASE("an allocation tally counts what its thread allocates until freed, by any thread, warm "
          "or cold, raw allocations included") {
  for (bool warm : {true, false}) {
    CAPTURE(warm);
    torch::Tensor kept;
    on_thread(warm, [&] {
      memory::allocation_tally outer;
      auto small = torch::ones({10}); // 40 bytes: libtorch's allocator, still counted
      CHECK(outer.live_bytes() == 40);
      {
        memory::allocation_tally inner;
        kept = torch::ones({1 << 16}); // 256 KB: warm memory on a warm thread
        CHECK(inner.live_bytes() == (1 << 18));
        CHECK(outer.live_bytes() == 40); // the innermost tally counts
        auto* raw = c10::GetCPUAllocator()->raw_allocate(1 << 17);
        CHECK(inner.live_bytes() == (1 << 18) + (1 << 17));
        c10::GetCPUAllocator()->raw_deallocate(raw);
        CHECK(inner.live_bytes() == (1 << 18));
        auto scratch = torch::ones({1 << 15}) * 2; // two temporaries, one freed at once
        CHECK(inner.live_bytes() == (1 << 18) + (1 << 17));
      }
      small = torch::Tensor();
      CHECK(outer.live_bytes() == 0);
      // The inner tally gone, the outer counts again.
      auto later = torch::ones({1 << 16});
      CHECK(outer.live_bytes() == (1 << 18));
    });
    // Freed on this thread: still subtracted from the tally it was counted in (no crash, and
    // the buffer goes where it came from).
    kept = torch::Tensor();
  }
}

TEST_CASE("an allocation tally keeps its peak, and a later tally can count on an earlier one's "
          "count, so that what it frees of that is subtracted") {
  memory::warm_memory_scope warm;
  std::shared_ptr<memory::tally_count> count;
  torch::Tensor kept;
  {
    memory::allocation_tally forward;
    kept = torch::ones({1 << 16});             // 256 KB kept
    { auto scratch = torch::ones({1 << 17}); } // 512 KB for a moment
    CHECK(forward.live_bytes() == (1 << 18));
    CHECK(forward.peak_bytes() == (1 << 18) + (1 << 19));
    count = forward.count();
  }
  count->reset_peak();
  CHECK(count->peak() == (1 << 18));
  {
    memory::allocation_tally backward(count); // counts with what the forward kept
    auto gradient = torch::ones({1 << 15});   // 128 KB
    kept = torch::Tensor();                   // the forward's, freed
    auto more = torch::ones({1 << 15});
    CHECK(backward.live_bytes() == (1 << 18));
    CHECK(backward.peak_bytes() == (1 << 18) + (1 << 17));
  }
  CHECK(count->live() == 0);
}
