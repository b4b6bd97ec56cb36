#pragma once
// Test values in the element types the library stores (fp32, bf16, f16, fp8 e4m3): rounding a
// value as a dtype stores it, packing fp32 values into a dtype's bytes, and reading them back.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "replayssm/types.h"

namespace replayssm::testing {

/// v as `dtype` stores it (round to nearest even; fp8 saturates), back in fp32.
float round_to(DType dtype, float v);
void round_all(DType dtype, std::vector<float>* v);
/// Packs fp32 values into `dtype` bytes.
std::vector<std::uint8_t> encode(DType dtype, const std::vector<float>& v);
/// Element i of a `dtype` array, as fp32.
float decode_elem(DType dtype, const void* data, std::size_t i);
std::vector<float> decode(DType dtype, const void* data, std::size_t n);

}  // namespace replayssm::testing
