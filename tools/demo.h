#pragma once
// `replayssm demo`: replay against eager at real layer shapes, on generated inputs. Two parts:
// agreement (a small batch decoded in every mode through the trace engine, each compared with
// eager decoding) and speed (the benchmark's timed cycles at a batch whose state streams from
// memory), then, for each replay mode that did not beat eager, why, from what the run measured.

#include <cstdint>
#include <cstdio>

#include "replayssm/status.h"
#include "replayssm/types.h"

namespace replayssm::tools {

struct DemoOptions {
  Device device = Device::kCpu;
  int batch = 0;        ///< speed part; 0 = kDemoBatchCpu or kDemoBatchCuda by device
  int buffer_len = 16;  ///< L, both parts
  int cycles = 8;       ///< agreement part: tokens = cycles × L, so every replay run folds
  std::uint64_t seed = 1;
  /// Speed part, as BenchOptions::min_state_bytes (0: 4 × the cache, within a memory budget).
  std::int64_t min_state_bytes = 0;
};

inline constexpr int kDemoBatchCpu = 64;    ///< a serving batch that a 2-core CPU times in seconds
inline constexpr int kDemoBatchCuda = 256;  ///< the benchmark's headline batch
inline constexpr int kDemoAgreementBatch = 4;

/// Runs both layer kinds (Mamba-2 at Nemotron-3-Nano-4B's shape, GDN at Qwen3.5-4B's) and
/// prints the two parts. Fails (after printing) when a replay mode disagrees with eager beyond
/// its tolerance.
Status run_demo(const DemoOptions& options, std::FILE* out);

}  // namespace replayssm::tools
