#include "testing/tolerances.h"

#include <gtest/gtest.h>

#include <cmath>

namespace replayssm::testing {

void expect_within_naive(const RunResult& r, double floor) {
  ASSERT_FALSE(r.naive_step_error.empty());
  EXPECT_GT(r.naive_max_error, 0.0);  // the low precision is really there
  EXPECT_LE(r.max_error, 2.0 * r.naive_max_error + floor)
      << "naive same-precision loop: " << r.naive_max_error;
}

void expect_checkpoint_bounds(const RunResult& r, CheckpointPrecision precision,
                              double fp32_tol) {
  const double bf16_u = std::ldexp(1.0, -8), fp8_u = std::ldexp(1.0, -4);
  switch (precision) {
    case CheckpointPrecision::kFp32:
      EXPECT_LE(r.max_error, fp32_tol);
      EXPECT_LE(r.export_error, fp32_tol);
      break;
    case CheckpointPrecision::kFp32Bf16:
      EXPECT_LE(r.max_error, 2 * bf16_u);
      EXPECT_GT(r.max_error, fp32_tol);  // the bf16 copy is what outputs read
      EXPECT_LE(r.export_error, fp32_tol);  // folds use the fp32 master
      break;
    case CheckpointPrecision::kFp32Fp8:
      EXPECT_LE(r.max_error, 2 * fp8_u);
      EXPECT_GT(r.max_error, fp32_tol);
      EXPECT_LE(r.export_error, fp32_tol);
      break;
    case CheckpointPrecision::kBf16:
      EXPECT_LE(r.max_error, 4 * bf16_u);
      EXPECT_GT(r.export_error, fp32_tol);  // no master: the state itself is bf16
      EXPECT_LE(r.export_error, 4 * bf16_u);
      break;
  }
}

}  // namespace replayssm::testing
