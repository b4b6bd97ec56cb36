#pragma once
// The main driver: a cache (CPU or CUDA) and the float64 oracle (src/cpu/reference.h) decode
// the same seeded tokens side by side over many steps, with the integrity checks of every step
// (pad rows keep their poison, guard and free slots keep their bytes, a row's slot is untouched
// while the row pads) and, optionally, a naive same-precision loop and a plain (T = 1) cache
// fed the accepted stream of a speculative run.

#include <cstdint>
#include <string>
#include <vector>

#include "replayssm/state_cache.h"
#include "replayssm/types.h"
#include "testing/inputs.h"

namespace replayssm::testing {

struct RunSpec {
  StateCacheConfig cache;  ///< capacity is set by the driver (batch + guard slots + 1 free)
  int batch = 2;
  int steps = 64;
  std::uint64_t seed = 1;
  Recipe recipe;
  bool gate = false;        ///< Mamba-2: pass z
  bool qk_l2norm = true;    ///< GDN
  float scale = 0.0f;       ///< GDN
  /// Window T of every decode (<= cache.max_spec_tokens). T = 1: plain decoding, every token
  /// committed. T > 1: each row accepts k ~ U{0..T} (a separate seeded stream).
  int window = 1;
  /// Row r joins at step r·stagger (a pad row −1 before), so rows sit at different ring fill
  /// levels in one batch.
  int stagger = 0;
  /// Also run a same-precision naive loop (state in naive_state_dtype).
  bool naive = false;
  DType naive_state_dtype = DType::kF32;
  /// Spec only: rerun the accepted stream through a plain (T = 1) cache of the same config and
  /// compare its outputs with the window's at accepted positions.
  bool compare_plain = false;
  /// Extra allocated slots no row uses: their bytes must stay as allocated.
  int guard_slots = 1;
  /// Replay: the fold cadence of each step's decodes, cycled (family.h, fold_every_at; empty:
  /// the cache's buffer_len).
  std::vector<int> fold_every;
};

struct RunResult {
  /// Empty when every call returned ok and every integrity check held; else what went wrong
  /// first (a Status, a NaN output, a written pad row, a touched guard slot).
  std::string failure;
  std::vector<double> step_error;  ///< per step, max over layers of the error vs the oracle
  double max_error = 0.0;
  std::vector<double> naive_step_error;
  double naive_max_error = 0.0;
  /// compare_plain: max over steps of max|y_window − y_plain| / max|ref| at accepted positions.
  double plain_max_error = 0.0;
  /// After the run: exported state of every (layer, row) vs the oracle's, max|ΔS| / max|S|.
  double export_error = 0.0;
  std::int64_t tokens_committed = 0;
  /// The most distinct (committed − folded) values among real rows at the start of a step.
  int max_distinct_fill_levels = 0;
};

RunResult run_mamba2(const RunSpec& spec);
RunResult run_gdn(const RunSpec& spec);
/// run_mamba2 or run_gdn, by spec.cache.kind.
RunResult run_oracle(const RunSpec& spec);

/// GDN over a long memory (the dual-precision study, ALGORITHM.md §6, §10): g ≈ −0.001 and
/// small β ~ U(0.02, 0.06), about 500-1,000 tokens of memory; Hk=2, Hv=4, K=32, V=16, replay
/// with `buffer_len`, fp32 inputs, 2 rows, `steps` steps, seed 901, no guard slots, on the CPU
/// (callers set cache.device and cache.checkpoint).
RunSpec gdn_long_memory_spec(int buffer_len, int steps);

}  // namespace replayssm::testing
