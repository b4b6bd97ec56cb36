#include "testing/dtypes.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "common/numeric.h"

namespace replayssm::testing {

namespace {

// The cursor types (u8, u32) are no activation, state or checkpoint type.
[[noreturn]] void not_a_value_type(DType dtype) {
  throw std::invalid_argument(std::string("not a floating-point dtype: ") + dtype_name(dtype));
}

}  // namespace

float round_to(DType dtype, float v) {
  switch (dtype) {
    case DType::kF32: return v;
    case DType::kBF16: return to_float(float_to_bf16(v));
    case DType::kF16: return to_float(float_to_f16(v));
    case DType::kF8E4M3: return to_float(float_to_fp8e4m3(v));
    case DType::kU8:
    case DType::kU32: not_a_value_type(dtype);
  }
  return v;
}

void round_all(DType dtype, std::vector<float>* v) {
  for (float& e : *v) e = round_to(dtype, e);
}

std::vector<std::uint8_t> encode(DType dtype, const std::vector<float>& v) {
  const std::size_t es = dtype_size(dtype);
  std::vector<std::uint8_t> out(v.size() * es);
  for (std::size_t i = 0; i < v.size(); ++i) {
    std::uint8_t* dst = out.data() + i * es;
    switch (dtype) {
      case DType::kF32: std::memcpy(dst, &v[i], 4); break;
      case DType::kBF16: {
        const bf16_t b = float_to_bf16(v[i]);
        std::memcpy(dst, &b.bits, 2);
        break;
      }
      case DType::kF16: {
        const f16_t h = float_to_f16(v[i]);
        std::memcpy(dst, &h.bits, 2);
        break;
      }
      case DType::kF8E4M3: *dst = float_to_fp8e4m3(v[i]).bits; break;
      case DType::kU8:
      case DType::kU32: not_a_value_type(dtype);
    }
  }
  return out;
}

float decode_elem(DType dtype, const void* data, std::size_t i) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  switch (dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
    case DType::kBF16: {
      bf16_t b;
      std::memcpy(&b.bits, p + 2 * i, 2);
      return to_float(b);
    }
    case DType::kF16: {
      f16_t h;
      std::memcpy(&h.bits, p + 2 * i, 2);
      return to_float(h);
    }
    case DType::kF8E4M3: return to_float(fp8e4m3_t{p[i]});
    case DType::kU8:
    case DType::kU32: not_a_value_type(dtype);
  }
  return 0.0f;
}

std::vector<float> decode(DType dtype, const void* data, std::size_t n) {
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = decode_elem(dtype, data, i);
  return out;
}

}  // namespace replayssm::testing
