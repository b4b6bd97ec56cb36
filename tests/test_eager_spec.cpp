// Eager caches with max_spec_tokens T > 1 (per-draft-state speculation): a window reads the
// current state copy once and writes the state after each token into its own copy; commit(k)
// selects the copy after token k. Both families, fp32 and bf16 state, on the CPU and (cases
// named "Cuda", label `cuda`) on the GPU:
//   - against the float64 oracle over many windows with random acceptance k ~ U{0..T}, rows
//     joining at different steps, guard and free slots untouched; the exported state after the
//     run is the oracle's after the accepted prefixes; outputs at accepted positions equal a
//     plain (T = 1, in-place) cache fed the accepted stream (bit for bit for fp32 state on the
//     CPU: the window carries the fp32 state from token to token as plain decoding does);
//   - k single-token windows equal one k-token window (a narrower window on a wide cache);
//   - data movement, bit-exact: a window never writes the current copy, a commit moves no state
//     (only the cursors), commit(0) leaves the exported state as it was;
//   - refusals write nothing; on CUDA a second window before commit replaces the first;
//   - the CUDA backend against the CPU backend, at small, generic and real shapes.

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "testing/family.h"
#include "testing/family_cases.h"
#include "testing/require_gpu.h"
#include "testing/side_case.h"
#include "testing/test_util.h"

namespace replayssm {
namespace {

using testing::device_tag;
using testing::dtype_tag;
using testing::int_tag;
using testing::kind_tag;

constexpr double kFp32Tol = 1e-5;
constexpr double kFloor = 1e-6;  // slack over twice the naive loop's error
const double kBf16U = std::ldexp(1.0, -8);

// Shapes: "small" takes the tuned CUDA kernels (Mamba-2 dstate 128; GDN K a multiple of 16),
// "odd" the generic ones, with no power of two where the family allows it.
Mamba2Shape mamba2_shape(bool odd) {
  return odd ? Mamba2Shape{6, 5, 7, 3} : Mamba2Shape{4, 16, 128, 2};
}
GdnShape gdn_shape(bool odd) { return odd ? GdnShape{2, 6, 20, 7} : GdnShape{2, 4, 32, 16}; }

StateCacheConfig eager_config(LayerKind kind, bool odd, Device device, DType state, DType input,
                              int T) {
  StateCacheConfig c;
  c.kind = kind;
  c.mamba2 = mamba2_shape(odd);
  c.gdn = gdn_shape(odd);
  c.device = device;
  c.mode = DecodeMode::kEager;
  c.state_dtype = state;
  c.input_dtype = input;
  c.max_spec_tokens = T;
  c.num_layers = 2;
  c.capacity = 4;
  return c;
}


// ---- against the float64 oracle ----------------------------------------------------------

struct OracleCase {
  LayerKind kind;
  Device device;
  bool odd;    // the generic CUDA kernels' shape
  DType state;
  DType input;
  int T;       // max_spec_tokens
  int window;  // the width of every decode (<= T)
};
void PrintTo(const OracleCase& c, std::ostream* os) {
  *os << kind_tag(c.kind) << "_" << device_tag(c.device) << (c.odd ? "_Odd" : "_Small")
      << "_State" << dtype_tag(c.state) << "_In" << dtype_tag(c.input) << int_tag("_T", c.T)
      << int_tag("_W", c.window);
}

class EagerSpecOracle : public ::testing::TestWithParam<OracleCase> {};

TEST_P(EagerSpecOracle, MatchesOracleAndPlainDecodingOnTheAcceptedStream) {
  const OracleCase c = GetParam();
  if (c.device == Device::kCuda) SKIP_WITHOUT_GPU();
  testing::RunSpec spec;
  spec.cache = eager_config(c.kind, c.odd, c.device, c.state, c.input, c.T);
  spec.batch = 3;
  spec.steps = 48;
  spec.stagger = 4;
  spec.seed = 2024 + std::uint64_t(c.T);
  spec.window = c.window;
  spec.gate = true;
  spec.naive = true;
  spec.naive_state_dtype = c.state;
  spec.compare_plain = c.window > 1;
  spec.guard_slots = 2;
  const testing::RunResult r = testing::run_oracle(spec);
  ASSERT_EQ(r.failure, "");
  ASSERT_EQ(r.step_error.size(), std::size_t(spec.steps));
  EXPECT_GT(r.tokens_committed, 0);
  if (c.state == DType::kF32 && c.input == DType::kF32) {
    EXPECT_LE(r.max_error, kFp32Tol);
    EXPECT_LE(r.export_error, kFp32Tol);
    // The same arithmetic as plain decoding: on the CPU the same bits.
    if (spec.compare_plain) {
      EXPECT_LE(r.plain_max_error, c.device == Device::kCpu ? 0.0 : 1e-6);
    }
  } else {
    testing::expect_within_naive(r, kFloor);
    // bf16 state: plain decoding rounds the state after every token, a window carries it in
    // fp32 and rounds only the copies it stores, so the two runs drift apart by roundings: no
    // more than the naive same-precision loop drifts from the oracle, twice over. bf16 inputs:
    // the outputs' own rounding.
    if (spec.compare_plain) {
      EXPECT_LE(r.plain_max_error, 2 * r.naive_max_error + kFloor);
    }
    EXPECT_LE(r.export_error, c.state == DType::kF32 ? kFp32Tol : 8 * kBf16U);
  }
}

std::vector<OracleCase> oracle_cases() {
  std::vector<OracleCase> out;
  constexpr auto kF32 = DType::kF32, kBF16 = DType::kBF16;
  for (Device device : {Device::kCpu, Device::kCuda}) {
    for (LayerKind kind : {LayerKind::kMamba2, LayerKind::kGdn}) {
      for (bool odd : {false, true}) {
        out.push_back({kind, device, odd, kF32, kF32, 4, 4});
        out.push_back({kind, device, odd, kBF16, kF32, 4, 4});
      }
      out.push_back({kind, device, false, kF32, kF32, 2, 2});
      out.push_back({kind, device, false, kF32, kF32, 8, 8});
      out.push_back({kind, device, false, kF32, kF32, 5, 3});  // narrower than the cache's T
      out.push_back({kind, device, false, kF32, kBF16, 4, 4});
      out.push_back({kind, device, false, kBF16, kBF16, 3, 3});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, EagerSpecOracle, ::testing::ValuesIn(oracle_cases()),
                         ::testing::PrintToStringParamName());

// ---- k single-token windows = one k-token window -----------------------------------------

struct WindowCase {
  LayerKind kind;
  Device device;
  int T;
};
void PrintTo(const WindowCase& c, std::ostream* os) {
  *os << kind_tag(c.kind) << "_" << device_tag(c.device) << int_tag("_T", c.T);
}

class EagerSpecWindow : public ::testing::TestWithParam<WindowCase> {};

TEST_P(EagerSpecWindow, EqualsSingleTokenWindows) {
  const WindowCase c = GetParam();
  if (c.device == Device::kCuda) SKIP_WITHOUT_GPU();
  StateCacheConfig config = eager_config(c.kind, false, c.device, DType::kF32, DType::kF32, c.T);
  config.num_layers = 1;  // the pair decodes layer 0
  // L only sets the number of rounds here (eager caches do not fold).
  testing::expect_window_equals_single_steps(config, {c.T, 3}, 77,
                                             c.device == Device::kCpu ? 0.0 : 1e-6);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, EagerSpecWindow,
    ::testing::Values(WindowCase{LayerKind::kMamba2, Device::kCpu, 2},
                      WindowCase{LayerKind::kMamba2, Device::kCpu, 7},
                      WindowCase{LayerKind::kGdn, Device::kCpu, 2},
                      WindowCase{LayerKind::kGdn, Device::kCpu, 7},
                      WindowCase{LayerKind::kMamba2, Device::kCuda, 4},
                      WindowCase{LayerKind::kGdn, Device::kCuda, 4}),
    ::testing::PrintToStringParamName());

// ---- data movement and refusals ------------------------------------------------------------

struct KindDevice {
  LayerKind kind;
  Device device;
};
void PrintTo(const KindDevice& c, std::ostream* os) {
  *os << kind_tag(c.kind) << "_" << device_tag(c.device);
}

// One cache with two rows loaded with random states, and the family to decode it with.
template <typename Family>
struct Bench {
  static constexpr int kT = 3;
  StateCacheConfig cfg;
  std::unique_ptr<StateCache> cache;
  std::vector<std::int32_t> slots;
  testing::Rng rng{5};
  Family family;
  std::vector<std::vector<float>> loaded;  // [layer·2 + row]

  explicit Bench(const KindDevice& c)
      : cfg(eager_config(c.kind, false, c.device, DType::kF32, DType::kF32, kT)),
        cache(testing::create_cache(cfg)),
        family(settings(cfg), rng) {
    testing::allocate_slot(*cache);  // slot 0 stays a guard
    slots = {std::int32_t(testing::allocate_slot(*cache)),
             std::int32_t(testing::allocate_slot(*cache))};
    for (int layer = 0; layer < cfg.num_layers; ++layer) {
      for (std::int32_t s : slots) {
        std::vector<float> st(std::size_t(cfg.dims().state_elems()));
        for (float& v : st) v = float(rng.normal(0.0, 0.5));
        testing::throw_if_error(state_cache_load_state(*cache, layer, s, st.data()), "load");
        loaded.push_back(std::move(st));
      }
    }
  }
  static testing::FamilySettings settings(const StateCacheConfig& c) {
    testing::FamilySettings s;
    s.cache = c;
    s.gate = true;
    return s;
  }
  Status decode(int layer, const std::vector<std::int32_t>& ids, int T) {
    const auto tk = family.tokens(int(ids.size()), T, rng);
    const auto call = family.call(*cache, layer, ids, tk);
    return Family::decode(*cache, call);
  }
  Status decode_all(int T) {
    for (int layer = 0; layer < cfg.num_layers; ++layer) {
      REPLAYSSM_RETURN_IF_ERROR(decode(layer, slots, T));
    }
    return Status::ok();
  }
  std::vector<float> exported(int layer, int row) {
    std::vector<float> s;
    testing::throw_if_error(testing::export_state(*cache, layer, slots[std::size_t(row)], &s),
                            "export");
    return s;
  }
};

template <typename F>
void with_bench(const KindDevice& c, F&& f) {
  testing::with_family(c.kind, [&](auto family) {
    Bench<typename decltype(family)::type> b(c);
    f(b);
  });
}

class EagerSpecMovement : public ::testing::TestWithParam<KindDevice> {};

// The current copy is only read by a window, and a commit moves no state: the state buffer is
// the same bytes before and after it, only the cursors and the current-copy index change;
// commit(0) keeps the loaded state as the exported one, bit for bit.
TEST_P(EagerSpecMovement, AWindowNeverWritesTheCurrentCopyAndCommitMovesNoState) {
  const KindDevice c = GetParam();
  if (c.device == Device::kCuda) SKIP_WITHOUT_GPU();
  with_bench(c, [&](auto& b) {
    for (int round = 0; round < 4; ++round) {
      SCOPED_TRACE("round " + std::to_string(round));
      const testing::CacheBytes before_decode = testing::snapshot(*b.cache);
      ASSERT_TRUE(b.decode_all(b.kT).is_ok());
      for (int layer = 0; layer < b.cfg.num_layers; ++layer) {
        for (int row = 0; row < 2; ++row) {
          EXPECT_EQ(b.exported(layer, row), b.loaded[std::size_t(layer * 2 + row)]);
        }
      }
      const testing::CacheBytes after_decode = testing::snapshot(*b.cache);
      EXPECT_EQ(after_decode["state_current"], before_decode["state_current"]);
      EXPECT_EQ(after_decode["committed"], before_decode["committed"]);
      const testing::CacheBytes before_commit = testing::snapshot(*b.cache, {"state"});
      // Row 0 rejects every draft; row 1 accepts round % 4 tokens (0 on round 0).
      const std::vector<std::int32_t> accepted = {0, round % (b.kT + 1)};
      ASSERT_TRUE(testing::commit(*b.cache, b.slots, accepted).is_ok());
      EXPECT_EQ(testing::diff(before_commit, testing::snapshot(*b.cache, {"state"})), "");
      EXPECT_EQ(testing::cursor_pending(*b.cache, b.slots[0]), 0);
      for (int layer = 0; layer < b.cfg.num_layers; ++layer) {
        EXPECT_EQ(b.exported(layer, 0), b.loaded[std::size_t(layer * 2)]) << "commit(0)";
        b.loaded[std::size_t(layer * 2 + 1)] = b.exported(layer, 1);
      }
    }
  });
}

class EagerSpecRefusals : public ::testing::TestWithParam<KindDevice> {};

// Every refused call returns an error with a message and changes no byte of the cache.
TEST_P(EagerSpecRefusals, WriteNothing) {
  const KindDevice c = GetParam();
  if (c.device == Device::kCuda) SKIP_WITHOUT_GPU();
  with_bench(c, [&](auto& b) {
    const bool cpu = c.device == Device::kCpu;
    auto expect_refused = [&](const std::string& what, const std::function<Status()>& call) {
      SCOPED_TRACE(what);
      const testing::CacheBytes before = testing::snapshot(*b.cache);
      const Status st = call();
      EXPECT_FALSE(st.is_ok());
      EXPECT_FALSE(st.message().empty());
      EXPECT_EQ(testing::diff(before, testing::snapshot(*b.cache)), "");
    };
    expect_refused("window wider than max_spec_tokens", [&] { return b.decode(0, b.slots, 4); });
    if (cpu) {  // device-resident slot ids are skipped on the device, not refused
      expect_refused("slot out of range", [&] { return b.decode(0, {b.slots[0], 9}, 2); });
      expect_refused("slot not allocated", [&] { return b.decode(0, {b.slots[0], 3}, 2); });
      expect_refused("slot twice", [&] { return b.decode(0, {b.slots[0], b.slots[0]}, 2); });
    }
    ASSERT_TRUE(b.decode(0, b.slots, 2).is_ok());
    if (cpu) {
      expect_refused("second window before commit", [&] { return b.decode(0, b.slots, 1); });
      expect_refused("commit before every layer decoded",
                     [&] { return testing::commit(*b.cache, b.slots, {1, 1}); });
    }
    std::vector<float> state(std::size_t(b.cfg.dims().state_elems()), 0.5f);
    expect_refused("load while a window is uncommitted", [&] {
      return state_cache_load_state(*b.cache, 0, b.slots[0], state.data());
    });
    ASSERT_TRUE(b.decode(1, b.slots, 2).is_ok());
    if (cpu) {
      expect_refused("commit past the window",
                     [&] { return testing::commit(*b.cache, b.slots, {1, 3}); });
      expect_refused("negative commit",
                     [&] { return testing::commit(*b.cache, b.slots, {-1, 1}); });
    }
    ASSERT_TRUE(testing::commit(*b.cache, b.slots, {2, 1}).is_ok());
  });
}

// On CUDA a second window before commit replaces the first (ops.h): the state committed after
// it is the one the second window's accepted prefix gives from the committed state, as a CPU
// cache that decoded only the second window has it.
TEST(EagerSpecCuda, ASecondWindowBeforeCommitReplacesTheFirst) {
  SKIP_WITHOUT_GPU();
  for (LayerKind kind : {LayerKind::kMamba2, LayerKind::kGdn}) {
    SCOPED_TRACE(kind_tag(kind));
    testing::with_family(kind, [&](auto fam) {
      using Family = typename decltype(fam)::type;
      Bench<Family> gpu(KindDevice{kind, Device::kCuda});
      Bench<Family> cpu(KindDevice{kind, Device::kCpu});  // the same seeds: the same states
      for (int layer = 0; layer < gpu.cfg.num_layers; ++layer) {
        const auto first = gpu.family.tokens(2, 3, gpu.rng);
        const auto second = gpu.family.tokens(2, 3, gpu.rng);
        // Each call's inputs live until its decode has run (device copies are freed on return).
        auto run = [&](auto& bench, const auto& tokens) {
          const auto call = bench.family.call(*bench.cache, layer, bench.slots, tokens);
          return Family::decode(*bench.cache, call);
        };
        ASSERT_TRUE(run(gpu, first).is_ok());
        ASSERT_TRUE(run(gpu, second).is_ok());
        ASSERT_TRUE(run(cpu, second).is_ok());
      }
      ASSERT_TRUE(testing::commit(*gpu.cache, gpu.slots, {2, 3}).is_ok());
      ASSERT_TRUE(testing::commit(*cpu.cache, cpu.slots, {2, 3}).is_ok());
      for (int layer = 0; layer < gpu.cfg.num_layers; ++layer) {
        for (int row = 0; row < 2; ++row) {
          const std::vector<float> g = gpu.exported(layer, row), c = cpu.exported(layer, row);
          EXPECT_LE(testing::max_rel_diff(g, c, 0, g.size()), kFp32Tol);
          EXPECT_NE(g, gpu.loaded[std::size_t(layer * 2 + row)]);
        }
      }
    });
  }
}

const KindDevice kKindDevices[] = {{LayerKind::kMamba2, Device::kCpu},
                                   {LayerKind::kGdn, Device::kCpu},
                                   {LayerKind::kMamba2, Device::kCuda},
                                   {LayerKind::kGdn, Device::kCuda}};
INSTANTIATE_TEST_SUITE_P(Cases, EagerSpecMovement, ::testing::ValuesIn(kKindDevices),
                         ::testing::PrintToStringParamName());
INSTANTIATE_TEST_SUITE_P(Cases, EagerSpecRefusals, ::testing::ValuesIn(kKindDevices),
                         ::testing::PrintToStringParamName());

// ---- the CUDA backend against the CPU backend -----------------------------------------------

template <typename Shape>
void add_window_cases(const testing::NamedShape<Shape>& shape, std::initializer_list<DType> states,
                      std::initializer_list<DType> inputs, int T,
                      std::vector<testing::SideCase<Shape>>* out) {
  for (DType state : states) {
    for (DType input : inputs) {
      testing::SideCase<Shape> c{shape.name, shape.shape, DecodeMode::kEager};
      c.state = state;
      c.input = input;
      c.window = T;
      c.steps = 16;
      c.stagger = 2;
      out->push_back(c);
    }
  }
}

// The exported state: fp32 but for a bf16 state, whose elements can round the other way and
// then evolve apart by a few ulps (as the eager cases of test_mamba2_cuda.cpp).
template <typename Shape>
double state_tolerance(const testing::SideCase<Shape>& c) {
  return c.state == DType::kF32 ? 1e-4 : 1.6e-2;
}

template <typename Shape>
void compare(const testing::SideCase<Shape>& c) {
  testing::CudaVsCpuSpec spec = testing::side_spec(c, 31, 0.5);
  spec.gate = true;
  spec.output_tol = testing::side_output_tolerance(c, 2e-2);
  spec.state_tol = state_tolerance(c);
  double worst = 0.0;
  ASSERT_NO_FATAL_FAILURE(testing::compare_cuda_vs_cpu(spec, &worst));
}

using Mamba2Side = testing::SideCase<Mamba2Shape>;
using GdnSide = testing::SideCase<GdnShape>;
class EagerSpecCudaVsCpuMamba2 : public ::testing::TestWithParam<Mamba2Side> {};
class EagerSpecCudaVsCpuGdn : public ::testing::TestWithParam<GdnSide> {};

TEST_P(EagerSpecCudaVsCpuMamba2, SameOutputsStatesAndCursors) {
  SKIP_WITHOUT_GPU();
  compare(GetParam());
}
TEST_P(EagerSpecCudaVsCpuGdn, SameOutputsStatesAndCursors) {
  SKIP_WITHOUT_GPU();
  compare(GetParam());
}

std::vector<Mamba2Side> mamba2_side_cases() {
  std::vector<Mamba2Side> out;
  constexpr auto kF32 = DType::kF32, kBF16 = DType::kBF16;
  add_window_cases<Mamba2Shape>({"small", mamba2_shape(false)}, {kF32, kBF16}, {kF32, kBF16}, 4,
                                &out);
  add_window_cases<Mamba2Shape>({"oddrows", {6, 20, 128, 3}}, {kF32}, {kF32}, 8, &out);
  add_window_cases<Mamba2Shape>({"odd", mamba2_shape(true)}, {kF32, kBF16}, {kF32}, 3, &out);
  add_window_cases<Mamba2Shape>({"nano4b", {96, 80, 128, 8}}, {kF32}, {kBF16}, 4, &out);
  return out;
}
std::vector<GdnSide> gdn_side_cases() {
  std::vector<GdnSide> out;
  constexpr auto kF32 = DType::kF32, kBF16 = DType::kBF16;
  add_window_cases<GdnShape>({"small", gdn_shape(false)}, {kF32, kBF16}, {kF32, kBF16}, 4, &out);
  add_window_cases<GdnShape>({"oddrows", {2, 6, 16, 7}}, {kF32}, {kF32}, 8, &out);
  add_window_cases<GdnShape>({"odd", gdn_shape(true)}, {kF32, kBF16}, {kF32}, 3, &out);
  add_window_cases<GdnShape>({"qwen4b", {16, 32, 128, 128}}, {kF32}, {kBF16}, 4, &out);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, EagerSpecCudaVsCpuMamba2, ::testing::ValuesIn(mamba2_side_cases()),
                         testing::side_name<Mamba2Shape>);
INSTANTIATE_TEST_SUITE_P(Cases, EagerSpecCudaVsCpuGdn, ::testing::ValuesIn(gdn_side_cases()),
                         testing::side_name<GdnShape>);

}  // namespace
}  // namespace replayssm
