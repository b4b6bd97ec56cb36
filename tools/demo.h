#pragma once
// `replayssm demo`: replay against eager on generated traces at real layer shapes.

#include <cstdint>
#include <cstdio>

#include "replayssm/status.h"
#include "replayssm/types.h"

namespace replayssm::tools {

struct DemoOptions {
  Device device = Device::kCpu;
  int batch = 16;
  int buffer_len = 16;
  int cycles = 4;  ///< tokens = cycles × buffer_len, so every replay run folds `cycles` times
  std::uint64_t seed = 1;
};

/// Runs both layer kinds (Mamba-2 at Nemotron-3-Nano-4B's shape, GDN at Qwen3.5-4B's) in
/// eager, replay with each checkpoint precision, and speculative replay, and prints how far
/// each is from eager and how fast it is.
Status run_demo(const DemoOptions& options, std::FILE* out);

}  // namespace replayssm::tools
