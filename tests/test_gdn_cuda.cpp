// Gated DeltaNet decode on CUDA: the CUDA backend against the CPU backend (same Args, same
// inputs, every mode, small and real shapes), against the float64 oracle over many fold cycles
// (random acceptance, plain-decoding equivalence, dual precision flat in length), and the
// properties only a device backend can break: bad device-resident slot ids, a verify that
// commits nothing, ring appends, and decode steps captured into a CUDA graph.
//
// Tolerances, CUDA vs CPU, as max|o_cuda − o_cpu| / max|o_cpu| per decode call. Both backends
// run the same arithmetic in another rounding order (FMA contraction on the GPU, 128-term dot
// products and the k norm summed in another order), so fp32 paths agree to ~1e-6; what else
// differs is a low-precision value rounding the other way (the ring holds the raw k, exact, and
// both backends form k̂ = k·scale in fp32, so the ring itself adds no rounding):
//   o in bf16: one bf16 ulp of an element, <= 2^-8 of max|o|               -> 8e-3
//   bf16 read copy or eager state: a flipped element moves one term of a
//   dot product by 2^-8 of itself                                           -> 2e-3 (f32 inputs)
//   fp8 read copy: the two backends' fp32 masters differ by rounding order, so their fp8
//   copies are two roundings of slightly different rows; a flipped element moves a term by
//   2^-3 of itself, and with few terms (K = 16, 32) a couple of flips reach 3.7e-2 of max|o|
//   (measured on the H200): within twice the fp8 copy's own error against the oracle
//   (2^-4 of a row's max, test_gdn_cpu.cpp)                                 -> 2 · 2^-4

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "cuda/gdn/gdn_staging.h"
#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "testing/cuda_test_util.h"
#include "testing/side_case.h"
#include "testing/test_util.h"

namespace replayssm {
namespace {

using testing::GdnCall;
using testing::kAllPrecisions;
using testing::NamedShape;
using testing::shape_tag;
using testing::side_config;
using testing::side_name;
using testing::GdnTokens;
using testing::Recipe;
using testing::Rng;

const GdnShape kSmall{2, 4, 32, 16};       // 2 value heads per key head
const GdnShape kOdd{2, 6, 16, 7};          // G = 3, V = 7: G·V not a whole 16-byte run
const GdnShape kQwen4b{16, 32, 128, 128};  // Qwen3.5-4B
// Heads of 2 · 128 rows: at batch 4 each key head's rows split over several CTAs of 32 rows
// (row_tiling), inside an fp8 copy's 64-row read pass.
const GdnShape kSplitHeads{2, 4, 128, 128};
const GdnShape kQwen122b{16, 64, 128, 128};  // Qwen3.5-122B

const double kBf16U = std::ldexp(1.0, -8);  // unit roundoff-ish: one bf16 ulp at 1.0
const double kFp8U = std::ldexp(1.0, -4);
const double kFp8TwoRoundings = 2 * kFp8U;

// ---- CUDA vs CPU, side by side ---------------------------------------------------------------

using SideCase = testing::SideCase<GdnShape>;

double output_tolerance(const SideCase& c) {
  return testing::side_output_tolerance(c, kFp8TwoRoundings);
}

class GdnCudaVsCpu : public ::testing::TestWithParam<SideCase> {};

TEST_P(GdnCudaVsCpu, SameOutputsStatesAndCursors) {
  SKIP_WITHOUT_GPU();
  const SideCase c = GetParam();
  testing::CudaVsCpuSpec spec = testing::side_spec(c, 23, 0.05);
  spec.output_tol = output_tolerance(c);
  spec.state_tol = std::max(spec.output_tol, 1e-5);
  double worst = 0.0;
  ASSERT_NO_FATAL_FAILURE(testing::compare_cuda_vs_cpu(spec, &worst));
  RecordProperty("max_rel_diff", std::to_string(worst));
}

std::vector<SideCase> side_cases() {
  std::vector<SideCase> out;
  constexpr auto kF32 = DType::kF32, kBF16 = DType::kBF16;
  const NamedShape<GdnShape> small{"small", kSmall}, odd{"odd", kOdd};
  const NamedShape<GdnShape> qwen4b{"qwen4b", kQwen4b}, qwen122b{"qwen122b", kQwen122b};
  // Eager, both state dtypes, an odd shape (rows past the head in the last pass), raw q/k.
  testing::add_eager_cases(odd, {kF32, kBF16}, {kF32, kBF16}, &out);
  SideCase raw{small.name, small.shape, DecodeMode::kEager};
  raw.qk_l2norm = false;
  out.push_back(raw);
  // Replay, every checkpoint precision, plain and speculative.
  testing::add_replay_cases(small, odd, {kF32, kBF16}, {kF32, kBF16}, &out);
  SideCase wide{small.name, small.shape, DecodeMode::kReplay};  // the widest window, raw q/k
  wide.window = 8;
  wide.buffer_len = 3;
  wide.steps = 20;
  wide.stagger = 1;
  wide.qk_l2norm = false;
  out.push_back(wide);
  testing::add_real_shape_cases({qwen4b, qwen122b}, {kF32, kBF16}, &out);
  // Verify windows at a 16-row head, whose low-precision read copies are read on the tensor
  // cores (gdn_params.cuh, reads_on_tensor_cores); fp32 inputs and outputs, so that the walked
  // queries' two bf16 parts are checked to the fp32 outputs' tolerance, not bf16's.
  testing::add_replay_cases(small, small, {}, {kF32}, &out);
  // A batch at kFoldPairsBatchLimit (gdn_params.cuh), where single-token folds go record by
  // record; below it, in every case above, they fold in pairs (plain caches' windows never do).
  const std::size_t first_b256 = out.size();
  const NamedShape<GdnShape> small_b256{"small_b256", kSmall};
  testing::add_replay_cases(small_b256, small_b256, {kBF16}, {}, &out);
  for (std::size_t i = first_b256; i < out.size(); ++i) out[i].batch = 256;
  // The real shape at serving batches: at 16 each key head's rows split over several CTAs
  // (row_tiling), at 64 the rows are served fold-first (fold_order.cuh); staggered, a few rows
  // fold on each step, aligned, all on one.
  // Every row runs 4L steps after it joins.
  const auto serving = [&](const char* name, GdnShape shape, int batch, int window, int stagger,
                           CheckpointPrecision p, int buffer_len) {
    SideCase c = testing::real_shape_replay(NamedShape<GdnShape>{name, shape}, p, window, batch,
                                            stagger, batch * stagger + 4 * buffer_len);
    c.buffer_len = buffer_len;
    out.push_back(c);
  };
  constexpr auto kFp32 = CheckpointPrecision::kFp32, kBf16Copy = CheckpointPrecision::kBf16;
  constexpr auto kDual = CheckpointPrecision::kFp32Bf16;
  for (CheckpointPrecision p : testing::kAllPrecisions) {
    serving("qwen4b_b16", kQwen4b, 16, 1, 1, p, 16);
  }
  serving("qwen4b_b64", kQwen4b, 64, 1, 1, kDual, 16);
  serving("qwen4b_b64", kQwen4b, 64, 1, 0, kFp32, 16);
  serving("qwen4b_b64", kQwen4b, 64, 1, 0, kBf16Copy, 16);
  // At kStagedMmaMinBatch (gdn_params.cuh) bf16 read copies' single-token steps are summed on
  // the tensor cores (read_staged_mma), whose K = 128 variant only real shapes take.
  serving("qwen4b_b128", kQwen4b, 128, 1, 1, kDual, 16);
  serving("qwen4b_b128", kQwen4b, 128, 1, 0, kBf16Copy, 16);
  // Four value heads per key head at serving batches (gdn_params.cuh, kReplayResidentFloor):
  // single tokens stage all 4 heads (64: two splits, 128: one, the bf16 copy on the tensor
  // cores, read_staged_mma); a 4-token window stages its split's 2 (64: the tiling's two
  // splits, read_window_mma over fp8; 128: split further from one, so that 8 CTAs fit an SM);
  // and L = 32, whose single-token staging of all 4 heads is 55 KB, stages its split's 2.
  serving("qwen122b_b64", kQwen122b, 64, 1, 1, kFp32, 16);
  serving("qwen122b_b128", kQwen122b, 128, 1, 1, kDual, 16);
  serving("qwen122b_b128", kQwen122b, 128, 4, 0, kBf16Copy, 16);
  serving("qwen122b_b64", kQwen122b, 64, 4, 0, CheckpointPrecision::kFp32Fp8, 16);
  serving("qwen122b_b64", kQwen122b, 64, 1, 0, kFp32, 32);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, GdnCudaVsCpu, ::testing::ValuesIn(side_cases()),
                         side_name<GdnShape>);

// ---- CUDA vs the float64 oracle over many cycles (the shared driver) -------------------------

struct OracleCase {
  CheckpointPrecision checkpoint;
  DType input;
  int window;
  GdnShape shape;
};
void PrintTo(const OracleCase& c, std::ostream* os) {
  *os << testing::precision_tag(c.checkpoint) << "_in" << testing::dtype_tag(c.input)
      << testing::int_tag("_T", c.window) << "_" << shape_tag(c.shape);
}

class GdnCudaOracle : public ::testing::TestWithParam<OracleCase> {};

// Random acceptance, staggered rows, guard slots, a freed slot, pad rows (the driver checks
// each), and every accepted output equal to plain decoding's on the accepted stream.
TEST_P(GdnCudaOracle, ReplayMatchesOracleAndPlainDecoding) {
  SKIP_WITHOUT_GPU();
  const OracleCase c = GetParam();
  testing::RunSpec spec;
  spec.cache.kind = LayerKind::kGdn;
  spec.cache.gdn = c.shape;
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
  spec.compare_plain = c.window > 1;
  spec.guard_slots = 2;
  const testing::RunResult r = testing::run_gdn(spec);
  ASSERT_TRUE(r.failure.empty()) << r.failure;
  EXPECT_GE(r.max_distinct_fill_levels, 2);
  RecordProperty("max_error", std::to_string(r.max_error));
  if (c.input == DType::kF32 && c.checkpoint == CheckpointPrecision::kFp32) {
    EXPECT_LE(r.max_error, 1e-5);
    EXPECT_LE(r.export_error, 1e-5);
    if (c.window > 1) {
      EXPECT_LE(r.plain_max_error, 1e-5);
    }
  } else {
    // fp8: the read copy alone is within 2^-4 of a row's max (test_gdn_cpu.cpp). The window
    // cache and the plain one fold at different points of the stream, so their fp8 copies
    // are roundings of different states: up to twice that apart.
    const bool fp8 = c.checkpoint == CheckpointPrecision::kFp32Fp8;
    EXPECT_LE(r.max_error, fp8 ? 2 * kFp8U : 2e-2);
    if (c.window > 1) {
      EXPECT_LE(r.plain_max_error, fp8 ? kFp8TwoRoundings : 2e-2);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, GdnCudaOracle,
    ::testing::Values(OracleCase{CheckpointPrecision::kFp32, DType::kF32, 1, kSmall},
                      OracleCase{CheckpointPrecision::kFp32, DType::kF32, 4, kSmall},
                      OracleCase{CheckpointPrecision::kFp32, DType::kF32, 3, kOdd},
                      OracleCase{CheckpointPrecision::kFp32, DType::kF32, 2, kSmall},
                      OracleCase{CheckpointPrecision::kFp32Bf16, DType::kBF16, 5, kOdd},
                      OracleCase{CheckpointPrecision::kFp32Bf16, DType::kBF16, 1, kSmall},
                      OracleCase{CheckpointPrecision::kBf16, DType::kBF16, 4, kSmall},
                      OracleCase{CheckpointPrecision::kFp32Bf16, DType::kBF16, 4, kSmall},
                      OracleCase{CheckpointPrecision::kFp32Fp8, DType::kBF16, 4, kSmall},
                      OracleCase{CheckpointPrecision::kFp32, DType::kF32, 1, kSplitHeads},
                      OracleCase{CheckpointPrecision::kFp32Fp8, DType::kBF16, 1, kSplitHeads}),
    ::testing::PrintToStringParamName());

// Dual precision over a long memory (ALGORITHM.md §6, §10; the CPU version is
// test_dual_precision.cpp): g ≈ −0.001 and β ~ U(0.02, 0.06), about 1,000 tokens of memory,
// 1,000 steps at L = 16. fp32+bf16 stays flat; shared bf16 grows and ends well above it.
TEST(GdnCuda, DualPrecisionErrorIsFlatInLength) {
  SKIP_WITHOUT_GPU();
  constexpr int kSteps = 1000;
  testing::RunSpec spec = testing::gdn_long_memory_spec(16, kSteps);  // kSmall's shape
  spec.cache.device = Device::kCuda;
  double early[4] = {}, late[4] = {}, worst[4] = {};
  for (int i = 0; i < 4; ++i) {
    spec.cache.checkpoint = kAllPrecisions[i];
    const testing::RunResult r = testing::run_gdn(spec);
    ASSERT_EQ(r.failure, "") << checkpoint_precision_name(kAllPrecisions[i]);
    ASSERT_EQ(r.step_error.size(), std::size_t(kSteps));
    early[i] = testing::mean_of(r.step_error, 100, 200);
    late[i] = testing::mean_of(r.step_error, 900, 1000);
    worst[i] = r.max_error;
    std::printf("[ curve    ] gdn cuda %-9s early %.3e  late %.3e  max %.3e\n",
                checkpoint_precision_name(kAllPrecisions[i]), early[i], late[i], worst[i]);
  }
  // The CPU test's criteria (test_dual_precision.cpp, L = 16). Measured on the H200, mean
  // error over steps 100-200 / 900-1000: fp32+bf16 1.700e-3 / 1.739e-3, fp32+fp8 2.49e-2 /
  // 2.61e-2, shared bf16 3.57e-3 / 6.58e-3 (the CPU backend: 3.57e-3 / 6.34e-3).
  EXPECT_LE(worst[0], 1e-5);                     // fp32
  EXPECT_LE(late[2], 1.25 * early[2]);           // fp32+bf16: flat
  EXPECT_LE(worst[2], 2 * kBf16U);
  EXPECT_LE(late[3], 1.25 * early[3]);           // fp32+fp8: flat
  EXPECT_LE(worst[3], 2 * kFp8U);
  EXPECT_GE(late[1], 1.5 * early[1]);            // shared bf16 grows ...
  EXPECT_GE(late[1], 3.0 * late[2]);             // ... and ends well above fp32+bf16
}

// ---- device-only properties ------------------------------------------------------------------

StateCacheConfig replay_config(CheckpointPrecision p, int capacity, int window) {
  StateCacheConfig cfg;
  cfg.kind = LayerKind::kGdn;
  cfg.gdn = kSmall;
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
void run_steps(StateCache& cache, const std::vector<std::int32_t>& slots, int window, int steps,
               Rng& rng) {
  const StateCacheConfig& cfg = cache.config();
  for (int step = 0; step < steps; ++step) {
    for (int layer = 0; layer < cfg.num_layers; ++layer) {
      const GdnTokens tk = testing::make_gdn_tokens(cfg.gdn, int(slots.size()), window,
                                                    cfg.input_dtype, Recipe{}, rng);
      const GdnCall call = testing::make_gdn_call(cache, layer, slots, tk, true, 0.0f);
      ASSERT_TRUE(gdn_decode(cache, call.args).is_ok());
    }
    std::vector<std::int32_t> accepted(slots.size());
    for (auto& a : accepted) a = rng.uniform_int(0, window);
    ASSERT_TRUE(testing::commit(cache, slots, accepted).is_ok());
  }
}

TEST(GdnCuda, VerifyThatCommitsNothingLeavesCheckpointBitIdentical) {
  SKIP_WITHOUT_GPU();
  for (CheckpointPrecision p : kAllPrecisions) {
    SCOPED_TRACE(checkpoint_precision_name(p));
    std::unique_ptr<StateCache> cache = testing::create_cache(replay_config(p, 3, 4));
    std::vector<std::int32_t> slots;
    for (int i = 0; i < 3; ++i) slots.push_back(testing::allocate_slot(*cache));
    Rng rng(5);
    run_steps(*cache, slots, 4, 7, rng);
    ASSERT_TRUE(testing::fold(*cache, slots).is_ok());  // nothing due at the next decode
    const GdnTokens tk = testing::make_gdn_tokens(kSmall, 3, 4, DType::kBF16, Recipe{}, rng);
    ASSERT_NO_FATAL_FAILURE(testing::expect_verify_commits_nothing(
        *cache, slots, [&] { return testing::make_gdn_call(*cache, 1, slots, tk, true, 0.0f); },
        [](StateCache& c, const GdnCall& call) { return gdn_decode(c, call.args); },
        [](const GdnCall& call) { return call.o.bytes(); }));
  }
}

// Ring records are data movement: the CUDA ring holds the CPU ring's bytes exactly (raw k, v,
// β, g), in every input dtype, with and without q/k normalisation. The keys' normalisation
// factors (ring_key_scale) are 1 exactly without it, and with it agree to the rounding of a
// K-term fp32 sum of squares taken in another order.
TEST(GdnCuda, RingAppendsAreBitExact) {
  SKIP_WITHOUT_GPU();
  for (int variant = 0; variant < 4; ++variant) {
    const DType input = variant % 2 == 0 ? DType::kF32 : DType::kBF16;
    const bool l2norm = variant >= 2;
    SCOPED_TRACE(std::string(dtype_name(input)) + (l2norm ? " l2norm" : " raw q/k"));
    StateCacheConfig cfg = replay_config(CheckpointPrecision::kFp32, 3, 3);
    cfg.input_dtype = input;
    cfg.device = Device::kCpu;
    StateCacheConfig gcfg = cfg;
    gcfg.device = Device::kCuda;
    std::unique_ptr<StateCache> cpu = testing::create_cache(cfg);
    std::unique_ptr<StateCache> gpu = testing::create_cache(gcfg);
    std::vector<std::int32_t> slots;
    for (int i = 0; i < 3; ++i) {
      slots.push_back(testing::allocate_slot(*cpu));
      ASSERT_EQ(testing::allocate_slot(*gpu), slots.back());
    }
    slots[1] = -1;
    Rng rng(31);
    Recipe recipe;
    recipe.unit_keys = !l2norm;
    for (int step = 0; step < 9; ++step) {
      for (int layer = 0; layer < cfg.num_layers; ++layer) {
        const GdnTokens tk = testing::make_gdn_tokens(kSmall, 3, 3, input, recipe, rng);
        const GdnCall cc = testing::make_gdn_call(*cpu, layer, slots, tk, l2norm, 0.0f);
        const GdnCall gc = testing::make_gdn_call(*gpu, layer, slots, tk, l2norm, 0.0f);
        ASSERT_TRUE(gdn_decode(*cpu, cc.args).is_ok());
        ASSERT_TRUE(gdn_decode(*gpu, gc.args).is_ok());
      }
      const std::vector<std::int32_t> accepted = {step % 4, 0, 3 - step % 4};
      ASSERT_TRUE(testing::commit(*cpu, slots, accepted).is_ok());
      ASSERT_TRUE(testing::commit(*gpu, slots, accepted).is_ok());
    }
    const std::vector<std::string> ring = {"ring_key", "ring_vec", "ring_write", "ring_decay",
                                           "committed", "folded", "pending"};
    EXPECT_EQ(testing::diff(testing::snapshot(*gpu, ring), testing::snapshot(*cpu, ring)), "");

    // ring_key_scale, every record (both backends' allocations start zeroed): exactly the
    // CPU's without normalisation (all 1), within sum-order rounding with it.
    const std::vector<std::uint8_t> gs =
        testing::snapshot(*gpu, {"ring_key_scale"})["ring_key_scale"];
    const std::vector<std::uint8_t> cs =
        testing::snapshot(*cpu, {"ring_key_scale"})["ring_key_scale"];
    ASSERT_EQ(gs.size(), cs.size());
    ASSERT_EQ(gs.size() % 4, 0u);
    std::vector<float> g(gs.size() / 4), c(cs.size() / 4);
    std::memcpy(g.data(), gs.data(), gs.size());
    std::memcpy(c.data(), cs.data(), cs.size());
    int compared = 0;
    for (std::size_t i = 0; i < c.size(); ++i) {
      if (c[i] == 0.0f || !l2norm) {
        ASSERT_EQ(g[i], c[i]) << "ring_key_scale[" << i << "]";
        if (c[i] != 0.0f) {
          ASSERT_EQ(c[i], 1.0f) << "ring_key_scale[" << i << "]";
        }
      } else {
        ASSERT_LE(std::fabs(double(g[i]) - double(c[i])), 1e-5 * std::fabs(double(c[i])))
            << "ring_key_scale[" << i << "]: cuda " << g[i] << " cpu " << c[i];
      }
      compared += c[i] != 0.0f;
    }
    EXPECT_GT(compared, 0);
  }
}

TEST(GdnCuda, BadDeviceSlotIdsTouchNothing) {
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
    const GdnTokens tk =
        testing::make_gdn_tokens(kSmall, int(slots.size()), 1, cfg.input_dtype, Recipe{}, rng);
    const testing::CacheBytes before = testing::snapshot(*cache);
    const GdnCall call = testing::make_gdn_call(*cache, 0, slots, tk, true, 0.0f);
    ASSERT_TRUE(gdn_decode(*cache, call.args).is_ok());
    if (mode == DecodeMode::kReplay) {
      ASSERT_TRUE(testing::commit(*cache, slots, {1, 1, 1, 1, 1}).is_ok());
      ASSERT_TRUE(testing::fold(*cache, slots).is_ok());
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(testing::diff(testing::snapshot(*cache), before), "");
    const std::vector<float> o = call.output();
    EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float v) { return std::isnan(v); }));
    (void)a;
  }
}

// ---- How a replay launch stages its CTAs (host arithmetic: runs without a GPU) --------------

// The choices measured on the H200 (docs/BENCHMARKS.md, "2026-12-04 (evening)"), against its
// limits: 132 SMs, 228 KB of shared memory an SM, 1 KB of it reserved per CTA.
TEST(GdnReplayStaging, SplitsAndStagedHeadsOnAnH200) {
  cuda::DeviceLimits h200;
  h200.sms = 132;
  h200.smem_per_block = 227 * 1024;
  h200.smem_per_sm = 228 * 1024;
  h200.smem_reserved = 1024;
  struct Want {
    GdnShape shape;
    CheckpointPrecision checkpoint;
    int buffer_len, tokens, batch;
    bool conv;
    int splits, heads;
  };
  constexpr auto kFp32 = CheckpointPrecision::kFp32, kBf16 = CheckpointPrecision::kBf16;
  const Want wants[] = {
      // 4 value heads a key head: a single-token CTA staging all 4 fits 6 an SM, the floor.
      {kQwen122b, kFp32, 16, 1, 256, false, 1, 4},
      {kQwen122b, kBf16, 16, 1, 1024, false, 1, 4},
      {kQwen122b, kFp32, 16, 1, 64, false, 2, 4},  // two splits, several waves: all 4
      {kQwen122b, kFp32, 16, 1, 16, false, 4, 1},  // four splits, one wave: its own head
      {kQwen122b, kFp32, 16, 1, 16, true, 4, 4},   // a conv cache convolves every head
      // 4-token windows staging all 4 fit 5 an SM: two splits of 2 heads.
      {kQwen122b, kBf16, 16, 4, 256, false, 2, 2},
      {kQwen122b, kFp32, 16, 4, 64, false, 2, 2},
      {kQwen122b, kBf16, 16, 8, 64, false, 4, 1},  // 8 tokens: 2 heads still fit 5
      {kQwen122b, kFp32, 32, 1, 64, false, 2, 2},  // L = 32: all 4 heads fit 4
      // 2 value heads a key head: windows of 4 fit 8 an SM as they are; of 8, two splits.
      {kQwen4b, kBf16, 16, 4, 256, false, 1, 2},
      {kQwen4b, kBf16, 16, 4, 64, false, 2, 1},
      {kQwen4b, kFp32, 16, 8, 256, false, 2, 1},
      {kQwen4b, kFp32, 16, 1, 256, false, 1, 2},
      {kQwen4b, kFp32, 16, 1, 64, false, 2, 2},
  };
  for (const Want& w : wants) {
    StateCacheConfig c = replay_config(w.checkpoint, w.batch, w.tokens);
    c.gdn = w.shape;
    c.buffer_len = w.buffer_len;
    c.conv_kernel = w.conv ? 4 : 0;
    const cuda::gdn::ReplayStaging s =
        cuda::gdn::replay_staging(c, w.batch, w.tokens, w.conv, h200);
    SCOPED_TRACE(testing::shape_tag(w.shape) + " L" + std::to_string(w.buffer_len) + " T" +
                 std::to_string(w.tokens) + " batch " + std::to_string(w.batch) +
                 (w.conv ? " conv" : ""));
    EXPECT_EQ(s.tiling.splits, w.splits);
    EXPECT_EQ(s.heads, w.heads);
    EXPECT_EQ(s.tiling.splits * s.tiling.rows_per_split, w.shape.num_v_heads /
                                                             w.shape.num_k_heads *
                                                             w.shape.head_v_dim);
  }
}

TEST(GdnCuda, UnsupportedConfigsNameWhatIsSupported) {
  SKIP_WITHOUT_GPU();
  // Refused when the cache is created: no cache is made.
  auto decode_status = [](const StateCacheConfig& cfg) {
    std::unique_ptr<StateCache> cache;
    const Status st = state_cache_create(cfg, &cache);
    EXPECT_FALSE(cache);
    return st;
  };
  // Head sizes the tuned kernels are not built for run on the generic ones (test_gdn_generic
  // _cuda.cpp); past what a warp-held row takes, none does.
  StateCacheConfig k1024 = replay_config(CheckpointPrecision::kFp32, 1, 1);
  k1024.gdn.head_k_dim = 1024;
  Status st = decode_status(k1024);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("head_k_dim 1024; supported: 1 to 512"), std::string::npos)
      << st.message();
  for (GdnShape generic : {GdnShape{2, 4, 100, 16}, GdnShape{2, 4, 32, 256}}) {
    StateCacheConfig cfg = replay_config(CheckpointPrecision::kFp32, 1, 1);
    cfg.gdn = generic;
    std::unique_ptr<StateCache> cache;
    EXPECT_TRUE(state_cache_create(cfg, &cache).is_ok());
  }

  StateCacheConfig f16 = replay_config(CheckpointPrecision::kFp32, 1, 1);
  f16.input_dtype = DType::kF16;
  st = decode_status(f16);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("supported: f32, bf16"), std::string::npos) << st.message();

  StateCacheConfig eager16 = replay_config(CheckpointPrecision::kFp32, 1, 1);
  eager16.mode = DecodeMode::kEager;
  eager16.state_dtype = DType::kF16;
  st = decode_status(eager16);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("state dtype f16; supported: f32, bf16"), std::string::npos)
      << st.message();
}

// A whole decode step (every layer's decode and the commit) captured once into a CUDA graph and
// replayed: the same bytes and outputs as issuing the same calls on a stream. Speculative
// windows with a fixed acceptance pattern, so folds fall due inside the replays (the fold
// decision is taken on the device).
TEST(GdnCuda, GraphCapturedStepsMatchStreamExecution) {
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
    std::vector<GdnCall> direct_calls, graph_calls;
    for (int layer = 0; layer < cfg.num_layers; ++layer) {
      const GdnTokens tk = testing::make_gdn_tokens(kSmall, 4, 3, cfg.input_dtype, Recipe{}, rng);
      direct_calls.push_back(testing::make_gdn_call(*direct, layer, slots, tk, true, 0.0f));
      graph_calls.push_back(testing::make_gdn_call(*graphed, layer, slots, tk, true, 0.0f));
    }
    const std::vector<std::int32_t> accepted = {3, 1, 2, 0};
    ASSERT_NO_FATAL_FAILURE(testing::expect_graph_matches_stream(
        *direct, *graphed, slots, accepted, direct_calls, graph_calls, kSteps,
        [](StateCache& cache, const GdnCall& c, Stream s) { return gdn_decode(cache, c.args, s); },
        [](const GdnCall& c) { return c.o.bytes(); }));
  }
}

}  // namespace
}  // namespace replayssm
