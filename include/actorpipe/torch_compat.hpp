/// \file
/// The libtorch lines actorpipe builds against, in one place: Debian's 1.13 (CPU, the default
/// build) and the libtorch inside PyTorch's wheels, 2.11 through the newest on PyPI (2.15 when
/// written; `pip install .`, docs/install.md). Every difference between them that the tree meets
/// is spelt here once; nothing else in the tree tests a libtorch version. Internal: applications
/// need not include it.
// clang-format off
///
/// | difference                       | 1.13                       | 2.x                                |
/// |----------------------------------|----------------------------|------------------------------------|
/// | c10::Allocator::allocate         | const                      | not const, + copy_data             |
/// | optimizer state keys             | string of the TensorImpl*  | the TensorImpl* (void*)            |
/// | c10::variant / get_if            | c10::                      | std::                              |
/// | autocast getters and setters     | per device (cpu / gpu)     | by device type (1.13's forms warn  |
/// |                                  |                            | on every call)                     |
/// | c10d process groups (Gloo, NCCL) | derive from ProcessGroup   | derive from c10d::Backend          |
/// | c10::Error's second argument     | std::string backtrace      | a lazy backtrace pointer: pass `{}`|
/// |                                  |                            | on both lines                      |
/// | autograd's multithreading switch | none (CPU only: not needed)| AutogradState's                    |
/// | a strong reference to an autograd| std::shared_ptr            | std::shared_ptr to 2.14, then      |
/// | node (compat::node_ref)          | (shared_from_this)         | c10::intrusive_ptr (both: getptr)  |
/// | a CUDA graph's generator         | (no CUDA graphs)           | registered by the caller on 2.11;  |
/// | (compat::register_generator)     |                            | by capture_begin alone on 2.15 (the|
/// |                                  |                            | current device's default one)      |
/// | c10d::Work, c10d::Backend        | through the store headers  | their own headers from 2.15 (the   |
/// |                                  |                            | store headers no longer bring them:|
/// |                                  |                            | comm/ includes them by name)       |
// clang-format on
#pragma once

#include <cstddef>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <c10/core/AutogradState.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/function.h>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR >= 2
#include <variant>
#else
#include <c10/util/variant.h>
#endif

/// 1 on PyTorch 2's libtorch (the wheel line), 0 on Debian's 1.13.
#define ACTORPIPE_TORCH_2 (TORCH_VERSION_MAJOR >= 2)

namespace c10d {
class Backend;
class ProcessGroup;
} // namespace c10d

namespace actorpipe::compat {

/// What c10d's Gloo and NCCL groups derive from, and so what a replica group holds.
#if ACTORPIPE_TORCH_2
using process_group = c10d::Backend;
#else
using process_group = c10d::ProcessGroup;
#endif

/// A c10::Allocator written once: derived classes implement allocate_bytes (const on both lines).
class allocator : public c10::Allocator {
public:
  virtual c10::DataPtr allocate_bytes(std::size_t n) const = 0;
#if ACTORPIPE_TORCH_2
  c10::DataPtr allocate(std::size_t n) override {
    return allocate_bytes(n);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
#else
  c10::DataPtr allocate(std::size_t n) const override {
    return allocate_bytes(n);
  }
#endif
};

/// The key under which torch::optim keeps a parameter's state.
#if ACTORPIPE_TORCH_2
inline void* optimizer_state_key(const void* tensor_impl) {
  return const_cast<void*>(tensor_impl);
}
#else
inline std::string optimizer_state_key(const void* tensor_impl) {
  return c10::guts::to_string(tensor_impl);
}
#endif

/// std::get_if on 2.x, c10::get_if on 1.13 (options such as Conv2dOptions::padding).
template <class T, class Variant>
auto* get_if(Variant* v) {
#if ACTORPIPE_TORCH_2
  return std::get_if<T>(v);
#else
  return c10::get_if<T>(v);
#endif
}

/// Autocast's thread-local state for one device type (CPU or CUDA).
inline bool autocast_enabled(c10::DeviceType type) {
#if ACTORPIPE_TORCH_2
  return at::autocast::is_autocast_enabled(type);
#else
  return type == c10::DeviceType::CUDA ? at::autocast::is_enabled()
                                       : at::autocast::is_cpu_enabled();
#endif
}

inline void set_autocast_enabled(c10::DeviceType type, bool enabled) {
#if ACTORPIPE_TORCH_2
  at::autocast::set_autocast_enabled(type, enabled);
#else
  if (type == c10::DeviceType::CUDA) {
    at::autocast::set_enabled(enabled);
  } else {
    at::autocast::set_cpu_enabled(enabled);
  }
#endif
}

inline c10::ScalarType autocast_dtype(c10::DeviceType type) {
#if ACTORPIPE_TORCH_2
  return at::autocast::get_autocast_dtype(type);
#else
  return type == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype()
                                       : at::autocast::get_autocast_cpu_dtype();
#endif
}

inline void set_autocast_dtype(c10::DeviceType type, c10::ScalarType dtype) {
#if ACTORPIPE_TORCH_2
  at::autocast::set_autocast_dtype(type, dtype);
#else
  if (type == c10::DeviceType::CUDA) {
    at::autocast::set_autocast_gpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_cpu_dtype(dtype);
  }
#endif
}

/// A strong reference to an autograd node, and one taken from the node itself.
#if ACTORPIPE_TORCH_2
using node_ref = decltype(std::declval<torch::autograd::Node&>().getptr());
inline node_ref hold(torch::autograd::Node& node) {
  return node.getptr();
}
#else
using node_ref = std::shared_ptr<torch::autograd::Node>;
inline node_ref hold(torch::autograd::Node& node) {
  return node.shared_from_this();
}
#endif

namespace detail {
template <class Graph, class Generator, class = void>
struct takes_generator : std::false_type {};
template <class Graph, class Generator>
struct takes_generator<Graph, Generator,
                       std::void_t<decltype(std::declval<Graph&>().register_generator_state(
                         std::declval<const Generator&>()))>> : std::true_type {};
} // namespace detail

/// Registers a device's default generator with a CUDA graph about to be captured, so that a replay
/// advances it as the eager work would. 2.11's at::cuda::CUDAGraph takes it from the caller; 2.15's
/// has no such overload, and its capture_begin registers the current device's default generator
/// itself: the caller makes the graph's device current on both lines.
template <class Graph, class Generator>
void register_generator(Graph& graph, const Generator& generator) {
  if constexpr (detail::takes_generator<Graph, Generator>::value) {
    graph.register_generator_state(generator);
  }
}

/// Runs a backward on the calling thread, not on the autograd engine's worker thread of the
/// device, while alive (thread-local: make one around each backward, on the thread that runs
/// it), so that two stages on one GPU launch their backwards side by side. On 1.13 nothing:
/// that line computes on the CPU, whose backward runs on the calling thread already.
class backward_on_this_thread {
public:
#if ACTORPIPE_TORCH_2
  backward_on_this_thread()
    : was_(c10::AutogradState::get_tls_state().get_multithreading_enabled()) {
    c10::AutogradState::get_tls_state().set_multithreading_enabled(false);
  }
  ~backward_on_this_thread() {
    c10::AutogradState::get_tls_state().set_multithreading_enabled(was_);
  }
#else
  backward_on_this_thread() {} // user-provided: an object that does nothing is not "unused"
  ~backward_on_this_thread() {}
#endif
  backward_on_this_thread(const backward_on_this_thread&) = delete;
  backward_on_this_thread& operator=(const backward_on_this_thread&) = delete;

#if ACTORPIPE_TORCH_2
private:
  bool was_;
#endif
};

} // namespace actorpipe::compat
