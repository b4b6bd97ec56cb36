#pragma once
// Device-side addressing of a StateCacheLayout (src/state_cache_layout.h) and slot validation.
//
// StateCacheLayout is plain data and travels inside each kernel's Params by value; its member
// functions are host-only, so the same index arithmetic is repeated here for device code.

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/stream.h"
#include "state_cache_layout.h"

namespace replayssm::cuda {

/// Index of (layer, slot) among the cache's per-slot regions.
__device__ __forceinline__ std::int64_t layer_slot(const StateCacheLayout& l, int layer,
                                                   int slot) {
  return std::int64_t{layer} * l.config.capacity + slot;
}

/// Index, in records, of ring position `pos` of (layer, slot).
__device__ __forceinline__ std::int64_t ring_record(const StateCacheLayout& l, int layer,
                                                    int slot, std::uint32_t pos) {
  return layer_slot(l, layer, slot) * l.ring_capacity +
         (pos & std::uint32_t(l.ring_capacity - 1));
}

/// The slot of batch row b when its id is in [0, capacity), else -1 (a pad row, or a bad id
/// that must never address memory). Whether the slot is allocated is a second, later load
/// (slot_allocated) so that a kernel can start streaming the slot's state meanwhile: reading
/// an in-range slot is harmless even when it turns out to be free.
__device__ __forceinline__ int slot_in_range(const StateCacheLayout& l,
                                             const std::int32_t* slot_ids, int b) {
  const std::int32_t s = slot_ids[b];
  return (s >= 0 && s < l.config.capacity) ? s : -1;
}
__device__ __forceinline__ bool slot_allocated(const StateCacheLayout& l, int slot) {
  return l.allocated[slot] != 0;
}
/// Both checks at once: the slot of row b, or -1 when the row must be skipped entirely.
__device__ __forceinline__ int resolve_slot(const StateCacheLayout& l,
                                            const std::int32_t* slot_ids, int b) {
  const int s = slot_in_range(l, slot_ids, b);
  return (s >= 0 && slot_allocated(l, s)) ? s : -1;
}

/// Committed tokens of (layer, slot) not yet folded into its checkpoint.
__device__ __forceinline__ std::uint32_t unfolded(const StateCacheLayout& l, int layer,
                                                  int slot) {
  return l.committed[slot] - l.folded[layer_slot(l, layer, slot)];
}

/// Whether a decode of T tokens (T = 0: an explicit fold) folds the committed history first
/// (state_cache.h: when committed − folded >= buffer_len; an explicit fold whenever any).
__device__ __forceinline__ bool fold_due(const StateCacheLayout& l, std::uint32_t unfolded_count,
                                         int num_tokens) {
  return num_tokens == 0 ? unfolded_count > 0
                         : unfolded_count >= std::uint32_t(l.config.buffer_len);
}

/// The most committed history a (layer, slot) can hold in valid use: a fold is due from
/// buffer_len on, and a commit may add up to max_spec_tokens past buffer_len − 1. Kernels clamp
/// to it so that corrupt cursors can never index past their shared-memory staging.
__device__ __forceinline__ int max_history(const StateCacheLayout& l) {
  return l.config.buffer_len - 1 + l.config.max_spec_tokens;
}

}  // namespace replayssm::cuda
