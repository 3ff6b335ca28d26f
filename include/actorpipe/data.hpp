/// \file
/// Datasets: Fashion-MNIST from its IDX files, text as character tokens, and the epoch-seeded
/// sample order.
#pragma once

#include <cstdint>
#include <string>

#include <torch/types.h>

#include <actorpipe/errors.hpp>

namespace actorpipe {

/// Samples held in memory: images [N, C, H, W] float32, labels [N] int64 (for text: token
/// ids [N, T] and their next tokens [N, T], both int64).
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

/// Inputs and targets from a file written by Python's `torch.save({"inputs": X, "targets": Y},
/// path)` (or save_tensor_file): `images` holds X and `labels` Y, any shapes and dtypes whose
/// first dimensions (the samples) agree. Throws invalid_argument naming the file when it cannot
/// be read, is not a torch.save file, is not a dict, lacks a key (naming the keys it has), holds
/// something other than a tensor, or its first dimensions differ or are 0.
dataset load_tensor_file(const std::string& path);

/// Writes what load_tensor_file reads (Python's `torch.load` reads it too).
void save_tensor_file(const std::string& path, const torch::Tensor& inputs,
                      const torch::Tensor& targets);

/// Where Debian's fortunes package puts its files (the text corpus of `--data text`).
inline const char* default_fortunes_dir() {
  return "/usr/share/games/fortunes";
}

/// A text as character-level tokens: each distinct byte of the text is a token, numbered in
/// byte order (an ASCII text's tokens are its characters).
struct text_corpus {
  /// Where it came from (a file or a folder), for messages and checkpoints.
  std::string source;
  /// Token i stands for byte alphabet[i].
  std::string alphabet;
  /// The training and validation parts, token ids (int64): the last tenth of every file is
  /// held out for validation.
  torch::Tensor train;
  torch::Tensor validation;

  int64_t vocabulary() const { return static_cast<int64_t>(alphabet.size()); }
  /// Token ids [L] of `text`; invalid_argument names a byte the alphabet lacks.
  torch::Tensor encode(const std::string& text) const;
  /// The text of token ids (any shape, read in order).
  std::string decode(const torch::Tensor& ids) const;
};

/// Reads a UTF-8 text file, or every text file of a folder in name order (fortune's `.dat`
/// indexes and links skipped). Throws invalid_argument naming the path (and the package to
/// install for the fortunes folder) when there is nothing to read, and pipeline_error (io)
/// naming the file and byte offset of text that is not UTF-8, or a text too short to hold out a
/// validation part.
text_corpus load_text(const std::string& path);

/// Next-token samples of `tokens`: consecutive windows of context + 1 tokens, the first
/// `context` the input [N, context] ("images") and the last `context` the target ("labels").
/// Throws invalid_argument when the tokens hold no window.
dataset text_windows(const torch::Tensor& tokens, int64_t context);

} // namespace actorpipe
