#include "cache_buffers.h"

#include <functional>
#include <numeric>
#include <optional>

namespace replayssm {

namespace {

// The spec of one buffer, or nothing when `c` has no such buffer. The one place that says which
// buffers a configuration has and what they hold (state_cache.h documents the same shapes).
std::optional<CacheBufferSpec> spec_of(CacheBufferId id, const StateCacheConfig& c) {
  const bool replay = c.mode == DecodeMode::kReplay;
  const CheckpointTraits t = checkpoint_traits(c.checkpoint);
  const StateDims d = c.dims();
  const std::int64_t layers = c.num_layers, slots = c.capacity;
  const std::int64_t ring = replay ? ring_capacity_for(c.buffer_len, c.max_spec_tokens) : 0;
  // [layers, capacity, inner...] (slot axis 1) or [capacity, inner...] (slot axis 0).
  auto make = [&](DType dtype, bool per_layer, std::vector<std::int64_t> inner) {
    CacheBufferSpec s;
    s.id = id;
    s.name = cache_buffer_name(id);
    s.dtype = dtype;
    s.slot_axis = per_layer ? 1 : 0;
    // CUDA kernels load 16-byte vectors and cp.async tiles; the CPU streams cache lines.
    s.alignment = c.device == Device::kCuda ? 256 : 64;
    if (per_layer) s.shape.push_back(layers);
    s.shape.push_back(slots);
    s.shape.insert(s.shape.end(), inner.begin(), inner.end());
    s.bytes = std::accumulate(s.shape.begin(), s.shape.end(), std::int64_t{1},
                              std::multiplies<>()) *
              static_cast<std::int64_t>(dtype_size(dtype));
    return std::optional<CacheBufferSpec>(std::move(s));
  };
  const auto layered = [&](DType dtype, std::vector<std::int64_t> inner) {
    return make(dtype, true, std::move(inner));
  };
  const std::vector<std::int64_t> state = {d.heads, d.rows, d.cols};
  switch (id) {
    case CacheBufferId::kState: {
      if (replay) return std::nullopt;
      const int copies = eager_state_copies(c.max_spec_tokens);
      // One copy keeps the plain [layers, capacity, heads, rows, cols] layout.
      if (copies == 1) return layered(c.state_dtype, state);
      return layered(c.state_dtype, {copies, d.heads, d.rows, d.cols});
    }
    case CacheBufferId::kStateCurrent:
      return !replay && eager_state_copies(c.max_spec_tokens) > 1 ? make(DType::kU32, false, {})
                                                                  : std::nullopt;
    case CacheBufferId::kCkptHi:
      return replay && t.has_hi ? layered(DType::kF32, state) : std::nullopt;
    case CacheBufferId::kCkptLo:
      return replay && t.has_lo ? layered(t.lo_dtype, state) : std::nullopt;
    case CacheBufferId::kCkptLoScale:
      return replay && t.lo_row_scale ? layered(DType::kF32, {d.heads, d.rows})
                                      : std::nullopt;
    case CacheBufferId::kRingVec:
      return replay ? layered(c.input_dtype, {ring, d.heads, d.rows}) : std::nullopt;
    case CacheBufferId::kRingKey:
      return replay ? layered(c.input_dtype, {ring, d.key_heads, d.cols})
                    : std::nullopt;
    case CacheBufferId::kRingKeyScale:
      // Only GDN normalises its keys (Mamba-2's B is used as it comes).
      switch (c.kind) {
        case LayerKind::kMamba2: return std::nullopt;
        case LayerKind::kGdn:
          return replay ? layered(DType::kF32, {ring, d.key_heads}) : std::nullopt;
      }
      return std::nullopt;
    case CacheBufferId::kRingWrite:
    case CacheBufferId::kRingDecay:
      return replay ? layered(DType::kF32, {ring, d.heads}) : std::nullopt;
    case CacheBufferId::kCommitted: return make(DType::kU32, false, {});
    case CacheBufferId::kFolded: return layered(DType::kU32, {});
    case CacheBufferId::kPending: return layered(DType::kU8, {});
    case CacheBufferId::kAllocated: return make(DType::kU8, false, {});
    case CacheBufferId::kCkptSource:
    case CacheBufferId::kCkptBorrowers:
      return replay && c.share_forked_checkpoints ? layered(DType::kU32, {}) : std::nullopt;
    case CacheBufferId::kConvWindow:
      if (!replay || c.conv_kernel == 0) return std::nullopt;
      return layered(c.input_dtype,
                     {conv_ring_capacity_for(c.buffer_len, c.max_spec_tokens, c.conv_kernel),
                      c.conv_channels()});
  }
  return std::nullopt;
}

}  // namespace

const char* cache_buffer_name(CacheBufferId id) {
  switch (id) {
    case CacheBufferId::kState: return "state";
    case CacheBufferId::kStateCurrent: return "state_current";
    case CacheBufferId::kCkptHi: return "ckpt_hi";
    case CacheBufferId::kCkptLo: return "ckpt_lo";
    case CacheBufferId::kCkptLoScale: return "ckpt_lo_scale";
    case CacheBufferId::kRingVec: return "ring_vec";
    case CacheBufferId::kRingKey: return "ring_key";
    case CacheBufferId::kRingKeyScale: return "ring_key_scale";
    case CacheBufferId::kRingWrite: return "ring_write";
    case CacheBufferId::kRingDecay: return "ring_decay";
    case CacheBufferId::kCommitted: return "committed";
    case CacheBufferId::kFolded: return "folded";
    case CacheBufferId::kPending: return "pending";
    case CacheBufferId::kAllocated: return "allocated";
    case CacheBufferId::kCkptSource: return "ckpt_source";
    case CacheBufferId::kCkptBorrowers: return "ckpt_borrowers";
    case CacheBufferId::kConvWindow: return "conv_window";
  }
  return "?";
}

std::vector<CacheBufferSpec> cache_buffer_specs(const StateCacheConfig& config) {
  std::vector<CacheBufferSpec> out;
  for (int i = 0; i < kNumCacheBuffers; ++i) {
    if (auto s = spec_of(static_cast<CacheBufferId>(i), config)) out.push_back(std::move(*s));
  }
  return out;
}

std::int64_t slot_region_count(const CacheBufferSpec& spec) {
  return spec.slot_axis == 1 ? spec.shape[0] : 1;
}

std::int64_t slot_region_bytes(const CacheBufferSpec& spec) {
  return spec.bytes / (slot_region_count(spec) * spec.shape[std::size_t(spec.slot_axis)]);
}

bool zeroed_on_slot_reset(CacheBufferId id) {
  switch (id) {
    case CacheBufferId::kState:
    case CacheBufferId::kStateCurrent:
    case CacheBufferId::kCkptHi:
    case CacheBufferId::kCkptLo:
    case CacheBufferId::kCkptLoScale:
    case CacheBufferId::kCommitted:
    case CacheBufferId::kFolded:
    case CacheBufferId::kPending:
    // A slot is reset when it is taken, and a free slot neither reads another's checkpoint
    // nor lends its own (free releases both).
    case CacheBufferId::kCkptSource:
    case CacheBufferId::kCkptBorrowers:
    // A fresh sequence's conv reads zeros before its first token (the conv's left padding).
    case CacheBufferId::kConvWindow:
      return true;
    case CacheBufferId::kRingVec:
    case CacheBufferId::kRingKey:
    case CacheBufferId::kRingKeyScale:
    case CacheBufferId::kRingWrite:
    case CacheBufferId::kRingDecay:
    case CacheBufferId::kAllocated:  // set to 1, not zeroed
      return false;
  }
  return false;
}

void* layout_buffer(const StateCacheLayout& l, CacheBufferId id) {
  switch (id) {
    case CacheBufferId::kState: return l.state;
    case CacheBufferId::kStateCurrent: return l.state_current;
    case CacheBufferId::kCkptHi: return l.ckpt_hi;
    case CacheBufferId::kCkptLo: return l.ckpt_lo;
    case CacheBufferId::kCkptLoScale: return l.ckpt_lo_scale;
    case CacheBufferId::kRingVec: return l.ring_vec;
    case CacheBufferId::kRingKey: return l.ring_key;
    case CacheBufferId::kRingKeyScale: return l.ring_key_scale;
    case CacheBufferId::kRingWrite: return l.ring_write;
    case CacheBufferId::kRingDecay: return l.ring_decay;
    case CacheBufferId::kCommitted: return l.committed;
    case CacheBufferId::kFolded: return l.folded;
    case CacheBufferId::kPending: return l.pending;
    case CacheBufferId::kAllocated: return l.allocated;
    case CacheBufferId::kCkptSource: return l.ckpt_source;
    case CacheBufferId::kCkptBorrowers: return l.ckpt_borrowers;
    case CacheBufferId::kConvWindow: return l.conv_window;
  }
  return nullptr;
}

void bind_layout_buffer(StateCacheLayout& l, CacheBufferId id, void* p) {
  switch (id) {
    case CacheBufferId::kState: l.state = p; return;
    case CacheBufferId::kStateCurrent: l.state_current = static_cast<std::uint32_t*>(p); return;
    case CacheBufferId::kCkptHi: l.ckpt_hi = static_cast<float*>(p); return;
    case CacheBufferId::kCkptLo: l.ckpt_lo = p; return;
    case CacheBufferId::kCkptLoScale: l.ckpt_lo_scale = static_cast<float*>(p); return;
    case CacheBufferId::kRingVec: l.ring_vec = p; return;
    case CacheBufferId::kRingKey: l.ring_key = p; return;
    case CacheBufferId::kRingKeyScale: l.ring_key_scale = static_cast<float*>(p); return;
    case CacheBufferId::kRingWrite: l.ring_write = static_cast<float*>(p); return;
    case CacheBufferId::kRingDecay: l.ring_decay = static_cast<float*>(p); return;
    case CacheBufferId::kCommitted: l.committed = static_cast<std::uint32_t*>(p); return;
    case CacheBufferId::kFolded: l.folded = static_cast<std::uint32_t*>(p); return;
    case CacheBufferId::kPending: l.pending = static_cast<std::uint8_t*>(p); return;
    case CacheBufferId::kAllocated: l.allocated = static_cast<std::uint8_t*>(p); return;
    case CacheBufferId::kCkptSource: l.ckpt_source = static_cast<std::uint32_t*>(p); return;
    case CacheBufferId::kCkptBorrowers: l.ckpt_borrowers = static_cast<std::uint32_t*>(p); return;
    case CacheBufferId::kConvWindow: l.conv_window = p; return;
  }
}

}  // namespace replayssm
