// Small image folders the tests write themselves (PNG and JPEG through stb_image_write).
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <stb/stb_image_write.h>

namespace actorpipe::test {

// An RGB image of w x h pixels whose pixel (x, y) is pixel(x, y) -> {r, g, b}.
template <class F>
std::vector<uint8_t> rgb_image(int w, int h, F pixel) {
  std::vector<uint8_t> rgb(static_cast<std::size_t>(w * h * 3));
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      auto [r, g, b] = pixel(x, y);
      auto* p = &rgb[static_cast<std::size_t>((y * w + x) * 3)];
      p[0] = static_cast<uint8_t>(r);
      p[1] = static_cast<uint8_t>(g);
      p[2] = static_cast<uint8_t>(b);
    }
  }
  return rgb;
}

inline void write_png(const std::filesystem::path& path, int w, int h,
                      const std::vector<uint8_t>& rgb) {
  std::filesystem::create_directories(path.parent_path());
  REQUIRE(stbi_write_png(path.c_str(), w, h, 3, rgb.data(), w * 3) != 0);
}

inline void write_jpeg(const std::filesystem::path& path, int w, int h,
                       const std::vector<uint8_t>& rgb) {
  std::filesystem::create_directories(path.parent_path());
  REQUIRE(stbi_write_jpg(path.c_str(), w, h, 3, rgb.data(), 95) != 0);
}

// A learnable folder: class c's images are stripes of colour c (horizontal for even c, vertical
// for odd) at a random phase, with noise, of varying sizes (some not square), PNG and JPEG
// alternately. `splits`: train/ and val/ (a fifth held out), else the classes at the root.
inline void write_class_folder(const std::filesystem::path& root, int classes, int per_class,
                               bool splits, uint32_t seed = 1) {
  uint32_t state = seed * 2654435761U + 1;
  auto next = [&] {
    state = state * 1664525U + 1013904223U;
    return state >> 8;
  };
  const int colours[4][3] = {{220, 40, 40}, {40, 200, 60}, {50, 70, 230}, {230, 210, 40}};
  for (int c = 0; c < classes; ++c) {
    for (int i = 0; i < per_class; ++i) {
      const bool held_out = splits && i % 5 == 4;
      auto dir = splits ? root / (held_out ? "val" : "train") : root;
      const int w = 20 + static_cast<int>(next() % 12);
      const int h = 20 + static_cast<int>(next() % 12);
      const int phase = static_cast<int>(next() % 6);
      auto rgb = rgb_image(w, h, [&](int x, int y) {
        const bool on = ((c % 2 == 0 ? y : x) + phase) % 6 < 3;
        const int noise = static_cast<int>(next() % 40);
        const auto* k = colours[c % 4];
        return std::array<int, 3>{on ? k[0] - noise / 2 : 20 + noise,
                                  on ? k[1] - noise / 2 : 20 + noise,
                                  on ? k[2] - noise / 2 : 20 + noise};
      });
      auto file = dir / ("class" + std::to_string(c)) /
                  ("img" + std::to_string(i) + (i % 2 == 0 ? ".png" : ".jpg"));
      if (i % 2 == 0) {
        write_png(file, w, h, rgb);
      } else {
        write_jpeg(file, w, h, rgb);
      }
    }
  }
}

} // namespace actorpipe::test
