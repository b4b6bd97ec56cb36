// Gated DeltaNet decode on the CPU against the float64 oracle: eager, replay over many fold
// cycles (qk_l2norm on/off, explicit scale, grouped value heads), speculative windows with
// random acceptance, multi-layer caches, real shapes.
//
// Tolerances. fp32 inputs with an fp32 state/checkpoint: 1e-5 relative to max|o| (ALGORITHM.md
// §10). bf16 inputs: the oracle is fed the same bf16-rounded inputs; what remains is fp32
// arithmetic and the rounding of o to bf16 (up to u = 2^-8 of max|o|); the ring keeps raw k
// with an fp32 normalisation factor, so replay adds no rounding of k̂. The long-run rule bounds
// the error by twice that of a naive loop at the same precision (testing::naive_gdn_step).

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
constexpr double kFloor = 1e-6;
// Unit roundoff: bf16 keeps 8 significant bits (fp8 e4m3 4: testing::expect_checkpoint_bounds).
const double kBf16U = std::ldexp(1.0, -8);
// Replay with bf16 inputs keeps k̂ in bf16 (relative rounding u per element), so the folded
// state carries a few of those roundings: bound the exported state by 4u.
const double kBf16StateTol = 4 * kBf16U;

RunSpec gdn_spec(GdnShape shape, DecodeMode mode, DType input) {
  RunSpec spec;
  spec.cache.kind = LayerKind::kGdn;
  spec.cache.gdn = shape;
  spec.cache.mode = mode;
  spec.cache.input_dtype = input;
  return spec;
}

const GdnShape kSmall{2, 4, 16, 8};     // Hk, Hv, K, V: two value heads per key head, K != V
const GdnShape kOdd{3, 6, 7, 5};        // no power of two anywhere
const GdnShape kReal{16, 32, 128, 128};  // Qwen3.5-4B

void set_keys(RunSpec* spec, bool l2norm, float scale) {
  spec->qk_l2norm = l2norm;
  spec->scale = scale;
  spec->recipe.unit_keys = !l2norm;  // raw keys must keep β|k|² < 2
}

std::string keys_tag(bool l2norm, float scale) {
  return std::string(l2norm ? "L2Norm" : "RawKeys") +
         (scale == 0.0f ? "_DefaultScale" : testing::int_tag("_Scale", int(scale * 100)));
}

// ---- eager --------------------------------------------------------------------------------

struct EagerCase {
  DType state;
  DType input;
  bool l2norm;
};

class GdnEager : public ::testing::TestWithParam<EagerCase> {};

TEST_P(GdnEager, MatchesOracle) {
  const EagerCase c = GetParam();
  RunSpec spec = gdn_spec(kSmall, DecodeMode::kEager, c.input);
  spec.cache.state_dtype = c.state;
  set_keys(&spec, c.l2norm, 0.0f);
  spec.batch = 3;
  spec.steps = 64;
  spec.stagger = 5;
  spec.seed = 111;
  spec.naive = true;
  spec.naive_state_dtype = c.state;
  const RunResult r = testing::run_gdn(spec);
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
    StateInputKeys, GdnEager,
    ::testing::Values(EagerCase{DType::kF32, DType::kF32, true},
                      EagerCase{DType::kF32, DType::kF32, false},
                      EagerCase{DType::kF32, DType::kBF16, true},
                      EagerCase{DType::kBF16, DType::kF32, true},
                      EagerCase{DType::kBF16, DType::kBF16, true},
                      EagerCase{DType::kF16, DType::kF32, true},
                      EagerCase{DType::kF16, DType::kF16, false}),
    [](const ::testing::TestParamInfo<EagerCase>& i) {
      return "State" + testing::dtype_tag(i.param.state) + "_Input" +
             testing::dtype_tag(i.param.input) + (i.param.l2norm ? "_L2Norm" : "_RawKeys");
    });

// ---- replay, plain decoding ---------------------------------------------------------------

struct ReplayCase {
  int L;
  DType input;
  bool l2norm;
  float scale;
};

class GdnReplay : public ::testing::TestWithParam<ReplayCase> {};

TEST_P(GdnReplay, MatchesOracleOverManyCycles) {
  const ReplayCase c = GetParam();
  RunSpec spec = gdn_spec(kSmall, DecodeMode::kReplay, c.input);
  spec.cache.buffer_len = c.L;
  set_keys(&spec, c.l2norm, c.scale);
  spec.batch = 3;
  spec.steps = std::max(4 * c.L, 40) + 3;
  spec.stagger = 3;
  spec.seed = 210 + c.L;
  spec.naive = c.input != DType::kF32;
  const RunResult r = testing::run_gdn(spec);
  ASSERT_EQ(r.failure, "");
  if (c.input == DType::kF32) {
    EXPECT_LE(r.max_error, kFp32Tol);
    EXPECT_LE(r.export_error, kFp32Tol);
  } else {
    testing::expect_within_naive(r, kFloor);
    EXPECT_LE(r.export_error, kBf16StateTol);
  }
  EXPECT_GE(r.max_distinct_fill_levels, c.L > 1 ? 2 : 1);
}

INSTANTIATE_TEST_SUITE_P(
    LInputKeys, GdnReplay,
    ::testing::Values(ReplayCase{1, DType::kF32, true, 0.0f},
                      ReplayCase{1, DType::kF32, false, 0.5f},
                      ReplayCase{1, DType::kBF16, true, 0.0f},
                      ReplayCase{2, DType::kF32, true, 0.0f},
                      ReplayCase{2, DType::kF32, false, 0.0f},
                      ReplayCase{2, DType::kBF16, false, 0.5f},
                      ReplayCase{16, DType::kF32, true, 0.0f},
                      ReplayCase{16, DType::kF32, true, 0.5f},
                      ReplayCase{16, DType::kF32, false, 0.0f},
                      ReplayCase{16, DType::kBF16, true, 0.0f},
                      ReplayCase{16, DType::kF16, true, 0.0f}),
    [](const ::testing::TestParamInfo<ReplayCase>& i) {
      return testing::int_tag("L", i.param.L) + "_Input" + testing::dtype_tag(i.param.input) +
             "_" + keys_tag(i.param.l2norm, i.param.scale);
    });

// Strong decays (α = e^-8 per token): a fold's decay product underflows within one cycle of
// L = 16, which the fold must absorb: no 1/Γ may turn into inf (the CPU fold's chunk form
// uses only decays e^{λ_j−λ_i} ≤ 1; an earlier form carried rows as Γ·ŝ and had to rescale).
TEST(GdnReplayStrongDecay, MatchesOracle) {
  RunSpec spec = gdn_spec(kSmall, DecodeMode::kReplay, DType::kF32);
  spec.cache.buffer_len = 16;
  set_keys(&spec, true, 0.0f);
  spec.recipe.g_fixed = -8.0;
  spec.batch = 2;
  spec.steps = 4 * 16 + 3;
  spec.stagger = 3;
  spec.seed = 451;
  const RunResult r = testing::run_gdn(spec);
  ASSERT_EQ(r.failure, "");
  EXPECT_LE(r.max_error, kFp32Tol);
  EXPECT_LE(r.export_error, kFp32Tol);
}

// Nearly parallel keys, β near 1 and almost no decay, over folds of 1 to 4 chunks of 16
// tokens: the case where the chunk-form fold's triangular solve is least well conditioned
// (its entries alternate in sign and grow), against the float64 oracle at the fp32 tolerance.
class GdnReplayParallelKeys : public ::testing::TestWithParam<int> {};

TEST_P(GdnReplayParallelKeys, MatchesOracle) {
  const int L = GetParam();
  RunSpec spec = gdn_spec(kSmall, DecodeMode::kReplay, DType::kF32);
  spec.cache.buffer_len = L;
  set_keys(&spec, true, 0.0f);
  spec.recipe.key_spread = 0.005;
  spec.recipe.g_fixed = -1e-3;
  spec.recipe.beta_lo = 0.99;
  spec.recipe.beta_hi = 1.0;
  spec.batch = 2;
  spec.steps = 4 * L + 3;
  spec.stagger = 5;
  spec.seed = 97 + L;
  const RunResult r = testing::run_gdn(spec);
  ASSERT_EQ(r.failure, "");
  EXPECT_LE(r.max_error, kFp32Tol);
  EXPECT_LE(r.export_error, kFp32Tol);
}

INSTANTIATE_TEST_SUITE_P(L, GdnReplayParallelKeys, ::testing::Values(16, 40, 64),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return testing::int_tag("L", i.param);
                         });

struct StructuredCase {
  DecodeMode mode;
  int L;
};
class GdnStructured : public ::testing::TestWithParam<StructuredCase> {};

TEST_P(GdnStructured, OddShapeMatchesOracle) {
  const StructuredCase c = GetParam();
  RunSpec spec = gdn_spec(kOdd, c.mode, DType::kF32);
  spec.cache.buffer_len = c.L;
  spec.recipe.structured = true;
  spec.batch = 3;
  spec.steps = std::max(4 * c.L, 24) + 1;
  spec.seed = 8;
  const RunResult r = testing::run_gdn(spec);
  ASSERT_EQ(r.failure, "");
  EXPECT_LE(r.max_error, kFp32Tol);
  EXPECT_LE(r.export_error, kFp32Tol);
}

INSTANTIATE_TEST_SUITE_P(ModeL, GdnStructured,
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
  bool l2norm;
};

class GdnSpec : public ::testing::TestWithParam<SpecCase> {};

TEST_P(GdnSpec, RandomAcceptanceMatchesPlainDecoding) {
  const SpecCase c = GetParam();
  RunSpec spec = gdn_spec(kSmall, DecodeMode::kReplay, c.input);
  spec.cache.buffer_len = c.L;
  spec.cache.max_spec_tokens = c.T;
  spec.cache.num_layers = c.layers;
  set_keys(&spec, c.l2norm, 0.0f);
  spec.window = c.T;
  spec.batch = 4;
  spec.steps = 110;
  spec.stagger = 7;
  spec.seed = 310 + 10 * c.T + c.L;
  spec.compare_plain = true;
  spec.naive = c.input != DType::kF32;
  const RunResult r = testing::run_gdn(spec);
  ASSERT_EQ(r.failure, "");
  if (c.input == DType::kF32) {
    EXPECT_LE(r.max_error, kFp32Tol);
    EXPECT_LE(r.plain_max_error, kFp32Tol);
    EXPECT_LE(r.export_error, kFp32Tol);
  } else {
    testing::expect_within_naive(r, kFloor);
    EXPECT_LE(r.plain_max_error, 2 * kBf16U);
    EXPECT_LE(r.export_error, kBf16StateTol);
  }
  EXPECT_GE(r.max_distinct_fill_levels, 3);
  EXPECT_GT(r.tokens_committed, 4 * 60 * c.T / 4);
}

INSTANTIATE_TEST_SUITE_P(
    TLLayersInputKeys, GdnSpec,
    ::testing::Values(SpecCase{2, 1, 1, DType::kF32, true}, SpecCase{2, 2, 1, DType::kF32, false},
                      SpecCase{2, 16, 3, DType::kF32, true}, SpecCase{4, 1, 3, DType::kF32, true},
                      SpecCase{4, 2, 1, DType::kF32, true}, SpecCase{4, 16, 1, DType::kF32, false},
                      SpecCase{4, 16, 3, DType::kF32, true}, SpecCase{4, 5, 3, DType::kBF16, true}),
    [](const ::testing::TestParamInfo<SpecCase>& i) {
      return testing::int_tag("T", i.param.T) + testing::int_tag("_L", i.param.L) + testing::int_tag("_Layers", i.param.layers) + "_Input" + testing::dtype_tag(i.param.input) +
             (i.param.l2norm ? "_L2Norm" : "_RawKeys");
    });

struct WindowCase {
  int T;
  int L;
};
class GdnWindow : public ::testing::TestWithParam<WindowCase> {};

TEST_P(GdnWindow, KSingleStepsEqualOneKTokenWindow) {
  const WindowCase c = GetParam();
  StateCacheConfig cfg;
  cfg.kind = LayerKind::kGdn;
  cfg.gdn = kSmall;
  cfg.capacity = 2;
  cfg.buffer_len = c.L;
  cfg.max_spec_tokens = c.T;
  testing::WindowPair p = testing::make_window_pair(cfg, 2);
  double worst = 0.0;
  ASSERT_NO_FATAL_FAILURE(testing::run_window_vs_single(p, 410 + c.T, 4 * c.L + 6, &worst));
  EXPECT_LE(worst, kFp32Tol);
  testing::expect_window_states_match(p, kFp32Tol);
}

INSTANTIATE_TEST_SUITE_P(TL, GdnWindow,
                         ::testing::Values(WindowCase{2, 1}, WindowCase{2, 3}, WindowCase{4, 2},
                                           WindowCase{4, 16}),
                         [](const ::testing::TestParamInfo<WindowCase>& i) {
                           return testing::int_tag("T", i.param.T) + testing::int_tag("_L", i.param.L);
                         });

// ---- checkpoint precisions ------------------------------------------------------------------

struct PrecisionCase {
  CheckpointPrecision precision;
  int L;
};
class GdnPrecision : public ::testing::TestWithParam<PrecisionCase> {};

TEST_P(GdnPrecision, BoundedByTheReadCopy) {
  const PrecisionCase c = GetParam();
  RunSpec spec = gdn_spec(kSmall, DecodeMode::kReplay, DType::kF32);
  spec.cache.buffer_len = c.L;
  spec.cache.checkpoint = c.precision;
  spec.batch = 3;
  spec.steps = 4 * c.L + 3;
  spec.seed = 510 + c.L;
  const RunResult r = testing::run_gdn(spec);
  ASSERT_EQ(r.failure, "");
  // o = S_c·t + ring terms: the read copy's per-element rounding (u for bf16; u of the row's
  // max for fp8 with a per-row scale) over K = 16 terms with random signs: a couple of u of
  // max|o| (measured: bf16 <= 0.7u, fp8 <= 0.75u).
  testing::expect_checkpoint_bounds(r, c.precision, kFp32Tol);
}

INSTANTIATE_TEST_SUITE_P(
    PrecisionL, GdnPrecision,
    ::testing::Values(PrecisionCase{CheckpointPrecision::kFp32Bf16, 2},
                      PrecisionCase{CheckpointPrecision::kFp32Bf16, 16},
                      PrecisionCase{CheckpointPrecision::kFp32Fp8, 2},
                      PrecisionCase{CheckpointPrecision::kFp32Fp8, 16},
                      PrecisionCase{CheckpointPrecision::kBf16, 4}),
    [](const ::testing::TestParamInfo<PrecisionCase>& i) {
      return testing::precision_tag(i.param.precision) + testing::int_tag("_L", i.param.L);
    });

// ---- a real shape: Qwen3.5-4B's Hk=16, Hv=32, K=V=128 --------------------------------------

TEST(GdnRealShape, EagerF32) {
  RunSpec spec = gdn_spec(kReal, DecodeMode::kEager, DType::kF32);
  spec.batch = 2;
  spec.steps = 12;
  spec.seed = 610;
  const RunResult r = testing::run_gdn(spec);
  ASSERT_EQ(r.failure, "");
  EXPECT_LE(r.max_error, kFp32Tol);
  EXPECT_LE(r.export_error, kFp32Tol);
}

TEST(GdnRealShape, ReplayL16F32) {
  RunSpec spec = gdn_spec(kReal, DecodeMode::kReplay, DType::kF32);
  spec.cache.buffer_len = 16;
  spec.batch = 2;
  spec.steps = 64;
  spec.seed = 611;
  const RunResult r = testing::run_gdn(spec);
  ASSERT_EQ(r.failure, "");
  EXPECT_LE(r.max_error, kFp32Tol);
  EXPECT_LE(r.export_error, kFp32Tol);
}

TEST(GdnRealShape, ReplayL16Bf16Inputs) {
  RunSpec spec = gdn_spec(kReal, DecodeMode::kReplay, DType::kBF16);
  spec.cache.buffer_len = 16;
  spec.batch = 2;
  spec.steps = 40;
  spec.seed = 612;
  spec.naive = true;
  const RunResult r = testing::run_gdn(spec);
  ASSERT_EQ(r.failure, "");
  testing::expect_within_naive(r, kFloor);
  EXPECT_LE(r.export_error, kBf16StateTol);
}

TEST(GdnRealShape, SpecT4L16F32) {
  RunSpec spec = gdn_spec(kReal, DecodeMode::kReplay, DType::kF32);
  spec.cache.buffer_len = 16;
  spec.cache.max_spec_tokens = 4;
  spec.window = 4;
  spec.batch = 2;
  spec.steps = 24;
  spec.stagger = 3;
  spec.seed = 613;
  spec.compare_plain = true;
  const RunResult r = testing::run_gdn(spec);
  ASSERT_EQ(r.failure, "");
  EXPECT_LE(r.max_error, kFp32Tol);
  EXPECT_LE(r.plain_max_error, kFp32Tol);
  EXPECT_LE(r.export_error, kFp32Tol);
}

}  // namespace
}  // namespace replayssm
