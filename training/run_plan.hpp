/// \file
/// A training run's plan, built once. A front end (`actorpipe train`'s flags, the Python module's
/// keywords) fills one `run_settings` value, all of it before planning; `plan_run` turns it into
/// the run's plan (the planner's choice of cut, schedule, micro-batches, chunks, threads and the
/// chosen stages' devices); `start_run` builds the pipeline that plan describes, in this process
/// or on nodes, alone or as replicas. A front end reads the plan to show it and never completes
/// it or derives any of it again: the micro-batch count goes from the settings into the choice,
/// from the choice into the pipeline's options as the pipeline is built, and from there down.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <actorpipe/layers.hpp>
#include <actorpipe/options.hpp>
#include <actorpipe/pipeline.hpp>
#include <actorpipe/replicas.hpp>

#include "training/planning.hpp"

namespace actorpipe::training {

/// Everything a run is planned and built from.
struct run_settings {
  /// What the planner chooses from (stages, schedule, micro-batches, partition, threads, memory
  /// caps, devices).
  planning_args plan;
  /// Everything else a pipeline takes: loss, optimizer, precision, timeouts, replicas
  /// (data_parallel), nodes (placement). The planner's fields (micro-batches, schedule, chunks,
  /// recomputation, threads, memory, devices) are the choice's, set as the pipeline is built.
  pipeline_options pipeline;
  /// Hooks after each forward or backward: made in this process (make_hooks), or sent to the
  /// nodes as they are.
  hook_specs hooks;
  /// Replicas this process builds and one loop feeds (a replicated_pipeline). 1: one pipeline
  /// (which may be one of several processes' replicas: pipeline.data_parallel).
  std::size_t replicas = 1;
  /// The settings of training/settings.hpp's table a front end set (set_setting), by name.
  std::vector<std::string> given;
};

/// A run's plan: what the planner chose, and the settings it chose from.
class run_plan {
public:
  run_plan(plan_choice choice, run_settings settings)
    : choice_(std::move(choice)), settings_(std::move(settings)) {}

  const plan_choice& choice() const { return choice_; }
  const run_settings& settings() const { return settings_; }
  /// The pipeline's options: the settings' with the choice set in (pipeline_options_for).
  pipeline_options options() const;

private:
  plan_choice choice_;
  run_settings settings_;
};

/// Plans a run for `layers` and a batch shaped like `batch` (choose_plan: profiles and ranks
/// where the settings leave anything open): the one place where `actorpipe train`, `actorpipe
/// plan`, the bench and the Python module plan. `always_profile`: profile the layers even for a
/// layout given whole (`actorpipe plan` prints the profile).
run_plan plan_run(const layer_list& layers, const torch::Tensor& batch, run_settings settings,
                  bool always_profile = false);

/// A plan for `args` alone, for front ends that plan without running (the plan command, the
/// bench's contenders): plan_run with settings holding nothing else.
run_plan plan_layout(const layer_list& layers, const torch::Tensor& batch,
                     const planning_args& args, bool always_profile = false);

/// The model a plan runs, as the front end has it: the layers in this process, a maker of each
/// replica's own (settings.replicas > 1 in this process), or its description for nodes
/// (settings.pipeline.placement.nodes; the settings' hooks are set into it).
struct run_model {
  layer_list layers;
  std::function<layer_list()> replica;
  remote_model remote;
};

/// The pipeline a run trains: one, or a set of replicas that one loop feeds.
struct run_pipeline {
  std::unique_ptr<pipeline> single;
  std::unique_ptr<replicated_pipeline> replicated;

  /// Replica 0 (its parameters are every replica's). After a recovery it may be another object.
  pipeline& lead() { return single ? *single : replicated->replica(0); }
  /// Where nodes may join (placement.accept_joins), else empty.
  std::string join_address() const;
};

/// Builds the plan's pipeline on `sys`: on the nodes of its placement when it lists any, else in
/// this process; a replicated_pipeline of settings.replicas when above 1. `rank`: where each of
/// this process's replicas runs a loop of its own on a thread of its own (the CLI's --replicas),
/// which one this is; otherwise the settings' rank holds. Throws what the pipeline's constructor
/// throws.
run_pipeline start_run(engine& sys, run_model model, const run_plan& plan,
                       std::optional<std::size_t> rank = std::nullopt);

} // namespace actorpipe::training
