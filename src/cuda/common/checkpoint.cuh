#pragma once
// The replay checkpoint's copies (ALGORITHM.md §6), per state row, for both layer kinds.
//
//   precision   master (folds read/write)   read copy (outputs read)
//   fp32        hi fp32                     hi fp32
//   bf16        lo bf16 (shared)            lo bf16
//   fp32+bf16   hi fp32                     lo bf16
//   fp32+fp8    hi fp32                     lo e4m3 · scale[row],  scale = max|row| / 448
//
// Mirrors common/checkpoint_rows.h (write_row) element for element, with the row split over a
// lane group (vec.cuh's RowSplit): a fold computes its new fp32 row, `checkpoint_store` writes
// every copy and hands back the values the read copy now holds, so an output fused after a
// fold reads exactly what later steps will read. CheckpointHead gives each copy's rows
// (read_row: what outputs stream; master_row: what folds stream).

#include <cstdint>

#include "common/checkpoint_traits.h"
#include "common/numeric.h"
#include "cuda/common/cache.cuh"
#include "cuda/common/dispatch.cuh"
#include "cuda/common/vec.cuh"
#include "replayssm/types.h"
#include "state_cache_layout.h"

namespace replayssm::cuda {

/// The C++ types of precision P's copies, for templated kernels; the facts come from the
/// host+device table (common/checkpoint_traits.h).
template <CheckpointPrecision P>
struct CheckpointTypes {
  static constexpr CheckpointTraits kTraits = checkpoint_traits(P);
  static constexpr bool kHasHi = kTraits.has_hi;
  static constexpr bool kHasLo = kTraits.has_lo;
  static constexpr bool kScaled = kTraits.lo_row_scale;
  /// Whether the master and the read copy are one buffer (fp32, bf16): a step can then start
  /// streaming it before it knows whether a fold is due.
  static constexpr bool kReadIsMaster = kTraits.shared_copy();
  using lo_t = dtype_t<kTraits.lo_dtype>;
  using read_t = std::conditional_t<kHasLo, lo_t, float>;
  using master_t = std::conditional_t<kHasHi, float, lo_t>;
};

/// One (layer, slot, head) block [rows, cols] in each checkpoint copy; null where absent.
template <CheckpointPrecision P>
struct CheckpointHead {
  using Traits = CheckpointTypes<P>;
  using lo_t = typename Traits::lo_t;
  float* hi = nullptr;
  lo_t* lo = nullptr;
  float* scale = nullptr;  // [rows], fp8 only
  int cols = 0;

  __device__ __forceinline__ CheckpointHead(const StateCacheLayout& l, int layer, int slot,
                                            int head) {
    const std::int64_t ls = l.checkpoint_region(layer, slot);  // own rows, or a fork source's
    const std::int64_t block = ls * l.dims.heads * l.dims.rows * l.dims.cols +
                               std::int64_t{head} * l.dims.rows * l.dims.cols;
    cols = l.dims.cols;
    if constexpr (Traits::kHasHi) hi = l.ckpt_hi + block;
    if constexpr (Traits::kHasLo) lo = static_cast<lo_t*>(l.ckpt_lo) + block;
    if constexpr (Traits::kScaled) {
      scale = l.ckpt_lo_scale + ls * l.dims.heads * l.dims.rows +
              std::int64_t{head} * l.dims.rows;
    }
  }

  __device__ __forceinline__ typename Traits::read_t* read_row(int r) const {
    if constexpr (Traits::kHasLo) {
      return lo + std::int64_t{r} * cols;
    } else {
      return hi + std::int64_t{r} * cols;
    }
  }
  __device__ __forceinline__ typename Traits::master_t* master_row(int r) const {
    if constexpr (Traits::kHasHi) {
      return hi + std::int64_t{r} * cols;
    } else {
      return lo + std::int64_t{r} * cols;
    }
  }
};

/// Stores a folded fp32 row (this lane's values v, in order_t's layout) into every copy, as
/// write_row (common/checkpoint_rows.h): the master as is, the low copy rounded (fp8 with a fresh per-row scale
/// max|row| / 448, 1 for an all-zero row). Then v holds what the read copy holds now.
/// Every lane of the warp must call it (the fp8 row max is a group shuffle); lanes with
/// `active` false (rows past the head) store nothing. The family's kernels supply how a
/// fragment is stored into a row, store_row(fragment, row pointer), and read back,
/// unpack(fragment, v) (GDN masks columns past K and widens fp8 with the hardware converter).
template <CheckpointPrecision P, typename Split, typename order_t, typename StoreRow,
          typename Unpack>
__device__ __forceinline__ void checkpoint_store_with(const CheckpointHead<P>& c, int row,
                                                      bool active,
                                                      float (&v)[Split::kPerLane],
                                                      int lane, StoreRow store_row,
                                                      Unpack unpack) {
  using Traits = CheckpointTypes<P>;
  using lo_t = typename Traits::lo_t;
  constexpr int kN = Split::kPerLane;
  if constexpr (Traits::kHasHi) {
    typename Split::template Fragment<float, order_t> hi;
    hi.pack(v);
    if (active) store_row(hi, c.hi + std::int64_t{row} * c.cols);
  }
  if constexpr (Traits::kHasLo) {
    float scale = 1.0f, inv = 1.0f;
    if constexpr (Traits::kScaled) {
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < kN; ++i) amax = fmaxf(amax, fabsf(v[i]));  // zero past the row
      amax = group_max<Split::kRowLanes>(amax);
      scale = amax > 0.0f ? amax / kFp8Max : 1.0f;
      inv = 1.0f / scale;
      if (active && lane == 0) c.scale[row] = scale;
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = __fmul_rn(v[i], inv);
    }
    typename Split::template Fragment<lo_t, order_t> lo;
    lo.pack(v);
    if (active) store_row(lo, c.lo + std::int64_t{row} * c.cols);
    unpack(lo, v);
    if constexpr (Traits::kScaled) {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = __fmul_rn(v[i], scale);
    }
  }
}

/// checkpoint_store_with for whole rows of Split's width.
template <CheckpointPrecision P, typename Split, typename order_t>
__device__ __forceinline__ void checkpoint_store(const CheckpointHead<P>& c, int row, int lane,
                                                 bool active, float (&v)[Split::kPerLane]) {
  checkpoint_store_with<P, Split, order_t>(
      c, row, active, v, lane,
      [lane](const auto& f, auto* dst) { f.template store<CacheOp::kStreaming>(dst, lane); },
      [](const auto& f, float (&out)[Split::kPerLane]) { f.unpack(out); });
}

}  // namespace replayssm::cuda
