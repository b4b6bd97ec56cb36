// StateCache: config validation, buffer allocation, slot management and the cursor ops.
// Everything here is backend-agnostic; the per-element work is in src/cpu and src/cuda.

#include "replayssm/state_cache.h"

#include <string>

#include "backend.h"
#include "state_cache_layout.h"
#include "validate.h"

namespace replayssm {

namespace {

int next_pow2(int v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

bool is_activation_dtype(DType d) {
  return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16;
}

Status validate_config(const StateCacheConfig& c) {
  const StateDims d = c.dims();
  if (d.heads <= 0 || d.rows <= 0 || d.cols <= 0 || d.key_heads <= 0) {
    return invalid_argument("layer shape has a non-positive dimension");
  }
  if (d.heads % d.key_heads != 0) {
    return invalid_argument(c.kind == LayerKind::kMamba2
                                ? "nheads must be a multiple of ngroups"
                                : "num_v_heads must be a multiple of num_k_heads");
  }
  if (c.num_layers < 1) return invalid_argument("num_layers must be >= 1");
  if (c.capacity < 1) return invalid_argument("capacity must be >= 1 slot");
  if (!is_activation_dtype(c.input_dtype)) {
    return invalid_argument(std::string("unsupported input dtype ") + dtype_name(c.input_dtype) +
                            "; supported: f32, bf16, f16");
  }
  if (c.mode == DecodeMode::kEager) {
    if (!is_activation_dtype(c.state_dtype)) {
      return invalid_argument(std::string("unsupported eager state dtype ") +
                              dtype_name(c.state_dtype) + "; supported: f32, bf16, f16");
    }
    return Status::ok();
  }
  if (c.buffer_len < 1 || c.buffer_len > kMaxBufferLen) {
    return invalid_argument("buffer_len (L) must be in [1, " + std::to_string(kMaxBufferLen) +
                            "], got " + std::to_string(c.buffer_len));
  }
  if (c.max_spec_tokens < 1 || c.max_spec_tokens > kMaxSpecTokens) {
    return invalid_argument("max_spec_tokens (T) must be in [1, " +
                            std::to_string(kMaxSpecTokens) + "], got " +
                            std::to_string(c.max_spec_tokens));
  }
  return Status::ok();
}

// Allocates `count` elements of `elem_bytes` into *ptr, accumulating the total in *total.
template <typename T>
Status alloc_buffer(Device device, std::int64_t count, std::size_t elem_bytes, T** ptr,
                    std::int64_t* total) {
  const auto bytes = static_cast<std::size_t>(count) * elem_bytes;
  void* p = nullptr;
  REPLAYSSM_RETURN_IF_ERROR(memory_alloc(device, bytes, &p));
  *ptr = static_cast<T*>(p);
  *total += static_cast<std::int64_t>(bytes);
  return Status::ok();
}

}  // namespace

StateCache::StateCache() : layout_(std::make_unique<StateCacheLayout>()) {}

StateCache::~StateCache() {
  auto& l = *layout_;
  const Device dev = l.config.device;
  for (void* p : {l.state, static_cast<void*>(l.ckpt_hi), l.ckpt_lo,
                  static_cast<void*>(l.ckpt_lo_scale), l.ring_vec, l.ring_key, static_cast<void*>(l.ring_key_scale),
                  static_cast<void*>(l.ring_write), static_cast<void*>(l.ring_decay),
                  static_cast<void*>(l.committed), static_cast<void*>(l.folded),
                  static_cast<void*>(l.pending), static_cast<void*>(l.allocated)}) {
    if (p != nullptr) memory_free(dev, p);
  }
}

const StateCacheConfig& StateCache::config() const { return layout_->config; }
int StateCache::ring_capacity() const { return layout_->ring_capacity; }
int StateCache::free_slots() const { return static_cast<int>(free_list_.size()); }
StateCacheLayout& StateCache::layout() { return *layout_; }
const StateCacheLayout& StateCache::layout() const { return *layout_; }
std::int64_t StateCache::bytes() const { return layout_->total_bytes; }

bool StateCache::is_allocated(int slot) const {
  if (slot < 0 || slot >= layout_->config.capacity) return false;
  return host_allocated_[static_cast<std::size_t>(slot)] != 0;
}

Status state_cache_create(const StateCacheConfig& config, std::unique_ptr<StateCache>* out) {
  if (out == nullptr) return invalid_argument("state_cache_create: out is null");
  REPLAYSSM_RETURN_IF_ERROR(validate_config(config));
  if (config.device == Device::kCuda && !cuda_available()) {
    return unsupported("a CUDA state cache needs a build with CUDA and a GPU");
  }
  std::unique_ptr<StateCache> cache(new StateCache());
  StateCacheLayout& l = *cache->layout_;
  l.config = config;
  l.dims = config.dims();
  const Device dev = config.device;
  const std::int64_t layer_slots = std::int64_t{config.num_layers} * config.capacity;
  std::int64_t& total = l.total_bytes;

  if (config.mode == DecodeMode::kEager) {
    REPLAYSSM_RETURN_IF_ERROR(alloc_buffer(dev, layer_slots * l.state_elems(),
                                           dtype_size(config.state_dtype), &l.state, &total));
  } else {
    l.ring_capacity = next_pow2(config.buffer_len + 2 * config.max_spec_tokens - 1);
    const CheckpointPrecision p = config.checkpoint;
    if (p != CheckpointPrecision::kBf16) {
      REPLAYSSM_RETURN_IF_ERROR(
          alloc_buffer(dev, layer_slots * l.state_elems(), 4, &l.ckpt_hi, &total));
    }
    if (p != CheckpointPrecision::kFp32) {
      REPLAYSSM_RETURN_IF_ERROR(alloc_buffer(dev, layer_slots * l.state_elems(),
                                             dtype_size(l.lo_dtype()), &l.ckpt_lo, &total));
    }
    if (p == CheckpointPrecision::kFp32Fp8) {
      REPLAYSSM_RETURN_IF_ERROR(
          alloc_buffer(dev, layer_slots * l.state_rows(), 4, &l.ckpt_lo_scale, &total));
    }
    const std::int64_t records = layer_slots * l.ring_capacity;
    const std::size_t in_bytes = dtype_size(config.input_dtype);
    REPLAYSSM_RETURN_IF_ERROR(
        alloc_buffer(dev, records * l.vec_elems(), in_bytes, &l.ring_vec, &total));
    REPLAYSSM_RETURN_IF_ERROR(
        alloc_buffer(dev, records * l.key_elems(), in_bytes, &l.ring_key, &total));
    if (config.kind == LayerKind::kGdn) {
      REPLAYSSM_RETURN_IF_ERROR(
          alloc_buffer(dev, records * l.dims.key_heads, 4, &l.ring_key_scale, &total));
    }
    REPLAYSSM_RETURN_IF_ERROR(
        alloc_buffer(dev, records * l.dims.heads, 4, &l.ring_write, &total));
    REPLAYSSM_RETURN_IF_ERROR(
        alloc_buffer(dev, records * l.dims.heads, 4, &l.ring_decay, &total));
  }
  REPLAYSSM_RETURN_IF_ERROR(alloc_buffer(dev, config.capacity, 4, &l.committed, &total));
  REPLAYSSM_RETURN_IF_ERROR(alloc_buffer(dev, layer_slots, 4, &l.folded, &total));
  REPLAYSSM_RETURN_IF_ERROR(alloc_buffer(dev, config.capacity, 1, &l.pending, &total));
  REPLAYSSM_RETURN_IF_ERROR(alloc_buffer(dev, config.capacity, 1, &l.allocated, &total));

  cache->host_allocated_.assign(static_cast<std::size_t>(config.capacity), 0);
  cache->free_list_.reserve(static_cast<std::size_t>(config.capacity));
  for (int s = config.capacity - 1; s >= 0; --s) cache->free_list_.push_back(s);
  *out = std::move(cache);
  return Status::ok();
}

Status state_cache_allocate_slot(StateCache& cache, int* slot) {
  if (slot == nullptr) return invalid_argument("state_cache_allocate_slot: slot is null");
  if (cache.free_list_.empty()) {
    return {StatusCode::kOutOfMemory, "state cache is full (" +
                                          std::to_string(cache.config().capacity) + " slots)"};
  }
  const int s = cache.free_list_.back();
  REPLAYSSM_RETURN_IF_ERROR(reset_slot(cache.layout(), s));
  cache.free_list_.pop_back();
  cache.host_allocated_[static_cast<std::size_t>(s)] = 1;
  *slot = s;
  return Status::ok();
}

Status state_cache_free_slot(StateCache& cache, int slot) {
  REPLAYSSM_RETURN_IF_ERROR(validate_slot(cache, slot));
  const std::uint8_t zero = 0;
  REPLAYSSM_RETURN_IF_ERROR(memory_from_host(cache.config().device,
                                             cache.layout().allocated + slot, &zero, 1));
  cache.host_allocated_[static_cast<std::size_t>(slot)] = 0;
  cache.free_list_.push_back(slot);
  return Status::ok();
}

Status state_cache_load_state(StateCache& cache, int layer, int slot, const float* state) {
  REPLAYSSM_RETURN_IF_ERROR(validate_layer(cache, layer));
  REPLAYSSM_RETURN_IF_ERROR(validate_slot(cache, slot));
  if (state == nullptr) return invalid_argument("state_cache_load_state: state is null");
  REPLAYSSM_RETURN_IF_ERROR(validate_no_pending(cache, slot, "load a state into"));
  StateCacheLayout& l = cache.layout();
  if (l.config.device == Device::kCpu) {
    cpu::load_state(l, layer, slot, state);
    return Status::ok();
  }
#if defined(REPLAYSSM_WITH_CUDA)
  return cuda::load_state(l, layer, slot, state);
#else
  return unsupported("built without CUDA");
#endif
}

Status state_cache_export_state(StateCache& cache, int layer, int slot, float* state) {
  REPLAYSSM_RETURN_IF_ERROR(validate_layer(cache, layer));
  REPLAYSSM_RETURN_IF_ERROR(validate_slot(cache, slot));
  if (state == nullptr) return invalid_argument("state_cache_export_state: state is null");
  StateCacheLayout& l = cache.layout();
  if (l.config.device == Device::kCpu) {
    cpu::fold_committed(l, layer, slot);
    cpu::export_state(l, layer, slot, state);
    return Status::ok();
  }
#if defined(REPLAYSSM_WITH_CUDA)
  return cuda::export_state(l, layer, slot, state);
#else
  return unsupported("built without CUDA");
#endif
}

Status state_cache_commit(StateCache& cache, const CommitArgs& args) {
  REPLAYSSM_RETURN_IF_ERROR(validate_commit(cache, args));
  StateCacheLayout& l = cache.layout();
  if (l.config.device == Device::kCpu) {
    cpu::commit(l, args);
    return Status::ok();
  }
#if defined(REPLAYSSM_WITH_CUDA)
  return cuda::commit(l, args);
#else
  return unsupported("built without CUDA");
#endif
}

Status state_cache_fold(StateCache& cache, const FoldArgs& args) {
  REPLAYSSM_RETURN_IF_ERROR(validate_batch_slots(cache, args.batch, args.slot_ids));
  StateCacheLayout& l = cache.layout();
  if (l.config.mode == DecodeMode::kEager) return Status::ok();
  if (l.config.device == Device::kCpu) {
    for (int b = 0; b < args.batch; ++b) {
      if (args.slot_ids[b] < 0) continue;
      for (int layer = 0; layer < l.config.num_layers; ++layer) {
        cpu::fold_committed(l, layer, args.slot_ids[b]);
      }
    }
    return Status::ok();
  }
#if defined(REPLAYSSM_WITH_CUDA)
  return cuda::fold(l, args);
#else
  return unsupported("built without CUDA");
#endif
}

}  // namespace replayssm
