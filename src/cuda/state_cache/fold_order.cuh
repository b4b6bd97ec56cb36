#pragma once
// Fold-first block order for the replay launches of both layer kinds.
//
// In serving, requests start at different steps, so each replay step has a few rows whose fold
// is due among many that only read. A folding block streams the fp32 master, folds up to L
// records into every row and writes every checkpoint copy: it lasts several reading blocks (5x
// with a bf16 read copy, 9x with fp8). The GPU dispatches blocks roughly in blockIdx order, so
// with rows in batch order the folding blocks of the last wave finished on an otherwise idle GPU:
// that tail cost staggered steps 12-35% over steps whose rows all fold together
// (docs/BENCHMARKS_CUDA_MAMBA2.md, section 6). Serving the folding rows first puts the long
// blocks in the first waves, where the short ones fill in around them.
//
// Each block derives the same order on its own from the rows' cursors, so the classification
// must not change while the launch moves `folded` (cursors.cuh): a row counts as "first" when
// its fold is due or when nothing of it is unfolded. A folding row is due before and during its
// arrivals and, once its last block stored folded = committed, has nothing unfolded; a row that
// does not fold keeps its cursors for the whole launch. Rows with nothing unfolded that do not
// fold (a freshly loaded slot) go first too, which costs nothing. Pad rows and bad slot ids go
// last. Only the order depends on this; what a row computes does not.

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/cache.cuh"
#include "cuda/common/device_limits.cuh"
#include "cuda/state_cache/cursors.cuh"
#include "state_cache_layout.h"

namespace replayssm::cuda {

/// Launches with more rows keep batch order: the ballot masks live in static shared memory, and
/// with that many waves the tail is a small share of the step.
inline constexpr int kFoldFirstMaxBatch = 4096;

/// Those masks' bytes: static shared memory of every replay kernel, on top of its dynamic
/// staging. It counts against the 48 KB a block may take without opting in
/// (allow_dynamic_smem) and against the device's per-block limit (replay_smem_budget).
inline constexpr int kFoldFirstSmemBytes = kFoldFirstMaxBatch / 32 * int(sizeof(std::uint32_t));

/// The dynamic shared memory a replay block may take on this device.
inline int replay_smem_budget(const DeviceLimits& limits) {
  return limits.smem_per_block - kFoldFirstSmemBytes;
}

/// Whether a replay launch orders its rows fold-first: decodes only (an explicit fold has no
/// reading rows), and from a batch where blocks outnumber what the GPU holds at once. Below
/// that every block is resident from the start and the order changes nothing, while the
/// order's cursor pass would delay the small-batch prefetch of the state.
inline bool use_fold_first(int batch, int num_tokens, int min_batch) {
  return num_tokens > 0 && batch >= min_batch && batch <= kFoldFirstMaxBatch;
}

/// The row that the blocks at grid row `y` serve: the y-th row of the fold-first order (rows
/// whose fold is due first, each class in batch order). Every thread of the block must call it
/// (it has a barrier) before any of them returns; blockDim.x must be a multiple of 32.
__device__ inline int fold_first_row(const StateCacheLayout& l, const std::int32_t* slot_ids,
                                     int batch, int layer, int num_tokens, int y) {
  __shared__ std::uint32_t first_mask[kFoldFirstSmemBytes / sizeof(std::uint32_t)];
  for (int base = 0; base < batch; base += blockDim.x) {
    const int row = base + int(threadIdx.x);
    bool first = false;
    if (row < batch) {
      const int slot = slot_in_range(l, slot_ids, row);
      if (slot >= 0) {
        const std::uint32_t committed = l.committed[slot];
        const FoldCursor c =
            fold_cursor(l, fold_cursor_load(l, layer, slot), committed, num_tokens);
        first = c.fold || c.unfolded == 0;
      }
    }
    const std::uint32_t mask = __ballot_sync(0xffffffffu, first);
    if (threadIdx.x % 32 == 0 && row < batch) first_mask[row / 32] = mask;
  }
  __syncthreads();
  const int words = (batch + 31) / 32;
  int firsts = 0;
  for (int w = 0; w < words; ++w) firsts += __popc(first_mask[w]);
  const bool want_first = y < firsts;
  int rank = want_first ? y : y - firsts;  // among the rows of the wanted class
  for (int w = 0; w < words; ++w) {
    const int valid = min(32, batch - w * 32);
    const std::uint32_t in_range = valid == 32 ? 0xffffffffu : (1u << valid) - 1u;
    const std::uint32_t m = want_first ? first_mask[w] : ~first_mask[w] & in_range;
    const int n = __popc(m);
    if (rank < n) return w * 32 + int(__fns(m, 0, rank + 1));
    rank -= n;
  }
  return y;  // unreachable: the classes together hold every row
}

}  // namespace replayssm::cuda
