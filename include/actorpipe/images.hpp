/// \file
/// Folders of images as torchvision's ImageFolder reads them: a class per sub-folder, JPEG, PNG,
/// BMP, GIF, PNM or TGA files decoded with stb_image (Debian's libstb-dev), resized, cropped
/// (randomly, for training), flipped and normalised as torchvision's transforms do.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/types.h>

#include <actorpipe/errors.hpp>

namespace actorpipe {

/// An image file and its class.
struct image_file {
  std::string path;
  int64_t label = 0;
};

/// What to do with a file that is not an image stb_image can read (another kind of file, a
/// truncated or corrupt image): stop with an error naming it, or leave it out with a warning
/// naming it.
enum class bad_image_policy { fail, skip };

/// The files of an image folder: `root/CLASS/*` (a class per sub-folder, classes numbered in
/// name order as torchvision's ImageFolder), or `root/train/CLASS/*` with `root/val/CLASS/*` (or
/// `test/`) held out, the same classes in both.
struct image_folder {
  std::string root;
  std::vector<std::string> classes;
  std::vector<image_file> train;
  /// Empty when the folder has no val/ (or test/) split.
  std::vector<image_file> validation;
  /// Files left out (bad_image_policy::skip): "path: why".
  std::vector<std::string> skipped;
};

/// Lists `dir` as image_folder says, checking every file's header with stb_image (cheap: no
/// pixels are decoded). Hidden files and folders (a leading '.') are ignored; files of the root
/// itself (a README) are ignored when it has class folders. Throws invalid_argument naming the
/// folder when it does not exist or holds no class folder with an image, and when val/'s
/// classes differ from train/'s; with bad_image_policy::fail, pipeline_error (io) naming the
/// first file that is not a readable image and why.
image_folder scan_image_folder(const std::string& dir, bad_image_policy bad);

/// How a decoded image becomes a tensor, as torchvision's Resize(resize), then RandomCrop(size)
/// with RandomHorizontalFlip for training, or CenterCrop(size) for evaluation, then ToTensor and
/// Normalize(mean, std).
struct image_transform {
  /// Side of the square output.
  int64_t size = 32;
  /// 1 (grey) or 3 (RGB); images are converted as stb_image converts them.
  int64_t channels = 3;
  /// The shorter side is resized to this first (0: size * 8 / 7, as 256 is to 224).
  int64_t resize = 0;
  /// Training: a random crop and a flip with probability 1/2; else the centre crop.
  bool random = false;
  /// Per channel; empty: ImageNet's (0.485, 0.456, 0.406) / (0.229, 0.224, 0.225) for RGB,
  /// 0.5 / 0.5 for grey.
  std::vector<float> mean;
  std::vector<float> std;

  int64_t resized_side() const { return resize > 0 ? resize : (size * 8 + 6) / 7; }
};

/// Decodes `path` and transforms it into `out`, a float tensor [channels, size, size]
/// (contiguous). `draw` seeds the random crop and flip (the same draw gives the same image).
/// Throws pipeline_error (io) naming the file and stb_image's reason when it cannot be decoded.
void load_image_into(const std::string& path, const image_transform& transform, uint64_t draw,
                     torch::Tensor& out);

/// `files` decoded and transformed, as a batch [N, channels, size, size] with labels [N]; file i
/// draws from mix(seed, i) (see load_image_into). A file that cannot be decoded throws (see
/// load_image_into) unless `failures` is given: then the next file of `files` that decodes
/// stands in for it (image and label) and "path: why" is appended to `failures`; when none
/// decodes, pipeline_error (io) names the files.
std::pair<torch::Tensor, torch::Tensor> load_images(const std::vector<image_file>& files,
                                                    const image_transform& transform, uint64_t seed,
                                                    std::vector<std::string>* failures = nullptr);

/// A 64-bit hash of `a` and `b` (splitmix64), for random draws that depend on a sample's
/// position alone.
uint64_t mix(uint64_t a, uint64_t b);

} // namespace actorpipe
