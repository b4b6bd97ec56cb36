// Mamba-2 decode on the CPU against the float64 oracle: eager, replay over many fold cycles,
// speculative windows with random acceptance, multi-layer caches, real shapes.
//
// Tolerances. fp32 inputs with an fp32 state/checkpoint: 1e-5 relative to max|y| (ALGORITHM.md
// §10). bf16 inputs: the oracle is fed the same bf16-rounded inputs, so what remains is fp32
// arithmetic and the rounding of y to bf16 (up to u = 2^-8 of max|y|), plus, for a bf16/f16 eager
// state, that state's rounding; the long-run rule bounds the error by twice that of a naive loop
// at the same precision (testing::naive_mamba2_step), which the driver runs alongside.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <ostream>
#include <vector>

#include "testing/family_cases.h"
#include "testing/names.h"
#include "testing/oracle_run.h"
#include "testing/tolerances.h"
#include "testing/window_pair.h"

namespace replayssm {
namespace {

using testing::dtype_tag;
using testing::int_tag;
using testing::RunResult;
using testing::RunSpec;

constexpr double kFp32Tol = 1e-5;
// Slack over twice the naive loop's error, for errors that are exactly zero in both.
constexpr double kFloor = 1e-6;
// Unit roundoff: bf16 keeps 8 significant bits (fp8 e4m3 4: testing::expect_checkpoint_bounds).
const double kBf16U = std::ldexp(1.0, -8);

RunSpec mamba2_spec(Mamba2Shape shape, DecodeMode mode, DType input) {
  RunSpec spec;
  spec.cache.kind = LayerKind::kMamba2;
  spec.cache.mamba2 = shape;
  spec.cache.mode = mode;
  spec.cache.input_dtype = input;
  return spec;
}

const Mamba2Shape kSmall{4, 8, 16, 2};    // grouped: 2 heads per group
const Mamba2Shape kOdd{6, 5, 7, 3};       // no power of two anywhere: stride bugs show
const Mamba2Shape kReal{128, 64, 128, 8};  // Nemotron-3-Super-120B

// ---- eager --------------------------------------------------------------------------------

struct EagerCase {
  DType state;
  DType input;
  bool gate;
};
void PrintTo(const EagerCase& c, std::ostream* os) {
  *os << "State" << dtype_tag(c.state) << "_Input" << dtype_tag(c.input)
      << (c.gate ? "_Gate" : "_NoGate");
}

class Mamba2Eager : public ::testing::TestWithParam<EagerCase> {};

TEST_P(Mamba2Eager, MatchesOracle) {
  const EagerCase c = GetParam();
  RunSpec spec = mamba2_spec(kSmall, DecodeMode::kEager, c.input);
  spec.cache.state_dtype = c.state;
  spec.batch = 3;
  spec.steps = 64;
  spec.stagger = 5;
  spec.gate = c.gate;
  spec.seed = 101;
  spec.naive = true;
  spec.naive_state_dtype = c.state;
  const RunResult r = testing::run_mamba2(spec);
  ASSERT_EQ(r.failure, "");
  ASSERT_EQ(r.step_error.size(), 64u);
  if (c.state == DType::kF32 && c.input == DType::kF32) {
    EXPECT_LE(r.max_error, kFp32Tol);
    EXPECT_LE(r.export_error, kFp32Tol);
  } else {
    testing::expect_within_naive(r, kFloor);
  }
}

INSTANTIATE_TEST_SUITE_P(
    StateInputGate, Mamba2Eager,
    ::testing::Values(EagerCase{DType::kF32, DType::kF32, false},
                      EagerCase{DType::kF32, DType::kF32, true},
                      EagerCase{DType::kF32, DType::kBF16, true},
                      EagerCase{DType::kBF16, DType::kF32, false},
                      EagerCase{DType::kBF16, DType::kBF16, true},
                      EagerCase{DType::kF16, DType::kF32, false},
                      EagerCase{DType::kF16, DType::kF16, true}),
    ::testing::PrintToStringParamName());

// ---- replay, plain decoding ---------------------------------------------------------------

struct ReplayCase {
  int L;
  DType input;
  bool gate;
};
void PrintTo(const ReplayCase& c, std::ostream* os) {
  *os << int_tag("L", c.L) << "_Input" << dtype_tag(c.input) << (c.gate ? "_Gate" : "_NoGate");
}

class Mamba2Replay : public ::testing::TestWithParam<ReplayCase> {};

TEST_P(Mamba2Replay, MatchesOracleOverManyCycles) {
  const ReplayCase c = GetParam();
  RunSpec spec = mamba2_spec(kSmall, DecodeMode::kReplay, c.input);
  spec.cache.buffer_len = c.L;
  spec.batch = 3;
  spec.steps = std::max(4 * c.L, 40) + 3;  // >= 4 cycles, ending mid-cycle
  spec.stagger = 3;
  spec.gate = c.gate;
  spec.seed = 200 + c.L;
  spec.naive = c.input != DType::kF32;
  const RunResult r = testing::run_mamba2(spec);
  ASSERT_EQ(r.failure, "");
  if (c.input == DType::kF32) {
    EXPECT_LE(r.max_error, kFp32Tol);
  } else {
    testing::expect_within_naive(r, kFloor);
  }
  // Folds run in fp32 on the inputs as stored: the state itself is fp32-accurate either way.
  EXPECT_LE(r.export_error, kFp32Tol);
  EXPECT_GE(r.max_distinct_fill_levels, c.L > 1 ? 2 : 1);
}

INSTANTIATE_TEST_SUITE_P(
    LInputGate, Mamba2Replay,
    ::testing::Values(ReplayCase{1, DType::kF32, false}, ReplayCase{1, DType::kF32, true},
                      ReplayCase{1, DType::kBF16, true}, ReplayCase{2, DType::kF32, false},
                      ReplayCase{2, DType::kF32, true}, ReplayCase{2, DType::kBF16, false},
                      ReplayCase{16, DType::kF32, false}, ReplayCase{16, DType::kF32, true},
                      ReplayCase{16, DType::kBF16, true}, ReplayCase{16, DType::kF16, false}),
    ::testing::PrintToStringParamName());

// Arange-like inputs at a shape with no power of two (testing::StructuredCase).
class Mamba2Structured : public ::testing::TestWithParam<testing::StructuredCase> {};

TEST_P(Mamba2Structured, OddShapeMatchesOracle) {
  RunSpec spec = mamba2_spec(kOdd, GetParam().mode, DType::kF32);
  spec.gate = true;
  testing::expect_structured_matches_oracle(spec, GetParam(), 7, kFp32Tol);
}

INSTANTIATE_TEST_SUITE_P(ModeL, Mamba2Structured, ::testing::ValuesIn(testing::kStructuredCases),
                         ::testing::PrintToStringParamName());

// ---- replay, speculative windows with random acceptance -----------------------------------

struct SpecCase {
  int T;
  int L;
  int layers;
  DType input;
};
void PrintTo(const SpecCase& c, std::ostream* os) {
  *os << int_tag("T", c.T) << int_tag("_L", c.L) << int_tag("_Layers", c.layers) << "_Input"
      << dtype_tag(c.input);
}

class Mamba2Spec : public ::testing::TestWithParam<SpecCase> {};

// Every window position vs the oracle (chained through the window), the accepted positions vs
// a plain T = 1 cache fed the accepted stream, rows joining at different steps and accepting
// different counts (so one batch mixes ring fill levels), layers folding on shared cursors.
TEST_P(Mamba2Spec, RandomAcceptanceMatchesPlainDecoding) {
  const SpecCase c = GetParam();
  RunSpec spec = mamba2_spec(kSmall, DecodeMode::kReplay, c.input);
  spec.cache.buffer_len = c.L;
  spec.cache.max_spec_tokens = c.T;
  spec.cache.num_layers = c.layers;
  spec.window = c.T;
  spec.batch = 4;
  spec.steps = 110;
  spec.stagger = 7;
  spec.gate = c.layers > 1;
  spec.seed = 300 + 10 * c.T + c.L;
  spec.compare_plain = true;
  spec.naive = c.input != DType::kF32;
  const RunResult r = testing::run_mamba2(spec);
  ASSERT_EQ(r.failure, "");
  if (c.input == DType::kF32) {
    EXPECT_LE(r.max_error, kFp32Tol);
    EXPECT_LE(r.plain_max_error, kFp32Tol);
  } else {
    testing::expect_within_naive(r, kFloor);
    // Both outputs are within u (plus fp32 noise) of the same value.
    EXPECT_LE(r.plain_max_error, 2 * kBf16U);
  }
  EXPECT_LE(r.export_error, kFp32Tol);
  EXPECT_GE(r.max_distinct_fill_levels, 3);
  // k ~ U{0..T} per row and step: about T/2 accepted on average.
  EXPECT_GT(r.tokens_committed, 4 * 60 * c.T / 4);
}

INSTANTIATE_TEST_SUITE_P(
    TLLayersInput, Mamba2Spec,
    ::testing::Values(SpecCase{2, 1, 1, DType::kF32}, SpecCase{2, 2, 1, DType::kF32},
                      SpecCase{2, 16, 3, DType::kF32}, SpecCase{4, 1, 3, DType::kF32},
                      SpecCase{4, 2, 1, DType::kF32}, SpecCase{4, 16, 1, DType::kF32},
                      SpecCase{4, 16, 3, DType::kF32}, SpecCase{4, 5, 3, DType::kBF16}),
    ::testing::PrintToStringParamName());

// k single-token decodes (commit 1 each) and one k-token window (commit k) on the same tokens
// give the same outputs, round after round across folds.
class Mamba2Window : public ::testing::TestWithParam<testing::WindowCase> {};

TEST_P(Mamba2Window, KSingleStepsEqualOneKTokenWindow) {
  StateCacheConfig cfg;
  cfg.kind = LayerKind::kMamba2;
  cfg.mamba2 = kSmall;
  testing::expect_window_equals_single_steps(cfg, GetParam(), 400 + GetParam().T, kFp32Tol);
}

INSTANTIATE_TEST_SUITE_P(TL, Mamba2Window, ::testing::ValuesIn(testing::kWindowCases),
                         ::testing::PrintToStringParamName());

// ---- checkpoint precisions (short runs; the long-memory study is test_dual_precision) ------

class Mamba2Precision : public ::testing::TestWithParam<testing::PrecisionCase> {};

// Output error: the read copy's rounding of S_c·C. Each element is within u of itself (bf16)
// or of its row's max (fp8 e4m3 with a per-row scale max|row|/448); y sums N = 16 such terms
// with random signs, so a couple of u of max|y| bound it (measured: bf16 <= 0.8u, fp8 <= u).
TEST_P(Mamba2Precision, BoundedByTheReadCopy) {
  const RunSpec spec = mamba2_spec(kSmall, DecodeMode::kReplay, DType::kF32);
  testing::expect_checkpoint_precision_bounds(spec, GetParam(), 500 + GetParam().L, kFp32Tol);
}

INSTANTIATE_TEST_SUITE_P(PrecisionL, Mamba2Precision, ::testing::ValuesIn(testing::kPrecisionCases),
                         ::testing::PrintToStringParamName());

// ---- a real shape: Nemotron-3-Super-120B's H=128, P=64, N=128, G=8 -------------------------

TEST(Mamba2RealShape, EagerF32) {
  RunSpec spec = mamba2_spec(kReal, DecodeMode::kEager, DType::kF32);
  spec.batch = 2;
  spec.steps = 12;
  spec.seed = 600;
  const RunResult r = testing::run_mamba2(spec);
  ASSERT_EQ(r.failure, "");
  EXPECT_LE(r.max_error, kFp32Tol);
  EXPECT_LE(r.export_error, kFp32Tol);
}

TEST(Mamba2RealShape, ReplayL16F32) {
  RunSpec spec = mamba2_spec(kReal, DecodeMode::kReplay, DType::kF32);
  spec.cache.buffer_len = 16;
  spec.batch = 2;
  spec.steps = 64;
  spec.gate = true;
  spec.seed = 601;
  const RunResult r = testing::run_mamba2(spec);
  ASSERT_EQ(r.failure, "");
  EXPECT_LE(r.max_error, kFp32Tol);
  EXPECT_LE(r.export_error, kFp32Tol);
}

TEST(Mamba2RealShape, ReplayL16Bf16Inputs) {
  RunSpec spec = mamba2_spec(kReal, DecodeMode::kReplay, DType::kBF16);
  spec.cache.buffer_len = 16;
  spec.batch = 2;
  spec.steps = 40;
  spec.seed = 602;
  spec.naive = true;
  const RunResult r = testing::run_mamba2(spec);
  ASSERT_EQ(r.failure, "");
  testing::expect_within_naive(r, kFloor);
  EXPECT_LE(r.export_error, kFp32Tol);
}

TEST(Mamba2RealShape, SpecT4L16F32) {
  RunSpec spec = mamba2_spec(kReal, DecodeMode::kReplay, DType::kF32);
  spec.cache.buffer_len = 16;
  spec.cache.max_spec_tokens = 4;
  spec.window = 4;
  spec.batch = 2;
  spec.steps = 24;
  spec.stagger = 3;
  spec.seed = 603;
  spec.compare_plain = true;
  const RunResult r = testing::run_mamba2(spec);
  ASSERT_EQ(r.failure, "");
  EXPECT_LE(r.max_error, kFp32Tol);
  EXPECT_LE(r.plain_max_error, kFp32Tol);
  EXPECT_LE(r.export_error, kFp32Tol);
}

}  // namespace
}  // namespace replayssm
