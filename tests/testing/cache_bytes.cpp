#include "testing/cache_bytes.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "backend.h"
#include "cache_buffers.h"
#include "testing/device_buffer.h"

namespace replayssm::testing {

std::vector<BufferView> layout_buffers(const StateCacheLayout& l) {
  std::vector<BufferView> v;
  for (const CacheBufferSpec& spec : cache_buffer_specs(l.config)) {
    v.push_back({spec.name, layout_buffer(l, spec.id), int(slot_region_count(spec)),
                 std::size_t(slot_region_bytes(spec))});
  }
  return v;
}

const std::vector<std::uint8_t>& CacheBytes::operator[](const std::string& name) const {
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return data[i];
  }
  throw std::runtime_error("CacheBytes: no buffer " + name);
}

CacheBytes snapshot(const StateCache& cache, const std::vector<std::string>& names) {
  const StateCacheLayout& l = cache.layout();
  CacheBytes out;
  for (const BufferView& b : layout_buffers(l)) {
    if (!names.empty() && std::find(names.begin(), names.end(), b.name) == names.end()) continue;
    std::vector<std::uint8_t> bytes(b.total_bytes(l.config.capacity));
    throw_if_error(memory_to_host(l.config.device, bytes.data(), b.ptr, bytes.size()),
                   "snapshot");
    out.names.push_back(b.name);
    out.data.push_back(std::move(bytes));
  }
  return out;
}

CacheBytes snapshot(const StateCache& cache) { return snapshot(cache, {}); }

std::string diff(const CacheBytes& a, const CacheBytes& b) {
  if (a.names != b.names) return "different buffer sets";
  for (std::size_t i = 0; i < a.names.size(); ++i) {
    if (a.data[i].size() != b.data[i].size()) return a.names[i] + ": sizes differ";
    for (std::size_t j = 0; j < a.data[i].size(); ++j) {
      if (a.data[i][j] != b.data[i][j]) {
        return a.names[i] + " differs at byte " + std::to_string(j) + " (of " +
               std::to_string(a.data[i].size()) + ")";
      }
    }
  }
  return "";
}

std::vector<std::uint8_t> slot_bytes(const StateCache& cache, int slot) {
  const StateCacheLayout& l = cache.layout();
  std::vector<std::uint8_t> out;
  for (const BufferView& b : layout_buffers(l)) {
    for (int layer = 0; layer < b.layers; ++layer) {
      const std::size_t off =
          (std::size_t(layer) * std::size_t(l.config.capacity) + std::size_t(slot)) * b.slot_bytes;
      const std::size_t at = out.size();
      out.resize(at + b.slot_bytes);
      throw_if_error(memory_to_host(l.config.device, out.data() + at,
                                    static_cast<const std::uint8_t*>(b.ptr) + off, b.slot_bytes),
                     "slot_bytes");
    }
  }
  return out;
}

std::uint32_t cursor_committed(const StateCache& cache, int slot) {
  std::uint32_t v = 0;
  throw_if_error(memory_to_host(cache.config().device, &v, cache.layout().committed + slot, 4),
                 "cursor");
  return v;
}

std::uint32_t cursor_folded(const StateCache& cache, int layer, int slot) {
  std::uint32_t v = 0;
  const StateCacheLayout& l = cache.layout();
  throw_if_error(
      memory_to_host(cache.config().device, &v, l.folded + l.layer_slot(layer, slot), 4),
      "cursor");
  return v;
}

int cursor_pending(const StateCache& cache, int slot) {
  std::uint8_t v = 0;
  throw_if_error(memory_to_host(cache.config().device, &v, cache.layout().pending + slot, 1),
                 "cursor");
  return v;
}

}  // namespace replayssm::testing
