#pragma once
// The CUDA backend against the CPU backend, side by side: two caches of one config on the two
// devices decode the same inputs step after step; outputs, cursors, untouched slots and the
// exported states are compared. Built without the CUDA runtime: the CUDA cache is reached
// through the library's API only.

#include <cstdint>
#include <vector>

#include "replayssm/state_cache.h"

namespace replayssm::testing {

/// `config` (a CPU config; the CUDA cache is its copy on Device::kCuda) with capacity batch + 2,
/// slot 0 and the last one guards no row uses; rows in slots 1..batch plus one pad row; row r
/// joins at step r·stagger; windows of T = config.max_spec_tokens with accepted ~ U{0..T}
/// (1 each for T = 1).
struct CudaVsCpuSpec {
  StateCacheConfig config;
  int batch = 3;
  int steps = 24;
  int stagger = 0;
  std::uint64_t seed = 1;
  bool load_initial = true;  ///< start every row from a loaded N(0, initial_sd) state
  double initial_sd = 0.5;
  bool gate = true;          ///< Mamba-2
  bool qk_l2norm = true;     ///< GDN (raw keys drawn with |k| ≈ 1 without it)
  double output_tol = 0.0;   ///< per decode call and row, max|o_cuda − o_cpu| / max|o_cpu|
  double state_tol = 0.0;    ///< every exported state at the end, likewise
  /// The fold cadence of each step's decodes, cycled (family.h, fold_every_at).
  std::vector<int> fold_every;
};
/// Fatal assertions on outputs past output_tol, a written pad row, a cursor differing after a
/// commit, a failed call; non-fatal ones on written guard slots and exported states past
/// state_tol. *worst: the largest output difference seen.
void compare_cuda_vs_cpu(const CudaVsCpuSpec& spec, double* worst);

}  // namespace replayssm::testing
