/// \file
/// A progress bar on stderr: redrawn in place on a terminal, a line per tenth otherwise (CI logs).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include <unistd.h>

namespace actorpipe::training {

class progress_bar {
public:
  progress_bar(std::string label, int64_t total)
    : label_(std::move(label)), total_(total), tty_(isatty(fileno(stderr)) == 1),
      start_(clock::now()), last_draw_(start_) {}

  /// `done` of `total` units finished; `suffix` is shown after the bar (rate, loss, ...).
  void update(int64_t done, const std::string& suffix) {
    auto now = clock::now();
    bool finished = done >= total_;
    if (tty_) {
      if (!finished && now - last_draw_ < std::chrono::milliseconds(100)) {
        return;
      }
    } else {
      auto tenth = total_ > 0 ? done * 10 / total_ : 10;
      if (!finished && tenth == last_tenth_) {
        return;
      }
      last_tenth_ = tenth;
    }
    last_draw_ = now;
    constexpr int width = 30;
    auto fraction = total_ > 0 ? static_cast<double>(done) / static_cast<double>(total_) : 1.0;
    auto filled = static_cast<int>(fraction * width);
    auto elapsed = std::chrono::duration<double>(now - start_).count();
    auto eta = fraction > 0 ? elapsed * (1 - fraction) / fraction : 0.0;
    std::string bar(static_cast<std::size_t>(filled), '#');
    bar.resize(width, '.');
    std::fprintf(stderr, "%s%s [%s] %3d%% %lld/%lld %s ETA %dm%02ds%s", tty_ ? "\r" : "",
                 label_.c_str(), bar.c_str(), static_cast<int>(fraction * 100),
                 static_cast<long long>(done), static_cast<long long>(total_), suffix.c_str(),
                 static_cast<int>(eta) / 60, static_cast<int>(eta) % 60,
                 tty_ && !finished ? "\033[K" : "\n");
    std::fflush(stderr);
  }

  double elapsed_seconds() const {
    return std::chrono::duration<double>(clock::now() - start_).count();
  }

private:
  using clock = std::chrono::steady_clock;
  std::string label_;
  int64_t total_;
  bool tty_;
  clock::time_point start_;
  clock::time_point last_draw_;
  int64_t last_tenth_ = -1;
};

} // namespace actorpipe::training
