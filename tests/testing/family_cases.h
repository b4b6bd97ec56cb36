#pragma once
// Parameterised cases that the Mamba-2 and the GDN CPU suites (test_mamba2_cpu.cpp,
// test_gdn_cpu.cpp) both run, with one body each: the suite gives its family's spec or config
// and seed, this file the cases, the run and the checks.

#include <cstdint>
#include <ostream>

#include "replayssm/state_cache.h"
#include "replayssm/types.h"
#include "testing/oracle_run.h"

namespace replayssm::testing {

/// Arange-like inputs at a shape with no power of two: a swapped axis or a wrong stride moves a
/// value to where a different one is expected, which random data can average away.
struct StructuredCase {
  DecodeMode mode;
  int L;
};
void PrintTo(const StructuredCase& c, std::ostream* os);
inline constexpr StructuredCase kStructuredCases[] = {
    {DecodeMode::kEager, 1}, {DecodeMode::kReplay, 1}, {DecodeMode::kReplay, 3}};
/// `spec`: the family's odd shape in c.mode with fp32 inputs (and its call settings); run with
/// structured inputs, 3 rows, L = c.L, >= 4 fold cycles: outputs and states within tol.
void expect_structured_matches_oracle(RunSpec spec, const StructuredCase& c, std::uint64_t seed,
                                      double tol);

/// k single-token decodes (commit 1 each) and one k-token window (commit k) on the same tokens.
struct WindowCase {
  int T;
  int L;
};
void PrintTo(const WindowCase& c, std::ostream* os);
inline constexpr WindowCase kWindowCases[] = {{2, 1}, {2, 3}, {4, 2}, {4, 16}};
/// `config`: the family's kind and shape (L and T from c); 2 rows, 4L + 6 rounds: the two
/// caches' outputs and states within tol, the same tokens committed.
void expect_window_equals_single_steps(StateCacheConfig config, const WindowCase& c,
                                       std::uint64_t seed, double tol);

/// A replay cache in a checkpoint precision (short runs; the long-memory study is
/// test_dual_precision.cpp).
struct PrecisionCase {
  CheckpointPrecision precision;
  int L;
};
void PrintTo(const PrecisionCase& c, std::ostream* os);
inline constexpr PrecisionCase kPrecisionCases[] = {
    {CheckpointPrecision::kFp32Bf16, 2}, {CheckpointPrecision::kFp32Bf16, 16},
    {CheckpointPrecision::kFp32Fp8, 2},  {CheckpointPrecision::kFp32Fp8, 16},
    {CheckpointPrecision::kBf16, 4}};
/// `spec`: the family's replay cache with fp32 inputs; 3 rows, 4L + 3 steps: the bounds of
/// expect_checkpoint_bounds (tolerances.h).
void expect_checkpoint_precision_bounds(RunSpec spec, const PrecisionCase& c, std::uint64_t seed,
                                        double fp32_tol);

}  // namespace replayssm::testing
