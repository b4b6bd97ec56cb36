// A decode's fold cadence (ops.h, fold_every): a replay cache folds a row's committed history
// first once fold_every tokens of it wait, whatever its buffer_len, and the cadence may change
// from one call to the next. Both families, on the CPU and (cases named "Cuda", label `cuda`)
// on the GPU:
//   - the cursors: after each decode, a row's `folded` moved to `committed` exactly when the
//     call's cadence was due (outputs alone would not show a cadence that was ignored: folding
//     later is exact too);
//   - against the float64 oracle over many steps with the cadence cycling through 1..L and 0,
//     rows staggered, single tokens and verify windows with random acceptance, every checkpoint
//     precision; the cycle shortens the cadence while rows hold longer history, which then
//     folds whole;
//   - refusals: a cadence outside [0, buffer_len], or nonzero on an eager cache, is an error
//     that names it, and nothing is written;
//   - the CUDA backend against the CPU one (outputs, states, every cursor) under cycling
//     cadences, at small shapes and at the real ones the tuned kernels serve.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <type_traits>
#include <vector>

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "testing/family.h"
#include "testing/require_gpu.h"
#include "testing/side_case.h"
#include "testing/test_util.h"

namespace replayssm {
namespace {

using testing::device_tag;
using testing::int_tag;
using testing::kind_tag;
using testing::precision_tag;

constexpr double kFp32Tol = 1e-5;
constexpr int kL = 8;
// Every cadence from 1 to L and the cache's own (0), in an order that shortens it while rows
// hold up to L - 1 tokens (8 -> 1, 0 -> 2) and lengthens it again.
const std::vector<int> kCycle = {0, 1, 3, kL, 2, 5, 0, 2, 7, 1, 4, 6};

// Shapes of the tuned CUDA kernels (Mamba-2 dstate 128; GDN head_k_dim a multiple of 16).
const Mamba2Shape kMamba2Small{4, 16, 128, 2};
const GdnShape kGdnSmall{2, 4, 32, 16};

StateCacheConfig replay_config(LayerKind kind, Device device, CheckpointPrecision precision,
                               int T) {
  StateCacheConfig c;
  c.kind = kind;
  c.mamba2 = kMamba2Small;
  c.gdn = kGdnSmall;
  c.device = device;
  c.mode = DecodeMode::kReplay;
  c.checkpoint = precision;
  c.input_dtype = DType::kF32;
  c.buffer_len = kL;
  c.max_spec_tokens = T;
  c.num_layers = 2;
  c.capacity = 4;
  return c;
}

// f(family) with the family of `config`, its layer parameters drawn from `rng` (Mamba-2 with
// its gate).
template <typename F>
void with_family_of(const StateCacheConfig& config, testing::Rng& rng, F&& f) {
  testing::FamilySettings settings;
  settings.cache = config;
  settings.gate = true;
  testing::with_family(config.kind, [&](auto tag) {
    using Family = typename decltype(tag)::type;
    f(Family(settings, rng));
  });
}

// ---- the cursors follow the call's cadence -----------------------------------------------

struct CursorCase {
  LayerKind kind;
  Device device;
  int T;
};
void PrintTo(const CursorCase& c, std::ostream* os) {
  *os << kind_tag(c.kind) << "_" << device_tag(c.device) << int_tag("_T", c.T);
}

class FoldCadenceCursors : public ::testing::TestWithParam<CursorCase> {};

TEST_P(FoldCadenceCursors, AFoldFallsExactlyWhenTheCallsCadenceIsDue) {
  const CursorCase c = GetParam();
  if (c.device == Device::kCuda) SKIP_WITHOUT_GPU();
  const StateCacheConfig cfg = replay_config(c.kind, c.device, CheckpointPrecision::kFp32, c.T);
  std::unique_ptr<StateCache> cache = testing::create_cache(cfg);
  const std::vector<std::int32_t> slots = {testing::allocate_slot(*cache),
                                           testing::allocate_slot(*cache)};
  testing::Rng rng(91);
  with_family_of(cfg, rng, [&](const auto& family) {
    using Family = std::decay_t<decltype(family)>;
    int folds = 0;
    for (int step = 0; step < 6 * kL; ++step) {
      const int fold_every = testing::fold_every_at(kCycle, step);
      const std::uint32_t due_at = std::uint32_t(fold_every > 0 ? fold_every : kL);
      // Row 1 pads for the first three steps, so the rows' fill levels differ.
      const std::vector<std::int32_t> rows = {slots[0], step < 3 ? -1 : slots[1]};
      for (int layer = 0; layer < cfg.num_layers; ++layer) {
        std::vector<std::uint32_t> before(rows.size()), committed(rows.size());
        for (std::size_t r = 0; r < rows.size(); ++r) {
          if (rows[r] < 0) continue;
          before[r] = testing::cursor_folded(*cache, layer, rows[r]);
          committed[r] = testing::cursor_committed(*cache, rows[r]);
        }
        typename Family::Call call = family.call(*cache, layer, rows, family.tokens(2, c.T, rng));
        call.args.fold_every = fold_every;
        const Status st = Family::decode(*cache, call);
        ASSERT_TRUE(st.is_ok()) << st.to_string();
        for (std::size_t r = 0; r < rows.size(); ++r) {
          if (rows[r] < 0) continue;
          const bool due = committed[r] - before[r] >= due_at;
          folds += due;
          EXPECT_EQ(testing::cursor_folded(*cache, layer, rows[r]), due ? committed[r] : before[r])
              << "step " << step << " layer " << layer << " row " << r << ": fold_every "
              << fold_every << ", " << committed[r] - before[r] << " tokens waiting";
        }
      }
      std::vector<std::int32_t> accepted(rows.size(), 0);
      for (std::size_t r = 0; r < rows.size(); ++r) {
        if (rows[r] >= 0) accepted[r] = c.T == 1 ? 1 : rng.uniform_int(1, c.T);
      }
      ASSERT_TRUE(testing::commit(*cache, rows, accepted).is_ok());
    }
    // The cache's own L would fold each row and layer about 6 times in these 6L steps.
    EXPECT_GT(folds, int(slots.size()) * cfg.num_layers * 6) << "no more folds than L gives";
  });
}

std::vector<CursorCase> cursor_cases() {
  std::vector<CursorCase> out;
  for (Device d : {Device::kCpu, Device::kCuda}) {
    for (LayerKind k : {LayerKind::kMamba2, LayerKind::kGdn}) {
      for (int T : {1, 4}) out.push_back({k, d, T});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, FoldCadenceCursors, ::testing::ValuesIn(cursor_cases()),
                         ::testing::PrintToStringParamName());

// ---- against the float64 oracle ----------------------------------------------------------

struct OracleCase {
  LayerKind kind;
  Device device;
  CheckpointPrecision precision;
  int T;
};
void PrintTo(const OracleCase& c, std::ostream* os) {
  *os << kind_tag(c.kind) << "_" << device_tag(c.device) << "_" << precision_tag(c.precision)
      << int_tag("_T", c.T);
}

class FoldCadenceOracle : public ::testing::TestWithParam<OracleCase> {};

TEST_P(FoldCadenceOracle, OutputsAndStatesMatchTheOracleUnderACyclingCadence) {
  const OracleCase c = GetParam();
  if (c.device == Device::kCuda) SKIP_WITHOUT_GPU();
  testing::RunSpec spec;
  spec.cache = replay_config(c.kind, c.device, c.precision, c.T);
  spec.batch = 3;
  spec.steps = 8 * kL;
  spec.stagger = 3;
  spec.seed = 4100 + std::uint64_t(c.T);
  spec.window = c.T;
  spec.gate = true;
  spec.guard_slots = 2;
  spec.fold_every = kCycle;
  const testing::RunResult r = testing::run_oracle(spec);
  ASSERT_EQ(r.failure, "");
  EXPECT_GT(r.tokens_committed, 0);
  testing::expect_checkpoint_bounds(r, c.precision, kFp32Tol);
}

std::vector<OracleCase> oracle_cases() {
  std::vector<OracleCase> out;
  for (Device d : {Device::kCpu, Device::kCuda}) {
    for (LayerKind k : {LayerKind::kMamba2, LayerKind::kGdn}) {
      for (CheckpointPrecision p : testing::kAllPrecisions) out.push_back({k, d, p, 1});
      out.push_back({k, d, CheckpointPrecision::kFp32, 4});
      out.push_back({k, d, CheckpointPrecision::kFp32Bf16, 4});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, FoldCadenceOracle, ::testing::ValuesIn(oracle_cases()),
                         ::testing::PrintToStringParamName());

// ---- refusals ----------------------------------------------------------------------------

struct RefusalCase {
  LayerKind kind;
  Device device;
};
void PrintTo(const RefusalCase& c, std::ostream* os) {
  *os << kind_tag(c.kind) << "_" << device_tag(c.device);
}

class FoldCadenceRefusals : public ::testing::TestWithParam<RefusalCase> {};

TEST_P(FoldCadenceRefusals, ACadenceOutOfRangeOrOnAnEagerCacheIsAnErrorAndWritesNothing) {
  const RefusalCase c = GetParam();
  if (c.device == Device::kCuda) SKIP_WITHOUT_GPU();
  StateCacheConfig replay = replay_config(c.kind, c.device, CheckpointPrecision::kFp32, 1);
  replay.num_layers = 1;  // so that a one-layer decode can be committed
  StateCacheConfig eager = replay;
  eager.mode = DecodeMode::kEager;
  struct Bad {
    StateCacheConfig config;
    int fold_every;
  };
  for (const Bad& bad : {Bad{replay, kL + 1}, Bad{replay, -1}, Bad{eager, 2}}) {
    std::unique_ptr<StateCache> cache = testing::create_cache(bad.config);
    const std::int32_t slot = testing::allocate_slot(*cache);
    testing::Rng rng(7);
    with_family_of(bad.config, rng, [&](const auto& family) {
      using Family = std::decay_t<decltype(family)>;
      // A few committed tokens first, so that a wrongly accepted call would fold them.
      for (int step = 0; step < 3; ++step) {
        const typename Family::Call ok = family.call(*cache, 0, {slot}, family.tokens(1, 1, rng));
        ASSERT_TRUE(Family::decode(*cache, ok).is_ok());
        if (bad.config.mode == DecodeMode::kReplay) {
          ASSERT_TRUE(testing::commit(*cache, {slot}, {1}).is_ok());
        }
      }
      const std::vector<std::uint8_t> bytes = testing::slot_bytes(*cache, slot);
      typename Family::Call call = family.call(*cache, 0, {slot}, family.tokens(1, 1, rng));
      call.args.fold_every = bad.fold_every;
      const Status st = Family::decode(*cache, call);
      EXPECT_FALSE(st.is_ok()) << "fold_every " << bad.fold_every << " was accepted";
      EXPECT_NE(st.to_string().find("fold_every"), std::string::npos) << st.to_string();
      EXPECT_EQ(testing::slot_bytes(*cache, slot), bytes) << "a refused call wrote the slot";
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, FoldCadenceRefusals,
                         ::testing::Values(RefusalCase{LayerKind::kMamba2, Device::kCpu},
                                           RefusalCase{LayerKind::kGdn, Device::kCpu},
                                           RefusalCase{LayerKind::kMamba2, Device::kCuda},
                                           RefusalCase{LayerKind::kGdn, Device::kCuda}),
                         ::testing::PrintToStringParamName());

// ---- CUDA against the CPU --------------------------------------------------------------

// Both families' cases in one parameter: the side-by-side driver (cuda_vs_cpu.h) with the
// case's cadence cycle, tolerances as the family suites state them (test_*_cuda.cpp headers;
// fp32 masters only here, so the exported states agree to fp32 rounding order).
struct CudaCase {
  std::string name;
  testing::CudaVsCpuSpec spec;
  double output_tol = 0.0;
};
void PrintTo(const CudaCase& c, std::ostream* os) { *os << c.name; }

template <typename Shape>
CudaCase cuda_case(const testing::SideCase<Shape>& side, std::vector<int> cycle,
                   const char* cycle_name) {
  CudaCase c;
  c.name = kind_tag(testing::side_config(side).kind) + "_" + testing::side_case_name(side) + "_" +
           cycle_name;
  c.spec = testing::side_spec(side, 59, 0.05);
  c.spec.fold_every = std::move(cycle);
  c.spec.output_tol = testing::side_output_tolerance(side, 0.0);
  c.spec.state_tol = std::max(c.spec.output_tol, 1e-4);
  return c;
}

class FoldCadenceCudaVsCpu : public ::testing::TestWithParam<CudaCase> {};

TEST_P(FoldCadenceCudaVsCpu, SameOutputsStatesAndCursors) {
  SKIP_WITHOUT_GPU();
  double worst = 0.0;
  ASSERT_NO_FATAL_FAILURE(testing::compare_cuda_vs_cpu(GetParam().spec, &worst));
  RecordProperty("max_rel_diff", std::to_string(worst));
}

std::vector<CudaCase> cuda_cases() {
  using testing::NamedShape;
  using testing::real_shape_replay;
  std::vector<CudaCase> out;
  const std::vector<int> short_cycle = {4}, mixed = {16, 4, 1, 0, 4, 9};
  constexpr auto kFp32 = CheckpointPrecision::kFp32, kFp32Bf16 = CheckpointPrecision::kFp32Bf16;
  for (CheckpointPrecision p : {kFp32, kFp32Bf16}) {
    // The tuned kernels' small shapes and the generic ones', L = 16, rows staggered.
    for (const auto& shape : {NamedShape<GdnShape>{"small", kGdnSmall},
                              NamedShape<GdnShape>{"odd", GdnShape{2, 6, 20, 7}}}) {
      out.push_back(cuda_case(real_shape_replay(shape, p, 1, 4, 1, 40), mixed, "mixed"));
    }
    for (const auto& shape : {NamedShape<Mamba2Shape>{"small", kMamba2Small},
                              NamedShape<Mamba2Shape>{"generic", Mamba2Shape{6, 20, 64, 3}}}) {
      out.push_back(cuda_case(real_shape_replay(shape, p, 1, 4, 1, 40), mixed, "mixed"));
    }
    // Real layers as a serving engine runs them at small batch: Qwen3.5-4B's GDN folding every
    // 4 tokens (the rule replayssm.models applies there), and verify windows under the mix.
    const NamedShape<GdnShape> qwen4b{"qwen4b", GdnShape{16, 32, 128, 128}};
    out.push_back(cuda_case(real_shape_replay(qwen4b, p, 1, 6, 1, 40), short_cycle, "every4"));
    out.push_back(cuda_case(real_shape_replay(qwen4b, p, 4, 3, 2, 24), mixed, "mixed"));
    const NamedShape<Mamba2Shape> super120b{"super120b", Mamba2Shape{128, 64, 128, 8}};
    out.push_back(cuda_case(real_shape_replay(super120b, p, 1, 4, 1, 40), mixed, "mixed"));
  }
  return out;
}

std::string cuda_case_name(const ::testing::TestParamInfo<CudaCase>& param) {
  return param.param.name;
}

INSTANTIATE_TEST_SUITE_P(Cases, FoldCadenceCudaVsCpu, ::testing::ValuesIn(cuda_cases()),
                         cuda_case_name);

}  // namespace
}  // namespace replayssm
