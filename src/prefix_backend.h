#pragma once
// What the prefix ops (include/replayssm/prefix.h) share between the validation (prefix.cpp)
// and the backends (cpu/prefix.cpp, cuda/state_cache/prefix.cu): the reach rule, for host and
// device; the byte runs a slot's checkpoint and ring records are made of, taken from the
// buffer table; and each backend's entry points. Arguments reaching a backend are validated.

#include <cstdint>
#include <cstring>

#include "cache_buffers.h"
#include "common/host_device.h"
#include "replayssm/prefix.h"
#include "state_cache_layout.h"

namespace replayssm {

// ---- the reach rule (prefix.h) ---------------------------------------------------------------

/// Records from (layer, slot)'s checkpoint to position p, or -1 when p is out of reach for
/// that layer: p − folded <= committed − folded (modulo 2^32), and never past what the ring
/// holds (so that corrupt cursors cannot index past a kernel's staging).
REPLAYSSM_HD int prefix_records_to(const StateCacheLayout& l, int layer, int slot,
                                   std::uint32_t p) {
  const std::uint32_t folded = l.folded[l.layer_slot(layer, slot)];
  const std::uint32_t count = p - folded;
  return count <= l.committed[slot] - folded && count <= std::uint32_t(l.max_history())
             ? int(count)
             : -1;
}

/// Whether p is in reach of every layer of `slot`.
REPLAYSSM_HD bool prefix_in_reach(const StateCacheLayout& l, int slot, std::uint32_t p) {
  for (int layer = 0; layer < l.config.num_layers; ++layer) {
    if (prefix_records_to(l, layer, slot, p) < 0) return false;
  }
  return true;
}

// ---- a slot's bytes ----------------------------------------------------------------------------

/// One buffer of a slot as runs of bytes: checkpoint copies one run per (layer, slot) at
/// base + layer_slot · bytes; ring fields one run per record at base + ring_record · bytes.
struct ByteRun {
  char* base = nullptr;
  std::int64_t bytes = 0;
};
inline constexpr int kMaxRuns = 5;
struct SlotRuns {
  int count = 0;
  ByteRun run[kMaxRuns];
};

/// Which part of a slot a buffer holds.
enum class SlotPart : std::uint8_t { kCheckpoint, kRing, kOther };
inline SlotPart slot_part(CacheBufferId id) {
  switch (id) {
    case CacheBufferId::kCkptHi:
    case CacheBufferId::kCkptLo:
    case CacheBufferId::kCkptLoScale:
      return SlotPart::kCheckpoint;
    case CacheBufferId::kRingVec:
    case CacheBufferId::kRingKey:
    case CacheBufferId::kRingKeyScale:
    case CacheBufferId::kRingWrite:
    case CacheBufferId::kRingDecay:
      return SlotPart::kRing;
    case CacheBufferId::kState:
    case CacheBufferId::kStateCurrent:
    case CacheBufferId::kCommitted:
    case CacheBufferId::kFolded:
    case CacheBufferId::kPending:
    case CacheBufferId::kAllocated:
    case CacheBufferId::kCkptSource:
    case CacheBufferId::kCkptBorrowers:
    case CacheBufferId::kConvWindow:  // its own ring (conv_record), copied by position
      return SlotPart::kOther;
  }
  return SlotPart::kOther;
}

/// CacheRecords' field for a ring buffer (null for any other buffer).
inline void* records_field(const CacheRecords& r, CacheBufferId id) {
  switch (id) {
    case CacheBufferId::kRingVec: return r.vec;
    case CacheBufferId::kRingKey: return r.key;
    case CacheBufferId::kRingKeyScale: return r.key_scale;
    case CacheBufferId::kRingWrite: return r.write;
    case CacheBufferId::kRingDecay: return r.decay;
    case CacheBufferId::kState:
    case CacheBufferId::kStateCurrent:
    case CacheBufferId::kCkptHi:
    case CacheBufferId::kCkptLo:
    case CacheBufferId::kCkptLoScale:
    case CacheBufferId::kCommitted:
    case CacheBufferId::kFolded:
    case CacheBufferId::kPending:
    case CacheBufferId::kAllocated:
    case CacheBufferId::kCkptSource:
    case CacheBufferId::kCkptBorrowers:
    case CacheBufferId::kConvWindow:
      return nullptr;
  }
  return nullptr;
}

/// The runs of `part` in the cache, in buffer-table order. For the ring, with `outside`, the
/// same fields of a CacheRecords instead (record (layer, j) at base + (layer·count + j)·bytes).
inline SlotRuns slot_runs(const StateCacheLayout& l, SlotPart part,
                          const CacheRecords* outside = nullptr) {
  SlotRuns out;
  for (const CacheBufferSpec& s : cache_buffer_specs(l.config)) {
    if (slot_part(s.id) != part) continue;
    std::int64_t bytes = slot_region_bytes(s);
    if (part == SlotPart::kRing) bytes /= l.ring_capacity;
    void* base = outside != nullptr ? records_field(*outside, s.id) : layout_buffer(l, s.id);
    out.run[out.count++] = {static_cast<char*>(base), bytes};
  }
  return out;
}

/// Every checkpoint copy of [layer][slot] region `from` onto region `to`, in host memory (a CPU
/// cache's fork and release).
inline void copy_checkpoint_host(const SlotRuns& ckpt, std::int64_t from, std::int64_t to) {
  for (int f = 0; f < ckpt.count; ++f) {
    const ByteRun& r = ckpt.run[f];
    std::memcpy(r.base + to * r.bytes, r.base + from * r.bytes, std::size_t(r.bytes));
  }
}

// ---- the backends ----------------------------------------------------------------------------

namespace cpu {
void materialize(const StateCacheLayout& cache, const MaterializeArgs& args);
void read_records(const StateCacheLayout& cache, int slot, std::uint32_t first,
                  const CacheRecords& out);
void restore(StateCacheLayout& cache, const RestoreArgs& args);
void fork(StateCacheLayout& cache, const ForkArgs& args);
void truncate(StateCacheLayout& cache, const TruncateArgs& args);
}  // namespace cpu

/// The CUDA backend (src/cuda/state_cache/prefix.cu); a build without CUDA links
/// prefix_cuda_unavailable.cpp, whose entry points refuse.
namespace cuda {
Status materialize(const StateCacheLayout& cache, const MaterializeArgs& args, Stream stream);
/// Checks [first, first + out.count] against the device cursors first (synchronises).
Status read_records(const StateCacheLayout& cache, int slot, std::uint32_t first,
                    const CacheRecords& out, Stream stream);
/// Checks the slot's windows and the states' finiteness on the device first (synchronises).
Status restore(StateCacheLayout& cache, const RestoreArgs& args, Stream stream);
Status fork(StateCacheLayout& cache, const ForkArgs& args, Stream stream);
Status truncate(StateCacheLayout& cache, const TruncateArgs& args, Stream stream);
}  // namespace cuda

}  // namespace replayssm
