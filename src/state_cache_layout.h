#pragma once
// The raw buffers of a StateCache and the rules that address them, shared by the CPU and CUDA
// backends, host and device. Plain data only (no CUDA types) so that it travels by value inside
// kernels' Params; every index and every L/T rule is written here once.
//
// Every per-slot buffer is indexed [layer][slot][...]; the ring is
// [layer][slot][ring_capacity][...] and position p of a slot lives at p & (ring_capacity - 1).
// Ring record per token (ALGORITHM.md §3), in the common heads × rows × cols view:
//   ring_vec    [heads, rows]       Mamba-2 x, GDN v                  (input dtype)
//   ring_key    [key_heads, cols]   Mamba-2 B, GDN raw k                (input dtype)
//   ring_key_scale [key_heads]      GDN only: 1/sqrt(|k|² + 1e-6), or 1 without qk_l2norm (fp32)
//   ring_write  [heads]             Mamba-2 Δ (after bias, softplus), GDN β        (fp32)
//   ring_decay  [heads]             Mamba-2 A·Δ, GDN g: the token's log-decay     (fp32)
// Mamba-2 stores A·Δ beside Δ so that a fold needs no layer parameters (export, preemption).
// GDN stores the raw key, exact in the input dtype, and its fp32 normalisation factor, so that
// k̂ = k·scale is formed in fp32 wherever it is used: a k̂ rounded to bf16 in the ring would put
// an input-dtype rounding into every fold of the fp32 master (measured: 2x the error of a
// plain bf16-input loop; with the scale, replay's error equals eager's).

#include <cstdint>

#include "common/checkpoint_traits.h"
#include "common/host_device.h"
#include "replayssm/state_cache.h"
#include "replayssm/types.h"

namespace replayssm {

// ---- the L/T rules (L = buffer_len, T = max_spec_tokens) -------------------------------------

/// The most committed history a (layer, slot) holds in valid use: a fold is due from L on, and
/// one commit may add up to T tokens past L − 1. Kernels clamp to it so that corrupt cursors can
/// never index past their staging.
REPLAYSSM_HD constexpr int max_history(int L, int T) { return L - 1 + T; }
/// Records a decode may touch: that history plus its own window of up to T tokens. What replay
/// kernels stage in shared memory.
REPLAYSSM_HD constexpr int max_records(int L, int T) { return max_history(L, T) + T; }
/// Ring entries per (layer, slot): the next power of two >= max_records, so that a position's
/// index is a mask.
REPLAYSSM_HD constexpr int ring_capacity_for(int L, int T) {
  int p = 1;
  while (p < max_records(L, T)) p <<= 1;
  return p;
}
/// Conv window ring entries per (layer, slot) of a conv cache (kernel K): K - 1 more than the
/// records, so that the window of every position in reach (prefix.h: fork, truncate) survives
/// the window appended after the committed end.
REPLAYSSM_HD constexpr int conv_ring_capacity_for(int L, int T, int K) {
  return ring_capacity_for(L + K - 1, T);
}
/// Whether a decode of `num_tokens` tokens (0: an explicit fold) folds the committed history
/// first: a decode when at least L tokens wait, an explicit fold whenever any do.
REPLAYSSM_HD constexpr bool fold_due(std::uint32_t unfolded_count, int num_tokens, int L) {
  return num_tokens == 0 ? unfolded_count > 0 : unfolded_count >= std::uint32_t(L);
}

/// Eager state copies per (layer, slot). T = 1: one, updated in place. T > 1 (per-draft-state
/// speculation): the current state plus one per window token, so that a window writes the state
/// after each of its tokens without touching the current one, and a commit selects one.
REPLAYSSM_HD constexpr int eager_state_copies(int T) { return T > 1 ? T + 1 : 1; }

// ---- the buffers -----------------------------------------------------------------------------

struct StateCacheLayout {
  StateCacheConfig config;
  StateDims dims;
  CheckpointTraits ckpt;  // of config.checkpoint (replay caches)
  int ring_capacity = 0;  // power of two; 0 for eager caches
  // A decode's fold cadence (ops.h, fold_every; 0 = config.buffer_len): set on the copy of the
  // layout one decode runs on (ops.cpp), never on the cache's own.
  int fold_every = 0;
  std::int64_t total_bytes = 0;

  // Eager: the state, [layer][slot][copy][heads, rows, cols] in config.state_dtype, with
  // eager_state_copies(T) copies; state_current[slot] (T > 1 only, else null) is the copy that
  // holds the committed state, shared by the slot's layers as `committed` is.
  void* state = nullptr;
  std::uint32_t* state_current = nullptr;

  // Replay checkpoint copies, [layer][slot][heads, rows, cols]. ckpt_hi is fp32 (null in
  // kBf16 mode); ckpt_lo is bf16 or fp8 (null in kFp32 mode); ckpt_lo_scale is fp32
  // [layer][slot][heads, rows], one dequantisation scale per state row (fp8 only).
  float* ckpt_hi = nullptr;
  void* ckpt_lo = nullptr;
  float* ckpt_lo_scale = nullptr;

  void* ring_vec = nullptr;
  void* ring_key = nullptr;
  float* ring_key_scale = nullptr;
  float* ring_write = nullptr;
  float* ring_decay = nullptr;

  std::uint32_t* committed = nullptr;  // [slot]
  std::uint32_t* folded = nullptr;     // [layer][slot]
  std::uint8_t* pending = nullptr;     // [layer][slot]
  std::uint8_t* allocated = nullptr;   // [slot]
  // share_forked_checkpoints only (else null), [layer][slot]: ckpt_source 0 when the slot's
  // checkpoint is its own rows, t + 1 when it is slot t's (a fork not yet folded);
  // ckpt_borrowers counts the slots whose ckpt_source names this one. A slot that lends never
  // borrows (forks of a copy name its source's source). src/checkpoint_sharing.h has the rules.
  std::uint32_t* ckpt_source = nullptr;
  std::uint32_t* ckpt_borrowers = nullptr;
  // conv_kernel > 0 only (else null): the pre-conv inputs, [layer][slot][conv_ring][channels]
  // in the input dtype, position p at p & (conv_ring - 1) (conv_record).
  void* conv_window = nullptr;
  int conv_ring = 0;  // power of two; 0 without conv_window

  // Sizes and offsets, in elements.
  REPLAYSSM_HD std::int64_t state_elems() const {
    return std::int64_t{dims.heads} * dims.rows * dims.cols;
  }
  REPLAYSSM_HD std::int64_t state_rows() const { return std::int64_t{dims.heads} * dims.rows; }
  REPLAYSSM_HD std::int64_t vec_elems() const { return std::int64_t{dims.heads} * dims.rows; }
  REPLAYSSM_HD std::int64_t key_elems() const {
    return std::int64_t{dims.key_heads} * dims.cols;
  }
  /// Index of (layer, slot) among the per-layer regions of every [layer][slot] buffer.
  REPLAYSSM_HD std::int64_t layer_slot(int layer, int slot) const {
    return std::int64_t{layer} * config.capacity + slot;
  }
  /// The slot whose checkpoint rows (layer, slot) reads: its own, or while it shares one since
  /// a fork, its source's. Every reader of a checkpoint addresses it through this; a slot
  /// writes its checkpoint only after src/checkpoint_sharing.h's release made it its own. A
  /// corrupt source past the slots reads as the slot's own.
  REPLAYSSM_HD int checkpoint_owner(int layer, int slot) const {
    if (ckpt_source == nullptr) return slot;
    const int lender = lender_slot(ckpt_source[layer_slot(layer, slot)]);
    return lender >= 0 ? lender : slot;
  }
  /// The slot a ckpt_source entry names (entries hold slot + 1; 0 = not borrowing), or -1 for
  /// 0 and for a corrupt entry past the slots. The one decoding of the entries.
  REPLAYSSM_HD int lender_slot(std::uint32_t source) const {
    return source != 0 && source <= std::uint32_t(config.capacity) ? int(source - 1) : -1;
  }
  /// checkpoint_owner's index among the [layer][slot] regions of the checkpoint buffers.
  REPLAYSSM_HD std::int64_t checkpoint_region(int layer, int slot) const {
    return layer_slot(layer, checkpoint_owner(layer, slot));
  }
  /// Index of ring entry `pos` of (layer, slot) in units of one record.
  REPLAYSSM_HD std::int64_t ring_record(int layer, int slot, std::uint32_t pos) const {
    return layer_slot(layer, slot) * ring_capacity + (pos & std::uint32_t(ring_capacity - 1));
  }
  // The conv window (conv caches).
  REPLAYSSM_HD int conv_kernel() const { return config.conv_kernel; }
  REPLAYSSM_HD int conv_channels() const {
    return dims.heads * dims.rows + 2 * dims.key_heads * dims.cols;
  }
  /// Index of conv ring entry `pos` of (layer, slot) in units of one row of conv_channels.
  REPLAYSSM_HD std::int64_t conv_record(int layer, int slot, std::uint32_t pos) const {
    return layer_slot(layer, slot) * conv_ring + (pos & std::uint32_t(conv_ring - 1));
  }
  /// First conv channel of each part: the per-head vectors (Mamba-2 x, GDN v), the keys
  /// (Mamba-2 B, GDN k) and the queries (Mamba-2 C, GDN q), in the models' channel order
  /// (Mamba-2 x, B, C; GDN q, k, v).
  REPLAYSSM_HD int conv_vec_channel() const {
    return config.kind == LayerKind::kMamba2 ? 0 : 2 * dims.key_heads * dims.cols;
  }
  REPLAYSSM_HD int conv_key_channel() const {
    return config.kind == LayerKind::kMamba2 ? dims.heads * dims.rows
                                             : dims.key_heads * dims.cols;
  }
  REPLAYSSM_HD int conv_query_channel() const {
    return config.kind == LayerKind::kMamba2 ? dims.heads * dims.rows + dims.key_heads * dims.cols
                                             : 0;
  }
  /// Eager: state copies per (layer, slot).
  REPLAYSSM_HD int state_copies() const { return eager_state_copies(config.max_spec_tokens); }
  /// Eager: element offset of state copy `copy` of (layer, slot).
  REPLAYSSM_HD std::int64_t state_offset(int layer, int slot, int copy) const {
    return (layer_slot(layer, slot) * state_copies() + copy) * state_elems();
  }
  /// Eager: the copy holding `slot`'s committed state (0 when there is one copy). Taken modulo
  /// the copies, so that a corrupt value still names a copy of the slot.
  REPLAYSSM_HD int current_copy(int slot) const {
    return state_current == nullptr
               ? 0
               : int(state_current[slot] % std::uint32_t(state_copies()));
  }
  /// Eager with T > 1: the copy that receives the state after token t (1 <= t <= T) of a window
  /// read from copy `current`; commit(k) makes after_tokens(current, k) current.
  REPLAYSSM_HD int after_tokens(int current, int t) const {
    return (current + t) % state_copies();
  }
  /// Whether decodes leave a window uncommitted until state_cache_commit: replay caches, and
  /// eager caches with T > 1 (eager T = 1 updates its state in place).
  REPLAYSSM_HD bool holds_windows() const {
    return config.mode == DecodeMode::kReplay || state_copies() > 1;
  }
  REPLAYSSM_HD bool has_hi() const { return ckpt_hi != nullptr; }
  REPLAYSSM_HD bool has_lo() const { return ckpt_lo != nullptr; }
  REPLAYSSM_HD DType lo_dtype() const { return ckpt.lo_dtype; }

  // The L/T rules for this cache.
  REPLAYSSM_HD int max_history() const {
    return replayssm::max_history(config.buffer_len, config.max_spec_tokens);
  }
  REPLAYSSM_HD int max_records() const {
    return replayssm::max_records(config.buffer_len, config.max_spec_tokens);
  }
  /// Committed tokens of (layer, slot) not yet folded into its checkpoint.
  REPLAYSSM_HD std::uint32_t unfolded(int layer, int slot) const {
    return committed[slot] - folded[layer_slot(layer, slot)];
  }
  /// The decode's L: its fold cadence (ops.h, fold_every), config.buffer_len unless the call
  /// set a shorter one. Only fold_due reads it; what the ring and staging hold stays sized by
  /// config.buffer_len (max_history), so history left by a longer cadence still fits.
  REPLAYSSM_HD int fold_length() const {
    return fold_every > 0 ? fold_every : config.buffer_len;
  }
  REPLAYSSM_HD bool fold_due(std::uint32_t unfolded_count, int num_tokens) const {
    return replayssm::fold_due(unfolded_count, num_tokens, fold_length());
  }
};

}  // namespace replayssm
