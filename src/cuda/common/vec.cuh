#pragma once
// Vector memory access and lane-group reductions for the CUDA kernels.
//
// Decode of an SSM layer is bound by streaming the state, so every state access goes through
// `Packed` (kN elements moved in the widest word that divides them, up to 16 bytes) and
// `RowSplit` (one state row spread over a group of lanes so that each warp-wide access is one
// contiguous run of memory). Values cross to fp32 only through numeric.h, so the CUDA kernels
// round exactly as the CPU backend does.

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/numeric.h"

namespace replayssm::cuda {

/// Cache policy of a global access. kStreaming (ld/st.global.cs, "evict first") is for data
/// touched once per step and far larger than L2 (the state); kDefault for everything that is
/// re-read by other blocks (ring records, inputs).
enum class CacheOp { kDefault, kStreaming };

namespace detail {

// The widest of 16/8/4/2/1-byte words that divides kBytes.
template <int kBytes>
using word_for_t = std::conditional_t<
    kBytes % 16 == 0, uint4,
    std::conditional_t<kBytes % 8 == 0, uint2,
                       std::conditional_t<kBytes % 4 == 0, std::uint32_t,
                                          std::conditional_t<kBytes % 2 == 0, std::uint16_t,
                                                             std::uint8_t>>>>;

template <CacheOp op, typename W>
__device__ __forceinline__ W load_word(const W* p) {
  if constexpr (op == CacheOp::kStreaming) {
    return __ldcs(p);
  } else {
    return *p;
  }
}

template <CacheOp op, typename W>
__device__ __forceinline__ void store_word(W* p, const W& w) {
  if constexpr (op == CacheOp::kStreaming) {
    __stcs(p, w);
  } else {
    *p = w;
  }
}

}  // namespace detail

/// kN contiguous elements of T held as raw words, so that a load can be issued long before its
/// values are used (the words are registers; nothing is decoded until unpack()).
/// The address must be aligned to the word size (kN·sizeof(T) rounded down to 16/8/4/2/1).
template <typename T, int kN>
struct Packed {
  static constexpr int kBytes = kN * int(sizeof(T));
  using word_t = detail::word_for_t<kBytes>;
  static constexpr int kWords = kBytes / int(sizeof(word_t));
  word_t w[kWords];

  template <CacheOp op = CacheOp::kDefault>
  __device__ __forceinline__ void load(const T* src) {
    const auto* p = reinterpret_cast<const word_t*>(src);
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = detail::load_word<op>(p + i);
  }

  template <CacheOp op = CacheOp::kDefault>
  __device__ __forceinline__ void store(T* dst) const {
    auto* p = reinterpret_cast<word_t*>(dst);
#pragma unroll
    for (int i = 0; i < kWords; ++i) detail::store_word<op>(p + i, w[i]);
  }

  /// out[i] = element i as fp32 (numeric.h's to_float).
  __device__ __forceinline__ void unpack(float (&out)[kN]) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if constexpr (std::is_same_v<T, fp8e4m3_t> && kN % 2 == 0) {
      // e4m3 -> f16 -> f32 in hardware, two at a time: both steps are exact, so this equals
      // numeric.h's to_float bit for bit, in 1.5 instructions per value instead of ~10.
      std::uint16_t pairs[kN / 2];
      memcpy(pairs, w, kBytes);
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3);
        const float2 f = __half22float2(__half2(h));
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
      }
      return;
    }
#endif
    if constexpr (std::is_same_v<T, bf16_t> && kN % 2 == 0) {
      // Two per 32-bit word: the low one shifted up, the high one masked (to_float exactly, one
      // instruction a value where extracting each half first took two).
      std::uint32_t pairs[kN / 2];
      memcpy(pairs, w, kBytes);
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) {
        out[2 * i] = __uint_as_float(pairs[i] << 16);
        out[2 * i + 1] = __uint_as_float(pairs[i] & 0xffff0000u);
      }
    } else {
      T e[kN];
      memcpy(e, w, kBytes);
#pragma unroll
      for (int i = 0; i < kN; ++i) out[i] = to_float(e[i]);
    }
  }

  /// element i = in[i] rounded to T (numeric.h's from_float: nearest-even, fp8 saturating).
  __device__ __forceinline__ void pack(const float (&in)[kN]) {
    if constexpr (std::is_same_v<T, bf16_t> && kN % 2 == 0) {
      std::uint32_t pairs[kN / 2];
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) pairs[i] = float2_to_bf16x2(in[2 * i], in[2 * i + 1]);
      memcpy(w, pairs, kBytes);
    } else {
      T e[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) e[i] = from_float<T>(in[i]);
      memcpy(w, e, kBytes);
    }
  }
};

/// One row of kCols columns split across kLanes consecutive lanes (a lane group, aligned
/// within its warp), kPerLane = kCols / kLanes columns per lane.
///
/// Layout: the row is cut into vectors of kVec<order_t> elements (16 bytes of order_t), dealt
/// round-robin to the lanes: lane l holds vectors l, l + kLanes, l + 2·kLanes, ... So each
/// warp-wide access of one vector per lane covers kLanes·16 contiguous bytes per row (a whole
/// number of 32-byte sectors) instead of every lane striding over its own contiguous run.
/// `order_t` fixes which columns a lane holds; the element type T of an access may differ
/// (a fold reads fp32 in fp32 order and writes bf16 in the same order, 8-byte vectors).
template <int kCols, int kLanes>
struct RowSplit {
  static_assert(kCols % kLanes == 0, "a row must split evenly over its lanes");
  static_assert(kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "lane groups are powers of two");
  static constexpr int kRowCols = kCols;
  static constexpr int kRowLanes = kLanes;
  static constexpr int kPerLane = kCols / kLanes;

  template <typename order_t>
  static constexpr int kVec =
      (16 / int(sizeof(order_t))) < kPerLane ? 16 / int(sizeof(order_t)) : kPerLane;
  template <typename order_t>
  static constexpr int kChunks = kPerLane / kVec<order_t>;

  /// Column of this lane's i-th value (i in [0, kPerLane)).
  template <typename order_t>
  __device__ __forceinline__ static int col(int lane, int i) {
    constexpr int v = kVec<order_t>;
    return (i / v) * (kLanes * v) + lane * v + i % v;
  }

  /// This lane's part of a row, as loaded: kChunks vectors of T in order_t's layout.
  template <typename T, typename order_t = T>
  struct Fragment {
    static constexpr int kVecN = kVec<order_t>;
    Packed<T, kVecN> chunk[kChunks<order_t>];

    template <CacheOp op = CacheOp::kDefault>
    __device__ __forceinline__ void load(const T* row, int lane) {
#pragma unroll
      for (int k = 0; k < kChunks<order_t>; ++k) {
        chunk[k].template load<op>(row + (k * kLanes + lane) * kVecN);
      }
    }
    template <CacheOp op = CacheOp::kDefault>
    __device__ __forceinline__ void store(T* row, int lane) const {
#pragma unroll
      for (int k = 0; k < kChunks<order_t>; ++k) {
        chunk[k].template store<op>(row + k * kLanes * kVecN + lane * kVecN);
      }
    }
    __device__ __forceinline__ void unpack(float (&out)[kPerLane]) const {
#pragma unroll
      for (int k = 0; k < kChunks<order_t>; ++k) {
        float v[kVecN];
        chunk[k].unpack(v);
#pragma unroll
        for (int e = 0; e < kVecN; ++e) out[k * kVecN + e] = v[e];
      }
    }
    __device__ __forceinline__ void pack(const float (&in)[kPerLane]) {
#pragma unroll
      for (int k = 0; k < kChunks<order_t>; ++k) {
        float v[kVecN];
#pragma unroll
        for (int e = 0; e < kVecN; ++e) v[e] = in[k * kVecN + e];
        chunk[k].pack(v);
      }
    }
  };

  /// This lane's values of an fp32 row of all kCols columns in shared memory, in order_t's
  /// layout: kVec<order_t> >= 4 contiguous floats per vector, read as 16-byte loads.
  template <typename order_t>
  __device__ __forceinline__ static void gather(const float* row, int lane,
                                                float (&out)[kPerLane]) {
    constexpr int v = kVec<order_t>;
    static_assert(v % 4 == 0, "lane vectors are whole float4s");
#pragma unroll
    for (int k = 0; k < kChunks<order_t>; ++k) {
#pragma unroll
      for (int e = 0; e < v / 4; ++e) {
        const float4 f = *reinterpret_cast<const float4*>(row + k * kLanes * v + lane * v + 4 * e);
        out[k * v + 4 * e + 0] = f.x;
        out[k * v + 4 * e + 1] = f.y;
        out[k * v + 4 * e + 2] = f.z;
        out[k * v + 4 * e + 3] = f.w;
      }
    }
  }
};

/// Sum / max over an aligned group of kLanes consecutive lanes (a power of two <= 32); every
/// lane of the warp must call it (full-mask shuffles), and every lane gets the result.
template <int kLanes>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
/// The sums over an aligned group of 8 lanes of kN values at once (kN = 2 or 4): lane bits 2
/// (and 1, for kN = 4) pick which sum a lane ends with, group_sum8_scatter_index<kN>(lane) of them.
/// Each exchange halves what a lane carries: 4 shuffles for kN = 4 and 3 for kN = 2, where kN
/// group_sum<8> calls take 12 and 6. Every sum adds the same pairs in the same order as
/// group_sum<8> (lane ^ 4, then ^ 2, then ^ 1), so the results are bit-identical to it.
template <int kN>
__device__ __forceinline__ float group_sum8_scatter(const float (&v)[kN]) {
  static_assert(kN == 2 || kN == 4, "2 or 4 sums");
  const int lane = threadIdx.x % 32;
  const bool hi4 = (lane & 4) != 0;
  float m;
  if constexpr (kN == 4) {
    // lanes without bit 2 keep sums 0 and 1, the others 2 and 3
    float keep[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float send = hi4 ? v[i] : v[i + 2];
      keep[i] = (hi4 ? v[i + 2] : v[i]) + __shfl_xor_sync(0xffffffffu, send, 4);
    }
    const bool hi2 = (lane & 2) != 0;
    const float send = hi2 ? keep[0] : keep[1];
    m = (hi2 ? keep[1] : keep[0]) + __shfl_xor_sync(0xffffffffu, send, 2);
  } else {
    const float send = hi4 ? v[0] : v[1];
    m = (hi4 ? v[1] : v[0]) + __shfl_xor_sync(0xffffffffu, send, 4);
    m += __shfl_xor_sync(0xffffffffu, m, 2);
  }
  return m + __shfl_xor_sync(0xffffffffu, m, 1);
}
/// Which of group_sum8_scatter<kN>'s sums a lane holds.
template <int kN>
__device__ __forceinline__ int group_sum8_scatter_index(int lane) {
  return kN == 4 ? ((lane >> 1) & 3) : ((lane >> 2) & 1);
}
/// Whether a lane is the first of those holding its sum (2 lanes each for kN = 4, 4 for kN =
/// 2): the one lane per sum that stores it.
template <int kN>
__device__ __forceinline__ bool group_sum8_scatter_stores(int lane) {
  return lane % (8 / kN) == 0;
}

template <int kLanes>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace replayssm::cuda
