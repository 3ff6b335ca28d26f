/// \file
/// CUDA graphs for a stage (docs/gpu.md#cuda-graphs): when a stage captures, which of its
/// micro-batches replay, what runs eagerly and why (graph_book), and what one micro-batch's
/// graphs own (graph_pass). Device-blind: the captures go through device_context::capture, a
/// GPU's CUDA graphs or, in the tests, a device that records its calls on the CPU.
///
/// The plan, after Megatron-LM's per-micro-batch graphs under pipeline parallelism: a stage runs
/// its first `warmup_steps` training steps eagerly (cuDNN's and cuBLAS's lazy set-up happen
/// there), then captures, in the next step and in its program's order, a forward and a backward
/// graph per micro-batch into a pool of its own, and replays them from then on. Graphs of one
/// pool are safe to replay in the order they were captured, or in any part of that order that
/// keeps each micro-batch's forward and backward together: a step whose program differs from
/// the captured one runs eagerly, and a micro-batch whose input differs in shape runs eagerly
/// with its backward.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include <actorpipe/bundle.hpp>
#include <actorpipe/options.hpp>

#include "stages/device.hpp"

namespace actorpipe::stages {

/// The shapes, types and gradient flags of a bundle's tensors: a graph replays only on inputs
/// like those it was captured on.
struct tensor_signature {
  std::vector<std::vector<int64_t>> shapes;
  std::vector<c10::ScalarType> types;
  std::vector<bool> gradients;

  static tensor_signature of(const bundle& b);
  /// `b`'s with a target tensor after its own (the last stage's forward takes both).
  static tensor_signature of(const bundle& b, const at::Tensor& target);
  bool operator==(const tensor_signature& o) const {
    return shapes == o.shapes && types == o.types && gradients == o.gradients;
  }
  bool operator!=(const tensor_signature& o) const { return !(*this == o); }
  /// "[4, 16] Float, [4] Long".
  std::string str() const;
};

/// One action of a stage's training program as its graphs see it.
struct graph_action {
  enum class kind { forward, backward, weight } what = kind::forward;
  int32_t microbatch = 0;
  bool operator==(const graph_action& o) const {
    return what == o.what && microbatch == o.microbatch;
  }
};

/// The decisions of one stage (one chunk of a stage actor): eager, capture or replay, action by
/// action, and the notes a person should read once (why a stage or a micro-batch runs eagerly).
class graph_book {
public:
  enum class use { eager, capture, replay };

  /// `who` names the stage in notes ("stage 1"); `device_captures`: its device can
  /// (device_context::captures_graphs).
  graph_book(std::string who, cuda_graph_mode mode, bool device_captures,
             std::size_t warmup_steps = 2);

  /// From now on eager, saying `why` once ("stage 1 runs without CUDA graphs: <why>").
  void turn_off(const std::string& why);
  bool is_off() const { return off_; }

  /// A training step starts with this program (the stage's forwards, backwards and weight
  /// passes, in order). Steps before the capture step count as warm-up.
  void begin_step(const std::vector<graph_action>& program);

  /// What the forward of `microbatch` does with an input of `signature` in this step: eager in
  /// warm-up, in a step whose program is not the captured one and where the signature is not
  /// the one captured; capture in the capture step; replay after it.
  use forward(int32_t microbatch, const tensor_signature& signature);
  /// What its backward does: what its forward did (capture or replay), eager otherwise.
  use backward(int32_t microbatch) const;

  /// The stage captured `microbatch`'s forward on `signature`.
  void captured(int32_t microbatch, tensor_signature signature);
  /// The capture step failed before its end (a step aborted): its graphs are dropped and the
  /// next step captures again. Nothing in another step.
  bool abandon_capture();
  /// A capture failed: eager from now on, with `why`.
  void capture_failed(const std::string& why) { turn_off("its capture failed: " + why); }

  /// `auto` during warm-up: an eager action took `ms` on the host.
  void observe(double ms);

  /// What to say, each line once, taken (the stage actor logs them).
  std::vector<std::string> take_notes();

  /// Replays and captures so far (forwards and backwards counted apart).
  std::size_t replays() const { return replays_; }
  std::size_t captures() const { return captures_; }
  void count_replay() { ++replays_; }
  void count_capture() { ++captures_; }

private:
  void note(const std::string& line);

  std::string who_;
  cuda_graph_mode mode_;
  std::size_t warmup_steps_;
  bool off_ = false;
  std::size_t steps_ = 0;
  // The capture step's program; whether this step replays (its program is that one), or
  // captures.
  std::vector<graph_action> captured_program_;
  bool capturing_ = false;
  bool replaying_ = false;
  // The signature each micro-batch's graphs were captured on, and this step's decisions.
  std::map<int32_t, tensor_signature> signatures_;
  std::map<int32_t, use> this_step_;
  double observed_ms_ = 0;
  std::size_t observed_ = 0;
  std::vector<std::string> notes_;
  std::set<std::string> said_;
  std::size_t replays_ = 0;
  std::size_t captures_ = 0;
};

/// What one micro-batch's graphs own: static buffers that every replay reads and writes in
/// place, and the two graphs. `roots` are the forward's outputs as autograd made them (its
/// backward starts there); `outputs` and `input_gradients` are copies the graphs write, which
/// leave the stage (graph-owned: they stay valid until the same graph replays again, a step
/// later). On the last stage `outputs` holds the unscaled loss and `gradients` the scale.
struct graph_pass {
  bundle input;
  at::Tensor target;
  bundle roots;
  bundle outputs;
  std::vector<at::Tensor> gradients;
  std::vector<at::Tensor> input_gradients;
  /// Which of the stage's parameters the backward reaches (a graph walk at its capture): their
  /// gradients are the tensors the graph adds into; the others stay as eager leaves them.
  std::vector<bool> reached;
  std::unique_ptr<device_graph> forward;
  std::unique_ptr<device_graph> backward;
};

/// A bundle's tensors cloned (detached), each still requiring a gradient where `b`'s did: a
/// graph's static input.
bundle static_copy(const bundle& b);
/// Copies `from`'s tensors into `into`'s, in place (the shapes checked by the signature).
void copy_into(const bundle& into, const bundle& from);

} // namespace actorpipe::stages
