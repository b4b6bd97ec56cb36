// Gated DeltaNet eager decode (ALGORITHM.md §2) on CUDA: the state is read, updated and
// written back every token. It is the baseline replay is measured against, so it is tuned to
// stream: one CTA per (batch row, key head, row split); q̂ and k̂ are the same for all G·V rows
// of a key head, so each lane holds its 16 columns of both in registers for the whole CTA,
// and a row costs 16-byte loads and stores, two dot products (3 shuffles each) and 32 FMAs.
//
//   s ← α·S_row;  d = β·(v − s·k̂);  s ← s + d·k̂;  o = s·q̂;  S_row ← round(s)
// in the CPU backend's order (o from the unrounded s).

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

/// Rows in flight per thread: 2 (128 bytes of fp32 state, 64 of bf16). Four bf16 rows spill
/// ~200 bytes per thread under the 80-register cap that 3 CTAs per SM need.
template <typename state_t>
constexpr int kEagerRows = 2;

template <typename input_t, typename state_t>
__global__ void __launch_bounds__(kEagerThreads, 3)
    gdn_eager_kernel(const __grid_constant__ EagerParams p) {
  const StateCacheLayout& l = p.cache;
  const GdnInputs& in = p.in;
  const int K = l.dims.cols, V = l.dims.rows, Hk = l.dims.key_heads, Hv = l.dims.heads;
  const int G = p.heads_per_key;
  const int hk = blockIdx.x / p.tiling.splits;
  const int split = blockIdx.x - hk * p.tiling.splits;
  const int b = blockIdx.y;
  const int slot = resolve_slot(l, in.slot_ids, b);
  if (slot < 0) return;
  const int row_begin = split * p.tiling.rows_per_split;
  const int row_end = min(G * V, row_begin + p.tiling.rows_per_split);
  if (row_begin >= row_end) return;

  __shared__ __align__(16) float s_q[kMaxHeadKDim];
  __shared__ __align__(16) float s_k[kMaxHeadKDim];
  const int warp = threadIdx.x / 32, wl = threadIdx.x % 32;
  if (warp < 2) {
    const auto* src = static_cast<const input_t*>(warp == 0 ? in.q : in.k) +
                      (std::int64_t{b} * Hk + hk) * K;
    float x[kWalkPerLane];
    normalise_warp(src, K, in.qk_l2norm, warp == 0 ? in.q_scale : 1.0f, wl, x);
    float* dst = warp == 0 ? s_q : s_k;
#pragma unroll
    for (int i = 0; i < kWalkPerLane; ++i) dst[wl + 32 * i] = x[i];
  }
  if (hk == 0 && split == 0 && threadIdx.x == 0) l.pending[slot] = 1;
  __syncthreads();

  const int lane = threadIdx.x % kRowLanes;
  const int rg = threadIdx.x / kRowLanes;

  const std::int64_t ls = layer_slot(l, p.layer, slot);
  // Rows of the key head's G value heads are contiguous: row r is head hk·G + r / V.
  state_t* S = static_cast<state_t*>(l.state) +
               (ls * Hv + std::int64_t{hk} * G) * V * K;
  const std::int64_t bh0 = std::int64_t{b} * Hv + hk * G;
  const auto* v_in = static_cast<const input_t*>(in.v) + bh0 * V;
  auto* o = static_cast<input_t*>(in.o) + bh0 * V;

  constexpr int kRows = kEagerRows<state_t>;
  using Frag = typename Split::template Fragment<state_t>;
  // Block-uniform loop bound: the row reductions shuffle over full warps (see gdn_replay.cu).
  for (int base = row_begin; base < row_end; base += kEagerRowGroups * kRows) {
    const int r0 = base + rg;
    Frag f[kRows];
    float x[kRows], alpha[kRows], beta[kRows];
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int r = min(r0 + u * kEagerRowGroups, row_end - 1);
      if (r0 + u * kEagerRowGroups < row_end) {
        load_cols<CacheOp::kStreaming>(f[u], S + std::int64_t{r} * K, lane, K);
      } else {
        f[u] = {};
      }
      const int h = r / V;
      x[u] = to_float(v_in[r]);
      alpha[u] = expf(in.g[bh0 + h]);
      beta[u] = in.beta[bh0 + h];
    }
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int r = r0 + u * kEagerRowGroups;
      float s[kPerLane], k[kPerLane];
      unpack_frag(f[u], s);
      // q̂, k̂ re-read from shared memory per row (16-byte broadcasts): holding them in
      // registers for the whole CTA cost 32 registers, i.e. 2 instead of 3 CTAs per SM.
      gather_smem<state_t>(s_k, lane, k);
      float sk = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        s[i] *= alpha[u];
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
}

}  // namespace

Status launch_eager(StateCacheLayout& l, const GdnDecodeArgs& args) {
  EagerParams p;
  p.cache = l;
  p.in = input_args(args, l.dims.cols);
  p.layer = args.layer;
  p.heads_per_key = l.dims.heads / l.dims.key_heads;
  const int group_rows = p.heads_per_key * l.dims.rows;
  p.tiling = row_tiling(args.batch, l.dims.key_heads, group_rows, kEagerRowGroups * 2);
  const dim3 grid(l.dims.key_heads * p.tiling.splits, args.batch);
  return ActivationDTypes::dispatch(l.config.input_dtype, "input dtype", [&](auto in) {
    using input_t = dtype_t<in.value>;
    return EagerStateDTypes::dispatch(l.config.state_dtype, "eager state dtype", [&](auto st) {
      using state_t = dtype_t<st.value>;
      gdn_eager_kernel<input_t, state_t><<<grid, kEagerThreads, 0, launch_stream()>>>(p);
      REPLAYSSM_CUDA_CHECK_LAUNCH("gdn_eager_kernel");
      return Status::ok();
    });
  });
}

}  // namespace replayssm::cuda::gdn
