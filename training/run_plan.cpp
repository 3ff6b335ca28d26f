#include "training/run_plan.hpp"

#include <actorpipe/hooks.hpp>
#include <actorpipe/partition.hpp>

#include "logging/log.hpp"

namespace actorpipe::training {

pipeline_options run_plan::options() const {
  return pipeline_options_for(choice_, settings_.plan, settings_.pipeline);
}

namespace {

// A cut that gives a stage no parameters (a model's parameter-free pooling or rotary tables
// alone) is legal, but rarely meant: said once, naming the stage and its layers.
void note_idle_stages(const layer_list& layers, const plan_choice& choice) {
  const auto& cut = choice.cut;
  auto counts = stage_parameter_counts(layers, cut);
  int64_t total = 0;
  for (auto c : counts) {
    total += c;
  }
  for (std::size_t k = 0; k < counts.size() && total > 0; ++k) {
    if (counts[k] == 0) {
      log::get()->warn("stage {} (layers {}..{}) holds no parameters: it only passes tensors "
                       "on. Fewer stages, or --partition cut:I,J, give it work",
                       k, layers[cut.begin(k)].name(), layers[cut.end(k) - 1].name());
    }
  }
}

} // namespace

run_plan plan_run(const layer_list& layers, const torch::Tensor& batch, run_settings settings,
                  bool always_profile) {
  auto choice = choose_plan(layers, batch, settings.plan, always_profile);
  note_idle_stages(layers, choice);
  return {std::move(choice), std::move(settings)};
}

run_plan plan_layout(const layer_list& layers, const torch::Tensor& batch,
                     const planning_args& args, bool always_profile) {
  run_settings settings;
  settings.plan = args;
  return plan_run(layers, batch, std::move(settings), always_profile);
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
