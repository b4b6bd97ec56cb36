// Gated DeltaNet replay decode (ALGORITHM.md §3–§7) and the explicit fold, on CUDA.
//
// One CTA per (batch row, key head, row split), in four phases:
//   1. stage: the committed history's ring records (cp.async, every load in flight at once)
//      and the window's records, built from the inputs (raw k and its fp32 normalisation
//      factor, v, β, g) and appended to the ring at positions committed..committed+T-1;
//   2. walk (§4, adjoint form): one warp per (window position t, value head), newest record
//      first: c = β_j·(k̂_j·t); o += c·v_j; t ← α_j·(t − c·k̂_j). Each walk is O(w·(K+V)) and
//      leaves the query t that meets the checkpoint and the ring's part of the output;
//   3. rows: each state row is read once from the read copy and multiplied by the T walked
//      queries (T dot products per row: a verify of T tokens costs one read of the state).
//      Single tokens stream fp32 and bf16 copies through shared memory (stages_passes);
//      verify windows over bf16 and fp8 copies, and single tokens over fp8 ones, take the
//      products on the tensor cores (read_window_mma, reads_on_tensor_cores); the rest hold
//      their passes in registers;
//   3'. or, when a fold is due (committed − folded >= L; any history for an explicit fold), the
//      rows are read from the fp32 master, the history is replayed forward in fp32 registers
//      (§5: s ← α s; d = β(v − s·k̂); s ← s + d k̂), written back to every copy (§6), and the
//      outputs use the fresh read copy; the walks then cover the window only.
// Wherever k̂ is used (walks, folds) it is formed in fp32 as to_float(k_j)·scale_j from the
// ring's raw key and ring_key_scale (state_cache_layout.h), as the CPU backend does: a k̂
// rounded to the input dtype would put that rounding into every fold of the fp32 master.
// The cursor move folded = committed happens inside the launch (state_cache/cursors.cuh: the
// last CTA of a folding row to arrive moves it): a step is one launch per layer.
//
// Exactness: the walks apply each record's transition transposed to the query, so outputs
// equal the eager recurrence up to rounding order; the only per-step state traffic is one
// read of the read copy (fp32, bf16 or fp8), plus 1/L of a master read+write at folds.

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "backend.h"
#include "cuda/common/async_copy.cuh"
#include "cuda/common/cache.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/checkpoint.cuh"
#include "cuda/common/conv.cuh"
#include "cuda/common/device_limits.cuh"
#include "cuda/common/dispatch.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/common/mma.cuh"
#include "cuda/gdn/gdn_device.cuh"
#include "cuda/gdn/gdn_launch.h"
#include "cuda/gdn/gdn_params.cuh"
#include "cuda/common/tuning.h"
#include "cuda/state_cache/cursors.cuh"
#include "cuda/state_cache/fold_order.cuh"

namespace replayssm::cuda::gdn {

namespace {

/// Rows of the read copy each thread has in flight per pass: kReplayRowBytes of them (fp32 1,
/// bf16 2, fp8 4). The first pass is requested before the prologue.
template <typename read_t>
constexpr int kOutputRows = kReplayRowBytes / (kPerLane * int(sizeof(read_t)));
/// Rows per thread in a fold: fp32 rows live in registers across the whole history, and the
/// history's keys are gathered once per token for both. Two rows spill up to 60 bytes under
/// the 64-register cap (one row: up to 4), but one row gathers every key once per row: measured,
/// 7 µs more per step (fp32, L = 16, aligned flushes: one fold step in 16) and 24 µs more per
/// spec verify step with 4 tokens committed per step (a fold every 4 steps).
constexpr int kFoldRows = 2;
/// Rows of one fold pass of a CTA, the unit of its rows (gdn_params.cuh, kSplitRows).
constexpr int kFoldPassRows = kRowGroups * kFoldRows;
static_assert(kSplitRows == kFoldPassRows, "a split is whole fold passes");

/// Where local value head h (of the key head's G) lies in the staged per-head arrays
/// (ReplaySmem::heads): h itself where all G are staged, else h's place among its split's
/// heads, which are an aligned run of a power of two (ReplaySmem::head_mask). Row r of head h
/// is staged at r − (h − staged_head(h))·V. One AND with a launch constant: no register is
/// held for it across the kernel (a per-CTA offset raised the kernels' spills).
__device__ __forceinline__ int staged_head(const ReplayParams& p, int h) {
  return h & p.smem.head_mask;
}

/// Phase 1: the committed history's records (positions first .. first+hist-1) into shared
/// memory, as staged ring records [j] = position first + j.
template <typename input_t>
__device__ __forceinline__ void stage_history(const ReplayParams& p, int layer, int slot, int hk,
                                              std::uint32_t first, int hist, int h_lo,
                                              int h_hi, unsigned char* smem) {
  const StateCacheLayout& l = p.cache;
  const int K = l.dims.cols, V = l.dims.rows, Hk = l.dims.key_heads, Hv = l.dims.heads;
  const int G = p.heads_per_key, h0 = hk * G;
  constexpr int in = sizeof(input_t);
  auto* s_key = smem + p.smem.key_bytes;
  auto* s_vec = smem + p.smem.vec_bytes;
  auto* s_alpha = reinterpret_cast<float*>(smem) + p.smem.alpha;
  auto* s_beta = reinterpret_cast<float*>(smem) + p.smem.beta;
  auto* s_kscale = reinterpret_cast<float*>(smem) + p.smem.kscale;
  const auto* ring_key = static_cast<const unsigned char*>(l.ring_key);
  const auto* ring_vec = static_cast<const unsigned char*>(l.ring_vec);

  const int key_chunks = K * in / 16;  // K % 16 == 0: whole 16-byte vectors
  // Only the v of the value heads this CTA's rows belong to, when a head is whole vectors.
  const bool head_runs = V * in % 16 == 0;
  const int vec_c0 = head_runs ? h_lo * V * in / 16 : 0;
  // The staged v begin at the first staged head's (staged_head: 0 where all G are staged,
  // which is where head_runs or vec_async may be false).
  const int vec_dst0 = (h_lo - staged_head(p, h_lo)) * V * in;
  const int vec_chunks = !p.vec_async ? 0 : head_runs ? (h_hi + 1 - h_lo) * V * in / 16
                                                       : G * V * in / 16;
  const int per_record = key_chunks + vec_chunks;
  for (int i = threadIdx.x; i < hist * per_record; i += blockDim.x) {
    const int j = i / per_record;
    const int c = i - j * per_record;
    const std::int64_t rec = l.ring_record(layer, slot, first + std::uint32_t(j));
    if (c < key_chunks) {
      cp_async16(s_key + (j * K) * in + c * 16,
                 ring_key + ((rec * Hk + hk) * K) * in + c * 16);
    } else {
      const int cv = vec_c0 + c - key_chunks;
      cp_async16(s_vec + (j * p.smem.vec_stride) * in + cv * 16 - vec_dst0,
                 ring_vec + ((rec * Hv + h0) * V) * in + cv * 16);
    }
  }
  if (!p.vec_async) {  // small shapes whose G·V run is not a whole number of 16-byte vectors
    const int n = G * V;
    for (int i = threadIdx.x; i < hist * n; i += blockDim.x) {
      const int j = i / n;
      const int e = i - j * n;
      const std::int64_t rec = l.ring_record(layer, slot, first + std::uint32_t(j));
      reinterpret_cast<input_t*>(s_vec)[j * p.smem.vec_stride + e] =
          static_cast<const input_t*>(l.ring_vec)[(rec * Hv + h0) * V + e];
    }
  }
  for (int i = threadIdx.x; i < hist * G; i += blockDim.x) {
    const int j = i / G;
    const int h = i - j * G;
    const std::int64_t rec = l.ring_record(layer, slot, first + std::uint32_t(j));
    s_alpha[i] = expf(l.ring_decay[rec * Hv + h0 + h]);
    s_beta[i] = l.ring_write[rec * Hv + h0 + h];
  }
  for (int j = threadIdx.x; j < hist; j += blockDim.x) {
    const std::int64_t rec = l.ring_record(layer, slot, first + std::uint32_t(j));
    s_kscale[j] = l.ring_key_scale[rec * Hk + hk];
  }
}

/// Phase 1, window: records of the T tokens at staged index hist + t (raw k and its factor,
/// v, β, g), appended to the ring at position committed + t by split 0 (the other splits of
/// the key head stage the same values). q̂ of each token into the walked-query rows (tq) of
/// every head the CTA walks: each walk starts from its own row and leaves its result there, so
/// no walk reads a row another writes, and q̂ takes no shared memory of its own.
template <typename input_t, bool kConv>
__device__ __forceinline__ void stage_window(const ReplayParams& p, int layer, int slot, int hk,
                                             int b, std::uint32_t committed, int hist,
                                             int h_lo, int h_hi, bool append,
                                             unsigned char* smem) {
  const StateCacheLayout& l = p.cache;
  const GdnInputs& in = p.in;
  const int K = l.dims.cols, V = l.dims.rows, Hk = l.dims.key_heads, Hv = l.dims.heads;
  const int G = p.heads_per_key, h0 = hk * G, T = p.num_tokens;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* s_f = reinterpret_cast<float*>(smem);
  auto* s_key = reinterpret_cast<input_t*>(smem + p.smem.key_bytes);
  auto* s_vec = reinterpret_cast<input_t*>(smem + p.smem.vec_bytes);
  auto* ring_key = static_cast<input_t*>(l.ring_key);
  auto* ring_vec = static_cast<input_t*>(l.ring_vec);
  // Where token t's q, k and v are read: the inputs, or on a conv cache shared memory, where
  // the block convolves them first (cuda/common/conv.cuh): k and v where they are staged, q
  // into its own rows.
  auto* s_conv_q = reinterpret_cast<input_t*>(smem + p.smem.conv_q_bytes);
  if constexpr (kConv) {
    const auto convolve = [&](int first, int n, input_t* dst, int dst_stride) {
      conv_channels(l, in.conv, layer, slot, b, T, committed, first, n, dst, dst_stride);
    };
    convolve(l.conv_query_channel() + hk * K, K, s_conv_q, K);
    convolve(l.conv_key_channel() + hk * K, K, s_key + hist * K, K);
    convolve(l.conv_vec_channel() + h0 * V, G * V, s_vec + hist * p.smem.vec_stride,
             p.smem.vec_stride);
    if (append) {
      append_conv_channels<input_t>(l, in.conv, layer, slot, b, T, committed,
                                    l.conv_query_channel() + hk * K, K);
      append_conv_channels<input_t>(l, in.conv, layer, slot, b, T, committed,
                                    l.conv_key_channel() + hk * K, K);
      append_conv_channels<input_t>(l, in.conv, layer, slot, b, T, committed,
                                    l.conv_vec_channel() + h0 * V, G * V);
    }
    __syncthreads();
  }
  const auto qk_of = [&](bool is_key, int t) -> const input_t* {
    if (kConv) return is_key ? s_key + (hist + t) * K : s_conv_q + t * K;
    const std::int64_t bt = std::int64_t{b} * T + t;
    return static_cast<const input_t*>(is_key ? in.k : in.q) + (bt * Hk + hk) * K;
  };

  // k and q̂: one warp per (token, which). The ring keeps the raw k (copied, exact) and its
  // fp32 normalisation factor; every use (this step's walks included) forms k̂ = k·factor in
  // fp32, as the CPU does.
  float* s_kscale = s_f + p.smem.kscale;
  float* ring_key_scale = l.ring_key_scale;
  for (int job = warp; job < 2 * T; job += blockDim.x / 32) {
    const bool is_key = job < T;
    const int t = is_key ? job : job - T;
    const input_t* src = qk_of(is_key, t);
    if (is_key) {
      float x[kWalkPerLane];
      const float factor = load_l2norm_factor_warp(src, K, lane, x);
      const float key_scale = in.qk_l2norm ? factor : 1.0f;
      const std::int64_t rec = l.ring_record(layer, slot, committed + std::uint32_t(t));
#pragma unroll
      for (int i = 0; i < kWalkPerLane; ++i) {
        const int c = lane + 32 * i;
        if (c < K) {
          const input_t r = src[c];
          s_key[(hist + t) * K + c] = r;
          if (append) ring_key[(rec * Hk + hk) * K + c] = r;
        }
      }
      if (lane == 0) {
        s_kscale[hist + t] = key_scale;
        if (append) ring_key_scale[rec * Hk + hk] = key_scale;
      }
    } else {
      float x[kWalkPerLane];
      normalise_warp(src, K, in.qk_l2norm, in.q_scale, lane, x);
      for (int h = h_lo; h <= h_hi; ++h) {
        float* row = s_f + p.smem.tq + (t * p.smem.heads + staged_head(p, h)) * kMaxHeadKDim;
#pragma unroll
        for (int i = 0; i < kWalkPerLane; ++i) row[lane + 32 * i] = x[i];  // zero past K
      }
    }
  }
  // v of the staged heads (elements [e_lo, e_hi) of the key head's G·V); the appending CTA
  // copies every head's into the ring.
  const int e_lo = (h_lo - staged_head(p, h_lo)) * V;
  const int e_hi = min(G * V, e_lo + p.smem.heads * V);
  const int e_first = append ? 0 : e_lo;
  const int n = (append ? G * V : e_hi) - e_first;
  for (int i = threadIdx.x; i < T * n; i += blockDim.x) {
    const int t = i / n;
    const int e = e_first + i - t * n;
    const bool staged = e >= e_lo && e < e_hi;
    const input_t x =
        kConv ? s_vec[(hist + t) * p.smem.vec_stride + e]  // conv caches stage every head
             : static_cast<const input_t*>(in.v)[((std::int64_t{b} * T + t) * Hv + h0) * V + e];
    if (staged) s_vec[(hist + t) * p.smem.vec_stride + e - e_lo] = x;
    if (append) {
      const std::int64_t rec = l.ring_record(layer, slot, committed + std::uint32_t(t));
      ring_vec[(rec * Hv + h0) * V + e] = x;
    }
  }
  for (int i = threadIdx.x; i < T * G; i += blockDim.x) {
    const int t = i / G;
    const int h = i - t * G;
    const std::int64_t bth = (std::int64_t{b} * T + t) * Hv + h0 + h;
    const float g = in.g[bth], beta = in.beta[bth];
    s_f[p.smem.alpha + (hist + t) * G + h] = expf(g);
    s_f[p.smem.beta + (hist + t) * G + h] = beta;
    if (append) {
      const std::int64_t rec = l.ring_record(layer, slot, committed + std::uint32_t(t));
      l.ring_decay[rec * Hv + h0 + h] = g;
      l.ring_write[rec * Hv + h0 + h] = beta;
    }
  }
}

/// The staged ring records as the walks read them (ReplaySmem's arrays): per record and head
/// e^g and β, per record k's normalisation factor, raw k and v.
template <typename input_t>
struct StagedRecords {
  const float* alpha;
  const float* beta;
  const float* kscale;
  const input_t* key;
  const input_t* vec;
};
template <typename input_t>
__device__ __forceinline__ StagedRecords<input_t> staged_records(const ReplayParams& p,
                                                                 const unsigned char* smem) {
  const auto* f = reinterpret_cast<const float*>(smem);
  return {f + p.smem.alpha, f + p.smem.beta, f + p.smem.kscale,
          reinterpret_cast<const input_t*>(smem + p.smem.key_bytes),
          reinterpret_cast<const input_t*>(smem + p.smem.vec_bytes)};
}

/// Phase 2: the adjoint walks (§4) of window positions 0..T-1 for local heads h_lo..h_hi, one
/// warp per walk; records [stop, hist + t] newest first (stop = hist after a fold: the history
/// is in the checkpoint then). Writes s_tq and s_oring. Lane l holds columns l, l + 32, ...:
/// the single-token kernel's walk (walk_window is the verify windows').
template <typename input_t>
__device__ __forceinline__ void walk(const ReplayParams& p, int hist, int stop, int h_lo,
                                     int h_hi, unsigned char* smem) {
  const StateCacheLayout& l = p.cache;
  const int K = l.dims.cols, V = l.dims.rows, G = p.heads_per_key, T = p.num_tokens;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* s_f = reinterpret_cast<float*>(smem);
  const auto [s_alpha, s_beta, s_kscale, s_key, s_vec] = staged_records<input_t>(p, smem);
  const int nh = h_hi - h_lo + 1, Hs = p.smem.heads;
  for (int id = warp; id < T * nh; id += blockDim.x / 32) {
    const int t = id / nh;
    const int h = h_lo + (id - t * nh);
    const int hs = staged_head(p, h);
    float q[kWalkPerLane], acc[kWalkPerLane];
#pragma unroll
    for (int i = 0; i < kWalkPerLane; ++i) {
      q[i] = s_f[p.smem.tq + (t * Hs + hs) * kMaxHeadKDim + lane + 32 * i];  // q̂_t
      acc[i] = 0.0f;
    }
    for (int j = hist + t; j >= stop; --j) {
      const input_t* key = s_key + j * K;
      const float key_scale = s_kscale[j];
      float kv[kWalkPerLane];  // k̂_j = to_float(k_j)·scale_j, as the CPU rounds it
      float kq = 0.0f;
#pragma unroll
      for (int i = 0; i < kWalkPerLane; ++i) {
        const int c = lane + 32 * i;
        kv[i] = c < K ? to_float(key[c]) * key_scale : 0.0f;
        kq += kv[i] * q[i];
      }
      kq = group_sum<32>(kq);
      const float coeff = s_beta[j * G + h] * kq;
      const input_t* vec = s_vec + j * p.smem.vec_stride + hs * V;
#pragma unroll
      for (int i = 0; i < kWalkPerLane; ++i) {
        const int r = lane + 32 * i;
        if (r < V) acc[i] += coeff * to_float(vec[r]);
      }
      const float a = s_alpha[j * G + h];
#pragma unroll
      for (int i = 0; i < kWalkPerLane; ++i) q[i] = a * (q[i] - coeff * kv[i]);
    }
#pragma unroll
    for (int i = 0; i < kWalkPerLane; ++i) {
      s_f[p.smem.tq + (t * Hs + hs) * kMaxHeadKDim + lane + 32 * i] = q[i];  // zero past K
      const int r = lane + 32 * i;
      if (r < V) s_f[p.smem.oring + (t * Hs + hs) * V + r] = acc[i];
    }
  }
}

/// Phase 2 of a verify window (T >= 2): walk()'s arithmetic, but a lane holds kWalkPerLane
/// contiguous columns: one vector load of a key or value record and one bounds check, instead
/// of kWalkPerLane strided loads each behind its own check (the walks were a quarter of a
/// 4-token window's time). K is a multiple of 16 on this kernel; a V that is not a multiple of
/// kWalkPerLane takes its values element by element. (The single-token kernel keeps walk():
/// the build that used this one everywhere ran some single-token steps slower.)
template <typename input_t>
__device__ __forceinline__ void walk_window(const ReplayParams& p, int hist, int stop,
                                            int h_lo, int h_hi, unsigned char* smem) {
  static_assert(kWalkPerLane == 4 && kWalkPerLane * 32 == kMaxHeadKDim,
                "a warp covers a key row, a lane one float4 of it");
  const StateCacheLayout& l = p.cache;
  const int K = l.dims.cols, V = l.dims.rows, G = p.heads_per_key, T = p.num_tokens;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int c0 = lane * kWalkPerLane;  // this lane's columns c0 .. c0 + kWalkPerLane − 1
  const bool key_lane = c0 < K;
  const bool vec_whole = V % kWalkPerLane == 0 && p.smem.vec_stride % kWalkPerLane == 0;
  float* s_f = reinterpret_cast<float*>(smem);
  const auto [s_alpha, s_beta, s_kscale, s_key, s_vec] = staged_records<input_t>(p, smem);
  using Vec = Packed<input_t, kWalkPerLane>;
  const int nh = h_hi - h_lo + 1, Hs = p.smem.heads;
  for (int id = warp; id < T * nh; id += blockDim.x / 32) {
    const int t = id / nh;
    const int h = h_lo + (id - t * nh);
    const int hs = staged_head(p, h);
    float q[kWalkPerLane], acc[kWalkPerLane] = {};
    {
      const float* qhat = s_f + p.smem.tq + (t * Hs + hs) * kMaxHeadKDim;  // q̂_t, 0 past K
      const float4 v = *reinterpret_cast<const float4*>(qhat + c0);
      q[0] = v.x, q[1] = v.y, q[2] = v.z, q[3] = v.w;
    }
    for (int j = hist + t; j >= stop; --j) {
      float kv[kWalkPerLane] = {};  // k̂_j = to_float(k_j)·scale_j, as the CPU rounds it
      if (key_lane) {
        Vec raw;
        raw.load(s_key + j * K + c0);
        raw.unpack(kv);
        const float key_scale = s_kscale[j];
#pragma unroll
        for (int i = 0; i < kWalkPerLane; ++i) kv[i] *= key_scale;
      }
      float kq = 0.0f;
#pragma unroll
      for (int i = 0; i < kWalkPerLane; ++i) kq += kv[i] * q[i];
      kq = group_sum<32>(kq);
      const float coeff = s_beta[j * G + h] * kq;
      const input_t* vec = s_vec + j * p.smem.vec_stride + hs * V + c0;
      float x[kWalkPerLane] = {};
      if (vec_whole) {
        if (c0 < V) {
          Vec raw;
          raw.load(vec);
          raw.unpack(x);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kWalkPerLane; ++i) {
          if (c0 + i < V) x[i] = to_float(vec[i]);
        }
      }
#pragma unroll
      for (int i = 0; i < kWalkPerLane; ++i) acc[i] += coeff * x[i];
      const float a = s_alpha[j * G + h];
#pragma unroll
      for (int i = 0; i < kWalkPerLane; ++i) q[i] = a * (q[i] - coeff * kv[i]);
    }
    *reinterpret_cast<float4*>(s_f + p.smem.tq + (t * Hs + hs) * kMaxHeadKDim + c0) =
        make_float4(q[0], q[1], q[2], q[3]);
#pragma unroll
    for (int i = 0; i < kWalkPerLane; ++i) {
      if (c0 + i < V) s_f[p.smem.oring + (t * Hs + hs) * V + c0 + i] = acc[i];
    }
  }
}

/// The local value head of row r of a key head's G·V rows (r / V without a division).
__device__ __forceinline__ int value_head(const ReplayParams& p, int r) {
  return p.row_head_magic == 0 ? r : int(__umulhi(std::uint32_t(r), p.row_head_magic));
}

/// Phase 3 for one row (this lane's values s of the read copy, order_t layout): the T outputs
/// o_t[row] = S_read[row]·t_t + ring part, for row v of the value head staged at hs
/// (staged_head). `out` is the row's
/// output of token 0 (token t's is t·Hv·V further). Every lane of the warp must call it (the
/// sums shuffle). With kScatter, verify windows sum tokens in pairs (group_sum8_scatter: half
/// the shuffles), two lanes storing them; in fours it spilled under the 64-register cap.
template <typename input_t, typename order_t, bool kScatter>
__device__ __forceinline__ void emit_outputs(const ReplayParams& p, int hs, int v, input_t* out,
                                             bool active, const float (&s)[kPerLane],
                                             const float* s_f, int lane) {
  const int V = p.cache.dims.rows, Hv = p.cache.dims.heads, Hs = p.smem.heads;
  const int T = p.num_tokens;
  const auto part = [&](int t) {  // this lane's share of S_read[row]·t_t
    float q[kPerLane];
    gather_smem<order_t>(s_f + p.smem.tq + (t * Hs + hs) * kMaxHeadKDim, lane, q);
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) dot += s[i] * q[i];
    return dot;
  };
  const auto store = [&](int t, float dot) {
    out[t * Hv * V] = from_float<input_t>(s_f[p.smem.oring + (t * Hs + hs) * V + v] + dot);
  };
  static_assert(kRowLanes == 8, "group_sum8_scatter sums over 8 lanes");
  int t0 = 0;
  if constexpr (kScatter) {
    for (; t0 + 2 <= T; t0 += 2) {
      const float parts[2] = {part(t0), part(t0 + 1)};
      const float dot = group_sum8_scatter<2>(parts);
      if (active && group_sum8_scatter_stores<2>(lane)) {
        store(t0 + group_sum8_scatter_index<2>(lane), dot);
      }
    }
  }
  for (; t0 < T; ++t0) {
    const float dot = group_sum<kRowLanes>(part(t0));
    if (active && lane == 0) store(t0, dot);
  }
}

/// The tensor-core read of a window of T >= 1 tokens (reads_on_tensor_cores). A lane (g, t) of a
/// warp (lane = 4g + t, mma.cuh) loads, of state rows g and g + 8 of a 16-row tile, the 16-byte
/// vectors j at columns vc·(4j + t) (vc = 8 bf16 or 16 fp8 values a vector): a row's four lanes
/// read 64 contiguous bytes per j. Vector j feeds k-steps j·vc/4 on, 4 columns each: bf16 words 2w
/// and 2w + 1 (fp8: word w, widened to two bf16 pairs) of step j·vc/4 + w hold the pairs at columns
/// vc·(4j + t) + 4w + 2e (e = 0, 1): A's k slots 2t and 2t + 8. A dot product does not care how its
/// columns are ordered, so the queries' fragments (B) only have to hold the same columns in the
/// same slots, which stage_query_fragments arranges.
template <typename read_t>
__device__ __forceinline__ int mma_read_col(int step, int e, int t) {
  constexpr int vc = mma_vector_cols(int(sizeof(read_t))), spv = vc / 4;
  return vc * (4 * (step / spv) + t) + 4 * (step % spv) + 2 * e;
}

/// The walked queries of the window (s_f's tq, fp32) as m16n8k16 B fragments of bf16 hi and
/// lo parts, per local value head, k-step and lane: {b0 hi, b1 hi, b0 lo, b1 lo} with token
/// n = g (zero for g >= T), into the shared memory at p.smem.mma_query.
template <typename read_t>
__device__ __forceinline__ void stage_query_fragments(const ReplayParams& p, int h_lo, int h_hi,
                                                      unsigned char* smem) {
  const int Hs = p.smem.heads, T = p.num_tokens;
  const int steps = mma_read_steps(p.cache.dims.cols, int(sizeof(read_t)));
  const float* s_f = reinterpret_cast<const float*>(smem);
  auto* frags = reinterpret_cast<uint4*>(smem + p.smem.mma_query);
  const int n = (h_hi - h_lo + 1) * steps * 32;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int lane = i % 32, g = lane / 4, t = lane % 4;
    const int step = (i / 32) % steps;
    const int h = staged_head(p, h_lo + i / (32 * steps));
    std::uint32_t hi[2] = {0u, 0u}, lo[2] = {0u, 0u};
    if (g < T) {
      // Past K the walked queries are zero (tq is kMaxHeadKDim wide, zero past K).
      const float* q = s_f + p.smem.tq + (g * Hs + h) * kMaxHeadKDim;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = mma_read_col<read_t>(step, e, t);
        const float x0 = c < kMaxHeadKDim ? q[c] : 0.0f;
        const float x1 = c + 1 < kMaxHeadKDim ? q[c + 1] : 0.0f;
        hi[e] = float2_to_bf16x2(x0, x1);
        const float h0 = __uint_as_float(hi[e] << 16), h1 = __uint_as_float(hi[e] & 0xffff0000u);
        lo[e] = float2_to_bf16x2(x0 - h0, x1 - h1);
      }
    }
    frags[(h * steps + step) * 32 + lane] = make_uint4(hi[0], hi[1], lo[0], lo[1]);
  }
}

/// A's pairs of k-step w of a lane's vector (mma_read_col): slots 2t (first) and 2t + 8.
template <typename read_t>
__device__ __forceinline__ void mma_read_pairs(const uint4& v, int w, std::uint32_t& a0,
                                               std::uint32_t& a2) {
  const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
  if constexpr (std::is_same_v<read_t, bf16_t>) {
    a0 = words[2 * w];
    a2 = words[2 * w + 1];
  } else {
    static_assert(std::is_same_v<read_t, fp8e4m3_t>, "bf16 or fp8 read copies");
    a0 = fp8x2_to_bf16x2(words[w] & 0xffffu);
    a2 = fp8x2_to_bf16x2(words[w] >> 16);
  }
}

/// Phase 3 of a reading step on the tensor cores: o_n[row] = S_read[row]·t_n +
/// the walks' ring part, every token n < T of the rows [row_begin, row_end) of a bf16 or fp8
/// read copy (fp8: the row's scale applied to the product), each warp a 16-row tile at a time
/// (all of it in one value head: V % 16 == 0). Each product is exact in the fp32 accumulator,
/// and hi + lo carries t within 2^-16.
template <typename input_t, CheckpointPrecision P>
__device__ __forceinline__ void read_window_mma(const ReplayParams& p, const CheckpointHead<P>& ck,
                                                int row_begin, int row_end, input_t* out_rows,
                                                const unsigned char* smem) {
  using read_t = typename CheckpointTypes<P>::read_t;
  constexpr int vc = mma_vector_cols(int(sizeof(read_t))), spv = vc / 4;
  constexpr int kVecs = kMaxHeadKDim / (4 * vc);  // 16-byte vectors of a row per lane
  const int K = p.cache.dims.cols, V = p.cache.dims.rows, Hv = p.cache.dims.heads;
  const int Hs = p.smem.heads, T = p.num_tokens;
  const int steps = mma_read_steps(K, int(sizeof(read_t)));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float* s_f = reinterpret_cast<const float*>(smem);
  const auto* frags = reinterpret_cast<const uint4*>(smem + p.smem.mma_query);
  const read_t* rows = ck.read_row(row_begin);
  const int tiles = (row_end - row_begin + 15) / 16;
  for (int tile = warp; tile < tiles; tile += kThreads / 32) {
    const int r0 = row_begin + 16 * tile;
    const int next = r0 + 16 * (kThreads / 32);  // this warp's next tile, into L2 meanwhile
    if (lane == 0 && next < row_end) {
      prefetch_l2(rows + std::int64_t{next - row_begin} * K,
                  std::uint32_t(min(16, row_end - next) * K * int(sizeof(read_t))));
    }
    uint4 a[2][kVecs];  // rows g and g + 8
    float scale[2] = {1.0f, 1.0f};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = r0 + g + 8 * half;
      const read_t* row = rows + std::int64_t{r - row_begin} * K;
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int c = vc * (4 * j + t);
        a[half][j] = r < row_end && c < K
                         ? __ldcs(reinterpret_cast<const uint4*>(row + c))
                         : make_uint4(0u, 0u, 0u, 0u);
      }
      if constexpr (CheckpointTypes<P>::kScaled) {
        if (r < row_end) scale[half] = ck.scale[r];
      }
    }
    const int h = value_head(p, r0);  // the tile's local value head
    const int hs = staged_head(p, h);
    float acc[4] = {};
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j * spv >= steps) break;
#pragma unroll
      for (int w = 0; w < spv; ++w) {
        std::uint32_t fa[4];  // a0 (row g), a1 (row g + 8), a2 (row g), a3 (row g + 8)
        mma_read_pairs<read_t>(a[0][j], w, fa[0], fa[2]);
        mma_read_pairs<read_t>(a[1][j], w, fa[1], fa[3]);
        const uint4 b = frags[(hs * steps + j * spv + w) * 32 + lane];
        mma_bf16(acc, fa, b.x, b.y);
        mma_bf16(acc, fa, b.z, b.w);
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      // Accumulator e: row g + 8·(e / 2) of the tile, token 2t + e % 2 (mma.cuh).
      const int r = r0 + g + 8 * (e / 2);
      const int n = 2 * t + e % 2;
      if (r >= row_end || n >= T) continue;
      const int v = r - h * V;
      out_rows[std::int64_t{n} * Hv * V + r] = from_float<input_t>(
          s_f[p.smem.oring + (n * Hs + hs) * V + v] + acc[e] * scale[e / 2]);
    }
  }
}

/// The query fragments of a staged tensor-core read (stages_on_tensor_cores; token 0, the
/// only one of a single-token step), into the shared memory at p.smem.mma_query: per local
/// value head, k-step and column lane t, the A registers of m16n8k16 rows 0 (the walked
/// query's bf16 hi part) and 8 (its lo part, t − hi): {hi, lo} of columns c, c + 1, then of
/// c + 2, c + 3, with c = 8·(4·(step / 2) + t) + 4·(step % 2), the columns whose state values a
/// lane's 16-byte vector step / 2 holds for that step's B registers (read_staged_mma); then
/// one head's worth of zeros (staged_mma_query_bytes).
__device__ __forceinline__ void stage_step_fragments(const ReplayParams& p, int h_lo, int h_hi,
                                                     unsigned char* smem) {
  const int steps = staged_mma_steps(p.cache.dims.cols);
  const float* s_f = reinterpret_cast<const float*>(smem);
  auto* frags = reinterpret_cast<uint4*>(smem + p.smem.mma_query);
  const int n = (h_hi - h_lo + 1) * steps * 4;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int t = i % 4, step = (i / 4) % steps;
    const int h = staged_head(p, h_lo + i / (4 * steps));
    const float* q = s_f + p.smem.tq + h * kMaxHeadKDim;  // zero past K
    const int c = 8 * (4 * (step / 2) + t) + 4 * (step % 2);
    std::uint32_t w[4];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float x0 = q[c + 2 * e], x1 = q[c + 2 * e + 1];
      const std::uint32_t hi = float2_to_bf16x2(x0, x1);
      const float h0 = __uint_as_float(hi << 16), h1 = __uint_as_float(hi & 0xffff0000u);
      w[2 * e] = hi;
      w[2 * e + 1] = float2_to_bf16x2(x0 - h0, x1 - h1);
    }
    frags[(h * steps + step) * 4 + t] = make_uint4(w[0], w[1], w[2], w[3]);
  }
  for (int i = threadIdx.x; i < steps * 4; i += blockDim.x) {  // the zeros past the heads
    frags[p.smem.heads * steps * 4 + i] = make_uint4(0u, 0u, 0u, 0u);
  }
}

/// One pass of a staged tensor-core read: warp w takes rows base + 8w .. base + 8w + 7, lane
/// (g, t) copying its row's 16-byte vectors 4j + t (j < 4: a bf16 row of up to 128 columns)
/// into its own pieces of `buf`, as the CUDA-core passes do (each lane reads back only what it
/// copied: no barrier). `row` is the lane's row of this pass, `live` whether it is below the
/// end. One cp.async group, empty past the end.
template <typename read_t>
__device__ __forceinline__ void issue_pass_mma(const read_t* row, bool live, int K,
                                               unsigned char* buf) {
  static_assert(sizeof(read_t) == 2, "a bf16 read copy: 8 values a vector");
  const int t = threadIdx.x % 4;
  if (live) {
#pragma unroll
    for (int j = 0; j < kPassPieces; ++j) {
      const int c = 8 * (4 * j + t);
      if (c < K) cp_async_16(buf + 16 * (kThreads * j + int(threadIdx.x)), row + c);
    }
  }
  cp_async_commit();
}

/// Phase 3 of a single-token step over a bf16 read copy, on the tensor cores
/// (stages_on_tensor_cores). The passes stream through the two staged buffers as on the CUDA
/// cores (pass 0 is in buf0 already, issued by issue_pass_mma), 32 rows a pass, 8 a warp: those
/// are the n columns of m16n8k16 products whose A rows 0 and 8 are the walked query's hi and
/// lo parts (stage_step_fragments), so D[0][n] + D[8][n] is row n's product S_read[row]·t,
/// exact in the fp32 accumulator up to hi + lo's 2^-16 of t. The 8 rows of a warp lie in one
/// value head (V % 16 == 0 and passes start at multiples of 8 rows), and rows come in pairs
/// below row_end. kFullRows: K = 128, every piece of a live row copied.
template <bool kFullRows, typename input_t, CheckpointPrecision P>
__device__ __forceinline__ void read_staged_mma(const ReplayParams& p, const CheckpointHead<P>& ck,
                                                int row_begin, int row_end, input_t* out_rows,
                                                unsigned char* buf0, unsigned char* buf1,
                                                const unsigned char* smem) {
  using read_t = typename CheckpointTypes<P>::read_t;
  constexpr int kPassRows = 8 * kWarps;
  const int K = kFullRows ? kMaxHeadKDim : p.cache.dims.cols;
  const int V = p.cache.dims.rows, G = p.heads_per_key, Hs = p.smem.heads;
  const int steps = staged_mma_steps(K);
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float* s_f = reinterpret_cast<const float*>(smem);
  // Lanes g > 0 read their (zero) A registers from the zero fragments past the staged heads'.
  const auto* frags = reinterpret_cast<const uint4*>(smem + p.smem.mma_query) +
                      (g == 0 ? t : Hs * steps * 4 + t);
  const int first = row_begin + 8 * int(threadIdx.x / 32);  // this warp's rows of pass 0
  const read_t* lane_row = ck.read_row(min(first + g, row_end - 1));
  const std::int64_t pass_elems = std::int64_t{kPassRows} * K;
  issue_pass_mma(lane_row + pass_elems, first + kPassRows + g < row_end, K, buf1);
  int pass = 0;
  for (int base = row_begin; base < row_end; base += kPassRows, ++pass, lane_row += pass_elems) {
    unsigned char* const buf = pass & 1 ? buf1 : buf0;
    const int unit = base + 8 * int(threadIdx.x / 32);  // this warp's first row
    cp_async_wait<1>();
    // Pieces of rows past the end are stale but only feed their own (unstored) columns;
    // those past K would meet the query's zeros, so they are zeroed.
    uint4 v[kPassPieces];
#pragma unroll
    for (int j = 0; j < kPassPieces; ++j) {
      v[j] = kFullRows || 8 * (4 * j + t) < K
                 ? *reinterpret_cast<const uint4*>(buf + 16 * (kThreads * j + int(threadIdx.x)))
                 : make_uint4(0u, 0u, 0u, 0u);
    }
    const int h = min(value_head(p, unit), G - 1);  // past the end: any head, nothing stored
    const int hs = staged_head(p, h);
    const uint4* f = frags + hs * steps * 4 * (g == 0);
    float acc[4] = {};
#pragma unroll
    for (int step = 0; step < 2 * kPassPieces; ++step) {
      if (!kFullRows && step >= steps) break;
      const uint4 q = f[step * 4];
      const std::uint32_t a[4] = {q.x, q.y, q.z, q.w};
      const uint4& x = v[step / 2];
      if (step % 2 == 0) {
        mma_bf16(acc, a, x.x, x.y);
      } else {
        mma_bf16(acc, a, x.z, x.w);
      }
    }
    // The products used the registers read from buf, so it takes the pass two ahead.
    issue_pass_mma(lane_row + 2 * pass_elems, unit + 2 * kPassRows + g < row_end, K, buf);
    const int r = unit + 2 * t;  // D[0][2t + e] + D[8][2t + e]: rows r and r + 1
    if (g == 0 && r < row_end) {  // the ring part of token 0's output: oring + row
      const float2 ring =
          *reinterpret_cast<const float2*>(s_f + p.smem.oring + r - (h - hs) * V);
      Packed<input_t, 2> out;
      out.pack({ring.x + acc[0] + acc[2], ring.y + acc[1] + acc[3]});
      out.store(out_rows + r);
    }
  }
}

/// kWindow: the instantiation for verify windows (T >= 2), with their own walk and output sums.
template <typename input_t, CheckpointPrecision P, bool kConv, bool kWindow>
__global__ void __launch_bounds__(kThreads, kReplayMinBlocks)
    gdn_replay_kernel(const __grid_constant__ ReplayParams p) {
  using Traits = CheckpointTypes<P>;
  using read_t = typename Traits::read_t;
  using master_t = typename Traits::master_t;
  extern __shared__ __align__(16) unsigned char smem[];
  grid_dependency_wait();
  allow_dependents();
  const StateCacheLayout& l = p.cache;
  const int K = l.dims.cols, V = l.dims.rows, G = p.heads_per_key, T = p.num_tokens;
  const int hk = blockIdx.x / p.tiling.splits;
  const int split = blockIdx.x - hk * p.tiling.splits;
  const int layer = p.layer + int(blockIdx.z);  // z > 0 only for folds of several layers
  const int b = p.fold_first
                    ? fold_first_row(l, p.in.slot_ids, int(gridDim.y), layer, T, int(blockIdx.y))
                    : int(blockIdx.y);
  const int slot = slot_in_range(l, p.in.slot_ids, b);
  if (slot < 0) return;  // pad row or bad id: nothing read or written
  const int group_rows = G * V;
  const int row_begin = split * p.tiling.rows_per_split;
  const int row_end = min(group_rows, row_begin + p.tiling.rows_per_split);
  // Never taken (row_tiling leaves no split empty), so every CTA of a folding row arrives.
  if (row_begin >= row_end) return;
  const int lane = threadIdx.x % kRowLanes;
  const int rg = threadIdx.x / kRowLanes;
  // Rows of the key head's G value heads are contiguous: row r of head hk·G + r / V.
  const CheckpointHead<P> ck(l, layer, slot, hk * G);

  // The first pass of this CTA's read copy is requested before anything else is known: the
  // cursors, the ring staging and the walks (a chain of ~3 dependent memory round trips and w
  // shuffle reductions) then run while it is in flight. On a fold step the prefetch is dropped
  // (dual precision reads the master instead); reading a free slot's rows is harmless, and
  // they are never used. See kThreads for what this is worth and what bounds the step.
  constexpr int kRows = kOutputRows<read_t>;
  using Frag = typename Split::template Fragment<read_t>;
  constexpr int kChunks = kPerLane / Frag::kVecN;
  static_assert(kRows * kChunks == kPassPieces, "a pass is kPassPieces 16-byte pieces a thread");
  // Staged passes (stages_passes) stream through shared memory (cp.async): the next pass is
  // in flight while this one's rows are summed, and no registers hold it.
  constexpr bool kStagedPasses = stages_passes(P, kWindow);
  static_assert(!(kStagedPasses && Traits::kScaled), "an fp8 row's scale is not staged");
  Frag f[kRows];
  float scale[kRows];
  // A pass reads rows base + rg + u·kRowGroups; this thread's first row and the strides are
  // computed once (the index arithmetic per row was as many instructions as the row's loads).
  const read_t* rows = ck.read_row(row_begin + rg);
  const auto load_pass = [&](int base) {
    const read_t* at = rows + std::int64_t{base - row_begin} * K;
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int r = base + rg + u * kRowGroups;
      scale[u] = 1.0f;
      if (r < row_end) {
        load_cols<CacheOp::kStreaming>(f[u], at + u * kRowGroups * K, lane, K);
        if constexpr (Traits::kScaled) scale[u] = ck.scale[r];
      } else {
        f[u] = {};
      }
    }
  };
  // A staged pass: piece (u, k) of thread i at 16·(kThreads·(u·kChunks + k) + i), so that a
  // warp's reads of one piece are 512 contiguous bytes (no bank conflicts). Each thread reads
  // back only what it copied itself, so no barrier is needed, only its own cp.async groups:
  // one committed per pass, empty past the end.
  const auto piece_at = [&](unsigned char* buf, int u, int k) {
    return buf + 16 * (kThreads * (u * kChunks + k) + int(threadIdx.x));
  };
  const auto issue_pass = [&](int base, unsigned char* buf) {
    const read_t* at = rows + std::int64_t{base - row_begin} * K;
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      if (base + rg + u * kRowGroups >= row_end) continue;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        const int c = (k * kRowLanes + lane) * Frag::kVecN;
        if (c < K) cp_async_16(piece_at(buf, u, k), at + u * kRowGroups * K + c);
      }
    }
    cp_async_commit();
  };
  const auto read_pass = [&](int base, unsigned char* buf) {
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const bool row = base + rg + u * kRowGroups < row_end;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        const int c = (k * kRowLanes + lane) * Frag::kVecN;
        if (row && c < K) {
          f[u].chunk[k].load(reinterpret_cast<const read_t*>(piece_at(buf, u, k)));
        } else {
          f[u].chunk[k] = {};
        }
      }
    }
  };
  unsigned char* const pass_buf0 = smem + p.smem.pass[0];
  unsigned char* const pass_buf1 = smem + p.smem.pass[1];
  // A tensor-core read (read_window_mma) loads its rows in its own layout: the first tile of
  // each warp is requested into L2 instead.
  constexpr bool kTcRead = reads_on_tensor_cores(P, kWindow);
  // A staged tensor-core read (read_staged_mma) streams the same passes in its own layout.
  constexpr bool kStagedMma = kStagedPasses && stages_on_tensor_cores(P, kWindow, kConv);
  const bool tc_read = (kTcRead || kStagedMma) && p.tc_read;
  if (T > 0) {
    if (kStagedMma && tc_read) {
      if constexpr (kStagedMma) {  // issue_pass_mma exists for bf16 read copies only
        const int r = row_begin + int(threadIdx.x / 4);  // read_staged_mma's rows of pass 0
        issue_pass_mma(ck.read_row(min(r, row_end - 1)), r < row_end, K, pass_buf0);
      }
    } else if (tc_read) {
      if (threadIdx.x == 0) {
        prefetch_l2(ck.read_row(row_begin),
                    std::uint32_t(min(kThreads / 2, row_end - row_begin) * K *
                                  int(sizeof(read_t))));
      }
    } else if constexpr (kStagedPasses) {
      issue_pass(row_begin, pass_buf0);
    } else {
      load_pass(row_begin);
    }
  }
  // Where it pays (gdn_params.cuh, kL2PrefetchPasses: register passes of an fp32 read copy),
  // the passes after it are requested into L2 ahead of their loads, l2_passes ahead, by one
  // thread.
  constexpr int kPassRows = kRowGroups * kRows;
  const auto prefetch_pass = [&](int base) {
    if (threadIdx.x == 0 && base < row_end) {
      prefetch_l2(ck.read_row(base),
                  std::uint32_t(min(kPassRows, row_end - base) * K * int(sizeof(read_t))));
    }
  };
  for (int m = 1; m <= p.l2_passes; ++m) prefetch_pass(row_begin + m * kPassRows);

  // Cursors, all three loads in flight together.
  const bool allocated = slot_allocated(l, slot);
  const std::uint32_t committed = l.committed[slot];
  const FoldCursor cursor =
      fold_cursor(l, fold_cursor_load(l, layer, slot), committed, T);
  if (!allocated) {  // a free slot: nothing written
    cp_async_wait_all();  // the first pass's copies land before the block's memory is freed
    return;
  }
  const std::uint32_t first = cursor.first;
  const std::uint32_t unfolded_count = cursor.unfolded;
  const bool fold = cursor.fold;
  if (T == 0 && !fold) return;
  // Clamped so that corrupt cursors cannot index past the staging (cache.cuh).
  const int hist = int(min(unfolded_count, std::uint32_t(l.max_history())));
  const int h_lo = row_begin / V, h_hi = (row_end - 1) / V;

  // Phase 1.
  stage_history<input_t>(p, layer, slot, hk, first, hist, h_lo, h_hi, smem);
  if (T > 0) {
    stage_window<input_t, kConv>(p, layer, slot, hk, b, committed, hist, h_lo, h_hi,
                                 split == 0, smem);
  }
  if (T > 0 && hk == 0 && split == 0 && threadIdx.x == 0) {
    l.pending[l.layer_slot(layer, slot)] = static_cast<std::uint8_t>(T);
  }
  cp_async_wait_all();
  __syncthreads();

  // Phase 2.
  if (T > 0) {
    if constexpr (kWindow) {
      walk_window<input_t>(p, hist, fold ? hist : 0, h_lo, h_hi, smem);
    } else {
      walk<input_t>(p, hist, fold ? hist : 0, h_lo, h_hi, smem);
    }
    __syncthreads();
  }

  // Phase 3.
  const float* s_f = reinterpret_cast<const float*>(smem);
  // This CTA's outputs (token 0) as rows of its key head: [batch, T, Hv, V] at (b, 0, hk·G).
  input_t* out_rows =
      T > 0 ? static_cast<input_t*>(p.in.o) + (std::int64_t{b} * T * l.dims.heads + hk * G) * V
            : nullptr;
  if (!fold) {
    if constexpr (kTcRead) {
      if (tc_read) {
        stage_query_fragments<read_t>(p, h_lo, h_hi, smem);  // over the records, dead now
        __syncthreads();
        read_window_mma<input_t, P>(p, ck, row_begin, row_end, out_rows, smem);
        return;
      }
    }
    if constexpr (kStagedMma) {
      if (tc_read) {
        stage_step_fragments(p, h_lo, h_hi, smem);
        __syncthreads();
        if (K == kMaxHeadKDim) {
          read_staged_mma<true, input_t, P>(p, ck, row_begin, row_end, out_rows, pass_buf0,
                                            pass_buf1, smem);
        } else {
          read_staged_mma<false, input_t, P>(p, ck, row_begin, row_end, out_rows, pass_buf0,
                                             pass_buf1, smem);
        }
        return;
      }
    }
    // One pass per CTA at the host's tiling; the loop bound is the same for the whole block
    // (base, not a lane's own row): the row reductions shuffle over full warps, so a lane
    // whose rows lie past the end still runs the pass, on zeros.
    // Staged: pass 0 has landed (the staging's wait); pass 1 goes to the second buffer now that
    // the walks are done with the records under it, and each pass's buffer takes the pass two
    // ahead once its rows are summed (the sums used the registers read from it, so those
    // reads are complete).
    if constexpr (kStagedPasses) issue_pass(row_begin + kPassRows, pass_buf1);
    int pass = 0;
    for (int base = row_begin; base < row_end; base += kPassRows, ++pass) {
      unsigned char* const buf = pass & 1 ? pass_buf1 : pass_buf0;
      if constexpr (kStagedPasses) {
        cp_async_wait<1>();
        read_pass(base, buf);
      } else if (base != row_begin) {
        load_pass(base);
        if (p.l2_passes > 0) prefetch_pass(base + p.l2_passes * kPassRows);
      }
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        const int r = base + rg + u * kRowGroups;
        float s[kPerLane];
        unpack_frag(f[u], s);
        if constexpr (Traits::kScaled) {
#pragma unroll
          for (int i = 0; i < kPerLane; ++i) s[i] = __fmul_rn(s[i], scale[u]);
        }
        const int h = min(value_head(p, r), G - 1);  // past the end: any head, nothing stored
        // pairs spilled with an fp8 read copy (ptxas, sm_90)
        constexpr bool kPairs = kWindow && sizeof(read_t) > 1;
        emit_outputs<input_t, read_t, kPairs>(p, staged_head(p, h), r - h * V, out_rows + r,
                                              r < row_end, s, s_f, lane);
      }
      if constexpr (kStagedPasses) issue_pass(base + 2 * kPassRows, buf);
    }
    return;
  }

  // Phase 3': fold, then (decode) the outputs from the refreshed read copy.
  const auto [s_alpha, s_beta, s_kscale, s_key, s_vec] = staged_records<input_t>(p, smem);
  using MasterFrag = typename Split::template Fragment<master_t, read_t>;
  // Folds in pairs (fold_pairs): the raw keys' products k_j·k_{j+1} of each pair, once per CTA.
  float* const s_pair_dot = reinterpret_cast<float*>(smem) + p.smem.pair_dot;
  const bool pairs = p.fold_pairs;
  if (pairs) {
    const int warp = threadIdx.x / 32, wl = threadIdx.x % 32;
    for (int j = 2 * warp; j + 1 < hist; j += 2 * kWarps) {
      float acc = 0.0f;
      for (int c = wl; c < K; c += 32) {
        acc += to_float(s_key[j * K + c]) * to_float(s_key[(j + 1) * K + c]);
      }
      acc = group_sum<32>(acc);
      if (wl == 0) s_pair_dot[j] = acc;
    }
    __syncthreads();
  }
  for (int base = row_begin; base < row_end; base += kFoldPassRows) {
    const int r0 = base + rg;
    // A fold's next pass of the master, likewise (its replay of the history hides the wait).
    if (p.l2_passes > 0 && threadIdx.x == 0 && base + kFoldPassRows < row_end) {
      const int next = base + kFoldPassRows;
      prefetch_l2(ck.master_row(next),
                  std::uint32_t(min(kFoldPassRows, row_end - next) * K * int(sizeof(master_t))));
    }
    float s[kFoldRows][kPerLane];
    // Each row's local value head and its staged v (staged_head): the replay reads only
    // these; the row itself is derived again for the stores, so that no third index per row
    // is live across it (one more each raised the spills under the 64-register cap).
    int vrow[kFoldRows], h[kFoldRows];
#pragma unroll
    for (int u = 0; u < kFoldRows; ++u) {
      const int row = min(r0 + u * kRowGroups, row_end - 1);
      h[u] = value_head(p, row);
      vrow[u] = row - (h[u] - staged_head(p, h[u])) * V;
      MasterFrag m;
      if (r0 + u * kRowGroups < row_end) {
        load_cols<CacheOp::kStreaming>(m, ck.master_row(row), lane, K);
      } else {
        m = {};
      }
      unpack_frag(m, s[u]);
    }
    // Exact alternative, measured and not kept: carrying the row as s = Γ·ŝ (Γ the decay
    // product) saves the per-token s ← α·s (2 instead of 3 ops per element and token, as the
    // CPU fold once did), but Γ and 1/Γ per row raised the spills under the 64-register cap
    // (28 → 60 bytes) and the step got slower: qwen35-4b, batch 256, L = 16, fp32 / bf16 /
    // fp32+bf16: 193.0 / 146.1 / 148.6 µs against 189.7 / 145.0 / 143.0; spec T = 4: 407.7
    // against 383.0 (docs/BENCHMARKS_CUDA_GDN.md, "Tuning"). The CPU fold now uses the chunk
    // form (cpu/fold.cpp), the candidate here too (docs/BENCHMARKS.md, what bounds replay).
    int j = 0;
    // Two records a round (fold_pairs): with s' = α_j·s + d_j·k_j, the second record's product
    // is α_{j+1}·(α_j·(s·k_{j+1}) + d_j·(k_j·k_{j+1})), so both products s·k_j and s·k_{j+1}
    // are summed from the same s at once and the row is updated once, s ← α_j·α_{j+1}·s +
    // α_{j+1}·d_j·k_j + d_{j+1}·k_{j+1}: one chain of sums across the row's lanes per pair
    // where the record-by-record fold has one per record. Exact up to rounding order.
    // This lane's share of s·k_rec (raw key) for each of its rows.
    const auto lane_products = [&](int rec, float (&dot)[kFoldRows]) {
      float key[kPerLane];
      gather_key<read_t>(s_key + rec * K, lane, K, key);
#pragma unroll
      for (int u = 0; u < kFoldRows; ++u) {
        dot[u] = 0.0f;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) dot[u] += s[u][i] * key[i];
      }
    };
    for (; pairs && j + 2 <= hist; j += 2) {
      float dot0[kFoldRows], dot1[kFoldRows];
      lane_products(j, dot0);
      lane_products(j + 1, dot1);
      const float ks0 = s_kscale[j], ks1 = s_kscale[j + 1], kk = s_pair_dot[j];
      float decay[kFoldRows], c0[kFoldRows], c1[kFoldRows];
#pragma unroll
      for (int u = 0; u < kFoldRows; ++u) {
        const float p0 = group_sum<kRowLanes>(dot0[u]), p1 = group_sum<kRowLanes>(dot1[u]);
        const float a0 = s_alpha[j * G + h[u]], a1 = s_alpha[(j + 1) * G + h[u]];
        const float x0 = to_float(s_vec[j * p.smem.vec_stride + vrow[u]]);
        const float x1 = to_float(s_vec[(j + 1) * p.smem.vec_stride + vrow[u]]);
        const float d0 = s_beta[j * G + h[u]] * (x0 - a0 * p0 * ks0) * ks0;
        const float q1 = (a1 * (a0 * p1 + d0 * kk)) * ks1;
        const float d1 = s_beta[(j + 1) * G + h[u]] * (x1 - q1) * ks1;
        decay[u] = a0 * a1;
        c0[u] = a1 * d0;
        c1[u] = d1;
      }
      // The keys are gathered again rather than kept from lane_products: both held across the
      // sums would be 32 more registers under the 64-register cap.
      float key[kPerLane];
      gather_key<read_t>(s_key + j * K, lane, K, key);
#pragma unroll
      for (int u = 0; u < kFoldRows; ++u) {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) s[u][i] = s[u][i] * decay[u] + c0[u] * key[i];
      }
      gather_key<read_t>(s_key + (j + 1) * K, lane, K, key);
#pragma unroll
      for (int u = 0; u < kFoldRows; ++u) {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) s[u][i] += c1[u] * key[i];
      }
    }
    for (; j < hist; ++j) {
      // k̂_j = scale_j·k_j with the scale taken into the row's two scalars (s·k̂ = scale·(s·k),
      // d·k̂ = (d·scale)·k): the same fp32 arithmetic as the CPU's up to rounding order, and
      // no per-element product: scaling the 16 gathered values doubled the kernel's spills
      // under the 80-register cap (ptxas, sm_90: 12 → 24 bytes with an fp8 copy; this: 16).
      float key[kPerLane];
      gather_key<read_t>(s_key + j * K, lane, K, key);
      const float key_scale = s_kscale[j];
#pragma unroll
      for (int u = 0; u < kFoldRows; ++u) {
        const float a = s_alpha[j * G + h[u]];
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          s[u][i] *= a;
          dot += s[u][i] * key[i];
        }
        dot = group_sum<kRowLanes>(dot) * key_scale;
        const float x = to_float(s_vec[j * p.smem.vec_stride + vrow[u]]);
        const float d = s_beta[j * G + h[u]] * (x - dot) * key_scale;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) s[u][i] += d * key[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kFoldRows; ++u) {
      const bool active = r0 + u * kRowGroups < row_end;
      const int hs = staged_head(p, h[u]);
      const int row = vrow[u] + (h[u] - hs) * V;
      checkpoint_store_cols<P, read_t>(ck, row, lane, active, K, s[u]);
      if (T > 0) {
        emit_outputs<input_t, read_t, false>(p, hs, row - h[u] * V, out_rows + row, active,
                                             s[u], s_f, lane);
      }
    }
  }
  // Every thread read `folded` before the staging barrier.
  if (threadIdx.x == 0) fold_cursor_arrive(l, layer, slot, committed, gridDim.x);
}

/// Whether a decode of `num_tokens` takes the verify-window instantiation: windows (T >= 2) of a
/// cache without conv (conv caches take their own for every T). launch() picks the kernel by
/// it and replay_smem() sizes that kernel's shared memory by it.
bool takes_window_kernel(bool conv, int num_tokens) { return !conv && num_tokens >= 2; }
/// Whether such a decode reads on the tensor cores (REPLAYSSM_TUNE_GDN_TC_READ aside): a
/// precision and kernel that have the code (reads_on_tensor_cores directly,
/// stages_on_tensor_cores through the staged passes), and value heads of whole 16-row tiles.
bool tc_read_fits(CheckpointPrecision p, bool window, bool conv, int head_v_dim) {
  return (reads_on_tensor_cores(p, window) || stages_on_tensor_cores(p, window, conv)) &&
         head_v_dim % 16 == 0;
}

/// Whether the ring's v records of a key head's value heads are 16-byte aligned runs, which
/// stage_history copies with cp.async.
bool vec_records_async(const StateCacheConfig& c) {
  const StateDims d = c.dims();
  const std::int64_t head = std::int64_t{d.rows} * dtype_size(c.input_dtype);
  return head * d.heads_per_key() % 16 == 0 && head * d.heads % 16 == 0;
}

/// The value heads a CTA of tiling `t` could stage (ReplaySmem::heads): where every split's
/// rows are an aligned run of a power of two of whole heads, or lie in one head, that many
/// (staged_head), if the cache can stage head by head: a plain cache (a conv cache convolves
/// every head's channels) whose v records of one head are whole 16-byte vectors
/// (stage_history). Else all G.
int split_heads(const StateCacheConfig& c, bool conv, const RowTiling& t) {
  const StateDims d = c.dims();
  const int G = d.heads_per_key(), V = d.rows, R = t.rows_per_split;
  const std::int64_t head_bytes = std::int64_t{V} * dtype_size(c.input_dtype);
  if (t.splits == 1 || conv || !vec_records_async(c) || head_bytes % 16 != 0) return G;
  const int heads = R % V == 0 ? R / V : V % R == 0 ? 1 : G;
  return heads < G && (heads & (heads - 1)) == 0 ? heads : G;
}

template <typename input_t, CheckpointPrecision P>
Status launch(ReplayParams p, int batch, int num_layers, cudaStream_t stream) {
  using read_t = typename CheckpointTypes<P>::read_t;
  const int group_rows = p.heads_per_key * p.cache.dims.rows;
  if (group_rows >= (1 << 16)) {  // value_head's multiply-high is exact below 2^16 rows
    return unsupported("gdn CUDA replay takes fewer than 65536 value rows per key head, got " +
                       std::to_string(group_rows));
  }
  DeviceLimits limits;
  REPLAYSSM_RETURN_IF_ERROR(device_limits(&limits));
  static const int fold_first_min_batch =
      tuning_value("REPLAYSSM_TUNE_FOLD_FIRST_MIN_BATCH", kFoldFirstMinBatch);
  const bool conv = p.in.conv.in != nullptr;
  const bool window_kernel = takes_window_kernel(conv, p.num_tokens);
  const ReplayStaging staging = replay_staging(p.cache.config, batch, p.num_tokens, conv, limits);
  p.tiling = staging.tiling;
  p.smem = replay_smem(p.cache.config, p.num_tokens, staging.heads);
  // REPLAYSSM_TUNE_GDN_SMEM_PAD: unused bytes added to each CTA's shared memory, so that an
  // A/B run can hold fewer CTAs an SM with the same kernel.
  static const int smem_pad = tuning_value("REPLAYSSM_TUNE_GDN_SMEM_PAD", 0);
  p.smem.bytes += std::max(0, smem_pad);
  p.fold_first = use_fold_first(batch, p.num_tokens, fold_first_min_batch);
  static const int l2_passes = tuning_value("REPLAYSSM_TUNE_GDN_L2_PASSES", kL2PrefetchPasses);
  static const int l2_min_batch =
      tuning_value("REPLAYSSM_TUNE_GDN_L2_MIN_BATCH", kL2PrefetchMinBatch);
  static const bool tc_read = tuning_value("REPLAYSSM_TUNE_GDN_TC_READ", 1) != 0;
  static const int staged_mma_min_batch =
      tuning_value("REPLAYSSM_TUNE_GDN_STAGED_MMA_MIN_BATCH", kStagedMmaMinBatch);
  p.tc_read = tc_read && tc_read_fits(P, window_kernel, conv, p.cache.dims.rows) &&
              (!stages_on_tensor_cores(P, window_kernel, conv) || batch >= staged_mma_min_batch);
  // REPLAYSSM_TUNE_GDN_FOLD_PAIRS: 0 never, 1 the rule (folds_in_pairs), 2 every fold.
  static const int fold_pairs = tuning_value("REPLAYSSM_TUNE_GDN_FOLD_PAIRS", 1);
  p.fold_pairs = fold_pairs == 2 || (fold_pairs == 1 && folds_in_pairs(window_kernel, batch));
  p.l2_passes = std::is_same_v<read_t, float> && batch >= l2_min_batch &&
                        !stages_passes(P, window_kernel)
                    ? l2_passes
                    : 0;
  const int blocks_per_row = p.cache.dims.key_heads * p.tiling.splits;
  if (blocks_per_row > kMaxFoldBlocks) {
    return unsupported("gdn CUDA replay runs up to " + std::to_string(kMaxFoldBlocks) +
                       " blocks per batch row, got " + std::to_string(blocks_per_row));
  }
  const dim3 grid(blocks_per_row, batch, num_layers);
  // Conv caches' decodes take their own instantiation, so that the plain one is unchanged; so
  // do verify windows of plain caches (T >= 2: their walks and sums, tuned for windows).
  auto kernel = p.in.conv.in != nullptr ? gdn_replay_kernel<input_t, P, true, false>
                : window_kernel         ? gdn_replay_kernel<input_t, P, false, true>
                                        : gdn_replay_kernel<input_t, P, false, false>;
  REPLAYSSM_RETURN_IF_ERROR(allow_dynamic_smem(kernel, p.smem.bytes, "gdn_replay_kernel"));
  return launch_programmatic(kernel, grid, dim3(kThreads), p.smem.bytes, stream, p,
                             "gdn_replay_kernel");
}

}  // namespace

ReplaySmem replay_smem(const StateCacheConfig& c, int num_tokens) {
  return replay_smem(c, num_tokens, c.dims().heads_per_key());
}

ReplaySmem replay_smem(const StateCacheConfig& c, int num_tokens, int heads) {
  const StateDims d = c.dims();
  const bool conv = c.conv_kernel > 0;
  const bool window = takes_window_kernel(conv, num_tokens);
  const bool staged = num_tokens > 0 && stages_passes(c.checkpoint, window);
  const int G = d.heads_per_key();
  int query_bytes = 0;
  if (tc_read_fits(c.checkpoint, window, conv, d.rows)) {
    query_bytes =
        stages_on_tensor_cores(c.checkpoint, window, conv)
            ? staged_mma_query_bytes(heads, d.cols)
            : mma_query_bytes(heads, d.cols, checkpoint_traits(c.checkpoint).read_bytes());
  }
  return ReplaySmem::make(num_tokens, G, heads, d.cols, d.rows,
                          max_history(c.buffer_len, c.max_spec_tokens) + num_tokens,
                          static_cast<int>(dtype_size(c.input_dtype)), conv,
                          staged ? kReplayPassBytes : 0, query_bytes);
}

ReplayStaging replay_staging(const StateCacheConfig& c, int batch, int num_tokens, bool conv,
                             const DeviceLimits& limits) {
  static const int min_splits = tuning_value("REPLAYSSM_TUNE_GDN_MIN_SPLITS", kMinRowSplits);
  static const int ctas_per_sm =
      tuning_value("REPLAYSSM_TUNE_GDN_CTAS_PER_SM", kReplayMinBlocks);
  static const int split_rows = tuning_value("REPLAYSSM_TUNE_GDN_SPLIT_ROWS", kSplitRows);
  static const int floor = tuning_value("REPLAYSSM_TUNE_GDN_RESIDENT", kReplayResidentFloor);
  // 0: every CTA stages all G; 1: the rule; 2: a split's heads wherever the tiling allows.
  static const int split_mode = tuning_value("REPLAYSSM_TUNE_GDN_SPLIT_HEADS", 1);
  const StateDims d = c.dims();
  const int G = d.heads_per_key();
  // A read pass: kOutputRows rows of the read copy per thread.
  const int pass_rows =
      kRowGroups * (kReplayRowBytes / (kPerLane * checkpoint_traits(c.checkpoint).read_bytes()));
  const auto tiling_of = [&](int splits_at_least) {
    return row_tiling(batch, d.key_heads, G * d.rows,
                      split_granule(pass_rows, split_rows, kRowGroups), limits.sms, ctas_per_sm,
                      std::max(min_splits, splits_at_least));
  };
  // CTAs of `heads` staged that an SM holds: its shared memory's share, the registers' at most.
  const auto resident_of = [&](int heads) {
    const int bytes = replay_smem(c, num_tokens, heads).bytes + limits.smem_reserved;
    return std::min(kReplayMinBlocks, limits.smem_per_sm / bytes);
  };
  ReplayStaging s{tiling_of(1), G};
  if (split_mode == 0) return s;
  const bool crowded = split_mode == 1 && resident_of(G) < floor;
  // The next split count that stages fewer heads (counts whose splits are not aligned runs of
  // heads are skipped), until the row tiling splits no further.
  for (RowTiling at = s.tiling; crowded && resident_of(split_heads(c, conv, s.tiling)) < floor;) {
    const RowTiling finer = tiling_of(at.splits + 1);
    if (finer.splits <= at.splits) break;
    at = finer;
    if (split_heads(c, conv, finer) < split_heads(c, conv, s.tiling)) s.tiling = finer;
  }
  const int heads = split_heads(c, conv, s.tiling);
  const std::int64_t ctas = std::int64_t{batch} * d.key_heads * s.tiling.splits;
  const bool one_wave = ctas <= std::int64_t{limits.sms} * resident_of(heads);
  const bool window = takes_window_kernel(conv, num_tokens);
  if (split_mode == 2 || crowded || window || one_wave) s.heads = heads;
  return s;
}

Status launch_replay(StateCacheLayout& l, const ReplayWork& work, cudaStream_t stream) {
  const StateCacheConfig& c = l.config;
  ReplayParams p;
  p.cache = l;
  p.heads_per_key = l.dims.heads / l.dims.key_heads;
  const int K = l.dims.cols, V = l.dims.rows;
  p.row_head_magic = V > 1 ? std::uint32_t(((std::uint64_t{1} << 32) + V - 1) / V) : 0u;
  const int batch = work.batch;
  p.layer = work.first_layer;
  if (work.decode != nullptr) {
    p.num_tokens = work.decode->num_tokens;
    p.in = input_args(*work.decode, K);
  } else {
    p.num_tokens = 0;
    p.in.slot_ids = work.slot_ids;
  }
  const int T = p.num_tokens;
  const int num_layers = T > 0 ? 1 : work.num_layers;
  p.records = max_history(c.buffer_len, c.max_spec_tokens) + T;
  p.vec_async = vec_records_async(c);

  return ActivationDTypes::dispatch(c.input_dtype, "input dtype", [&](auto in) {
    using input_t = dtype_t<in.value>;
    return CheckpointPrecisions::dispatch(c.checkpoint, "checkpoint precision", [&](auto ck) {
      return launch<input_t, ck.value>(p, batch, num_layers, stream);
    });
  });
}

}  // namespace replayssm::cuda::gdn
