#pragma once
// The fused causal conv1d in the replay kernels' staging (conv caches: ops.h, ConvInputs).
// A block convolves the channels its heads read, for the window's T tokens, straight into the
// shared memory where the kernel would have staged the convolved inputs, and appends those
// channels' pre-conv inputs to the conv ring; the arithmetic is common/causal_conv.h's, as on
// the CPU. Taps before the window read the ring at positions < committed, which no block of
// the launch writes (appends go to committed.. committed + T - 1), so blocks need no order.
//
// The kernels instantiate this code only for conv caches (a template flag), so the plain
// instantiations are unchanged. Each thread takes runs of kRun = 8 channels, tap by tap: one
// 16-byte load of each tap's input row (two for fp32), the run's weights of that tap, kRun
// accumulators (~20 registers). Measured on the H200 (µs per step, bf16 checkpoint, batch
// 256; docs/BENCHMARKS.md, Fused conv1d): with every tap and weight of a run loaded before the
// arithmetic (~70 registers) the GDN kernel spilled under its cap of 64 (qwen35-4b 247 against
// 198 tap by tap), while the Mamba-2 kernel, with 80, was faster that way (super120b 296
// against 364); as calls (__noinline__) instead of inlined, 397 at super120b. One channel per
// thread, each tap's address computed per channel, measured about the same as runs at
// super120b (fp32 checkpoint, batch 1 / 64: 14.2 / 106.2 against 16.0 / 106.5).

#include <cstdint>

#include "common/causal_conv.h"
#include "state_cache_layout.h"

namespace replayssm::cuda {

namespace conv_detail {

constexpr int kRun = 8;
constexpr int kModelTaps = 4;  // the conv width of every target model (Mamba-2, GDN)

// A run of kRun consecutive elements as fp32 (16-byte loads; the caller checked alignment).
template <typename input_t>
__device__ __forceinline__ void load_run(const input_t* p, float* out) {
  constexpr int kPer16 = 16 / int(sizeof(input_t));
#pragma unroll
  for (int v = 0; v < kRun / kPer16; ++v) {
    const uint4 raw = reinterpret_cast<const uint4*>(p)[v];
    const input_t* e = reinterpret_cast<const input_t*>(&raw);
#pragma unroll
    for (int i = 0; i < kPer16; ++i) out[v * kPer16 + i] = to_float(e[i]);
  }
}

template <typename input_t>
__device__ __forceinline__ void store_run(input_t* p, const input_t* v) {
  constexpr int kPer16 = 16 / int(sizeof(input_t));
#pragma unroll
  for (int i = 0; i < kRun / kPer16; ++i) {
    reinterpret_cast<uint4*>(p)[i] = reinterpret_cast<const uint4*>(v)[i];
  }
}

// Whether every run starts on a 16-byte boundary: the inputs' rows, the ring's rows, the range.
template <typename input_t>
__device__ __forceinline__ bool runs_aligned(const StateCacheLayout& l, const ConvInputs& conv,
                                             int first, int n, const void* dst, int dst_stride) {
  const int channels = l.conv_channels();
  const std::int64_t stride = conv_in_stride(conv, channels);
  const auto bits = reinterpret_cast<std::uintptr_t>(conv.in) |
                    reinterpret_cast<std::uintptr_t>(l.conv_window) |
                    reinterpret_cast<std::uintptr_t>(dst);
  return (bits & 15u) == 0 && first % kRun == 0 && n % kRun == 0 && channels % kRun == 0 &&
         stride % kRun == 0 && dst_stride % kRun == 0;
}

}  // namespace conv_detail

/// Channels [first, first + n) of the window's tokens after the conv: token t's into
/// dst + t·dst_stride (input dtype, plain stores by the whole block). Runs of kRun channels
/// for the models' width K = 4 when aligned; one channel per thread otherwise.
template <typename input_t>
__device__ __forceinline__ void conv_channels(const StateCacheLayout& l, const ConvInputs& conv,
                                              int layer, int slot, int b, int T,
                                              std::uint32_t committed, int first, int n,
                                              input_t* dst, int dst_stride) {
  using namespace conv_detail;
  constexpr int K = kModelTaps;
  if (l.conv_kernel() != K || !runs_aligned<input_t>(l, conv, first, n, dst, dst_stride)) {
    for (int i = threadIdx.x; i < T * n; i += blockDim.x) {
      const int t = i / n, c = i - t * n;
      dst[t * dst_stride + c] =
          conv_output<input_t>(l, conv, layer, slot, b, T, committed, t, first + c);
    }
    return;
  }
  const int channels = l.conv_channels();
  const std::int64_t stride = conv_in_stride(conv, channels);
  const auto* in = static_cast<const input_t*>(conv.in);
  const auto* ring = static_cast<const input_t*>(l.conv_window);
  // Tap k of window token t reads position committed + t - (K - 1) + k.
  const auto tap_row = [&](int t, int k) -> const input_t* {
    const int d = t - (K - 1) + k;
    return d >= 0 ? in + (std::int64_t{b} * T + d) * stride
                  : ring + l.conv_record(layer, slot, committed + std::uint32_t(d)) * channels;
  };
  const int runs = n / kRun;
  for (int i = threadIdx.x; i < T * runs; i += blockDim.x) {
    const int t = i / runs, c0 = first + (i - t * runs) * kRun;
    // Tap by tap into kRun accumulators (~20 registers).
    float acc[kRun];
#pragma unroll
    for (int j = 0; j < kRun; ++j) acc[j] = conv.bias != nullptr ? conv.bias[c0 + j] : 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float v[kRun];
      load_run(tap_row(t, k) + c0, v);
#pragma unroll
      for (int j = 0; j < kRun; ++j) {
        acc[j] = conv_step(acc[j], conv.weight[std::int64_t{c0 + j} * K + k], v[j]);
      }
    }
    alignas(16) input_t out[kRun];
#pragma unroll
    for (int j = 0; j < kRun; ++j) out[j] = conv_finish<input_t>(acc[j]);
    store_run(dst + t * dst_stride + (c0 - first), out);
  }
}

/// Channels [first, first + n) of the window's pre-conv inputs into the conv ring at
/// committed + t (whole block).
template <typename input_t>
__device__ __forceinline__ void append_conv_channels(const StateCacheLayout& l,
                                                     const ConvInputs& conv, int layer, int slot,
                                                     int b, int T, std::uint32_t committed,
                                                     int first, int n) {
  using namespace conv_detail;
  const int channels = l.conv_channels();
  const std::int64_t stride = conv_in_stride(conv, channels);
  const auto* in = static_cast<const input_t*>(conv.in);
  auto* ring = static_cast<input_t*>(l.conv_window);
  const int runs = n / kRun;
  const bool aligned = runs_aligned<input_t>(l, conv, first, n, ring, kRun);
  for (int i = threadIdx.x; i < T * (aligned ? runs : n); i += blockDim.x) {
    const int t = aligned ? i / runs : i / n;
    const std::int64_t rec = l.conv_record(layer, slot, committed + std::uint32_t(t));
    const std::int64_t from = (std::int64_t{b} * T + t) * stride;
    if (aligned) {  // 16-byte pieces (kRun channels are one or two of them)
      const int c = first + (i - t * runs) * kRun;
      constexpr int kPer16 = 16 / int(sizeof(input_t));
#pragma unroll
      for (int v = 0; v < kRun / kPer16; ++v) {
        reinterpret_cast<uint4*>(ring + rec * channels + c)[v] =
            reinterpret_cast<const uint4*>(in + from + c)[v];
      }
    } else {
      const int c = first + i - t * n;
      ring[rec * channels + c] = in[from + c];
    }
  }
}

}  // namespace replayssm::cuda
