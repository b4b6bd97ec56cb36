// Replay decoding on CUDA under serving conditions, both layer families: each step's launch
// holds rows that fold beside rows that do not (requests that started at different steps), at
// the small batches where a step is latency (1, 4, 16 rows and a pad row) and at 40 rows,
// where the launches serve the folding rows first (src/cuda/state_cache/fold_order.cuh); a
// replay step is one launch per layer that moves its own fold cursor
// (src/cuda/state_cache/cursors.cuh).
//
// Against the CPU backend on the same inputs: outputs per call (the family tests' tolerances,
// side_case.h), and the cursors bit for bit right after every decode, before its commit: the
// CPU moves `folded` inside its decode, so a CUDA launch that left it (or an arrival count) for
// later differs here. Then a verify that is decoded twice before its commit, which on CUDA
// replaces the window (the first decode's fold must not be repeated), and whole steps captured
// into a CUDA graph (the launches are programmatic: launch.cuh).

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "testing/require_gpu.h"
#include "testing/cuda_test_util.h"
#include "testing/side_case.h"
#include "testing/test_util.h"

namespace replayssm {
namespace {

using testing::Recipe;
using testing::Rng;

const Mamba2Shape kMamba2Small{4, 16, 128, 2};
const Mamba2Shape kMamba2Generic{6, 20, 64, 3};  // dstate 64: the generic kernels
const Mamba2Shape kSuper120b{128, 64, 128, 8};
const Mamba2Shape kNano4b{96, 80, 128, 8};
const GdnShape kGdnSmall{2, 4, 32, 16};
const GdnShape kQwen4b{16, 32, 128, 128};

// ---- the two families behind one interface ---------------------------------------------------

struct Mamba2Side {
  using Shape = Mamba2Shape;
  using Call = testing::Mamba2Call;
  std::vector<testing::Mamba2Layer> params;  // per layer

  Mamba2Side(const Shape& shape, int layers, Rng& rng) {
    for (int l = 0; l < layers; ++l) params.push_back(testing::make_mamba2_layer(shape, Recipe{}, rng));
  }
  struct Tokens {
    testing::Mamba2Tokens t;
  };
  static Tokens tokens(const Shape& s, int rows, int T, DType input, Rng& rng) {
    return {testing::make_mamba2_tokens(s, rows, T, input, true, Recipe{}, rng)};
  }
  Call call(const StateCache& cache, int layer, const std::vector<std::int32_t>& slots,
            const Tokens& tk) const {
    return testing::make_mamba2_call(cache, layer, slots, params[std::size_t(layer)], tk.t);
  }
  static Status decode(StateCache& cache, const Call& c, Stream s = kDefaultStream) {
    return mamba2_decode(cache, c.args, s);
  }
  static std::vector<std::uint8_t> output_bytes(const Call& c) { return c.y.bytes(); }
  static double fp8_tolerance() { return 2e-2; }  // test_mamba2_cuda.cpp
};

struct GdnSide {
  using Shape = GdnShape;
  using Call = testing::GdnCall;

  GdnSide(const Shape&, int, Rng&) {}
  struct Tokens {
    testing::GdnTokens t;
  };
  static Tokens tokens(const Shape& s, int rows, int T, DType input, Rng& rng) {
    return {testing::make_gdn_tokens(s, rows, T, input, Recipe{}, rng)};
  }
  Call call(const StateCache& cache, int layer, const std::vector<std::int32_t>& slots,
            const Tokens& tk) const {
    return testing::make_gdn_call(cache, layer, slots, tk.t, true, 0.0f);
  }
  static Status decode(StateCache& cache, const Call& c, Stream s = kDefaultStream) {
    return gdn_decode(cache, c.args, s);
  }
  static std::vector<std::uint8_t> output_bytes(const Call& c) { return c.o.bytes(); }
  static double fp8_tolerance() { return 2 * 0.0625; }  // test_gdn_cuda.cpp: two fp8 roundings
};

// ---- rows folding beside rows that do not, every cursor after every launch -------------------

template <typename Shape>
struct ServingCase {
  const char* name;
  Shape shape;
  CheckpointPrecision checkpoint;
  DType input = DType::kBF16;
  int batch = 4;
  int window = 1;  // T
  int buffer_len = 4;
  int layers = 2;
};

template <typename Shape>
testing::SideCase<Shape> as_side_case(const ServingCase<Shape>& c) {
  testing::SideCase<Shape> s{c.name, c.shape, DecodeMode::kReplay};
  s.checkpoint = c.checkpoint;
  s.input = c.input;
  s.buffer_len = c.buffer_len;
  s.window = c.window;
  s.batch = c.batch;
  s.layers = c.layers;
  return s;
}

template <typename Shape>
std::string serving_name(const ::testing::TestParamInfo<ServingCase<Shape>>& info) {
  const ServingCase<Shape>& c = info.param;
  return std::string(c.name) + "_" + testing::shape_tag(c.shape) + "_" +
         testing::precision_tag(c.checkpoint) + "_in" + testing::dtype_tag(c.input) + "_B" +
         std::to_string(c.batch) + "_T" + std::to_string(c.window) + "_L" +
         std::to_string(c.buffer_len);
}

// A CPU cache of `cfg` and its CUDA copy, every slot allocated in both (the same ids).
struct CpuGpu {
  std::unique_ptr<StateCache> cpu, gpu;
};
CpuGpu make_cpu_gpu(const StateCacheConfig& cfg) {
  CpuGpu p;
  p.cpu = testing::create_cache(cfg);
  StateCacheConfig gcfg = cfg;
  gcfg.device = Device::kCuda;
  p.gpu = testing::create_cache(gcfg);
  for (int i = 0; i < cfg.capacity; ++i) {
    EXPECT_EQ(testing::allocate_slot(*p.cpu), testing::allocate_slot(*p.gpu));
  }
  return p;
}

// Every cursor of the rows' slots on the GPU equals the CPU's.
void expect_same_cursors(const StateCache& gpu, const StateCache& cpu, int batch, int layers,
                         const std::string& when) {
  for (int r = 0; r < batch; ++r) {
    const int slot = r + 1;
    ASSERT_EQ(testing::cursor_committed(gpu, slot), testing::cursor_committed(cpu, slot))
        << when << ", row " << r;
    ASSERT_EQ(testing::cursor_pending(gpu, slot), testing::cursor_pending(cpu, slot))
        << when << ", row " << r;
    for (int layer = 0; layer < layers; ++layer) {
      ASSERT_EQ(testing::cursor_folded(gpu, layer, slot), testing::cursor_folded(cpu, layer, slot))
          << when << ", layer " << layer << ", row " << r;
    }
  }
}

// Rows in slots 1..batch (slot 0 and the last are guards), plus one pad row. Row r takes its
// first token at step r mod L, so from step L on every launch holds rows at every phase of
// the fold cycle: rows folding and rows not, in one launch, on every step. >= 4L + T steps.
template <typename Side>
void run_serving_case(const ServingCase<typename Side::Shape>& c, double output_tol,
                      double state_tol) {
  const StateCacheConfig cfg = testing::side_config(as_side_case(c));
  CpuGpu caches = make_cpu_gpu(cfg);
  StateCache& cpu = *caches.cpu;
  StateCache& gpu = *caches.gpu;
  Rng rng(71);
  const std::size_t state_elems = std::size_t(cfg.dims().state_elems());
  for (int layer = 0; layer < c.layers; ++layer) {
    for (int r = 0; r < c.batch; ++r) {
      std::vector<float> s(state_elems);
      for (float& v : s) v = float(rng.normal(0.0, 0.1));
      ASSERT_TRUE(state_cache_load_state(cpu, layer, r + 1, s.data()).is_ok());
      ASSERT_TRUE(state_cache_load_state(gpu, layer, r + 1, s.data()).is_ok());
    }
  }
  const std::vector<std::uint8_t> guard_lo = testing::slot_bytes(gpu, 0);
  const std::vector<std::uint8_t> guard_hi = testing::slot_bytes(gpu, cfg.capacity - 1);
  const Side side(c.shape, c.layers, rng);
  const int rows = c.batch + 1;
  const int steps = 4 * c.buffer_len + c.window + 2;
  int fold_launches = 0;  // launches in which some rows folded and others did not
  for (int step = 0; step < steps; ++step) {
    std::vector<std::int32_t> slots(std::size_t(rows), -1);
    for (int r = 0; r < c.batch; ++r) {
      if (step >= r % c.buffer_len) slots[std::size_t(r)] = r + 1;
    }
    // Which rows fold in this step's launches (committed − folded >= L, the same in every layer).
    int folding = 0, plain = 0;
    for (int r = 0; r < c.batch; ++r) {
      if (slots[std::size_t(r)] < 0) continue;
      const std::uint32_t unfolded = testing::cursor_committed(cpu, r + 1) -
                                     testing::cursor_folded(cpu, 0, r + 1);
      (unfolded >= std::uint32_t(c.buffer_len) ? folding : plain) += 1;
    }
    if (folding > 0 && plain > 0) ++fold_launches;
    for (int layer = 0; layer < c.layers; ++layer) {
      const auto tk = Side::tokens(c.shape, rows, c.window, c.input, rng);
      const auto cc = side.call(cpu, layer, slots, tk);
      const auto gc = side.call(gpu, layer, slots, tk);
      ASSERT_TRUE(Side::decode(cpu, cc).is_ok());
      const Status st = Side::decode(gpu, gc);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      const std::vector<float> oc = cc.output(), og = gc.output();
      const std::size_t per_row = og.size() / std::size_t(rows);
      for (int r = 0; r < rows; ++r) {
        const std::size_t b = std::size_t(r) * per_row, e = b + per_row;
        if (slots[std::size_t(r)] < 0) {
          ASSERT_TRUE(std::all_of(og.begin() + b, og.begin() + e,
                                  [](float v) { return std::isnan(v); }))
              << "step " << step << ": pad row " << r << "'s output was written";
          continue;
        }
        ASSERT_LE(testing::max_rel_diff(og, oc, b, e), output_tol)
            << "step " << step << " layer " << layer << " row " << r;
      }
      // The single launch has moved this layer's fold cursor, as the CPU decode did.
      ASSERT_NO_FATAL_FAILURE(expect_same_cursors(
          gpu, cpu, c.batch, c.layers,
          "step " + std::to_string(step) + " after layer " + std::to_string(layer)));
    }
    std::vector<std::int32_t> accepted(std::size_t(rows), 0);
    for (int r = 0; r < c.batch; ++r) {
      if (slots[std::size_t(r)] >= 0) {
        accepted[std::size_t(r)] = c.window == 1 ? 1 : rng.uniform_int(0, c.window);
      }
    }
    ASSERT_TRUE(testing::commit(cpu, slots, accepted).is_ok());
    ASSERT_TRUE(testing::commit(gpu, slots, accepted).is_ok());
    ASSERT_NO_FATAL_FAILURE(expect_same_cursors(gpu, cpu, c.batch, c.layers,
                                                "step " + std::to_string(step) + " commit"));
  }
  if (c.batch > 1) {
    EXPECT_GE(fold_launches, 2) << "no launch mixed folding and plain rows";
  }
  // An explicit fold of every row (one launch per layer), then the materialised states.
  std::vector<std::int32_t> all;
  for (int r = 0; r < c.batch; ++r) all.push_back(r + 1);
  ASSERT_TRUE(testing::fold(cpu, all).is_ok());
  ASSERT_TRUE(testing::fold(gpu, all).is_ok());
  ASSERT_NO_FATAL_FAILURE(expect_same_cursors(gpu, cpu, c.batch, c.layers, "explicit fold"));
  EXPECT_EQ(testing::slot_bytes(gpu, 0), guard_lo) << "guard slot written";
  EXPECT_EQ(testing::slot_bytes(gpu, cfg.capacity - 1), guard_hi) << "guard slot written";
  for (int layer = 0; layer < c.layers; ++layer) {
    for (int r = 0; r < c.batch; ++r) {
      std::vector<float> sc, sg;
      ASSERT_TRUE(testing::export_state(cpu, layer, r + 1, &sc).is_ok());
      ASSERT_TRUE(testing::export_state(gpu, layer, r + 1, &sg).is_ok());
      EXPECT_LE(testing::max_rel_diff(sg, sc, 0, state_elems), state_tol)
          << "layer " << layer << " row " << r;
    }
  }
}

// Exported-state tolerances as the family tests': the fp32 master to rounding order, a shared
// bf16 master to a few flipped elements.
double state_tolerance(CheckpointPrecision p, double output_tol) {
  return p == CheckpointPrecision::kBf16 ? std::max(1.6e-2, output_tol) : 1e-4;
}

template <typename Shape>
std::vector<ServingCase<Shape>> serving_cases(const char* small_name, const Shape& small,
                                              const Shape& real) {
  std::vector<ServingCase<Shape>> out;
  for (CheckpointPrecision p : testing::kAllPrecisions) {
    for (int batch : {1, 4, 16}) {
      out.push_back({small_name, small, p, DType::kBF16, batch, 1, 4, 2});
    }
    out.push_back({small_name, small, p, DType::kF32, 16, 1, 5, 2});  // f32: the 3-term fold
    out.push_back({small_name, small, p, DType::kBF16, 16, 4, 5, 2});  // verifies, k ~ U{0..4}
    out.push_back({"real", real, p, DType::kBF16, 16, 1, 16, 1});
    // Past kFoldFirstMinBatch of both families: the launches order their rows fold-first
    // (state_cache/fold_order.cuh), with rows that have not started yet as pad rows.
    out.push_back({small_name, small, p, DType::kBF16, 40, 1, 4, 2});
    out.push_back({small_name, small, p, DType::kBF16, 40, 4, 4, 1});
  }
  return out;
}

using Mamba2Case = ServingCase<Mamba2Shape>;
class Mamba2Serving : public ::testing::TestWithParam<Mamba2Case> {};

TEST_P(Mamba2Serving, OneLaunchPerLayerMatchesCpuWithMixedFolds) {
  SKIP_WITHOUT_GPU();
  const Mamba2Case c = GetParam();
  const double tol = testing::side_output_tolerance(as_side_case(c), Mamba2Side::fp8_tolerance());
  run_serving_case<Mamba2Side>(c, tol, state_tolerance(c.checkpoint, tol));
}

std::vector<Mamba2Case> mamba2_cases() {
  std::vector<Mamba2Case> out = serving_cases("small", kMamba2Small, kSuper120b);
  for (CheckpointPrecision p : testing::kAllPrecisions) {
    out.push_back({"generic", kMamba2Generic, p, DType::kBF16, 16, 1, 4, 2});
    // Small batches of real shapes: a folding row takes finer runs of heads than a reading
    // one (super120b at batch 4: 1 and 2; nano4b at 16: 2 and 6, which do not nest).
    out.push_back({"real", kSuper120b, p, DType::kBF16, 4, 1, 16, 1});
    out.push_back({"nano4b", kNano4b, p, DType::kBF16, 16, 1, 16, 1});
    out.push_back({"nano4b", kNano4b, p, DType::kF32, 4, 4, 8, 1});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, Mamba2Serving, ::testing::ValuesIn(mamba2_cases()),
                         serving_name<Mamba2Shape>);

using GdnCase = ServingCase<GdnShape>;
class GdnServing : public ::testing::TestWithParam<GdnCase> {};

TEST_P(GdnServing, OneLaunchPerLayerMatchesCpuWithMixedFolds) {
  SKIP_WITHOUT_GPU();
  const GdnCase c = GetParam();
  const double tol = testing::side_output_tolerance(as_side_case(c), GdnSide::fp8_tolerance());
  run_serving_case<GdnSide>(c, tol, state_tolerance(c.checkpoint, tol));
}

INSTANTIATE_TEST_SUITE_P(Cases, GdnServing,
                         ::testing::ValuesIn(serving_cases("small", kGdnSmall, kQwen4b)),
                         serving_name<GdnShape>);

// ---- a window decoded twice before its commit --------------------------------------------------

// On CUDA a second decode of a layer before the commit replaces the window (the CPU refuses it).
// The first decode folded (its launch moved `folded`), so the second must not fold again: its
// outputs, cursors and state equal a CPU cache's that decoded only the second window.
template <typename Side>
void expect_second_decode_replaces_window(const typename Side::Shape& shape) {
  for (CheckpointPrecision p : testing::kAllPrecisions) {
    SCOPED_TRACE(checkpoint_precision_name(p));
    ServingCase<typename Side::Shape> c{"twice", shape, p, DType::kF32, 3, 2, 3, 1};
    CpuGpu caches = make_cpu_gpu(testing::side_config(as_side_case(c)));
    StateCache& cpu = *caches.cpu;
    StateCache& gpu = *caches.gpu;
    Rng rng(5);
    const Side side(shape, 1, rng);
    const std::vector<std::int32_t> slots = {1, 2, 3, -1};
    // Two steps of two tokens: 4 >= L = 3 committed, so the next decode folds.
    for (int step = 0; step < 2; ++step) {
      const auto tk = Side::tokens(shape, 4, 2, c.input, rng);
      const auto cc = side.call(cpu, 0, slots, tk);
      const auto gc = side.call(gpu, 0, slots, tk);
      ASSERT_TRUE(Side::decode(cpu, cc).is_ok());
      ASSERT_TRUE(Side::decode(gpu, gc).is_ok());
      ASSERT_TRUE(testing::commit(cpu, slots, {2, 2, 2, 0}).is_ok());
      ASSERT_TRUE(testing::commit(gpu, slots, {2, 2, 2, 0}).is_ok());
    }
    const auto first = Side::tokens(shape, 4, 2, c.input, rng);
    const auto second = Side::tokens(shape, 4, 2, c.input, rng);
    const auto g1 = side.call(gpu, 0, slots, first);
    ASSERT_TRUE(Side::decode(gpu, g1).is_ok());
    const auto g2 = side.call(gpu, 0, slots, second);
    ASSERT_TRUE(Side::decode(gpu, g2).is_ok());
    const auto c2 = side.call(cpu, 0, slots, second);
    ASSERT_TRUE(Side::decode(cpu, c2).is_ok());
    const double tol =
        testing::side_output_tolerance(as_side_case(c), Side::fp8_tolerance());
    const std::vector<float> og = g2.output(), oc = c2.output();
    EXPECT_LE(testing::max_rel_diff(og, oc, 0, oc.size() * 3 / 4), tol);
    ASSERT_NO_FATAL_FAILURE(expect_same_cursors(gpu, cpu, 3, 1, "second decode"));
    ASSERT_TRUE(testing::commit(cpu, slots, {1, 2, 0, 0}).is_ok());
    ASSERT_TRUE(testing::commit(gpu, slots, {1, 2, 0, 0}).is_ok());
    ASSERT_NO_FATAL_FAILURE(expect_same_cursors(gpu, cpu, 3, 1, "commit"));
    for (int r = 0; r < 3; ++r) {
      std::vector<float> sc, sg;
      ASSERT_TRUE(testing::export_state(cpu, 0, r + 1, &sc).is_ok());
      ASSERT_TRUE(testing::export_state(gpu, 0, r + 1, &sg).is_ok());
      EXPECT_LE(testing::max_rel_diff(sg, sc, 0, sc.size()), state_tolerance(p, tol))
          << "row " << r;
    }
  }
}

TEST(Mamba2Serving, ASecondDecodeBeforeTheCommitReplacesTheWindow) {
  SKIP_WITHOUT_GPU();
  expect_second_decode_replaces_window<Mamba2Side>(kMamba2Small);
}

TEST(GdnServing, ASecondDecodeBeforeTheCommitReplacesTheWindow) {
  SKIP_WITHOUT_GPU();
  expect_second_decode_replaces_window<GdnSide>(kGdnSmall);
}

// ---- whole steps in a CUDA graph, at the small batches --------------------------------------

// Rows at different fold phases (pre-advanced eagerly), then every layer's decode and the
// commit captured once and replayed: the graph's programmatic edges give the same bytes as
// issuing the calls on a stream, folds falling due inside the replays.
template <typename Side>
void expect_graph_with_mixed_folds(const typename Side::Shape& shape, int batch) {
  for (CheckpointPrecision p : {CheckpointPrecision::kFp32, CheckpointPrecision::kFp32Bf16}) {
    SCOPED_TRACE(checkpoint_precision_name(p));
    ServingCase<typename Side::Shape> c{"graph", shape, p, DType::kBF16, batch, 1, 4, 2};
    StateCacheConfig cfg = testing::side_config(as_side_case(c));
    cfg.device = Device::kCuda;
    std::unique_ptr<StateCache> direct = testing::create_cache(cfg);
    std::unique_ptr<StateCache> graphed = testing::create_cache(cfg);
    std::vector<std::int32_t> slots;
    for (int i = 0; i < batch; ++i) {
      slots.push_back(testing::allocate_slot(*direct));
      ASSERT_EQ(testing::allocate_slot(*graphed), slots.back());
    }
    slots.push_back(-1);
    Rng rng(13);
    const Side side(shape, cfg.num_layers, rng);
    // Row r is r mod L tokens ahead in both caches.
    for (int j = 0; j + 1 < cfg.buffer_len; ++j) {
      std::vector<std::int32_t> ids = slots;
      for (int r = 0; r < batch; ++r) {
        if (r % cfg.buffer_len <= j) ids[std::size_t(r)] = -1;
      }
      const std::vector<std::int32_t> ones(ids.size(), 1);
      for (int layer = 0; layer < cfg.num_layers; ++layer) {
        const auto tk = Side::tokens(shape, int(ids.size()), 1, c.input, rng);
        for (StateCache* cache : {direct.get(), graphed.get()}) {
          ASSERT_TRUE(Side::decode(*cache, side.call(*cache, layer, ids, tk)).is_ok());
        }
      }
      for (StateCache* cache : {direct.get(), graphed.get()}) {
        ASSERT_TRUE(testing::commit(*cache, ids, ones).is_ok());
      }
    }
    std::vector<typename Side::Call> direct_calls, graph_calls;
    for (int layer = 0; layer < cfg.num_layers; ++layer) {
      const auto tk = Side::tokens(shape, int(slots.size()), 1, c.input, rng);
      direct_calls.push_back(side.call(*direct, layer, slots, tk));
      graph_calls.push_back(side.call(*graphed, layer, slots, tk));
    }
    std::vector<std::int32_t> accepted(slots.size(), 1);
    accepted.back() = 0;
    ASSERT_NO_FATAL_FAILURE(testing::expect_graph_matches_stream(
        *direct, *graphed, slots, accepted, direct_calls, graph_calls, 9,
        [](StateCache& cache, const typename Side::Call& call, Stream s) {
          return Side::decode(cache, call, s);
        },
        [](const typename Side::Call& call) { return Side::output_bytes(call); }));
  }
}

TEST(Mamba2Serving, GraphCapturedStepsWithMixedFoldsAtSmallBatches) {
  SKIP_WITHOUT_GPU();
  for (int batch : {1, 4, 16, 40}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    expect_graph_with_mixed_folds<Mamba2Side>(kMamba2Small, batch);
  }
}

TEST(GdnServing, GraphCapturedStepsWithMixedFoldsAtSmallBatches) {
  SKIP_WITHOUT_GPU();
  for (int batch : {1, 4, 16, 40}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    expect_graph_with_mixed_folds<GdnSide>(kGdnSmall, batch);
  }
}

}  // namespace
}  // namespace replayssm
