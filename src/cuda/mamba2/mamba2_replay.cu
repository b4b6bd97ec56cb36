// Mamba-2 replay decode (ALGORITHM.md §4, §5, §7): the outputs of a T-token window from the
// checkpoint's read copy and the ring, with the fold of committed history fused in when due.
//
// One block per (batch row b, run of hpc heads h0.. of group g), w = committed − folded history
// records; hpc is finer for a row whose fold is due than for one that only reads, at small
// batch (Params::read_heads_per_cta), and the rows whose fold is due come first
// (state_cache/fold_order.cuh):
//   1. stage in shared memory (cp.async) what the step reads besides the state: x of the
//      block's heads and B of the group for the w history records (ring) and the T window
//      tokens (inputs), C_t, Δ and A·Δ; append the window to the ring;
//   2. per head, fp32 prefix sums Λ of A·Δ, and the coefficients
//        fold:    τ = exp(Λ_{w−1}),  weight_j = Δ_j·exp(Λ_{w−1} − Λ_j)
//        output:  τ_t = exp(Λ_last), coef_tj = Δ_j·exp(Λ_last − Λ_j)·(B_j·C_t)  (j ≤ last)
//      with B_j·C_t computed once for the group;
//   3. stream the heads' rows (contiguous in memory) through shared-memory tiles: when a fold
//      is due (w >= L; any w for an explicit fold) S ← τ·S + Σ_j weight_j·x_j·B_jᵀ on the
//      master copy (on the tensor cores at fp32 accuracy, fold_tile_mma, when head_dim is a
//      multiple of 16), written back to every copy (checkpoint.cuh), after which the window
//      reads the fresh read copy and no history; then (S·C_t)[p] for every window token (on
//      the tensor cores, read_tile_mma, for fp8 read copies and bf16 ones under a verify
//      window; tiles are swizzled in shared memory for those reads, Stage);
//   4. y_t = τ_t·(S·C_t) + Σ_{j ≤ last} coef_tj·x_j + D·x_t, gated by silu(z_t).
// The state is read once (the floor of a replay step) and written only by a due fold. The fold
// cursor moves inside the launch (state_cache/cursors.cuh): a step is one launch per layer.
// Arithmetic follows src/cpu/mamba2_decode.cpp term by term, so the backends differ only by
// rounding order (FMA contraction, the order of the 128-term dot products).

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common/numeric.h"
#include "cuda/common/async_copy.cuh"
#include "cuda/common/cache.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/checkpoint.cuh"
#include "cuda/common/conv.cuh"
#include "cuda/common/device_limits.cuh"
#include "cuda/common/dispatch.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/common/mma.cuh"
#include "cuda/common/vec.cuh"
#include "cuda/mamba2/mamba2_launch.h"
#include "cuda/common/tuning.h"
#include "cuda/state_cache/cursors.cuh"
#include "cuda/state_cache/fold_order.cuh"

namespace replayssm::cuda::mamba2 {

namespace {

using Split = RowSplit<kDstate, kLanesPerRow>;
constexpr int kPerLane = Split::kPerLane;  // 16 columns of a row per lane

/// Rows of T in one tile, and rows per row group (lane group of 8) in it.
template <typename T>
constexpr int kTileRows = kTileBytes / (kDstate * int(sizeof(T)));  // fp32 32, bf16 64, fp8 128
template <typename T>
constexpr int kRowsPerGroup = kTileRows<T> / kRowGroups;

// A stage holds a tile's rows as in memory, except that each row's 16-byte chunks are permuted
// by an XOR of their index with a few bits of the row (a shared-memory swizzle). The tensor-core
// paths read the same columns of 8 or 16 rows at once, and rows of 128-512 bytes would put all
// of those in the same banks (4- to 8-way conflicts): with the swizzle, a bf16 / fp32 half-warp
// (8-byte pieces of an even and odd chunk in 4 rows) and an fp8 warp (4-byte pieces of one
// chunk in 8 rows) each touch 32 different banks. The row pass reads whole rows, 8 lanes over
// 8 chunks, which any permutation inside an aligned group of 8 chunks keeps conflict-free.
template <typename T>
struct Stage {
  static constexpr int kChunkElems = 16 / int(sizeof(T));
  static constexpr int kRowChunks = kDstate / kChunkElems;
  static_assert(kRowChunks % 8 == 0, "the XOR stays inside a row");

  __device__ __forceinline__ static int chunk_xor(int row) {
    return sizeof(T) == 1 ? (row & 7) : ((row & 3) << 1);
  }
  /// Element (row, col) of a stage.
  template <typename U>
  __device__ __forceinline__ static U* at(U* stage, int row, int col) {
    const int chunk = (col / kChunkElems) ^ chunk_xor(row);
    return stage + row * kDstate + chunk * kChunkElems + col % kChunkElems;
  }
  /// Byte offset in a stage of a tile's 16-byte piece c (pieces numbered in memory order).
  __device__ __forceinline__ static int piece_offset(int c) {
    const int row = c / kRowChunks;
    return (row * kRowChunks + ((c % kRowChunks) ^ chunk_xor(row))) * 16;
  }
  /// The XOR takes fewer bits than a row's vector index within its lane group (vec.cuh), so a
  /// row's lane reads its vector k at k·kLanesPerRow + (lane ^ chunk_xor): the swizzle is a
  /// permutation of the lanes, the same for every vector of the row.
  static_assert(kLanesPerRow >= 8, "the XOR (< 8) stays inside a lane group");
  static_assert(Split::kVec<T> == kChunkElems, "a lane's vector is a chunk");
  /// Rows kRowGroups apart (one row group's rows of a tile) share their swizzle bits, and so do
  /// the pieces a thread copies into a whole tile (kReplayThreads apart): both read or write at
  /// the offset of their first, plus a constant.
  static_assert(kRowGroups % 8 == 0 && (kReplayThreads / kRowChunks) % 8 == 0 &&
                    kReplayThreads % kRowChunks == 0,
                "strided rows keep their swizzle bits");
};

// Where one block is, and its shared memory.
struct Block {
  int b, g, h0, hpc, slot;
  int P, T, R, Tm;
  int rows;    // hpc·P state rows, contiguous from head h0's first row
  int w;       // committed history records staged at [0, w)
  bool fold;   // fold those w records first
  int out0;    // first record the outputs read: w after a fold, else 0
  int nout;    // records the outputs read: window plus any unfolded history
  unsigned char* smem;
  ReplaySmem at;

  template <typename T = float>
  __device__ __forceinline__ T* ptr(int offset) const {
    return reinterpret_cast<T*>(smem + offset);
  }
};

// Step 1: the records' x (this block's heads), B and C (the group's) by cp.async, one group;
// Δ and A·Δ by plain loads. History j < w from ring position folded + j, window token t at
// record w + t from the inputs.
// A conv cache's window (kConv) is convolved here from the pre-conv inputs
// (cuda/common/conv.cuh) instead of copied, while the copies fly. In prepare, after the first
// state tiles were issued, it measured the same (super120b, bf16 checkpoint, batch 256: 359 µs
// per step there, 364 here).
template <typename input_t, CheckpointPrecision P, bool kConv>
__device__ void issue_staging(const Params& p, const Block& k, std::uint32_t folded,
                              std::uint32_t committed) {
  const StateCacheLayout& l = p.cache;
  const int H = l.dims.heads, G = l.dims.key_heads, T = k.T;
  const int xrec = k.hpc * k.P;  // elements of one record's x in this block
  const int nrec = kConv ? k.w : k.w + T;  // records copied
  input_t* xs = k.ptr<input_t>(k.at.x());
  input_t* Bs = k.ptr<input_t>(k.at.B());
  // Where record j's x and B come from: ring position folded + j, or window token j − w.
  const auto x_of = [&](int j) {
    if (j < k.w) {
      const std::int64_t rec = l.ring_record(p.layer, k.slot, folded + j);
      return static_cast<const input_t*>(l.ring_vec) + (rec * H + k.h0) * k.P;
    }
    const std::int64_t bt = std::int64_t{k.b} * T + (j - k.w);
    return static_cast<const input_t*>(p.x) + (bt * H + k.h0) * k.P;
  };
  const auto B_of = [&](int j) {
    if (j < k.w) {
      const std::int64_t rec = l.ring_record(p.layer, k.slot, folded + j);
      return static_cast<const input_t*>(l.ring_key) + (rec * G + k.g) * kDstate;
    }
    const std::int64_t bt = std::int64_t{k.b} * T + (j - k.w);
    return static_cast<const input_t*>(p.B) + (bt * G + k.g) * kDstate;
  };
  // Whole 16-byte pieces (every real shape): one loop over all records' pieces, so that each
  // thread issues a few copies instead of walking every record (the per-record loop cost a
  // low-precision block about as many instructions as streaming its state).
  constexpr int kPiece = 16 / int(sizeof(input_t));  // elements per 16-byte piece
  const int x_pieces = xrec / kPiece;
  constexpr int kBPieces = kDstate / kPiece;
  const auto base_bits = reinterpret_cast<std::uintptr_t>(p.x) |
                         reinterpret_cast<std::uintptr_t>(p.B) |
                         reinterpret_cast<std::uintptr_t>(l.ring_vec) |
                         reinterpret_cast<std::uintptr_t>(l.ring_key);
  if ((base_bits & 15u) == 0 && (xrec * int(sizeof(input_t))) % 16 == 0 &&
      (H * k.P * int(sizeof(input_t))) % 16 == 0) {
    const int per_record = x_pieces + kBPieces;
    for (int i = threadIdx.x; i < nrec * per_record; i += blockDim.x) {
      const int j = i / per_record, c = i - j * per_record;
      if (c < x_pieces) {
        cp_async_16(xs + j * xrec + c * kPiece, x_of(j) + c * kPiece);
      } else {
        const int cb = c - x_pieces;
        cp_async_16(Bs + j * kDstate + cb * kPiece, B_of(j) + cb * kPiece);
      }
    }
  } else {
    for (int j = 0; j < nrec; ++j) {
      copy_to_shared(xs + j * xrec, x_of(j), xrec * int(sizeof(input_t)));
      copy_to_shared(Bs + j * kDstate, B_of(j), kDstate * int(sizeof(input_t)));
    }
  }
  for (int t = 0; t < T && !kConv; ++t) {
    const std::int64_t bt = std::int64_t{k.b} * T + t;
    copy_to_shared(k.ptr<input_t>(k.at.C()) + t * kDstate,
                   static_cast<const input_t*>(p.C) + (bt * G + k.g) * kDstate,
                   kDstate * int(sizeof(input_t)));
  }
  if constexpr (CheckpointTypes<P>::kScaled) {
    if (!k.fold) {  // the read copy's per-row scales
      const std::int64_t region = l.checkpoint_region(p.layer, k.slot);
      copy_to_shared(k.ptr(k.at.scale()), l.ckpt_lo_scale + (region * H + k.h0) * k.P,
                     k.rows * 4);
    }
  }
  cp_async_commit();
  if constexpr (kConv) {  // the window's x (this block's heads), B and C (the group's)
    const auto convolve = [&](int first, int n, input_t* dst) {
      conv_channels(l, p.conv, p.layer, k.slot, k.b, T, committed, first, n, dst, n);
    };
    convolve(l.conv_vec_channel() + k.h0 * k.P, xrec, xs + k.w * xrec);
    convolve(l.conv_key_channel() + k.g * kDstate, kDstate, Bs + k.w * kDstate);
    convolve(l.conv_query_channel() + k.g * kDstate, kDstate, k.ptr<input_t>(k.at.C()));
  }
  float* dts = k.ptr(k.at.dt());
  float* decay = k.ptr(k.at.decay());
  for (int i = threadIdx.x; i < (k.w + T) * k.hpc; i += blockDim.x) {
    const int j = i / k.hpc, h = k.h0 + i % k.hpc;
    if (j < k.w) {
      const std::int64_t rec = l.ring_record(p.layer, k.slot, folded + j);
      dts[i] = l.ring_write[rec * H + h];
      decay[i] = l.ring_decay[rec * H + h];
    } else {
      const std::int64_t bt = std::int64_t{k.b} * T + (j - k.w);
      const float delta = softplus(p.dt[bt * H + h] + p.dt_bias[h]);
      dts[i] = delta;
      decay[i] = p.A[h] * delta;
    }
  }
}

// Plain copy shared -> global with the whole block (16-byte pieces when aligned).
__device__ __forceinline__ void copy_to_global(void* gmem, const void* smem, int bytes) {
  const auto s = reinterpret_cast<std::uintptr_t>(smem);
  const auto g = reinterpret_cast<std::uintptr_t>(gmem);
  if (((s | g | std::uintptr_t(bytes)) & 15u) == 0) {
    for (int i = threadIdx.x; i < bytes / 16; i += blockDim.x) {
      static_cast<uint4*>(gmem)[i] = static_cast<const uint4*>(smem)[i];
    }
  } else {
    for (int i = threadIdx.x; i < bytes / 2; i += blockDim.x) {
      static_cast<std::uint16_t*>(gmem)[i] = static_cast<const std::uint16_t*>(smem)[i];
    }
  }
}

// Step 1b, once the staging has landed: append the window to the ring at committed + t (x of
// this block's heads, Δ, A·Δ; B by the block holding the group's first head), and step 2.
template <typename input_t, bool kConv, bool kWindow>
__device__ void prepare(const Params& p, const Block& k, std::uint32_t committed) {
  const StateCacheLayout& l = p.cache;
  const int H = l.dims.heads, G = l.dims.key_heads;
  const int xrec = k.hpc * k.P;
  const input_t* xs = k.ptr<input_t>(k.at.x());
  const input_t* Bs = k.ptr<input_t>(k.at.B());
  const input_t* Cs = k.ptr<input_t>(k.at.C());
  const float* dts = k.ptr(k.at.dt());
  const float* decay = k.ptr(k.at.decay());
  for (int t = 0; t < k.T; ++t) {
    const std::int64_t rec = l.ring_record(p.layer, k.slot, committed + t);
    const int j = k.w + t;
    copy_to_global(static_cast<input_t*>(l.ring_vec) + (rec * H + k.h0) * k.P, xs + j * xrec,
                   xrec * int(sizeof(input_t)));
    if (k.h0 % (H / G) == 0) {
      copy_to_global(static_cast<input_t*>(l.ring_key) + (rec * G + k.g) * kDstate,
                     Bs + j * kDstate, kDstate * int(sizeof(input_t)));
    }
    for (int hl = threadIdx.x; hl < k.hpc; hl += blockDim.x) {
      l.ring_write[rec * H + k.h0 + hl] = dts[j * k.hpc + hl];
      l.ring_decay[rec * H + k.h0 + hl] = decay[j * k.hpc + hl];
    }
  }
  if constexpr (kConv) {  // the pre-conv inputs of the same channels into the conv ring
    append_conv_channels<input_t>(l, p.conv, p.layer, k.slot, k.b, k.T, committed,
                                  l.conv_vec_channel() + k.h0 * k.P, xrec);
    if (k.h0 % (H / G) == 0) {
      append_conv_channels<input_t>(l, p.conv, p.layer, k.slot, k.b, k.T, committed,
                                    l.conv_key_channel() + k.g * kDstate, kDstate);
      append_conv_channels<input_t>(l, p.conv, p.layer, k.slot, k.b, k.T, committed,
                                    l.conv_query_channel() + k.g * kDstate, kDstate);
    }
  }

  // C as fp32 once, for the dot products' inner loops; B too for a single token. A verify
  // window's readers widen the staged B as they load it (a bf16 value is exact in fp32 and in
  // TF32): its fp32 copy cost a block R·512 bytes of shared memory (replay_smem_for).
  float* Cf = k.ptr(k.at.Cf());
  if constexpr (!kWindow) {
    float* Bf = k.ptr(k.at.Bf());
    for (int i = threadIdx.x; i < (k.w + k.T) * kDstate; i += blockDim.x) Bf[i] = to_float(Bs[i]);
  }
  for (int i = threadIdx.x; i < k.T * kDstate; i += blockDim.x) Cf[i] = to_float(Cs[i]);
  __syncthreads();

  // B_i·C_t for the records the outputs read, once for the group: a warp per product for a
  // single token; 8 lanes per product in a verify window, a warp taking 4 records of one token
  // at a time (a warp per product with its index divided out was 9% of a 4-token window's
  // instructions).
  float* Gm = k.ptr(k.at.G());
  if constexpr (!kWindow) {
    const int warp = threadIdx.x / 32, lane32 = threadIdx.x % 32;
    for (int d = warp; d < k.T * k.nout; d += blockDim.x / 32) {
      const int t = d / k.nout, i = d % k.nout;
      const float* Bi = k.ptr(k.at.Bf()) + (k.out0 + i) * kDstate;
      const float* Ct = Cf + t * kDstate;
      float dot = 0.0f;
      for (int n = lane32; n < kDstate; n += 32) dot += Bi[n] * Ct[n];
      dot = group_sum<32>(dot);
      if (lane32 == 0) Gm[t * k.R + i] = dot;
    }
  } else {
    constexpr int kDotLanes = 8, kDotsPerWarp = 32 / kDotLanes;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % kDotLanes;
    const int sub = (threadIdx.x % 32) / kDotLanes;
    const int step = blockDim.x / 32 * kDotsPerWarp;
    for (int t = 0; t < k.T; ++t) {
      const float* Ct = Cf + t * kDstate;
      for (int i0 = warp * kDotsPerWarp; i0 < k.nout; i0 += step) {  // uniform in the warp
        const int i = i0 + sub;
        float dot = 0.0f;
        if (i < k.nout) {
          const input_t* Bi = Bs + (k.out0 + i) * kDstate;
#pragma unroll
          for (int n = lane * 4; n < kDstate; n += kDotLanes * 4) {
            Packed<input_t, 4> packed;
            packed.load(Bi + n);
            float b[4];
            packed.unpack(b);
            const float4 c = *reinterpret_cast<const float4*>(Ct + n);
            dot += b[0] * c.x + b[1] * c.y + b[2] * c.z + b[3] * c.w;
          }
        }
        dot = group_sum<kDotLanes>(dot);
        if (lane == 0 && i < k.nout) Gm[t * k.R + i] = dot;
      }
    }
  }
  // Per head: prefix sums of A·Δ in record order (as the CPU), fold and output decays.
  float* cum = k.ptr(k.at.cum());
  for (int hl = threadIdx.x; hl < k.hpc; hl += blockDim.x) {
    float* c = cum + hl * k.R;
    if (k.fold) {
      float total = 0.0f;
      for (int j = 0; j < k.w; ++j) {
        total += decay[j * k.hpc + hl];
        c[j] = total;
      }
      float* weight = k.ptr(k.at.fold_w()) + hl * k.R;
      for (int j = 0; j < k.w; ++j) weight[j] = dts[j * k.hpc + hl] * expf(total - c[j]);
      k.ptr(k.at.fold_tau())[hl] = expf(total);
    }
    float total = 0.0f;
    for (int i = 0; i < k.nout; ++i) {
      total += decay[(k.out0 + i) * k.hpc + hl];
      c[i] = total;
    }
    for (int t = 0; t < k.T; ++t) k.ptr(k.at.tau())[hl * k.Tm + t] = expf(c[k.nout - k.T + t]);
  }
  __syncthreads();
  // coef_ti: a thread per coefficient for a single token; in a verify window a warp per
  // (head, token), its lanes over the records (no division per coefficient).
  float* coef = k.ptr(k.at.coef());
  if constexpr (!kWindow) {
    const int per_head = k.T * k.nout;
    for (int d = threadIdx.x; d < k.hpc * per_head; d += blockDim.x) {
      const int hl = d / per_head, t = (d % per_head) / k.nout, i = d % k.nout;
      const int last = k.nout - k.T + t;
      const float* c = cum + hl * k.R;
      float v = 0.0f;
      if (i <= last) {
        v = dts[(k.out0 + i) * k.hpc + hl] * expf(c[last] - c[i]) * Gm[t * k.R + i];
      }
      coef[(hl * k.Tm + t) * k.R + i] = v;
    }
  } else {
    for (int ht = threadIdx.x / 32; ht < k.hpc * k.T; ht += blockDim.x / 32) {
      const int hl = ht / k.T, t = ht - hl * k.T;
      const int last = k.nout - k.T + t;
      const float* c = cum + hl * k.R;
      for (int i = threadIdx.x % 32; i < k.nout; i += 32) {
        float v = 0.0f;
        if (i <= last) {
          v = dts[(k.out0 + i) * k.hpc + hl] * expf(c[last] - c[i]) * Gm[t * k.R + i];
        }
        coef[(hl * k.Tm + t) * k.R + i] = v;
      }
    }
  }
  __syncthreads();
}

// Queues tile `tile` (rows [tile·kTileRows, +kTileRows) of the block's run) into its stage,
// one cp.async group (empty past the end, so every iteration commits exactly one group).
template <typename stream_t>
__device__ __forceinline__ void issue_tile(const Block& k, const stream_t* src, int tile) {
  constexpr int kRows = kTileRows<stream_t>;
  const int row0 = tile * kRows;
  if (row0 < k.rows) {
    unsigned char* dst = k.smem + k.at.pipe() + (tile % kStages) * kTileBytes;
    const auto* from = reinterpret_cast<const unsigned char*>(src + std::int64_t{row0} * kDstate);
    using S = Stage<stream_t>;
    if (row0 + kRows <= k.rows) {
      // A whole tile: a thread's pieces are kReplayThreads apart and share one swizzle (Stage),
      // so they take one offset computation and constant strides (a per-piece index computation
      // was a third of a reading block's instructions in the tile loop).
      constexpr int kStride = kReplayThreads * 16;
      static_assert(kTileBytes % kStride == 0, "whole rounds of pieces");
      const int to = S::piece_offset(int(threadIdx.x));
      const int at = int(threadIdx.x) * 16;
#pragma unroll
      for (int i = 0; i < kTileBytes / kStride; ++i) {
        cp_async_16(dst + to + i * kStride, from + at + i * kStride);
      }
    } else {
      const int bytes = (k.rows - row0) * kDstate * int(sizeof(stream_t));
      for (int c = threadIdx.x; c < bytes / 16; c += blockDim.x) {
        cp_async_16(dst + S::piece_offset(c), from + c * 16);
      }
    }
  }
  cp_async_commit();
}

// Whether a fold runs on the tensor cores (fold_tile_mma): its 16-row m-tiles must not straddle
// two heads, whose weights differ.
__device__ __forceinline__ bool fold_on_tensor_cores(const Block& k) { return k.P % 16 == 0; }

// Two adjacent values of a stage row as fp32, and back (vec.cuh's Packed: rounded as the
// checkpoint store rounds them).
template <typename T>
__device__ __forceinline__ void load_pair(const T* at, float (&v)[2]) {
  Packed<T, 2> p;
  p.load(at);
  p.unpack(v);
}
template <typename T>
__device__ __forceinline__ void store_pair(T* at, const float (&v)[2]) {
  Packed<T, 2> p;
  p.pack(v);
  p.store(at);
}

// The fold of one staged tile on the tensor cores (mma.cuh): S ← τ·S + A·B over the tile's
// rows, A[p][j] = weight_j·x_j[p] (one fp32 product, split into two TF32 parts), B[j][n] =
// B_j[n] (exact in TF32 for bf16 inputs; split too for fp32 ones), records in k-steps of 8
// (zero past w). Each warp takes one 16-row m-tile and a run of its 8-column n-tiles. The
// folded rows go back into the stage (rounded to the stage's type, as the store rounds them),
// and the row pass that follows stores every copy and takes the outputs' dot products from
// them, as after a fold on the CUDA cores. Per state element a fold on the CUDA cores costs w
// FMAs plus a shared-memory load per 4 of them; here it is ~w/64 mma instructions per lane.
template <typename input_t, bool kWindow, typename stream_t>
__device__ void fold_tile_mma(const Block& k, stream_t* stage, int tile) {
  constexpr int kRows = kTileRows<stream_t>;
  constexpr int kMTiles = kRows / 16;
  constexpr int kWarps = kReplayThreads / 32;
  constexpr int kNTiles = (kDstate / 8) * kMTiles / kWarps;  // per warp
  static_assert(kRows % 16 == 0 && kWarps % kMTiles == 0, "a tile is whole m-tiles per warp");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int mt = warp % kMTiles;
  const int r0 = tile * kRows + mt * 16;  // the m-tile's first row in the block's run
  if (r0 >= k.rows) return;               // past the run: the row pass skips these rows
  const int hl = r0 / k.P;
  const int n0 = (warp / kMTiles) * kNTiles * 8;
  const float tau = k.ptr(k.at.fold_tau())[hl];
  const float* weight = k.ptr(k.at.fold_w()) + hl * k.R;
  const input_t* Bs = k.ptr<input_t>(k.at.B());
  const float* Bf = k.ptr(k.at.Bf());
  // B_j[n]: from B's fp32 copy for a single token, widened from the staged B in a window.
  const auto key = [&](int j, int n) {
    if constexpr (kWindow) return to_float(Bs[j * kDstate + n]);
    else return Bf[j * kDstate + n];
  };
  const input_t* xs = k.ptr<input_t>(k.at.x());
  const int xrec = k.hpc * k.P;
  const int row_g = mt * 16 + g, row_g8 = row_g + 8;  // in the stage

  float acc[kNTiles][4];
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
    const int col = n0 + nt * 8 + 2 * t;
    float lo[2], hi[2];
    load_pair(Stage<stream_t>::at(stage, row_g, col), lo);
    load_pair(Stage<stream_t>::at(stage, row_g8, col), hi);
    acc[nt][0] = lo[0] * tau;
    acc[nt][1] = lo[1] * tau;
    acc[nt][2] = hi[0] * tau;
    acc[nt][3] = hi[1] * tau;
  }
  for (int j0 = 0; j0 < k.w; j0 += 8) {
    const int ja = j0 + t, jb = j0 + t + 4;
    const auto a_at = [&](int j, int r) {
      return j < k.w ? weight[j] * to_float(xs[j * xrec + r]) : 0.0f;
    };
    const Tf32Pair a0(a_at(ja, r0 + g)), a1(a_at(ja, r0 + g + 8)), a2(a_at(jb, r0 + g)),
        a3(a_at(jb, r0 + g + 8));
    const std::uint32_t a_hi[4] = {a0.hi, a1.hi, a2.hi, a3.hi};
    const std::uint32_t a_lo[4] = {a0.lo, a1.lo, a2.lo, a3.lo};
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const int n = n0 + nt * 8 + g;
      // Records past w contribute zero and their B (unstaged memory) must not be read.
      const float b0 = ja < k.w ? key(ja, n) : 0.0f;
      const float b1 = jb < k.w ? key(jb, n) : 0.0f;
      if constexpr (std::is_same_v<input_t, float>) {
        const Tf32Pair p0(b0), p1(b1);
        mma_tf32(acc[nt], a_lo, p0.hi, p1.hi);
        mma_tf32(acc[nt], a_hi, p0.lo, p1.lo);
        mma_tf32(acc[nt], a_hi, p0.hi, p1.hi);
      } else {
        mma_tf32(acc[nt], a_lo, __float_as_uint(b0), __float_as_uint(b1));
        mma_tf32(acc[nt], a_hi, __float_as_uint(b0), __float_as_uint(b1));
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
    const int col = n0 + nt * 8 + 2 * t;
    store_pair(Stage<stream_t>::at(stage, row_g, col), {acc[nt][0], acc[nt][1]});
    store_pair(Stage<stream_t>::at(stage, row_g8, col), {acc[nt][2], acc[nt][3]});
  }
}

// Whether a reading step's dot products S·C_t run on the tensor cores (read_tile_mma): bf16
// activations (C exact as a bf16 operand) and a bf16 or fp8 read copy (fp8 widens exactly to
// bf16), fp8 at any window and bf16 from T = 2. An fp32 read copy stays on the CUDA cores: the
// TF32 split that an fp32-accurate product needs cost more than it saved (a T = 4 verify window
// measured 28% slower). So does a bf16 one at T = 1: no widening to save there, and seven of the
// mma's eight n columns would be empty (measured 2-5% slower on the tensor cores).
template <typename input_t, typename stream_t>
inline constexpr bool kReadOnTensorCores =
    std::is_same_v<input_t, bf16_t> &&
    (std::is_same_v<stream_t, bf16_t> || std::is_same_v<stream_t, fp8e4m3_t>);
template <typename input_t, typename stream_t>
__host__ __device__ constexpr bool read_on_tensor_cores(int T) {
  if constexpr (kReadOnTensorCores<input_t, stream_t>) {
    return std::is_same_v<stream_t, fp8e4m3_t> || T >= 2;
  } else {
    return false;
  }
}
/// Whether an instantiation holds that code: one that runs single tokens only (the plain one:
/// T <= 1) holds it only where the rule above takes the tensor cores at T = 1 (fp8); without
/// the code a bf16 copy's single-token kernel spills less.
template <typename input_t, typename stream_t, bool kMultiToken>
inline constexpr bool kReadMmaCompiled = kMultiToken ? kReadOnTensorCores<input_t, stream_t>
                                                     : read_on_tensor_cores<input_t, stream_t>(1);

// The tile shape of read_tile_mma: every warp takes whole rows, all kDstate columns. An fp8
// stage (128 rows) is a 16-row m-tile per warp, the window's tokens the n columns. A bf16 stage
// (64 rows) has half as many m-tiles as warps; splitting their columns between two warps made
// them add their halves with shared-memory float atomics (a compare-and-swap loop on sm_90: a
// sixth of a 4-token window's instructions and a quarter of its stall samples). So there the
// roles swap: the tokens are the m rows (T <= 8 of 16) and each warp's 8 rows the n columns.
template <typename stream_t>
struct ReadMma {
  static constexpr int kWarps = kReplayThreads / 32;
  static constexpr bool kRowsAsN = kTileRows<stream_t> == 8 * kWarps;
  static constexpr int kSteps = kDstate / 16;  // k-steps of 16 columns
  static_assert(sizeof(stream_t) == 4 || kRowsAsN || kTileRows<stream_t> == 16 * kWarps,
                "8 or 16 rows per warp (fp32 stages are read on the CUDA cores)");
  static_assert(kMaxWindow <= 8, "a window's tokens fit the fragments' rows or columns g < 8");
};

// The C fragments of a reading step: C_n for window token n = g (zero past T), in the permuted
// k order of read_tile_mma (k 2t, 2t+1 are columns 4t, 4t+1 of a 16-column step and k 2t+8,
// 2t+9 are 4t+2, 4t+3, so that a lane's state operand is 4 contiguous columns of its row).
// They are the B operand (n = token) of an fp8 stage's mma and the nonzero half of the A
// operand (m = token) of a bf16 stage's: the same registers either way. Loaded once per block:
// C is the same for every tile.
template <typename stream_t>
__device__ __forceinline__ void load_c_fragments(
    const Block& k, std::uint32_t (&c_frag)[ReadMma<stream_t>::kSteps][2]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const auto* c = reinterpret_cast<const std::uint32_t*>(k.ptr<bf16_t>(k.at.C()) + g * kDstate);
#pragma unroll
  for (int s = 0; s < ReadMma<stream_t>::kSteps; ++s) {
    const int col = 16 * s + 4 * t;
    c_frag[s][0] = g < k.T ? c[col / 2] : 0u;
    c_frag[s][1] = g < k.T ? c[col / 2 + 1] : 0u;
  }
}

// Four contiguous values of a stage row as two bf16 pairs (fp8 widened exactly).
__device__ __forceinline__ void load_quad(const bf16_t* at, std::uint32_t& lo, std::uint32_t& hi) {
  const uint2 v = *reinterpret_cast<const uint2*>(at);
  lo = v.x;
  hi = v.y;
}
__device__ __forceinline__ void load_quad(const fp8e4m3_t* at, std::uint32_t& lo,
                                          std::uint32_t& hi) {
  const std::uint32_t v = *reinterpret_cast<const std::uint32_t*>(at);
  lo = fp8x2_to_bf16x2(v & 0xffffu);
  hi = fp8x2_to_bf16x2(v >> 16);
}

// Step 3 of a reading (non-fold) step on the tensor cores: (S·C_n)[row] for the stage's rows
// and every window token n, as one m16n8k16 product per 16 columns, accumulated in fp32 without
// any shuffle. Per lane and tile that is a few shared-memory loads and mma instructions where
// the CUDA cores need, per row, a load, an unpack and an FMA per element and a reduction across
// the row's lanes per token. Every product (token, row) has one writer.
template <CheckpointPrecision P, typename stream_t>
__device__ __forceinline__ void read_tile_mma(
    const Block& k, const stream_t* stage, int tile,
    const std::uint32_t (&c_frag)[ReadMma<stream_t>::kSteps][2]) {
  using Shape = ReadMma<stream_t>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  constexpr int kWarpRows = Shape::kRowsAsN ? 8 : 16;
  const int r0 = tile * kTileRows<stream_t> + warp * kWarpRows;  // in the block's run
  if (r0 >= k.rows) return;
  const int row_g = warp * kWarpRows + g;  // in the stage
  float acc[4] = {};
  if constexpr (Shape::kRowsAsN) {
    // D[token][row]: A = the C fragments in rows g < 8 (rows g + 8 zero), B = 4 contiguous
    // columns of state row g of the warp's 8.
#pragma unroll
    for (int s = 0; s < Shape::kSteps; ++s) {
      std::uint32_t b0, b1;
      load_quad(Stage<stream_t>::at(stage, row_g, 16 * s + 4 * t), b0, b1);
      const std::uint32_t a[4] = {c_frag[s][0], 0u, c_frag[s][1], 0u};
      mma_bf16(acc, a, b0, b1);
    }
  } else {
    // D[row][token]: A = 4 contiguous columns of state rows g and g + 8, B = the C fragments.
#pragma unroll
    for (int s = 0; s < Shape::kSteps; ++s) {
      std::uint32_t a[4];
      load_quad(Stage<stream_t>::at(stage, row_g, 16 * s + 4 * t), a[0], a[2]);
      load_quad(Stage<stream_t>::at(stage, row_g + 8, 16 * s + 4 * t), a[1], a[3]);
      mma_bf16(acc, a, c_frag[s][0], c_frag[s][1]);
    }
  }
  float* dots = k.ptr(k.at.dot());
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    // Where accumulator e of this lane belongs (mma.cuh: D row g + 8·(e / 2), column 2t + e % 2).
    const int r = Shape::kRowsAsN ? r0 + 2 * t + e % 2 : r0 + g + 8 * (e / 2);
    const int n = Shape::kRowsAsN ? g + 8 * (e / 2) : 2 * t + e % 2;
    if (r >= k.rows || n >= k.T) continue;
    float value = acc[e];
    if constexpr (CheckpointTypes<P>::kScaled) value *= k.ptr(k.at.scale())[r];
    dots[n * k.rows + r] = value;
  }
}

// This lane's columns (in order_t's layout) of an fp32 row in shared memory.
template <typename order_t>
__device__ __forceinline__ void lane_columns(const float* row, float (&out)[kPerLane]) {
  Split::gather<order_t>(row, threadIdx.x % kLanesPerRow, out);
}

// (S·C_t)[r] of one row for every window token t, into dots[t][r]: this lane's 16 products,
// summed over the row's 8 lanes. C_0's columns come from registers (c0; every step has a t = 0),
// the later tokens' from Cf. Every lane of the warp must call it (the sums shuffle). With
// kScatter, verify windows sum 4 (or 2) tokens at once (group_sum8_scatter: a third of the
// shuffles); only where registers allow it (an fp32 row being read: elsewhere it spilled).
template <typename order_t, bool kScatter>
__device__ __forceinline__ void row_dots(const Block& k, const float (&v)[kPerLane], int r,
                                         bool active, float row_scale,
                                         const float (&c0)[kPerLane]) {
  static_assert(kLanesPerRow == 8, "group_sum8_scatter sums over 8 lanes");
  if (k.T == 0) return;  // an explicit fold: no window
  const int lane = threadIdx.x % kLanesPerRow;
  float* dots = k.ptr(k.at.dot());
  const auto dot = [&](int t, const float(&c)[kPerLane]) {
    float part = 0.0f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) part += v[e] * c[e];
    part = group_sum<kLanesPerRow>(part);
    if (active && lane == 0) dots[t * k.rows + r] = part * row_scale;
  };
  if constexpr (kScatter) {
    const auto part = [&](int t) {  // this lane's share of (S·C_t)[r]
      float c[kPerLane];
      if (t == 0) {
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) c[e] = c0[e];
      } else {
        lane_columns<order_t>(k.ptr(k.at.Cf()) + t * kDstate, c);
      }
      float sum = 0.0f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) sum += v[e] * c[e];
      return sum;
    };
    const auto sums = [&]<int kN>(int t0) {
      float parts[kN];
#pragma unroll
      for (int u = 0; u < kN; ++u) parts[u] = part(t0 + u);
      const float sum = group_sum8_scatter<kN>(parts);
      const int t = t0 + group_sum8_scatter_index<kN>(lane);
      if (active && group_sum8_scatter_stores<kN>(lane)) {
        dots[t * k.rows + r] = sum * row_scale;
      }
    };
    int t0 = 0;
    for (; t0 + 4 <= k.T; t0 += 4) sums.template operator()<4>(t0);
    if (k.T - t0 >= 2) {
      sums.template operator()<2>(t0);
      t0 += 2;
    }
    if (t0 < k.T) {
      float c[kPerLane];
      lane_columns<order_t>(k.ptr(k.at.Cf()) + t0 * kDstate, c);
      dot(t0, c);
    }
    return;
  }
  dot(0, c0);
  for (int t = 1; t < k.T; ++t) {
    float c[kPerLane];
    lane_columns<order_t>(k.ptr(k.at.Cf()) + t * kDstate, c);
    dot(t, c);
  }
}

// Step 3 of a reading step on the CUDA cores: the dot products of this row group's rows of a
// stage (kRowsPerGroup of them, kRowGroups apart). `lane_x` is the lane's vector index in those
// rows, the swizzle applied (Stage: rows kRowGroups apart share it), so that a row costs its
// loads, conversions, products and sum and nothing else: per-row index arithmetic was as many
// instructions as the products.
template <CheckpointPrecision P, typename stream_t, bool kWindow>
__device__ __forceinline__ void read_rows(const Block& k, const stream_t* stage, int tile,
                                          int group, int lane_x, const float (&c0)[kPerLane]) {
#pragma unroll
  for (int m = 0; m < kRowsPerGroup<stream_t>; ++m) {
    const int srow = m * kRowGroups + group;
    const int r = tile * kTileRows<stream_t> + srow;
    const bool active = r < k.rows;
    float v[kPerLane] = {};
    float row_scale = 1.0f;  // fp8 read copy: S·C = scale·(q·C), the scale applied to the sum
    if (active) {
      typename Split::template Fragment<stream_t> f;
      f.load(stage + srow * kDstate, lane_x);
      f.unpack(v);
      if constexpr (CheckpointTypes<P>::kScaled) row_scale = k.ptr(k.at.scale())[r];
    }
    row_dots<stream_t, kWindow && std::is_same_v<stream_t, float>>(k, v, r, active, row_scale,
                                                                   c0);
  }
}

// Step 3 of a folding step for one row (this lane's 16 columns): row `srow` of `stage`; (hl, p)
// is its head within the block and its row within the head. The row is folded here, unless
// `folded` says fold_tile_mma already did, stored to every copy, and its dot products taken.
template <typename input_t, CheckpointPrecision P, typename stream_t, bool kWindow>
__device__ __forceinline__ void fold_row(const Block& k, const CheckpointHead<P>& ckpt,
                                         const stream_t* stage, int srow, int hl, int p,
                                         bool active, bool folded, const float (&c0)[kPerLane]) {
  using order_t = stream_t;
  const int lane = threadIdx.x % kLanesPerRow;
  const int r = hl * k.P + p;
  float v[kPerLane];
  if (active) {
    typename Split::template Fragment<stream_t> f;
    f.load(stage + srow * kDstate, lane ^ Stage<stream_t>::chunk_xor(srow));
    f.unpack(v);
  } else {
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) v[e] = 0.0f;
  }
  // S ← τ·S, then S += (weight_j·x_j[p])·B_j[n] record by record (cpu fold_head_mamba2).
  const int xrec = k.hpc * k.P;
  const input_t* xs = k.ptr<input_t>(k.at.x());
  const float tau = folded ? 1.0f : k.ptr(k.at.fold_tau())[hl];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) v[e] *= tau;
  const float* weight = k.ptr(k.at.fold_w()) + hl * k.R;
  for (int j = 0; j < (folded ? 0 : k.w); ++j) {
    float key[kPerLane];  // this lane's columns of B_j, in order_t's layout, as fp32
    if constexpr (kWindow) {  // widened from the staged B (replay_smem_for)
      typename Split::template Fragment<input_t, order_t> staged;
      staged.load(k.ptr<input_t>(k.at.B()) + j * kDstate, lane);
      staged.unpack(key);
    } else {
      lane_columns<order_t>(k.ptr(k.at.Bf()) + j * kDstate, key);
    }
    const float xw = active ? weight[j] * to_float(xs[j * xrec + r]) : 0.0f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) v[e] += xw * key[e];
  }
  checkpoint_store<P, Split, order_t>(ckpt, r, lane, active, v);
  // A window's T sums scattered (row_dots) only where the registers allow it: with an fp32
  // master and a bf16 read copy (ptxas: no spills; an fp32 or fp8 read copy's window spilled).
  constexpr bool kScatter = kWindow && P == CheckpointPrecision::kFp32Bf16;
  row_dots<order_t, kScatter>(k, v, r, active, 1.0f, c0);
}

// Step 4 of a verify window for one state row e = hl·P + r of the block: the kN outputs
// t0 .. t0 + kN − 1, which share the history records, so x_j is loaded once for all of them.
// Each output sums in the single-token pass's order: τ_t·(S·C_t), then coef_tj·x_j by j, then
// D·x.
template <typename input_t, int kN>
__device__ __forceinline__ void row_outputs(const Params& p, const Block& k, int e, int t0) {
  const int H = p.cache.dims.heads, P = k.P, T = k.T;
  const int xrec = k.hpc * P;
  const int hl = e / P, r = e - hl * P, h = k.h0 + hl;
  const input_t* x = k.ptr<input_t>(k.at.x()) + k.out0 * xrec + e;
  const float* dots = k.ptr(k.at.dot());
  const float* tau = k.ptr(k.at.tau());
  const float* coef[kN];
  float acc[kN];
#pragma unroll
  for (int u = 0; u < kN; ++u) {
    const int t = t0 + u;
    acc[u] = tau[hl * k.Tm + t] * dots[t * k.rows + e];
    coef[u] = k.ptr(k.at.coef()) + (hl * k.Tm + t) * k.R;
  }
  const int last0 = k.nout - T + t0;  // output t0 + u reads records j <= last0 + u
  for (int j = 0; j <= last0 + kN - 1; ++j) {
    const float xj = to_float(x[j * xrec]);
#pragma unroll
    for (int u = 0; u < kN; ++u) {
      if (j <= last0 + u) acc[u] += coef[u][j] * xj;
    }
  }
  const auto* z = static_cast<const input_t*>(p.z);
  auto* y = static_cast<input_t*>(p.y);
#pragma unroll
  for (int u = 0; u < kN; ++u) {
    const std::int64_t off = ((std::int64_t{k.b} * T + t0 + u) * H + h) * P + r;
    float out = acc[u] + p.D[h] * to_float(x[(last0 + u) * xrec]);
    if (z != nullptr) out *= silu(to_float(z[off]));
    y[off] = from_float<input_t>(out);
  }
}

// Step 4: stores run along head_dim. A single token: one thread per output element (head, p).
// A verify window: a thread per state row of the block, its outputs in runs of up to 4 that
// share their history records (row_outputs; a thread per output, its index divided out of a
// flat count, was 14% of a 4-token window's time).
template <typename input_t, bool kWindow>
__device__ void write_outputs(const Params& p, const Block& k) {
  if constexpr (kWindow) {
    for (int e = threadIdx.x; e < k.hpc * k.P; e += blockDim.x) {
      for (int t0 = 0; t0 < k.T; t0 += 4) {
        switch (k.T - t0) {
          case 1: row_outputs<input_t, 1>(p, k, e, t0); break;
          case 2: row_outputs<input_t, 2>(p, k, e, t0); break;
          case 3: row_outputs<input_t, 3>(p, k, e, t0); break;
          default: row_outputs<input_t, 4>(p, k, e, t0); break;
        }
      }
    }
    return;
  }
  const int H = p.cache.dims.heads, P = k.P, T = k.T;
  const int xrec = k.hpc * P;
  const input_t* xs = k.ptr<input_t>(k.at.x());
  const float* dots = k.ptr(k.at.dot());
  const float* tau = k.ptr(k.at.tau());
  const float* coef_all = k.ptr(k.at.coef());
  const auto* z = static_cast<const input_t*>(p.z);
  auto* y = static_cast<input_t*>(p.y);
  for (int i = threadIdx.x; i < k.hpc * T * P; i += blockDim.x) {
    const int hl = i / (T * P), t = (i / P) % T, r = i % P;
    const int h = k.h0 + hl;
    const int last = k.nout - T + t;
    float acc = tau[hl * k.Tm + t] * dots[t * k.rows + hl * P + r];
    const float* coef = coef_all + (hl * k.Tm + t) * k.R;
    const input_t* x = xs + k.out0 * xrec + hl * P + r;
    for (int j = 0; j <= last; ++j) acc += coef[j] * to_float(x[j * xrec]);
    const std::int64_t off = ((std::int64_t{k.b} * T + t) * H + h) * P + r;
    float out = acc + p.D[h] * to_float(x[last * xrec]);
    if (z != nullptr) out *= silu(to_float(z[off]));
    y[off] = from_float<input_t>(out);
  }
}

// Steps 2–4 with the state streamed from `src` (master when folding, else read copy). With
// `early`, the read copy's first kStages tiles were queued before the staging (small batches).
template <typename input_t, CheckpointPrecision P, typename stream_t, bool kFold, bool kConv,
          bool kWindow>
__device__ void run(const Params& p, const Block& k, const CheckpointHead<P>& ckpt,
                    const stream_t* src, std::uint32_t committed, bool early) {
  constexpr int kS = kStages;
  constexpr int kRows = kTileRows<stream_t>;
  if (early) {
    // The staging, queued after the early tiles, which are this block's first stages of `src`
    // (the kernel dropped any that were not).
    cp_async_wait<0>();
  } else {
#pragma unroll 1
    for (int s = 0; s < kS; ++s) issue_tile(k, src, s);
    cp_async_wait<kS>();  // the staging group, committed before the tiles
  }
  __syncthreads();
  prepare<input_t, kConv, kWindow>(p, k, committed);

  float c0[kPerLane] = {};
  if (k.T > 0) lane_columns<stream_t>(k.ptr(k.at.Cf()), c0);
  const int ntiles = (k.rows + kRows - 1) / kRows;
  const int group = threadIdx.x / kLanesPerRow;
  const int lane_x = (threadIdx.x % kLanesPerRow) ^ Stage<stream_t>::chunk_xor(group);
  // A folding row group's next row: head within the block, row within the head. Row m of the
  // group in a tile is tile row group + 32·m, so the rows a group visits advance by 32 each time.
  int hl = group / k.P, pr = group % k.P;
  bool mma = false;  // whether this fold runs on the tensor cores
  if constexpr (kFold) mma = fold_on_tensor_cores(k);
  constexpr bool kReadMma = !kFold && kReadMmaCompiled<input_t, stream_t, kWindow || kConv>;
  const bool read_mma = kReadMma && p.tc_read && read_on_tensor_cores<input_t, stream_t>(k.T);
  std::uint32_t c_frag[ReadMma<stream_t>::kSteps][2];
  if constexpr (kReadMma) {
    if (read_mma) load_c_fragments<stream_t>(k, c_frag);
  }
  for (int tile = 0; tile < ntiles; ++tile) {
    cp_async_wait<kS - 1>();
    __syncthreads();
    auto* stage = reinterpret_cast<stream_t*>(k.smem + k.at.pipe() + (tile % kS) * kTileBytes);
    if constexpr (kReadMma) {
      if (read_mma) {
        read_tile_mma<P>(k, stage, tile, c_frag);
        __syncthreads();  // the stage is free again
        issue_tile(k, src, tile + kS);
        continue;
      }
    }
    if constexpr (kFold) {
      if (mma) {
        fold_tile_mma<input_t, kWindow>(k, stage, tile);
        __syncthreads();  // a row's columns were folded by several warps
      }
#pragma unroll
      for (int m = 0; m < kRowsPerGroup<stream_t>; ++m) {
        fold_row<input_t, P, stream_t, kWindow>(k, ckpt, stage, m * kRowGroups + group, hl,
                                                pr, hl < k.hpc, mma, c0);
        for (pr += kRowGroups; pr >= k.P; pr -= k.P) ++hl;
      }
    } else {
      read_rows<P, stream_t, kWindow>(k, stage, tile, group, lane_x, c0);
    }
    __syncthreads();  // the stage is free again
    issue_tile(k, src, tile + kS);
  }
  cp_async_wait<0>();
  if (k.T == 0) return;
  write_outputs<input_t, kWindow>(p, k);
  if (k.h0 == 0 && threadIdx.x == 0) {
    p.cache.pending[p.cache.layer_slot(p.layer, k.slot)] = static_cast<std::uint8_t>(k.T);
  }
}

// kWindow: the instantiation for verify windows (T >= 2), with their own output pass, products
// and sums (write_outputs, prepare, row_dots).
template <typename input_t, CheckpointPrecision P, bool kConv, bool kWindow>
__global__ void __launch_bounds__(kReplayThreads, kReplayResidentBlocks)
    replay_kernel(const __grid_constant__ Params params) {
  using Traits = CheckpointTypes<P>;
  extern __shared__ __align__(16) unsigned char smem[];
  grid_dependency_wait();
  allow_dependents();
  const StateCacheLayout& l = params.cache;
  Block k;
  k.b = params.fold_first ? fold_first_row(l, params.slot_ids, params.batch, params.layer,
                                           params.num_tokens, int(blockIdx.y))
                         : int(blockIdx.y);
  k.P = l.dims.rows;
  k.T = params.num_tokens;
  k.R = l.max_records();
  k.Tm = l.config.max_spec_tokens;
  k.smem = smem;
  // The block's heads: a run of `hpc` from blockIdx.x·hpc, and its shared-memory carve-up.
  const auto take_heads = [&](int hpc) {
    k.hpc = hpc;
    k.h0 = int(blockIdx.x) * hpc;
    k.g = k.h0 / (l.dims.heads / l.dims.key_heads);
    k.rows = hpc * k.P;
    k.at = replay_smem_for(k.R, k.Tm, k.P, hpc, int(sizeof(input_t)), checkpoint_traits(P),
                           kWindow);
  };
  // Blocks past the reading rows' runs serve folding rows only (Params::read_heads_per_cta).
  const bool reads = int(blockIdx.x) * params.read_heads_per_cta < l.dims.heads;
  take_heads(reads ? params.read_heads_per_cta : params.heads_per_cta);

  k.slot = slot_in_range(l, params.slot_ids, k.b);
  if (k.slot < 0) return;  // a pad row or a bad id: nothing read or written
  // The allocation flag and both cursors in flight together (and, at small batch, the first
  // tiles of the read copy: reading a free slot's rows is harmless, they are never used).
  const bool allocated = slot_allocated(l, k.slot);
  const std::uint32_t committed = l.committed[k.slot];
  const std::uint32_t folded = fold_cursor_load(l, params.layer, k.slot);
  bool early = params.early_tiles && k.T > 0 && reads;
  if (early) {
    const CheckpointHead<P> guess(l, params.layer, k.slot, k.h0);
#pragma unroll 1
    for (int s = 0; s < kStages; ++s) issue_tile(k, guess.read_row(0), s);
  }
  const FoldCursor cursor = fold_cursor(l, folded, committed, k.T);
  k.fold = cursor.fold;
  const bool idle = !allocated || (!k.fold && (k.T == 0 || !reads));
  if (idle) {
    cp_async_wait<0>();
    return;
  }
  // A folding row takes the finer runs. Its early tiles were the read copy's rows of the
  // reading run: usable only when the read copy is the master and the run is unchanged.
  if (k.fold && k.hpc != params.heads_per_cta) take_heads(params.heads_per_cta);
  const bool early_tiles_reusable = Traits::kReadIsMaster && k.hpc == params.read_heads_per_cta;
  if (early && k.fold && !early_tiles_reusable) {
    cp_async_wait<0>();  // their stages are about to be reissued
    early = false;
  }
  const CheckpointHead<P> ckpt(l, params.layer, k.slot, k.h0);
  // Clamped so that corrupt cursors can never index past the staging.
  k.w = static_cast<int>(std::min<std::uint32_t>(cursor.unfolded, l.max_history()));
  k.out0 = k.fold ? k.w : 0;
  k.nout = (k.fold ? 0 : k.w) + k.T;

  issue_staging<input_t, P, kConv>(params, k, cursor.first, committed);
  if (k.fold) {
    run<input_t, P, typename Traits::master_t, true, kConv, kWindow>(
        params, k, ckpt, ckpt.master_row(0), committed, early);
    if (threadIdx.x == 0) fold_cursor_arrive(l, params.layer, k.slot, committed, gridDim.x);
  } else {
    run<input_t, P, typename Traits::read_t, false, kConv, kWindow>(params, k, ckpt,
                                                                    ckpt.read_row(0), committed,
                                                                    early);
  }
}

// Heads per block: the most of one group (up to kMaxHeadsPerCta, a divisor of heads per
// group) that still gives the GPU >= `blocks_per_sm` blocks per SM; fewer at small batch.
int pick_heads_per_cta(const StateCacheLayout& l, int batch, int sms, int blocks_per_sm) {
  const int hpg = l.dims.heads / l.dims.key_heads;
  for (int hpc = std::min(hpg, kMaxHeadsPerCta); hpc > 1; --hpc) {
    if (hpg % hpc != 0) continue;
    if (std::int64_t{batch} * (l.dims.heads / hpc) >= std::int64_t{blocks_per_sm} * sms) {
      return hpc;
    }
  }
  return 1;
}

template <typename input_t, CheckpointPrecision P>
Status launch(Params params, cudaStream_t stream) {
  const StateCacheLayout& l = params.cache;
  DeviceLimits limits;
  REPLAYSSM_RETURN_IF_ERROR(device_limits(&limits));
  static const int blocks_per_sm =
      tuning_value("REPLAYSSM_TUNE_MAMBA2_BLOCKS_PER_SM", kReplayBlocksPerSm);
  static const int fold_first_min_batch =
      tuning_value("REPLAYSSM_TUNE_FOLD_FIRST_MIN_BATCH", kFoldFirstMinBatch);
  static const int early_tiles_batch =
      tuning_value("REPLAYSSM_TUNE_MAMBA2_EARLY_TILES_BATCH", kEarlyTilesBatch);
  static const int read_blocks_per_sm =
      tuning_value("REPLAYSSM_TUNE_MAMBA2_READ_BLOCKS_PER_SM", kReadBlocksPerSm);
  static const int resident = tuning_value(
      "REPLAYSSM_TUNE_MAMBA2_RESIDENT_BLOCKS",
      P == CheckpointPrecision::kFp32 ? kReplayResidentBlocks : 0);
  const auto fewer = [&](int hpc) {  // the next smaller divisor of the heads per group
    do {
      --hpc;
    } while ((l.dims.heads / l.dims.key_heads) % hpc != 0);
    return hpc;
  };
  // Conv caches' decodes take their own instantiation, so that the plain one is unchanged; so
  // do verify windows of plain caches (T >= 2: their output pass and sums, tuned for windows).
  const bool window = params.conv.in == nullptr && params.num_tokens >= 2;
  auto* kernel = params.conv.in != nullptr ? replay_kernel<input_t, P, true, false>
                 : window                  ? replay_kernel<input_t, P, false, true>
                                           : replay_kernel<input_t, P, false, false>;
  const auto smem_of = [&](int hpc) { return replay_smem(l.config, hpc, window).bytes(); };
  // One head per block always fits: can_implement checked it when the cache was created.
  // Then, where `resident` > 0, fewer heads until that many blocks fit an SM's shared memory,
  // if half the heads or more remain (mamba2_params.cuh, kReplayResidentBlocks).
  const auto fitting = [&](int hpc) {
    while (hpc > 1 && smem_of(hpc) > replay_smem_budget(limits)) hpc = fewer(hpc);
    int cut = hpc;
    while (cut > 1 && resident * (smem_of(cut) + kFoldFirstSmemBytes +
                                  limits.smem_reserved) >
                          limits.smem_per_sm) {
      cut = fewer(cut);
    }
    return 2 * cut >= hpc ? cut : hpc;
  };
  const int hpc_fold =
      fitting(pick_heads_per_cta(l, params.batch, limits.sms, blocks_per_sm));
  const int hpc_read =
      params.num_tokens == 0  // an explicit fold: every row it serves folds
          ? hpc_fold
          : fitting(pick_heads_per_cta(l, params.batch, limits.sms, read_blocks_per_sm));
  // Folding rows take their own finer runs only when the reading runs are much longer.
  const int hpc = hpc_read < kMinReadToFoldHeads * hpc_fold ? hpc_read : hpc_fold;
  params.heads_per_cta = hpc;
  params.read_heads_per_cta = hpc_read;
  const int smem = smem_of(params.read_heads_per_cta);
  params.early_tiles = params.batch <= early_tiles_batch;
  params.fold_first = use_fold_first(params.batch, params.num_tokens, fold_first_min_batch);
  static const bool tc_read = tuning_value("REPLAYSSM_TUNE_MAMBA2_TC_READ", 1) != 0;
  params.tc_read = tc_read;
  if (l.dims.heads / hpc > kMaxFoldBlocks) {
    return unsupported("mamba2 CUDA replay runs up to " + std::to_string(kMaxFoldBlocks) +
                       " blocks per batch row, got " + std::to_string(l.dims.heads / hpc));
  }
  REPLAYSSM_RETURN_IF_ERROR(allow_dynamic_smem(kernel, smem, "mamba2 replay kernel"));
  // Shared memory over L1: three ~70 KB blocks per SM need the largest carveout.
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  const dim3 grid(static_cast<unsigned>(l.dims.heads / hpc), static_cast<unsigned>(params.batch));
  return launch_programmatic(kernel, grid, dim3(kReplayThreads), smem, stream, params,
                             "mamba2 replay kernel");
}

}  // namespace

Status launch_replay(const Params& params, cudaStream_t stream) {
  const StateCacheConfig& c = params.cache.config;
  return ActivationDTypes::dispatch(c.input_dtype, "input dtype", [&](auto in) {
    return CheckpointPrecisions::dispatch(c.checkpoint, "checkpoint precision", [&](auto prec) {
      return launch<dtype_t<in.value>, prec.value>(params, stream);
    });
  });
}

}  // namespace replayssm::cuda::mamba2
