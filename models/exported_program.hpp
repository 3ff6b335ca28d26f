/// \file
/// Internal to models/: a `torch.export` program read from a PT2 archive and planned for the
/// c10 dispatcher, and the interpreter that runs a range of its nodes with autograd recording
/// as in eager. Compiled on the PyTorch 2.x line only (the archive's schema types ship with
/// that libtorch); exported.cpp cuts the program into segments, the layers of a layer list.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/core/Device.h>

namespace actorpipe::exported {

/// An index into a run's value table: every named value of the graph has one.
using slot = int32_t;

/// One argument of one node, resolved against the op's schema at load time.
struct argument_plan {
  enum class kind : uint8_t {
    constant,         // `constant` as it is
    value,            // the value table's `value`
    scalar_tensor,    // the value table's `value` (a SymInt), as a 0-dim wrapped number
    tensors,          // a Tensor[] of `values`
    optional_tensors, // a Tensor?[] of `values` (-1: None)
    ints,             // an int[] of `ints`, where `values[i]` >= 0 takes a SymInt instead
    device,           // the device the program runs on (the graph names the export's)
    mode,             // `train`/`training` given as true: the module's training mode
  };
  kind how = kind::constant;
  c10::IValue constant;
  slot value = -1;
  std::vector<slot> values;
  std::vector<int64_t> ints;
};

/// Where a node's returns go.
struct output_plan {
  enum class kind : uint8_t { none, one, list };
  kind how = kind::none;
  slot value = -1;
  std::vector<slot> values;
};

/// The `_operator.*` SymInt arithmetic of programs with dynamic shapes, on ints.
using builtin = int64_t (*)(int64_t, int64_t);

/// One node: an op through the dispatcher, or a builtin.
struct node {
  std::string name;
  std::string target;
  std::optional<c10::OperatorHandle> op;
  builtin arithmetic = nullptr;
  std::vector<argument_plan> arguments;
  std::vector<output_plan> outputs;
  /// The submodules the node ran in, outermost first ("layers.0", "layers.0.attn", ...;
  /// empty for the model's own forward and for nodes PyTorch made without a module), and the
  /// class of each ("transformers.models.llama.modeling_llama.LlamaDecoderLayer").
  std::vector<std::string> modules;
  std::vector<std::string> module_types;
  /// Slots the node writes in place (its schema's mutable arguments).
  std::vector<slot> writes;
  /// Draws random numbers (dropout, bernoulli, rand*).
  bool draws_random = false;
  /// Runs in train mode only (batch norm's num_batches_tracked += 1).
  bool training_only = false;
};

/// A parameter, buffer or constant: the tensor, and every slot and name that refer to it (a
/// tied parameter is one tensor under several names).
struct state_tensor {
  std::string name;               // the first name the graph uses it by (an fqn)
  std::vector<std::string> names; // every fqn that is this tensor, `name` first
  std::vector<slot> slots;        // the graph inputs bound to it
  at::Tensor tensor;
  enum class kind : uint8_t { parameter, buffer, constant } role = kind::parameter;
  bool persistent = true;
};

/// A user input's batch dimension: a symbol with its range, or a fixed size.
struct batch_dimension {
  std::string input;
  std::optional<std::string> symbol;
  int64_t fixed = 0;
  int64_t min = 1;
  int64_t max = INT64_MAX;
};

/// A whole program, planned.
struct program {
  std::string what;                // names the archive in errors
  std::vector<std::string> values; // slot -> the graph's name
  std::vector<node> nodes;
  /// Nodes before which a user's pipe_split() marker stood.
  std::vector<std::size_t> markers;
  std::vector<slot> user_inputs;
  /// What the last segment returns, for the loss: the program's only output, else the one named
  /// `logits` in the dict or ModelOutput forward returns, else its first; the others are not
  /// kept.
  std::vector<slot> user_outputs;
  std::vector<state_tensor> state;
  /// Buffers a functional graph returns anew: (slot of the new value, state index).
  std::vector<std::pair<slot, std::size_t>> mutations;
  std::vector<batch_dimension> batch;
  /// Slots that hold a SymInt (a size), not a tensor.
  std::set<slot> sym_ints;
  /// "TRAINING" (torch.export.export) or "ATEN" (after run_decompositions()).
  std::string dialect;

  slot slot_of(const std::string& name);
  const std::string& name_of(slot s) const { return values.at(static_cast<std::size_t>(s)); }

private:
  std::map<std::string, slot> slots_;
};

/// Our op for `name` ("transformers::grouped_mm_fallback") with `overload` where it is one a
/// Python library registers and actorpipe runs itself (library_ops(), models/transformers_ops.cpp).
std::optional<c10::OperatorHandle> library_op(const std::string& name, const std::string& overload);

/// The schema major version of PT2 archives this build reads (the wheel's schema.yaml).
int schema_major();

/// Reads the program `model` ("model" unless the archive holds others) of a PT2 archive's
/// bytes. Throws invalid_argument naming `what` and, where there is one, the node and op: not a
/// PT2 archive or truncated, another schema major version, an op not registered in this process
/// (a custom op), a higher-order op, a decomposed graph with an op that has no autograd formula,
/// a tensor-subclass weight, an input or output kind the engine cannot give.
program read_program(const std::string& bytes, const std::string& what, const std::string& model);

/// A run's value table.
using values = std::vector<c10::IValue>;

/// How a run's nodes see the module: its device, its training mode.
struct run_context {
  c10::Device device = c10::Device(c10::kCPU);
  bool training = true;
};

/// Runs nodes [begin, end) of `p` on `table`, dropping each value at `drop[i]` after node i.
/// Throws c10::Error with the node's name and op in front of libtorch's own message.
void run_nodes(const program& p, values& table, std::size_t begin, std::size_t end,
               const run_context& context, const std::vector<std::vector<slot>>& drop);

} // namespace actorpipe::exported
