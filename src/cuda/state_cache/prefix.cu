// The prefix ops on a CUDA cache (include/replayssm/prefix.h, src/prefix_backend.h).
//
//   materialize   one block per (head, layer, pair), a warp per pair of state rows: the rows of
//                 the checkpoint's master copy in registers, the records folded..p-1 applied in
//                 order (their keys and this head's inputs staged in shared memory, 32 records
//                 at a time), the fp32 rows written out: one read of the master and of the
//                 records, one state write.
//   fork          the checkpoint copies of every layer, the records folded..p-1, then the
//                 cursors (a launch of their own, after every copy has read the source's).
//   truncate      a cursor move per row.
//   read_records,
//   restore       per slot: the records gathered or scattered, the checkpoint copies written
//                 from fp32 rows as a fold writes them (common/checkpoint_rows.h's write_row,
//                 element for element), so a restored CUDA slot holds the bytes a CPU one does.
// Nothing here allocates or synchronises except restore's finiteness check (one flag read
// back), so materialize, fork and truncate can be captured in a CUDA graph.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#include "backend.h"
#include "common/numeric.h"
#include "cuda/common/cache.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/dispatch.cuh"
#include "cuda/common/stream.cuh"
#include "cuda/common/vec.cuh"
#include "prefix_backend.h"

namespace replayssm::cuda {

namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarps = 8;  // rows a block works on at once, one per warp
constexpr int kThreads = kWarps * 32;
/// A state row lives in registers, kMaxPerLane columns a lane: up to 128 columns, every target
/// model's (Mamba-2 dstate, GDN head_k_dim). With 256 the GDN kernel spilled at 64 registers.
constexpr int kMaxPerLane = 4;
constexpr int kMaxCols = 32 * kMaxPerLane;
/// Records staged in shared memory at a time: one per lane of a warp.
constexpr int kRecordChunk = 32;
constexpr int kCursorThreads = 256;

int blocks_for(std::int64_t items, int threads) {
  return static_cast<int>((items + threads - 1) / threads);
}

// What the launches over (layer, row) grids check on the host: the grid's y and z axes, and
// for the kernels that hold state rows in registers (`rows_in_registers`) the row width.
Status check_grid(const StateCacheLayout& l, int batch, const char* op, bool rows_in_registers) {
  if (batch > 65535 || l.config.num_layers > 65535) {
    return unsupported(std::string(op) + " on CUDA takes at most 65535 rows and layers per call");
  }
  if (rows_in_registers && l.dims.cols > kMaxCols) {
    return unsupported(std::string(op) + " on CUDA takes states of up to " +
                       std::to_string(kMaxCols) + " columns; this cache's have " +
                       std::to_string(l.dims.cols));
  }
  return Status::ok();
}

// `bytes` from src to dst by `workers` threads (this one is `worker`): in 16-byte words when
// both ends and the size allow it (every run of the target shapes), else 4 or 1.
__device__ __forceinline__ void copy_run(char* dst, const char* src, std::int64_t bytes,
                                         std::int64_t worker, std::int64_t workers) {
  const auto bits = reinterpret_cast<std::uintptr_t>(dst) | reinterpret_cast<std::uintptr_t>(src) |
                    static_cast<std::uintptr_t>(bytes);
  if ((bits & 15u) == 0) {
    auto* d = reinterpret_cast<uint4*>(dst);
    const auto* s = reinterpret_cast<const uint4*>(src);
    for (std::int64_t i = worker; i < bytes / 16; i += workers) d[i] = s[i];
  } else if ((bits & 3u) == 0) {
    auto* d = reinterpret_cast<std::uint32_t*>(dst);
    const auto* s = reinterpret_cast<const std::uint32_t*>(src);
    for (std::int64_t i = worker; i < bytes / 4; i += workers) d[i] = s[i];
  } else {
    for (std::int64_t i = worker; i < bytes; i += workers) dst[i] = src[i];
  }
}

// ---- materialize -----------------------------------------------------------------------------

struct MaterializeParams {
  StateCacheLayout cache;
  int batch;
  const std::int32_t* slot_ids;
  const std::uint32_t* positions;
  float* states;
};

/// Rows a warp works on at once: their dependent chains (GDN's reductions) interleave, and
/// the next ones' loads are issued before the current ones' records are applied. One row per
/// warp, loaded when needed (and record inputs read from L2), took 1253 µs (super120b) and
/// 2433 µs (qwen35-122b) for 256 pairs at 15 records on the H200, against 1050 and 1769 µs
/// now (docs/BENCHMARKS.md, Prefix caching).
constexpr int kRowsPerWarp = 2;

// Shared memory of a materialize block, fp32: the staged records' keys [kRecordChunk][cols]
// (GDN's normalised) and input rows [kRecordChunk][rows] (Mamba-2 x, GDN v of this head), and
// two per-record factors (Mamba-2: the fold weight s_j; GDN: α_j = e^{g_j} and β_j).
int materialize_smem(const StateDims& d) {
  return (kRecordChunk * (d.cols + d.rows) + 2 * kRecordChunk) * 4;
}
constexpr int kMaxMaterializeSmem = 48 * 1024;  // no opt-in: every target shape needs < 34 KB

template <LayerKind kKind, typename input_t, typename master_t>
__global__ void __launch_bounds__(kThreads)
    materialize_kernel(const __grid_constant__ MaterializeParams p) {
  const StateCacheLayout& l = p.cache;
  const StateDims& d = l.dims;
  const int h = blockIdx.x, layer = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slot = resolve_slot(l, p.slot_ids, b);
  if (slot < 0) return;
  const int count = prefix_records_to(l, layer, slot, p.positions[b]);
  float* out = p.states + ((std::int64_t{b} * l.config.num_layers + layer) * d.heads + h) *
                              std::int64_t{d.rows} * d.cols;
  if (count < 0) {  // out of reach: a state of NaNs, never one that could pass for real
    for (std::int64_t i = threadIdx.x; i < std::int64_t{d.rows} * d.cols; i += kThreads) {
      out[i] = __int_as_float(0x7fc00000);
    }
    return;
  }
  const std::int64_t ls = l.layer_slot(layer, slot);
  const std::uint32_t first = l.folded[ls];
  const int key_head = h / (d.heads / d.key_heads);
  const auto* master = static_cast<const master_t*>(l.has_hi() ? static_cast<const void*>(l.ckpt_hi)
                                                                : l.ckpt_lo) +
                       (l.checkpoint_region(layer, slot) * d.heads + h) * std::int64_t{d.rows} *
                           d.cols;
  extern __shared__ float smem[];
  float* keys = smem;
  float* vals = keys + kRecordChunk * d.cols;
  float* factor_a = vals + kRecordChunk * d.rows;
  float* factor_b = factor_a + kRecordChunk;
  __shared__ float total_shared;
  const auto record = [&](int j) { return l.ring_record(layer, slot, first + std::uint32_t(j)); };
  const auto decay = [&](int j) { return l.ring_decay[record(j) * d.heads + h]; };

  // Mamba-2's decays come from fp32 prefix sums of A·Δ in record order, as the CPU fold sums
  // them: every lane of warp 0 runs the same serial sum over values loaded 32 at a time.
  // `*mine` gets the sum through record `mine`.
  const auto serial_sum = [&](int from, int upto, float acc, int mine, float* at_mine) {
    for (int j0 = from; j0 < upto; j0 += 32) {
      const float v = j0 + lane < upto ? decay(j0 + lane) : 0.0f;
      const int n = min(32, upto - j0);
      for (int i = 0; i < n; ++i) {
        acc += __shfl_sync(kFullMask, v, i);
        if (j0 + i == mine) *at_mine = acc;
      }
    }
    return acc;
  };
  const int chunks = (count + kRecordChunk - 1) / kRecordChunk;
  // Warp 0's lanes: the sum of all the records' log-decays, when more than one chunk needs it
  // before the first chunk's weights (only past 32 records, i.e. buffer_len >= 33).
  float total_all = 0.0f;
  if constexpr (kKind == LayerKind::kMamba2) {
    if (chunks > 1 && warp == 0) {
      float unused = 0.0f;
      total_all = serial_sum(0, count, 0.0f, -1, &unused);
      if (lane == 0) total_shared = total_all;
    }
  }

  // Records [c0, c0 + n) into shared memory.
  const auto stage = [&](int c0, int n) {
    for (int e = threadIdx.x; e < n * d.cols; e += kThreads) {
      const int j = e / d.cols, c = e - j * d.cols;
      const std::int64_t rec = record(c0 + j);
      float key = to_float(static_cast<const input_t*>(l.ring_key)[rec * l.key_elems() +
                                                                    key_head * d.cols + c]);
      if constexpr (kKind == LayerKind::kGdn) key *= l.ring_key_scale[rec * d.key_heads + key_head];
      keys[j * d.cols + c] = key;
    }
    for (int e = threadIdx.x; e < n * d.rows; e += kThreads) {
      const int j = e / d.rows, r = e - j * d.rows;
      vals[j * d.rows + r] = to_float(static_cast<const input_t*>(
          l.ring_vec)[record(c0 + j) * l.vec_elems() + std::int64_t{h} * d.rows + r]);
    }
    if (warp != 0) return;
    if constexpr (kKind == LayerKind::kMamba2) {
      // s_j = Δ_j·exp(total − cum_j), cum_j the prefix sum through record j.
      float before = 0.0f, cum = 0.0f;
      if (c0 > 0) before = serial_sum(0, c0, 0.0f, -1, &cum);
      const float through = serial_sum(c0, c0 + n, before, c0 + lane, &cum);
      const float total = chunks > 1 ? total_all : through;
      if (lane == 0 && chunks <= 1) total_shared = through;
      if (lane < n) factor_a[lane] = l.ring_write[record(c0 + lane) * d.heads + h] * expf(total - cum);
    } else if (lane < n) {
      const std::int64_t rec = record(c0 + lane);
      factor_a[lane] = expf(l.ring_decay[rec * d.heads + h]);
      factor_b[lane] = l.ring_write[rec * d.heads + h];
    }
  };

  // kRowsPerWarp rows of the state, this lane's columns lane + 32·i, from the master (on the
  // first chunk) or from `out` (this warp's own writes of the chunk before).
  using Rows = float[kRowsPerWarp][kMaxPerLane];
  const auto load_rows = [&](Rows& v, int r0, auto from_master) {
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) {
        const int r = r0 + k, c = lane + 32 * i;
        const std::int64_t e = std::int64_t{r} * d.cols + c;
        if constexpr (decltype(from_master)::value) {
          v[k][i] = r < d.rows && c < d.cols ? to_float(master[e]) : 0.0f;
        } else {
          v[k][i] = r < d.rows && c < d.cols ? out[e] : 0.0f;
        }
      }
    }
  };
  // The chunk's records applied to rows r0.. in record order.
  const auto apply = [&](Rows& s, int r0, int n) {
    for (int j = 0; j < n; ++j) {
      const float* key = keys + j * d.cols;
      float k_i[kMaxPerLane];
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) {
        const int c = lane + 32 * i;
        k_i[i] = c < d.cols ? key[c] : 0.0f;
      }
      float v[kRowsPerWarp];
#pragma unroll
      for (int k = 0; k < kRowsPerWarp; ++k) v[k] = r0 + k < d.rows ? vals[j * d.rows + r0 + k] : 0.0f;
      if constexpr (kKind == LayerKind::kMamba2) {
        // S ← S + (s_j·x_j)·B_jᵀ, the CPU fold's products and sums in its order.
#pragma unroll
        for (int k = 0; k < kRowsPerWarp; ++k) {
          const float coeff = __fmul_rn(factor_a[j], v[k]);
#pragma unroll
          for (int i = 0; i < kMaxPerLane; ++i) s[k][i] = __fmaf_rn(coeff, k_i[i], s[k][i]);
        }
      } else {
        // d = β·(v − α·S·k̂),  S ← α·S + d·k̂ᵀ (ALGORITHM.md §2); the rows' reductions interleave.
        float dot[kRowsPerWarp];
#pragma unroll
        for (int k = 0; k < kRowsPerWarp; ++k) {
          dot[k] = 0.0f;
#pragma unroll
          for (int i = 0; i < kMaxPerLane; ++i) dot[k] = __fmaf_rn(s[k][i], k_i[i], dot[k]);
        }
#pragma unroll
        for (int o = 16; o > 0; o /= 2) {
#pragma unroll
          for (int k = 0; k < kRowsPerWarp; ++k) dot[k] += __shfl_xor_sync(kFullMask, dot[k], o);
        }
        const float alpha = factor_a[j], beta = factor_b[j];
#pragma unroll
        for (int k = 0; k < kRowsPerWarp; ++k) {
          const float delta = beta * (v[k] - alpha * dot[k]);
#pragma unroll
          for (int i = 0; i < kMaxPerLane; ++i) s[k][i] = __fmaf_rn(alpha, s[k][i], delta * k_i[i]);
        }
      }
    }
  };

  // This warp's rows, `next` holding the first ones' values: each row's records applied, the
  // row written out, the next rows loaded before the current ones are worked on.
  const int first_row = warp * kRowsPerWarp, stride = kWarps * kRowsPerWarp;
  const auto rows_pass = [&](Rows& next, int n, float tau, auto from_master) {
    for (int r0 = first_row; r0 < d.rows; r0 += stride) {
      Rows s;
#pragma unroll
      for (int k = 0; k < kRowsPerWarp; ++k) {
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i) s[k][i] = next[k][i] * tau;
      }
      if (r0 + stride < d.rows) load_rows(next, r0 + stride, from_master);
      apply(s, r0, n);
#pragma unroll
      for (int k = 0; k < kRowsPerWarp; ++k) {
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i) {
          const int r = r0 + k, c = lane + 32 * i;
          if (r < d.rows && c < d.cols) out[std::int64_t{r} * d.cols + c] = s[k][i];
        }
      }
    }
  };

  // Chunk by chunk (one, unless buffer_len >= 33). The first rows' loads go out before the
  // staging, whose loads and serial sums they overlap.
  Rows next;
  load_rows(next, first_row, std::true_type{});
  for (int ch = 0; ch < max(chunks, 1); ++ch) {
    const int c0 = ch * kRecordChunk, n = min(kRecordChunk, count - c0);
    if (ch > 0) __syncthreads();  // every warp is done with the previous chunk
    if (n > 0) stage(c0, n);
    __syncthreads();
    if (ch == 0) {
      float tau = 1.0f;
      if constexpr (kKind == LayerKind::kMamba2) {
        if (count > 0) tau = expf(total_shared);
      }
      rows_pass(next, n, tau, std::true_type{});
    } else {
      load_rows(next, first_row, std::false_type{});
      rows_pass(next, n, 1.0f, std::false_type{});
    }
  }
}

// ---- fork and truncate -----------------------------------------------------------------------

struct ForkParams {
  StateCacheLayout cache;
  SlotRuns ckpt, ring;
  int batch;
  const std::int32_t* src_slots;
  const std::int32_t* dst_slots;
  const std::uint32_t* positions;
  int conv_elem_bytes;  // the input dtype's size (conv caches)
};

// Row b's slots when the row is to be forked (both in range and allocated, distinct, the
// position in reach of the source), else false.
__device__ __forceinline__ bool fork_row(const ForkParams& p, int b, int* src, int* dst) {
  *src = resolve_slot(p.cache, p.src_slots, b);
  *dst = resolve_slot(p.cache, p.dst_slots, b);
  return *src >= 0 && *dst >= 0 && *src != *dst && prefix_in_reach(p.cache, *src, p.positions[b]);
}

// Grid (blocks per region, layer, row): the checkpoint copies of (layer, src) onto dst's.
__global__ void fork_checkpoint_kernel(const __grid_constant__ ForkParams p) {
  int src, dst;
  if (!fork_row(p, blockIdx.z, &src, &dst)) return;
  const StateCacheLayout& l = p.cache;
  const int layer = blockIdx.y;
  const std::int64_t worker = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const std::int64_t workers = std::int64_t{gridDim.x} * blockDim.x;
  for (int f = 0; f < p.ckpt.count; ++f) {
    const ByteRun& r = p.ckpt.run[f];
    copy_run(r.base + l.layer_slot(layer, dst) * r.bytes, r.base + l.layer_slot(layer, src) * r.bytes,
             r.bytes, worker, workers);
  }
}

// Grid (record j, layer, row): record folded + j of (layer, src) onto dst's, for j < p − folded,
// and on conv caches the conv row of position p − 1 − j, for j < K − 1 (the window at p).
__global__ void fork_ring_kernel(const __grid_constant__ ForkParams p) {
  int src, dst;
  if (!fork_row(p, blockIdx.z, &src, &dst)) return;
  const StateCacheLayout& l = p.cache;
  const int layer = blockIdx.y, j = blockIdx.x;
  if (l.conv_window != nullptr && j < l.conv_kernel() - 1) {
    const std::uint32_t pos = p.positions[blockIdx.z] - 1u - std::uint32_t(j);
    const std::int64_t row_bytes = std::int64_t{l.conv_channels()} * p.conv_elem_bytes;
    auto* conv = static_cast<char*>(l.conv_window);
    copy_run(conv + l.conv_record(layer, dst, pos) * row_bytes,
             conv + l.conv_record(layer, src, pos) * row_bytes, row_bytes, threadIdx.x,
             blockDim.x);
  }
  if (j >= prefix_records_to(l, layer, src, p.positions[blockIdx.z])) return;
  const std::uint32_t pos = l.folded[l.layer_slot(layer, src)] + std::uint32_t(j);
  for (int f = 0; f < p.ring.count; ++f) {
    const ByteRun& r = p.ring.run[f];
    copy_run(r.base + l.ring_record(layer, dst, pos) * r.bytes,
             r.base + l.ring_record(layer, src, pos) * r.bytes, r.bytes, threadIdx.x, blockDim.x);
  }
}

__global__ void fork_cursor_kernel(const __grid_constant__ ForkParams p) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  int src, dst;
  if (b >= p.batch || !fork_row(p, b, &src, &dst)) return;
  const StateCacheLayout& l = p.cache;
  l.committed[dst] = p.positions[b];
  for (int layer = 0; layer < l.config.num_layers; ++layer) {
    l.folded[l.layer_slot(layer, dst)] = l.folded[l.layer_slot(layer, src)];
    l.pending[l.layer_slot(layer, dst)] = 0;
    if (l.ckpt_source != nullptr) share_checkpoint(l, layer, src, dst);
  }
}

struct TruncateParams {
  StateCacheLayout cache;
  int batch;
  const std::int32_t* slot_ids;
  const std::uint32_t* positions;
};

__global__ void truncate_kernel(const __grid_constant__ TruncateParams p) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= p.batch) return;
  const StateCacheLayout& l = p.cache;
  const int slot = resolve_slot(l, p.slot_ids, b);
  if (slot < 0 || !prefix_in_reach(l, slot, p.positions[b])) return;
  l.committed[slot] = p.positions[b];
  for (int layer = 0; layer < l.config.num_layers; ++layer) l.pending[l.layer_slot(layer, slot)] = 0;
}

// ---- records and restore ---------------------------------------------------------------------

struct RecordsParams {
  StateCacheLayout cache;
  SlotRuns ring, outside;
  int slot;
  std::uint32_t first;
  int count;
  bool to_ring;
};

// Grid (record j, layer): record first + j of (layer, slot) to or from CacheRecords' layout.
__global__ void records_kernel(const __grid_constant__ RecordsParams p) {
  const int j = blockIdx.x, layer = blockIdx.y;
  const std::int64_t rec = p.cache.ring_record(layer, p.slot, p.first + std::uint32_t(j));
  const std::int64_t at = std::int64_t{layer} * p.count + j;
  for (int f = 0; f < p.ring.count; ++f) {
    char* ring = p.ring.run[f].base + rec * p.ring.run[f].bytes;
    char* outside = p.outside.run[f].base + at * p.outside.run[f].bytes;
    if (p.to_ring) {
      copy_run(ring, outside, p.ring.run[f].bytes, threadIdx.x, blockDim.x);
    } else {
      copy_run(outside, ring, p.ring.run[f].bytes, threadIdx.x, blockDim.x);
    }
  }
}

Status copy_records(const StateCacheLayout& l, int slot, std::uint32_t first,
                    const CacheRecords& outside, bool to_ring, cudaStream_t stream) {
  if (outside.count == 0) return Status::ok();
  const RecordsParams p{l, slot_runs(l, SlotPart::kRing), slot_runs(l, SlotPart::kRing, &outside),
                        slot, first, outside.count, to_ring};
  records_kernel<<<dim3(outside.count, l.config.num_layers), kThreads, 0, stream>>>(p);
  REPLAYSSM_CUDA_CHECK_LAUNCH("prefix records kernel");
  return Status::ok();
}

__global__ void count_nonfinite_kernel(const float* v, std::int64_t n, unsigned* flag) {
  for (std::int64_t i = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    if (!isfinite(v[i])) atomicOr(flag, 1u);
  }
}

struct RestoreParams {
  StateCacheLayout cache;
  int slot;
  std::uint32_t position;
  int count;
  const float* states;  // [layers, heads, rows, cols]
};

// Grid (head, layer), a warp per row: every checkpoint copy of the row from its fp32 values,
// as write_row (common/checkpoint_rows.h) stores a folded row: the master as is, bf16 rounded,
// fp8 with a fresh scale max|row| / 448.
__global__ void __launch_bounds__(kThreads) restore_kernel(const __grid_constant__ RestoreParams p) {
  const StateCacheLayout& l = p.cache;
  const StateDims& d = l.dims;
  const int h = blockIdx.x, layer = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t ls = l.layer_slot(layer, p.slot);
  for (int r = warp; r < d.rows; r += kWarps) {
    const std::int64_t row = (ls * d.heads + h) * d.rows + r;  // state row index in the cache
    const float* in = p.states + ((std::int64_t{layer} * d.heads + h) * d.rows + r) * d.cols;
    float v[kMaxPerLane];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int c = lane + 32 * i;
      v[i] = c < d.cols ? in[c] : 0.0f;
      amax = fmaxf(amax, fabsf(v[i]));
    }
    const float scale_max = group_max<32>(amax);
    const float scale = scale_max > 0.0f ? scale_max / kFp8Max : 1.0f;
    const float inv = 1.0f / scale;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int c = lane + 32 * i;
      if (c >= d.cols) continue;
      const std::int64_t e = row * d.cols + c;
      if (l.has_hi()) l.ckpt_hi[e] = v[i];
      if (!l.has_lo()) continue;
      if (l.lo_dtype() == DType::kF8E4M3) {
        static_cast<fp8e4m3_t*>(l.ckpt_lo)[e] = float_to_fp8e4m3(__fmul_rn(v[i], inv));
      } else {
        static_cast<bf16_t*>(l.ckpt_lo)[e] = float_to_bf16(v[i]);
      }
    }
    if (l.ckpt_lo_scale != nullptr && lane == 0) l.ckpt_lo_scale[row] = scale;
  }
}

__global__ void restore_cursor_kernel(const __grid_constant__ RestoreParams p) {
  const StateCacheLayout& l = p.cache;
  l.committed[p.slot] = p.position + std::uint32_t(p.count);
  for (int layer = 0; layer < l.config.num_layers; ++layer) {
    l.folded[l.layer_slot(layer, p.slot)] = p.position;
    l.pending[l.layer_slot(layer, p.slot)] = 0;
  }
}

}  // namespace

Status materialize(const StateCacheLayout& l, const MaterializeArgs& a, Stream s) {
  REPLAYSSM_RETURN_IF_ERROR(check_grid(l, a.batch, "state_cache_materialize", true));
  const cudaStream_t stream = to_cuda(s);
  const MaterializeParams p{l, a.batch, a.slot_ids, a.positions, a.states};
  const dim3 grid(l.dims.heads, l.config.num_layers, a.batch);
  const int smem = materialize_smem(l.dims);
  if (smem > kMaxMaterializeSmem) {
    return unsupported("state_cache_materialize on CUDA stages " + std::to_string(kRecordChunk) +
                       " records of rows + cols = " + std::to_string(l.dims.rows + l.dims.cols) +
                       " values in shared memory; at most " +
                       std::to_string(kMaxMaterializeSmem / 4 / kRecordChunk - 2) + " fit");
  }
  const auto launch = [&](auto kind, auto in, auto master) {
    using input_t = dtype_t<decltype(in)::value>;
    using master_t = std::conditional_t<decltype(master)::value, float, bf16_t>;
    materialize_kernel<decltype(kind)::value, input_t, master_t>
        <<<grid, kThreads, smem, stream>>>(p);
    REPLAYSSM_CUDA_CHECK_LAUNCH("materialize kernel");
    return Status::ok();
  };
  // The master a fold updates: fp32, or the shared bf16 copy.
  const auto with_master = [&](auto kind, auto in) {
    return l.has_hi() ? launch(kind, in, std::true_type{}) : launch(kind, in, std::false_type{});
  };
  return ActivationDTypes::dispatch(l.config.input_dtype, "input dtype", [&](auto in) {
    switch (l.config.kind) {
      case LayerKind::kMamba2:
        return with_master(std::integral_constant<LayerKind, LayerKind::kMamba2>{}, in);
      case LayerKind::kGdn:
        return with_master(std::integral_constant<LayerKind, LayerKind::kGdn>{}, in);
    }
    return invalid_argument("unknown layer kind");
  });
}

Status fork(StateCacheLayout& l, const ForkArgs& a, Stream s) {
  REPLAYSSM_RETURN_IF_ERROR(check_grid(l, a.batch, "state_cache_fork", false));
  const cudaStream_t stream = to_cuda(s);
  const ForkParams p{l, slot_runs(l, SlotPart::kCheckpoint), slot_runs(l, SlotPart::kRing),
                     a.batch, a.src_slots, a.dst_slots, a.positions,
                     int(dtype_size(l.config.input_dtype))};
  // Enough blocks per region that each thread copies a few 16-byte words of the largest run.
  std::int64_t largest = 0;
  for (int f = 0; f < p.ckpt.count; ++f) largest = std::max(largest, p.ckpt.run[f].bytes);
  const int per_region = std::clamp(blocks_for(largest, kThreads * 16 * 8), 1, 1024);
  // A shared checkpoint is not copied: the cursor kernel points dst at it.
  if (l.ckpt_source == nullptr) {
    fork_checkpoint_kernel<<<dim3(per_region, l.config.num_layers, a.batch), kThreads, 0,
                             stream>>>(p);
    REPLAYSSM_CUDA_CHECK_LAUNCH("fork checkpoint kernel");
  }
  const int ring_blocks = std::max(l.max_history(), l.conv_kernel() - 1);
  fork_ring_kernel<<<dim3(ring_blocks, l.config.num_layers, a.batch), kThreads, 0, stream>>>(p);
  REPLAYSSM_CUDA_CHECK_LAUNCH("fork ring kernel");
  fork_cursor_kernel<<<blocks_for(a.batch, kCursorThreads), kCursorThreads, 0, stream>>>(p);
  REPLAYSSM_CUDA_CHECK_LAUNCH("fork cursor kernel");
  return Status::ok();
}

Status truncate(StateCacheLayout& l, const TruncateArgs& a, Stream s) {
  const TruncateParams p{l, a.batch, a.slot_ids, a.positions};
  truncate_kernel<<<blocks_for(a.batch, kCursorThreads), kCursorThreads, 0, to_cuda(s)>>>(p);
  REPLAYSSM_CUDA_CHECK_LAUNCH("truncate kernel");
  return Status::ok();
}

Status read_records(const StateCacheLayout& l, int slot, std::uint32_t first,
                    const CacheRecords& out, Stream s) {
  return copy_records(l, slot, first, out, /*to_ring=*/false, to_cuda(s));
}

Status restore(StateCacheLayout& l, const RestoreArgs& a, Stream s) {
  REPLAYSSM_RETURN_IF_ERROR(check_grid(l, 1, "state_cache_restore", true));
  const cudaStream_t stream = to_cuda(s);
  // Finite first, with nothing written before the answer is back.
  unsigned* flag_ptr = nullptr;
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaMalloc(&flag_ptr, sizeof(unsigned)));
  const std::unique_ptr<unsigned, cudaError_t (*)(void*)> flag(flag_ptr, cudaFree);
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flag.get(), 0, sizeof(unsigned), stream));
  const std::int64_t n = std::int64_t{l.config.num_layers} * l.state_elems();
  count_nonfinite_kernel<<<std::clamp(blocks_for(n, kThreads), 1, 4096), kThreads, 0, stream>>>(
      a.states, n, flag.get());
  REPLAYSSM_CUDA_CHECK_LAUNCH("restore check kernel");
  unsigned nonfinite = 0;
  REPLAYSSM_RETURN_IF_ERROR(memory_copy(&nonfinite, flag.get(), sizeof nonfinite, s));
  if (nonfinite != 0) {
    return invalid_argument("state_cache_restore: the states hold a NaN or an infinity; a "
                            "restored state must be finite");
  }
  // The slot's checkpoint is replaced: it stops sharing (its borrowers get copies first).
  REPLAYSSM_RETURN_IF_ERROR(
      release_slot_checkpoints(l, a.slot, 0, l.config.num_layers, ReleaseFor::kOverwrite, s));
  const RestoreParams p{l, a.slot, a.position, a.records.count, a.states};
  restore_kernel<<<dim3(l.dims.heads, l.config.num_layers), kThreads, 0, stream>>>(p);
  REPLAYSSM_CUDA_CHECK_LAUNCH("restore kernel");
  REPLAYSSM_RETURN_IF_ERROR(copy_records(l, a.slot, a.position, a.records, true, stream));
  restore_cursor_kernel<<<1, 1, 0, stream>>>(p);
  REPLAYSSM_CUDA_CHECK_LAUNCH("restore cursor kernel");
  return Status::ok();
}

}  // namespace replayssm::cuda
