#pragma once
// Device-side slot checks of a StateCacheLayout (src/state_cache_layout.h, which holds the
// index arithmetic and the L/T rules for host and device alike).

#include <cuda_runtime.h>

#include <cstdint>

#include "state_cache_layout.h"

namespace replayssm::cuda {

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

}  // namespace replayssm::cuda
