#include "training/run_plan.hpp"

#include <actorpipe/hooks.hpp>

namespace actorpipe::training {

pipeline_options run_plan::options() const {
  return pipeline_options_for(choice_, settings_.plan, settings_.pipeline);
}

run_plan plan_run(const layer_list& layers, const torch::Tensor& batch, run_settings settings) {
  auto choice = choose_plan(layers, batch, settings.plan);
  return {std::move(choice), std::move(settings)};
}

std::string run_pipeline::join_address() const {
  return single ? single->join_address() : replicated->join_address();
}

run_pipeline start_run(engine& sys, run_model model, const run_plan& plan,
                       std::optional<std::size_t> rank) {
  const auto& s = plan.settings();
  const auto& cut = plan.choice().cut;
  auto po = plan.options();
  if (rank) {
    po.data_parallel.rank = *rank;
  }
  if (!po.placement.nodes.empty()) {
    model.remote.hooks = s.hooks;
    if (s.replicas > 1) {
      return {nullptr, std::make_unique<replicated_pipeline>(sys, model.remote, cut, std::move(po),
                                                             s.replicas)};
    }
    return {std::make_unique<pipeline>(sys, std::move(model.remote), cut, std::move(po)), nullptr};
  }
  po.hooks = make_hooks(s.hooks);
  if (s.replicas > 1) {
    ACTORPIPE_CHECK(model.replica != nullptr, "start_run: ", s.replicas,
                    " replicas in this process need a maker of each one's layers "
                    "(run_model::replica)");
    return {nullptr, std::make_unique<replicated_pipeline>(sys, model.replica, cut, std::move(po),
                                                           s.replicas)};
  }
  return {std::make_unique<pipeline>(sys, std::move(model.layers), cut, std::move(po)), nullptr};
}

} // namespace actorpipe::training
