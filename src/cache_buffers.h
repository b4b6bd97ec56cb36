#pragma once
// The buffer table of a state cache: for each CacheBufferId, whether a configuration has the
// buffer, its dtype and shape (cache_buffers.cpp, one exhaustive switch), and how a layout
// reaches it. Creation, views, slot resets and tests iterate this table; nothing else lists
// the buffers.

#include <cstdint>
#include <vector>

#include "replayssm/state_cache.h"
#include "state_cache_layout.h"

namespace replayssm {

/// Every buffer `config` needs, in id order (config assumed valid).
std::vector<CacheBufferSpec> cache_buffer_specs(const StateCacheConfig& config);

/// Bytes of one slot's region of a buffer: one (layer, slot) for per-layer buffers, one slot for
/// per-slot ones. The buffer is `outer` such regions per slot-axis step apart: region (o, slot)
/// starts at (o · capacity + slot) · slot_region_bytes, o < outer (outer = layers or 1).
std::int64_t slot_region_bytes(const CacheBufferSpec& spec);
std::int64_t slot_region_count(const CacheBufferSpec& spec);  ///< `outer` above

/// Whether allocating a slot zeroes its region of this buffer. Ring records are not zeroed:
/// only positions folded..committed+pending-1 are ever read, and a fresh slot has none.
bool zeroed_on_slot_reset(CacheBufferId id);

void* layout_buffer(const StateCacheLayout& layout, CacheBufferId id);
void bind_layout_buffer(StateCacheLayout& layout, CacheBufferId id, void* data);

}  // namespace replayssm
