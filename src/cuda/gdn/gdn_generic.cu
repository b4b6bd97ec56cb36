// Gated DeltaNet decode for the shapes the tuned kernels are not built for: any head_k_dim up
// to kGenericMaxK and any head_v_dim, windows wider than the tuned walks take, and buffer
// lengths whose staging would not fit the tuned kernels' shared memory. Same semantics and
// cache layout as the tuned kernels and the CPU backend (ALGORITHM.md §2, §4, §5), written for
// clarity, not bandwidth:
//   one block per (value head, batch row[, layer for folds]); one warp per state row, the row's
//   K columns spread over the lanes (kGenericPerLane each) and reduced by shuffles;
//   a fold replays the committed tokens forward, row by row, in fp32 registers (each row of
//   the delta rule depends only on itself), then stores every copy as write_row does;
//   outputs use the adjoint walk, computed once per window token by warp 0 into shared memory
//   (the walked query and one coefficient per record) and met by every row.

#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "common/numeric.h"
#include "cuda/common/cache.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/dispatch.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/gdn/gdn_launch.h"
#include "cuda/state_cache/cursors.cuh"

namespace replayssm::cuda::gdn {

namespace {

constexpr int kGenericWarps = 4;
constexpr int kGenericThreads = 32 * kGenericWarps;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

struct GenericParams {
  StateCacheLayout cache;
  GdnInputs in;
  int num_tokens = 1;  ///< T; 0 = a fold (blockIdx.z + layer is the layer)
  int layer = 0;
};

// The records one block reads: `history` committed records from ring position `first`, then
// the window's tokens from the call's inputs (another block may still be appending them).
template <typename input_t>
struct Records {
  const GenericParams& p;
  int layer, slot, b, h, kh, history;
  std::uint32_t first;

  __device__ std::int64_t ring(int j) const {
    return p.cache.ring_record(layer, slot, first + std::uint32_t(j));
  }
  __device__ std::int64_t token(int j) const {
    return std::int64_t{b} * p.num_tokens + (j - history);
  }
  __device__ float g(int j) const {
    const StateDims& d = p.cache.dims;
    return j < history ? p.cache.ring_decay[ring(j) * d.heads + h]
                       : p.in.g[token(j) * d.heads + h];
  }
  __device__ float beta(int j) const {
    const StateDims& d = p.cache.dims;
    return j < history ? p.cache.ring_write[ring(j) * d.heads + h]
                       : p.in.beta[token(j) * d.heads + h];
  }
  __device__ float v(int j, int row) const {
    const StateDims& d = p.cache.dims;
    const auto* src = j < history
        ? static_cast<const input_t*>(p.cache.ring_vec) + ring(j) * d.heads * d.rows
        : static_cast<const input_t*>(p.in.v) + token(j) * d.heads * d.rows;
    return to_float(src[h * d.rows + row]);
  }
  __device__ const input_t* raw_k(int j) const {
    const StateDims& d = p.cache.dims;
    const auto* src = j < history
        ? static_cast<const input_t*>(p.cache.ring_key) + ring(j) * d.key_heads * d.cols
        : static_cast<const input_t*>(p.in.k) + token(j) * d.key_heads * d.cols;
    return src + kh * d.cols;
  }
  /// The factor that normalises raw_k(j) (the ring stores it; a window token's is computed by
  /// every lane of the calling warp).
  __device__ float k_scale(int j, int lane) const {
    if (j < history) return p.cache.ring_key_scale[ring(j) * p.cache.dims.key_heads + kh];
    if (!p.in.qk_l2norm) return 1.0f;
    return l2norm_factor(raw_k(j), p.cache.dims.cols, lane);
  }

  /// 1 / sqrt(|u|² + 1e-6), summed by the warp.
  static __device__ float l2norm_factor(const input_t* u, int n, int lane) {
    float sq = 0.0f;
    for (int c = lane; c < n; c += 32) sq += to_float(u[c]) * to_float(u[c]);
    return 1.0f / sqrtf(warp_sum(sq) + 1e-6f);
  }
};

// This lane's columns of a row: c = lane + 32·i.
struct LaneRow {
  float v[kGenericPerLane];
};

template <typename input_t>
__device__ void load_k_hat(const Records<input_t>& rec, int j, int lane, int K, LaneRow* k) {
  const float s = rec.k_scale(j, lane);
  const input_t* raw = rec.raw_k(j);
#pragma unroll
  for (int i = 0; i < kGenericPerLane; ++i) {
    const int c = lane + 32 * i;
    k->v[i] = c < K ? to_float(raw[c]) * s : 0.0f;
  }
}

__device__ float lane_dot(const LaneRow& a, const LaneRow& b) {
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < kGenericPerLane; ++i) s += a.v[i] * b.v[i];
  return warp_sum(s);
}

// One (layer, slot, head) block of the checkpoint, every copy it has.
struct Block {
  const StateCacheLayout& l;
  std::int64_t state_row0;  // index of the block's first state row

  __device__ float read_output(int row, int c) const {  // the copy outputs read
    const std::int64_t e = (state_row0 + row) * l.dims.cols + c;
    if (l.ckpt_lo == nullptr) return l.ckpt_hi[e];
    if (l.ckpt_lo_scale != nullptr) {
      return to_float(static_cast<const fp8e4m3_t*>(l.ckpt_lo)[e]) *
             l.ckpt_lo_scale[state_row0 + row];
    }
    return to_float(static_cast<const bf16_t*>(l.ckpt_lo)[e]);
  }
  __device__ float read_master(int row, int c) const {  // the copy folds update
    const std::int64_t e = (state_row0 + row) * l.dims.cols + c;
    return l.ckpt_hi != nullptr ? l.ckpt_hi[e] : to_float(static_cast<const bf16_t*>(l.ckpt_lo)[e]);
  }
  // Stores a folded fp32 row into every copy, as write_row (common/checkpoint_rows.h) does.
  __device__ void write_row(int row, const LaneRow& s, int lane) const {
    const int K = l.dims.cols;
    const std::int64_t base = (state_row0 + row) * K;
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kGenericPerLane; ++i) {
      const int c = lane + 32 * i;
      if (c >= K) continue;
      if (l.ckpt_hi != nullptr) l.ckpt_hi[base + c] = s.v[i];
      if (l.ckpt_lo != nullptr && l.ckpt_lo_scale == nullptr) {
        static_cast<bf16_t*>(l.ckpt_lo)[base + c] = float_to_bf16(s.v[i]);
      }
      amax = fmaxf(amax, fabsf(s.v[i]));
    }
    if (l.ckpt_lo_scale == nullptr) return;
    amax = warp_max(amax);
    const float scale = amax > 0.0f ? amax / kFp8Max : 1.0f;
    const float inv = 1.0f / scale;
    if (lane == 0) l.ckpt_lo_scale[state_row0 + row] = scale;
#pragma unroll
    for (int i = 0; i < kGenericPerLane; ++i) {
      const int c = lane + 32 * i;
      if (c < K) static_cast<fp8e4m3_t*>(l.ckpt_lo)[base + c] = float_to_fp8e4m3(s.v[i] * inv);
    }
  }
};

// S_r ← α_j·S_r + β_j·(v_j[r] − α_j·S_r·k̂_j)·k̂_j for the `count` records, row by row.
template <typename input_t>
__device__ void fold_rows(const Block& blk, const Records<input_t>& rec, int count, int warp,
                          int lane) {
  const int K = blk.l.dims.cols, V = blk.l.dims.rows;
  for (int row = warp; row < V; row += kGenericWarps) {
    LaneRow s;
#pragma unroll
    for (int i = 0; i < kGenericPerLane; ++i) {
      const int c = lane + 32 * i;
      s.v[i] = c < K ? blk.read_master(row, c) : 0.0f;
    }
    for (int j = 0; j < count; ++j) {
      LaneRow k;
      load_k_hat(rec, j, lane, K, &k);
      const float alpha = expf(rec.g(j));
#pragma unroll
      for (int i = 0; i < kGenericPerLane; ++i) s.v[i] *= alpha;
      const float d = rec.beta(j) * (rec.v(j, row) - lane_dot(s, k));
#pragma unroll
      for (int i = 0; i < kGenericPerLane; ++i) s.v[i] += d * k.v[i];
    }
    blk.write_row(row, s, lane);
  }
}

template <typename input_t>
__global__ void __launch_bounds__(kGenericThreads)
    generic_replay_kernel(const __grid_constant__ GenericParams p) {
  extern __shared__ float smem[];  // walked query [K], then one coefficient per record
  const StateCacheLayout& l = p.cache;
  const StateDims& d = l.dims;
  const int K = d.cols, V = d.rows, T = p.num_tokens;
  const int h = blockIdx.x, b = blockIdx.y, layer = p.layer + int(blockIdx.z);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = resolve_slot(l, p.in.slot_ids, b);
  if (slot < 0) return;
  const int kh = h / (d.heads / d.key_heads);
  const std::uint32_t committed = l.committed[slot];
  const FoldCursor cursor = fold_cursor(l, fold_cursor_load(l, layer, slot), committed, T);
  const std::uint32_t first = cursor.first;
  // Clamped so that corrupt cursors can never index past the ring's live records.
  const int unfolded_count = int(min(cursor.unfolded, std::uint32_t(l.max_history())));
  const bool fold = cursor.fold;
  const Block blk{l, (l.checkpoint_region(layer, slot) * d.heads + h) * std::int64_t{V}};
  if (fold) {
    const Records<input_t> history{p, layer, slot, b, h, kh, unfolded_count, first};
    fold_rows(blk, history, unfolded_count, warp, lane);
    __syncthreads();  // every thread of the block has read `folded` (and folded its rows)
    if (threadIdx.x == 0) fold_cursor_arrive(l, layer, slot, committed, gridDim.x);
  }
  if (T == 0) return;
  __syncthreads();  // the folded rows are what the outputs read (same warp per row anyway)
  const int hist = fold ? 0 : unfolded_count;
  const Records<input_t> rec{p, layer, slot, b, h, kh, hist,
                             fold ? first + std::uint32_t(unfolded_count) : first};
  float* tq_s = smem;
  float* coef = smem + K;
  for (int t = 0; t < T; ++t) {
    // The walk of token t (position hist + t), newest record first, by warp 0:
    //   tq ← q̂_t; for j = last … 0: c_j = β_j·(k̂_j·tq); tq ← α_j·(tq − c_j·k̂_j).
    if (warp == 0) {
      const std::int64_t bt = std::int64_t{b} * T + t;
      const auto* q = static_cast<const input_t*>(p.in.q) + (bt * d.key_heads + kh) * K;
      const float f = p.in.qk_l2norm
                          ? p.in.q_scale * Records<input_t>::l2norm_factor(q, K, lane)
                          : p.in.q_scale;
      LaneRow tq;
#pragma unroll
      for (int i = 0; i < kGenericPerLane; ++i) {
        const int c = lane + 32 * i;
        tq.v[i] = c < K ? to_float(q[c]) * f : 0.0f;
      }
      for (int j = hist + t; j >= 0; --j) {
        LaneRow k;
        load_k_hat(rec, j, lane, K, &k);
        const float c = rec.beta(j) * lane_dot(k, tq);
        const float alpha = expf(rec.g(j));
#pragma unroll
        for (int i = 0; i < kGenericPerLane; ++i) tq.v[i] = alpha * (tq.v[i] - c * k.v[i]);
        if (lane == 0) coef[j] = c;
      }
#pragma unroll
      for (int i = 0; i < kGenericPerLane; ++i) {
        const int c = lane + 32 * i;
        if (c < K) tq_s[c] = tq.v[i];
      }
    }
    __syncthreads();
    // o[r] = Σ_j c_j·v_j[r] + S_c[r]·tq, one warp per row.
    for (int row = warp; row < V; row += kGenericWarps) {
      float acc = 0.0f;
      for (int c = lane; c < K; c += 32) acc += blk.read_output(row, c) * tq_s[c];
      acc = warp_sum(acc);
      if (lane == 0) {
        for (int j = 0; j <= hist + t; ++j) acc += coef[j] * rec.v(j, row);
        const std::int64_t out = ((std::int64_t{b} * T + t) * d.heads + h) * V + row;
        static_cast<input_t*>(p.in.o)[out] = from_float<input_t>(acc);
      }
    }
    __syncthreads();  // tq_s and coef are rewritten by the next token's walk
  }
  // Append the window at committed..committed+T-1 (past every record read above): v, β, g of
  // this head; the raw k and its factor by the key head's first value head.
  for (int t = 0; t < T; ++t) {
    const std::int64_t r = l.ring_record(layer, slot, committed + std::uint32_t(t));
    const std::int64_t bt = std::int64_t{b} * T + t;
    for (int row = threadIdx.x; row < V; row += kGenericThreads) {
      static_cast<input_t*>(l.ring_vec)[(r * d.heads + h) * V + row] =
          static_cast<const input_t*>(p.in.v)[(bt * d.heads + h) * V + row];
    }
    if (h % (d.heads / d.key_heads) == 0) {
      const auto* k = static_cast<const input_t*>(p.in.k) + (bt * d.key_heads + kh) * K;
      for (int c = threadIdx.x; c < K; c += kGenericThreads) {
        static_cast<input_t*>(l.ring_key)[(r * d.key_heads + kh) * K + c] = k[c];
      }
      if (warp == 0) {
        const float s =
            p.in.qk_l2norm ? Records<input_t>::l2norm_factor(k, K, lane) : 1.0f;
        if (lane == 0) l.ring_key_scale[r * d.key_heads + kh] = s;
      }
    }
    if (threadIdx.x == 0) {
      l.ring_write[r * d.heads + h] = p.in.beta[bt * d.heads + h];
      l.ring_decay[r * d.heads + h] = p.in.g[bt * d.heads + h];
    }
  }
  if (h == 0 && threadIdx.x == 0) {
    l.pending[l.layer_slot(layer, slot)] = static_cast<std::uint8_t>(T);
  }
}

// Eager, a window of T <= kMaxEagerWindow tokens (T = 1 on a one-copy cache: in place), one
// warp per row: per token S_r ← α·S_r; d = β·(v[r] − S_r·k̂); S_r += d·k̂; o[r] = S_r·q̂, the row
// read once from the current copy, carried in fp32 and stored (rounded) after token t into
// copy after_tokens(current, t), as on the CPU. The window's q̂ and k̂ are normalised once per
// block, a warp per vector, into shared memory ([T][2][K] floats, eager_smem_bytes).
template <typename input_t, typename state_t>
__global__ void __launch_bounds__(kGenericThreads)
    generic_eager_kernel(const __grid_constant__ GenericParams p) {
  extern __shared__ float hats[];  // [T][q̂, k̂][K]
  const StateCacheLayout& l = p.cache;
  const StateDims& d = l.dims;
  const int K = d.cols, V = d.rows, T = p.num_tokens;
  const int h = blockIdx.x, b = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = resolve_slot(l, p.in.slot_ids, b);
  if (slot < 0) return;
  const int kh = h / (d.heads / d.key_heads);
  for (int job = warp; job < 2 * T; job += kGenericWarps) {
    const int t = job / 2;
    const bool query = job % 2 == 0;
    const auto* u = static_cast<const input_t*>(query ? p.in.q : p.in.k) +
                    ((std::int64_t{b} * T + t) * d.key_heads + kh) * K;
    const float f = p.in.qk_l2norm ? Records<input_t>::l2norm_factor(u, K, lane) : 1.0f;
    const float scale = query ? (p.in.qk_l2norm ? p.in.q_scale * f : p.in.q_scale) : f;
    for (int c = lane; c < K; c += 32) hats[std::size_t(job) * K + c] = to_float(u[c]) * scale;
  }
  __syncthreads();
  // Token t's q̂ or k̂ as this lane's columns.
  auto hat = [&](int t, bool query) {
    LaneRow r;
    const float* src = hats + std::size_t(2 * t + (query ? 0 : 1)) * K;
#pragma unroll
    for (int i = 0; i < kGenericPerLane; ++i) {
      const int c = lane + 32 * i;
      r.v[i] = c < K ? src[c] : 0.0f;
    }
    return r;
  };
  const int current = l.current_copy(slot);
  auto* state = static_cast<state_t*>(l.state);
  for (int row = warp; row < V; row += kGenericWarps) {
    const std::int64_t row_elem = (std::int64_t{h} * V + row) * K;
    const state_t* S = state + l.state_offset(p.layer, slot, current) + row_elem;
    LaneRow s;
#pragma unroll
    for (int i = 0; i < kGenericPerLane; ++i) {
      const int c = lane + 32 * i;
      s.v[i] = c < K ? to_float(S[c]) : 0.0f;
    }
    for (int t = 0; t < T; ++t) {
      const std::int64_t bh = (std::int64_t{b} * T + t) * d.heads + h;
      const float alpha = expf(p.in.g[bh]), beta = p.in.beta[bh];
      const LaneRow kh_row = hat(t, false);
#pragma unroll
      for (int i = 0; i < kGenericPerLane; ++i) s.v[i] *= alpha;
      const float v = to_float(static_cast<const input_t*>(p.in.v)[bh * V + row]);
      const float delta = beta * (v - lane_dot(s, kh_row));
      state_t* out =
          state + l.state_offset(p.layer, slot, l.after_tokens(current, t + 1)) + row_elem;
#pragma unroll
      for (int i = 0; i < kGenericPerLane; ++i) {
        const int c = lane + 32 * i;
        s.v[i] += delta * kh_row.v[i];
        if (c < K) out[c] = from_float<state_t>(s.v[i]);
      }
      const float o = lane_dot(s, hat(t, true));
      if (lane == 0) static_cast<input_t*>(p.in.o)[bh * V + row] = from_float<input_t>(o);
    }
  }
  if (h == 0 && threadIdx.x == 0) {
    l.pending[l.layer_slot(p.layer, slot)] = static_cast<std::uint8_t>(T);
  }
}

}  // namespace

int generic_smem_bytes(const StateCacheConfig& c, int num_tokens) {
  return (c.dims().cols + max_history(c.buffer_len, c.max_spec_tokens) + num_tokens) *
         int(sizeof(float));
}

Status launch_generic(StateCacheLayout& l, const ReplayWork& work, cudaStream_t stream) {
  const StateCacheConfig& c = l.config;
  GenericParams p;
  p.cache = l;
  p.layer = work.first_layer;
  p.num_tokens = work.decode != nullptr ? work.decode->num_tokens : 0;
  if (work.decode != nullptr) {
    p.in = input_args(*work.decode, l.dims.cols);
  } else {
    p.in.slot_ids = work.slot_ids;
  }
  const int layers = p.num_tokens > 0 ? 1 : work.num_layers;
  if (l.dims.heads > kMaxFoldBlocks) {
    return unsupported("gdn CUDA decode runs up to " + std::to_string(kMaxFoldBlocks) +
                       " blocks per row (one per value head); the layer has " +
                       std::to_string(l.dims.heads) + " value heads");
  }
  const dim3 grid(static_cast<unsigned>(l.dims.heads), static_cast<unsigned>(work.batch),
                  static_cast<unsigned>(c.mode == DecodeMode::kEager ? 1 : layers));
  return ActivationDTypes::dispatch(c.input_dtype, "input dtype", [&](auto in) {
    using input_t = dtype_t<in.value>;
    if (c.mode == DecodeMode::kEager) {
      const int hats = 2 * p.num_tokens * l.dims.cols * int(sizeof(float));  // <= 32 KB
      return EagerStateDTypes::dispatch(c.state_dtype, "eager state dtype", [&](auto st) {
        generic_eager_kernel<input_t, dtype_t<st.value>>
            <<<grid, kGenericThreads, hats, stream>>>(p);
        REPLAYSSM_CUDA_CHECK_LAUNCH("gdn generic eager kernel");
        return Status::ok();
      });
    }
    const int smem = generic_smem_bytes(c, p.num_tokens);
    auto kernel = generic_replay_kernel<input_t>;
    REPLAYSSM_RETURN_IF_ERROR(allow_dynamic_smem(kernel, smem, "gdn generic replay kernel"));
    kernel<<<grid, kGenericThreads, smem, stream>>>(p);
    REPLAYSSM_CUDA_CHECK_LAUNCH("gdn generic replay kernel");
    return Status::ok();
  });
}

}  // namespace replayssm::cuda::gdn
