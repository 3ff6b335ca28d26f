// A pipeline's snapshots (pipeline::snapshot*, what nodes keep of them) and the door its
// recovery goes through: recovery::placed_stages answered from pipeline::impl. The recovery
// room (engine/recovery/) reaches a pipeline, alone or a replica, through that door only.
#include <actorpipe/pipeline.hpp>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <actorpipe/memory.hpp>

#include "engine/pipeline_impl.hpp"
#include "engine/recovery/membership.hpp"
#include "engine/recovery/placed_stages.hpp"
#include "logging/log.hpp"
#include "nodes/remote_stages.hpp"

namespace actorpipe {

pipeline::impl::impl(partition p, pipeline_options o)
  : cut(std::move(p)), options(std::move(o)), snapshots(std::make_unique<recovery::snapshots>()),
    members(std::make_unique<recovery::membership>()) {}

pipeline::impl::~impl() {
  stop_actors();
}

void pipeline::impl::settle_if_arrived() {
  if (snapshots->arrived()) {
    settle_snapshot();
  }
}

std::future<std::shared_ptr<std::map<std::string, torch::Tensor>>>
pipeline::impl::submit_fetch(bool background, uint64_t keep_as) {
  auto request = std::make_shared<scheduler::step_request>();
  request->kind = scheduler::request_kind::fetch;
  request->background = background;
  request->keep_as = keep_as;
  return submit<std::shared_ptr<std::map<std::string, torch::Tensor>>>(
    std::move(request), [](scheduler::step_outcome& o) { return std::move(o.state); });
}

void pipeline::impl::settle_snapshot() {
  if (!snapshots->pending.valid()) {
    return;
  }
  auto number = snapshots->pending_number;
  try {
    install_snapshot(wait(snapshots->pending, "snapshot"), number, snapshots->pending_note);
  } catch (const std::exception& e) {
    // A node lost while its state was on the way: the step after it fails too, and recover()
    // restores the newest snapshot that did arrive.
    log::get()->warn("snapshot {} did not arrive ({}); {} stays the newest", number, e.what(),
                     snapshots->number == 0 ? std::string("the starting state")
                                            : detail::concat("snapshot ", snapshots->number));
    memory::release_free_heap(); // whatever of it did arrive
  }
  snapshots->pending = {};
}

void pipeline::impl::install_snapshot(std::shared_ptr<std::map<std::string, torch::Tensor>> state,
                                      uint64_t number, const std::string& note) {
  snapshots->newest = std::make_shared<const stages::tensor_map>(std::move(*state));
  snapshots->number = number;
  if (remote) {
    // Complete here: every node keeps its stages' copy, tagged with the cut it was taken on,
    // and, but for replicas (the other replicas' same stages are as good), its neighbour's.
    nodes::keep_snapshot(system(), stage_nodes(),
                         replicas ? std::vector<nodes::endpoint>{} : stage_data, number,
                         nlohmann::json{{"bounds", cut.bounds}, {"note", note}}.dump());
  }
  // The frames and the snapshot this one replaced were megabytes of heap.
  memory::release_free_heap();
}

std::vector<caf::actor> pipeline::impl::stage_nodes() const {
  std::vector<caf::actor> result;
  for (const auto& address : options.placement.nodes) {
    auto it = nodes.find(address);
    result.push_back(it == nodes.end() ? caf::actor{} : it->second);
  }
  return result;
}

uint64_t pipeline::snapshot(const std::string& note) {
  auto& self = *impl_;
  self.settle_snapshot();
  auto number = ++self.snapshots->taken;
  auto future = self.submit_fetch(false, number);
  self.install_snapshot(self.wait(future, "snapshot"), number, note);
  return self.snapshots->number;
}

uint64_t pipeline::snapshot_in_background(const std::string& note) {
  auto& self = *impl_;
  self.settle_snapshot();
  self.snapshots->pending_number = ++self.snapshots->taken;
  self.snapshots->pending_note = note;
  self.snapshots->pending = self.submit_fetch(true, self.snapshots->pending_number);
  return self.snapshots->pending_number;
}

uint64_t pipeline::newest_snapshot() {
  auto& self = *impl_;
  self.settle_snapshot();
  return self.snapshots->number;
}

} // namespace actorpipe

namespace actorpipe {

recovery::placed_stages pipeline::placed(const recovery::access&) {
  return recovery::placed_stages(*impl_);
}

namespace recovery {

bool placed_stages::on_nodes() const {
  return p_->remote.has_value();
}

const pipeline_options& placed_stages::options() const {
  return p_->options;
}

const std::map<std::string, caf::actor>& placed_stages::reached() const {
  return p_->nodes;
}

const std::vector<std::size_t>& placed_stages::bounds() const {
  return p_->cut.bounds;
}

caf::actor_system& placed_stages::system() const {
  return p_->system();
}

recovery::snapshots& placed_stages::settled_snapshots() {
  p_->settle_snapshot();
  return *p_->snapshots;
}

recovery::snapshots& placed_stages::kept_snapshots() {
  return *p_->snapshots;
}

std::shared_ptr<const stages::tensor_map> placed_stages::fetch(const char* what) {
  return p_->fetch_now(what);
}

void placed_stages::stop(bool leave_replicas) {
  p_->stop_actors();
  if (leave_replicas) {
    p_->replicas.reset();
  }
}

void placed_stages::move_to(std::vector<std::string> nodes, std::size_t rank, std::size_t world) {
  p_->options.data_parallel.rank = rank;
  p_->options.data_parallel.replicas = world;
  p_->options.placement.nodes = std::move(nodes);
}

void placed_stages::start(const std::shared_ptr<const stages::tensor_map>& state, uint64_t number) {
  p_->meet_replicas();
  p_->place_on_nodes();
  p_->restore(state, number, "recover");
}

bool placed_stages::replicated() const {
  return p_->replicas != nullptr;
}

const partition& placed_stages::cut() const {
  return p_->cut;
}

const layer_list& placed_stages::layers() const {
  return p_->layers;
}

membership& placed_stages::members() {
  return *p_->members;
}

std::vector<caf::actor> placed_stages::stage_nodes() const {
  return p_->stage_nodes();
}

const std::vector<nodes::endpoint>& placed_stages::stage_data() const {
  return p_->stage_data;
}

void placed_stages::place(std::vector<std::string> nodes, partition cut) {
  p_->cut = std::move(cut);
  p_->options.placement.nodes = std::move(nodes);
  p_->place_on_nodes();
}

void placed_stages::restore(const std::shared_ptr<const stages::tensor_map>& state, uint64_t number,
                            const char* what) {
  p_->restore(state, number, what);
}

void placed_stages::add_spare(const std::string& node) {
  auto& spares = p_->options.placement.spares;
  if (std::find(spares.begin(), spares.end(), node) == spares.end()) {
    spares.push_back(node);
  }
}

void placed_stages::take_joined() {
  p_->members->take_joined(p_->options.placement.nodes, p_->options.placement.spares);
}

void placed_stages::set_spares(std::vector<std::string> spares) {
  p_->options.placement.spares = std::move(spares);
}

} // namespace recovery
} // namespace actorpipe
