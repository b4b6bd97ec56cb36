#pragma once
// One decode call ready to run: its inputs uploaded into the cache's memory, its Args pointing
// at them, and an output buffer poisoned with NaN (which pad rows must keep).

#include <cstddef>
#include <cstdint>
#include <vector>

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "testing/device_buffer.h"
#include "testing/inputs.h"

namespace replayssm::testing {

struct Mamba2Call {
  Mamba2DecodeArgs args;
  CacheBuffer slots, x, dt, B, C, z, A, D, dt_bias, y;
  DType dtype = DType::kF32;  ///< of y
  std::size_t out_elems = 0;
  /// The outputs [batch, T, nheads, head_dim] as fp32.
  std::vector<float> output() const;
};
struct GdnCall {
  GdnDecodeArgs args;
  CacheBuffer slots, q, k, v, g, beta, o;
  DType dtype = DType::kF32;  ///< of o
  std::size_t out_elems = 0;
  std::vector<float> output() const;
};
Mamba2Call make_mamba2_call(const StateCache& cache, int layer,
                            const std::vector<std::int32_t>& slot_ids, const Mamba2Layer& params,
                            const Mamba2Tokens& tokens);
GdnCall make_gdn_call(const StateCache& cache, int layer, const std::vector<std::int32_t>& slot_ids,
                      const GdnTokens& tokens, bool qk_l2norm, float scale);

}  // namespace replayssm::testing
