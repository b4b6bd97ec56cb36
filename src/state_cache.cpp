// StateCache: config validation, buffers (owned or the caller's), slot management and the
// cursor ops. Everything here is backend-agnostic; the per-element work is in src/cpu and
// src/cuda.

#include "replayssm/state_cache.h"

#include <string>

#include "backend.h"
#include "cache_buffers.h"
#include "checkpoint_sharing.h"
#include "conv_window.h"
#include "state_cache_layout.h"
#include "validate.h"

namespace replayssm {

/// The buffers of an owning cache: freed with it.
struct OwnedCacheMemory {
  Device device = Device::kCpu;
  std::vector<void*> buffers;
  ~OwnedCacheMemory() {
    for (void* p : buffers) memory_free(device, p);
  }
};

/// What the free functions of this file need of a StateCache's private parts.
struct StateCacheAccess {
  static StateCache* make() { return new StateCache(); }
  static std::unique_ptr<OwnedCacheMemory>& owned(StateCache& c) { return c.owned_; }
  static std::vector<int>& free_list(StateCache& c) { return c.free_list_; }
  static std::vector<std::uint8_t>& host_allocated(StateCache& c) { return c.host_allocated_; }
};

int StateCacheConfig::conv_channels() const {
  const StateDims d = dims();
  return d.heads * d.rows + 2 * d.key_heads * d.cols;
}

StateDims StateCacheConfig::dims() const {
  switch (kind) {
    case LayerKind::kMamba2: return state_dims(mamba2);
    case LayerKind::kGdn: return state_dims(gdn);
  }
  return {};
}

namespace {

std::string str(std::int64_t v) { return std::to_string(v); }

bool is_activation_dtype(DType d) {
  return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16;
}

// What every backend needs of a configuration; backend-specific limits come after.
Status validate_config(const StateCacheConfig& c) {
  const StateDims d = c.dims();
  if (d.heads <= 0 || d.rows <= 0 || d.cols <= 0 || d.key_heads <= 0) {
    return invalid_argument("layer shape has a non-positive dimension");
  }
  if (d.heads % d.key_heads != 0) {
    switch (c.kind) {
      case LayerKind::kMamba2: return invalid_argument("nheads must be a multiple of ngroups");
      case LayerKind::kGdn:
        return invalid_argument("num_v_heads must be a multiple of num_k_heads");
    }
  }
  if (c.num_layers < 1) return invalid_argument("num_layers must be >= 1");
  if (c.capacity < 1) return invalid_argument("capacity must be >= 1 slot");
  if (!is_activation_dtype(c.input_dtype)) {
    return invalid_argument(std::string("unsupported input dtype ") + dtype_name(c.input_dtype) +
                            "; supported: f32, bf16, f16");
  }
  if (c.max_spec_tokens < 1 || c.max_spec_tokens > kMaxSpecTokens) {
    return invalid_argument("max_spec_tokens (T) must be in [1, " + str(kMaxSpecTokens) +
                            "], got " + str(c.max_spec_tokens));
  }
  switch (c.mode) {
    case DecodeMode::kEager:
      if (c.share_forked_checkpoints) {
        return invalid_argument("share_forked_checkpoints needs a replay cache (an eager "
                                "cache has no checkpoint to share and cannot fork)");
      }
      if (c.conv_kernel != 0) {
        return invalid_argument("conv_kernel needs a replay cache (eager decodes take "
                                "convolved inputs; leave conv_kernel at 0)");
      }
      if (!is_activation_dtype(c.state_dtype)) {
        return invalid_argument(std::string("unsupported eager state dtype ") +
                                dtype_name(c.state_dtype) + "; supported: f32, bf16, f16");
      }
      return Status::ok();
    case DecodeMode::kReplay:
      if (c.buffer_len < 1 || c.buffer_len > kMaxBufferLen) {
        return invalid_argument("buffer_len (L) must be in [1, " + str(kMaxBufferLen) +
                                "], got " + str(c.buffer_len));
      }
      if (c.conv_kernel != 0 && (c.conv_kernel < 2 || c.conv_kernel > kMaxConvKernel)) {
        return invalid_argument("conv_kernel must be 0 (no fused conv) or in [2, " +
                                str(kMaxConvKernel) + "], got " + str(c.conv_kernel));
      }
      return Status::ok();
  }
  return invalid_argument("unknown decode mode");
}

// Every binding names a buffer of `specs` once, with enough aligned, usable memory.
Status validate_bindings(const StateCacheConfig& config,
                         const std::vector<CacheBufferSpec>& specs,
                         std::span<const CacheBufferBinding> buffers) {
  std::vector<const CacheBufferBinding*> bound(kNumCacheBuffers, nullptr);
  for (const CacheBufferBinding& b : buffers) {
    const int i = static_cast<int>(b.id);
    if (i < 0 || i >= kNumCacheBuffers) return invalid_argument("unknown cache buffer id " + str(i));
    if (bound[std::size_t(i)] != nullptr) {
      return invalid_argument(std::string("cache buffer ") + cache_buffer_name(b.id) +
                              " is bound twice");
    }
    bound[std::size_t(i)] = &b;
  }
  for (const CacheBufferSpec& s : specs) {
    const CacheBufferBinding* b = bound[static_cast<std::size_t>(s.id)];
    const std::string name = std::string("cache buffer ") + s.name;
    if (b == nullptr) return invalid_argument(name + " is not bound (this configuration needs it)");
    bound[static_cast<std::size_t>(s.id)] = nullptr;
    if (b->data == nullptr) return invalid_argument(name + " is null");
    if (b->bytes < s.bytes) {
      return invalid_argument(name + " has " + str(b->bytes) + " bytes; it needs " + str(s.bytes));
    }
    if (reinterpret_cast<std::uintptr_t>(b->data) % std::uintptr_t(s.alignment) != 0) {
      return invalid_argument(name + " is not aligned to " + str(s.alignment) + " bytes");
    }
    REPLAYSSM_RETURN_IF_ERROR(memory_check_usable(config.device, b->data, s.name));
  }
  for (const CacheBufferBinding* b : bound) {
    if (b != nullptr) {
      return invalid_argument(std::string("cache buffer ") + cache_buffer_name(b->id) +
                              " is bound but this configuration has no such buffer");
    }
  }
  return Status::ok();
}

// Builds the cache over `buffers` (already validated). `zeroed`: the memory is known to be zero
// (fresh allocations), so kZero need not clear it again.
Status build_cache(const StateCacheConfig& config, std::span<const CacheBufferBinding> buffers,
                   ViewInit init, bool zeroed, Stream stream, std::unique_ptr<StateCache>* out) {
  std::unique_ptr<StateCache> cache(StateCacheAccess::make());
  StateCacheLayout& l = cache->layout();
  l.config = config;
  l.dims = config.dims();
  l.ckpt = checkpoint_traits(config.checkpoint);
  l.ring_capacity = config.mode == DecodeMode::kReplay
                        ? ring_capacity_for(config.buffer_len, config.max_spec_tokens)
                        : 0;
  l.conv_ring = config.conv_kernel > 0 ? conv_ring_capacity_for(config.buffer_len,
                                                                config.max_spec_tokens,
                                                                config.conv_kernel)
                                       : 0;
  for (const CacheBufferSpec& s : cache_buffer_specs(config)) l.total_bytes += s.bytes;
  for (const CacheBufferBinding& b : buffers) bind_layout_buffer(l, b.id, b.data);

  auto& host_allocated = StateCacheAccess::host_allocated(*cache);
  host_allocated.assign(static_cast<std::size_t>(config.capacity), 0);
  switch (init) {
    case ViewInit::kZero:
      if (!zeroed) {
        for (const CacheBufferSpec& s : cache_buffer_specs(config)) {
          REPLAYSSM_RETURN_IF_ERROR(memory_zero(config.device, layout_buffer(l, s.id),
                                                static_cast<std::size_t>(s.bytes), stream));
        }
      }
      break;
    case ViewInit::kAdopt:
      REPLAYSSM_RETURN_IF_ERROR(memory_to_host(config.device, host_allocated.data(), l.allocated,
                                               host_allocated.size(), stream));
      for (std::size_t s = 0; s < host_allocated.size(); ++s) {
        if (host_allocated[s] > 1) {
          return invalid_argument("cannot adopt the buffers: allocated[" + str(std::int64_t(s)) +
                                  "] is " + str(host_allocated[s]) + " (must be 0 or 1)");
        }
      }
      break;
  }
  auto& free_list = StateCacheAccess::free_list(*cache);
  free_list.reserve(static_cast<std::size_t>(config.capacity));
  for (int s = config.capacity - 1; s >= 0; --s) {
    if (host_allocated[std::size_t(s)] == 0) free_list.push_back(s);
  }
  *out = std::move(cache);
  return Status::ok();
}

// Zeroes every layer's state (or checkpoint copies) and cursors of `slot`, marks it allocated.
Status reset_slot(StateCacheLayout& l, int slot, Stream stream) {
  for (const CacheBufferSpec& s : cache_buffer_specs(l.config)) {
    if (!zeroed_on_slot_reset(s.id)) continue;
    const auto region = static_cast<std::size_t>(slot_region_bytes(s));
    const auto pitch = region * static_cast<std::size_t>(l.config.capacity);
    char* base = static_cast<char*>(layout_buffer(l, s.id)) + region * std::size_t(slot);
    REPLAYSSM_RETURN_IF_ERROR(memory_zero_2d(l.config.device, base, region, pitch,
                                             static_cast<std::size_t>(slot_region_count(s)),
                                             stream));
  }
  return memory_set_byte(l.config.device, l.allocated + slot, 1, stream);
}

Status take_slot(StateCache& cache, int slot, Stream stream) {
  REPLAYSSM_RETURN_IF_ERROR(reset_slot(cache.layout(), slot, stream));
  auto& free_list = StateCacheAccess::free_list(cache);
  std::erase(free_list, slot);
  StateCacheAccess::host_allocated(cache)[static_cast<std::size_t>(slot)] = 1;
  return Status::ok();
}

}  // namespace

StateCache::StateCache() : layout_(std::make_unique<StateCacheLayout>()) {}
StateCache::~StateCache() = default;

const StateCacheConfig& StateCache::config() const { return layout_->config; }
int StateCache::ring_capacity() const { return layout_->ring_capacity; }
int StateCache::free_slots() const { return static_cast<int>(free_list_.size()); }
StateCacheLayout& StateCache::layout() { return *layout_; }
const StateCacheLayout& StateCache::layout() const { return *layout_; }
std::int64_t StateCache::bytes() const { return layout_->total_bytes; }
bool StateCache::owns_memory() const { return owned_ != nullptr; }
void* StateCache::buffer(CacheBufferId id) const { return layout_buffer(*layout_, id); }

bool StateCache::is_allocated(int slot) const {
  if (slot < 0 || slot >= layout_->config.capacity) return false;
  return host_allocated_[static_cast<std::size_t>(slot)] != 0;
}

Status state_cache_can_implement(const StateCacheConfig& config) {
  REPLAYSSM_RETURN_IF_ERROR(validate_config(config));
  switch (config.device) {
    case Device::kCpu: return Status::ok();  // the CPU backend runs every valid config
    case Device::kCuda: return cuda::can_implement(config);
  }
  return invalid_argument("unknown device");
}

Status state_cache_buffers(const StateCacheConfig& config, std::vector<CacheBufferSpec>* out) {
  if (out == nullptr) return invalid_argument("state_cache_buffers: out is null");
  REPLAYSSM_RETURN_IF_ERROR(validate_config(config));
  *out = cache_buffer_specs(config);
  return Status::ok();
}

Status state_cache_create(const StateCacheConfig& config, std::unique_ptr<StateCache>* out,
                          Stream stream) {
  if (out == nullptr) return invalid_argument("state_cache_create: out is null");
  REPLAYSSM_RETURN_IF_ERROR(state_cache_can_implement(config));
  auto owned = std::make_unique<OwnedCacheMemory>();
  owned->device = config.device;
  std::vector<CacheBufferBinding> bindings;
  for (const CacheBufferSpec& s : cache_buffer_specs(config)) {
    void* p = nullptr;
    REPLAYSSM_RETURN_IF_ERROR(memory_alloc(config.device, static_cast<std::size_t>(s.bytes), &p));
    owned->buffers.push_back(p);
    bindings.push_back({s.id, p, s.bytes});
  }
  REPLAYSSM_RETURN_IF_ERROR(build_cache(config, bindings, ViewInit::kZero, /*zeroed=*/true,
                                        stream, out));
  StateCacheAccess::owned(**out) = std::move(owned);
  return Status::ok();
}

Status state_cache_create_view(const StateCacheConfig& config,
                               std::span<const CacheBufferBinding> buffers, ViewInit init,
                               std::unique_ptr<StateCache>* out, Stream stream) {
  if (out == nullptr) return invalid_argument("state_cache_create_view: out is null");
  REPLAYSSM_RETURN_IF_ERROR(state_cache_can_implement(config));
  REPLAYSSM_RETURN_IF_ERROR(validate_bindings(config, cache_buffer_specs(config), buffers));
  return build_cache(config, buffers, init, /*zeroed=*/false, stream, out);
}

Status state_cache_allocate_slot(StateCache& cache, int* slot, Stream stream) {
  if (slot == nullptr) return invalid_argument("state_cache_allocate_slot: slot is null");
  const auto& free_list = StateCacheAccess::free_list(cache);
  if (free_list.empty()) {
    return {StatusCode::kOutOfMemory,
            "state cache is full (" + str(cache.config().capacity) + " slots)"};
  }
  const int s = free_list.back();
  REPLAYSSM_RETURN_IF_ERROR(take_slot(cache, s, stream));
  *slot = s;
  return Status::ok();
}

Status state_cache_claim_slot(StateCache& cache, int slot, Stream stream) {
  if (slot < 0 || slot >= cache.config().capacity) {
    return invalid_argument("slot " + str(slot) + " out of range [0, " +
                            str(cache.config().capacity) + ")");
  }
  if (cache.is_allocated(slot)) return invalid_argument("slot " + str(slot) + " is in use");
  return take_slot(cache, slot, stream);
}

Status state_cache_free_slot(StateCache& cache, int slot, Stream stream) {
  REPLAYSSM_RETURN_IF_ERROR(validate_slot(cache, slot));
  // A free slot neither borrows nor lends a checkpoint: its borrowers get their own copies.
  REPLAYSSM_RETURN_IF_ERROR(release_slot_checkpoints(cache.layout(), slot, 0,
                                                     cache.config().num_layers,
                                                     ReleaseFor::kOverwrite, stream));
  REPLAYSSM_RETURN_IF_ERROR(
      memory_set_byte(cache.config().device, cache.layout().allocated + slot, 0, stream));
  StateCacheAccess::host_allocated(cache)[static_cast<std::size_t>(slot)] = 0;
  StateCacheAccess::free_list(cache).push_back(slot);
  return Status::ok();
}

Status state_cache_load_state(StateCache& cache, int layer, int slot, const float* state,
                              Stream stream) {
  REPLAYSSM_RETURN_IF_ERROR(validate_layer(cache, layer));
  REPLAYSSM_RETURN_IF_ERROR(validate_slot(cache, slot));
  if (state == nullptr) return invalid_argument("state_cache_load_state: state is null");
  REPLAYSSM_RETURN_IF_ERROR(validate_no_pending(cache, layer, slot, "load a state into", stream));
  StateCacheLayout& l = cache.layout();
  switch (l.config.device) {
    case Device::kCpu:
      REPLAYSSM_RETURN_IF_ERROR(validate_finite_state(l, state));
      REPLAYSSM_RETURN_IF_ERROR(
          release_slot_checkpoints(l, slot, layer, 1, ReleaseFor::kOverwrite, stream));
      cpu::load_state(l, layer, slot, state);
      return Status::ok();
    case Device::kCuda: return cuda::load_state(l, layer, slot, state, stream);
  }
  return invalid_argument("unknown device");
}

Status state_cache_export_state(StateCache& cache, int layer, int slot, float* state,
                                Stream stream) {
  REPLAYSSM_RETURN_IF_ERROR(validate_layer(cache, layer));
  REPLAYSSM_RETURN_IF_ERROR(validate_slot(cache, slot));
  if (state == nullptr) return invalid_argument("state_cache_export_state: state is null");
  StateCacheLayout& l = cache.layout();
  // Export folds first, so a slot that shares its checkpoint stops where the fold is due.
  REPLAYSSM_RETURN_IF_ERROR(release_slot_checkpoints(l, slot, layer, 1, ReleaseFor::kFold, stream));
  switch (l.config.device) {
    case Device::kCpu:
      cpu::fold_committed(l, layer, slot);
      cpu::export_state(l, layer, slot, state);
      return Status::ok();
    case Device::kCuda: return cuda::export_state(l, layer, slot, state, stream);
  }
  return invalid_argument("unknown device");
}

namespace {

// What loading and exporting a conv window check; the slot's committed position on the host.
Status conv_window_call(StateCache& cache, int layer, int slot, const void* window,
                        const char* op, Stream stream, std::uint32_t* committed) {
  REPLAYSSM_RETURN_IF_ERROR(validate_layer(cache, layer));
  REPLAYSSM_RETURN_IF_ERROR(validate_slot(cache, slot));
  const StateCacheLayout& l = cache.layout();
  if (l.conv_window == nullptr) {
    return invalid_argument(std::string(op) + ": the cache has no conv window (conv_kernel = 0)");
  }
  if (window == nullptr) return invalid_argument(std::string(op) + ": window is null");
  return memory_to_host(l.config.device, committed, l.committed + slot, sizeof(std::uint32_t),
                        stream);
}

}  // namespace

Status state_cache_load_conv_window(StateCache& cache, int layer, int slot, const void* window,
                                    Stream stream) {
  std::uint32_t committed = 0;
  REPLAYSSM_RETURN_IF_ERROR(conv_window_call(cache, layer, slot, window,
                                             "state_cache_load_conv_window", stream, &committed));
  return write_conv_window(cache.layout(), layer, slot, committed, window, stream);
}

Status state_cache_export_conv_window(StateCache& cache, int layer, int slot, void* window,
                                      Stream stream) {
  std::uint32_t committed = 0;
  REPLAYSSM_RETURN_IF_ERROR(conv_window_call(cache, layer, slot, window,
                                             "state_cache_export_conv_window", stream,
                                             &committed));
  return read_conv_window(cache.layout(), layer, slot, committed, window, stream);
}

Status state_cache_commit(StateCache& cache, const CommitArgs& args, Stream stream) {
  REPLAYSSM_RETURN_IF_ERROR(validate_commit(cache, args));
  StateCacheLayout& l = cache.layout();
  switch (l.config.device) {
    case Device::kCpu:
      cpu::commit(l, args);
      return Status::ok();
    case Device::kCuda: return cuda::commit(l, args, stream);
  }
  return invalid_argument("unknown device");
}

Status state_cache_fold(StateCache& cache, const FoldArgs& args, Stream stream) {
  REPLAYSSM_RETURN_IF_ERROR(validate_batch_slots(cache, args.batch, args.slot_ids));
  StateCacheLayout& l = cache.layout();
  if (l.config.mode == DecodeMode::kEager || args.batch == 0) return Status::ok();
  REPLAYSSM_RETURN_IF_ERROR(release_checkpoints(  // num_tokens 0: an explicit fold
      l, {.num_layers = l.config.num_layers, .batch = args.batch, .slot_ids = args.slot_ids,
          .why = ReleaseFor::kFold},
      stream));
  switch (l.config.device) {
    case Device::kCpu:
      for (int b = 0; b < args.batch; ++b) {
        if (args.slot_ids[b] < 0) continue;
        for (int layer = 0; layer < l.config.num_layers; ++layer) {
          cpu::fold_committed(l, layer, args.slot_ids[b]);
        }
      }
      return Status::ok();
    case Device::kCuda: return cuda::fold(l, args, stream);
  }
  return invalid_argument("unknown device");
}

}  // namespace replayssm
