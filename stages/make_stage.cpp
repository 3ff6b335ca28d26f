// Making a stage: its slice of the cut's layers on its device, what in them draws random numbers
// or keeps batch-norm statistics, the parameters it ties with other stages (a copy on every stage
// but the first holder's), and its optimizer (stages/stage.hpp).
#include "stages/stage.hpp"

#include <map>
#include <set>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/dropout.h>

#include <actorpipe/batch_norm.hpp>
#include <actorpipe/errors.hpp>

#include "stages/stage_helpers.hpp"

namespace actorpipe::stages {
using namespace stage_helpers;
namespace {

// Modules whose training forward draws from the CPU generator.
bool draws_random(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::DropoutImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::Dropout2dImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::Dropout3dImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::AlphaDropoutImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::FeatureAlphaDropoutImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::RReLUImpl*>(&m) != nullptr;
}

} // namespace

stage::stage(stage_config config, layer_list layers) : config_(config), layers_(std::move(layers)) {
  ACTORPIPE_CHECK(!layers_.empty(), "stage ", config_.index, " has no layers");
  for (auto& l : layers_) {
    if (auto m = l.module()) {
      m->to(config_.device);
      for (auto& sub : m->modules(/*include_self=*/true)) {
        if (auto bn = std::dynamic_pointer_cast<DeferredBatchNorm2dImpl>(sub)) {
          batch_norms_.push_back(std::move(bn));
        }
        draws_random_ = draws_random_ || draws_random(*sub);
        if (const auto* own = dynamic_cast<const random_source*>(sub.get())) {
          draws_random_ = draws_random_ || own->draws_random();
        }
      }
    }
  }
}

void stage::attach_optimizer(const optimizer_factory& make) {
  std::lock_guard<std::mutex> guard{mutex_};
  make_optimizer_ = make;
  auto params = parameters();
  if (!params.empty()) {
    optimizer_ = make(std::move(params));
  }
}

std::vector<torch::Tensor> stage::parameters() const {
  std::vector<torch::Tensor> result;
  std::set<const c10::TensorImpl*> seen; // a parameter tied between two layers here is one
  for (const auto& l : layers_) {
    if (auto m = l.module()) {
      for (auto& p : m->parameters()) {
        if (seen.insert(p.unsafeGetTensorImpl()).second) {
          result.push_back(p);
        }
      }
    }
  }
  return result;
}

bool stage::is_copy(const std::string& name) const {
  auto shared = config_.shared_ties.find(name);
  return shared != config_.shared_ties.end() && shared->second;
}

std::map<std::string, torch::Tensor> stage::shared_parameters() const {
  std::lock_guard<std::mutex> guard{mutex_};
  std::map<std::string, torch::Tensor> result;
  for_each_named(layers_, false, config_.tied, [&](const std::string& name, torch::Tensor p) {
    if (config_.shared_ties.count(name) == 1) {
      if (!p.grad().defined()) {
        p.mutable_grad() = torch::zeros_like(p);
      }
      result.emplace(name, p);
    }
  });
  return result;
}

std::vector<torch::Tensor> stage::buffers() const {
  std::vector<torch::Tensor> result;
  for (const auto& l : layers_) {
    if (auto m = l.module()) {
      for (auto& b : m->buffers()) {
        result.push_back(b);
      }
    }
  }
  return result;
}

namespace {

// One holder of a parameter tensor: its layer, its stage and its name in the layer.
struct holder {
  std::size_t layer;
  std::size_t stage;
  std::string parameter;
};

// The holders of each parameter tensor, in model order (tied_parameters' walk, with indices),
// and the tensors in the order first held.
struct holders_of_tensors {
  std::map<const c10::TensorImpl*, std::vector<holder>> holders;
  std::vector<const c10::TensorImpl*> order;
};

holders_of_tensors find_holders(const layer_list& layers, const partition& cut) {
  holders_of_tensors found;
  std::size_t stage = 0;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    while (i >= cut.end(stage)) {
      ++stage;
    }
    if (auto m = layers[i].module()) {
      for (const auto& item : m->named_parameters()) {
        auto& list = found.holders[item.value().unsafeGetTensorImpl()];
        if (list.empty()) {
          found.order.push_back(item.value().unsafeGetTensorImpl());
        }
        list.push_back({i, stage, item.key()});
      }
    }
  }
  return found;
}

// Fills config.tied and config.shared_ties for stage k, and gives this stage's holders of a tie
// whose first holder is on an earlier stage a copy of it (one copy per stage).
void tie_stage(const layer_list& layers, const partition& cut, std::size_t k,
               stage_config& config) {
  auto found = find_holders(layers, cut);
  for (const auto* impl : found.order) {
    const auto& list = found.holders[impl];
    if (list.size() < 2) {
      continue;
    }
    auto name_of = [&](const holder& h) { return layers[h.layer].qualified(h.parameter); };
    auto tie = name_of(list.front());
    bool shared = false;
    std::vector<holder> here;
    for (const auto& h : list) {
      shared = shared || h.stage != list.front().stage;
      if (h.stage == k) {
        config.tied[name_of(h)] = tie;
        here.push_back(h);
      }
    }
    if (here.empty() || !shared) {
      continue;
    }
    bool copy = list.front().stage != k;
    config.shared_ties[tie] = copy;
    for (const auto& h : list) {
      config.tie_holders.insert(h.stage);
    }
    if (copy) {
      torch::NoGradGuard no_grad;
      auto tensor = layers[here.front().layer].module()->named_parameters()[here.front().parameter];
      tensor = tensor.detach().clone().set_requires_grad(true);
      for (const auto& h : here) {
        tie_parameter(layers[h.layer], h.parameter, tensor);
      }
    }
  }
}

} // namespace

std::shared_ptr<stage> make_stage(const layer_list& layers, const partition& cut, std::size_t k,
                                  c10::Device device, const optimizer_factory& optimizer,
                                  precision_mode precision) {
  stage_config config;
  config.precision = precision;
  config.index = k;
  config.count = cut.stages();
  config.first_layer = cut.begin(k);
  config.device = device;
  layer_list slice(layers.begin() + static_cast<std::ptrdiff_t>(cut.begin(k)),
                   layers.begin() + static_cast<std::ptrdiff_t>(cut.end(k)));
  tie_stage(layers, cut, k, config);
  auto st = std::make_shared<stage>(config, std::move(slice));
  if (optimizer) {
    st->attach_optimizer(optimizer);
  }
  return st;
}

} // namespace actorpipe::stages
