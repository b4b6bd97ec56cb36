#pragma once
// Device helpers of the GDN kernels that the shared ones (cuda/common/vec.cuh, checkpoint.cuh)
// do not have yet. Each is a candidate for cuda/common (see the notes); nothing here is
// GDN-specific except the normalisation.
//
// - Column masking: common's RowSplit fragments always move kCols columns. GDN's head_k_dim
//   is a runtime value (multiple of 16, up to the 128-column tile), so loads, stores and the
//   checkpoint store here take the row's real width and skip whole vectors past it.
//   MERGE NOTE: a `cols` bound on RowSplit::Fragment::load/store and checkpoint_store would
//   make these wrappers unnecessary.
// - fp8 unpack through the hardware converter (cvt.rn.f16x2.e4m3x2, exact: every e4m3 value is
//   an f16 value). numeric.h's to_float(fp8e4m3_t) is the reference definition but costs ~10
//   integer ops per element, which at 16 elements per 16-byte load makes the fp8 read path
//   issue-bound instead of memory-bound. MERGE NOTE: worth using in Packed<fp8e4m3_t>::unpack.

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/numeric.h"
#include "cuda/common/checkpoint.cuh"
#include "cuda/common/vec.cuh"
#include "cuda/gdn/gdn_params.cuh"

namespace replayssm::cuda::gdn {

/// First column of this lane's k-th vector in order_t's layout (RowSplit::col of element 0).
template <typename order_t>
__device__ __forceinline__ int vec_col(int lane, int k) {
  constexpr int v = Split::kVec<order_t>;
  return (k * kRowLanes + lane) * v;
}

/// Fragment::load restricted to the columns [0, cols); vectors past cols read as zero.
template <CacheOp op, typename Frag, typename T>
__device__ __forceinline__ void load_cols(Frag& f, const T* row, int lane, int cols) {
  constexpr int n = Frag::kVecN;
#pragma unroll
  for (int k = 0; k < kPerLane / n; ++k) {
    const int c = (k * kRowLanes + lane) * n;
    if (c < cols) {
      f.chunk[k].template load<op>(row + c);
    } else {
      f.chunk[k] = {};
    }
  }
}

/// Fragment::store restricted to the columns [0, cols).
template <CacheOp op, typename Frag, typename T>
__device__ __forceinline__ void store_cols(const Frag& f, T* row, int lane, int cols) {
  constexpr int n = Frag::kVecN;
#pragma unroll
  for (int k = 0; k < kPerLane / n; ++k) {
    const int c = (k * kRowLanes + lane) * n;
    if (c < cols) f.chunk[k].template store<op>(row + c);
  }
}

/// Packed::unpack, with fp8 through the hardware converter (exact, see the file comment).
template <typename T, int kN>
__device__ __forceinline__ void unpack_fast(const Packed<T, kN>& p, float (&out)[kN]) {
  if constexpr (std::is_same_v<T, fp8e4m3_t> && kN % 4 == 0) {
    const auto* words = reinterpret_cast<const std::uint32_t*>(p.w);
#pragma unroll
    for (int i = 0; i < kN / 4; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>(words[i] >> (16 * half)), __NV_E4M3);
        const float2 f = __half22float2(__half2(h));
        out[4 * i + 2 * half] = f.x;
        out[4 * i + 2 * half + 1] = f.y;
      }
    }
  } else {
    p.unpack(out);
  }
}

/// Fragment::unpack through unpack_fast.
template <typename Frag>
__device__ __forceinline__ void unpack_frag(const Frag& f, float (&out)[kPerLane]) {
  constexpr int n = Frag::kVecN;
#pragma unroll
  for (int k = 0; k < kPerLane / n; ++k) {
    float v[n];
    unpack_fast(f.chunk[k], v);
#pragma unroll
    for (int e = 0; e < n; ++e) out[k * n + e] = v[e];
  }
}

/// This lane's values (order_t layout) of an fp32 row in shared memory of kMaxHeadKDim
/// columns, zero past the real width; 16-byte loads (each lane vector is 16-byte aligned).
template <typename order_t>
__device__ __forceinline__ void gather_smem(const float* row, int lane, float (&out)[kPerLane]) {
  constexpr int v = Split::kVec<order_t>;
#pragma unroll
  for (int k = 0; k < kPerLane / v; ++k) {
    const float4* p = reinterpret_cast<const float4*>(row + vec_col<order_t>(lane, k));
#pragma unroll
    for (int e = 0; e < v / 4; ++e) {
      const float4 x = p[e];
      out[k * v + 4 * e] = x.x;
      out[k * v + 4 * e + 1] = x.y;
      out[k * v + 4 * e + 2] = x.z;
      out[k * v + 4 * e + 3] = x.w;
    }
  }
}

/// This lane's values (order_t layout) of a raw ring key staged in shared memory (input dtype,
/// `cols` columns, 16-byte aligned rows), as fp32, zero past cols. One vector load per lane
/// vector: a fold gathers a key per history token, and element-wise 2-byte loads made that
/// gather cost as much as the row update it feeds.
template <typename order_t, typename input_t>
__device__ __forceinline__ void gather_key(const input_t* key, int lane, int cols,
                                           float (&out)[kPerLane]) {
  constexpr int v = Split::kVec<order_t>;
#pragma unroll
  for (int k = 0; k < kPerLane / v; ++k) {
    const int c = vec_col<order_t>(lane, k);
    Packed<input_t, v> x;
    if (c < cols) {
      x.load(key + c);
    } else {
      x = {};
    }
    float f[v];
    x.unpack(f);
#pragma unroll
    for (int e = 0; e < v; ++e) out[k * v + e] = f[e];
  }
}

/// checkpoint_store (checkpoint.cuh) restricted to the columns [0, cols): writes a folded fp32
/// row into every copy of the checkpoint as write_row (common/checkpoint_rows.h) does, and leaves in v the values
/// the read copy now holds. Every lane of the warp must call it (fp8's row max shuffles).
template <CheckpointPrecision P, typename order_t>
__device__ __forceinline__ void checkpoint_store_cols(const CheckpointHead<P>& c, int row,
                                                      int lane, bool active, int cols,
                                                      float (&v)[kPerLane]) {
  checkpoint_store_with<P, Split, order_t>(
      c, row, active, v, lane,
      [lane, cols](const auto& f, auto* dst) {
        store_cols<CacheOp::kStreaming>(f, dst, lane, cols);
      },
      [](const auto& f, float (&out)[kPerLane]) { unpack_frag(f, out); });
}

/// 16-byte global → shared copy that bypasses registers and L1 (cp.async.cg, sm_80+), so a
/// block stages all its ring records with every load in flight at once.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
  const auto dst = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src));
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

/// One warp: the raw values of u as fp32 (lane holding columns lane + 32·i, zero past cols),
/// and the factor 1 / sqrt(|u|² + 1e-6) that L2-normalises u, as the CPU's l2norm_factor
/// computes it (IEEE sqrt and divide, no fast math); only the order of the sum of squares
/// differs. Every lane gets the factor.
template <typename input_t>
__device__ __forceinline__ float load_l2norm_factor_warp(const input_t* u, int cols, int lane,
                                                         float (&out)[kWalkPerLane]) {
  float sq = 0.0f;
#pragma unroll
  for (int i = 0; i < kWalkPerLane; ++i) {
    const int c = lane + 32 * i;
    out[i] = c < cols ? to_float(u[c]) : 0.0f;
    sq += out[i] * out[i];
  }
  sq = group_sum<32>(sq);
  return 1.0f / sqrtf(sq + 1e-6f);
}

/// One warp: u · (l2norm_factor(u) when l2norm) · scale, the CPU's normalise with the same
/// rounding of the factor (scale · (1 / sqrt(...))), lane holding columns lane + 32·i; zero
/// past cols.
template <typename input_t>
__device__ __forceinline__ void normalise_warp(const input_t* u, int cols, bool l2norm,
                                               float scale, int lane,
                                               float (&out)[kWalkPerLane]) {
  const float factor = load_l2norm_factor_warp(u, cols, lane, out);
  const float f = l2norm ? scale * factor : scale;
#pragma unroll
  for (int i = 0; i < kWalkPerLane; ++i) out[i] *= f;
}

}  // namespace replayssm::cuda::gdn
