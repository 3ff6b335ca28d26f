/// \file
/// The cheap weight pass of zero-bubble schedules (Qi et al., "Zero Bubble Pipeline
/// Parallelism"): B computes only the input gradient, W only the weight gradients, and the two
/// together cost what one fused backward costs.
///
/// Without it, W is a second walk of the autograd graph from the stage's outputs with the
/// parameters as its targets: every intermediate gradient B already computed is computed again,
/// so B + W costs nearly two backwards. With it:
/// - before B, `prepare` walks the graph once and finds the *weight nodes*: the nodes on the
///   path from the outputs to the stage's inputs with an edge towards a parameter, directly or
///   through nodes off that path (a linear's addmm and its weight's transpose, a convolution, a
///   batch or layer norm, an add of a learned position embedding, a custom function such as the
///   oneDNN 1x1 convolution); a hook on each keeps the gradient B hands it;
/// - B runs with the inputs as its only targets, so every weight node computes its input
///   gradient alone (a convolution skips its weight-gradient kernel);
/// - W cuts each weight node's edges into B's part of the graph and runs every weight node once
///   on its kept gradient: each computes its parameters' gradients alone (a linear's
///   dW = g^T x, a convolution's weight kernel) from the tensors it saved in forward, and what
///   lies off the input path (the transpose) runs once, as in any backward. No node of B runs
///   again.
/// Norm layers (batch, layer, group norm) are the exception: their weight and bias gradients
/// reduce over what their input gradient reduces over anyway, so B computes all three in one
/// kernel (`input_backward`) rather than W reading the activations a second time.
/// A stage output computed from parameters alone (off the input path) gets no weight pass
/// (`prepare` returns null) and W walks the graph as before. Gradients equal the fused
/// backward's (tests/stages/stage_test.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::autograd {
struct Node;
}

namespace actorpipe::stages {

class weight_pass {
public:
  /// For the graph from `roots` to `inputs` (the tensors B differentiates for) and the
  /// `parameters` W differentiates for; null when an output depends on parameters but not on
  /// the inputs, or no input needs a gradient.
  static std::shared_ptr<weight_pass> prepare(const std::vector<at::Tensor>& roots,
                                              const std::vector<at::Tensor>& inputs,
                                              const std::vector<at::Tensor>& parameters);

  weight_pass(const weight_pass&) = delete;
  weight_pass& operator=(const weight_pass&) = delete;
  ~weight_pass();

  /// Bytes of the gradients kept from B for W.
  int64_t kept_bytes() const;

private:
  friend std::vector<at::Tensor> input_backward(const std::vector<at::Tensor>&,
                                                const std::vector<at::Tensor>&,
                                                const std::vector<at::Tensor>&, const weight_pass*);
  friend bool weight_backward(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                              const std::vector<at::Tensor>&, weight_pass*);
  struct capture;
  weight_pass();
  // After B: whether every weight node received its gradient (else W must walk the graph).
  bool complete() const;
  // W: accumulates the parameters' gradients from the weight nodes alone. Once.
  void run();
  // Of `parameters`, those whose gradients B did not compute.
  std::vector<at::Tensor> left_for_w(const std::vector<at::Tensor>& parameters) const;
  std::vector<capture> captures_;
  // Parameters whose gradients B computes (norm layers' weights and biases).
  std::vector<at::Tensor> in_b_;
  bool ran_ = false;
};

/// B: the gradients of `inputs` from `roots` (graph retained, for W). With a weight pass, B also
/// computes the gradients of the norm layers' weights and biases (in the same kernel as their
/// input gradient) and accumulates them into their `.grad`; W then leaves those nodes alone.
std::vector<at::Tensor> input_backward(const std::vector<at::Tensor>& roots,
                                       const std::vector<at::Tensor>& inputs,
                                       const std::vector<at::Tensor>& root_gradients,
                                       const weight_pass* pass);

/// W, after `input_backward` with the same `pass`: the weight pass when it applies (returns
/// true), else a walk of the graph from `roots` for the `parameters` whose gradients B did not
/// compute (false; nothing to do when B computed them all). Accumulates into their `.grad`.
bool weight_backward(const std::vector<at::Tensor>& roots,
                     const std::vector<at::Tensor>& root_gradients,
                     const std::vector<at::Tensor>& parameters, weight_pass* pass);

} // namespace actorpipe::stages
