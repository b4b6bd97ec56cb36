// Mamba-2 eager decode (ALGORITHM.md §1), the baseline replay is measured against, one token
// in place and (eager_window_kernel) a speculative window with a state copy per draft:
//   Δ = softplus(dt + dt_bias), S ← exp(A·Δ)·S + Δ·x·Bᵀ, y = S·C + D·x, y ← y·silu(z),
// reading and writing the whole state every token. Same tiling as the replay kernel
// (params.cuh): one block per (head, row), 8 lanes per state row, 4 rows per thread, the
// state streamed with 16-byte evict-first accesses. Arithmetic as src/cpu/mamba2_decode.cpp
// (the output is taken from the fp32 update, before it is rounded to the state dtype).

#include <cuda_runtime.h>

#include <cstdint>

#include "common/numeric.h"
#include "cuda/common/cache.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/dispatch.cuh"
#include "cuda/common/vec.cuh"
#include "cuda/mamba2/mamba2_launch.h"

namespace replayssm::cuda::mamba2 {

namespace {

using Split = RowSplit<kDstate, kLanesPerRow>;
constexpr int kPerLane = Split::kPerLane;

template <typename input_t, typename state_t>
__global__ void __launch_bounds__(kMaxThreads)
    eager_kernel(const __grid_constant__ Params params) {
  __shared__ float dots[kMaxHeadDim];
  const StateCacheLayout& l = params.cache;
  const int h = blockIdx.x, b = blockIdx.y;
  const int H = l.dims.heads, P = l.dims.rows, G = l.dims.key_heads;
  const int g = h / (H / G);
  const int lane = threadIdx.x % kLanesPerRow;
  const int row0 = threadIdx.x / kLanesPerRow;
  const int rows_per_pass = blockDim.x / kLanesPerRow;

  const int slot = slot_in_range(l, params.slot_ids, b);
  if (slot < 0) return;
  state_t* S = static_cast<state_t*>(l.state) +
               (l.layer_slot(params.layer, slot) * H + h) * std::int64_t{P} * kDstate;

  // Stream the state in first; the slot's allocation flag and the inputs arrive meanwhile.
  typename Split::template Fragment<state_t> st[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int row = row0 + i * rows_per_pass;
    if (row < P) st[i].template load<CacheOp::kStreaming>(S + std::int64_t{row} * kDstate, lane);
  }
  if (!slot_allocated(l, slot)) return;

  // B and C of this lane's columns (in the state's column order), x of its rows.
  typename Split::template Fragment<input_t, state_t> b_in, c_in;
  const std::int64_t bc_off = (std::int64_t{b} * G + g) * kDstate;
  b_in.load(static_cast<const input_t*>(params.B) + bc_off, lane);
  c_in.load(static_cast<const input_t*>(params.C) + bc_off, lane);
  const auto* x = static_cast<const input_t*>(params.x) + (std::int64_t{b} * H + h) * P;
  float xv[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int row = row0 + i * rows_per_pass;
    xv[i] = row < P ? to_float(x[row]) : 0.0f;
  }
  const float delta = softplus(params.dt[std::int64_t{b} * H + h] + params.dt_bias[h]);
  const float decay = expf(params.A[h] * delta);
  float Bv[kPerLane], Cv[kPerLane];
  b_in.unpack(Bv);
  c_in.unpack(Cv);

#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int row = row0 + i * rows_per_pass;
    float s[kPerLane];
    st[i].unpack(s);
    const float xdt = xv[i] * delta;
    float dot = 0.0f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      s[e] = decay * s[e] + xdt * Bv[e];
      dot += s[e] * Cv[e];
    }
    st[i].pack(s);
    if (row < P) st[i].template store<CacheOp::kStreaming>(S + std::int64_t{row} * kDstate, lane);
    dot = group_sum<kLanesPerRow>(dot);
    if (row < P && lane == 0) dots[row] = dot;
  }
  __syncthreads();
  const float D = params.D[h];
  const auto* z = static_cast<const input_t*>(params.z);
  auto* y = static_cast<input_t*>(params.y);
  for (int r = threadIdx.x; r < P; r += blockDim.x) {
    const std::int64_t off = (std::int64_t{b} * H + h) * P + r;
    float out = dots[r] + D * to_float(x[r]);
    if (z != nullptr) out *= silu(to_float(z[off]));
    y[off] = from_float<input_t>(out);
  }
  if (h == 0 && threadIdx.x == 0) l.pending[l.layer_slot(params.layer, slot)] = 1;
}

// The eager decode of a speculative window on a cache with a state copy per draft
// (max_spec_tokens > 1; per-draft-state speculation, as engines verify drafts on eager state):
// the state is read once, from the slot's current copy, kept in registers across the window's
// T tokens, and the state after token t is written into copy after_tokens(current, t);
// state_cache_commit(k) then selects one. T + 1 state transfers per step instead of the 2·T of
// T single-token decodes. Same tile as eager_kernel; per token the same arithmetic (y_t from
// the fp32 state, each stored copy rounded to the state dtype, the fp32 state carried on).
template <typename input_t, typename state_t>
__global__ void __launch_bounds__(kMaxThreads)
    eager_window_kernel(const __grid_constant__ Params params) {
  __shared__ float dots[kMaxWindow][kMaxHeadDim];
  const StateCacheLayout& l = params.cache;
  const int h = blockIdx.x, b = blockIdx.y;
  const int H = l.dims.heads, P = l.dims.rows, G = l.dims.key_heads;
  const int T = params.num_tokens;
  const int g = h / (H / G);
  const int lane = threadIdx.x % kLanesPerRow;
  const int row0 = threadIdx.x / kLanesPerRow;
  const int rows_per_pass = blockDim.x / kLanesPerRow;

  const int slot = slot_in_range(l, params.slot_ids, b);
  if (slot < 0) return;
  const int current = l.current_copy(slot);
  state_t* head = static_cast<state_t*>(l.state) + std::int64_t{h} * P * kDstate;
  const state_t* S = head + l.state_offset(params.layer, slot, current);

  // Stream the current copy in first; the slot's allocation flag arrives meanwhile.
  typename Split::template Fragment<state_t> st[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int row = row0 + i * rows_per_pass;
    if (row < P) st[i].template load<CacheOp::kStreaming>(S + std::int64_t{row} * kDstate, lane);
  }
  if (!slot_allocated(l, slot)) return;
  float s[kRowsPerThread][kPerLane];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) st[i].unpack(s[i]);

  for (int t = 0; t < T; ++t) {
    const std::int64_t bt = std::int64_t{b} * T + t;
    typename Split::template Fragment<input_t, state_t> b_in, c_in;
    const std::int64_t bc_off = (bt * G + g) * kDstate;
    b_in.load(static_cast<const input_t*>(params.B) + bc_off, lane);
    c_in.load(static_cast<const input_t*>(params.C) + bc_off, lane);
    float Bv[kPerLane], Cv[kPerLane];
    b_in.unpack(Bv);
    c_in.unpack(Cv);
    const float delta = softplus(params.dt[bt * H + h] + params.dt_bias[h]);
    const float decay = expf(params.A[h] * delta);
    const auto* x = static_cast<const input_t*>(params.x) + (bt * H + h) * P;
    state_t* out = head + l.state_offset(params.layer, slot, l.after_tokens(current, t + 1));
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int row = row0 + i * rows_per_pass;
      const float xdt = row < P ? to_float(x[row]) * delta : 0.0f;
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        s[i][e] = decay * s[i][e] + xdt * Bv[e];
        dot += s[i][e] * Cv[e];
      }
      st[i].pack(s[i]);
      if (row < P) {
        st[i].template store<CacheOp::kStreaming>(out + std::int64_t{row} * kDstate, lane);
      }
      dot = group_sum<kLanesPerRow>(dot);
      if (row < P && lane == 0) dots[t][row] = dot;
    }
  }
  __syncthreads();
  const float D = params.D[h];
  const auto* x = static_cast<const input_t*>(params.x);
  const auto* z = static_cast<const input_t*>(params.z);
  auto* y = static_cast<input_t*>(params.y);
  for (int i = threadIdx.x; i < T * P; i += blockDim.x) {
    const int t = i / P, r = i - t * P;
    const std::int64_t off = ((std::int64_t{b} * T + t) * H + h) * P + r;
    float v = dots[t][r] + D * to_float(x[off]);
    if (z != nullptr) v *= silu(to_float(z[off]));
    y[off] = from_float<input_t>(v);
  }
  if (h == 0 && threadIdx.x == 0) {
    l.pending[l.layer_slot(params.layer, slot)] = static_cast<std::uint8_t>(T);
  }
}

}  // namespace

Status launch_eager(const Params& params, cudaStream_t stream) {
  const StateCacheConfig& c = params.cache.config;
  return ActivationDTypes::dispatch(c.input_dtype, "input dtype", [&](auto in) {
    return EagerStateDTypes::dispatch(c.state_dtype, "eager state dtype", [&](auto st) {
      const dim3 grid(static_cast<unsigned>(params.cache.dims.heads),
                      static_cast<unsigned>(params.batch));
      const int threads = block_threads(params.cache.dims.rows);
      if (params.cache.state_copies() > 1) {
        eager_window_kernel<dtype_t<in.value>, dtype_t<st.value>>
            <<<grid, threads, 0, stream>>>(params);
      } else {
        eager_kernel<dtype_t<in.value>, dtype_t<st.value>><<<grid, threads, 0, stream>>>(params);
      }
      REPLAYSSM_CUDA_CHECK_LAUNCH("mamba2 eager kernel");
      return Status::ok();
    });
  });
}

}  // namespace replayssm::cuda::mamba2
