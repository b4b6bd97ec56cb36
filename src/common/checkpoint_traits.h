#pragma once
// What each checkpoint precision means (ALGORITHM.md §6), in one table for the host and the
// device: which copies a replay cache keeps, which copy outputs read and folds update, and the
// bytes of each. Allocation (the buffer list), both backends and the benches' bytes model read
// it; nothing else spells these facts out.

#include "common/host_device.h"
#include "replayssm/types.h"

namespace replayssm {

struct CheckpointTraits {
  bool has_hi = false;        ///< an fp32 copy (the master folds update, when there is a lo)
  bool has_lo = false;        ///< a low-precision copy (outputs read it when present)
  DType lo_dtype = DType::kBF16;
  int lo_bytes = 0;           ///< bytes per element of the low copy; 0 without one
  bool lo_row_scale = false;  ///< the low copy has one fp32 dequantisation scale per state row

  /// Bytes per element of the copy that outputs read (the low copy when there is one).
  REPLAYSSM_HD constexpr int read_bytes() const { return has_lo ? lo_bytes : 4; }
  /// Whether folds round into the copy outputs read (one shared copy: bf16 alone). Then
  /// rounding accumulates fold after fold; with a master, each fold rounds once from fp32.
  REPLAYSSM_HD constexpr bool shared_copy() const { return has_hi != has_lo; }
};

REPLAYSSM_HD constexpr CheckpointTraits checkpoint_traits(CheckpointPrecision p) {
  switch (p) {
    case CheckpointPrecision::kFp32: return {true, false, DType::kBF16, 0, false};
    case CheckpointPrecision::kBf16: return {false, true, DType::kBF16, 2, false};
    case CheckpointPrecision::kFp32Bf16: return {true, true, DType::kBF16, 2, false};
    case CheckpointPrecision::kFp32Fp8: return {true, true, DType::kF8E4M3, 1, true};
  }
  return {};
}

}  // namespace replayssm
