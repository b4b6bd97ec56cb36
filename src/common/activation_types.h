#pragma once
// Host code's dispatch from an activation dtype (f32, bf16, f16) to its C++ type (numeric.h's
// storage structs), for code outside the CPU backend's instruction-set variants (which have
// their own, cpu/cpu_common.h) and the CUDA dispatch (cuda/common/dispatch.cuh).

#include "common/numeric.h"
#include "replayssm/types.h"

namespace replayssm {

/// Calls fn(T{}) with T the C++ type of an activation dtype; nothing for the others (caches
/// refuse them as activations).
template <typename Fn>
void with_activation_type(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32: fn(float{}); return;
    case DType::kBF16: fn(bf16_t{}); return;
    case DType::kF16: fn(f16_t{}); return;
    case DType::kF8E4M3:
    case DType::kU8:
    case DType::kU32:
      return;
  }
}

}  // namespace replayssm
