#include "cli/flags.hpp"

#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include <CLI/CLI.hpp>

namespace actorpipe::cli {
namespace {

// --model gpt's sizes.
void add_gpt_flags(CLI::App* cmd, model_args& m) {
  cmd->add_option("--layers", m.layers, "gpt: transformer blocks (0: 4)")->capture_default_str();
  cmd->add_option("--heads", m.heads, "gpt: attention heads (0: 4)")->capture_default_str();
  cmd->add_option("--width", m.width, "gpt: embedding width, a multiple of --heads (0: 128)")
    ->capture_default_str();
  cmd->add_option("--context", m.context, "gpt: tokens per sequence (0: 64)")
    ->capture_default_str();
  cmd->add_option("--dropout", m.dropout, "gpt: dropout probability")->capture_default_str();
}

// Images: synthetic ones' side, and an image folder's.
void add_image_flags(CLI::App* cmd, model_args& m) {
  cmd
    ->add_option("--image", m.image,
                 "Synthetic data and images:DIR: the images' side (an image folder's are resized "
                 "and cropped to it)")
    ->capture_default_str();
  cmd->add_option("--channels", m.channels, "images:DIR: 3 (RGB) or 1 (grey)")
    ->capture_default_str();
  cmd
    ->add_option("--bad-images", m.bad_images,
                 "images:DIR: a file that is not a readable image stops the run (fail) or is "
                 "left out with a warning naming it (skip)")
    ->capture_default_str();
}

} // namespace

void add_model_flags(CLI::App* cmd, model_args& m) {
  cmd
    ->add_option("--data", m.data,
                 "Data: fashion-mnist (real, 1x28x28, 10 classes), text (real: character tokens "
                 "of Debian's fortunes, or --text-file), synthetic, tensors:PATH (a file "
                 "written by Python's torch.save({\"inputs\": X, \"targets\": Y}, PATH), read "
                 "in order), or images:DIR (a folder of class folders of JPEG/PNG images, or of "
                 "train/ and val/ splits; docs/images.md)")
    ->capture_default_str()
    ->check(CLI::Validator(
      [](std::string& value) -> std::string {
        if (value == "fashion-mnist" || value == "text" || value == "synthetic" ||
            value.rfind("tensors:", 0) == 0 || value.rfind("images:", 0) == 0) {
          return {};
        }
        return "'" + value + "' is not fashion-mnist, text, synthetic, tensors:PATH or images:DIR";
      },
      "DATA"));
  cmd->add_option("--model", m.model,
                  "Model: resnet18, resnet34, resnet50, resnet101, mlp, cnn, gpt, or a model file "
                  "written in Python: a PT2 archive (PATH.pt2, written by torch.export.save("
                  "torch.export.export(model, example)); the PyTorch 2.x line) or a TorchScript "
                  "nn.Sequential (PATH.pt; docs/from-pytorch.md) (default: cnn for fashion-mnist, "
                  "gpt for text, resnet50 for synthetic, resnet18 for images:DIR)");
  cmd
    ->add_option("--segments", m.segments,
                 "--model PATH.pt2: where the graph is cut into layers: auto (at pipe_split() "
                 "markers if any, else at the model's repeated blocks, else modules), blocks "
                 "(each repeated block: a decoder layer, a ResNet block; the embedding and the "
                 "head apart), modules (each top-level submodule), modules:K (submodules K "
                 "deep), markers, or nodes (every op)")
    ->capture_default_str();
  cmd->add_option("--init-from", m.init_from,
                  "--model PATH.pt2: start from these weights, matched by name: a .safetensors "
                  "file or a save_pretrained folder (model.safetensors, or shards and "
                  "model.safetensors.index.json); a wrapper's prefix (model.) is matched; a "
                  "tensor missing, left over or of another shape or dtype is refused by name");
  cmd
    ->add_option("--batch", m.batch,
                 "Samples per batch (0: 64 for fashion-mnist, 32 sequences for gpt, 120 for "
                 "synthetic)")
    ->capture_default_str();
  add_gpt_flags(cmd, m);
  add_image_flags(cmd, m);
  cmd
    ->add_option(
      "--classes", m.classes,
      "Synthetic data: output classes (0: 1000 for ResNets, else 10; gpt: its vocabulary, "
      "0: 64)")
    ->capture_default_str();
  cmd->add_option("--seed", m.seed, "Seed for parameters and data")->capture_default_str();
  cmd->add_flag("--deferred-bn", m.deferred_batch_norm,
                "ResNets: batch norm updates running statistics once per step from the whole "
                "batch (deferred batch norm), not once per micro-batch");
  cmd->add_flag("--resnet-blocks", m.block_layers,
                "ResNets: one layer per residual block (layer1.0, layer1.1, ...) instead of one "
                "per torchvision stage, so partitions cut between any two blocks; same parameters "
                "and checkpoint keys");
}

namespace {

// A count of at least `least`, or "auto" (nullopt).
std::optional<std::size_t> count_or_auto(const std::string& flag, const std::string& value,
                                         std::size_t least) {
  if (value == "auto") {
    return std::nullopt;
  }
  std::size_t used = 0;
  unsigned long long n = 0;
  try {
    n = std::stoull(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || value.empty() || value[0] == '-' || n < least) {
    throw CLI::ValidationError(flag, "'" + value + "' is neither a count" +
                                       (least > 0 ? " >= " + std::to_string(least) : "") +
                                       " nor auto");
  }
  return static_cast<std::size_t>(n);
}

// A number and its unit: {n, bytes per unit}, the factor 0 when no unit is given. `flag` and
// `what` name it in errors.
std::pair<double, double> number_and_unit(const char* flag, const std::string& value,
                                          const char* what) {
  std::size_t used = 0;
  double n = -1;
  try {
    n = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || n < 0) {
    throw CLI::ValidationError(flag, "'" + value + "' is " + what);
  }
  auto unit = value.substr(used);
  if (unit.empty()) {
    return {n, 0.0};
  }
  static const std::pair<const char*, double> units[] = {
    {"B", 1},      {"KB", 1e3},        {"MB", 1e6},          {"GB", 1e9},
    {"KiB", 1024}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}};
  for (const auto& [name, factor] : units) {
    if (unit == name) {
      return {n, factor};
    }
  }
  throw CLI::ValidationError(flag, "'" + value + "': unknown unit '" + unit +
                                     "' (B, KB, MB, GB, KiB, MiB, GiB)");
}

// "2" (micro-batches) or "512MB", "1.5GiB", "4096B" (bytes of activations).
void parse_stash_cap(const std::string& value, planning_args& a) {
  auto [n, factor] = number_and_unit(
    "--max-stash", value, "neither a micro-batch count nor bytes (e.g. 2, 512MB, 1.5GiB)");
  a.max_stash = factor == 0 ? n : 0;
  a.max_stash_bytes = factor == 0 ? 0 : static_cast<int64_t>(n * factor);
}

// "2GiB", "512MB" (0: no cap): the most a stage may hold.
void parse_memory_cap(const std::string& value, planning_args& a) {
  auto [n, factor] =
    number_and_unit("--max-memory", value, "not bytes with a unit (e.g. 512MB, 2GiB; 0: no cap)");
  if (factor == 0 && n != 0) {
    throw CLI::ValidationError("--max-memory", "'" + value + "' needs a unit (e.g. 512MB, 2GiB)");
  }
  a.max_memory_bytes = static_cast<int64_t>(n * factor);
}

} // namespace

uint64_t parse_bytes(const char* flag, const std::string& value) {
  auto [n, factor] = number_and_unit(flag, value, "not bytes (e.g. 512MB, 5GiB)");
  return static_cast<uint64_t>(n * (factor == 0 ? 1.0 : factor));
}

void add_recompute_flag(CLI::App* cmd, planning_args& a) {
  cmd
    ->add_option_function<std::string>(
      "--recompute",
      [&a](const std::string& v) {
        a.recompute = v;
        a.recompute_given = true;
      },
      "Activation recomputation: never, except_last (all but each step's last micro-batch) or "
      "always: keep only each stage's input between forward and backward and recompute the "
      "forward during backward (less memory, more time; docs/transformers.md). Left out under "
      "--max-memory, the planner chooses it when that is what fits (docs/memory.md)")
    ->default_str(a.recompute); // parse_recompute_mode names the modes
}

CLI::Validator at_least(double least) {
  std::ostringstream bound;
  bound << least;
  return CLI::Validator(
    [least, text = bound.str()](std::string& value) -> std::string {
      double v = 0;
      if (!CLI::detail::lexical_cast(value, v)) {
        return "'" + value + "' is not a number";
      }
      return v >= least ? std::string{} : "must be >= " + text + " (got " + value + ")";
    },
    ">=" + bound.str());
}

CLI::Option* add_parsed_flag(CLI::App* cmd, const std::string& name,
                             std::function<void(const std::string&)> set, const std::string& shown,
                             const std::string& help) {
  return cmd
    ->add_option_function<std::string>(
      name,
      [name, set = std::move(set)](const std::string& text) {
        try {
          set(text);
        } catch (const std::invalid_argument& e) {
          throw CLI::ValidationError(name, e.what());
        }
      },
      help)
    ->default_str(shown);
}

CLI::Option* add_milliseconds_flag(CLI::App* cmd, const std::string& name,
                                   std::chrono::milliseconds& field, int64_t least,
                                   const std::string& help) {
  return cmd
    ->add_option_function<int64_t>(
      name, [&field](int64_t ms) { field = std::chrono::milliseconds(ms); }, help)
    ->check(at_least(static_cast<double>(least)))
    ->default_str(std::to_string(field.count()));
}

namespace {

// The pipeline's layout: stages, micro-batches, chunks, schedule and cut.
void add_layout_flags(CLI::App* cmd, planning_args& a) {
  cmd
    ->add_option_function<std::string>(
      "--stages",
      [&a](const std::string& v) { a.stages = count_or_auto("--stages", v, 1).value_or(0); },
      "Pipeline stages (stage actors), >= 1, or auto: the planner profiles the layers at every "
      "thread count and micro-batch size, ranks stage counts (1 up to the cores or "
      "--max-stages), threads, micro-batches, schedules and partitions by simulated step, "
      "prints the ranking and runs the fastest (docs/planner.md)")
    ->default_str(std::to_string(a.stages));
  cmd
    ->add_option("--max-stages", a.max_stages,
                 "--stages auto: the most stages to try (0: the cores)")
    ->capture_default_str();
  cmd
    ->add_option("--microbatches", a.microbatches,
                 "Micro-batches per batch, >= 1 (0 with --schedule auto: let it choose; with "
                 "--stages auto chosen unless given)")
    ->capture_default_str();
  cmd
    ->add_option("--chunks", a.chunks,
                 "Model chunks per stage (interleaved and interleaved-zb; the V schedules zb-v, "
                 "v-half, v-min and dualpipe-v hold 2)")
    ->capture_default_str();
  cmd
    ->add_option("--schedule", a.schedule,
                 "Schedule: " + known_schedules() +
                   ", auto (fastest simulated with profiled costs) or file:PATH (JSON: "
                   "{\"programs\": [[\"F0\", ...], ...]}); with --stages auto chosen unless "
                   "given")
    ->capture_default_str();
  cmd
    ->add_option(
      "--partition", a.partition,
      "How to cut the layer list: uniform (by layer count), params (balance "
      "parameters), time (balance profiled time) or cut:I,J (stages start at layers I, J); "
      "with --stages auto the fastest of uniform, params and time unless given")
    ->capture_default_str();
}

// What the planner may use (memory caps, threads) and how it profiles.
void add_planner_flags(CLI::App* cmd, planning_args& a) {
  cmd
    ->add_option_function<std::string>(
      "--max-stash", [&a](const std::string& v) { parse_stash_cap(v, a); },
      "The planner's memory cap (--schedule auto, --stages auto): most micro-batches a stage "
      "may stash (e.g. 2), or most bytes of activations it may keep (e.g. 512MB, 2GiB); 0: no "
      "limit")
    ->default_str("0");
  cmd
    ->add_option_function<std::string>(
      "--max-memory", [&a](const std::string& v) { parse_memory_cap(v, a); },
      "The planner's memory cap per stage (--schedule auto, --stages auto): the most a stage "
      "may hold at its peak, predicted (parameters, gradients, optimizer state, stashed "
      "activations; docs/memory.md), e.g. 2GiB; 0: no limit")
    ->default_str("0");
  cmd
    ->add_option_function<std::string>(
      "--threads",
      [&a](const std::string& v) {
        auto count = count_or_auto("--threads", v, 0);
        a.threads_auto = !count;
        a.threads = count.value_or(a.threads);
      },
      "Intra-op threads per stage (0: cores divided among the stages; auto: the planner tries "
      "every count that fits the cores)")
    ->default_str("0");
  cmd
    ->add_option("--profile-repeats", a.profile_repeats,
                 "Timed rounds per layer when profiling (after two warm-up passes; medians)")
    ->capture_default_str()
    ->check(CLI::PositiveNumber);
  cmd->add_flag("--cold-memory", a.cold_memory,
                "Stage threads give freed tensor buffers back to the system (libtorch's "
                "allocator) instead of keeping them warm for the next micro-batch");
}

} // namespace

void add_pipeline_flags(CLI::App* cmd, planning_args& a) {
  add_layout_flags(cmd, a);
  add_planner_flags(cmd, a);
  cmd->parse_complete_callback([cmd, &a] {
    a.stages_given = cmd->count("--stages") > 0;
    a.schedule_given = cmd->count("--schedule") > 0;
    a.partition_given = cmd->count("--partition") > 0;
    a.microbatches_given = cmd->count("--microbatches") > 0;
  });
}

} // namespace actorpipe::cli
