#include "cli/flags.hpp"

#include <memory>
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

uint64_t parse_bytes(const char* flag, const std::string& value) {
  try {
    return training::parse_bytes(value);
  } catch (const std::invalid_argument& e) {
    throw CLI::ValidationError(flag, e.what());
  }
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

namespace {

// What a setting's flag takes, in the words CLI11's help (and config_file's messages) use.
const char* type_name_of(training::setting_kind kind) {
  switch (kind) {
  case training::setting_kind::count:
  case training::setting_kind::milliseconds:
    return "UINT";
  case training::setting_kind::number:
    return "FLOAT";
  default:
    return "TEXT";
  }
}

} // namespace

void add_setting_flags(CLI::App* cmd, training::run_settings& s, training::front_end front) {
  for (const auto& row : training::setting_table()) {
    if (!row.bound_by(front)) {
      continue;
    }
    auto set = [&s, &row](const std::string& text) {
      try {
        training::set_setting(s, row, text, training::flag_for);
      } catch (const std::invalid_argument& e) {
        throw CLI::ValidationError(e.what());
      }
    };
    if (row.kind == training::setting_kind::flag) {
      cmd->add_flag_function(
        row.flag(), [set](int64_t count) { set(count > 0 ? "true" : "false"); }, row.help);
    } else {
      cmd->add_option_function<std::string>(row.flag(), set, row.help)
        ->default_str(row.shown)
        ->type_name(type_name_of(row.kind));
    }
  }
}

void add_plan_flags(CLI::App* cmd, planning_args& plan, training::front_end front) {
  auto held = std::make_shared<training::run_settings>();
  held->plan = plan;
  add_setting_flags(cmd, *held, front);
  cmd->parse_complete_callback([held, &plan] { plan = held->plan; });
}

} // namespace actorpipe::cli
