#include <actorpipe/losses.hpp>

#include <torch/nn/functional/loss.h>

#include <actorpipe/errors.hpp>

namespace actorpipe {

loss_function builtin_loss(const std::string& name) {
  if (name == "mse") {
    return [](const torch::Tensor& y, const torch::Tensor& t) { return torch::mse_loss(y, t); };
  }
  if (name == "cross_entropy") {
    return [](const torch::Tensor& y, const torch::Tensor& t) {
      // A language model's logits [N, T, classes] against tokens [N, T]: the mean over tokens.
      if (y.dim() == 3 && t.dim() == 2) {
        return torch::nn::functional::cross_entropy(y.flatten(0, 1), t.flatten());
      }
      return torch::nn::functional::cross_entropy(y, t);
    };
  }
  throw invalid_argument(detail::concat("unknown loss '", name, "' (known: mse, cross_entropy)"));
}

} // namespace actorpipe
