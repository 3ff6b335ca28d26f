#include <actorpipe/data.hpp>

#include <array>
#include <filesystem>
#include <memory>
#include <vector>

#include <torch/torch.h>
#include <zlib.h>

namespace actorpipe {
namespace {

constexpr float fashion_mnist_mean = 0.2860f;
constexpr float fashion_mnist_std = 0.3530f;

struct gz_closer {
  void operator()(gzFile f) const {
    if (f != nullptr) {
      gzclose(f);
    }
  }
};

// Reads an IDX file (gzip or plain: zlib reads both) into its dimensions and bytes.
std::pair<std::vector<int64_t>, std::vector<uint8_t>> read_idx(const std::string& path,
                                                               int expected_dims) {
  std::unique_ptr<gzFile_s, gz_closer> file{gzopen(path.c_str(), "rb")};
  if (!file) {
    throw pipeline_error(detail::concat("cannot open '", path, "'"));
  }
  auto read_exact = [&](void* buffer, std::size_t bytes, const char* what) {
    auto n = gzread(file.get(), buffer, static_cast<unsigned>(bytes));
    if (n < 0 || static_cast<std::size_t>(n) != bytes) {
      throw pipeline_error(
        detail::concat("'", path, "' is truncated: could not read ", what, " (", bytes, " bytes)"));
    }
  };
  std::array<uint8_t, 4> magic{};
  read_exact(magic.data(), magic.size(), "the IDX header");
  // IDX: two zero bytes, type 0x08 (unsigned byte), number of dimensions.
  if (magic[0] != 0 || magic[1] != 0 || magic[2] != 0x08 || magic[3] != expected_dims) {
    throw pipeline_error(detail::concat("'", path, "' is not an IDX file of unsigned bytes with ",
                                        expected_dims, " dimensions"));
  }
  std::vector<int64_t> dims;
  int64_t total = 1;
  for (int d = 0; d < expected_dims; ++d) {
    std::array<uint8_t, 4> b{};
    read_exact(b.data(), b.size(), "a dimension");
    auto n = (int64_t{b[0]} << 24) | (int64_t{b[1]} << 16) | (int64_t{b[2]} << 8) | b[3];
    if (n <= 0 || n > 10'000'000) {
      throw pipeline_error(
        detail::concat("'", path, "': dimension ", d, " is ", n, ", not in 1..10000000"));
    }
    dims.push_back(n);
    total *= n;
  }
  if (total > (int64_t{1} << 32)) {
    throw pipeline_error(detail::concat("'", path, "': ", total, " elements is absurd"));
  }
  std::vector<uint8_t> bytes(static_cast<std::size_t>(total));
  read_exact(bytes.data(), bytes.size(), "the data");
  return {dims, std::move(bytes)};
}

std::string find_file(const std::string& dir, const std::string& name) {
  for (const auto& candidate : {dir + "/" + name + ".gz", dir + "/" + name}) {
    if (std::filesystem::exists(candidate)) {
      return candidate;
    }
  }
  throw invalid_argument(detail::concat(
    "Fashion-MNIST file '", dir, "/", name,
    ".gz' not found; install Debian's package "
    "dataset-fashion-mnist (apt-get install dataset-fashion-mnist) or point --data-dir at a "
    "folder holding the IDX files"));
}

} // namespace

dataset dataset::head(int64_t n) const {
  if (n <= 0 || n >= size()) {
    return *this;
  }
  return {images.slice(0, 0, n), labels.slice(0, 0, n)};
}

dataset load_fashion_mnist(const std::string& dir, bool train) {
  std::string prefix = train ? "train" : "t10k";
  auto images_path = find_file(dir, prefix + "-images-idx3-ubyte");
  auto labels_path = find_file(dir, prefix + "-labels-idx1-ubyte");
  auto [image_dims, image_bytes] = read_idx(images_path, 3);
  auto [label_dims, label_bytes] = read_idx(labels_path, 1);
  if (image_dims[0] != label_dims[0]) {
    throw pipeline_error(detail::concat("'", images_path, "' holds ", image_dims[0],
                                        " images but '", labels_path, "' holds ", label_dims[0],
                                        " labels"));
  }
  for (auto label : label_bytes) {
    if (label > 9) {
      throw pipeline_error(
        detail::concat("'", labels_path, "' holds label ", int{label}, ", not in 0..9"));
    }
  }
  auto n = image_dims[0];
  auto images =
    torch::from_blob(image_bytes.data(), {n, 1, image_dims[1], image_dims[2]}, torch::kUInt8)
      .to(torch::kFloat32)
      .div_(255.0f)
      .sub_(fashion_mnist_mean)
      .div_(fashion_mnist_std);
  auto labels = torch::from_blob(label_bytes.data(), {n}, torch::kUInt8).to(torch::kInt64);
  return {images, labels};
}

torch::Tensor epoch_order(int64_t n, uint64_t seed, int64_t epoch) {
  auto generator =
    at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ULL + static_cast<uint64_t>(epoch));
  return torch::randperm(n, generator, torch::TensorOptions().dtype(torch::kInt64));
}

torch::Tensor distributed_order(int64_t n, uint64_t seed, int64_t epoch, int64_t rank,
                                int64_t replicas) {
  ACTORPIPE_CHECK(n >= 1, "distributed_order: no samples");
  ACTORPIPE_CHECK(replicas >= 1 && rank >= 0 && rank < replicas, "distributed_order: rank ", rank,
                  " of ", replicas, " replicas");
  auto order = epoch_order(n, seed, epoch);
  auto padded = (n + replicas - 1) / replicas * replicas;
  while (order.size(0) < padded) {
    order = torch::cat({order, order.slice(0, 0, padded - order.size(0))});
  }
  return order.slice(0, rank, padded, replicas).clone();
}

} // namespace actorpipe
