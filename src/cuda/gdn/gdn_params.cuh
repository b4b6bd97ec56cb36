#pragma once
// Gated DeltaNet decode on CUDA: the tile, the kernels' Params, and what is supported.
//
// One CTA = (batch row, key head, row split). A key head's Hv/Hk value heads are consecutive
// and their state blocks [V, K] are contiguous, so the CTA sees one matrix of G·V rows × K
// columns and reads the key head's keys (q̂, k, ring keys) once for all G value heads: no
// value head re-reads a shared key from memory (ALGORITHM.md §2).
//
// A state row of K ≤ 128 columns is spread over kRowLanes = 8 consecutive lanes (vec.cuh's
// RowSplit), 16 columns per lane in 16-byte vectors: each warp-wide access covers four rows
// of 8·16 contiguous bytes, a dot product over a row is 16 FMAs per lane + 3 shuffles, and
// the 8 lanes of a row reduce without touching shared memory.
//
// head_k_dim is a runtime value (any multiple of 16 up to 128): vectors of a lane whose
// columns lie past K are masked as a whole (a vector never straddles K since K % 16 == 0),
// so one instantiation serves the real shapes (K = 128) and the small ones tests use.

#include <algorithm>
#include <cstdint>

#include "cuda/common/dispatch.cuh"
#include "cuda/common/vec.cuh"
#include "cuda/gdn/gdn_staging.h"
#include "replayssm/types.h"
#include "state_cache_layout.h"

namespace replayssm::cuda::gdn {

/// Replay tile. A replay step is bound by how many CTAs per SM are in their prologue at once
/// (slot → cursor loads → ring staging → the serial walk: ~9 µs under load, during which a
/// CTA streams little), more than by the bytes a CTA has in flight. Measured on the H200
/// (qwen35-4b, batch 256, L = 16, µs per step, fp32 / bf16 / fp32+bf16 checkpoint):
///   256 threads × 80 regs, 3 CTAs/SM, state loaded after the walks          210 / -   / 180
///   256 threads × 128 regs, 2 CTAs/SM, whole 64 KB slice prefetched          340 / -   / 228
///   128 threads × 80 regs, 6 CTAs/SM, 128 B/thread prefetched                200 / 165 / 156
///     + 1 to 3 more 16 KB passes in flight through shared memory (bulk copies; 4-6 CTAs/SM)
///                                                                 198-257 / 175-261 / 165-246
///   64 threads × 80 regs, 12 CTAs/SM, 128 B/thread                           199 / 153 / 148
///   64 threads × 64 regs, 16 CTAs/SM, 64 B/thread                            208 / 153 / 155
///   256 threads × 64 regs, 4 CTAs/SM, 64 B/thread                            209 / 167 / 168
///   CTAs split per value head (64 or 128 threads): 4-27 µs slower (walks, staging repeated)
///   128 threads × 64 regs, 8 CTAs/SM, 64 B/thread, 1 fold row per thread     197 / 145 / 147
///   the same, 2 fold rows per thread (this; gdn_replay.cu, kFoldRows)        190 / 145 / 143
/// (the previous tile, 6 CTAs/SM, measured in that same run: 201 / 165 / 157)
constexpr int kThreads = 128;
constexpr int kReplayMinBlocks = 8;
/// Shared memory against residency (gdn_staging.h, replay_staging). A CTA stages its key
/// head's ring records and walks for the G value heads it serves; at 4 value heads per key head
/// (qwen35-122b) that is 33 KB a single-token CTA and 43 KB for a 4-token window, so 6 and 5
/// CTAs share an SM where the registers allow 8 (4 for 8-token windows at either shape). So
/// where fewer than kReplayResidentFloor CTAs staging all G fit an SM, each CTA stages only its
/// split's heads (ReplaySmem::heads), over further splits of a key head's rows while still
/// fewer fit; elsewhere a CTA stages only its split's heads in verify windows, and in
/// single-token steps where that makes the whole launch resident at once (small batches).
/// Measured (one build, the rule against REPLAYSSM_TUNE_GDN_SPLIT_HEADS=0, every CTA staging
/// all G; qwen35-122b unless noted, L = 16, staggered, µs per step): T = 4 windows (random
/// acceptance) at batch 256 bf16 597.3 → 497.8, fp32 687.3 → 570.1, at 64 183.4 → 145.2;
/// qwen35-4b T = 4 at 64 95.2 → 90.2; single tokens at batch 16 bf16 39.4 → 36.7, fp32+bf16
/// 39.6 → 36.6; T = 8 (a first call) at 64 fp32 593.2 → 345.8, qwen35-4b 175.4 → 148.0, at
/// 256 557.5 → 518.6. Not taken, as they lost (that first call): splitting single-token steps
/// from 6 to 8 CTAs an SM (batch 256: fp32 364.8 → 374.7, bf16 245.4 → 255.6; 1024 bf16
/// 1030.7 → 1080.8), staging a split's heads in single-token steps of several waves (batch 64:
/// 6 → 8 CTAs an SM, fp32 105.0 → 110.0), and splitting qwen35-4b T = 4 windows from 7 to 8
/// (batch 256 bf16 256.3 → 276.2). docs/BENCHMARKS.md, "2026-12-04 (evening)".
/// REPLAYSSM_TUNE_GDN_RESIDENT sets the floor (0: no further splits).
constexpr int kReplayResidentFloor = 6;
/// A key head's rows are split over at least this many replay CTAs, at every batch. Two splits
/// once halved the tail of staggered steps (their folding CTAs finishing on an idle GPU); the
/// fold-first order (kFoldFirstMinBatch) removes that tail, and one split stages each key
/// head's history once. qwen35-4b, L = 16, µs per step, staggered / aligned, fp32 · bf16 ·
/// fp32+bf16 · fp32+fp8, both with the fold-first order: batch 256, 2 splits 201 / 209 ·
/// 175 / 175 · 180 / 177 · 211 / 207, 1 split 180 / 192 · 148 / 148 · 153 / 150 · 189 / 179;
/// batch 1024, fp32 829 → 701, bf16 761 → 592 (docs/BENCHMARKS_CUDA_GDN.md, "Fold-first").
constexpr int kMinRowSplits = 1;
/// The rows of a replay CTA are a multiple of this: one fold pass (gdn_replay.cu,
/// kFoldPassRows). A split smaller than a fold pass (fp32 read copies, whose read passes are 16
/// rows, took 16-row splits at batch 1 to 4) leaves half of a folding CTA's threads without a
/// row and stages the history and walks the queries in twice as many CTAs; a split of a whole
/// fp8 read pass (64 rows) folds in two passes where 32 rows fold in one, while its read is a
/// single pass either way (rows past a split's end are skipped). qwen35-4b, L = 16, µs per
/// step, read pass → fold pass (REPLAYSSM_TUNE_GDN_SPLIT_ROWS=0 → 32, one build): fp32 batch 4
/// staggered 13.4 → 11.8, aligned 12.7 → 11.1, T = 4 windows at batch 4 27.8 → 19.2; fp32+fp8
/// staggered 2-4% faster at batch 1-8; costs: fp32 batch 1 8.9 → 9.2, aligned fp32+fp8 batch 8
/// 15.4 → 18.3 (docs/BENCHMARKS_CUDA_GDN.md, "A replay CTA's rows in whole fold passes").
constexpr int kSplitRows = 32;
/// The unit of a split: `split_rows` rounded up to a multiple of `access_rows` (the rows a CTA
/// touches per access, kRowGroups), or a read pass of `pass_rows` when it is 0.
constexpr int split_granule(int pass_rows, int split_rows, int access_rows) {
  return split_rows > 0 ? (split_rows + access_rows - 1) / access_rows * access_rows : pass_rows;
}

/// From this batch a replay launch serves the rows whose fold is due first
/// (state_cache/fold_order.cuh). Below it a launch's CTAs are all resident at once (8 per SM),
/// so the order cannot shorten the step, and the read copy's prefetch, issued before the
/// cursors at small batch, would have to wait for the order's cursor pass.
constexpr int kFoldFirstMinBatch = 32;
/// With an fp32 read copy (16 passes of one row per thread) and from this batch, a replay CTA
/// also requests its next kL2PrefetchPasses passes into L2 (one bulk prefetch each, issued by
/// one thread: bytes in flight that take neither registers nor shared memory, which bound every
/// other way of adding them). qwen35-4b, L = 16, staggered, µs per step, none → 2 passes (4:
/// slower everywhere), two rounds in one call: batch 256 fp32 176.6 → 171.2, spec T = 4 fp32
/// 341.1 → 329.8, batch 1024 fp32 692 → 692; bf16 read copies gained nothing clear (256:
/// 139.9 → 139.5, spec 366.8 → 370.2, 1024: 554 → 543) and batch 64 lost (fp32 55.7 → 57.7,
/// bf16 48.5 → 51.1). Mamba-2's tiles, prefetched the same way, measured slower (up to +4%).
/// docs/BENCHMARKS_CUDA_GDN.md, "L2 prefetch". Single-token steps now stage their passes
/// (stages_passes) and prefetch nothing: beside staging it cost 3-5% (staggered, batch 1024
/// and 256), and without it the register kernel's aligned steps at 1024 ran 10% faster too
/// (830 → 750 µs; "Staged passes"). So it serves fp32 verify windows.
constexpr int kL2PrefetchPasses = 2;
constexpr int kL2PrefetchMinBatch = 256;
/// Whether a fold replays its records two at a time (gdn_replay.cu, phase 3'): one chain of
/// row sums per pair instead of per record, the same instructions within a few percent. It
/// shortens each folding CTA, which is what a staggered step waits for when a launch is one or
/// two waves of CTAs; where several waves keep the GPU busy around the folds, and under the
/// verify-window kernel, the record-by-record fold ran faster. qwen35-4b, L = 16, µs per step,
/// staggered, record by record → pairs (one build, REPLAYSSM_TUNE_GDN_FOLD_PAIRS): batch 16
/// bf16 24.8 → 22.0, fp32+bf16 25.5 → 23.1, fp32 25.7 → 24.3; batch 64 bf16 47.9 → 45.5,
/// fp32+bf16 50.1 → 47.7; batch 256 fp32+bf16 133.4 → 136.2, bf16 126.9 → 128.9; 4-token
/// windows at 256 fp32 292.5 → 299.7 (docs/BENCHMARKS_CUDA_GDN.md, "Folds in pairs"). Windows
/// below 256 (REPLAYSSM_TUNE_GDN_FOLD_PAIRS=2: every fold in pairs) gained at T = 2 and batch
/// 16 (4-5%) and lost at batch 64 (1-4%) and T = 4 from 64 (1-4%): no rule that would hold, so
/// windows stay record by record ("Verify windows folding in pairs").
constexpr int kFoldPairsBatchLimit = 256;
constexpr bool folds_in_pairs(bool window_kernel, int batch) {
  return !window_kernel && batch < kFoldPairsBatchLimit;
}
/// Bytes of the read copy each thread has in flight per pass (fp32: 1 row, bf16 2, fp8 4).
constexpr int kReplayRowBytes = 64;
/// The 16-byte pieces of one thread's pass.
constexpr int kPassPieces = kReplayRowBytes / 16;
/// Whether a step's outputs read a low-precision copy on the tensor cores (gdn_replay.cu,
/// read_window_mma): S·t for every row and token as m16n8k16 bf16 products (fp8 widened
/// exactly), the walked queries t carried as two bf16 parts (hi + lo, within 2^-16 of t: far
/// below the read copy's own rounding), where the CUDA cores need per row and token 16
/// products, the queries' loads from shared memory and a reduction across the row's lanes.
/// Value heads of a multiple of 16 rows (a product's 16 rows share one head's queries);
/// REPLAYSSM_TUNE_GDN_TC_READ=0 turns it off. Verify windows of a bf16 or fp8 copy, and
/// single-token steps of an fp8 copy, whose rows the CUDA cores would each widen from e4m3
/// element by element (qwen35-4b, staggered: 178.6 → 154.1 µs at batch 256, 668 → 580 at
/// 1024, 60.5 → 56.6 at 64; batch 1 11.2 → 11.6). A single-token bf16 step stays on the CUDA
/// cores: its staged passes (stages_passes) keep two passes in flight, where the tensor-core
/// read loads each tile as it reaches it, and the same build ran it 6% slower at batch 256 and
/// 8% at 64. An fp32 copy would need three TF32 products per pair of parts for its accuracy
/// and stays on the CUDA cores.
constexpr bool reads_on_tensor_cores(CheckpointPrecision p, bool window) {
  return window ? p != CheckpointPrecision::kFp32 : p == CheckpointPrecision::kFp32Fp8;
}
/// Whether single-token steps of a bf16 read copy (bf16 and fp32+bf16 checkpoints) sum their
/// staged passes (stages_passes) on the tensor cores (gdn_replay.cu, read_staged_mma): each
/// warp's 8 rows of a pass are the n columns of m16n8k16 products whose A rows are the walked
/// query's bf16 hi part (row 0) and lo part (row 8), so one product gives both and no row is
/// reduced across lanes: 100 instructions per warp and pass where the CUDA cores take 219.
/// Plain caches only (a conv cache's instantiation keeps the CUDA cores), and from
/// kStagedMmaMinBatch rows. At batch 256 a staggered step is bound by instruction issue (the
/// folds' and the passes'), and there it pays; a small batch's step is the latency of each
/// CTA's chain, which the products' dependent accumulations lengthen. qwen35-4b, L = 16, µs,
/// CUDA cores → tensor cores (two rounds): staggered batch 256 bf16 126.9 → 122.4, fp32+bf16
/// 132.9 → 127.8; 1024 501.4 → 495.4, 517.6 → 518.1; batch 64 45.3 → 46.0, 47.6 → 48.8; batch
/// 1-16 +4-5%; aligned 256 127.8 → 130.3, 1024 505.5 → 535.8 (bf16).
constexpr bool stages_on_tensor_cores(CheckpointPrecision p, bool window, bool conv) {
  return !window && !conv &&
         (p == CheckpointPrecision::kBf16 || p == CheckpointPrecision::kFp32Bf16);
}
constexpr int kStagedMmaMinBatch = 128;
/// k-steps of a staged tensor-core read of K columns (each lane's four 16-byte vectors of a
/// bf16 row feed two steps each), and the shared memory of its query fragments: per local
/// value head, k-step and column lane t of the A rows 0 and 8, one 16-byte fragment, and one
/// head's worth of zeros, which the lanes holding other A rows read.
constexpr int staged_mma_steps(int K) { return 2 * ((K + 31) / 32); }
constexpr int staged_mma_query_bytes(int G, int K) {
  return (G + 1) * staged_mma_steps(K) * 4 * 16;
}
/// Columns of a 16-byte vector of a read copy of `read_bytes`-byte values, and the k-steps of
/// 16 columns of a tensor-core read of K columns: each lane's vector feeds vector_cols / 4 of
/// them, a row's four lanes 4·vector_cols columns.
constexpr int mma_vector_cols(int read_bytes) { return 16 / read_bytes; }
constexpr int mma_read_steps(int K, int read_bytes) {
  const int vc = mma_vector_cols(read_bytes);
  return vc / 4 * ((K + 4 * vc - 1) / (4 * vc));
}
/// Shared memory of the tensor-core read's query fragments: per local value head and k-step,
/// each lane's four registers (hi and lo parts of b0 and b1).
constexpr int mma_query_bytes(int G, int K, int read_bytes) {
  return G * mma_read_steps(K, read_bytes) * 32 * 16;
}
/// Shared memory of one staged pass of a replay CTA (stages_passes): every thread's pieces.
constexpr int kReplayPassBytes = kThreads * kReplayRowBytes;
/// Whether a replay kernel streams its read copy's passes through shared memory (cp.async,
/// gdn_replay.cu) rather than registers: two passes in flight while one is summed, none of
/// them in registers. qwen35-4b, L = 16, µs per step, registers → staged (the L2 prefetch off
/// where staged), staggered / aligned: batch 256 fp32 171.6 / 193.7 → 170.3 / 186.1, bf16
/// 139.6 / 139.6 → 132.6 / 133.2, fp32+bf16 133.4 / 131.4 → 132.2 / 130.7; batch 1024 fp32
/// 691 / 830 → 683 / 729, bf16 553 / 558 → 525 / 530, fp32+bf16 525 → 520; batch 64 fp32
/// and bf16 within ±1.5%, fp32+bf16 48.2 → 50.9; batch 1 fp32 10.1 → 8.9, bf16 10.0 → 9.3.
/// fp32+fp8 keeps register passes: staged it lost 6-11% (its folds spilled more, and a row's
/// scale is one more copy per lane). Verify-window kernels (`window`) never stage: their
/// staging already takes the shared memory an 8 KB pass buffer would take from the blocks an
/// SM holds. docs/BENCHMARKS_CUDA_GDN.md, "Staged passes".
constexpr bool stages_passes(CheckpointPrecision p, bool window) {
  return !window && p != CheckpointPrecision::kFp32Fp8;
}
constexpr int kWarps = kThreads / 32;
/// Eager tile (gdn_eager.cu has the measurements): 64 threads, 2 rows in flight per thread,
/// 12 CTAs per SM (80 registers), one pass of 16 rows per CTA.
constexpr int kEagerThreads = 64;
constexpr int kEagerRows = 2;
constexpr int kEagerMinBlocks = 12;
constexpr int kMaxHeadKDim = 128;  ///< K tile: rows are split as if K were 128
constexpr int kHeadKDimStep = 16;  ///< K must be a multiple: one 16-byte fp8 vector
constexpr int kMaxHeadVDim = 128;  ///< a walking warp holds V/32 outputs per lane
constexpr int kRowLanes = 8;
constexpr int kRowGroups = kThreads / kRowLanes;  ///< rows a replay CTA touches per access
using Split = RowSplit<kMaxHeadKDim, kRowLanes>;
constexpr int kPerLane = Split::kPerLane;  ///< 16 columns of a row per lane
constexpr int kWalkPerLane = kMaxHeadKDim / 32;

// ---------------------------------------------------------------------------------------------
// What is supported: each list feeds the dispatch and the error text (dispatch.cuh).

/// Eager state dtypes. f16 state has no user among the target models.
using EagerStateDTypes = Supported<DType::kF32, DType::kBF16>;
/// head_k_dim: multiples of 16 up to 128.
using HeadKDims = Supported<16, 32, 48, 64, 80, 96, 112, 128>;
/// Window widths a decode may verify (1 = plain decode). T > 8 would need more walking warps
/// than a CTA has to keep every window position's walk in flight at once.
using WindowWidths = Supported<1, 2, 3, 4, 5, 6, 7, 8>;
/// The widest window an eager cache verifies (max_spec_tokens), tuned and generic kernels alike:
/// both stage a window's normalised q and k in shared memory, one row each per token.
constexpr int kMaxEagerWindow = WindowWidths::max();

// ---------------------------------------------------------------------------------------------
// Params

/// Inputs of one decode call, as GdnDecodeArgs (ops.h) in device memory.
struct GdnInputs {
  const std::int32_t* slot_ids = nullptr;  ///< [batch]
  const void* q = nullptr;                 ///< [batch, T, Hk, K]  input dtype
  const void* k = nullptr;                 ///< [batch, T, Hk, K]  input dtype
  const void* v = nullptr;                 ///< [batch, T, Hv, V]  input dtype
  const float* g = nullptr;                ///< [batch, T, Hv]
  const float* beta = nullptr;             ///< [batch, T, Hv]
  void* o = nullptr;                       ///< [batch, T, Hv, V]  input dtype
  ConvInputs conv;  ///< conv caches (replay kernel only): q, k, v before the conv
  bool qk_l2norm = true;
  float q_scale = 1.0f;  ///< resolved: args.scale, or K^-1/2 when 0 (as the CPU computes it)
};

struct EagerParams {
  StateCacheLayout cache;
  GdnInputs in;
  int layer = 0;
  int num_tokens = 1;     ///< T (> 1 only on a cache with a state copy per draft)
  int heads_per_key = 1;  ///< G
  RowTiling tiling;
};

/// Shared memory of the replay kernel, offsets from the dynamic base. Fp32 arrays first, then
/// the staged ring records in the input dtype (16-byte aligned for cp.async).
///
/// The per-value-head arrays (tq, oring, the v records, the tensor-core reads' query
/// fragments) hold `heads` value heads: all G of the key head, or, where each split's rows
/// are an aligned run of fewer (gdn_replay.cu, split_heads) and the launch chooses it
/// (replay_staging, kReplayResidentFloor), only a split's: local head h at h & head_mask
/// (staged_head).
struct ReplaySmem {
  int heads = 1;       ///< value heads staged: G, or a power of two below it
  int head_mask = -1;  ///< heads − 1 where fewer than G are staged, else all ones
  /// float [T][heads][kMaxHeadKDim]: each window token's q̂ (zero past K), which each walk
  /// turns into its walked query, met by the checkpoint (gdn_replay.cu, stage_window)
  int tq = 0;
  int oring = 0;  ///< float [T][heads][V]         the walks' ring part of the outputs
  int alpha = 0;  ///< float [records][G]          e^g
  int beta = 0;   ///< float [records][G]
  int kscale = 0;  ///< float [records]             k's normalisation factor (ring_key_scale)
  int pair_dot = 0;  ///< float [records]           folds in pairs: raw k_j·k_{j+1}, even j
  int key_bytes = 0;  ///< input_t [records][K]    raw k (history, then window); k̂ = k·kscale
  int vec_bytes = 0;  ///< input_t [records][vec_stride]  v of the staged heads
  int vec_stride = 0;
  int conv_q_bytes = 0;  ///< conv caches: input_t [T][K]  the window's q after the conv
  /// Single-token steps: two buffers of kReplayPassBytes, through which the read copy's passes
  /// stream (stages_passes). The first is the CTA's own, as its pass is requested before the
  /// ring is staged; the second lies over the staged records (key_bytes on), which are dead
  /// once the walks are done, where they are large enough.
  int pass[2] = {0, 0};
  int bytes = 0;

  /// Reads on the tensor cores: the queries' fragments, over the staged records from key_bytes
  /// on (dead once the walks are done) for a direct read (reads_on_tensor_cores,
  /// mma_query_bytes), after the passes for a staged one (stages_on_tensor_cores,
  /// staged_mma_query_bytes).
  int mma_query = 0;

  /// `heads` of the G value heads staged; `mma_query_bytes` sized for as many.
  static ReplaySmem make(int T, int G, int heads, int K, int V, int records, int in_size,
                         bool conv, int pass_bytes, int mma_query_bytes) {
    ReplaySmem s;
    s.heads = heads;
    s.head_mask = heads < G ? heads - 1 : -1;
    int f = 0;
    s.tq = f;
    f += T * heads * kMaxHeadKDim;
    s.oring = f;
    f += T * heads * V;
    s.alpha = f;
    f += records * G;
    s.beta = f;
    f += records * G;
    s.kscale = f;
    f += records;
    s.pair_dot = f;
    f += records;
    f = (f + 3) / 4 * 4;
    s.key_bytes = f * 4;
    const int per16 = 16 / in_size;
    s.vec_stride = (heads * V + per16 - 1) / per16 * per16;
    s.vec_bytes = s.key_bytes + records * K * in_size;
    s.bytes = s.vec_bytes + records * s.vec_stride * in_size;
    if (conv) {
      s.conv_q_bytes = (s.bytes + 15) / 16 * 16;
      s.bytes = s.conv_q_bytes + T * K * in_size;
    }
    if (pass_bytes == 0) {
      s.mma_query = s.key_bytes;
      s.bytes = std::max(s.bytes, s.key_bytes + mma_query_bytes);
    } else {
      s.pass[0] = (s.bytes + 15) / 16 * 16;
      s.pass[1] = s.pass[0] - s.key_bytes >= pass_bytes ? s.key_bytes : s.pass[0] + pass_bytes;
      s.bytes = std::max(s.pass[0], s.pass[1]) + pass_bytes;
      // A staged tensor-core read's fragments live beside both passes, the second of which
      // may lie over the records.
      s.mma_query = (s.bytes + 15) / 16 * 16;
      s.bytes = s.mma_query + mma_query_bytes;
    }
    return s;
  }
};

struct ReplayParams {
  StateCacheLayout cache;
  GdnInputs in;
  int num_tokens = 1;  ///< T; 0 = an explicit fold (state_cache_fold): no window, no outputs
  int layer = 0;       ///< decode: the layer; explicit fold: blockIdx.z is the layer
  int heads_per_key = 1;
  /// ceil(2^32 / V) for V > 1, 0 for V = 1: a row's value head r / V as one multiply-high
  /// (exact for r and V below 2^16), value_head() in gdn_replay.cu
  std::uint32_t row_head_magic = 0;
  int records = 0;     ///< staged ring records a CTA has room for: history + window
  bool vec_async = false;  ///< ring v records of G heads are 16-byte aligned runs (cp.async)
  bool fold_first = false;  ///< serve the rows whose fold is due first (fold_order.cuh)
  int l2_passes = 0;  ///< passes of the read copy requested into L2 ahead (kL2PrefetchPasses)
  bool tc_read = false;  ///< outputs read on the tensor cores (reads_on_tensor_cores)
  bool fold_pairs = false;  ///< folds replay two records a round (gdn_replay.cu, phase 3')
  RowTiling tiling;
  ReplaySmem smem;
};

}  // namespace replayssm::cuda::gdn
