#include <actorpipe/images.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <system_error>

#include <stb/stb_image.h>
#include <stb/stb_image_resize.h>
#include <torch/torch.h>

namespace actorpipe {
namespace fs = std::filesystem;
namespace {

bool hidden(const fs::path& p) {
  auto name = p.filename().string();
  return !name.empty() && name[0] == '.';
}

// Entries of `dir` in name order (the order torchvision's ImageFolder gives).
std::vector<fs::path> sorted_entries(const fs::path& dir) {
  std::vector<fs::path> entries;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (!hidden(it->path())) {
      entries.push_back(it->path());
    }
  }
  if (ec) {
    throw pipeline_error(detail::concat("cannot list '", dir.string(), "': ", ec.message()),
                         error_details{error_kind::io});
  }
  std::sort(entries.begin(), entries.end());
  return entries;
}

std::vector<std::string> class_folders(const fs::path& dir) {
  std::vector<std::string> classes;
  for (const auto& p : sorted_entries(dir)) {
    if (fs::is_directory(p)) {
      classes.push_back(p.filename().string());
    }
  }
  return classes;
}

// The files of `dir`'s class folders (classes in `classes`' order), checked by their headers.
std::vector<image_file> list_split(const fs::path& dir, const std::vector<std::string>& classes,
                                   bad_image_policy bad, std::vector<std::string>& skipped) {
  std::vector<image_file> files;
  for (std::size_t c = 0; c < classes.size(); ++c) {
    auto folder = dir / classes[c];
    std::size_t before = files.size();
    for (const auto& p : sorted_entries(folder)) {
      if (fs::is_directory(p)) {
        continue; // ImageFolder's classes are one level deep
      }
      int w = 0;
      int h = 0;
      int n = 0;
      if (stbi_info(p.c_str(), &w, &h, &n) == 0) {
        // (stbi_info sets no reason of its own here: the kinds it knows say enough.)
        auto why =
          detail::concat(p.string(), ": not an image stb_image can read (not JPEG, PNG, BMP, GIF, "
                                     "PNM, TGA, PSD, HDR or PIC, or its header is damaged)");
        if (bad == bad_image_policy::fail) {
          throw pipeline_error(why + "; --bad-images skip leaves such files out",
                               error_details{error_kind::io});
        }
        skipped.push_back(why);
        continue;
      }
      files.push_back({p.string(), static_cast<int64_t>(c)});
    }
    ACTORPIPE_CHECK(files.size() > before, "image folder: class folder '", folder.string(),
                    "' holds no image");
  }
  return files;
}

} // namespace

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t z = a + 0x9e3779b97f4a7c15ULL * (b + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

image_folder scan_image_folder(const std::string& dir, bad_image_policy bad) {
  fs::path root(dir);
  ACTORPIPE_CHECK(fs::is_directory(root), "--data images:", dir,
                  ": no such folder (a folder of class folders of images, or of train/ and val/)");
  image_folder folder;
  folder.root = dir;
  fs::path train = root;
  fs::path held_out;
  if (fs::is_directory(root / "train")) {
    train = root / "train";
    for (const char* name : {"val", "test"}) {
      if (fs::is_directory(root / name)) {
        held_out = root / name;
        break;
      }
    }
  }
  folder.classes = class_folders(train);
  ACTORPIPE_CHECK(!folder.classes.empty(), "--data images:", dir, ": '", train.string(),
                  "' holds no class folder (one sub-folder of images per class)");
  folder.train = list_split(train, folder.classes, bad, folder.skipped);
  if (!held_out.empty()) {
    auto classes = class_folders(held_out);
    ACTORPIPE_CHECK(classes == folder.classes, "--data images:", dir, ": '", held_out.string(),
                    "' has ", classes.size(), " class folders and '", train.string(), "' ",
                    folder.classes.size(), ": the held-out split needs the same classes");
    folder.validation = list_split(held_out, folder.classes, bad, folder.skipped);
  }
  return folder;
}

namespace {

// An image's pixels, `channels` per pixel, row by row: as decoded (stb_image's buffer, not
// copied), or resized into a buffer of its own.
struct pixels_of {
  std::unique_ptr<stbi_uc, void (*)(void*)> decoded{nullptr, stbi_image_free};
  std::vector<stbi_uc> resized;
  int64_t width = 0;
  int64_t height = 0;
  const stbi_uc* data() const { return decoded ? decoded.get() : resized.data(); }
};

pixels_of decode_image(const std::string& path, int channels) {
  int w = 0;
  int h = 0;
  int n = 0;
  pixels_of image;
  image.decoded.reset(stbi_load(path.c_str(), &w, &h, &n, channels));
  if (!image.decoded) {
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) {
      throw pipeline_error(detail::concat(path, ": cannot decode the image: no such file"),
                           error_details{error_kind::io});
    }
    throw pipeline_error(detail::concat(path, ": cannot decode the image (stb_image: \"",
                                        stbi_failure_reason(), "\"; a truncated or corrupt file?)"),
                         error_details{error_kind::io});
  }
  image.width = w;
  image.height = h;
  return image;
}

// The shorter side resized to `r`, keeping the aspect ratio (torchvision's Resize(int)).
pixels_of resize_shorter_side(pixels_of image, int64_t r, int channels, const std::string& path) {
  const auto w = image.width;
  const auto h = image.height;
  int64_t rw = r;
  int64_t rh = r;
  if (w <= h) {
    rh = std::max<int64_t>(r, static_cast<int64_t>(static_cast<double>(r) * h / w));
  } else {
    rw = std::max<int64_t>(r, static_cast<int64_t>(static_cast<double>(r) * w / h));
  }
  if (rw == w && rh == h) {
    return image;
  }
  pixels_of resized;
  resized.resized.resize(static_cast<std::size_t>(rw * rh * channels));
  resized.width = rw;
  resized.height = rh;
  if (stbir_resize_uint8(image.data(), static_cast<int>(w), static_cast<int>(h), 0,
                         resized.resized.data(), static_cast<int>(rw), static_cast<int>(rh), 0,
                         channels) == 0) {
    throw pipeline_error(
      detail::concat(path, ": cannot resize the image from ", w, 'x', h, " to ", rw, 'x', rh),
      error_details{error_kind::io});
  }
  return resized;
}

// Where the crop of side `t.size` starts, and whether it is flipped: at random from `draw`, or
// in the centre.
struct crop {
  int64_t x0 = 0;
  int64_t y0 = 0;
  bool flip = false;
};

crop crop_of(const image_transform& t, uint64_t draw, int64_t rw, int64_t rh) {
  const int64_t s = t.size;
  if (t.random) {
    return {static_cast<int64_t>(mix(draw, 1) % static_cast<uint64_t>(rw - s + 1)),
            static_cast<int64_t>(mix(draw, 2) % static_cast<uint64_t>(rh - s + 1)),
            (mix(draw, 3) & 1U) != 0};
  }
  return {static_cast<int64_t>(std::lround(static_cast<double>(rw - s) / 2.0)),
          static_cast<int64_t>(std::lround(static_cast<double>(rh - s) / 2.0)), false};
}

// The normalisation of channel `c`: the transform's, else ImageNet's for RGB, else 0.5.
std::pair<float, float> mean_and_std(const image_transform& t, int channels, int c) {
  static const float imagenet_mean[] = {0.485f, 0.456f, 0.406f};
  static const float imagenet_std[] = {0.229f, 0.224f, 0.225f};
  auto i = static_cast<std::size_t>(c);
  float mean = !t.mean.empty() ? t.mean[i % t.mean.size()]
               : channels == 3 ? imagenet_mean[c]
                               : 0.5f;
  float spread = !t.std.empty() ? t.std[i % t.std.size()] : channels == 3 ? imagenet_std[c] : 0.5f;
  return {mean, spread};
}

} // namespace

void load_image_into(const std::string& path, const image_transform& t, uint64_t draw,
                     torch::Tensor& out) {
  ACTORPIPE_CHECK(t.channels == 1 || t.channels == 3, "images have 1 or 3 channels, not ",
                  t.channels);
  ACTORPIPE_CHECK(t.size >= 1 && t.resized_side() >= t.size, "image size ", t.size, " and resize ",
                  t.resized_side(), ": the crop must fit the resized image");
  const int channels = static_cast<int>(t.channels);
  auto image = resize_shorter_side(decode_image(path, channels), t.resized_side(), channels, path);
  const int64_t s = t.size;
  const int64_t rw = image.width;
  auto at = crop_of(t, draw, rw, image.height);
  ACTORPIPE_CHECK(out.scalar_type() == torch::kFloat && out.is_contiguous() &&
                    out.numel() == t.channels * s * s,
                  "load_image_into: the output must be a contiguous float tensor [", t.channels,
                  ", ", s, ", ", s, "]");
  const stbi_uc* src = image.data();
  float* dst = out.data_ptr<float>();
  for (int c = 0; c < channels; ++c) {
    auto [mean, spread] = mean_and_std(t, channels, c);
    const float scale = 1.0f / (255.0f * spread);
    const float shift = mean / spread;
    for (int64_t y = 0; y < s; ++y) {
      const stbi_uc* row = src + ((at.y0 + y) * rw + at.x0) * channels + c;
      float* line = dst + (c * s + y) * s;
      for (int64_t x = 0; x < s; ++x) {
        const int64_t from = at.flip ? s - 1 - x : x;
        line[x] = static_cast<float>(row[from * channels]) * scale - shift;
      }
    }
  }
}

std::pair<torch::Tensor, torch::Tensor> load_images(const std::vector<image_file>& files,
                                                    const image_transform& transform, uint64_t seed,
                                                    std::vector<std::string>* failures) {
  const auto n = static_cast<int64_t>(files.size());
  auto images = torch::empty({n, transform.channels, transform.size, transform.size});
  auto labels = torch::empty({n}, torch::kLong);
  auto* label = labels.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    auto out = images[i];
    const auto draw = mix(seed, static_cast<uint64_t>(i));
    // Without `failures` the first file that cannot be decoded ends the batch with its error.
    for (int64_t k = 0;; ++k) {
      const auto& file = files[static_cast<std::size_t>((i + k) % n)];
      if (failures == nullptr) {
        load_image_into(file.path, transform, draw, out);
        label[i] = file.label;
        break;
      }
      try {
        load_image_into(file.path, transform, draw, out);
        label[i] = file.label;
        break;
      } catch (const pipeline_error& e) {
        if (k == 0) {
          failures->push_back(e.what());
        }
        if (k + 1 == n) {
          throw pipeline_error(detail::concat("none of the ", n, " images of the batch (the first ",
                                              files.front().path, ") can be decoded"),
                               error_details{error_kind::io});
        }
      }
    }
  }
  return {images, labels};
}

} // namespace actorpipe
