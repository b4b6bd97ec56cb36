#pragma once
// The fused causal conv1d of conv caches (StateCacheConfig::conv_kernel; ops.h, ConvInputs):
// where each tap's input comes from and how a channel's output is formed, written once for the
// CPU decodes and the CUDA kernels' staging so that both round alike.

#include <cstdint>

#include "common/host_device.h"
#include "common/numeric.h"
#include "replayssm/ops.h"
#include "state_cache_layout.h"

namespace replayssm {

/// Elements from one token's row of ConvInputs::in to the next.
REPLAYSSM_HD std::int64_t conv_in_stride(const ConvInputs& conv, int channels) {
  return conv.stride != 0 ? conv.stride : channels;
}

/// The input of channel c at tap i (0 = oldest) of window token t of batch row b, whose slot's
/// committed position is `committed`: tap i reads position committed + t - (K - 1) + i, the
/// window's own token when that is at or after `committed`, else the conv ring.
template <typename input_t>
REPLAYSSM_HD float conv_tap(const StateCacheLayout& l, const ConvInputs& conv, int layer,
                            int slot, int b, int T, std::uint32_t committed, int t, int i, int c) {
  const int channels = l.conv_channels();
  const int d = t - (l.conv_kernel() - 1) + i;  // token offset from the window's start
  if (d >= 0) {
    const std::int64_t row = std::int64_t{b} * T + d;
    return to_float(static_cast<const input_t*>(conv.in)[row * conv_in_stride(conv, channels) + c]);
  }
  const std::int64_t rec = l.conv_record(layer, slot, committed + std::uint32_t(d));
  return to_float(static_cast<const input_t*>(l.conv_window)[rec * channels + c]);
}

/// One channel's output: acc = bias, then acc = conv_step(acc, weight[i], tap i) for the K
/// taps oldest first, then conv_finish(acc) = SiLU(acc) rounded to the input dtype (what the
/// decode then treats as its x, B, C or q, k, v). fp32 throughout, in that order, everywhere.
REPLAYSSM_HD float conv_step(float acc, float weight, float tap) { return fmaf(weight, tap, acc); }
template <typename input_t>
REPLAYSSM_HD input_t conv_finish(float acc) {
  return from_float<input_t>(silu(acc));
}

/// Channel c of window token t after the conv.
template <typename input_t>
REPLAYSSM_HD input_t conv_output(const StateCacheLayout& l, const ConvInputs& conv, int layer,
                                 int slot, int b, int T, std::uint32_t committed, int t, int c) {
  const int K = l.conv_kernel();
  const float* w = conv.weight + std::int64_t{c} * K;
  float acc = conv.bias != nullptr ? conv.bias[c] : 0.0f;
  for (int i = 0; i < K; ++i) {
    acc = conv_step(acc, w[i], conv_tap<input_t>(l, conv, layer, slot, b, T, committed, t, i, c));
  }
  return conv_finish<input_t>(acc);
}

}  // namespace replayssm
