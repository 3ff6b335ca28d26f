// c10d's Gloo and NCCL process groups: their headers are guarded by USE_C10D_GLOO and
// USE_C10D_NCCL, which CMake defines where the build has them (ACTORPIPE_WITH_GLOO, _NCCL).
#include <actorpipe/errors.hpp>
#include <actorpipe/torch_compat.hpp>

#include "comm/replica_failures.hpp"
#include "comm/replica_group.hpp"
#include "logging/log.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/serialize.h>
#ifdef ACTORPIPE_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef ACTORPIPE_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace actorpipe {

namespace detail {
struct local_store {
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
};
} // namespace detail

namespace comm {
namespace {

using clock_type = std::chrono::steady_clock;

// The first line of an exception's text (c10's carry a backtrace after it).
std::string brief(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string text = c10_error ? c10_error->what_without_backtrace() : e.what();
  auto newline = text.find('\n');
  return newline == std::string::npos ? text : text.substr(0, newline);
}

std::string who(const data_parallel_options& o) {
  return detail::concat("data parallel rank ", o.rank, " of ", o.replicas);
}

// Where the rendezvous is, for messages.
std::string rendezvous_of(const data_parallel_options& o) {
  return o.local ? std::string("in process") : detail::concat(o.master_addr, ":", o.master_port);
}

// Rank 0 serves the store (`serve`), everyone else is a client of it.
c10::intrusive_ptr<c10d::Store> connect(const data_parallel_options& o, bool serve) {
  if (o.local) {
    o.local->store->setTimeout(o.timeout);
    return o.local->store;
  }
  c10d::TCPStoreOptions so;
  so.port = o.master_port;
  so.isServer = serve && !o.launcher_store;
  so.waitWorkers = false;
  so.timeout = o.timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(o.master_addr, so);
  } catch (const std::exception& e) {
    throw pipeline_error(detail::concat(who(o), ": ",
                                        serve ? "cannot serve the rendezvous store on "
                                              : "cannot reach the rendezvous store of rank 0 at ",
                                        o.master_addr, ":", o.master_port, " within ",
                                        o.timeout.count(), " ms: ", brief(e)),
                         error_details{error_kind::replica_failure});
  }
}

// Every rank checks in under `prefix`; all wait until every rank has, or name those missing at
// the deadline ("did not arrive at <where> within ...").
void barrier(c10d::Store& store, const data_parallel_options& o, const std::string& prefix,
             const std::vector<uint8_t>& value, const std::string& where) {
  auto key = [&](std::size_t r) { return detail::concat(prefix, r); };
  store.set(key(o.rank), value);
  auto deadline = clock_type::now() + o.timeout;
  for (;;) {
    std::vector<std::size_t> missing;
    for (std::size_t r = 0; r < o.replicas; ++r) {
      if (!store.check({key(r)})) {
        missing.push_back(r);
      }
    }
    if (missing.empty()) {
      return;
    }
    if (clock_type::now() > deadline) {
      std::string names;
      for (auto r : missing) {
        names += (names.empty() ? "" : ", ") + std::to_string(r);
      }
      throw pipeline_error(detail::concat(who(o), ": rank", missing.size() > 1 ? "s " : " ", names,
                                          " of ", o.replicas, " did not arrive at ", where,
                                          " within ", o.timeout.count(), " ms"),
                           error_details{error_kind::replica_failure});
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::unique_ptr<stage_sync::impl> sync_of(const data_parallel_options& o, std::size_t stage);

c10::intrusive_ptr<compat::process_group> form_group(const data_parallel_options& o,
                                                     std::size_t stage, c10::Device device,
                                                     const c10::intrusive_ptr<c10d::Store>& store,
                                                     const std::string& prefix);

} // namespace

struct replica_group::rendezvous {
  c10::intrusive_ptr<c10d::Store> store;
  data_parallel_options options;
  uint64_t calls = 0;
};

struct stage_sync::impl {
  c10::intrusive_ptr<compat::process_group> group;
  // Forms the group under `prefix` in `store`: in the constructor of a replica_group, or for a
  // stage on a node at its first collective, on the stage's thread (every replica's stage
  // reaches its first collective at about the same time; forming waits for all of them).
  std::function<c10::intrusive_ptr<compat::process_group>(
    const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix)>
    form;
  // Where the group's keys go in the store.
  std::string group_prefix;
  // For a stage on a node: connects `store` at the first collective.
  std::function<c10::intrusive_ptr<c10d::Store>()> connect_store;
  // Where the stage's tensors are: NCCL's collectives take tensors on it.
  c10::Device device{c10::kCPU};
  // Other replicas' failed steps (comm/replica_failures.hpp), and why the group was
  // abandoned (empty while it is not).
  std::unique_ptr<failure_watch> failures;
  std::string abandoned;

  compat::process_group& pg() {
    if (!abandoned.empty()) {
      throw pipeline_error(who() + ": the replica group was abandoned when " + abandoned_because +
                             " (" + abandoned +
                             "); build the replicas again (recover() on nodes, or new pipelines "
                             "from the last checkpoint)",
                           error_details{error_kind::replica_failure});
    }
    if (!group) {
      if (!failures->store() && connect_store) {
        failures->attach(connect_store());
      }
      failures->start();
      group = form(failures->store(), group_prefix);
    }
    return *group;
  }

  // Drops the group for good without waiting for it: a collective that the failed replica
  // never joins ends at Gloo's deadline, on a thread of its own.
  void abandon(std::string why) {
    abandoned = std::move(why);
    if (group) {
      std::thread([old = std::move(group)]() mutable { old.reset(); }).detach();
      group.reset();
    }
  }

  // Before a step's first collective, `what`: another replica failed a step since the group
  // formed (this one, or one this replica failed too).
  void refresh(const char* what) {
    if (group && failures->news()) {
      abandon(failures->last());
      throw pipeline_error(
        detail::concat(where(what), " abandoned: ", abandoned_because, " (", abandoned, ")"),
        error_details{error_kind::replica_failure});
    }
    pg();
  }
  std::size_t stage = 0;
  std::size_t rank = 0;
  std::size_t size = 1;
  std::chrono::milliseconds timeout{60000};
  std::size_t bucket_bytes = 25u << 20;

  std::string who() const {
    return detail::concat("stage ", stage, ", data parallel rank ", rank, " of ", size);
  }

  std::string where(const char* what) const { return detail::concat(who(), ": ", what); }

  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what) {
    try {
      if (device.is_cuda()) { // NCCL: WorkNCCL's wait is not one to slice
        work->wait(timeout);
      } else {
        wait_or_abandon(work, what);
      }
    } catch (const pipeline_error&) {
      throw;
    } catch (const std::exception& e) {
      throw pipeline_error(detail::concat(where(what), " failed or passed its deadline of ",
                                          timeout.count(),
                                          " ms (a replica failed or is gone): ", brief(e)),
                           error_details{error_kind::replica_failure});
    }
  }

  // Waits for a Gloo collective in slices, looking between them for another replica's failed
  // step: then the group is abandoned and the step fails at once, not at the deadline.
  void wait_or_abandon(const c10::intrusive_ptr<c10d::Work>& work, const char* what) {
    constexpr std::chrono::milliseconds slice{100};
    auto deadline = clock_type::now() + timeout;
    for (;;) {
      auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now());
      try {
        work->wait(std::max(std::chrono::milliseconds(1), std::min(slice, left)));
        return;
      } catch (const std::exception&) {
        if (work->isCompleted() || clock_type::now() >= deadline) {
          throw;
        }
      }
      if (failures->news()) {
        abandon(failures->last());
        throw pipeline_error(
          detail::concat(where(what), " abandoned: ", abandoned_because, " (", abandoned, ")"),
          error_details{error_kind::replica_failure});
      }
    }
  }

  // Tensors in buckets of one dtype and about bucket_bytes each, in the given order.
  std::vector<std::vector<torch::Tensor>> buckets(const std::vector<torch::Tensor>& tensors) const {
    std::vector<std::vector<torch::Tensor>> out;
    std::size_t bytes = 0;
    for (const auto& t : tensors) {
      if (out.empty() || out.back().front().scalar_type() != t.scalar_type() ||
          bytes >= bucket_bytes) {
        out.emplace_back();
        bytes = 0;
      }
      out.back().push_back(t);
      bytes += t.nbytes();
    }
    return out;
  }

  static torch::Tensor flatten(const std::vector<torch::Tensor>& bucket) {
    std::vector<torch::Tensor> flat;
    flat.reserve(bucket.size());
    for (const auto& t : bucket) {
      flat.push_back(t.detach().reshape({-1}));
    }
    return torch::cat(flat);
  }

  static void unflatten(const torch::Tensor& flat, const std::vector<torch::Tensor>& bucket) {
    int64_t offset = 0;
    for (const auto& t : bucket) {
      auto n = t.numel();
      t.detach().copy_(flat.slice(0, offset, offset + n).view(t.sizes()));
      offset += n;
    }
  }

  // Runs `collective` on each bucket (flattened; all launched before the first is awaited) and
  // copies the results back.
  template <class Collective, class Finish>
  int64_t coalesced(const std::vector<torch::Tensor>& tensors, const char* what,
                    Collective collective, Finish finish) {
    struct pending {
      std::vector<torch::Tensor> members;
      std::vector<torch::Tensor> flat;
      c10::intrusive_ptr<c10d::Work> work;
    };
    std::vector<pending> all;
    int64_t bytes = 0;
    for (auto& bucket : buckets(tensors)) {
      pending p;
      p.flat.push_back(flatten(bucket));
      bytes += static_cast<int64_t>(p.flat[0].nbytes());
      p.members = std::move(bucket);
      p.work = collective(p.flat);
      all.push_back(std::move(p));
    }
    for (auto& p : all) {
      wait(p.work, what);
      finish(p.flat[0]);
      unflatten(p.flat[0], p.members);
    }
    return bytes;
  }

  // `flat` (one tensor) takes rank `root`'s; reduce_to: rank `root`'s becomes the sum.
  c10::intrusive_ptr<c10d::Work> broadcast_from(std::vector<torch::Tensor>& flat,
                                                std::size_t root) {
    c10d::BroadcastOptions options;
    options.rootRank = static_cast<int64_t>(root);
    options.timeout = timeout;
    return pg().broadcast(flat, options);
  }

  c10::intrusive_ptr<c10d::Work> reduce_to(std::vector<torch::Tensor>& flat, std::size_t root) {
    c10d::ReduceOptions options;
    options.rootRank = static_cast<int64_t>(root);
    options.timeout = timeout;
    return pg().reduce(flat, options);
  }

  void broadcast(const std::vector<torch::Tensor>& tensors) {
    coalesced(
      tensors, "broadcast from rank 0",
      [&](std::vector<torch::Tensor>& flat) { return broadcast_from(flat, 0); },
      [](torch::Tensor&) {});
  }

  c10::intrusive_ptr<c10d::Work> all_reduce(std::vector<torch::Tensor>& flat) {
    c10d::AllreduceOptions options;
    options.timeout = timeout;
    return pg().allreduce(flat, options);
  }
};

namespace {

std::string failures_key_of(const data_parallel_options& o) {
  return detail::concat(o.group, "/failures");
}

std::unique_ptr<stage_sync::impl> sync_of(const data_parallel_options& o, std::size_t stage) {
  auto self = std::make_unique<stage_sync::impl>();
  self->stage = stage;
  self->rank = o.rank;
  self->size = o.replicas;
  self->timeout = o.timeout;
  self->bucket_bytes = o.bucket_bytes;
  self->failures = std::make_unique<failure_watch>(failures_key_of(o));
  return self;
}

#ifdef ACTORPIPE_WITH_GLOO
// Whether the replicas meet on this host (Gloo then binds to the loopback interface).
bool on_loopback(const data_parallel_options& o) {
  return o.local || o.master_addr == "127.0.0.1" || o.master_addr == "localhost";
}

std::shared_ptr<::gloo::transport::Device> make_gloo_device(const data_parallel_options& o) {
  for (const char* name : {"ACTORPIPE_GLOO_IFNAME", "GLOO_SOCKET_IFNAME"}) {
    if (const char* ifname = std::getenv(name); ifname && *ifname) {
      return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
    }
  }
  // Set by `actorpipe train` under a cluster's launcher: the address this host's node listens on.
  if (const char* host = std::getenv("ACTORPIPE_GLOO_HOST"); host && *host) {
    return c10d::ProcessGroupGloo::createDeviceForHostname(host);
  }
  if (on_loopback(o)) {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// One transport device serves every group of the process that binds the same way.
std::shared_ptr<::gloo::transport::Device> gloo_device(const data_parallel_options& o) {
  static std::mutex mutex;
  static std::map<bool, std::shared_ptr<::gloo::transport::Device>> devices;
  std::lock_guard<std::mutex> lock(mutex);
  auto& device = devices[on_loopback(o)];
  if (!device) {
    device = make_gloo_device(o);
  }
  return device;
}
#endif

#ifdef ACTORPIPE_WITH_NCCL
// A rank that is gone must fail the step at the deadline, not end the process: collectives wait
// blocking (wait() throws at the timeout) and NCCL's watchdog handles no errors itself. A value
// the user set stays.
void nccl_environment() {
  ::setenv("TORCH_NCCL_BLOCKING_WAIT", "1", 0);
  ::setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0", 0);
  ::setenv("TORCH_NCCL_ENABLE_MONITORING", "0", 0);
}
#endif

// The backend of stage `stage`'s group: the one asked for, or NCCL for a stage on a GPU.
dp_backend backend_of(const data_parallel_options& o, c10::Device device) {
  if (o.backend != dp_backend::automatic) {
    return o.backend;
  }
  return device.is_cuda() ? dp_backend::nccl : dp_backend::gloo;
}

c10::intrusive_ptr<compat::process_group> make_group(const data_parallel_options& o,
                                                     c10::Device device,
                                                     const c10::intrusive_ptr<c10d::Store>& store) {
  auto rank = static_cast<int>(o.rank);
  auto size = static_cast<int>(o.replicas);
  if (backend_of(o, device) == dp_backend::nccl) {
#ifdef ACTORPIPE_WITH_NCCL
    ACTORPIPE_CHECK(device.is_cuda(), who(o),
                    ": NCCL moves CUDA tensors only, but the stage is on ", device.str(),
                    " (--dp-backend gloo for stages on the CPU)");
    nccl_environment();
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = o.timeout;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
    throw invalid_argument(detail::concat(who(o), ": this build of actorpipe has no NCCL (the CUDA "
                                                  "line builds it: ./setup.sh build --torch pip)"));
#endif
  }
#ifdef ACTORPIPE_WITH_GLOO
  ACTORPIPE_CHECK(device.is_cpu(), who(o),
                  ": Gloo replicas here average tensors on the CPU, but "
                  "the stage is on ",
                  device.str(), " (--dp-backend nccl)");
  auto options = c10d::ProcessGroupGloo::Options::create(o.timeout);
  options->devices.push_back(gloo_device(o));
  options->threads = 1;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
#else
  throw invalid_argument(detail::concat(
    who(o), ": this build of actorpipe has no Gloo replica groups (PyTorch's wheel ships no Gloo "
            "headers that match its libtorch): use --dp-backend nccl with stages on GPUs, or "
            "Debian's libtorch (./setup.sh build) for replicas on the CPU"));
#endif
}

// The group of `stage` over every replica's rank, keyed under `prefix` in `store`.
c10::intrusive_ptr<compat::process_group> form_group(const data_parallel_options& o,
                                                     std::size_t stage, c10::Device device,
                                                     const c10::intrusive_ptr<c10d::Store>& store,
                                                     const std::string& prefix) {
  try {
    return make_group(o, device, c10::make_intrusive<c10d::PrefixStore>(prefix, store));
  } catch (const invalid_argument&) {
    throw;
  } catch (const std::exception& e) {
    throw pipeline_error(detail::concat(who(o), ": the process group of stage ", stage,
                                        " did not form within ", o.timeout.count(),
                                        " ms: ", brief(e)),
                         error_details{error_kind::replica_failure});
  }
}

} // namespace

stage_sync::stage_sync(std::unique_ptr<impl> self) : self_(std::move(self)) {}
stage_sync::~stage_sync() = default;

void stage_sync::broadcast(std::vector<torch::Tensor> tensors) {
  self_->refresh("broadcast from rank 0");
  self_->broadcast(tensors);
}

stage_sync::totals stage_sync::sum(double weight, double weighted_loss) {
  auto& s = *self_;
  s.refresh("all-reduce of sample counts"); // a step's first collective
  std::vector<torch::Tensor> meta{
    torch::tensor({weight, weighted_loss}, torch::kDouble).to(s.device)};
  s.wait(s.all_reduce(meta), "all-reduce of sample counts");
  auto totals = meta[0].cpu();
  return {totals[0].item<double>(), totals[1].item<double>()};
}

void stage_sync::all_reduce_sum(torch::Tensor& sums, const char* what) {
  auto& s = *self_;
  std::vector<torch::Tensor> flat{sums};
  s.wait(s.all_reduce(flat), what);
}

int64_t stage_sync::all_reduce_gradients(const std::vector<torch::Tensor>& parameters,
                                         double scale) {
  auto& s = *self_;
  std::vector<torch::Tensor> grads;
  grads.reserve(parameters.size());
  for (auto it = parameters.rbegin(); it != parameters.rend(); ++it) {
    torch::Tensor p = *it; // a handle to the same parameter
    if (!p.grad().defined()) {
      p.mutable_grad() = torch::zeros_like(p);
    }
    grads.push_back(p.grad());
  }
  return s.coalesced(
    grads, "gradient all-reduce",
    [&](std::vector<torch::Tensor>& flat) {
      if (scale != 1.0) {
        flat[0].mul_(scale);
      }
      return s.all_reduce(flat);
    },
    [](torch::Tensor&) {});
}

void stage_sync::sync_buffers(std::vector<torch::Tensor> buffers, buffer_sync mode) {
  auto& s = *self_;
  if (mode == buffer_sync::none || buffers.empty()) {
    return;
  }
  if (mode == buffer_sync::broadcast) {
    s.broadcast(buffers);
    return;
  }
  std::vector<torch::Tensor> floating;
  for (auto& b : buffers) {
    if (b.is_floating_point()) {
      floating.push_back(b);
    }
  }
  average(std::move(floating), "buffer all-reduce");
}

int64_t stage_sync::average(std::vector<torch::Tensor> tensors, const char* what) {
  auto& s = *self_;
  s.refresh(what); // BMUF's block sync: the first collective of its step
  auto n = static_cast<double>(s.size);
  return s.coalesced(
    tensors, what, [&](std::vector<torch::Tensor>& flat) { return s.all_reduce(flat); },
    [n](torch::Tensor& flat) { flat.div_(n); });
}

std::size_t stage_sync::rank() const {
  return self_->rank;
}

std::size_t stage_sync::size() const {
  return self_->size;
}

int64_t stage_sync::reduce_gradients(const std::vector<torch::Tensor>& parameters,
                                     const std::vector<std::size_t>& owner,
                                     const std::vector<bool>& all_reduce, double scale) {
  auto& s = *self_;
  ACTORPIPE_ASSERT(owner.size() == parameters.size() && all_reduce.size() == parameters.size());
  // The tied ones as before; the others in one list per owner, last parameters first.
  std::vector<torch::Tensor> tied;
  std::vector<std::vector<torch::Tensor>> by_owner(s.size);
  for (std::size_t k = parameters.size(); k-- > 0;) {
    torch::Tensor p = parameters[k];
    if (all_reduce[k]) {
      tied.push_back(p);
      continue;
    }
    if (!p.grad().defined()) {
      p.mutable_grad() = torch::zeros_like(p);
    }
    by_owner.at(owner[k]).push_back(p.grad());
  }
  std::reverse(tied.begin(), tied.end()); // model order, as all_reduce_gradients takes them
  int64_t bytes = all_reduce_gradients(tied, scale);
  for (std::size_t r = 0; r < s.size; ++r) {
    bytes += s.coalesced(
      by_owner[r], "gradient reduce to its owner",
      [&](std::vector<torch::Tensor>& flat) {
        if (scale != 1.0) {
          flat[0].mul_(scale);
        }
        return s.reduce_to(flat, r);
      },
      [](torch::Tensor&) {});
  }
  for (std::size_t k = 0; k < parameters.size(); ++k) {
    if (!all_reduce[k] && owner[k] != s.rank) {
      torch::Tensor p = parameters[k];
      p.mutable_grad() = torch::Tensor{};
    }
  }
  return bytes;
}

int64_t stage_sync::broadcast_from_owners(const std::vector<torch::Tensor>& parameters,
                                          const std::vector<std::size_t>& owner) {
  auto& s = *self_;
  ACTORPIPE_ASSERT(owner.size() == parameters.size());
  std::vector<std::vector<torch::Tensor>> by_owner(s.size);
  for (std::size_t k = 0; k < parameters.size(); ++k) {
    by_owner.at(owner[k]).push_back(parameters[k]);
  }
  int64_t bytes = 0;
  for (std::size_t r = 0; r < s.size; ++r) {
    bytes += s.coalesced(
      by_owner[r], "parameter broadcast from their owner",
      [&](std::vector<torch::Tensor>& flat) { return s.broadcast_from(flat, r); },
      [](torch::Tensor&) {});
  }
  return bytes;
}

std::map<std::string, torch::Tensor>
stage_sync::gather_on_first(const std::map<std::string, torch::Tensor>& mine, const char* what) {
  auto& s = *self_;
  s.refresh(what);
  c10::Dict<std::string, torch::Tensor> dict;
  for (const auto& [name, t] : mine) {
    dict.insert(name, t.cpu());
  }
  auto bytes = torch::pickle_save(c10::IValue(dict));
  // Every rank's size, then each rank's bytes broadcast from it (on the group's device).
  auto options = torch::TensorOptions().device(s.device);
  std::vector<torch::Tensor> sizes{
    torch::zeros({static_cast<int64_t>(s.size)}, options.dtype(torch::kInt64))};
  sizes[0][static_cast<int64_t>(s.rank)] = static_cast<int64_t>(bytes.size());
  s.wait(s.all_reduce(sizes), what);
  auto counts = sizes[0].cpu();
  std::map<std::string, torch::Tensor> merged;
  for (std::size_t r = 0; r < s.size; ++r) {
    auto n = counts[static_cast<int64_t>(r)].item<int64_t>();
    std::vector<torch::Tensor> buffer{torch::empty({n}, options.dtype(torch::kUInt8))};
    if (r == s.rank) {
      buffer[0].copy_(torch::from_blob(bytes.data(), {n}, torch::kUInt8));
    }
    s.wait(s.broadcast_from(buffer, r), what);
    if (s.rank != 0) {
      continue;
    }
    auto received = buffer[0].cpu();
    std::vector<char> data(static_cast<std::size_t>(n));
    std::memcpy(data.data(), received.data_ptr(), data.size());
    for (const auto& entry : torch::pickle_load(data).toGenericDict()) {
      merged[entry.key().toStringRef()] = entry.value().toTensor();
    }
  }
  return merged;
}

replica_group::replica_group(const data_parallel_options& o, std::size_t stages,
                             const std::vector<c10::Device>& devices) {
  ACTORPIPE_CHECK(o.replicas >= 1, "data parallel: replicas must be >= 1");
  ACTORPIPE_CHECK(o.rank < o.replicas, "data parallel: rank ", o.rank, " is not below the ",
                  o.replicas, " replicas");
  ACTORPIPE_CHECK(o.timeout.count() > 0, "data parallel: timeout must be > 0 ms");
  ACTORPIPE_CHECK(o.bucket_bytes > 0, "data parallel: bucket_bytes must be > 0");
  auto start = clock_type::now();
  auto store = connect(o, o.rank == 0);
  barrier(*store, o, detail::concat(o.group, "/arrived/"), {1},
          detail::concat("the rendezvous (", rendezvous_of(o), ", group '", o.group, "')"));
  rendezvous_ = std::make_unique<rendezvous>(rendezvous{store, o, 0});
  log::get()->info(
    "{}: all ranks arrived at the rendezvous ({}) after {} ms", who(o), rendezvous_of(o),
    std::chrono::duration_cast<std::chrono::milliseconds>(clock_type::now() - start).count());
  for (std::size_t s = 0; s < stages; ++s) {
    auto self = sync_of(o, s);
    auto device = self->device = s < devices.size() ? devices[s] : c10::Device(c10::kCPU);
    self->failures->attach(store);
    self->group_prefix = detail::concat(o.group, "/stage", s);
    self->form = [o, s, device](const c10::intrusive_ptr<c10d::Store>& store,
                                const std::string& prefix) {
      return form_group(o, s, device, store, prefix);
    };
    self->pg(); // formed now, every rank's at once
    stages_.push_back(std::make_shared<stage_sync>(std::move(self)));
  }
}

std::function<void(uint64_t, const std::string&)> replica_group::failure_announcer() const {
  auto store = rendezvous_->store;
  auto key = failures_key_of(rendezvous_->options);
  auto rank = rendezvous_->options.rank;
  return [store, key, rank](uint64_t step, const std::string& why) {
    if (!failure_watch::announce(*store, key,
                                 detail::concat("rank ", rank, ", step ", step, ": ", why))) {
      log::get()->warn("data parallel rank {}: could not tell the other replicas that step {} "
                       "failed; their collectives end at the deadline",
                       rank, step);
    }
  };
}

std::string replica_group::fresh_prefix(const std::string& what) {
  return detail::concat(rendezvous_->options.group, "/", what, rendezvous_->calls++);
}

std::shared_ptr<stage_sync> join_stage_group(const data_parallel_options& o, std::size_t stage,
                                             const std::string& prefix, c10::Device device) {
  ACTORPIPE_CHECK(o.replicas >= 2 && o.rank < o.replicas, "data parallel: rank ", o.rank, " of ",
                  o.replicas, " replicas");
  ACTORPIPE_CHECK(!o.local, "data parallel: a stage in another process cannot use an in-process "
                            "rendezvous store");
  auto self = sync_of(o, stage);
  self->device = device;
  // A client of rank 0's store (a node never serves it), connected at the first collective.
  self->connect_store = [o] { return connect(o, false); };
  self->group_prefix = detail::concat(prefix, "/stage", stage);
  self->form = [o, stage, device](const c10::intrusive_ptr<c10d::Store>& store,
                                  const std::string& group_prefix) {
    auto start = clock_type::now();
    auto group = form_group(o, stage, device, store, group_prefix);
    log::get()->info(
      "stage {}, {}: formed its replica group after {} ms", stage, who(o),
      std::chrono::duration_cast<std::chrono::milliseconds>(clock_type::now() - start).count());
    return group;
  };
  return std::make_shared<stage_sync>(std::move(self));
}

replica_group::~replica_group() {
  if (!rendezvous_ || rendezvous_->options.local) {
    return;
  }
  // Rank 0 serves the store: it stays until every rank has said it is done with it (within the
  // deadline), so that a rank still finishing its last meeting does not find it gone.
  const auto& o = rendezvous_->options;
  try {
    barrier(*rendezvous_->store, o, detail::concat(o.group, "/departed/"), {1},
            "the end of the run");
  } catch (const std::exception& e) {
    if (o.rank == 0) {
      log::get()->warn("{}", e.what());
    }
  }
}

void replica_group::agree(const std::string& what, int64_t value) {
  const auto& o = rendezvous_->options;
  auto& store = *rendezvous_->store;
  // Keys by call number (every rank calls in the same order), so a repeated `what` is a new
  // meeting; the value carries `what` so ranks at different meetings are told apart.
  auto prefix = detail::concat(o.group, "/agree/", rendezvous_->calls++, "/");
  auto mine = detail::concat(value, " at ", what);
  barrier(store, o, prefix, std::vector<uint8_t>(mine.begin(), mine.end()), what);
  std::string values;
  bool same = true;
  for (std::size_t r = 0; r < o.replicas; ++r) {
    auto bytes = store.get(detail::concat(prefix, r));
    std::string theirs(bytes.begin(), bytes.end());
    same = same && theirs == mine;
    auto at = theirs.find(" at ");
    auto shown = theirs.substr(at + 4) == what ? theirs.substr(0, at) : theirs;
    values += detail::concat(r == 0 ? "" : ", ", "rank ", r, ": ", shown);
  }
  if (!same) {
    throw pipeline_error(
      detail::concat(who(o), ": the ranks disagree on ", what, " (", values, ")"),
      error_details{error_kind::replica_failure});
  }
}

std::shared_ptr<detail::local_store> make_local_store() {
  return std::make_shared<detail::local_store>();
}

} // namespace comm
} // namespace actorpipe
