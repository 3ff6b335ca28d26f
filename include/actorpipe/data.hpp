/// \file
/// Datasets: Fashion-MNIST from its IDX files, and the epoch-seeded sample order.
#pragma once

#include <cstdint>
#include <string>

#include <torch/types.h>

#include <actorpipe/errors.hpp>

namespace actorpipe {

/// Samples held in memory: images [N, C, H, W] float32, labels [N] int64.
struct dataset {
  torch::Tensor images;
  torch::Tensor labels;

  int64_t size() const { return labels.defined() ? labels.size(0) : 0; }
  /// The first `n` samples (all when n <= 0 or n >= size()).
  dataset head(int64_t n) const;
};

/// Where Debian's dataset-fashion-mnist package puts the files.
inline const char* default_fashion_mnist_dir() {
  return "/usr/share/datasets/fashion-mnist";
}

/// Reads Fashion-MNIST's train (60,000) or test (10,000) split from `dir`: the IDX files
/// `{train,t10k}-{images-idx3,labels-idx1}-ubyte`, gzip-compressed (`.gz`) or not. Pixels are
/// scaled to [0, 1] and normalised with the training set's mean 0.2860 and std 0.3530.
/// Throws invalid_argument naming the missing file and the package to install, and
/// pipeline_error for a file that is not a valid IDX file (naming file and what is wrong).
dataset load_fashion_mnist(const std::string& dir, bool train);

/// The order in which epoch `epoch` visits `n` samples: a permutation drawn from a generator
/// seeded by (seed, epoch) alone, so a resumed run sees exactly the same order.
torch::Tensor epoch_order(int64_t n, uint64_t seed, int64_t epoch);

/// Replica `rank`'s share of epoch `epoch` (as PyTorch's DistributedSampler): epoch_order(n,
/// seed, epoch), padded by repeating its first samples up to a multiple of `replicas`, then
/// every `replicas`-th index from position `rank`. All ranks get ceil(n / replicas) indices;
/// together they cover every sample once, plus the padding. Throws invalid_argument for
/// replicas == 0, rank >= replicas or n < 1.
torch::Tensor distributed_order(int64_t n, uint64_t seed, int64_t epoch, int64_t rank,
                                int64_t replicas);

} // namespace actorpipe
