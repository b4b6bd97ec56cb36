// Gated DeltaNet eager decode of a speculative window (per-draft-state speculation): the state
// is read once, from the slot's current copy, kept in registers across the window's T tokens,
// and the state after token t is written into copy after_tokens(current, t);
// state_cache_commit(k) then selects one. T + 1 state transfers per step instead of the 2·T of
// T single-token decodes. The tile is the eager kernel's (gdn_eager.cu: one 64-thread CTA per
// (batch row, key head, slice of 16 rows), 2 rows per thread, the slice requested before the
// allocation flag and the normalised keys arrive), and per token the arithmetic is the eager
// kernel's and the CPU backend's:
//   s ← α_t·s;  d = β_t·(v_t − s·k̂_t);  s ← s + d·k̂_t;  o_t = s·q̂_t;  copy_t ← round(s)
// with s carried in fp32 from token to token.

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

template <typename input_t, typename state_t>
__global__ void __launch_bounds__(kEagerThreads, kEagerMinBlocks)
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

Status launch_eager_window(StateCacheLayout& l, const GdnDecodeArgs& args, cudaStream_t stream) {
  const EagerParams p = eager_params(l, args);
  const dim3 grid = eager_grid(p, args.batch);
  return ActivationDTypes::dispatch(l.config.input_dtype, "input dtype", [&](auto in) {
    using input_t = dtype_t<in.value>;
    return EagerStateDTypes::dispatch(l.config.state_dtype, "eager state dtype", [&](auto st) {
      using state_t = dtype_t<st.value>;
      gdn_eager_window_kernel<input_t, state_t><<<grid, kEagerThreads, 0, stream>>>(p);
      REPLAYSSM_CUDA_CHECK_LAUNCH("gdn_eager_window_kernel");
      return Status::ok();
    });
  });
}

}  // namespace replayssm::cuda::gdn
