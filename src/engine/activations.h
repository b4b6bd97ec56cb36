#pragma once
/// \file activations.h
/// Host-side conversion of fp32 values to and from an activation dtype (f32, bf16, f16), with
/// the library's rounding (round to nearest even, common/numeric.h). The engine and the
/// benchmarks stage inputs in fp32 and hand the cache its input dtype.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "replayssm/types.h"

namespace replayssm {

/// n fp32 values → n `dtype` elements at dst (n · dtype_size(dtype) bytes).
void activations_pack(DType dtype, const float* src, std::size_t n, void* dst);
/// n `dtype` elements at src → n fp32 values.
void activations_unpack(DType dtype, const void* src, std::size_t n, float* dst);

inline std::vector<std::uint8_t> activations_pack(DType dtype, const std::vector<float>& src) {
  std::vector<std::uint8_t> bytes(src.size() * dtype_size(dtype));
  activations_pack(dtype, src.data(), src.size(), bytes.data());
  return bytes;
}

}  // namespace replayssm
