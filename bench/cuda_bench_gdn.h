#pragma once
/// \file cuda_bench_gdn.h
/// The Gated DeltaNet part of the CUDA benchmark (bench/cuda_bench_gdn.cu), for run_cuda_bench
/// (bench/cuda_bench.cu) to call on shapes of kind kGdn. Timings follow BENCHMARKS.md's
/// protocol: whole fold cycles of L steps captured into one CUDA graph, timed with events after
/// warm-up, median of the repetitions, slots rotated so that a cycle streams several times the
/// L2; inputs drawn once per step of a cycle (realistic scales, never zeros).

#include <string>
#include <vector>

#include "bench.h"
#include "replayssm/status.h"
#include "replayssm/types.h"

namespace replayssm {

/// Per batch of options.batches: our eager kernel (options.eager_state_dtype) and replay in
/// each of options.checkpoints; each step is one decode of options.layers layers plus one
/// commit (BenchOptions::layers). Appends timings to report->results; bench_finish fills the
/// rest.
Status run_cuda_bench_gdn(const BenchShape& shape, const BenchOptions& options,
                          BenchReport* report);

/// Speculative decoding with T-token windows, µs per verify step of one layer:
///   replay: one decode verifying T tokens (every output from the unchanged checkpoint), then a
///           commit of `accepted` of them (folds fall due as history accumulates);
///   eager spec: one decode of an eager cache with max_spec_tokens = T (the baseline: the
///           state read once and one state copy written per window token, T + 1 state
///           transfers; eager_fused_us = eager_us), then the commit that selects the copy of
///           the same `accepted`.
/// accepted = kRandomAcceptance (spec_acceptance.h): both commit the same per-row, per-step
/// draws over random_acceptance_steps steps.
struct GdnSpecResult {
  std::string shape;
  int batch = 0;
  int window = 0;    ///< T
  int accepted = 0;  ///< k committed per step, or kRandomAcceptance
  int buffer_len = 0;
  CheckpointPrecision checkpoint = CheckpointPrecision::kFp32;
  double replay_us = 0.0;
  double eager_us = 0.0;
  double eager_fused_us = 0.0;
  double speedup = 0.0;        ///< eager_us / replay_us
  double speedup_fused = 0.0;  ///< eager_fused_us / replay_us
};
Status run_cuda_bench_gdn_spec(const BenchShape& shape, int batch, int window, int accepted,
                               const BenchOptions& options, std::vector<GdnSpecResult>* out);


}  // namespace replayssm
