#include "progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <utility>

namespace replayssm::tools {

namespace {
constexpr double kTerminalInterval = 0.1;
constexpr double kLogInterval = 10.0;
}  // namespace

Progress::Progress(std::string label, double quiet_seconds)
    : label_(std::move(label)),
      quiet_seconds_(quiet_seconds),
      terminal_(isatty(STDERR_FILENO) != 0),
      start_(Clock::now()),
      last_draw_(start_) {}

Progress::~Progress() { clear(); }

void Progress::clear() {
  if (terminal_ && drawn_) {
    std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
  }
}

void Progress::update(double fraction, const std::string& what) {
  const auto now = Clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double since_draw = std::chrono::duration<double>(now - last_draw_).count();
  if (elapsed < quiet_seconds_) return;
  if (drawn_ && since_draw < (terminal_ ? kTerminalInterval : kLogInterval)) return;
  last_draw_ = now;
  drawn_ = true;
  const int percent = static_cast<int>(100.0 * std::clamp(fraction, 0.0, 1.0));
  std::fprintf(stderr, "%s%s: %3d%%  %s  (%.0f s)%s", terminal_ ? "\r\033[K" : "", label_.c_str(),
               percent, what.c_str(), elapsed, terminal_ ? "" : "\n");
  std::fflush(stderr);
}

}  // namespace replayssm::tools
