#pragma once
// Naive same-precision loops: §1/§2 in fp32 with the state stored in `state_dtype` after every
// update and the outputs rounded to `out_dtype`: the yardstick for long runs (FlashAttention's
// rule): a path's error vs the oracle should be no more than about twice this loop's
// (tolerances.h).

#include <vector>

#include "replayssm/types.h"

namespace replayssm::testing {

void naive_mamba2_step(const Mamba2Shape& shape, DType state_dtype, DType out_dtype,
                       std::vector<float>& state, const float* x, const float* dt, const float* B,
                       const float* C, const float* z, const float* A, const float* D,
                       const float* dt_bias, float* y);
void naive_gdn_step(const GdnShape& shape, DType state_dtype, DType out_dtype,
                    std::vector<float>& state, const float* q, const float* k, const float* v,
                    const float* g, const float* beta, bool qk_l2norm, float scale, float* o);

}  // namespace replayssm::testing
