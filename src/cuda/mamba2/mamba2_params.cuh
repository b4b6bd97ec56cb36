#pragma once
// Mamba-2 decode on CUDA: the kernels' Params, their tile shapes, and what is supported.
//
// Both kernels split a state row of dstate = 128 columns over a group of kLanesPerRow = 8
// lanes (16 columns each: one 16-byte vector of fp8, two of bf16, four of fp32, interleaved so
// that each warp-wide access covers whole rows; vec.cuh's RowSplit).
//
// Eager (mamba2_eager.cu): one block per (head, batch row), each thread holding
// kRowsPerThread = 4 rows in registers: ceil(head_dim / 4)·8 threads (128 at head_dim 64, 160
// at 80), 4 rows' loads in flight per thread; 92-93% of copy bandwidth at batch 256.
// Replay (mamba2_replay.cu): see "replay kernel tiling" below.

#include <cuda_runtime.h>

#include <cstdint>

#include "common/checkpoint_traits.h"
#include "cuda/common/dispatch.cuh"
#include "replayssm/ops.h"
#include "replayssm/status.h"
#include "state_cache_layout.h"

namespace replayssm::cuda::mamba2 {

inline constexpr int kDstate = 128;
inline constexpr int kLanesPerRow = 8;
inline constexpr int kRowsPerThread = 4;
inline constexpr int kMaxHeadDim = 128;
inline constexpr int kMaxThreads = (kMaxHeadDim / kRowsPerThread) * kLanesPerRow;  // 256
/// The widest speculative window the CUDA replay kernel verifies (T up to 8).
inline constexpr int kMaxWindow = 8;

using Dstates = Supported<kDstate>;
/// Eager caches' state dtypes: all of them (common/dispatch.cuh).
using EagerStateDTypes = StateDTypes;

/// Everything a decode kernel reads, by value (`const __grid_constant__`).
struct Params {
  StateCacheLayout cache;
  int layer = 0;
  int batch = 0;
  int num_tokens = 0;  ///< T; 0 = an explicit fold (no inputs, no outputs)
  const std::int32_t* slot_ids = nullptr;  ///< [batch]
  const void* x = nullptr;                 ///< [batch, T, nheads, head_dim]
  const float* dt = nullptr;               ///< [batch, T, nheads]
  const void* B = nullptr;                 ///< [batch, T, ngroups, dstate]
  const void* C = nullptr;                 ///< [batch, T, ngroups, dstate]
  const void* z = nullptr;                 ///< [batch, T, nheads, head_dim] or null
  const float* A = nullptr;                ///< [nheads]
  const float* D = nullptr;                ///< [nheads]
  const float* dt_bias = nullptr;          ///< [nheads]
  void* y = nullptr;                       ///< [batch, T, nheads, head_dim]
  /// Conv caches: the pre-conv inputs (then x, B and C are null; replay kernel only).
  ConvInputs conv;
  /// Replay: heads of one group per block for rows whose fold is due (heads / heads_per_cta
  /// blocks per grid row). A row that only reads takes runs of read_heads_per_cta >=
  /// heads_per_cta heads on the first heads / read_heads_per_cta blocks of its grid row; its
  /// other blocks exit at once. At small batch the two differ: reading takes few large blocks
  /// (one wave), while a fold, several times a read's work per byte, spreads over more of them
  /// so that a staggered step's folding rows do not outlast the rest.
  int heads_per_cta = 1;
  int read_heads_per_cta = 1;
  /// Replay: queue the read copy's first tiles before the cursors arrive (kEarlyTilesBatch).
  bool early_tiles = false;
  /// Replay: serve the rows whose fold is due first (state_cache/fold_order.cuh).
  bool fold_first = false;
  /// Replay: a reading step's S·C on the tensor cores for bf16 / fp8 read copies
  /// (mamba2_replay.cu's read_tile_mma); off only to measure.
  bool tc_read = true;
};

/// Eager: threads per block for a head of `head_dim` rows (a whole number of warps).
__host__ __device__ inline int block_threads(int head_dim) {
  const int threads = (head_dim + kRowsPerThread - 1) / kRowsPerThread * kLanesPerRow;
  return (threads + 31) / 32 * 32;
}

// ---- replay kernel tiling (mamba2_replay.cu) ----------------------------------------------
//
// One block per (batch row, run of heads_per_cta heads of one group): the group's B and C and
// its B_j·C_t products are staged and computed once for all its heads, and the heads' state
// blocks, contiguous in memory, stream through a ring of kStages shared-memory tiles of
// kTileBytes (cp.async). 256 threads: 32 row groups of 8 lanes; a tile holds 32 fp32 rows,
// 64 bf16 or 128 fp8 rows, so each row group takes 1, 2 or 4 rows of it: the same bytes and
// the same two barriers per tile whatever the dtype.
inline constexpr int kReplayThreads = 256;
inline constexpr int kRowGroups = kReplayThreads / kLanesPerRow;  // 32
inline constexpr int kTileBytes = 16 * 1024;
inline constexpr int kStages = 2;
inline constexpr int kPipeBytes = kStages * kTileBytes;
inline constexpr int kMaxHeadsPerCta = 8;
/// Up to this batch a replay block queues its first state tiles before its cursors and ring
/// staging: a small batch is one memory round trip after another, and the tiles then arrive
/// with the cursors. Measured (super120b, fp32, µs per step): batch 1 10.1 → 9.6, 4 20.9 →
/// 19.9, 16 42.4 → 42.1; at batch 64 the early tiles delay the staging the prologue waits for,
/// 131.1 → 133.5 (and +1-3% at 256; docs/BENCHMARKS_CUDA_MAMBA2.md, sections 5 and 6), measured
/// before the one-loop staging (section 8); REPLAYSSM_TUNE_MAMBA2_EARLY_TILES_BATCH overrides it.
inline constexpr int kEarlyTilesBatch = 16;
/// Heads per block are chosen so that a launch has at least this many blocks per SM: for rows
/// whose fold is due (Params::heads_per_cta), and for rows that only read
/// (Params::read_heads_per_cta). super120b, µs per step, staggered / aligned, fp32 · bf16 ·
/// fp32+bf16 · fp32+fp8, both at 4: batch 4 19.3 / 19.5 · 19.5 / 19.5 · 19.2 / 19.4 ·
/// 21.6 / 21.6, both at 1: 14.6 / 13.4 · 14.8 / 12.6 · 14.4 / 12.3 · 15.8 / 12.9; at batch 16
/// both at 1 read in a quarter of the blocks (aligned 28.5 · 23.4 · 22.3 · 21.7) but a
/// staggered step's folding blocks then outlast it (50.1 · 63.7 · 54.9 · 72.4): hence the
/// two choices (docs/BENCHMARKS_CUDA_MAMBA2.md, "Small batches").
inline constexpr int kReplayBlocksPerSm = 4;
inline constexpr int kReadBlocksPerSm = 1;
/// Folding rows take their own finer runs only when the reading runs are at least this many
/// times longer: each extra block of a reading row still reads its cursors before it exits, and
/// at batch 4 (super120b: runs of 2 heads against 1) those blocks cost more than the shorter
/// folds save: 16.5 / 15.8 µs (fp32, staggered / aligned) against 14.6 / 13.4 with runs of 2 for
/// both; at batch 16 (8 against 2) the split takes fp32 from 50.1 / 28.5 to 32.3 / 33.8.
inline constexpr int kMinReadToFoldHeads = 3;
/// Blocks that the register budget lets an SM hold (replay_kernel's launch bounds), and what
/// launch() cuts heads per block toward for an fp32 read copy. A verify window's staging grows with
/// max_spec_tokens: at L = 16 super120b's blocks of 8 heads take ~67 KB at T = 2 and ~80 KB at T =
/// 4 (~78 and ~94 KB while windows staged B in fp32 too), so only 2 stay resident at T = 4. An fp32
/// read copy (T dot products per row on the CUDA cores) gains from the third block's warps, so its
/// heads per block are cut until this many blocks fit an SM's shared memory, when half the heads or
/// more remain (REPLAYSSM_TUNE_MAMBA2_RESIDENT_BLOCKS overrides the count for every precision; 0 =
/// never). Batch 256, µs per window, cut · kept (docs/BENCHMARKS_CUDA_MAMBA2.md, section 9):
/// super120b fp32 T = 2 390 · 412, T = 4 578 · 611; nano4b fp32 T = 4 (6 → 3 heads) 571 · 570. Not
/// for the tensor-core reads (fp32+fp8 T = 4 569 · 552 on super120b, 7% worse on nano4b), nor
/// deeper cuts (T = 8, 8 → 1 heads: fp32 1780 · 1602, the window staged 8 times as often); measured
/// with the larger staging. T = 1 blocks with bf16 activations (~69 KB) fit 3 already; with fp32
/// activations (~93 KB) they are cut (not measured).
inline constexpr int kReplayResidentBlocks = 3;
/// From this batch a replay launch serves the rows whose fold is due first
/// (state_cache/fold_order.cuh). super120b, staggered / aligned, µs: batch 16, fp32 · bf16 ·
/// fp32+bf16 · fp32+fp8 39.2 / 37.5 · 41.6 / 36.1 · 39.1 / 35.3 · 41.1 / 36.0 without it,
/// 38.6 / 39.6 · 38.2 / 38.3 · 37.1 / 37.5 · 38.1 / 38.1 with it; batch 64 and 256 in
/// docs/BENCHMARKS_CUDA_MAMBA2.md, "Fold-first".
inline constexpr int kFoldFirstMinBatch = kEarlyTilesBatch;

/// Shared-memory carve-up of a replay block, in bytes (16-byte aligned pieces).
struct ReplaySmem {
  int R;           // records staged (StateCacheLayout::max_records)
  int Tm;          // widest window (max_spec_tokens)
  int P;           // head_dim
  int hpc;         // heads per block
  int in_bytes;    // activation dtype size
  int scale_rows;  // rows whose read-copy scale is staged: hpc·P for a scaled (fp8) copy, else 0
  int keys_f32;    // records whose B is staged as fp32 too: R for single-token launches, else 0
  __host__ __device__ static int align16(int b) { return (b + 15) / 16 * 16; }
  __host__ __device__ int pipe() const { return 0; }                                // tiles
  __host__ __device__ int x() const { return kPipeBytes; }                          // [R][hpc][P] input
  __host__ __device__ int B() const { return x() + align16(R * hpc * P * in_bytes); }  // [R][N] input
  __host__ __device__ int C() const { return B() + align16(R * kDstate * in_bytes); }  // [Tm][N] input
  __host__ __device__ int Bf() const { return C() + align16(Tm * kDstate * in_bytes); }  // [keys_f32][N]
  __host__ __device__ int Cf() const { return Bf() + keys_f32 * kDstate * 4; }       // [Tm][N] fp32
  __host__ __device__ int scale() const { return Cf() + Tm * kDstate * 4; }          // [scale_rows]
  __host__ __device__ int dt() const { return scale() + align16(scale_rows * 4); }  // [R][hpc]
  __host__ __device__ int decay() const { return dt() + align16(R * hpc * 4); }     // [R][hpc]
  __host__ __device__ int cum() const { return decay() + align16(R * hpc * 4); }    // [hpc][R]
  __host__ __device__ int fold_w() const { return cum() + align16(hpc * R * 4); }   // [hpc][R]
  __host__ __device__ int fold_tau() const { return fold_w() + align16(hpc * R * 4); }  // [hpc]
  __host__ __device__ int tau() const { return fold_tau() + align16(hpc * 4); }     // [hpc][Tm]
  __host__ __device__ int G() const { return tau() + align16(hpc * Tm * 4); }       // [Tm][R]
  __host__ __device__ int coef() const { return G() + align16(Tm * R * 4); }        // [hpc][Tm][R]
  __host__ __device__ int dot() const { return coef() + align16(hpc * Tm * R * 4); }  // [Tm][hpc·P]
  __host__ __device__ int bytes() const { return dot() + align16(hpc * Tm * P * 4); }
};

/// The carve-up for R records, windows up to Tm, head_dim P, hpc heads, activations of
/// in_bytes, a checkpoint with traits t, and a launch of the verify-window instantiation or
/// not: the one rule for the host (replay_smem) and the kernel. Only a scaled read copy (fp8)
/// stages its rows' scales. Single-token launches keep an fp32 copy of B (their tuned code
/// reads it); verify windows widen the staged B as they load it, and the R·512 bytes saved
/// let 3 of super120b's 4-token window blocks at L = 8 fit an SM instead of 2.
__host__ __device__ inline ReplaySmem replay_smem_for(int R, int Tm, int P, int hpc, int in_bytes,
                                                     CheckpointTraits t, bool window) {
  return ReplaySmem{R, Tm, P, hpc, in_bytes, t.lo_row_scale ? hpc * P : 0, window ? 0 : R};
}

/// The shared memory of a replay block of `heads_per_cta` heads for a cache's config, for a
/// launch of the verify-window instantiation or not (the default: the larger carve-up).
inline ReplaySmem replay_smem(const StateCacheConfig& c, int heads_per_cta, bool window = false) {
  return replay_smem_for(max_records(c.buffer_len, c.max_spec_tokens), c.max_spec_tokens,
                         c.mamba2.head_dim, heads_per_cta, int(dtype_size(c.input_dtype)),
                         checkpoint_traits(c.checkpoint), window);
}

/// Whether a cache's shape takes the generic kernels: dstate other than kDstate, or rows past
/// kMaxHeadDim.
inline bool uses_generic_kernels(const Mamba2Shape& s) {
  return s.dstate != kDstate || s.head_dim > kMaxHeadDim;
}

}  // namespace replayssm::cuda::mamba2
