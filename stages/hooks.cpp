#include <actorpipe/hooks.hpp>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>

#include <torch/torch.h>

#include <actorpipe/errors.hpp>
#include <actorpipe/torchscript.hpp>

namespace actorpipe {
namespace {

constexpr const char* known = "clamp:V (V > 0), check_finite, or a TorchScript file";

// "clamp:V" as V > 0.
double clamp_bound(const std::string& builtin, const std::string& where) {
  auto text = builtin.substr(builtin.find(':') + 1);
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  ACTORPIPE_CHECK(!text.empty() && *end == '\0' && v > 0 && std::isfinite(v), where, " hook '",
                  builtin, "': the bound after clamp: must be a number above 0");
  return v;
}

} // namespace

std::function<void(const hook_context&, torch::Tensor&)> make_hook(const hook_spec& spec,
                                                                   const std::string& where) {
  ACTORPIPE_CHECK(spec.builtin.empty() || spec.torchscript.empty(), where,
                  " hook: give a built-in ('", spec.builtin, "') or TorchScript (", spec.name,
                  "), not both");
  if (!spec.torchscript.empty()) {
    auto what = detail::concat("the ", where, " hook ",
                               spec.name.empty() ? std::string("(TorchScript)") : spec.name);
    auto function = load_torchscript_function(spec.torchscript, what);
    return [function](const hook_context&, torch::Tensor& t) { t = function(t); };
  }
  const auto& b = spec.builtin;
  if (b.empty()) {
    return {};
  }
  if (b.rfind("clamp:", 0) == 0) {
    auto v = clamp_bound(b, where);
    return [v](const hook_context&, torch::Tensor& t) {
      torch::NoGradGuard no_grad;
      t = t.clamp(-v, v);
    };
  }
  if (b == "check_finite") {
    return [](const hook_context& c, torch::Tensor& t) {
      if (t.is_floating_point() && !torch::isfinite(t).all().item<bool>()) {
        throw invalid_argument(detail::concat("check_finite: a NaN or an infinity at step ", c.step,
                                              " (", torch::isnan(t).sum().item<int64_t>(),
                                              " NaN of ", t.numel(), " values)"));
      }
    };
  }
  throw invalid_argument(detail::concat("unknown ", where, " hook '", b, "' (known: ", known, ")"));
}

stage_hooks make_hooks(const hook_specs& specs) {
  stage_hooks hooks;
  hooks.after_forward = make_hook(specs.after_forward, "after_forward");
  hooks.after_backward = make_hook(specs.after_backward, "after_backward");
  return hooks;
}

hook_spec hook_from_text(const std::string& text, const std::string& flag) {
  hook_spec spec;
  if (text == "check_finite" || text.rfind("clamp:", 0) == 0) {
    spec.builtin = text;
    return spec;
  }
  std::ifstream in(text, std::ios::binary);
  ACTORPIPE_CHECK(in.good(), flag, " '", text, "' is neither a built-in hook (", known,
                  ") nor a file that can be read");
  spec.torchscript.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  spec.name = "'" + text + "'";
  return spec;
}

} // namespace actorpipe
