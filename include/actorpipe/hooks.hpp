/// \file
/// Hooks described by value (hook_spec): built-ins by name and TorchScript modules, which stages
/// on nodes build for themselves and in-process stages may use as well.
#pragma once

#include <functional>
#include <string>

#include <actorpipe/options.hpp>

namespace actorpipe {

/// A hook function as stage_hooks takes it: the built-in or TorchScript module `spec` describes
/// (an empty spec gives an empty function). `where` names the hook in errors ("after_forward",
/// say). Throws invalid_argument for an unknown built-in or a malformed argument (naming it and
/// the known built-ins), or TorchScript bytes that are no hook (load_torchscript_function).
std::function<void(const hook_context&, torch::Tensor&)> make_hook(const hook_spec& spec,
                                                                   const std::string& where);

/// Both hooks of `specs` (make_hook).
stage_hooks make_hooks(const hook_specs& specs);

/// Reads a hook from a command line: "clamp:V", "check_finite", or the path of a TorchScript file
/// (read into hook_spec::torchscript, its path as the name). Throws invalid_argument naming the
/// flag when the file cannot be read; the spec is checked by make_hook.
hook_spec hook_from_text(const std::string& text, const std::string& flag);

} // namespace actorpipe
