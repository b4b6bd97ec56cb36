// Mamba-2 decode on CUDA: the CUDA backend against the CPU backend (same Args, same inputs,
// every mode), against the float64 oracle over many fold cycles, and the properties only a
// device backend can break: bad device-resident slot ids, a verify that commits nothing, and
// decode steps captured into a CUDA graph.
//
// Tolerances, CUDA vs CPU, as max|y_cuda − y_cpu| / max|y_cpu| per decode call. The two
// backends run the same arithmetic in a different rounding order (FMA contraction on the GPU,
// dot products of 128 terms summed in another order), so fp32 paths agree to ~1e-6; what else
// differs is an output or a low-precision state element rounding the other way:
//   y in bf16: one bf16 ulp of an element, <= 2^-8 of max|y|            -> 8e-3
//   bf16 read copy / bf16 or f16 eager state: a flipped element moves one dot product term
//   by 2^-8 of itself                                                    -> 2e-3 (f32 inputs)
//   fp8 read copy: a flipped element moves a term by 2^-3 of itself     -> 2e-2

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "testing/cuda_test_util.h"
#include "testing/side_case.h"
#include "testing/test_util.h"

namespace replayssm {
namespace {

using testing::kAllPrecisions;
using testing::Mamba2Call;
using testing::NamedShape;
using testing::side_config;
using testing::side_name;
using testing::Mamba2Layer;
using testing::Mamba2Tokens;
using testing::Recipe;
using testing::Rng;

// 2 heads per group; head_dim 16: folds on the tensor cores (fold_tile_mma)
const Mamba2Shape kSmall{4, 16, 128, 2};
// head_dim 20: threads with rows past the head, folds on the CUDA cores (not a multiple of 16)
const Mamba2Shape kOddRows{6, 20, 128, 3};
const Mamba2Shape kGolden{4, 8, 16, 2};       // dstate 16: the generic kernels (golden traces)
const Mamba2Shape kGeneric{6, 20, 64, 3};     // dstate 64, odd head_dim: the generic kernels
const Mamba2Shape kNano4b{96, 80, 128, 8};    // Nemotron-3-Nano-4B
const Mamba2Shape kSuper120b{128, 64, 128, 8};  // Nemotron-3-Super-120B

// ---- CUDA vs CPU, side by side ---------------------------------------------------------------

using SideCase = testing::SideCase<Mamba2Shape>;

double output_tolerance(const SideCase& c) { return testing::side_output_tolerance(c, 2e-2); }

// The exported state is the master copy: fp32 except in eager bf16/f16 and shared-bf16 caches,
// whose elements can round the other way and then evolve apart by a few ulps.
double state_tolerance(const SideCase& c) {
  const bool low_master = (c.mode == DecodeMode::kEager && c.state != DType::kF32) ||
                          (c.mode == DecodeMode::kReplay && c.checkpoint == CheckpointPrecision::kBf16);
  return low_master ? 1.6e-2 : 1e-4;
}

class Mamba2CudaVsCpu : public ::testing::TestWithParam<SideCase> {};

TEST_P(Mamba2CudaVsCpu, SameOutputsStatesAndCursors) {
  SKIP_WITHOUT_GPU();
  const SideCase c = GetParam();
  testing::CudaVsCpuSpec spec = testing::side_spec(c, 17, 0.5);
  spec.gate = true;
  spec.output_tol = output_tolerance(c);
  spec.state_tol = state_tolerance(c);
  double worst = 0.0;
  ASSERT_NO_FATAL_FAILURE(testing::compare_cuda_vs_cpu(spec, &worst));
  RecordProperty("max_rel_diff", std::to_string(worst));
}

std::vector<SideCase> side_cases() {
  std::vector<SideCase> out;
  constexpr auto kF32 = DType::kF32, kBF16 = DType::kBF16, kF16 = DType::kF16;
  const NamedShape<Mamba2Shape> small{"small", kSmall}, odd_rows{"oddrows", kOddRows};
  const NamedShape<Mamba2Shape> golden{"golden", kGolden}, generic{"generic", kGeneric};
  const NamedShape<Mamba2Shape> nano4b{"nano4b", kNano4b}, super120b{"super120b", kSuper120b};
  // Eager, every state dtype, odd head_dim (rows past the head in the last pass).
  testing::add_eager_cases(odd_rows, {kF32, kBF16}, {kF32, kBF16, kF16}, &out);
  // Replay, every checkpoint precision, plain and speculative.
  testing::add_replay_cases(small, odd_rows, {kF32, kBF16}, {kF32, kBF16}, &out);
  // Shapes off the tuned kernels (dstate != 128) take the generic ones: the same cases.
  for (const NamedShape<Mamba2Shape>& s : {golden, generic}) {
    testing::add_eager_cases(s, {kF32}, {kF32, kBF16, kF16}, &out);
    testing::add_replay_cases(s, s, {kF32, kBF16}, {kF32}, &out);
  }
  testing::add_real_shape_cases({nano4b, super120b}, {kF32}, &out);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, Mamba2CudaVsCpu, ::testing::ValuesIn(side_cases()),
                         side_name<Mamba2Shape>);

// ---- CUDA vs the float64 oracle over many cycles (the shared driver) -------------------------

struct OracleCase {
  CheckpointPrecision checkpoint;
  DType input;
  int window;
};

void PrintTo(const OracleCase& c, std::ostream* os) {
  *os << testing::precision_tag(c.checkpoint) << "_in" << testing::dtype_tag(c.input)
      << testing::int_tag("_T", c.window);
}

class Mamba2CudaOracle : public ::testing::TestWithParam<OracleCase> {};

TEST_P(Mamba2CudaOracle, ReplayMatchesOracleAndPlainDecoding) {
  SKIP_WITHOUT_GPU();
  const OracleCase c = GetParam();
  testing::RunSpec spec;
  spec.cache.kind = LayerKind::kMamba2;
  spec.cache.mamba2 = kSmall;
  spec.cache.device = Device::kCuda;
  spec.cache.mode = DecodeMode::kReplay;
  spec.cache.checkpoint = c.checkpoint;
  spec.cache.input_dtype = c.input;
  spec.cache.num_layers = 2;
  spec.cache.buffer_len = 4;
  spec.cache.max_spec_tokens = c.window;
  spec.batch = 4;
  spec.steps = 40;  // 10 fold cycles
  spec.window = c.window;
  spec.stagger = 1;
  spec.gate = true;
  spec.compare_plain = c.window > 1;
  spec.guard_slots = 2;
  const testing::RunResult r = testing::run_mamba2(spec);
  ASSERT_TRUE(r.failure.empty()) << r.failure;
  EXPECT_GE(r.max_distinct_fill_levels, 2);
  if (c.input == DType::kF32 && c.checkpoint == CheckpointPrecision::kFp32) {
    EXPECT_LE(r.max_error, 1e-5);
    EXPECT_LE(r.export_error, 1e-5);
    if (c.window > 1) {
      EXPECT_LE(r.plain_max_error, 1e-5);
    }
  } else {
    // A window and plain decoding fold at different positions, so they read differently
    // rounded copies: up to about twice the read copy's own error apart.
    const double tol = c.checkpoint == CheckpointPrecision::kFp32Fp8 ? 5e-2 : 2e-2;
    EXPECT_LE(r.max_error, tol);
    if (c.window > 1) {
      EXPECT_LE(r.plain_max_error, 2.0 * tol);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Mamba2CudaOracle,
    // Windows of 3, 6 and 7 take every run length of the window kernel's sums (4, 2, 1) and
    // output pass (4, 3, 2).
    ::testing::Values(OracleCase{CheckpointPrecision::kFp32, DType::kF32, 1},
                      OracleCase{CheckpointPrecision::kFp32, DType::kF32, 4},
                      OracleCase{CheckpointPrecision::kFp32, DType::kF32, 3},
                      OracleCase{CheckpointPrecision::kFp32, DType::kF32, 6},
                      OracleCase{CheckpointPrecision::kFp32Bf16, DType::kBF16, 1},
                      OracleCase{CheckpointPrecision::kFp32Bf16, DType::kBF16, 7},
                      OracleCase{CheckpointPrecision::kFp32Fp8, DType::kBF16, 4}),
    ::testing::PrintToStringParamName());

// ---- device-only properties ------------------------------------------------------------------

StateCacheConfig replay_config(CheckpointPrecision p, int capacity, int window) {
  StateCacheConfig cfg;
  cfg.kind = LayerKind::kMamba2;
  cfg.mamba2 = kSmall;
  cfg.num_layers = 2;
  cfg.capacity = capacity;
  cfg.device = Device::kCuda;
  cfg.mode = DecodeMode::kReplay;
  cfg.input_dtype = DType::kBF16;
  cfg.buffer_len = 4;
  cfg.max_spec_tokens = window;
  cfg.checkpoint = p;
  return cfg;
}

// Runs `steps` decode + commit steps of every layer with fresh inputs.
void run_steps(StateCache& cache, const std::vector<std::int32_t>& slots,
               const std::vector<Mamba2Layer>& params, int window, int steps, Rng& rng) {
  const StateCacheConfig& cfg = cache.config();
  for (int step = 0; step < steps; ++step) {
    for (int layer = 0; layer < cfg.num_layers; ++layer) {
      const Mamba2Tokens tk = testing::make_mamba2_tokens(
          cfg.mamba2, int(slots.size()), window, cfg.input_dtype, false, Recipe{}, rng);
      const Mamba2Call call = testing::make_mamba2_call(cache, layer, slots, params[layer], tk);
      ASSERT_TRUE(mamba2_decode(cache, call.args).is_ok());
    }
    std::vector<std::int32_t> accepted(slots.size());
    for (auto& a : accepted) a = rng.uniform_int(0, window);
    ASSERT_TRUE(testing::commit(cache, slots, accepted).is_ok());
  }
}

TEST(Mamba2Cuda, VerifyThatCommitsNothingLeavesCheckpointBitIdentical) {
  SKIP_WITHOUT_GPU();
  for (CheckpointPrecision p : {CheckpointPrecision::kFp32, CheckpointPrecision::kBf16,
                                CheckpointPrecision::kFp32Bf16, CheckpointPrecision::kFp32Fp8}) {
    SCOPED_TRACE(checkpoint_precision_name(p));
    std::unique_ptr<StateCache> cache = testing::create_cache(replay_config(p, 3, 4));
    std::vector<std::int32_t> slots;
    for (int i = 0; i < 3; ++i) slots.push_back(testing::allocate_slot(*cache));
    Rng rng(5);
    std::vector<Mamba2Layer> params;
    for (int layer = 0; layer < 2; ++layer) {
      params.push_back(testing::make_mamba2_layer(kSmall, Recipe{}, rng));
    }
    run_steps(*cache, slots, params, 4, 7, rng);
    ASSERT_TRUE(testing::fold(*cache, slots).is_ok());  // nothing due at the next decode
    const Mamba2Tokens tk =
        testing::make_mamba2_tokens(kSmall, 3, 4, DType::kBF16, true, Recipe{}, rng);
    ASSERT_NO_FATAL_FAILURE(testing::expect_verify_commits_nothing(
        *cache, slots, [&] { return testing::make_mamba2_call(*cache, 1, slots, params[1], tk); },
        [](StateCache& c, const Mamba2Call& call) { return mamba2_decode(c, call.args); },
        [](const Mamba2Call& call) { return call.y.bytes(); }));
  }
}

TEST(Mamba2Cuda, CommitClampsToThePendingWindow) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<StateCache> cache =
      testing::create_cache(replay_config(CheckpointPrecision::kFp32, 2, 2));
  const std::vector<std::int32_t> slots = {testing::allocate_slot(*cache),
                                           testing::allocate_slot(*cache)};
  Rng rng(3);
  const Mamba2Layer params = testing::make_mamba2_layer(kSmall, Recipe{}, rng);
  const Mamba2Tokens tk = testing::make_mamba2_tokens(kSmall, 2, 2, DType::kBF16, false, Recipe{}, rng);
  const Mamba2Call call0 = testing::make_mamba2_call(*cache, 0, slots, params, tk);
  ASSERT_TRUE(mamba2_decode(*cache, call0.args).is_ok());
  ASSERT_EQ(testing::cursor_pending(*cache, slots[0]), 2);
  // A window layer 1 has not decoded cannot be committed: the count clamps to 0.
  ASSERT_TRUE(testing::commit(*cache, slots, {1, 1}).is_ok());
  EXPECT_EQ(testing::cursor_committed(*cache, slots[0]), 0u);
  EXPECT_EQ(testing::cursor_pending(*cache, slots[0]), 0);
  // Device-resident counts are not validated on the host: a count past the window is clamped.
  const Mamba2Call again0 = testing::make_mamba2_call(*cache, 0, slots, params, tk);
  const Mamba2Call call1 = testing::make_mamba2_call(*cache, 1, slots, params, tk);
  ASSERT_TRUE(mamba2_decode(*cache, again0.args).is_ok());
  ASSERT_TRUE(mamba2_decode(*cache, call1.args).is_ok());
  ASSERT_TRUE(testing::commit(*cache, slots, {7, -3}).is_ok());
  EXPECT_EQ(testing::cursor_committed(*cache, slots[0]), 2u);
  EXPECT_EQ(testing::cursor_committed(*cache, slots[1]), 0u);
  EXPECT_EQ(testing::cursor_pending(*cache, slots[0]), 0);
}

TEST(Mamba2Cuda, BadDeviceSlotIdsTouchNothing) {
  SKIP_WITHOUT_GPU();
  for (DecodeMode mode : {DecodeMode::kEager, DecodeMode::kReplay}) {
    StateCacheConfig cfg = replay_config(CheckpointPrecision::kFp32Fp8, 4, 1);
    cfg.mode = mode;
    std::unique_ptr<StateCache> cache = testing::create_cache(cfg);
    const int a = testing::allocate_slot(*cache);
    const int freed = testing::allocate_slot(*cache);
    ASSERT_TRUE(state_cache_free_slot(*cache, freed).is_ok());
    // Out of range both ways, a pad, a slot that is not allocated: no row may touch memory.
    const std::vector<std::int32_t> slots = {cfg.capacity + 5, -7, -1, freed, 1 << 30};
    Rng rng(9);
    const Mamba2Layer params = testing::make_mamba2_layer(kSmall, Recipe{}, rng);
    const Mamba2Tokens tk =
        testing::make_mamba2_tokens(kSmall, int(slots.size()), 1, cfg.input_dtype, true, Recipe{}, rng);
    const testing::CacheBytes before = testing::snapshot(*cache);
    const Mamba2Call call = testing::make_mamba2_call(*cache, 0, slots, params, tk);
    ASSERT_TRUE(mamba2_decode(*cache, call.args).is_ok());
    ASSERT_TRUE(testing::commit(*cache, slots, {1, 1, 1, 1, 1}).is_ok());
    ASSERT_TRUE(testing::fold(*cache, slots).is_ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(testing::diff(testing::snapshot(*cache), before), "");
    const std::vector<float> y = call.output();
    EXPECT_TRUE(std::all_of(y.begin(), y.end(), [](float v) { return std::isnan(v); }));
    (void)a;
  }
}

TEST(Mamba2Cuda, UnsupportedConfigsNameWhatIsSupported) {
  SKIP_WITHOUT_GPU();
  StateCacheConfig f16 = replay_config(CheckpointPrecision::kFp32, 1, 1);
  f16.input_dtype = DType::kF16;
  // Refused when the cache is created: no cache is made.
  std::unique_ptr<StateCache> c16;
  const Status st16 = state_cache_create(f16, &c16);
  EXPECT_FALSE(c16);
  EXPECT_EQ(st16.code(), StatusCode::kUnsupported);
  EXPECT_NE(st16.message().find("supported: f32, bf16"), std::string::npos) << st16.message();
}

// A whole decode step (every layer's decode and the commit) captured once into a CUDA graph and
// replayed: the same bytes and outputs as issuing the same calls on a stream. Speculative
// windows with a fixed acceptance pattern, so folds fall due inside the replays (the fold
// decision is made on the device).
TEST(Mamba2Cuda, GraphCapturedStepsMatchStreamExecution) {
  SKIP_WITHOUT_GPU();
  constexpr int kSteps = 11;
  for (CheckpointPrecision p : {CheckpointPrecision::kFp32, CheckpointPrecision::kFp32Fp8}) {
    SCOPED_TRACE(checkpoint_precision_name(p));
    const StateCacheConfig cfg = replay_config(p, 3, 3);
    std::unique_ptr<StateCache> direct = testing::create_cache(cfg);
    std::unique_ptr<StateCache> graphed = testing::create_cache(cfg);
    std::vector<std::int32_t> slots;
    for (int i = 0; i < 3; ++i) {
      slots.push_back(testing::allocate_slot(*direct));
      ASSERT_EQ(testing::allocate_slot(*graphed), slots.back());
    }
    slots.push_back(-1);
    Rng rng(11);
    std::vector<Mamba2Layer> params;
    std::vector<Mamba2Call> direct_calls, graph_calls;
    for (int layer = 0; layer < cfg.num_layers; ++layer) {
      params.push_back(testing::make_mamba2_layer(kSmall, Recipe{}, rng));
      const Mamba2Tokens tk =
          testing::make_mamba2_tokens(kSmall, 4, 3, cfg.input_dtype, true, Recipe{}, rng);
      direct_calls.push_back(testing::make_mamba2_call(*direct, layer, slots, params[layer], tk));
      graph_calls.push_back(testing::make_mamba2_call(*graphed, layer, slots, params[layer], tk));
    }
    const std::vector<std::int32_t> accepted = {3, 1, 2, 0};
    ASSERT_NO_FATAL_FAILURE(testing::expect_graph_matches_stream(
        *direct, *graphed, slots, accepted, direct_calls, graph_calls, kSteps,
        [](StateCache& cache, const Mamba2Call& c, Stream s) {
          return mamba2_decode(cache, c.args, s);
        },
        [](const Mamba2Call& c) { return c.y.bytes(); }));
  }
}

}  // namespace
}  // namespace replayssm
