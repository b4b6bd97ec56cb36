#pragma once
// The tolerance rules of oracle runs (oracle_run.h) in low precision, as assertions: the rule
// against the naive same-precision loop (naive.h), and the bounds each checkpoint
// precision's read copy allows.

#include "replayssm/types.h"
#include "testing/oracle_run.h"

namespace replayssm::testing {

/// The rule for a low-precision run: the naive same-precision loop ran and really saw an
/// error, and the run's error is at most twice it (+ `floor`, for errors exactly zero in both).
void expect_within_naive(const RunResult& r, double floor);
/// The bounds of a short fp32-input replay run by checkpoint precision, with u the unit
/// roundoff of the read copy (bf16 2^-8, fp8 e4m3 2^-4): fp32, outputs and exported state
/// within fp32_tol; fp32+bf16 / fp32+fp8, outputs within 2u and above fp32_tol (the low copy is
/// what outputs read), exported state within fp32_tol (folds use the fp32 master); shared bf16,
/// outputs within 4u and exported state within 4u but above fp32_tol (no master).
void expect_checkpoint_bounds(const RunResult& r, CheckpointPrecision precision, double fp32_tol);

}  // namespace replayssm::testing
