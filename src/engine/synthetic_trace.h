#pragma once
/// \file synthetic_trace.h
/// Generated layer traces with the statistics of a real model's decode (for the demo, the
/// benchmarks and tests that need real layer shapes without a recorded run):
///   Mamba-2: A = -a, a ~ U[1, 16] (the models' A_log init); dt_bias = log(e^Δ0 - 1) with Δ0
///            log-uniform in [1e-3, 0.1] (≈ -4 on average); raw dt ~ N(0, 0.5²); x, B, C, z
///            ~ N(0, 1); D ~ U[0.5, 1.5].
///   GDN:     q, k, v ~ N(0, 1) (the op L2-normalises q and k); g = -a·softplus(u + dt_bias)
///            with a ~ U[1, 16] per head, u ~ N(0, 1), dt_bias as above; beta = sigmoid(N(0, 1)).
///   state0 ~ N(0, 0.1²) for both, so that the first outputs already read a non-trivial state.
/// No value is zero and every value obeys trace_validate's rules.

#include <cstdint>

#include "io/trace.h"
#include "replayssm/status.h"
#include "replayssm/types.h"

namespace replayssm {

struct SyntheticTraceOptions {
  int num_steps = 64;
  int batch = 1;
  std::uint64_t seed = 0;
  bool mamba2_gate = true;  ///< generate Mamba-2's optional z
};

Status synthetic_trace_mamba2(const Mamba2Shape& shape, const SyntheticTraceOptions& options,
                              LayerTrace* out);
Status synthetic_trace_gdn(const GdnShape& shape, const SyntheticTraceOptions& options,
                           LayerTrace* out);

}  // namespace replayssm
