// Image folders: listing, decoding and transforms as torchvision's, and the loader's workers.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <actorpipe/images.hpp>
#include <actorpipe/training.hpp>

#include "image_folders.hpp"

using namespace actorpipe;
using namespace actorpipe::test;
namespace fs = std::filesystem;

namespace {

fs::path fresh_image_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() /
             ("actorpipe_images_test_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

template <class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(nothing thrown)";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A constant image whose red value encodes `index` (and whose green its class).
void write_marked(const fs::path& path, int index, int label) {
  write_png(path, 8, 8, rgb_image(8, 8, [&](int, int) {
              return std::array<int, 3>{index * 8, label * 60, 0};
            }));
}

// The index write_marked encoded, read back from a transformed image (RGB, ImageNet's
// normalisation).
int64_t marked_index(const torch::Tensor& image) {
  auto red = image[0][0][0].item<float>() * 0.229f + 0.485f;
  return std::lround(red * 255.0f / 8.0f);
}

void truncate_file(const fs::path& path) {
  auto size = fs::file_size(path);
  fs::resize_file(path, size / 2);
}

} // namespace

TEST_CASE("an image folder is a class per sub-folder in name order, or train/ and val/ splits") {
  auto root = fresh_image_dir("layout");
  write_marked(root / "flat" / "zebra" / "b.png", 0, 0);
  write_marked(root / "flat" / "zebra" / "a.png", 1, 0);
  write_marked(root / "flat" / "ant" / "c.png", 2, 0);
  write_marked(root / "flat" / ".hidden" / "d.png", 3, 0);
  write_marked(root / "flat" / "ant" / ".e.png", 4, 0);
  std::ofstream(root / "flat" / "README") << "class folders below";
  auto flat = scan_image_folder((root / "flat").string(), bad_image_policy::fail);
  CHECK(flat.classes == std::vector<std::string>{"ant", "zebra"});
  REQUIRE(flat.train.size() == 3);
  CHECK(flat.train[0].path == (root / "flat" / "ant" / "c.png").string());
  CHECK(flat.train[0].label == 0);
  CHECK(flat.train[1].path == (root / "flat" / "zebra" / "a.png").string());
  CHECK(flat.train[2].label == 1);
  CHECK(flat.validation.empty());

  for (const char* split : {"train", "val"}) {
    write_marked(root / "split" / split / "cat" / "1.png", 0, 0);
    write_marked(root / "split" / split / "dog" / "1.png", 1, 1);
    write_marked(root / "split" / split / "dog" / "2.png", 2, 1);
  }
  auto split = scan_image_folder((root / "split").string(), bad_image_policy::fail);
  CHECK(split.classes == std::vector<std::string>{"cat", "dog"});
  CHECK(split.train.size() == 3);
  CHECK(split.validation.size() == 3);
  CHECK(split.validation[2].label == 1);

  // Bad layouts are named.
  CHECK(contains(message_of([&] { scan_image_folder((root / "nope").string(), {}); }),
                 "no such folder"));
  write_marked(root / "split" / "val" / "emu" / "1.png", 0, 0);
  CHECK(contains(message_of([&] { scan_image_folder((root / "split").string(), {}); }),
                 "needs the same classes"));
  fs::create_directories(root / "empty" / "cat");
  CHECK(contains(message_of([&] { scan_image_folder((root / "empty").string(), {}); }),
                 "class folder '" + (root / "empty" / "cat").string() + "' holds no image"));
  fs::create_directories(root / "none");
  CHECK(contains(message_of([&] { scan_image_folder((root / "none").string(), {}); }),
                 "holds no class folder"));
  fs::remove_all(root);
}

TEST_CASE("decoding crops, flips and normalises as torchvision's transforms") {
  auto root = fresh_image_dir("decode");
  // Pixel (x, y) of an 8 x 6 image is (30 x, 40 y, 100): every crop says where it came from.
  auto png = root / "grid.png";
  write_png(png, 8, 6, rgb_image(8, 6, [](int x, int y) {
              return std::array<int, 3>{30 * x, 40 * y, 100};
            }));
  const float mean[] = {0.485f, 0.456f, 0.406f};
  const float stdev[] = {0.229f, 0.224f, 0.225f};
  auto pixel = [&](const torch::Tensor& img, int c, int y, int x) {
    return img[c][y][x].item<float>() * stdev[c] + mean[c];
  };
  image_transform t;
  t.size = 4;
  t.resize = 6; // the shorter side already: no resampling
  auto out = torch::empty({3, 4, 4});
  SUBCASE("the centre crop of evaluation") {
    load_image_into(png.string(), t, 0, out);
    // CenterCrop: offsets round((8 - 4) / 2) = 2 and round((6 - 4) / 2) = 1.
    for (int y = 0; y < 4; ++y) {
      for (int x = 0; x < 4; ++x) {
        CHECK(pixel(out, 0, y, x) == doctest::Approx(30.0 * (x + 2) / 255).epsilon(1e-5));
        CHECK(pixel(out, 1, y, x) == doctest::Approx(40.0 * (y + 1) / 255).epsilon(1e-5));
        CHECK(pixel(out, 2, y, x) == doctest::Approx(100.0 / 255).epsilon(1e-5));
      }
    }
  }
  SUBCASE("random crops are windows at every offset, flipped half the time, fixed by the draw") {
    t.random = true;
    std::set<int> xs;
    std::set<int> ys;
    int flipped = 0;
    for (uint64_t draw = 0; draw < 64; ++draw) {
      load_image_into(png.string(), t, draw, out);
      auto column = [&](int x) {
        return static_cast<int>(std::lround(pixel(out, 0, 0, x) * 255 / 30));
      };
      auto row = [&](int y) {
        return static_cast<int>(std::lround(pixel(out, 1, y, 0) * 255 / 40));
      };
      const bool flip = column(1) < column(0);
      flipped += flip ? 1 : 0;
      for (int x = 1; x < 4; ++x) {
        CHECK(column(x) - column(x - 1) == (flip ? -1 : 1));
      }
      for (int y = 1; y < 4; ++y) {
        CHECK(row(y) - row(y - 1) == 1);
      }
      xs.insert(flip ? column(3) : column(0));
      ys.insert(row(0));
      auto again = torch::empty({3, 4, 4});
      load_image_into(png.string(), t, draw, again);
      CHECK(torch::equal(out, again));
    }
    CHECK(xs == std::set<int>{0, 1, 2, 3, 4});
    CHECK(ys == std::set<int>{0, 1, 2});
    CHECK(flipped > 16);
    CHECK(flipped < 48);
  }
  SUBCASE("grey: stb_image's luma, normalised by 0.5 and 0.5") {
    t.channels = 1;
    auto grey = torch::empty({1, 4, 4});
    load_image_into(png.string(), t, 0, grey);
    for (int x = 0; x < 4; ++x) {
      const int r = 30 * (x + 2);
      const int g = 40;
      const int luma = (r * 77 + g * 150 + 100 * 29) >> 8;
      CHECK(grey[0][0][x].item<float>() * 0.5f + 0.5f ==
            doctest::Approx(luma / 255.0).epsilon(1e-5));
    }
  }
  SUBCASE("the shorter side is resized, keeping the aspect ratio, in either orientation") {
    // A flat colour stays that colour through resampling (PNG exactly, JPEG nearly).
    for (auto [w, h] : {std::pair{40, 20}, std::pair{20, 40}}) {
      const bool jpeg = w < h;
      auto flat = root / (jpeg ? "flat.jpg" : "flat.png");
      auto rgb = rgb_image(w, h, [](int, int) { return std::array<int, 3>{128, 64, 32}; });
      if (jpeg) {
        write_jpeg(flat, w, h, rgb);
      } else {
        write_png(flat, w, h, rgb);
      }
      image_transform r;
      r.size = 8;
      r.resize = 10; // 40 x 20 -> 20 x 10 (20 x 40 -> 10 x 20), then an 8 x 8 crop
      auto img = torch::empty({3, 8, 8});
      load_image_into(flat.string(), r, 0, img);
      const double tolerance = (jpeg ? 4.0 : 1.0) / 255;
      for (int c = 0; c < 3; ++c) {
        auto expect = (c == 0 ? 128 : c == 1 ? 64 : 32) / 255.0;
        CAPTURE(c);
        CAPTURE(jpeg);
        CHECK(std::abs(img[c].min().item<float>() * stdev[c] + mean[c] - expect) <= tolerance);
        CHECK(std::abs(img[c].max().item<float>() * stdev[c] + mean[c] - expect) <= tolerance);
      }
    }
  }
  SUBCASE("bad transforms and files are named") {
    t.size = 7; // larger than the resized side
    CHECK(
      contains(message_of([&] { load_image_into(png.string(), t, 0, out); }), "the crop must fit"));
    t.size = 4;
    t.channels = 2;
    CHECK(
      contains(message_of([&] { load_image_into(png.string(), t, 0, out); }), "1 or 3 channels"));
    t.channels = 3;
    CHECK(contains(message_of([&] { load_image_into((root / "missing.png").string(), t, 0, out); }),
                   "missing.png: cannot decode the image: no such file"));
  }
  fs::remove_all(root);
}

TEST_CASE("a file that is not an image is named: fail stops, skip leaves it out with the reason") {
  auto root = fresh_image_dir("bad");
  write_marked(root / "a" / "1.png", 1, 0);
  write_marked(root / "a" / "2.png", 2, 0);
  write_marked(root / "b" / "3.png", 3, 1);
  std::ofstream(root / "b" / "notes.txt") << "not an image";
  auto notes = (root / "b" / "notes.txt").string();
  auto failed = message_of([&] { scan_image_folder(root.string(), bad_image_policy::fail); });
  CHECK(contains(failed, notes + ": not an image stb_image can read"));
  CHECK(contains(failed, "--bad-images skip"));
  auto skipped = scan_image_folder(root.string(), bad_image_policy::skip);
  CHECK(skipped.train.size() == 3);
  REQUIRE(skipped.skipped.size() == 1);
  CHECK(contains(skipped.skipped[0], notes));

  // A truncated image passes the header check and fails to decode: named, or stood in for.
  truncate_file(root / "a" / "2.png");
  auto folder = scan_image_folder(root.string(), bad_image_policy::skip);
  REQUIRE(folder.train.size() == 3);
  image_transform t;
  t.size = 8;
  t.resize = 8;
  auto broken = (root / "a" / "2.png").string();
  CHECK(contains(message_of([&] { load_images(folder.train, t, 0); }),
                 broken + ": cannot decode the image"));
  std::vector<std::string> failures;
  auto [x, y] = load_images(folder.train, t, 0, &failures);
  REQUIRE(failures.size() == 1);
  CHECK(contains(failures[0], broken));
  // 2.png's place holds the next file, 3.png, with its label.
  CHECK(marked_index(x[1]) == 3);
  CHECK(y[1].item<int64_t>() == 1);
  CHECK(marked_index(x[0]) == 1);
  CHECK(marked_index(x[2]) == 3);
  fs::remove_all(root);
}

TEST_CASE("the loader's workers give every batch as the training thread would, each epoch visits "
          "every image once, and waits have a deadline") {
  auto root = fresh_image_dir("loader");
  // 30 images, 3 classes: image i is marked i.
  for (int i = 0; i < 30; ++i) {
    write_marked(root / ("class" + std::to_string(i % 3)) / ("img" + std::to_string(i) + ".png"), i,
                 i % 3);
  }
  auto folder = scan_image_folder(root.string(), bad_image_policy::fail);
  image_source_options o;
  o.transform.size = 8;
  o.transform.resize = 8;
  o.workers = 0;
  image_folder_source inline_source(folder, o);
  o.workers = 3;
  image_folder_source threaded(folder, o);
  CHECK(threaded.name() == "images:" + root.string());
  CHECK(threaded.epoch_samples() == 30);
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    std::set<int64_t> seen;
    for (int64_t b = 0; b < 5; ++b) {
      auto [x, y] = threaded.batch(epoch, b, 6, 7, 0, 1);
      auto [x0, y0] = inline_source.batch(epoch, b, 6, 7, 0, 1);
      CHECK(torch::equal(x, x0));
      CHECK(torch::equal(y, y0));
      for (int64_t i = 0; i < 6; ++i) {
        auto index = marked_index(x[i]);
        seen.insert(index);
        CHECK(y[i].item<int64_t>() == index % 3);
      }
    }
    CHECK(seen.size() == 30);
  }
  // Out of order (a resume mid-epoch): the same batch as in order.
  auto [late, late_y] = threaded.batch(0, 3, 6, 7, 0, 1);
  auto [in_order, in_order_y] = inline_source.batch(0, 3, 6, 7, 0, 1);
  CHECK(torch::equal(late, in_order));

  // Two replicas share an epoch between them.
  std::set<int64_t> shared;
  for (int64_t rank = 0; rank < 2; ++rank) {
    for (int64_t b = 0; b < 5; ++b) {
      auto [x, y] = threaded.batch(0, b, 6, 7, rank, 2);
      CHECK(x.size(0) == 3);
      for (int64_t i = 0; i < 3; ++i) {
        shared.insert(marked_index(x[i]));
      }
    }
  }
  CHECK(shared.size() == 30);

  {
    // A batch that takes one worker a while (6 noisy 1200 x 1200 images), and a deadline of 1 us.
    auto slow = root / "slow";
    uint32_t noise = 1;
    for (int i = 0; i < 6; ++i) {
      write_png(slow / "big" / ("big" + std::to_string(i) + ".png"), 1200, 1200,
                rgb_image(1200, 1200, [&](int, int) {
                  noise = noise * 1664525U + 1013904223U;
                  return std::array<int, 3>{static_cast<int>(noise >> 24), 0, 0};
                }));
    }
    auto hurried_options = o;
    hurried_options.workers = 1;
    hurried_options.deadline_seconds = 1e-6;
    image_folder_source hurried(scan_image_folder(slow.string(), {}), hurried_options);
    auto late_message = message_of([&] { hurried.batch(0, 0, 6, 7, 0, 1); });
    CHECK(contains(late_message, "did not deliver batch 0 of epoch 1 within 1e-06 s"));
  }

  // A worker's error reaches the training loop, naming the file.
  truncate_file(root / "class1" / "img4.png");
  o.deadline_seconds = 60;
  image_folder_source failing(folder, o);
  std::string error;
  for (int64_t b = 0; b < 5 && error.empty(); ++b) {
    error = message_of([&] { failing.batch(0, b, 6, 7, 0, 1); });
    if (error == "(nothing thrown)") {
      error.clear();
    }
  }
  CHECK(contains(error, (root / "class1" / "img4.png").string() + ": cannot decode the image"));
  o.bad = bad_image_policy::skip;
  image_folder_source skipping(folder, o);
  for (int64_t b = 0; b < 5; ++b) {
    CHECK(skipping.batch(0, b, 6, 7, 0, 1).first.size(0) == 6);
  }
  fs::remove_all(root);
}
