#pragma once
// The fused causal conv1d in the replay kernels' staging (conv caches: ops.h, ConvInputs).
// A block convolves the channels its heads read, for the window's T tokens, straight into the
// shared memory where the kernel would have staged the convolved inputs, and appends those
// channels' pre-conv inputs to the conv ring; the arithmetic is common/causal_conv.h's, as on
// the CPU. Taps before the window read the ring at positions < committed, which no block of
// the launch writes (appends go to committed.. committed + T - 1), so blocks need no order.
//
// The kernels instantiate this code only for conv caches (a template flag), so the plain
// instantiations are unchanged; as calls (__noinline__) it was slower still (super120b, bf16
// checkpoint, batch 256: 397 µs per step against 296 inlined). Each thread takes runs of
// kRun = 8 channels: per tap one 16-byte load of each input row (two
// for fp32) and the run's weights as float4s, all issued before the arithmetic. One channel
// per thread, each tap's address computed per channel, cost more than a separate conv kernel
// (super120b, fp32 checkpoint, batch 1: 14.2 µs per step against 10.4).

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
                    reinterpret_cast<std::uintptr_t>(dst) |
                    reinterpret_cast<std::uintptr_t>(conv.weight);
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
  const int runs = n / kRun;
  for (int i = threadIdx.x; i < T * runs; i += blockDim.x) {
    const int t = i / runs, c0 = first + (i - t * runs) * kRun;
    float taps[K][kRun];
#pragma unroll
    for (int k = 0; k < K; ++k) {  // tap k reads position committed + t - (K - 1) + k
      const int d = t - (K - 1) + k;
      const input_t* row =
          d >= 0 ? in + (std::int64_t{b} * T + d) * stride
                 : ring + l.conv_record(layer, slot, committed + std::uint32_t(d)) * channels;
      load_run(row + c0, taps[k]);
    }
    float w[kRun * K];
    const float4* wv = reinterpret_cast<const float4*>(conv.weight + std::int64_t{c0} * K);
#pragma unroll
    for (int v = 0; v < kRun * K / 4; ++v) reinterpret_cast<float4*>(w)[v] = wv[v];
    alignas(16) input_t out[kRun];
#pragma unroll
    for (int j = 0; j < kRun; ++j) {
      const float bias = conv.bias != nullptr ? conv.bias[c0 + j] : 0.0f;
      out[j] = conv_silu<input_t>(w + j * K, bias, K, [&](int k) { return taps[k][j]; });
    }
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
