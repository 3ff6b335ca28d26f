/// \file
/// The fields of the option structs a stage spec carries to a node (model_options,
/// optimizer_spec, hook_spec), each listed once: the node protocol's serializer and parser walk
/// these lists (nodes/protocol.cpp), as they walk stage_settings' visit_fields, so a field added
/// to one of these structs reaches nodes once it has its line here (tests/nodes/nodes_test.cpp
/// fails until it has).
#pragma once

#include <actorpipe/options.hpp>

namespace actorpipe::nodes {

/// Calls `f(name, field)` for every field of a model_options, in order.
template <class Options, class F>
void visit_model_options(Options& o, F&& f) {
  f("num_classes", o.num_classes);
  f("in_channels", o.in_channels);
  f("image_size", o.image_size);
  f("deferred_batch_norm", o.deferred_batch_norm);
  f("small_stem", o.small_stem);
  f("block_layers", o.block_layers);
  f("vocabulary", o.vocabulary);
  f("layers", o.layers);
  f("heads", o.heads);
  f("width", o.width);
  f("context", o.context);
  f("dropout", o.dropout);
}

/// Calls `f(name, field)` for every field of an optimizer_spec, in order.
template <class Spec, class F>
void visit_optimizer_spec(Spec& o, F&& f) {
  f("name", o.name);
  f("lr", o.lr);
  f("momentum", o.momentum);
  f("weight_decay", o.weight_decay);
  f("nesterov", o.nesterov);
}

/// Calls `f(name, field)` for every field of a hook_spec, in order.
template <class Spec, class F>
void visit_hook_spec(Spec& h, F&& f) {
  f("builtin", h.builtin);
  f("torchscript", h.torchscript);
  f("name", h.name);
}

} // namespace actorpipe::nodes
