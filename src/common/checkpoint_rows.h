#pragma once
// One (layer, slot, head) block of a replay checkpoint and its rows, in every copy the cache's
// precision keeps: how a row reads as fp32 and how an fp32 row is stored (the master as is, the
// low copy rounded, fp8 with a fresh per-row scale). Host code of both backends uses it (the
// CPU backend's ops; the CUDA backend's load/export staging), so a CUDA cache rounds its
// copies exactly as a CPU cache does. Written so that GCC vectorises the row loops.

#include <algorithm>
#include <cstdint>

#include "common/numeric.h"
#include "replayssm/types.h"
#include "state_cache_layout.h"

namespace replayssm {

/// Addresses of one (layer, slot, head) state block in every checkpoint copy.
struct CheckpointHead {
  float* hi = nullptr;        // [rows, cols] fp32 master, or null
  bf16_t* lo_bf16 = nullptr;  // [rows, cols], or null
  fp8e4m3_t* lo_fp8 = nullptr;
  float* lo_scale = nullptr;  // [rows] (fp8 only)
  int rows = 0;
  int cols = 0;
};

inline CheckpointHead checkpoint_head(const StateCacheLayout& l, int layer, int slot, int head) {
  CheckpointHead c;
  c.rows = l.dims.rows;
  c.cols = l.dims.cols;
  // The rows the slot reads: its own, or its fork source's while they share them.
  const std::int64_t region = l.checkpoint_region(layer, slot);
  const std::int64_t block = region * l.state_elems() +
                             std::int64_t{head} * l.dims.rows * l.dims.cols;
  if (l.ckpt_hi != nullptr) c.hi = l.ckpt_hi + block;
  if (l.ckpt_lo != nullptr) {
    if (l.lo_dtype() == DType::kF8E4M3) {
      c.lo_fp8 = static_cast<fp8e4m3_t*>(l.ckpt_lo) + block;
      c.lo_scale = l.ckpt_lo_scale + region * l.state_rows() +
                   std::int64_t{head} * l.dims.rows;
    } else {
      c.lo_bf16 = static_cast<bf16_t*>(l.ckpt_lo) + block;
    }
  }
  return c;
}

/// Elementwise fp32 value of a checkpoint element, branch-free so the loops that stream a
/// checkpoint copy vectorise (fp8: exact for every finite code; the NaN codes, which folds
/// never write from finite states, read as ±480).
inline float widen(float v) { return v; }
inline float widen(bf16_t v) { return to_float(v); }
inline float widen(fp8e4m3_t v) {
  const std::uint32_t magnitude = v.bits & 0x7fu;                          // exponent:mantissa
  const std::uint32_t normal = (magnitude << 20) + (120u << 23);           // rebias 7 -> 127
  const std::uint32_t subnormal =
      float_bits(static_cast<float>(magnitude) * 0.001953125f);            // mantissa · 2^-9
  // Select and sign with bit masks: GCC leaves a ?: here as a branch, which stops the
  // vectorisation of the loops that stream an fp8 copy.
  const std::uint32_t is_subnormal = 0u - static_cast<std::uint32_t>(magnitude < 8u);
  const std::uint32_t sign = std::uint32_t(v.bits & 0x80u) << 24;
  return bits_float(((subnormal & is_subnormal) | (normal & ~is_subnormal)) | sign);
}

/// fp32 → fp8 e4m3 code, bit-identical to numeric.h's float_to_fp8e4m3 (round to nearest even,
/// saturating at ±448, NaN to 0x7f) but with the three cases selected by masks instead of
/// branches, so that the folds' row encoding vectorises (the branchy encoder made fp32+fp8
/// folds the slowest part of a CPU replay step). Checked against float_to_fp8e4m3 on every
/// fp32 bit pattern (tests/test_numeric.cpp samples them).
inline fp8e4m3_t narrow_fp8(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t sign = (u >> 24) & 0x80u;
  const std::uint32_t a = u & 0x7fffffffu;
  // Normal range (|f| >= 2^-6): round at mantissa bit 20, rebias 127 -> 7, saturate at 0x7e.
  const std::uint32_t rounded = (a + 0x7ffffu + ((a >> 20) & 1u) - (120u << 23)) >> 20;
  const std::uint32_t normal = rounded < 0x7eu ? rounded : 0x7eu;
  // Subnormal range: |f|·2^9 rounded to an integer by adding 2^23 (the FPU rounds to even).
  const std::uint32_t subnormal = float_bits(bits_float(a) * 512.0f + 8388608.0f) - 0x4b000000u;
  const std::uint32_t is_sub = 0u - static_cast<std::uint32_t>(a < 0x3c800000u);
  const std::uint32_t is_nan = 0u - static_cast<std::uint32_t>(a > 0x7f800000u);
  const std::uint32_t code = (subnormal & is_sub) | (normal & ~is_sub);
  return fp8e4m3_t{static_cast<std::uint8_t>(sign | (0x7fu & is_nan) | (code & ~is_nan))};
}

/// Row r of the copy that outputs read, as fp32: the low copy when there is one, else the fp32
/// copy. (The hot loop does not call this: it widens inside the dot, see checkpoint_matvec.)
inline void read_output_row(const CheckpointHead& c, int r, float* out) {
  const std::int64_t off = std::int64_t{r} * c.cols;
  if (c.lo_fp8 != nullptr) {
    for (int i = 0; i < c.cols; ++i) out[i] = widen(c.lo_fp8[off + i]) * c.lo_scale[r];
  } else if (c.lo_bf16 != nullptr) {
    for (int i = 0; i < c.cols; ++i) out[i] = widen(c.lo_bf16[off + i]);
  } else {
    for (int i = 0; i < c.cols; ++i) out[i] = c.hi[off + i];
  }
}

/// Row r of the copy that folds update: the fp32 master when there is one (shared bf16 mode
/// has only the low copy, which is the point of comparing against it).
inline void read_master_row(const CheckpointHead& c, int r, float* out) {
  if (c.hi != nullptr) {
    const std::int64_t off = std::int64_t{r} * c.cols;
    for (int i = 0; i < c.cols; ++i) out[i] = c.hi[off + i];
  } else {
    read_output_row(c, r, out);
  }
}

/// Stores a folded fp32 row into every copy: the master as is, the low copy rounded (fp8 with
/// a fresh per-row scale max|row| / 448, so the row's largest element maps to fp8's largest).
inline void write_row(const CheckpointHead& c, int r, const float* row) {
  const std::int64_t off = std::int64_t{r} * c.cols;
  if (c.hi != nullptr) {
    for (int i = 0; i < c.cols; ++i) c.hi[off + i] = row[i];
  }
  if (c.lo_bf16 != nullptr) {
    for (int i = 0; i < c.cols; ++i) c.lo_bf16[off + i] = float_to_bf16(row[i]);
  }
  if (c.lo_fp8 != nullptr) {
    // max |row| on the bit patterns (the order of non-negative floats), NaNs skipped as
    // std::max skips them: this form vectorises, a float max reduction does not (GCC keeps
    // its NaN order), and the scalar loop was a quarter of an fp32+fp8 fold.
    std::uint32_t amax_bits = 0;
    for (int i = 0; i < c.cols; ++i) {
      const std::uint32_t m = float_bits(row[i]) & 0x7fffffffu;
      const std::uint32_t is_number = 0u - static_cast<std::uint32_t>(m <= 0x7f800000u);
      amax_bits = std::max(amax_bits, m & is_number);
    }
    const float amax = bits_float(amax_bits);
    const float scale = amax > 0.0f ? amax / kFp8Max : 1.0f;
    const float inv = 1.0f / scale;
    c.lo_scale[r] = scale;
    for (int i = 0; i < c.cols; ++i) c.lo_fp8[off + i] = narrow_fp8(row[i] * inv);
  }
}

}  // namespace replayssm
