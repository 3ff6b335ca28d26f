#include "training/settings.hpp"

#include <algorithm>
#include <cctype>
#include <utility>

#include <actorpipe/errors.hpp>
#include <actorpipe/hooks.hpp>
#include <actorpipe/optimizers.hpp>
#include <actorpipe/replicas.hpp>

namespace actorpipe::training {

namespace {

constexpr unsigned everywhere = train_front | plan_front | bench_front | python_front;
constexpr unsigned run_fronts = train_front | python_front;

// A number of at least `least`.
double number_of(const std::string& text, double least) {
  std::size_t used = 0;
  double n = 0;
  try {
    n = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  ACTORPIPE_CHECK(used == text.size() && used > 0, "'", text, "' is not a number");
  ACTORPIPE_CHECK(n >= least, "must be >= ", least, " (got ", text, ")");
  return n;
}

// A whole number of at least `least`.
std::size_t count_of(const std::string& text, std::size_t least) {
  auto n = number_of(text, static_cast<double>(least));
  ACTORPIPE_CHECK(n == static_cast<double>(static_cast<long long>(n)), "'", text,
                  "' is not a whole number");
  return static_cast<std::size_t>(n);
}

bool flag_of(const std::string& text) {
  ACTORPIPE_CHECK(text == "true" || text == "false", "'", text, "' is neither true nor false");
  return text == "true";
}

std::chrono::milliseconds milliseconds_of(const std::string& text, std::size_t least) {
  return std::chrono::milliseconds(count_of(text, least));
}

std::string ms_shown(std::chrono::milliseconds ms) {
  return std::to_string(ms.count());
}

// "2" (micro-batches) or "512MB", "1.5GiB" (bytes of activations), for --max-stash.
void set_stash_cap(planning_args& a, const std::string& text) {
  uint64_t bytes = 0;
  try {
    bytes = parse_bytes(text);
  } catch (const std::invalid_argument&) {
    if (!text.empty() && std::isdigit(static_cast<unsigned char>(text[0])) != 0) {
      throw; // a number with an unknown unit: parse_bytes names the units
    }
    throw invalid_argument("'" + text +
                           "' is neither a micro-batch count nor bytes (e.g. 2, "
                           "512MB, 1.5GiB)");
  }
  bool counted = text.find_first_not_of("0123456789.") == std::string::npos;
  a.max_stash = counted ? number_of(text, 0) : 0;
  a.max_stash_bytes = counted ? 0 : static_cast<int64_t>(bytes);
}

void set_memory_cap(planning_args& a, const std::string& text) {
  auto bytes = parse_bytes(text);
  ACTORPIPE_CHECK(bytes == 0 || text.find_first_not_of("0123456789.") != std::string::npos, "'",
                  text, "' needs a unit (e.g. 512MB, 2GiB)");
  a.max_memory_bytes = static_cast<int64_t>(bytes);
}

dp_backend dp_backend_of(const std::string& text) {
  ACTORPIPE_CHECK(text == "auto" || text == "gloo" || text == "nccl", "unknown backend '", text,
                  "' (choose auto, gloo or nccl)");
  return text == "gloo"   ? dp_backend::gloo
         : text == "nccl" ? dp_backend::nccl
                          : dp_backend::automatic;
}

std::optional<std::string> on_nodes(const run_settings& s, const setting_spelling& spell) {
  if (s.pipeline.placement.nodes.empty()) {
    return "applies to stages on nodes (" + spell("nodes") + ")";
  }
  return std::nullopt;
}

std::optional<std::string> on_gpus(const run_settings& s, const setting_spelling& spell) {
  const auto& d = s.plan.devices;
  if (s.pipeline.cuda_graphs != cuda_graph_mode::off &&
      std::none_of(d.begin(), d.end(), [](const c10::Device& x) { return x.is_cuda(); })) {
    return "applies to stages on GPUs (" + spell("devices") +
           " cuda:N): every stage of this run computes on the CPU";
  }
  return std::nullopt;
}

using setter = std::function<void(run_settings&, const std::string&)>;
using applier =
  std::function<std::optional<std::string>(const run_settings&, const setting_spelling&)>;

setting row(const char* name, setting_kind kind, unsigned fronts, std::string shown,
            std::string help, setter set, applier applies = {}) {
  return setting{
    name, kind, fronts, std::move(shown), std::move(help), std::move(set), std::move(applies)};
}

// The layout's rows: stages, micro-batches, chunks, schedule, cut.
void add_layout_rows(std::vector<setting>& t) {
  const planning_args d;
  t.push_back(
    row("stages", setting_kind::text, everywhere, std::to_string(d.stages),
        "Pipeline stages (stage actors), >= 1, or auto: the planner profiles the layers at "
        "every thread count and micro-batch size, ranks stage counts (1 up to the cores or "
        "max-stages), threads, micro-batches, schedules and partitions by simulated step, "
        "prints the ranking and runs the fastest (docs/planner.md)",
        [](run_settings& s, const std::string& v) {
          s.plan.stages = count_or_auto(v, 1).value_or(0);
          s.plan.stages_given = true;
        }));
  t.push_back(
    row("max_stages", setting_kind::count, everywhere, "0",
        "stages auto: the most stages to try (0: the cores)",
        [](run_settings& s, const std::string& v) { s.plan.max_stages = count_of(v, 0); }));
  t.push_back(row("microbatches", setting_kind::count, everywhere, std::to_string(d.microbatches),
                  "Micro-batches per batch, >= 1 (0 with schedule auto: let it choose; with stages "
                  "auto chosen unless given)",
                  [](run_settings& s, const std::string& v) {
                    s.plan.microbatches = count_of(v, 0);
                    s.plan.microbatches_given = true;
                  }));
  t.push_back(row("chunks", setting_kind::count, everywhere, std::to_string(d.chunks),
                  "Model chunks per stage (interleaved and interleaved-zb; the V schedules zb-v, "
                  "v-half, v-min and dualpipe-v hold 2)",
                  [](run_settings& s, const std::string& v) { s.plan.chunks = count_of(v, 1); }));
  t.push_back(row("schedule", setting_kind::text, everywhere, d.schedule,
                  "Schedule: " + known_schedules() +
                    ", auto (fastest simulated with profiled costs) or file:PATH (JSON: "
                    "{\"programs\": [[\"F0\", ...], ...]}); with stages auto chosen unless given",
                  [](run_settings& s, const std::string& v) {
                    s.plan.schedule = v;
                    s.plan.schedule_given = true;
                  }));
  t.push_back(
    row("partition", setting_kind::text, everywhere, d.partition,
        "How to cut the layer list: uniform (by layer count), params (balance parameters), "
        "time (balance profiled time) or cut:I,J (stages start at layers I, J); with "
        "stages auto the fastest of uniform, params and time unless given",
        [](run_settings& s, const std::string& v) {
          s.plan.partition = v;
          s.plan.partition_given = true;
        }));
}

// What the planner may use (memory caps, threads, recomputation) and how it profiles.
void add_planner_rows(std::vector<setting>& t) {
  t.push_back(
    row("max_stash", setting_kind::text, everywhere, "0",
        "The planner's memory cap (schedule auto, stages auto): most micro-batches a stage "
        "may stash (e.g. 2), or most bytes of activations it may keep (e.g. 512MB, 2GiB); "
        "0: no limit",
        [](run_settings& s, const std::string& v) { set_stash_cap(s.plan, v); }));
  t.push_back(
    row("max_memory", setting_kind::text, everywhere, "0",
        "The planner's memory cap per stage (schedule auto, stages auto): the most a stage "
        "may hold at its peak, predicted (parameters, gradients, optimizer state, stashed "
        "activations; docs/memory.md), e.g. 2GiB; 0: no limit",
        [](run_settings& s, const std::string& v) { set_memory_cap(s.plan, v); }));
  t.push_back(
    row("threads", setting_kind::text, everywhere, "0",
        "Intra-op threads per stage (0: cores divided among the stages; auto: the planner "
        "tries every count that fits the cores)",
        [](run_settings& s, const std::string& v) {
          auto count = count_or_auto(v, 0);
          s.plan.threads_auto = !count;
          s.plan.threads = count.value_or(s.plan.threads);
        }));
  t.push_back(row("profile_repeats", setting_kind::count, everywhere, "5",
                  "Timed rounds per layer when profiling (after two warm-up passes; medians)",
                  [](run_settings& s, const std::string& v) {
                    s.plan.profile_repeats = static_cast<int>(count_of(v, 1));
                  }));
  t.push_back(row("cold_memory", setting_kind::flag, everywhere, "false",
                  "Stage threads give freed tensor buffers back to the system (libtorch's "
                  "allocator) instead of keeping them warm for the next micro-batch",
                  [](run_settings& s, const std::string& v) { s.plan.cold_memory = flag_of(v); }));
  t.push_back(
    row("recompute", setting_kind::text, train_front | plan_front | python_front, "never",
        "Activation recomputation: never, except_last (all but each step's last "
        "micro-batch) or always: keep only each stage's input between forward and backward "
        "and recompute the forward during backward (less memory, more time; "
        "docs/transformers.md). Left out under max-memory, the planner chooses it when "
        "that is what fits (docs/memory.md)",
        [](run_settings& s, const std::string& v) {
          parse_recompute_mode(v);
          s.plan.recompute = v;
          s.plan.recompute_given = true;
        }));
}

// How each stage computes and how long it waits.
void add_stage_rows(std::vector<setting>& t) {
  const pipeline_options d;
  t.push_back(
    row("precision", setting_kind::text, run_fronts, to_string(d.precision),
        "fp32, or bf16 mixed precision: each stage computes under autocast to bfloat16 "
        "(CPU autocast, or CUDA autocast for a stage on a GPU), activations and their "
        "gradients cross stages in bf16, parameters and the optimizer stay fp32 (on a CPU "
        "fast only with avx512_bf16 or amx_bf16; docs/transformers.md, docs/gpu.md)",
        [](run_settings& s, const std::string& v) { s.pipeline.precision = parse_precision(v); }));
  t.push_back(row(
    "cuda_graphs", setting_kind::text, run_fronts, to_string(d.cuda_graphs),
    "auto, on or off: after two eager steps each stage on a GPU captures a CUDA graph "
    "for the forward and the backward of each micro-batch and replays them (auto: "
    "where its eager actions averaged under 2 ms on the host); not with stages on the "
    "CPU (docs/gpu.md#cuda-graphs)",
    [](run_settings& s, const std::string& v) {
      s.pipeline.cuda_graphs = parse_cuda_graph_mode(v);
    },
    on_gpus));
  t.push_back(
    row("max_grad_norm", setting_kind::number, run_fronts, "0",
        "Clip the global gradient norm (all stages, all replicas) to this value; 0: off",
        [](run_settings& s, const std::string& v) { s.pipeline.max_grad_norm = number_of(v, 0); }));
  t.push_back(
    row("overlap_steps", setting_kind::flag, train_front, "false",
        "Overlap consecutive steps: each stage starts the next step as soon as it is done "
        "with the one before (its optimizer steps early), the same parameters as without "
        "(stages in this process; docs/schedules.md#overlapping-steps)",
        [](run_settings& s, const std::string& v) { s.pipeline.overlap_steps = flag_of(v); }));
  t.push_back(row("wait_timeout", setting_kind::milliseconds, run_fronts, ms_shown(d.wait_timeout),
                  "Milliseconds a stage waits for an input before failing the step",
                  [](run_settings& s, const std::string& v) {
                    s.pipeline.wait_timeout = milliseconds_of(v, 1);
                  }));
  t.push_back(row("linger_us", setting_kind::count, run_fronts, std::to_string(d.linger.count()),
                  "Microseconds an idle thread of the pipeline (the scheduler, a stage, the caller "
                  "waiting for a step) polls for the message it expects before it sleeps: a polled "
                  "message costs ~1 us, one that wakes a sleeping thread 10-20 us on a VM; at most "
                  "this much CPU per message. 0: sleep at once (cores shared with other work; "
                  "docs/control-plane.md)",
                  [](run_settings& s, const std::string& v) {
                    s.pipeline.linger = std::chrono::microseconds(count_of(v, 0));
                  }));
  t.push_back(row("step_timeout", setting_kind::milliseconds, run_fronts, ms_shown(d.step_timeout),
                  "Milliseconds a whole step may take before it fails (every stage's actions, the "
                  "replicas' all-reduces and the optimizer)",
                  [](run_settings& s, const std::string& v) {
                    s.pipeline.step_timeout = milliseconds_of(v, 1);
                  }));
}

// How stages on nodes are reached and watched.
void add_node_rows(std::vector<setting>& t) {
  const node_placement d;
  t.push_back(row("connect_timeout", setting_kind::milliseconds, run_fronts,
                  ms_shown(d.connect_timeout),
                  "Milliseconds to reach each node and for each control request",
                  [](run_settings& s, const std::string& v) {
                    s.pipeline.placement.connect_timeout = milliseconds_of(v, 1);
                  }));
  t.push_back(row(
    "heartbeat_timeout", setting_kind::milliseconds, run_fronts, ms_shown(d.heartbeat_timeout),
    "Stages on nodes: milliseconds a node may leave a heartbeat unanswered before it "
    "counts as lost (a frozen process, a cut link: found within it and a sixth more), "
    "whatever the longest action; 0: no heartbeats",
    [](run_settings& s, const std::string& v) {
      s.pipeline.placement.heartbeat_timeout = milliseconds_of(v, 0);
    },
    on_nodes));
}

std::optional<std::string> with_replicas(const run_settings& s, const setting_spelling& spell) {
  if (s.pipeline.data_parallel.replicas <= 1) {
    return "applies to replicas (" + spell("replicas") + " > 1)";
  }
  return std::nullopt;
}

// How replicas meet and stay together.
void add_replica_rows(std::vector<setting>& t) {
  const data_parallel_options d;
  t.push_back(row(
    "dp_timeout", setting_kind::milliseconds, run_fronts, ms_shown(d.timeout),
    "Milliseconds to wait for all ranks at the rendezvous and for each all-reduce",
    [](run_settings& s, const std::string& v) {
      s.pipeline.data_parallel.timeout = milliseconds_of(v, 1);
    },
    with_replicas));
  t.push_back(row(
    "dp_backend", setting_kind::text, run_fronts, "auto",
    "Replicas' collectives: auto (NCCL for stages on GPUs, Gloo on the CPU), gloo or "
    "nccl",
    [](run_settings& s, const std::string& v) {
      s.pipeline.data_parallel.backend = dp_backend_of(v);
    },
    with_replicas));
  t.push_back(row(
    "shard", setting_kind::text, run_fronts, to_string(d.shard),
    "Replicas: none, optimizer (each keeps and steps 1/R of every stage's optimizer "
    "state, then the parameters are broadcast from their owners: ZeRO-1) or "
    "gradients (as optimizer, and each gradient is reduced to its owner only: ZeRO-2; "
    "docs/memory.md)",
    [](run_settings& s, const std::string& v) {
      s.pipeline.data_parallel.shard = parse_shard_mode(v);
    },
    with_replicas));
  t.push_back(row("buffers", setting_kind::text, run_fronts, to_string(d.buffers),
                  "Batch-norm statistics across replicas after each step: broadcast (rank 0's), "
                  "average, none",
                  [](run_settings& s, const std::string& v) {
                    s.pipeline.data_parallel.buffers = parse_buffer_sync(v);
                  }));
  t.push_back(
    row("batch_norm", setting_kind::text, train_front, "local",
        "Data parallelism with the ResNets' batch norm: local (each replica normalises "
        "with its own micro-batch's statistics) or sync (statistics over micro-batch k of "
        "every replica, as torch.nn.SyncBatchNorm; docs/data-parallel.md)",
        [](run_settings& s, const std::string& v) {
          ACTORPIPE_CHECK(v == "local" || v == "sync", "'", v, "' is neither local nor sync");
          s.pipeline.data_parallel.sync_batch_norm = v == "sync";
        }));
}

std::vector<setting> make_table() {
  std::vector<setting> t;
  add_layout_rows(t);
  add_planner_rows(t);
  add_stage_rows(t);
  add_node_rows(t);
  add_replica_rows(t);
  return t;
}

} // namespace

const char* to_string(setting_kind kind) {
  switch (kind) {
  case setting_kind::count:
    return "count";
  case setting_kind::number:
    return "number";
  case setting_kind::flag:
    return "flag";
  case setting_kind::milliseconds:
    return "milliseconds";
  case setting_kind::text:
    break;
  }
  return "text";
}

std::string flag_for(const std::string& name) {
  std::string flag = "--" + name;
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

std::string setting::flag() const {
  return flag_for(name);
}

const std::vector<setting>& setting_table() {
  static const std::vector<setting> table = make_table();
  return table;
}

const setting* find_setting(const std::string& name) {
  for (const auto& row : setting_table()) {
    if (name == row.name) {
      return &row;
    }
  }
  return nullptr;
}

void set_setting(run_settings& s, const setting& row, const std::string& text,
                 const setting_spelling& spell) {
  try {
    row.set(s, text);
  } catch (const std::invalid_argument& e) {
    throw invalid_argument(spell(row.name) + ": " + e.what());
  }
  if (std::find(s.given.begin(), s.given.end(), row.name) == s.given.end()) {
    s.given.emplace_back(row.name);
  }
}

namespace {
// --stages auto and --threads auto plan one pipeline on this machine's cores.
void check_layout_auto(const run_settings& s, const run_parts& parts,
                       const setting_spelling& spell) {
  if (!s.plan.layout_auto()) {
    return;
  }
  auto what = spell(s.plan.stages == 0 ? "stages" : "threads") + " auto";
  ACTORPIPE_CHECK(parts.nodes.empty(), what, " plans stages on this machine's cores: with ",
                  spell("nodes"), " (one stage per node) give ", spell("stages"));
  ACTORPIPE_CHECK(parts.replicas == 1 && s.pipeline.data_parallel.replicas <= 1, what,
                  " plans one pipeline on this machine's cores: with replicas (", spell("replicas"),
                  ", or processes of a launcher) give ", spell("stages"), " and ",
                  spell("threads"));
}

// Parts.replicas replicas: one loop for all (replicated_pipeline), or one loop per replica
// thread meeting at an in-process store (parts.replica_loops, stages in this process).
void lay_out_replicas(run_settings& s, const run_parts& parts) {
  if (parts.replicas <= 1) {
    return;
  }
  auto& dp = s.pipeline.data_parallel;
  const bool loops = parts.replica_loops && parts.nodes.empty();
  dp.replicas = parts.replicas;
  dp.rank = 0;
  dp.local = loops ? make_local_rendezvous() : nullptr;
  s.replicas = loops ? 1 : parts.replicas;
}

} // namespace

run_settings settings_for(run_settings s, run_parts parts, const setting_spelling& spell) {
  ACTORPIPE_CHECK(parts.replicas >= 1, spell("replicas"), " must be >= 1");
  check_layout_auto(s, parts, spell);
  ACTORPIPE_CHECK(parts.nodes.empty() || parts.nodes.size() == parts.replicas * s.plan.stages,
                  spell("nodes"), " lists ", parts.nodes.size(), " nodes for ", s.plan.stages,
                  " stages",
                  parts.replicas > 1 ? detail::concat(" of each of ", parts.replicas,
                                                      " replicas (replica after "
                                                      "replica)")
                                     : std::string{});
  make_hooks(parts.hooks); // refused here, before planning, data or nodes; start_run makes them
  s.hooks = std::move(parts.hooks);
  s.pipeline.loss = std::move(parts.loss);
  s.pipeline.optimizer = make_optimizer(parts.optimizer);
  s.pipeline.placement.nodes = parts.nodes;
  s.pipeline.placement.secret = std::move(parts.secret);
  lay_out_replicas(s, parts);
  for (const auto& name : s.given) {
    const auto* row = find_setting(name);
    if (auto why = row->applies ? row->applies(s, spell) : std::nullopt) {
      throw invalid_argument(spell(name) + " " + *why);
    }
  }
  return s;
}

std::optional<std::size_t> count_or_auto(const std::string& text, std::size_t least) {
  if (text == "auto") {
    return std::nullopt;
  }
  std::size_t used = 0;
  unsigned long long n = 0;
  try {
    n = std::stoull(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  ACTORPIPE_CHECK(used == text.size() && !text.empty() && text[0] != '-' && n >= least, "'", text,
                  "' is neither a count", least > 0 ? " >= " + std::to_string(least) : "",
                  " nor auto");
  return static_cast<std::size_t>(n);
}

uint64_t parse_bytes(const std::string& text) {
  std::size_t used = 0;
  double n = -1;
  try {
    n = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  ACTORPIPE_CHECK(used > 0 && n >= 0, "'", text, "' is not bytes (e.g. 512MB, 5GiB)");
  static const std::pair<const char*, double> units[] = {
    {"", 1},     {"B", 1},      {"KB", 1e3},        {"MB", 1e6},
    {"GB", 1e9}, {"KiB", 1024}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}};
  auto unit = text.substr(used);
  for (const auto& [name, factor] : units) {
    if (unit == name) {
      return static_cast<uint64_t>(n * factor);
    }
  }
  throw invalid_argument("'" + text + "': unknown unit '" + unit +
                         "' (B, KB, MB, GB, KiB, MiB, GiB)");
}

} // namespace actorpipe::training
