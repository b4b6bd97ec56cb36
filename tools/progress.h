#pragma once
// A one-line progress indicator on stderr for long runs. Quiet for the first 2 s by default
// (short runs print nothing; a run known to be long passes 0 to show its first line at once);
// then, on a terminal, one line redrawn in place at most 10 times a second and
// erased at the end; on a pipe or file, a plain line at most every 10 s, so logs stay short.

#include <chrono>
#include <string>

namespace replayssm::tools {

class Progress {
 public:
  explicit Progress(std::string label, double quiet_seconds = kDefaultQuietSeconds);
  static constexpr double kDefaultQuietSeconds = 2.0;
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  /// fraction in [0, 1]; `what` names the current part of the work (may be empty).
  void update(double fraction, const std::string& what = "");
  /// Erases the line, so that output to stdout on the same terminal starts clean; the next
  /// update draws it again.
  void clear();

 private:
  using Clock = std::chrono::steady_clock;
  std::string label_;
  double quiet_seconds_;
  bool terminal_;
  bool drawn_ = false;
  Clock::time_point start_;
  Clock::time_point last_draw_;
};

}  // namespace replayssm::tools
