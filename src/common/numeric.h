#pragma once
// Scalar conversions and math shared by the CPU backend and the CUDA kernels, written once so
// that both round the same way (round-to-nearest-even; fp8 e4m3 saturates at ±448, like
// __NV_SATFINITE). Host code and device code both include this.

#include <bit>
#include <cmath>
#include <cstdint>

#include "common/host_device.h"

namespace replayssm {

struct bf16_t {
  std::uint16_t bits;
};
struct f16_t {
  std::uint16_t bits;
};
struct fp8e4m3_t {
  std::uint8_t bits;
};

REPLAYSSM_HD std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<std::uint32_t>(f);
#endif
}
REPLAYSSM_HD float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);  // unlike memcpy, keeps loops that use it vectorisable
#endif
}

REPLAYSSM_HD float to_float(float v) { return v; }
REPLAYSSM_HD float to_float(bf16_t v) { return bits_float(std::uint32_t{v.bits} << 16); }

REPLAYSSM_HD float to_float(f16_t v) {
  const std::uint32_t sign = std::uint32_t(v.bits & 0x8000u) << 16;
  const std::uint32_t exp = (v.bits >> 10) & 0x1fu;
  const std::uint32_t man = v.bits & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {                                                          // zero / subnormal
    const float mag = float(man) * 5.9604644775390625e-8f;                 // man * 2^-24
    return sign ? -mag : mag;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// fp8 e4m3 (OCP "FN": no infinities, 0x7f/0xff are NaN, max normal 448).
REPLAYSSM_HD float to_float(fp8e4m3_t v) {
  const std::uint32_t sign = v.bits & 0x80u;
  const std::uint32_t exp = (v.bits >> 3) & 0xfu;
  const std::uint32_t man = v.bits & 0x7u;
  float mag;
  if (exp == 0xf && man == 0x7) {
    mag = NAN;
  } else if (exp == 0) {
    mag = float(man) * 0.001953125f;  // man * 2^-9
  } else {
    mag = bits_float(((exp + 120u) << 23) | (man << 20));
  }
  return sign ? -mag : mag;
}

REPLAYSSM_HD bool is_nan_bits(std::uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

REPLAYSSM_HD bf16_t float_to_bf16(float f) {
  std::uint32_t u = float_bits(f);
  if (is_nan_bits(u)) return bf16_t{std::uint16_t((u >> 16) | 0x40u)};  // quiet, payload kept
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // The same rounding in one instruction (the hardware differs only for NaN, handled above).
  std::uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return bf16_t{r};
#else
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{std::uint16_t(u >> 16)};
#endif
}

/// Two values as bf16 in one 32-bit word, `lo` in the low half (the lower address): each as
/// float_to_bf16 rounds it, two per instruction on the GPU.
REPLAYSSM_HD std::uint32_t float2_to_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (!is_nan_bits(float_bits(lo)) && !is_nan_bits(float_bits(hi))) {
    std::uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
#endif
  return std::uint32_t{float_to_bf16(lo).bits} | (std::uint32_t{float_to_bf16(hi).bits} << 16);
}

REPLAYSSM_HD f16_t float_to_f16(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint16_t sign = std::uint16_t((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return f16_t{std::uint16_t(sign | 0x7e00u)};  // nan
  if (abs >= 0x477ff000u) return f16_t{std::uint16_t(sign | 0x7c00u)};  // rounds to inf
  if (abs < 0x38800000u) {  // below 2^-14: subnormal in f16, round at 2^-24
    const float mag = bits_float(abs);
    // Adding 0.5 (= 2^23 * 2^-24) puts the f16 subnormal mantissa in the low bits of the
    // result with the hardware's round-to-nearest-even.
    const std::uint32_t r = float_bits(mag + 0.5f) - 0x3f000000u;
    return f16_t{std::uint16_t(sign | r)};
  }
  std::uint32_t m = abs + 0xfffu + ((abs >> 13) & 1u);  // round to nearest even at bit 13
  m -= 112u << 23;                                       // rebias 127 -> 15
  return f16_t{std::uint16_t(sign | (m >> 13))};
}

REPLAYSSM_HD fp8e4m3_t float_to_fp8e4m3(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint8_t sign = std::uint8_t((u >> 24) & 0x80u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return fp8e4m3_t{std::uint8_t(sign | 0x7fu)};  // nan
  const float mag = bits_float(abs);
  if (mag >= 448.0f) return fp8e4m3_t{std::uint8_t(sign | 0x7eu)};  // saturate
  if (abs < 0x3c800000u) {  // below 2^-6: subnormal, step 2^-9
    // mag * 2^9 rounded to nearest even integer, 0..8 (8 = smallest normal 0x08).
    const float scaled = mag * 512.0f;
    const std::uint32_t r = float_bits(scaled + 8388608.0f) - 0x4b000000u;  // + 2^23 trick
    return fp8e4m3_t{std::uint8_t(sign | r)};
  }
  std::uint32_t m = abs + 0x7ffffu + ((abs >> 20) & 1u);  // round to nearest even at bit 20
  m -= 120u << 23;                                         // rebias 127 -> 7
  const std::uint32_t r = m >> 20;
  return fp8e4m3_t{std::uint8_t(sign | (r > 0x7eu ? 0x7eu : r))};
}

template <typename T>
REPLAYSSM_HD T from_float(float f);
template <>
REPLAYSSM_HD float from_float<float>(float f) { return f; }
template <>
REPLAYSSM_HD bf16_t from_float<bf16_t>(float f) { return float_to_bf16(f); }
template <>
REPLAYSSM_HD f16_t from_float<f16_t>(float f) { return float_to_f16(f); }
template <>
REPLAYSSM_HD fp8e4m3_t from_float<fp8e4m3_t>(float f) { return float_to_fp8e4m3(f); }

/// Largest finite fp8 e4m3 value; a row's scale is max|row| / kFp8Max.
constexpr float kFp8Max = 448.0f;

/// softplus(u) = log(1 + e^u), = u past 20 (as the models do).
REPLAYSSM_HD float softplus(float u) { return u > 20.0f ? u : log1pf(expf(u)); }
REPLAYSSM_HD float silu(float u) { return u / (1.0f + expf(-u)); }

}  // namespace replayssm
