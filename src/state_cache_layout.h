#pragma once
// The raw buffers of a StateCache, shared by the CPU and CUDA backends. Plain data only (no
// CUDA types) so that it can be passed by value into kernels' Params.
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

#include "replayssm/state_cache.h"
#include "replayssm/types.h"

namespace replayssm {

struct StateCacheLayout {
  StateCacheConfig config;
  StateDims dims;
  int ring_capacity = 0;  // power of two; 0 for eager caches
  std::int64_t total_bytes = 0;

  // Eager: the state, [layer][slot][heads, rows, cols] in config.state_dtype.
  void* state = nullptr;

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
  std::uint8_t* pending = nullptr;     // [slot]
  std::uint8_t* allocated = nullptr;   // [slot]

  // Sizes and offsets, in elements.
  [[nodiscard]] std::int64_t state_elems() const { return dims.state_elems(); }
  [[nodiscard]] std::int64_t state_rows() const {
    return std::int64_t{dims.heads} * dims.rows;
  }
  [[nodiscard]] std::int64_t layer_slot(int layer, int slot) const {
    return std::int64_t{layer} * config.capacity + slot;
  }
  [[nodiscard]] std::int64_t vec_elems() const { return std::int64_t{dims.heads} * dims.rows; }
  [[nodiscard]] std::int64_t key_elems() const {
    return std::int64_t{dims.key_heads} * dims.cols;
  }
  // Index of ring entry `pos` of (layer, slot) in units of one record.
  [[nodiscard]] std::int64_t ring_record(int layer, int slot, std::uint32_t pos) const {
    return layer_slot(layer, slot) * ring_capacity + (pos & std::uint32_t(ring_capacity - 1));
  }
  [[nodiscard]] bool has_hi() const { return ckpt_hi != nullptr; }
  [[nodiscard]] bool has_lo() const { return ckpt_lo != nullptr; }
  [[nodiscard]] DType lo_dtype() const {
    return config.checkpoint == CheckpointPrecision::kFp32Fp8 ? DType::kF8E4M3 : DType::kBF16;
  }
};

}  // namespace replayssm
