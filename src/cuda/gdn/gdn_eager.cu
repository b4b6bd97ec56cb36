// Gated DeltaNet eager decode (ALGORITHM.md §2) on CUDA: the state is read, updated and
// written back every token (and, gdn_eager_window_kernel, a speculative window with a state
// copy per draft). It is the baseline replay is measured against, so it is tuned to
// stream, as the Mamba-2 eager kernel does: one small CTA per (batch row, key head, slice of
// kEagerRows·kEagerThreads/8 rows), which requests its whole slice of the state as soon as it
// knows the slot, before the slot's allocation flag, q̂ and k̂ (two warps, one each) arrive;
// then per row 16-byte loads and stores, two dot products (3 shuffles each) and 32 FMAs.
//
//   s ← α·S_row;  d = β·(v − s·k̂);  s ← s + d·k̂;  o = s·q̂;  S_row ← round(s)
// in the CPU backend's order (o from the unrounded s).
//
// Tile, measured on the H200 (qwen35-4b, batch 256, fp32 state, µs per step; copy 4200 GB/s):
//   256 threads × 2 rows, 3 CTAs/SM, 4 passes per CTA, state after the prologue   288.3 (89%)
//   256 × 2, one pass per CTA (64 rows), state requested first                     278.6
//   128 × 4 (4/SM) 282.3;  256 × 4 (2/SM) 281.1;  128 × 2 (6/SM) 279.8;  64 × 4 (8/SM) 275.8
//   32 × 4, 16 CTAs/SM                                                             272.9
//   64 × 2, 12 CTAs/SM, 16 rows per CTA (this)                                 272.9-273.6 (94%)
// Smaller CTAs win: a CTA's prologue (slot → flag, q̂, k̂) and its tail are shorter, and more of
// them overlap on an SM. vLLM's packed Triton kernel: 274 µs on the same shape.

#include <cuda_runtime.h>

#include "backend.h"
#include "cuda/common/cache.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/dispatch.cuh"
#include "cuda/gdn/gdn_device.cuh"
#include "cuda/gdn/gdn_launch.h"
#include "cuda/gdn/gdn_params.cuh"

namespace replayssm::cuda::gdn {

namespace {

/// One CTA = kEagerThreads threads over kEagerGranule rows of a key head (its split), each
/// thread holding kEagerRows of them: the whole slice is one pass, requested up front.
constexpr int kEagerRowGroups = kEagerThreads / kRowLanes;
constexpr int kEagerGranule = kEagerRowGroups * kEagerRows;

template <typename input_t, typename state_t>
__global__ void __launch_bounds__(kEagerThreads, kEagerMinBlocks)
    gdn_eager_kernel(const __grid_constant__ EagerParams p) {
  const StateCacheLayout& l = p.cache;
  const GdnInputs& in = p.in;
  const int K = l.dims.cols, V = l.dims.rows, Hk = l.dims.key_heads, Hv = l.dims.heads;
  const int G = p.heads_per_key;
  const int hk = blockIdx.x / p.tiling.splits;
  const int split = blockIdx.x - hk * p.tiling.splits;
  const int b = blockIdx.y;
  const int slot = slot_in_range(l, in.slot_ids, b);
  if (slot < 0) return;
  const int row_begin = split * p.tiling.rows_per_split;
  const int row_end = min(G * V, row_begin + p.tiling.rows_per_split);
  if (row_begin >= row_end) return;

  const int lane = threadIdx.x % kRowLanes;
  const int rg = threadIdx.x / kRowLanes;
  const std::int64_t ls = l.layer_slot(p.layer, slot);
  // Rows of the key head's G value heads are contiguous: row r is head hk·G + r / V.
  state_t* S = static_cast<state_t*>(l.state) +
               (ls * Hv + std::int64_t{hk} * G) * V * K;
  const std::int64_t bh0 = std::int64_t{b} * Hv + hk * G;
  const auto* v_in = static_cast<const input_t*>(in.v) + bh0 * V;
  auto* o = static_cast<input_t*>(in.o) + bh0 * V;

  // The slice first: the allocation flag, q̂ and k̂ arrive while it is in flight (reading a
  // free slot's rows is harmless: they are never written).
  using Frag = typename Split::template Fragment<state_t>;
  Frag f[kEagerRows];
  float x[kEagerRows], g[kEagerRows], beta[kEagerRows];
#pragma unroll
  for (int u = 0; u < kEagerRows; ++u) {
    const int r = min(row_begin + rg + u * kEagerRowGroups, row_end - 1);
    if (row_begin + rg + u * kEagerRowGroups < row_end) {
      load_cols<CacheOp::kStreaming>(f[u], S + std::int64_t{r} * K, lane, K);
    } else {
      f[u] = {};
    }
    const int h = r / V;
    x[u] = to_float(v_in[r]);
    g[u] = in.g[bh0 + h];
    beta[u] = in.beta[bh0 + h];
  }

  __shared__ __align__(16) float s_q[kMaxHeadKDim];
  __shared__ __align__(16) float s_k[kMaxHeadKDim];
  const bool allocated = slot_allocated(l, slot);
  const int warp = threadIdx.x / 32, wl = threadIdx.x % 32;
  for (int job = warp; job < 2; job += kEagerThreads / 32) {  // q̂ and k̂, one warp each
    const auto* src = static_cast<const input_t*>(job == 0 ? in.q : in.k) +
                      (std::int64_t{b} * Hk + hk) * K;
    float xq[kWalkPerLane];
    normalise_warp(src, K, in.qk_l2norm, job == 0 ? in.q_scale : 1.0f, wl, xq);
    float* dst = job == 0 ? s_q : s_k;
#pragma unroll
    for (int i = 0; i < kWalkPerLane; ++i) dst[wl + 32 * i] = xq[i];
  }
  if (!allocated) return;  // a free slot: nothing written
  if (hk == 0 && split == 0 && threadIdx.x == 0) l.pending[l.layer_slot(p.layer, slot)] = 1;
  __syncthreads();

  // Every lane runs every row slot (on zeros past the end): the row reductions shuffle over
  // full warps.
#pragma unroll
  for (int u = 0; u < kEagerRows; ++u) {
    const int r = row_begin + rg + u * kEagerRowGroups;
    float s[kPerLane], k[kPerLane];
    unpack_frag(f[u], s);
    const float alpha = expf(g[u]);
    // q̂, k̂ re-read from shared memory per row (16-byte broadcasts): holding them in
    // registers for the whole CTA would cost 32 registers, and CTAs per SM.
    gather_smem<state_t>(s_k, lane, k);
    float sk = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      s[i] *= alpha;
      sk += s[i] * k[i];
    }
    sk = group_sum<kRowLanes>(sk);
    const float d = beta[u] * (x[u] - sk);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) s[i] += d * k[i];
    float q[kPerLane];
    gather_smem<state_t>(s_q, lane, q);
    float out = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) out += s[i] * q[i];
    out = group_sum<kRowLanes>(out);
    if (r < row_end) {
      f[u].pack(s);
      store_cols<CacheOp::kStreaming>(f[u], S + std::int64_t{r} * K, lane, K);
      if (lane == 0) o[r] = from_float<input_t>(out);
    }
  }
}

// The eager decode of a speculative window on a cache with a state copy per draft
// (max_spec_tokens > 1; per-draft-state speculation): the state is read once, from the slot's
// current copy, kept in registers across the window's T tokens, and the state after token t is
// written into copy after_tokens(current, t); state_cache_commit(k) then selects one. T + 1
// state transfers per step instead of the 2·T of T single-token decodes. Same tile as
// gdn_eager_kernel (the slice requested before the allocation flag and the window's q̂, k̂
// arrive), and per token the same arithmetic:
//   s ← α_t·s;  d = β_t·(v_t − s·k̂_t);  s ← s + d·k̂_t;  o_t = s·q̂_t;  copy_t ← round(s)
// with s carried in fp32 from token to token.
// The window kernel carries its rows in fp32 across the tokens (kEagerRows·16 registers beyond
// what the eager kernel keeps): under the eager tile's 12 CTAs per SM (80 registers) ptxas
// spilled 32-84 bytes per thread, at 10 or 9 per SM (96) 4-8 bytes; at 8 per SM it takes
// 117-123 registers and spills nothing (ptxas -v, sm_90; not yet timed on the GPU).
constexpr int kEagerWindowMinBlocks = 8;

template <typename input_t, typename state_t>
__global__ void __launch_bounds__(kEagerThreads, kEagerWindowMinBlocks)
    gdn_eager_window_kernel(const __grid_constant__ EagerParams p) {
  const StateCacheLayout& l = p.cache;
  const GdnInputs& in = p.in;
  const int K = l.dims.cols, V = l.dims.rows, Hk = l.dims.key_heads, Hv = l.dims.heads;
  const int G = p.heads_per_key;
  const int T = p.num_tokens;
  const int hk = blockIdx.x / p.tiling.splits;
  const int split = blockIdx.x - hk * p.tiling.splits;
  const int b = blockIdx.y;
  const int slot = slot_in_range(l, in.slot_ids, b);
  if (slot < 0) return;
  const int row_begin = split * p.tiling.rows_per_split;
  const int row_end = min(G * V, row_begin + p.tiling.rows_per_split);
  if (row_begin >= row_end) return;

  const int lane = threadIdx.x % kRowLanes;
  const int rg = threadIdx.x / kRowLanes;
  const int current = l.current_copy(slot);
  // Rows of the key head's G value heads are contiguous: row r is head hk·G + r / V.
  state_t* key_head = static_cast<state_t*>(l.state) + std::int64_t{hk} * G * V * K;
  const state_t* S = key_head + l.state_offset(p.layer, slot, current);

  // The slice first: the allocation flag and the window's q̂, k̂ arrive while it is in flight.
  using Frag = typename Split::template Fragment<state_t>;
  Frag f[kEagerRows];
#pragma unroll
  for (int u = 0; u < kEagerRows; ++u) {
    const int r = row_begin + rg + u * kEagerRowGroups;
    if (r < row_end) {
      load_cols<CacheOp::kStreaming>(f[u], S + std::int64_t{r} * K, lane, K);
    } else {
      f[u] = {};
    }
  }

  __shared__ __align__(16) float s_q[kMaxEagerWindow][kMaxHeadKDim];
  __shared__ __align__(16) float s_k[kMaxEagerWindow][kMaxHeadKDim];
  const bool allocated = slot_allocated(l, slot);
  const int warp = threadIdx.x / 32, wl = threadIdx.x % 32;
  for (int job = warp; job < 2 * T; job += kEagerThreads / 32) {  // q̂_t and k̂_t, a warp each
    const int t = job / 2;
    const bool query = job % 2 == 0;
    const auto* src = static_cast<const input_t*>(query ? in.q : in.k) +
                      ((std::int64_t{b} * T + t) * Hk + hk) * K;
    float xq[kWalkPerLane];
    normalise_warp(src, K, in.qk_l2norm, query ? in.q_scale : 1.0f, wl, xq);
    float* dst = query ? s_q[t] : s_k[t];
#pragma unroll
    for (int i = 0; i < kWalkPerLane; ++i) dst[wl + 32 * i] = xq[i];
  }
  if (!allocated) return;  // a free slot: nothing written
  if (hk == 0 && split == 0 && threadIdx.x == 0) {
    l.pending[l.layer_slot(p.layer, slot)] = static_cast<std::uint8_t>(T);
  }
  __syncthreads();

  float s[kEagerRows][kPerLane];
#pragma unroll
  for (int u = 0; u < kEagerRows; ++u) unpack_frag(f[u], s[u]);
  for (int t = 0; t < T; ++t) {
    const std::int64_t bh0 = (std::int64_t{b} * T + t) * Hv + hk * G;
    const auto* v_in = static_cast<const input_t*>(in.v) + bh0 * V;
    auto* o = static_cast<input_t*>(in.o) + bh0 * V;
    state_t* out = key_head + l.state_offset(p.layer, slot, l.after_tokens(current, t + 1));
    // Every lane runs every row slot (on zeros past the end): the row reductions shuffle over
    // full warps.
#pragma unroll
    for (int u = 0; u < kEagerRows; ++u) {
      const int r = row_begin + rg + u * kEagerRowGroups;
      const int rc = min(r, row_end - 1);  // a valid row to read inputs for
      const int h = rc / V;
      const float alpha = expf(in.g[bh0 + h]);
      const float beta = in.beta[bh0 + h];
      const float x = to_float(v_in[rc]);
      float k[kPerLane];
      gather_smem<state_t>(s_k[t], lane, k);
      float sk = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        s[u][i] *= alpha;
        sk += s[u][i] * k[i];
      }
      sk = group_sum<kRowLanes>(sk);
      const float d = beta * (x - sk);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) s[u][i] += d * k[i];
      float q[kPerLane];
      gather_smem<state_t>(s_q[t], lane, q);
      float acc = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc += s[u][i] * q[i];
      acc = group_sum<kRowLanes>(acc);
      if (r < row_end) {
        f[u].pack(s[u]);
        store_cols<CacheOp::kStreaming>(f[u], out + std::int64_t{r} * K, lane, K);
        if (lane == 0) o[r] = from_float<input_t>(acc);
      }
    }
  }
}

}  // namespace

Status launch_eager(StateCacheLayout& l, const GdnDecodeArgs& args, cudaStream_t stream) {
  EagerParams p;
  p.cache = l;
  p.in = input_args(args, l.dims.cols);
  p.layer = args.layer;
  p.num_tokens = args.num_tokens;
  p.heads_per_key = l.dims.heads / l.dims.key_heads;
  const int group_rows = p.heads_per_key * l.dims.rows;
  p.tiling.rows_per_split = kEagerGranule;
  p.tiling.splits = (group_rows + kEagerGranule - 1) / kEagerGranule;
  const dim3 grid(l.dims.key_heads * p.tiling.splits, args.batch);
  return ActivationDTypes::dispatch(l.config.input_dtype, "input dtype", [&](auto in) {
    using input_t = dtype_t<in.value>;
    return EagerStateDTypes::dispatch(l.config.state_dtype, "eager state dtype", [&](auto st) {
      using state_t = dtype_t<st.value>;
      if (l.state_copies() > 1) {
        gdn_eager_window_kernel<input_t, state_t><<<grid, kEagerThreads, 0, stream>>>(p);
      } else {
        gdn_eager_kernel<input_t, state_t><<<grid, kEagerThreads, 0, stream>>>(p);
      }
      REPLAYSSM_CUDA_CHECK_LAUNCH("gdn eager kernel");
      return Status::ok();
    });
  });
}

}  // namespace replayssm::cuda::gdn
