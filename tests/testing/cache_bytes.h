#pragma once
// Raw views of a cache's buffers, for the bit-exact tier of the tests: host copies of whole
// buffers or of one slot's bytes (guard bands: what a call must not touch), their first
// difference, and the cursors as the cache stores them.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "replayssm/state_cache.h"
#include "state_cache_layout.h"

namespace replayssm::testing {

/// One buffer of a StateCacheLayout: `layers` × capacity regions of `slot_bytes` bytes each,
/// region (layer, slot) at byte offset (layer·capacity + slot)·slot_bytes (layers = 1 for
/// per-slot buffers).
struct BufferView {
  std::string name;
  const void* ptr = nullptr;
  int layers = 1;
  std::size_t slot_bytes = 0;
  [[nodiscard]] std::size_t total_bytes(int capacity) const {
    return std::size_t(layers) * std::size_t(capacity) * slot_bytes;
  }
};
/// Every buffer of the layout's config, from the library's buffer table (cache_buffers.h).
std::vector<BufferView> layout_buffers(const StateCacheLayout& layout);

/// A host copy of every buffer of a cache, by name.
struct CacheBytes {
  std::vector<std::string> names;
  std::vector<std::vector<std::uint8_t>> data;
  [[nodiscard]] const std::vector<std::uint8_t>& operator[](const std::string& name) const;
};
CacheBytes snapshot(const StateCache& cache);
/// Only the named buffers (e.g. {"ckpt_hi", "ckpt_lo", "ckpt_lo_scale"}); missing ones skipped.
CacheBytes snapshot(const StateCache& cache, const std::vector<std::string>& names);
/// "" when equal, else the first differing buffer and byte offset.
std::string diff(const CacheBytes& a, const CacheBytes& b);
/// Every byte a slot owns, in every buffer and layer, concatenated.
std::vector<std::uint8_t> slot_bytes(const StateCache& cache, int slot);

/// Host copies of the cursors.
std::uint32_t cursor_committed(const StateCache& cache, int slot);
std::uint32_t cursor_folded(const StateCache& cache, int layer, int slot);
/// Layer 0's pending window.
int cursor_pending(const StateCache& cache, int slot);

}  // namespace replayssm::testing
