// Mamba-2 decode for the layer shapes the tuned kernels are not built for (dstate other than
// 128: small test and research shapes, the golden traces). Same semantics and cache layout as
// the tuned kernels and the CPU backend (ALGORITHM.md §1, §4, §5), written for clarity, not
// bandwidth: one block per (head, batch row), one thread per state row, each thread reading
// and writing only its own row, so no shared memory and no barrier is needed. The fold of a
// row happens in place, so the outputs after a fold read the freshly rounded copy, as on the
// CPU.

#include <cuda_runtime.h>

#include <string>

#include "cuda/common/cache.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/dispatch.cuh"
#include "cuda/mamba2/mamba2_launch.h"
#include "cuda/state_cache/cursors.cuh"

namespace replayssm::cuda::mamba2 {

namespace {

constexpr int kGenericThreads = 128;

// The records of one (layer, slot) that a row's work reads: `history` committed records from
// ring position `first`, then the window's T tokens, taken from the call's inputs (the ring
// copy of a window's B is written by only one head's block of the group, which another head's
// block must not wait for).
template <typename input_t>
struct Records {
  const Params& p;
  int slot, b, h, g, history;
  std::uint32_t first;

  __device__ std::int64_t ring(int j) const {
    return p.cache.ring_record(p.layer, slot, first + std::uint32_t(j));
  }
  __device__ std::int64_t token(int j) const {
    return std::int64_t{b} * p.num_tokens + (j - history);
  }
  __device__ float decay(int j) const {  // A·Δ
    const StateDims& d = p.cache.dims;
    if (j < history) return p.cache.ring_decay[ring(j) * d.heads + h];
    return p.A[h] * delta(j);
  }
  __device__ float delta(int j) const {  // Δ = softplus(dt + dt_bias)
    const StateDims& d = p.cache.dims;
    if (j < history) return p.cache.ring_write[ring(j) * d.heads + h];
    return softplus(p.dt[token(j) * d.heads + h] + p.dt_bias[h]);
  }
  __device__ float x(int j, int row) const {
    const StateDims& d = p.cache.dims;
    const input_t* src = j < history
        ? static_cast<const input_t*>(p.cache.ring_vec) + ring(j) * d.heads * d.rows
        : static_cast<const input_t*>(p.x) + token(j) * d.heads * d.rows;
    return to_float(src[h * d.rows + row]);
  }
  __device__ const input_t* B(int j) const {
    const StateDims& d = p.cache.dims;
    const input_t* src = j < history
        ? static_cast<const input_t*>(p.cache.ring_key) + ring(j) * d.key_heads * d.cols
        : static_cast<const input_t*>(p.B) + token(j) * d.key_heads * d.cols;
    return src + g * d.cols;
  }
};

// One checkpoint element of the copy outputs read (low when present, else fp32).
__device__ float read_output(const StateCacheLayout& l, std::int64_t elem, std::int64_t row) {
  if (l.ckpt_lo == nullptr) return l.ckpt_hi[elem];
  if (l.ckpt_lo_scale != nullptr) {
    return to_float(static_cast<const fp8e4m3_t*>(l.ckpt_lo)[elem]) * l.ckpt_lo_scale[row];
  }
  return to_float(static_cast<const bf16_t*>(l.ckpt_lo)[elem]);
}

// Folds `count` records into one state row, in place: S ← τ·S + Σ_j s_j·x_j·B_jᵀ on the master
// (fp32 when present, else the shared bf16 copy), then refreshes the low copy.
template <typename input_t>
__device__ void fold_row(const StateCacheLayout& l, const Records<input_t>& rec, int count,
                         int row, std::int64_t state_row) {
  const std::int64_t row_elem = state_row * l.dims.cols;
  const int N = l.dims.cols;
  float total = 0.0f;
  for (int j = 0; j < count; ++j) total += rec.decay(j);
  const float tau = expf(total);
  float* hi = l.ckpt_hi != nullptr ? l.ckpt_hi + row_elem : nullptr;
  auto* lo_bf16 = (l.ckpt_lo != nullptr && l.ckpt_lo_scale == nullptr)
                      ? static_cast<bf16_t*>(l.ckpt_lo) + row_elem : nullptr;
  float amax = 0.0f;
  for (int n = 0; n < N; ++n) {
    float s = tau * (hi != nullptr ? hi[n] : to_float(lo_bf16[n]));
    float cum = 0.0f;
    for (int j = 0; j < count; ++j) {
      cum += rec.decay(j);
      s += rec.delta(j) * expf(total - cum) * rec.x(j, row) * to_float(rec.B(j)[n]);
    }
    if (hi != nullptr) hi[n] = s;
    if (lo_bf16 != nullptr) lo_bf16[n] = float_to_bf16(s);
    amax = fmaxf(amax, fabsf(s));
  }
  if (l.ckpt_lo_scale != nullptr) {  // fp8 read copy: a fresh per-row scale, then the codes
    const float scale = amax > 0.0f ? amax / kFp8Max : 1.0f;
    l.ckpt_lo_scale[state_row] = scale;
    auto* codes = static_cast<fp8e4m3_t*>(l.ckpt_lo) + row_elem;
    for (int n = 0; n < N; ++n) codes[n] = float_to_fp8e4m3(hi[n] / scale);
  }
}

template <typename input_t>
__global__ void generic_replay_kernel(const __grid_constant__ Params p) {
  const StateCacheLayout& l = p.cache;
  const StateDims& d = l.dims;
  const int h = blockIdx.x, b = blockIdx.y;
  const int slot = resolve_slot(l, p.slot_ids, b);
  if (slot < 0) return;
  const int T = p.num_tokens;
  const std::uint32_t committed = l.committed[slot];
  const FoldCursor cursor = fold_cursor(l, fold_cursor_load(l, p.layer, slot), committed, T);
  const std::uint32_t first = cursor.first;
  // Clamped so that corrupt cursors can never index past the ring's live records.
  const int unfolded_count = int(min(cursor.unfolded, std::uint32_t(l.max_history())));
  const bool fold = cursor.fold;
  const int g = h / (d.heads / d.key_heads);
  const Records<input_t> history{p, slot, b, h, g, unfolded_count, first};
  const Records<input_t> window{p, slot, b, h, g, fold ? 0 : unfolded_count,
                                fold ? first + std::uint32_t(unfolded_count) : first};

  const std::int64_t region = l.checkpoint_region(p.layer, slot);
  for (int row = threadIdx.x; row < d.rows; row += blockDim.x) {
    const std::int64_t state_row = (region * d.heads + h) * d.rows + row;
    const std::int64_t row_elem = state_row * d.cols;
    if (fold) fold_row(l, history, unfolded_count, row, state_row);
    // y_t = τ_t·(S·C_t) + Σ_{j ≤ w+t} s_j·(B_j·C_t)·x_j + D·x_t, then the gate.
    for (int t = 0; t < T; ++t) {
      const int last = window.history + t;
      const std::int64_t bt = std::int64_t{b} * T + t;
      const input_t* C = static_cast<const input_t*>(p.C) + (bt * d.key_heads + g) * d.cols;
      float total = 0.0f;
      for (int j = 0; j <= last; ++j) total += window.decay(j);
      float sc = 0.0f;
      for (int n = 0; n < d.cols; ++n) sc += read_output(l, row_elem + n, state_row) * to_float(C[n]);
      float acc = expf(total) * sc, cum = 0.0f;
      for (int j = 0; j <= last; ++j) {
        cum += window.decay(j);
        float bc = 0.0f;
        const input_t* Bj = window.B(j);
        for (int n = 0; n < d.cols; ++n) bc += to_float(Bj[n]) * to_float(C[n]);
        acc += window.delta(j) * expf(total - cum) * bc * window.x(j, row);
      }
      const std::int64_t out = (bt * d.heads + h) * d.rows + row;
      float y = acc + p.D[h] * to_float(static_cast<const input_t*>(p.x)[out]);
      if (p.z != nullptr) y *= silu(to_float(static_cast<const input_t*>(p.z)[out]));
      static_cast<input_t*>(p.y)[out] = from_float<input_t>(y);
    }
  }
  if (fold) {
    __syncthreads();  // every thread of the block has read `folded`
    if (threadIdx.x == 0) fold_cursor_arrive(l, p.layer, slot, committed, gridDim.x);
  }
  if (T == 0) return;
  // Append the window's ring records at committed..committed+T-1 (past every record read
  // above): x and Δ, A·Δ of this head; B of the group by its first head's block.
  for (int t = 0; t < T; ++t) {
    const std::int64_t rec = l.ring_record(p.layer, slot, committed + std::uint32_t(t));
    const std::int64_t bt = std::int64_t{b} * T + t;
    for (int row = threadIdx.x; row < d.rows; row += blockDim.x) {
      static_cast<input_t*>(l.ring_vec)[(rec * d.heads + h) * d.rows + row] =
          static_cast<const input_t*>(p.x)[(bt * d.heads + h) * d.rows + row];
    }
    if (h % (d.heads / d.key_heads) == 0) {
      for (int n = threadIdx.x; n < d.cols; n += blockDim.x) {
        static_cast<input_t*>(l.ring_key)[(rec * d.key_heads + g) * d.cols + n] =
            static_cast<const input_t*>(p.B)[(bt * d.key_heads + g) * d.cols + n];
      }
    }
    if (threadIdx.x == 0) {
      const float delta = softplus(p.dt[bt * d.heads + h] + p.dt_bias[h]);
      l.ring_write[rec * d.heads + h] = delta;
      l.ring_decay[rec * d.heads + h] = p.A[h] * delta;
    }
  }
  if (h == 0 && threadIdx.x == 0) {
    l.pending[l.layer_slot(p.layer, slot)] = static_cast<std::uint8_t>(T);
  }
}

// Eager, a window of T <= kMaxWindow tokens (T = 1 on a one-copy cache: in place): each state
// element is read once from the current copy, carried in fp32 through the tokens, and stored
// (rounded) after token t into copy after_tokens(current, t), as on the CPU.
template <typename input_t, typename state_t>
__global__ void generic_eager_kernel(const __grid_constant__ Params p) {
  const StateCacheLayout& l = p.cache;
  const StateDims& d = l.dims;
  const int h = blockIdx.x, b = blockIdx.y;
  const int slot = resolve_slot(l, p.slot_ids, b);
  if (slot < 0) return;
  const int T = p.num_tokens;
  const int g = h / (d.heads / d.key_heads);
  const int current = l.current_copy(slot);
  float delta[kMaxWindow], decay[kMaxWindow];
  for (int t = 0; t < T; ++t) {
    const std::int64_t bt = std::int64_t{b} * T + t;
    delta[t] = softplus(p.dt[bt * d.heads + h] + p.dt_bias[h]);
    decay[t] = expf(p.A[h] * delta[t]);
  }
  // Token t's B or C of the group.
  auto key = [&](const void* v, int t) {
    return static_cast<const input_t*>(v) + ((std::int64_t{b} * T + t) * d.key_heads + g) * d.cols;
  };
  auto* state = static_cast<state_t*>(l.state);
  for (int row = threadIdx.x; row < d.rows; row += blockDim.x) {
    const std::int64_t row_elem = (std::int64_t{h} * d.rows + row) * d.cols;
    const state_t* S = state + l.state_offset(p.layer, slot, current) + row_elem;
    float xdt[kMaxWindow], acc[kMaxWindow];
    for (int t = 0; t < T; ++t) {
      const std::int64_t out = ((std::int64_t{b} * T + t) * d.heads + h) * d.rows + row;
      xdt[t] = to_float(static_cast<const input_t*>(p.x)[out]) * delta[t];
      acc[t] = 0.0f;
    }
    for (int n = 0; n < d.cols; ++n) {
      float s = to_float(S[n]);
      for (int t = 0; t < T; ++t) {
        s = decay[t] * s + xdt[t] * to_float(key(p.B, t)[n]);
        state[l.state_offset(p.layer, slot, l.after_tokens(current, t + 1)) + row_elem + n] =
            from_float<state_t>(s);
        acc[t] += s * to_float(key(p.C, t)[n]);
      }
    }
    for (int t = 0; t < T; ++t) {
      const std::int64_t out = ((std::int64_t{b} * T + t) * d.heads + h) * d.rows + row;
      float y = acc[t] + p.D[h] * to_float(static_cast<const input_t*>(p.x)[out]);
      if (p.z != nullptr) y *= silu(to_float(static_cast<const input_t*>(p.z)[out]));
      static_cast<input_t*>(p.y)[out] = from_float<input_t>(y);
    }
  }
  if (h == 0 && threadIdx.x == 0) {
    l.pending[l.layer_slot(p.layer, slot)] = static_cast<std::uint8_t>(T);
  }
}

}  // namespace

Status launch_generic(const Params& params, cudaStream_t stream) {
  const StateCacheConfig& c = params.cache.config;
  if (params.cache.dims.heads > kMaxFoldBlocks) {
    return unsupported("mamba2 CUDA decode runs up to " + std::to_string(kMaxFoldBlocks) +
                       " heads, got " + std::to_string(params.cache.dims.heads));
  }
  const dim3 grid(static_cast<unsigned>(params.cache.dims.heads),
                  static_cast<unsigned>(params.batch));
  return ActivationDTypes::dispatch(c.input_dtype, "input dtype", [&](auto in) {
    using input_t = dtype_t<in.value>;
    if (c.mode == DecodeMode::kReplay) {
      generic_replay_kernel<input_t><<<grid, kGenericThreads, 0, stream>>>(params);
      REPLAYSSM_CUDA_CHECK_LAUNCH("mamba2 generic replay kernel");
      return Status::ok();
    }
    return EagerStateDTypes::dispatch(c.state_dtype, "eager state dtype", [&](auto st) {
      generic_eager_kernel<input_t, dtype_t<st.value>>
          <<<grid, kGenericThreads, 0, stream>>>(params);
      REPLAYSSM_CUDA_CHECK_LAUNCH("mamba2 generic eager kernel");
      return Status::ok();
    });
  });
}

}  // namespace replayssm::cuda::mamba2
