// src/common/numeric.h: the scalar conversions the CPU backend and the CUDA kernels share, and
// the CPU backend's vector helpers (built here without -march=native: their portable paths).
// Hand-computed values for round-to-nearest-even, ties, subnormals, overflow, NaN and fp8
// saturation, then every code round-tripped and random floats checked against an independent
// nearest-value search (the encoders use bit tricks; the search uses only comparisons).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/numeric.h"
#include "cpu/cpu_common.h"

namespace replayssm {
namespace {

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::uint16_t bf16(float f) { return float_to_bf16(f).bits; }
std::uint16_t f16(float f) { return float_to_f16(f).bits; }
std::uint8_t fp8(float f) { return float_to_fp8e4m3(f).bits; }

// ---- bf16 ---------------------------------------------------------------------------------

TEST(NumericBf16, HandValues) {
  EXPECT_EQ(bf16(1.0f), 0x3F80);
  EXPECT_EQ(bf16(-2.0f), 0xC000);
  EXPECT_EQ(bf16(0.0f), 0x0000);
  EXPECT_EQ(bf16(-0.0f), 0x8000);
  EXPECT_EQ(bf16(3.140625f), 0x4049);  // exact: 1.5703125·2
  EXPECT_EQ(to_float(bf16_t{0x3F80}), 1.0f);
  EXPECT_EQ(to_float(bf16_t{0xC049}), -3.140625f);
  EXPECT_EQ(to_float(bf16_t{0x0001}), from_bits(0x00010000u));  // smallest subnormal
}

TEST(NumericBf16, RoundToNearestEven) {
  // 1 + 2^-8 is half way between 1 (0x3F80, even) and 1 + 2^-7 (0x3F81): goes to even.
  EXPECT_EQ(bf16(from_bits(0x3F808000u)), 0x3F80);
  // 1 + 3·2^-8 is half way between 0x3F81 and 0x3F82 (even).
  EXPECT_EQ(bf16(from_bits(0x3F818000u)), 0x3F82);
  // Just above / below the tie.
  EXPECT_EQ(bf16(from_bits(0x3F808001u)), 0x3F81);
  EXPECT_EQ(bf16(from_bits(0x3F807FFFu)), 0x3F80);
  // Mantissa carry into the exponent: 1.9999999 -> 2.
  EXPECT_EQ(bf16(from_bits(0x3FFFFFFFu)), 0x4000);
  // Subnormal ties: half the smallest subnormal goes to 0, 1.5 of it to 2.
  EXPECT_EQ(bf16(from_bits(0x00008000u)), 0x0000);
  EXPECT_EQ(bf16(from_bits(0x00018000u)), 0x0002);
  EXPECT_EQ(bf16(from_bits(0x00010000u)), 0x0001);
}

TEST(NumericBf16, OverflowInfNan) {
  EXPECT_EQ(bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(bf16(-std::numeric_limits<float>::infinity()), 0xFF80);
  // FLT_MAX is above the largest bf16 (0x7F7F) by more than half an ulp: rounds to inf.
  EXPECT_EQ(bf16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(bf16(from_bits(0x7F7F7FFFu)), 0x7F7F);
  const std::uint16_t nan = bf16(std::nanf(""));
  EXPECT_TRUE(std::isnan(to_float(bf16_t{nan})));
  // A NaN whose payload sits only in the low 16 bits must not become inf.
  EXPECT_TRUE(std::isnan(to_float(float_to_bf16(from_bits(0x7F800001u)))));
  EXPECT_TRUE(std::isnan(to_float(float_to_bf16(from_bits(0xFF800001u)))));
}

// ---- f16 ----------------------------------------------------------------------------------

TEST(NumericF16, HandValues) {
  EXPECT_EQ(f16(1.0f), 0x3C00);
  EXPECT_EQ(f16(-2.0f), 0xC000);
  EXPECT_EQ(f16(0.5f), 0x3800);
  EXPECT_EQ(f16(-0.0f), 0x8000);
  EXPECT_EQ(f16(65504.0f), 0x7BFF);
  EXPECT_EQ(f16(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(f16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(f16(1023.0f * std::ldexp(1.0f, -24)), 0x03FF);  // largest subnormal
  EXPECT_EQ(to_float(f16_t{0x3C00}), 1.0f);
  EXPECT_EQ(to_float(f16_t{0x7BFF}), 65504.0f);
  EXPECT_EQ(to_float(f16_t{0x0001}), std::ldexp(1.0f, -24));
  EXPECT_EQ(to_float(f16_t{0x83FF}), -1023.0f * std::ldexp(1.0f, -24));
  EXPECT_EQ(to_float(f16_t{0x7C00}), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(to_float(f16_t{0x7E00})));
  EXPECT_TRUE(std::signbit(to_float(f16_t{0x8000})));
}

TEST(NumericF16, RoundToNearestEven) {
  const float ulp1 = std::ldexp(1.0f, -10);
  EXPECT_EQ(f16(1.0f + ulp1 / 2), 0x3C00);        // tie -> even (down)
  EXPECT_EQ(f16(1.0f + 3 * ulp1 / 2), 0x3C02);    // tie -> even (up)
  EXPECT_EQ(f16(1.0f + ulp1 / 2 + ulp1 / 64), 0x3C01);
  // Subnormal ties at 2^-25: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2.
  const float sub = std::ldexp(1.0f, -25);
  EXPECT_EQ(f16(sub), 0x0000);
  EXPECT_EQ(f16(3 * sub), 0x0002);
  EXPECT_EQ(f16(5 * sub), 0x0002);
  EXPECT_EQ(f16(-3 * sub), 0x8002);
  // Largest subnormal + half an ulp ties to the smallest normal (1024 is even).
  EXPECT_EQ(f16(1023.5f * std::ldexp(1.0f, -24)), 0x0400);
  // Far below half the smallest subnormal: signed zero.
  EXPECT_EQ(f16(1e-10f), 0x0000);
  EXPECT_EQ(f16(-1e-10f), 0x8000);
}

TEST(NumericF16, OverflowInfNan) {
  EXPECT_EQ(f16(65519.0f), 0x7BFF);  // below the tie 65520
  EXPECT_EQ(f16(65520.0f), 0x7C00);  // tie between 65504 and "65536": even = inf
  EXPECT_EQ(f16(1e6f), 0x7C00);
  EXPECT_EQ(f16(-1e6f), 0xFC00);
  EXPECT_EQ(f16(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_TRUE(std::isnan(to_float(float_to_f16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(to_float(float_to_f16(from_bits(0x7F800001u)))));
}

// ---- fp8 e4m3 -----------------------------------------------------------------------------

TEST(NumericFp8, HandValues) {
  EXPECT_EQ(fp8(1.0f), 0x38);
  EXPECT_EQ(fp8(-1.0f), 0xB8);
  EXPECT_EQ(fp8(1.125f), 0x39);
  EXPECT_EQ(fp8(240.0f), 0x77);  // 1.875·2^7
  EXPECT_EQ(fp8(256.0f), 0x78);
  EXPECT_EQ(fp8(448.0f), 0x7E);  // 1.75·2^8, the largest finite
  EXPECT_EQ(fp8(0.015625f), 0x08);  // 2^-6, smallest normal
  EXPECT_EQ(fp8(std::ldexp(1.0f, -9)), 0x01);  // smallest subnormal
  EXPECT_EQ(fp8(0.0f), 0x00);
  EXPECT_EQ(fp8(-0.0f), 0x80);
  EXPECT_EQ(to_float(fp8e4m3_t{0x38}), 1.0f);
  EXPECT_EQ(to_float(fp8e4m3_t{0x7E}), 448.0f);
  EXPECT_EQ(to_float(fp8e4m3_t{0xFE}), -448.0f);
  EXPECT_EQ(to_float(fp8e4m3_t{0x08}), 0.015625f);
  EXPECT_EQ(to_float(fp8e4m3_t{0x07}), 7.0f * std::ldexp(1.0f, -9));
  EXPECT_EQ(to_float(fp8e4m3_t{0x01}), std::ldexp(1.0f, -9));
  EXPECT_EQ(to_float(fp8e4m3_t{0x78}), 256.0f);
  EXPECT_TRUE(std::isnan(to_float(fp8e4m3_t{0x7F})));
  EXPECT_TRUE(std::isnan(to_float(fp8e4m3_t{0xFF})));
  EXPECT_TRUE(std::signbit(to_float(fp8e4m3_t{0x80})));
}

TEST(NumericFp8, RoundToNearestEven) {
  EXPECT_EQ(fp8(1.0625f), 0x38);   // tie between 1 and 1.125 -> even (1)
  EXPECT_EQ(fp8(1.1875f), 0x3A);   // tie between 1.125 and 1.25 -> even (1.25)
  EXPECT_EQ(fp8(1.07f), 0x39);
  EXPECT_EQ(fp8(1.9375f), 0x40);   // tie between 1.875 and 2 -> carry into the exponent
  const float sub = std::ldexp(1.0f, -10);  // half the smallest subnormal
  EXPECT_EQ(fp8(sub), 0x00);
  EXPECT_EQ(fp8(3 * sub), 0x02);
  EXPECT_EQ(fp8(5 * sub), 0x02);
  EXPECT_EQ(fp8(15 * sub), 0x08);  // 7.5·2^-9 ties to 8·2^-9 = smallest normal
  EXPECT_EQ(fp8(-3 * sub), 0x82);
}

TEST(NumericFp8, SaturatesAndNan) {
  EXPECT_EQ(fp8(449.0f), 0x7E);
  EXPECT_EQ(fp8(464.0f), 0x7E);  // the tie with a nonexistent 480 still saturates
  EXPECT_EQ(fp8(1e6f), 0x7E);
  EXPECT_EQ(fp8(-1e6f), 0xFE);
  EXPECT_EQ(fp8(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(fp8(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(fp8(447.0f), 0x7E);
  EXPECT_EQ(fp8(431.0f), 0x7D);  // 416 < 431 < 432 (the tie): 416 = 0x7D
  EXPECT_TRUE(std::isnan(to_float(float_to_fp8e4m3(std::nanf("")))));
  EXPECT_EQ(fp8(std::nanf("")) & 0x7F, 0x7F);
}

// ---- exhaustive round trips and an independent rounding search --------------------------

TEST(NumericRoundTrip, EveryBf16Code) {
  for (std::uint32_t c = 0; c < 0x10000; ++c) {
    const float f = to_float(bf16_t{std::uint16_t(c)});
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(to_float(float_to_bf16(f))));
      continue;
    }
    ASSERT_EQ(bf16(f), c) << "bf16 code 0x" << std::hex << c;
  }
}

TEST(NumericRoundTrip, EveryF16Code) {
  for (std::uint32_t c = 0; c < 0x10000; ++c) {
    const float f = to_float(f16_t{std::uint16_t(c)});
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(to_float(float_to_f16(f))));
      continue;
    }
    ASSERT_EQ(f16(f), c) << "f16 code 0x" << std::hex << c;
  }
}

TEST(NumericRoundTrip, EveryFp8Code) {
  for (std::uint32_t c = 0; c < 0x100; ++c) {
    const float f = to_float(fp8e4m3_t{std::uint8_t(c)});
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(to_float(float_to_fp8e4m3(f))));
      continue;
    }
    ASSERT_EQ(fp8(f), c) << "fp8 code 0x" << std::hex << c;
  }
}

// A non-negative finite code and its value.
struct Candidate {
  double value;
  std::uint32_t code;
};

template <typename Decode>
std::vector<Candidate> positive_codes(std::uint32_t sign_bit, Decode decode) {
  std::vector<Candidate> v;
  for (std::uint32_t c = 0; c < sign_bit; ++c) {
    const float f = decode(c);
    if (std::isfinite(f)) v.push_back({double(f), c});
  }
  std::sort(v.begin(), v.end(), [](const Candidate& a, const Candidate& b) {
    return a.value < b.value;
  });
  return v;
}

// The code nearest to |x|, ties to the even code. `c` is sorted by value; its last entry is
// either the largest finite value (saturation) or a virtual overflow value with inf's code.
std::uint32_t nearest(const std::vector<Candidate>& c, double ax) {
  if (ax >= c.back().value) return c.back().code;
  const auto hi = std::upper_bound(c.begin(), c.end(), ax,
                                   [](double v, const Candidate& e) { return v < e.value; });
  const Candidate& up = *hi;
  const Candidate& lo = *(hi - 1);
  const double dl = ax - lo.value, du = up.value - ax;
  if (dl < du) return lo.code;
  if (du < dl) return up.code;
  return (lo.code & 1u) == 0 ? lo.code : up.code;
}

// Random floats across the dtype's whole range, biased to ties and near-ties.
std::vector<float> probe_values(double lo_exp, double hi_exp, int mantissa_bits, int count) {
  std::mt19937_64 rng(12345);
  std::uniform_real_distribution<double> e(lo_exp, hi_exp);
  std::uniform_int_distribution<int> kind(0, 3);
  std::vector<float> v;
  for (int i = 0; i < count; ++i) {
    float f = float(std::exp2(e(rng)));
    if (kind(rng) == 0) {  // snap to a tie: mantissa with exactly one bit below the kept ones
      std::uint32_t u;
      std::memcpy(&u, &f, 4);
      const int drop = 23 - mantissa_bits;
      u = (u & ~((1u << drop) - 1u)) | (1u << (drop - 1));
      std::memcpy(&f, &u, 4);
    }
    v.push_back(f);
    v.push_back(-f);
  }
  return v;
}

TEST(NumericRounding, Bf16MatchesNearestSearch) {
  auto codes = positive_codes(0x8000u, [](std::uint32_t c) {
    return to_float(bf16_t{std::uint16_t(c)});
  });
  codes.push_back({std::ldexp(1.0, 128), 0x7F80});  // inf, one ulp past the largest finite
  for (float f : probe_values(-134, 127.9, 7, 20000)) {
    const std::uint32_t want =
        nearest(codes, std::fabs(double(f))) | (std::signbit(f) ? 0x8000u : 0u);
    ASSERT_EQ(bf16(f), want) << "x = " << f;
  }
}

TEST(NumericRounding, F16MatchesNearestSearch) {
  auto codes = positive_codes(0x8000u, [](std::uint32_t c) {
    return to_float(f16_t{std::uint16_t(c)});
  });
  codes.push_back({65536.0, 0x7C00});  // inf, one ulp past 65504
  for (float f : probe_values(-27, 17, 10, 20000)) {
    const std::uint32_t want =
        nearest(codes, std::fabs(double(f))) | (std::signbit(f) ? 0x8000u : 0u);
    ASSERT_EQ(f16(f), want) << "x = " << f;
  }
}

TEST(NumericRounding, Fp8MatchesNearestSearch) {
  const auto codes = positive_codes(0x80u, [](std::uint32_t c) {
    return to_float(fp8e4m3_t{std::uint8_t(c)});
  });
  // No overflow entry: fp8 saturates at 448, the last finite code.
  for (float f : probe_values(-12, 10, 3, 20000)) {
    const std::uint32_t want =
        nearest(codes, std::fabs(double(f))) | (std::signbit(f) ? 0x80u : 0u);
    ASSERT_EQ(fp8(f), want) << "x = " << f;
  }
}

// ---- math helpers ---------------------------------------------------------------------------

// The CPU backend's vectorisable codecs (cpu_common.h) against numeric.h's, which the CUDA
// kernels use: they must agree bit for bit, or CPU and GPU checkpoints drift apart. Every 251st
// fp32 bit pattern (all signs, exponents, NaN/Inf included), plus every fp8 code for widen.
// (The whole 2^32 sweep, 10 s, agreed as well when narrow_fp8 was written.)
TEST(NumericFp8, CpuCodecsMatchTheSharedOnes) {
  for (std::uint64_t i = 0; i <= 0xffffffffull; i += 251) {
    const float f = bits_float(static_cast<std::uint32_t>(i));
    ASSERT_EQ(narrow_fp8(f).bits, float_to_fp8e4m3(f).bits) << std::hex << i;
  }
  std::vector<fp8e4m3_t> codes;
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;  // NaN codes: widen reads them as ±480 by design
    const fp8e4m3_t v{static_cast<std::uint8_t>(code)};
    ASSERT_EQ(float_bits(widen(v)), float_bits(to_float(v))) << code;
    codes.push_back(v);
  }
  // The row widener (vectorised where the CPU allows), over a length with a scalar tail.
  std::vector<float> row(codes.size());
  cpu::widen_fp8_row(codes.data(), static_cast<int>(codes.size()), row.data());
  for (std::size_t i = 0; i < codes.size(); ++i) {
    ASSERT_EQ(float_bits(row[i]), float_bits(to_float(codes[i]))) << int(codes[i].bits);
  }
}

// The CPU mat-vec's row dots (cpu_common.h RowDots: partial sums per row, then the 16-row
// transpose-and-add tree or the row-by-row tail) against plain float64 sums, for fp32 and bf16
// rows, at row counts below, at and past 16 and lengths with and without a vector tail. Each
// row's values differ, so a row summed into the wrong output fails.
TEST(NumericRowDots, MatchFloat64Sums) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int rows : {1, 5, 16, 17, 40, 128}) {
    for (int n : {7, 16, 33, 128}) {
      std::vector<float> a(std::size_t(rows) * n), b(n), partials(16 * std::size_t(rows));
      std::vector<bf16_t> a_bf16(a.size());
      for (float& x : a) x = u(rng);
      for (float& x : b) x = u(rng);
      for (std::size_t i = 0; i < a.size(); ++i) a_bf16[i] = float_to_bf16(a[i]);
      for (bool low : {false, true}) {
        cpu::RowDots dots(rows, partials.data());
        for (int r = 0; r < rows; ++r) {
          if (low) {
            dots.set(r, a_bf16.data() + std::size_t(r) * n, b.data(), n, 0.5f);
          } else {
            dots.set(r, a.data() + std::size_t(r) * n, b.data(), n, 0.5f);
          }
        }
        std::vector<float> out(rows);
        dots.reduce(out.data());
        for (int r = 0; r < rows; ++r) {
          double want = 0.0;
          for (int i = 0; i < n; ++i) {
            const std::size_t e = std::size_t(r) * n + i;
            want += double(low ? to_float(a_bf16[e]) : a[e]) * b[i];
          }
          EXPECT_NEAR(out[r], 0.5 * want, 1e-5) << "rows " << rows << " n " << n << " row " << r
                                                << (low ? " bf16" : " fp32");
        }
      }
    }
  }
}

TEST(NumericMath, SoftplusAndSilu) {
  EXPECT_FLOAT_EQ(softplus(0.0f), std::log(2.0f));
  EXPECT_FLOAT_EQ(softplus(-4.0f), std::log1p(std::exp(-4.0f)));
  EXPECT_EQ(softplus(21.0f), 21.0f);  // the threshold: identity past 20
  EXPECT_NEAR(softplus(19.0f), 19.0f + std::exp(-19.0f), 1e-5f);
  EXPECT_GT(softplus(-30.0f), 0.0f);
  EXPECT_NEAR(softplus(-30.0f), std::exp(-30.0f), 1e-18f);
  EXPECT_EQ(silu(0.0f), 0.0f);
  EXPECT_FLOAT_EQ(silu(1.0f), 1.0f / (1.0f + std::exp(-1.0f)));
  EXPECT_FLOAT_EQ(silu(-2.0f), -2.0f / (1.0f + std::exp(2.0f)));
  EXPECT_NEAR(silu(30.0f), 30.0f, 1e-5f);
}

}  // namespace
}  // namespace replayssm
