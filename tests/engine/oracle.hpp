// Shared helpers for pipeline tests: the plain-libtorch oracle.
#pragma once

#include <array>
#include <cstdio>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>
#include <torch/script.h>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>

namespace actorpipe::test {

#ifndef ACTORPIPE_PYTHON
#define ACTORPIPE_PYTHON "/usr/bin/python3"
#endif

#ifdef ACTORPIPE_SOURCE_DIR
/// Runs `ACTORPIPE_PYTHON tests/oracle/<script> <arguments>` (Debian's /usr/bin/python3 with its
/// torch 1.13; the venv's python with the wheel's torch on the 2.x line) and parses the last JSON
/// object it printed. Fails the test, with what Python printed, when Python or torch is missing or
/// the script fails.
inline nlohmann::json python_oracle(const std::string& script, const std::string& arguments) {
  auto command = std::string(ACTORPIPE_PYTHON) + " " + std::string(ACTORPIPE_SOURCE_DIR) +
                 "/tests/oracle/" + script + " " + arguments + " 2>&1";
  std::string output;
  FILE* pipe = ::popen(command.c_str(), "r");
  REQUIRE_MESSAGE(pipe != nullptr, "cannot run ", command);
  std::array<char, 4096> chunk{};
  while (auto n = std::fread(chunk.data(), 1, chunk.size(), pipe)) {
    output.append(chunk.data(), n);
  }
  auto status = ::pclose(pipe);
  INFO("the oracle needs Debian's python3-torch (./setup.sh test installs it): ", command);
  INFO(output);
  REQUIRE(status == 0);
  auto start = output.rfind('{');
  REQUIRE(start != std::string::npos);
  return nlohmann::json::parse(output.substr(start));
}
#endif

/// A tiny MLP (flatten, fc1, relu1, fc2, relu2, fc3) for 1x4x4 inputs and 3 classes, built from
/// `seed` so that two calls give the same parameters.
inline layer_list tiny_mlp(uint64_t seed = 1) {
  torch::manual_seed(seed);
  model_options o;
  o.in_channels = 1;
  o.image_size = 4;
  o.num_classes = 3;
  return make_model("mlp", o);
}

/// tiny_mlp described by value, as stages on nodes build it: MSE, SGD (lr 0.1, momentum 0.9).
inline remote_model tiny_remote(uint64_t seed = 1) {
  remote_model m;
  m.name = "mlp";
  m.options.in_channels = 1;
  m.options.image_size = 4;
  m.options.num_classes = 3;
  m.seed = seed;
  m.loss = "mse";
  m.optimizer.name = "sgd";
  m.optimizer.lr = 0.1;
  m.optimizer.momentum = 0.9;
  return m;
}

/// The built-in gpt with test sizes (2 heads), drawn after torch::manual_seed(seed).
inline layer_list test_gpt(int64_t vocabulary, int64_t blocks, int64_t width, int64_t context,
                           uint64_t seed) {
  torch::manual_seed(seed);
  model_options o;
  o.vocabulary = vocabulary;
  o.layers = blocks;
  o.heads = 2;
  o.width = width;
  o.context = context;
  return make_model("gpt", o);
}

/// Token ids [n, t] below `vocabulary` and as many targets, drawn after torch::manual_seed(seed).
inline std::pair<torch::Tensor, torch::Tensor> random_tokens(int64_t vocabulary, int64_t n,
                                                             int64_t t, uint64_t seed) {
  torch::manual_seed(seed);
  auto x = torch::randint(vocabulary, {n, t});
  auto y = torch::randint(vocabulary, {n, t});
  return {x, y};
}

/// The vocabulary of the tests' tiny GPTs.
constexpr int64_t tiny_vocabulary = 11;

/// Token ids [n, t] over tiny_vocabulary and their targets.
inline std::pair<torch::Tensor, torch::Tensor> tokens(int64_t n, int64_t t, uint64_t seed) {
  return random_tokens(tiny_vocabulary, n, t, seed);
}

/// The parameters of a plain layer list, each once (a tied tensor is one parameter).
inline std::vector<torch::Tensor> unique_parameters(const layer_list& layers) {
  std::vector<torch::Tensor> parameters;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& l : layers) {
    if (auto m = l.module()) {
      for (auto& p : m->parameters()) {
        if (seen.insert(p.unsafeGetTensorImpl()).second) {
          parameters.push_back(p);
        }
      }
    }
  }
  return parameters;
}

inline torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

/// Parameters (or gradients) of a plain layer list, named as the pipeline names them.
inline std::vector<std::pair<std::string, torch::Tensor>> named(const layer_list& layers,
                                                                bool gradients) {
  std::vector<std::pair<std::string, torch::Tensor>> all;
  for (const auto& l : layers) {
    if (auto m = l.module()) {
      for (const auto& item : m->named_parameters()) {
        all.emplace_back(l.name() + "." + item.key(),
                         gradients ? item.value().grad() : item.value().detach());
      }
    }
  }
  return all;
}

/// Every parameter of `layers`, in layer order.
inline std::vector<torch::Tensor> parameters_of(const layer_list& layers) {
  std::vector<torch::Tensor> params;
  for (const auto& lay : layers) {
    if (auto m = lay.module()) {
      for (auto& p : m->parameters()) {
        params.push_back(p);
      }
    }
  }
  return params;
}

/// The same model, trained plainly on the full batch: one step.
struct plain_model {
  layer_list layers;
  std::unique_ptr<torch::optim::Optimizer> optimizer;

  plain_model(layer_list l, const optimizer_factory& make) : layers(std::move(l)) {
    optimizer = make(parameters_of(layers));
  }

  double step(const torch::Tensor& x, const torch::Tensor& t) {
    optimizer->zero_grad();
    auto loss = mse(run_layers(layers, x), t);
    loss.backward();
    optimizer->step();
    return loss.item<double>();
  }
};

/// A built-in schedule with the model chunks per stage it takes.
struct schedule_setting {
  schedule_kind kind;
  std::size_t chunks;
};

/// Every built-in schedule: GPipe, 1F1B, ZB-H1, ZB-H2 (one chunk), interleaved 1F1B and
/// interleaved zero bubble, ZB-V, V-Half, V-Min and DualPipeV (two chunks; the last four in a V).
inline std::vector<schedule_setting> every_schedule() {
  return {{schedule_kind::gpipe, 1},       {schedule_kind::one_f_one_b, 1},
          {schedule_kind::zb_h1, 1},       {schedule_kind::zb_h2, 1},
          {schedule_kind::interleaved, 2}, {schedule_kind::interleaved_zb, 2},
          {schedule_kind::zb_v, 2},        {schedule_kind::v_half, 2},
          {schedule_kind::v_min, 2},       {schedule_kind::dualpipe_v, 2}};
}

/// The micro-batches a test gives `kind` on `stages` stages where it gives the others `m`: 2 x
/// stages to the interleaved ones, at least 2 x stages to dualpipe-v.
inline std::size_t microbatches_for(schedule_kind kind, std::size_t stages, std::size_t m) {
  if (interleaves(kind)) {
    return 2 * stages;
  }
  return kind == schedule_kind::dualpipe_v ? std::max(m, 2 * stages) : m;
}

/// Every tensor of `a` allclose to its namesake in `b`.
inline void check_close(const std::vector<std::pair<std::string, torch::Tensor>>& a,
                        const std::vector<std::pair<std::string, torch::Tensor>>& b,
                        double rtol = 1e-5, double atol = 1e-7) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CAPTURE(a[i].first);
    REQUIRE(a[i].first == b[i].first);
    REQUIRE(a[i].second.defined() == b[i].second.defined());
    if (a[i].second.defined()) {
      // How far apart, where they are not close: the largest difference and where.
      auto difference = (a[i].second - b[i].second).abs().flatten();
      auto worst = difference.numel() > 0 ? difference.argmax().item<int64_t>() : 0;
      CAPTURE(difference.numel() > 0 ? difference[worst].item<double>() : 0.0);
      CAPTURE(difference.numel() > 0 ? b[i].second.flatten()[worst].item<double>() : 0.0);
      CHECK(torch::allclose(a[i].second, b[i].second, rtol, atol));
    }
  }
}

/// The bytes of a TorchScript file holding a module whose methods are `source` (TorchScript, as
/// Python's torch.jit.script would write them), made in C++: a hook for hook_spec::torchscript.
inline std::string script_module_bytes(const std::string& source) {
  torch::jit::Module m("HookModule");
  m.define(source);
  std::ostringstream out;
  m.save(out);
  return out.str();
}

} // namespace actorpipe::test
