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
#include <string>
#include <vector>

#include "testing/test_util.h"

namespace replayssm {
namespace {

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
    [](const ::testing::TestParamInfo<EagerCase>& i) {
      return "State" + testing::dtype_tag(i.param.state) + "_Input" +
             testing::dtype_tag(i.param.input) + (i.param.gate ? "_Gate" : "_NoGate");
    });

// ---- replay, plain decoding ---------------------------------------------------------------

struct ReplayCase {
  int L;
  DType input;
  bool gate;
};

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
    [](const ::testing::TestParamInfo<ReplayCase>& i) {
      return testing::int_tag("L", i.param.L) + "_Input" + testing::dtype_tag(i.param.input) +
             (i.param.gate ? "_Gate" : "_NoGate");
    });

// Arange-like inputs at a shape with no power of two: a swapped axis or a wrong stride moves a
// value to where a different one is expected, which random data can average away.
struct StructuredCase {
  DecodeMode mode;
  int L;
};
class Mamba2Structured : public ::testing::TestWithParam<StructuredCase> {};

TEST_P(Mamba2Structured, OddShapeMatchesOracle) {
  const StructuredCase c = GetParam();
  RunSpec spec = mamba2_spec(kOdd, c.mode, DType::kF32);
  spec.cache.buffer_len = c.L;
  spec.recipe.structured = true;
  spec.batch = 3;
  spec.steps = std::max(4 * c.L, 24) + 1;
  spec.gate = true;
  spec.seed = 7;
  const RunResult r = testing::run_mamba2(spec);
  ASSERT_EQ(r.failure, "");
  EXPECT_LE(r.max_error, kFp32Tol);
  EXPECT_LE(r.export_error, kFp32Tol);
}

INSTANTIATE_TEST_SUITE_P(ModeL, Mamba2Structured,
                         ::testing::Values(StructuredCase{DecodeMode::kEager, 1},
                                           StructuredCase{DecodeMode::kReplay, 1},
                                           StructuredCase{DecodeMode::kReplay, 3}),
                         [](const ::testing::TestParamInfo<StructuredCase>& i) {
                           return std::string(i.param.mode == DecodeMode::kEager ? "Eager"
                                                                                 : "Replay") +
                                  testing::int_tag("_L", i.param.L);
                         });

// ---- replay, speculative windows with random acceptance -----------------------------------

struct SpecCase {
  int T;
  int L;
  int layers;
  DType input;
};

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
    [](const ::testing::TestParamInfo<SpecCase>& i) {
      return testing::int_tag("T", i.param.T) + testing::int_tag("_L", i.param.L) + testing::int_tag("_Layers", i.param.layers) + "_Input" + testing::dtype_tag(i.param.input);
    });

// k single-token decodes (commit 1 each) and one k-token window (commit k) on the same tokens
// give the same outputs, round after round across folds.
struct WindowCase {
  int T;
  int L;
};
class Mamba2Window : public ::testing::TestWithParam<WindowCase> {};

TEST_P(Mamba2Window, KSingleStepsEqualOneKTokenWindow) {
  const WindowCase c = GetParam();
  StateCacheConfig cfg;
  cfg.kind = LayerKind::kMamba2;
  cfg.mamba2 = kSmall;
  cfg.capacity = 2;
  cfg.buffer_len = c.L;
  cfg.max_spec_tokens = c.T;
  testing::WindowPair p = testing::make_window_pair(cfg, 2);
  double worst = 0.0;
  ASSERT_NO_FATAL_FAILURE(testing::run_window_vs_single(p, 400 + c.T, 4 * c.L + 6, &worst));
  EXPECT_LE(worst, kFp32Tol);
  EXPECT_EQ(testing::cursor_committed(*p.window, p.ws[0]),
            testing::cursor_committed(*p.single, p.ss[0]));
  testing::expect_window_states_match(p, kFp32Tol);
}

INSTANTIATE_TEST_SUITE_P(TL, Mamba2Window,
                         ::testing::Values(WindowCase{2, 1}, WindowCase{2, 3}, WindowCase{4, 2},
                                           WindowCase{4, 16}),
                         [](const ::testing::TestParamInfo<WindowCase>& i) {
                           return testing::int_tag("T", i.param.T) + testing::int_tag("_L", i.param.L);
                         });

// ---- checkpoint precisions (short runs; the long-memory study is test_dual_precision) ------

struct PrecisionCase {
  CheckpointPrecision precision;
  int L;
};
class Mamba2Precision : public ::testing::TestWithParam<PrecisionCase> {};

TEST_P(Mamba2Precision, BoundedByTheReadCopy) {
  const PrecisionCase c = GetParam();
  RunSpec spec = mamba2_spec(kSmall, DecodeMode::kReplay, DType::kF32);
  spec.cache.buffer_len = c.L;
  spec.cache.checkpoint = c.precision;
  spec.batch = 3;
  spec.steps = 4 * c.L + 3;
  spec.seed = 500 + c.L;
  const RunResult r = testing::run_mamba2(spec);
  ASSERT_EQ(r.failure, "");
  // Output error: the read copy's rounding of S_c·C. Each element is within u of itself (bf16)
  // or of its row's max (fp8 e4m3 with a per-row scale max|row|/448); y sums N = 16 such terms
  // with random signs, so a couple of u of max|y| bound it (measured: bf16 <= 0.8u, fp8 <= u).
  testing::expect_checkpoint_bounds(r, c.precision, kFp32Tol);
}

INSTANTIATE_TEST_SUITE_P(
    PrecisionL, Mamba2Precision,
    ::testing::Values(PrecisionCase{CheckpointPrecision::kFp32Bf16, 2},
                      PrecisionCase{CheckpointPrecision::kFp32Bf16, 16},
                      PrecisionCase{CheckpointPrecision::kFp32Fp8, 2},
                      PrecisionCase{CheckpointPrecision::kFp32Fp8, 16},
                      PrecisionCase{CheckpointPrecision::kBf16, 4}),
    [](const ::testing::TestParamInfo<PrecisionCase>& i) {
      return testing::precision_tag(i.param.precision) + testing::int_tag("_L", i.param.L);
    });

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
