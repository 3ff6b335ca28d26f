/// \file
/// What a stage actor needs to know, as one value: built once from pipeline_options (by the
/// engine), handed whole to a stage actor in this process and sent whole to a node (one
/// serializer, one parser: nodes/protocol.cpp). A setting added here reaches both kinds of stage
/// or neither: `visit_fields` lists every field once, and the serializer, the parser and the
/// tests walk that list (tests/nodes holds the list against the struct's size, so that a field
/// added without its line there fails a test).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

#include <c10/core/Device.h>

#include <actorpipe/actions.hpp>
#include <actorpipe/options.hpp>

namespace actorpipe {

struct stage_settings {
  /// The wire format's version: a node refuses settings of another.
  static constexpr int version = 5;

  /// This stage actor's index among `count`, its chunks and which virtual stage each chunk is.
  std::size_t index = 0;
  std::size_t count = 1;
  std::size_t chunks = 1;
  chunk_placement placement = chunk_placement::looped;
  /// Where the stage's chunks are built (pipeline_options::devices); once built, the stage holds
  /// its device (stage_config::device) and the actor computes there.
  c10::Device device = c10::Device(c10::kCPU);
  /// Intra-op threads of the stage's thread.
  std::size_t threads = 1;
  /// The stage thread allocates through the warm-memory cache (pipeline_options::warm_memory).
  bool warm_memory = true;
  /// How long the stage waits for an input, and polls for the next message before it sleeps.
  std::chrono::milliseconds wait_timeout{60000};
  std::chrono::microseconds linger{50};
  loss_reduction reduction = loss_reduction::mean;
  /// Report the sum of squared gradients (global-norm clipping).
  bool report_gradient_norm = false;
  /// Time every action on the device too (pipeline_options::device_timing).
  bool device_timing = false;
  /// Each chunk on a stream of its own on a GPU (pipeline_options::chunk_streams).
  bool chunk_streams = true;
  recompute_mode recompute = recompute_mode::never;
  precision_mode precision = precision_mode::fp32;
  /// CUDA graphs on a GPU stage (pipeline_options::cuda_graphs).
  cuda_graph_mode cuda_graphs = cuda_graph_mode::off;
  /// Replicas: buffers after a step, synchronised batch norm, BMUF (block_steps > 0; its block
  /// momentum resolved, >= 0).
  buffer_sync buffers = buffer_sync::broadcast;
  bool sync_batch_norm = false;
  /// Replicas: what each keeps of the optimizer step (ZeRO-1, ZeRO-2).
  shard_mode shard = shard_mode::none;
  bmuf_options bmuf;
};

/// Calls `f(name, field)` for every field of `s`, in order: the one list of the fields.
template <class Settings, class F>
void visit_fields(Settings& s, F&& f) {
  f("index", s.index);
  f("count", s.count);
  f("chunks", s.chunks);
  f("placement", s.placement);
  f("device", s.device);
  f("threads", s.threads);
  f("warm_memory", s.warm_memory);
  f("wait_timeout", s.wait_timeout);
  f("linger", s.linger);
  f("reduction", s.reduction);
  f("report_gradient_norm", s.report_gradient_norm);
  f("device_timing", s.device_timing);
  f("chunk_streams", s.chunk_streams);
  f("recompute", s.recompute);
  f("precision", s.precision);
  f("cuda_graphs", s.cuda_graphs);
  f("buffers", s.buffers);
  f("sync_batch_norm", s.sync_batch_norm);
  f("shard", s.shard);
  f("bmuf.block_steps", s.bmuf.block_steps);
  f("bmuf.block_lr", s.bmuf.block_lr);
  f("bmuf.block_momentum", s.bmuf.block_momentum);
  f("bmuf.nesterov", s.bmuf.nesterov);
  f("bmuf.reset_momentum", s.bmuf.reset_momentum);
  f("bmuf.warmup_steps", s.bmuf.warmup_steps);
}

/// The settings of stage actor `index` of `count` under `o`, with `threads` intra-op threads
/// and `bmuf` (o.data_parallel.bmuf with its block momentum resolved): the one place where
/// pipeline_options become a stage's settings, for stages in this process and on nodes alike.
inline stage_settings stage_settings_for(const pipeline_options& o, std::size_t index,
                                         std::size_t count, std::size_t threads,
                                         const bmuf_options& bmuf) {
  stage_settings s;
  s.index = index;
  s.count = count;
  s.chunks = o.chunks;
  s.placement = o.chunk_layout();
  s.device = o.devices.empty() ? c10::Device(c10::kCPU) : o.devices.at(index);
  s.threads = threads;
  s.warm_memory = o.warm_memory;
  s.wait_timeout = o.wait_timeout;
  s.linger = o.linger;
  s.reduction = o.reduction;
  s.report_gradient_norm = o.max_grad_norm > 0;
  s.device_timing = o.device_timing;
  s.chunk_streams = o.chunk_streams;
  s.recompute = o.recompute;
  s.precision = o.precision;
  s.cuda_graphs = o.cuda_graphs;
  s.buffers = o.data_parallel.buffers;
  s.sync_batch_norm = o.data_parallel.sync_batch_norm;
  s.shard = o.data_parallel.shard;
  s.bmuf = bmuf;
  return s;
}

} // namespace actorpipe
