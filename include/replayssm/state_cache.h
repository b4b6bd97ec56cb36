#pragma once
/// \file state_cache.h
/// The per-layer-kind state cache: every decoding sequence owns a slot; a slot holds, for each
/// of the cache's layers, either the eager state or (replay) the checkpoint copies and the ring
/// of recent inputs, plus cursors shared by all layers of the slot (ALGORITHM.md §3, §8).
///
/// Cursors (all in the cache's memory: host for the CPU backend, device for CUDA):
///   committed[slot]       absolute position of the next token to commit (shared by layers)
///   folded[layer][slot]   position through which that layer's checkpoint is folded
///   pending[slot]         tokens appended by the last decode and not yet committed
/// A layer's ring holds positions folded..committed+pending-1 at index pos & (ring_capacity-1).
/// Each layer folds its own committed history at the start of a decode when
/// committed - folded >= buffer_len, so folds need no cross-layer step and no host decision;
/// every layer of a slot takes the same decision because they share `committed`.

#include <cstdint>
#include <memory>
#include <vector>

#include "replayssm/status.h"
#include "replayssm/types.h"

namespace replayssm {

/// The ranges a cache configuration may take (one source: the library checks them at creation,
/// tools check them before any work and quote them in --help).
inline constexpr int kMaxBufferLen = 4096;  ///< buffer_len (L) in [1, kMaxBufferLen]
inline constexpr int kMaxSpecTokens = 64;   ///< max_spec_tokens (T) in [1, kMaxSpecTokens]

struct StateCacheConfig {
  LayerKind kind = LayerKind::kMamba2;
  Mamba2Shape mamba2;  ///< used when kind == kMamba2
  GdnShape gdn;        ///< used when kind == kGdn
  int num_layers = 1;  ///< layers of this kind and shape that share the slots' cursors
  int capacity = 0;    ///< slots
  Device device = Device::kCpu;
  DecodeMode mode = DecodeMode::kReplay;
  /// Activation dtype: inputs, ring records and outputs (f32, bf16 or f16).
  DType input_dtype = DType::kF32;
  /// Eager only: the state's dtype (f32, bf16 or f16).
  DType state_dtype = DType::kF32;
  /// Replay only: tokens per fold cycle (L >= 1).
  int buffer_len = 16;
  /// Replay only: the widest speculative window a decode may verify (T >= 1; 1 = plain decode).
  int max_spec_tokens = 1;
  CheckpointPrecision checkpoint = CheckpointPrecision::kFp32;

  [[nodiscard]] StateDims dims() const {
    return kind == LayerKind::kMamba2 ? state_dims(mamba2) : state_dims(gdn);
  }
};

struct StateCacheLayout;  // the raw buffers, shared by the backends (src/state_cache_layout.h)

class StateCache {
 public:
  ~StateCache();
  StateCache(const StateCache&) = delete;
  StateCache& operator=(const StateCache&) = delete;

  [[nodiscard]] const StateCacheConfig& config() const;
  /// Ring entries per slot and layer: next power of two >= buffer_len + 2*max_spec_tokens - 1.
  /// (Committed history reaches buffer_len - 1 + T before the fold fused into the next decode,
  /// which then appends its own window of up to T tokens.)
  [[nodiscard]] int ring_capacity() const;
  [[nodiscard]] int free_slots() const;
  [[nodiscard]] bool is_allocated(int slot) const;
  /// Bytes of device (or host) memory the cache holds.
  [[nodiscard]] std::int64_t bytes() const;

  /// For the backends and tests; not for users.
  [[nodiscard]] StateCacheLayout& layout();
  [[nodiscard]] const StateCacheLayout& layout() const;

 private:
  friend Status state_cache_create(const StateCacheConfig&, std::unique_ptr<StateCache>*);
  friend Status state_cache_allocate_slot(StateCache&, int*);
  friend Status state_cache_free_slot(StateCache&, int);
  StateCache();
  std::unique_ptr<StateCacheLayout> layout_;
  std::vector<int> free_list_;  // host-side: allocation is a host decision
  std::vector<std::uint8_t> host_allocated_;  // host mirror of layout_->allocated
};

/// Validates the config and allocates every buffer (zeroed state, empty rings).
Status state_cache_create(const StateCacheConfig& config, std::unique_ptr<StateCache>* out);

/// Takes a free slot: zero state in every layer, empty ring, cursors at 0.
Status state_cache_allocate_slot(StateCache& cache, int* slot);
Status state_cache_free_slot(StateCache& cache, int slot);

/// Prefill hand-off: writes a full fp32 state (host memory, [heads, rows, cols]) into one layer
/// of a slot: the eager state, or S_hi and the rounded S_lo; that layer's ring is emptied.
/// Only allowed while the slot has no uncommitted window.
Status state_cache_load_state(StateCache& cache, int layer, int slot, const float* state);

/// Materialises one layer's current state into host memory as fp32 [heads, rows, cols]: a
/// replay cache first folds the layer's committed history into its checkpoint (for
/// preemption and debugging), so this writes the checkpoint.
Status state_cache_export_state(StateCache& cache, int layer, int slot, float* state);

struct CommitArgs {
  int batch = 0;
  const std::int32_t* slot_ids = nullptr;  ///< [batch], cache memory; -1 = pad row
  const std::int32_t* accepted = nullptr;  ///< [batch], cache memory; 0 <= k <= pending tokens
};

/// Accepts k of the tokens the last decode appended, for every layer at once: committed += k.
/// Rejected drafts stay in the ring to be overwritten: rollback is a cursor move.
/// CPU caches reject k outside [0, pending] with an error; CUDA caches, whose counts are device
/// memory (no host round trip, graph-capturable), clamp k to [0, pending] on the device.
Status state_cache_commit(StateCache& cache, const CommitArgs& args);

struct FoldArgs {
  int batch = 0;
  const std::int32_t* slot_ids = nullptr;  ///< [batch], cache memory; -1 = pad row
};

/// Folds the committed history of every layer of these slots into their checkpoints now
/// (decodes also fold by themselves once buffer_len tokens are due). Eager caches: no-op.
Status state_cache_fold(StateCache& cache, const FoldArgs& args);

}  // namespace replayssm
