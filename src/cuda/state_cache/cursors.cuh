#pragma once
// The fold cursor on the device, shared by both layer kinds' replay kernels: how every block
// of one replay launch (a decode or an explicit fold of one layer) reads `folded`, and how the
// launch moves it, so that a replay step is one launch per layer.
//
// A launch runs several blocks per batch row (runs of heads, row splits). Each decides from
// `folded` whether to fold the committed history first, so no block may move `folded` while
// another block of its row has yet to read it. The launch moves it itself, last block done,
// with `folded` as its own arrival counter: every block of a folding row reads it once
// (fold_cursor), then adds kFoldArrival (fold_cursor_arrive); the add that completes the row's
// count stores committed. Meanwhile folded = first + a·kFoldArrival after a arrivals, and
// since a decode's history committed − first is below kFoldArrival, every reader recovers the
// launch's `first`: all blocks of a row take the same decision and fold the same records. A row
// that does not fold writes nothing; pad rows and bad slot ids never get here; between launches
// `folded` holds its plain value, as the CPU backend's does.

#include <cuda_runtime.h>

#include <cstdint>

#include "replayssm/state_cache.h"
#include "state_cache_layout.h"

namespace replayssm::cuda {

/// What one block's arrival adds to `folded`: above any history a layer holds, so that
/// arrivals and history never mix.
inline constexpr std::uint32_t kFoldArrival = 1u << 16;
static_assert(max_history(kMaxBufferLen, kMaxSpecTokens) < int(kFoldArrival));
/// The most blocks one row of a replay launch may have: their arrivals stay below 2^31, where
/// folded − committed still reads as "ahead" (launches check it on the host).
inline constexpr int kMaxFoldBlocks = int((1u << 31) / kFoldArrival) - 1;

/// `folded` as a block of a launch found it.
struct FoldCursor {
  std::uint32_t first = 0;     ///< folded when the launch began: the history starts here
  std::uint32_t unfolded = 0;  ///< committed − first
  bool fold = false;           ///< the decision every block of the row takes alike
};

/// Blocks of the launch that had arrived when `folded` read `value` (0 for a plain value,
/// which is at most committed).
__device__ __forceinline__ std::uint32_t fold_arrivals(std::uint32_t value,
                                                       std::uint32_t committed) {
  const auto ahead = static_cast<std::int32_t>(value - committed);
  return ahead > 0 ? (static_cast<std::uint32_t>(ahead) + kFoldArrival - 1) / kFoldArrival : 0u;
}

/// (layer, slot)'s `folded`, read once per block (relaxed at GPU scope, so that it is ordered
/// with the arrivals' atomics and never a stale copy from L1).
__device__ __forceinline__ std::uint32_t fold_cursor_load(const StateCacheLayout& l, int layer,
                                                          int slot) {
  std::uint32_t value;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];"
               : "=r"(value)
               : "l"(l.folded + l.layer_slot(layer, slot)));
  return value;
}

/// The fold cursor a launch of `num_tokens` (0: an explicit fold) sees, from the block's
/// fold_cursor_load and the slot's `committed` (which no replay launch writes).
__device__ __forceinline__ FoldCursor fold_cursor(const StateCacheLayout& l,
                                                  std::uint32_t folded,
                                                  std::uint32_t committed, int num_tokens) {
  FoldCursor c;
  c.first = folded - fold_arrivals(folded, committed) * kFoldArrival;
  c.unfolded = committed - c.first;
  c.fold = l.fold_due(c.unfolded, num_tokens);
  return c;
}

/// One thread of each block of a folding row, after the block's fold_cursor: counts the block
/// in; the last of the row's `blocks` moves folded to committed. Its read came before its add,
/// so the store follows every read of the row's blocks.
__device__ __forceinline__ void fold_cursor_arrive(const StateCacheLayout& l, int layer,
                                                   int slot, std::uint32_t committed,
                                                   int blocks) {
  std::uint32_t* p = l.folded + l.layer_slot(layer, slot);
  const std::uint32_t before = atomicAdd(p, kFoldArrival);
  if (fold_arrivals(before, committed) + 1 == static_cast<std::uint32_t>(blocks)) {
    atomicExch(p, committed);
  }
}

}  // namespace replayssm::cuda
