#include "cli/flags.hpp"

#include <CLI/CLI.hpp>

namespace actorpipe::cli {

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
                  "Model: resnet18, resnet34, resnet50, resnet101, mlp, cnn, gpt, or a TorchScript "
                  "file (PATH.pt, written by torch.jit.save(torch.jit.script(nn.Sequential(...))); "
                  "docs/from-pytorch.md) (default: cnn for fashion-mnist, gpt for text, resnet50 "
                  "for synthetic, resnet18 for images:DIR)");
  cmd
    ->add_option("--batch", m.batch,
                 "Samples per batch (0: 64 for fashion-mnist, 32 sequences for gpt, 120 for "
                 "synthetic)")
    ->capture_default_str();
  cmd->add_option("--layers", m.layers, "gpt: transformer blocks (0: 4)")->capture_default_str();
  cmd->add_option("--heads", m.heads, "gpt: attention heads (0: 4)")->capture_default_str();
  cmd->add_option("--width", m.width, "gpt: embedding width, a multiple of --heads (0: 128)")
    ->capture_default_str();
  cmd->add_option("--context", m.context, "gpt: tokens per sequence (0: 64)")
    ->capture_default_str();
  cmd->add_option("--dropout", m.dropout, "gpt: dropout probability")->capture_default_str();
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
}

void add_pipeline_flags(CLI::App* cmd, planning_args& a) {
  cmd->add_option("--stages", a.stages, "Pipeline stages (stage actors), >= 1")
    ->capture_default_str();
  cmd
    ->add_option("--microbatches", a.microbatches,
                 "Micro-batches per batch, >= 1 (0 with --schedule auto: let it choose)")
    ->capture_default_str();
  cmd->add_option("--chunks", a.chunks, "Model chunks per stage (interleaved schedule)")
    ->capture_default_str();
  cmd
    ->add_option("--schedule", a.schedule,
                 "Schedule: gpipe, 1f1b, interleaved, zb-h1, auto (fastest simulated with "
                 "profiled costs) or file:PATH (JSON: {\"programs\": [[\"F0\", ...], ...]})")
    ->capture_default_str();
  cmd
    ->add_option(
      "--partition", a.partition,
      "How to cut the layer list: uniform (by layer count), params (balance "
      "parameters), time (balance profiled time) or cut:I,J (stages start at layers I, J)")
    ->capture_default_str();
  cmd
    ->add_option("--max-stash", a.max_stash,
                 "--schedule auto: most micro-batches a stage may stash (0: no limit)")
    ->capture_default_str();
  cmd
    ->add_option("--threads", a.threads,
                 "Intra-op threads per stage (0: cores divided among the stages)")
    ->capture_default_str();
  cmd->add_flag("--cold-memory", a.cold_memory,
                "Stage threads give freed tensor buffers back to the system (libtorch's "
                "allocator) instead of keeping them warm for the next micro-batch");
}

} // namespace actorpipe::cli
