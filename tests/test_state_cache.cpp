// The state cache's data movement, bit-exact: a verify that commits nothing, pad rows, guard
// slots, every rejected call writing nothing, the slot lifecycle, load/export/fold.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "common/numeric.h"
#include "cpu/reference.h"
#include "testing/test_util.h"

namespace replayssm {
namespace {

using testing::CacheBytes;
using testing::dtype_tag;
using testing::kind_tag;
using testing::mode_tag;
using testing::precision_tag;
using testing::Rng;

const Mamba2Shape kM2{4, 8, 16, 2};
const GdnShape kGdn{2, 4, 16, 8};

StateCacheConfig make_config(LayerKind kind, DecodeMode mode = DecodeMode::kReplay) {
  StateCacheConfig c;
  c.kind = kind;
  c.mamba2 = kM2;
  c.gdn = kGdn;
  c.mode = mode;
  c.capacity = 4;
  c.buffer_len = 16;
  // Eager: the in-place cache (test_eager_spec.cpp has the one with a state copy per draft).
  c.max_spec_tokens = mode == DecodeMode::kEager ? 1 : 4;
  return c;
}

// Random inputs for either layer kind, and one decode call of them.
struct Tokens {
  testing::Mamba2Tokens m2;
  testing::GdnTokens gdn;
};

struct Decoded {
  Status status;
  std::vector<float> out;            // decoded outputs [batch, T, heads, rows]
  std::vector<std::uint8_t> raw;     // the output buffer's bytes
};

class Harness {
 public:
  Harness(const StateCacheConfig& config, std::uint64_t seed)
      : cache(testing::create_cache(config)), rng_(seed) {
    Rng prng(seed + 99);
    for (int l = 0; l < config.num_layers; ++l) {
      params_.push_back(testing::make_mamba2_layer(config.mamba2, testing::Recipe{}, prng));
    }
  }
  LayerKind kind() const { return cache->config().kind; }
  std::size_t out_per_token() const {
    const StateDims d = cache->config().dims();
    return std::size_t(d.heads) * d.rows;
  }
  std::size_t state_elems() const { return std::size_t(cache->config().dims().state_elems()); }

  Tokens tokens(int batch, int T) {
    Tokens t;
    const StateCacheConfig& c = cache->config();
    if (kind() == LayerKind::kMamba2) {
      t.m2 = testing::make_mamba2_tokens(c.mamba2, batch, T, c.input_dtype, true, {}, rng_);
    } else {
      t.gdn = testing::make_gdn_tokens(c.gdn, batch, T, c.input_dtype, {}, rng_);
    }
    return t;
  }

  // The Args of a decode call (buffers owned by *holder), for tests that break one field.
  template <typename F>
  Decoded decode_with(int layer, const std::vector<std::int32_t>& slots, const Tokens& t,
                      F&& edit) {
    Decoded d;
    if (kind() == LayerKind::kMamba2) {
      testing::Mamba2Call call =
          testing::make_mamba2_call(*cache, layer, slots, params_[std::size_t(layer)], t.m2);
      Mamba2DecodeArgs args = call.args;
      edit(&args, static_cast<GdnDecodeArgs*>(nullptr));
      d.status = mamba2_decode(*cache, args);
      d.out = call.output();
      d.raw = call.y.bytes();
    } else {
      testing::GdnCall call = testing::make_gdn_call(*cache, layer, slots, t.gdn, true, 0.0f);
      GdnDecodeArgs args = call.args;
      edit(static_cast<Mamba2DecodeArgs*>(nullptr), &args);
      d.status = gdn_decode(*cache, args);
      d.out = call.output();
      d.raw = call.o.bytes();
    }
    return d;
  }
  Decoded decode(int layer, const std::vector<std::int32_t>& slots, const Tokens& t) {
    return decode_with(layer, slots, t, [](Mamba2DecodeArgs*, GdnDecodeArgs*) {});
  }
  // Decodes `T` fresh random tokens on every layer, then commits `accepted` per row.
  void step(const std::vector<std::int32_t>& slots, int T, std::int32_t accepted) {
    for (int l = 0; l < cache->config().num_layers; ++l) {
      const Decoded d = decode(l, slots, tokens(int(slots.size()), T));
      ASSERT_TRUE(d.status.is_ok()) << d.status.to_string();
    }
    if (cache->config().mode == DecodeMode::kReplay) {
      std::vector<std::int32_t> acc(slots.size(), accepted);
      ASSERT_TRUE(testing::commit(*cache, slots, acc).is_ok());
    }
  }
  const testing::Mamba2Layer& params(int layer) const { return params_[std::size_t(layer)]; }

  std::unique_ptr<StateCache> cache;

 private:
  Rng rng_;
  std::vector<testing::Mamba2Layer> params_;
};

std::vector<float> random_state(std::size_t n, std::uint64_t seed, double sd = 0.5) {
  Rng rng(seed);
  std::vector<float> s(n);
  for (float& e : s) e = float(rng.normal(0.0, sd));
  return s;
}

std::vector<float> export_state(StateCache& cache, int layer, int slot) {
  std::vector<float> s(std::size_t(cache.config().dims().state_elems()));
  const Status st = state_cache_export_state(cache, layer, slot, s.data());
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return s;
}

bool bytes_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// ---- a verify that commits nothing ---------------------------------------------------------

struct VerifyCase {
  LayerKind kind;
  CheckpointPrecision precision;
};
void PrintTo(const VerifyCase& c, std::ostream* os) {
  *os << kind_tag(c.kind) << "_" << precision_tag(c.precision);
}
class StateCacheVerify : public ::testing::TestWithParam<VerifyCase> {};

// Two caches on the same tokens; A also verifies a 4-token window of random drafts and commits
// none of it. A's checkpoint copies and cursors are bit-identical right after, its ring differs
// only at the window's positions, and from then on A and B agree bit for bit: outputs (across
// the next folds) and exported states. Rollback is a cursor move.
TEST_P(StateCacheVerify, CommittingNothingChangesNothing) {
  const VerifyCase c = GetParam();
  StateCacheConfig cfg = make_config(c.kind);
  cfg.checkpoint = c.precision;
  cfg.capacity = 3;
  Harness a(cfg, 1), b(cfg, 1);
  const int sa = testing::allocate_slot(*a.cache), sb = testing::allocate_slot(*b.cache);
  const int other = testing::allocate_slot(*a.cache);  // a second slot of A, never decoded
  const std::vector<float> s0 = random_state(a.state_elems(), 5);
  ASSERT_TRUE(state_cache_load_state(*a.cache, 0, sa, s0.data()).is_ok());
  ASSERT_TRUE(state_cache_load_state(*b.cache, 0, sb, s0.data()).is_ok());
  ASSERT_TRUE(state_cache_load_state(*a.cache, 0, other, s0.data()).is_ok());
  // 21 plain steps: a fold at the start of step 17 (16 committed), then 5 unfolded < L.
  for (int i = 0; i < 21; ++i) {
    const Tokens t = a.tokens(1, 1);
    ASSERT_TRUE(a.decode(0, {sa}, t).status.is_ok());
    ASSERT_TRUE(b.decode(0, {sb}, t).status.is_ok());
    ASSERT_TRUE(testing::commit(*a.cache, {sa}, {1}).is_ok());
    ASSERT_TRUE(testing::commit(*b.cache, {sb}, {1}).is_ok());
  }
  ASSERT_EQ(testing::cursor_committed(*a.cache, sa), 21u);
  ASSERT_EQ(testing::cursor_folded(*a.cache, 0, sa), 16u);

  const CacheBytes before = testing::snapshot(*a.cache);
  const std::vector<std::uint8_t> other_before = testing::slot_bytes(*a.cache, other);
  const Decoded v = a.decode(0, {sa}, a.tokens(1, 4));  // drafts only A sees
  ASSERT_TRUE(v.status.is_ok()) << v.status.to_string();
  ASSERT_TRUE(testing::all_finite(v.out));
  EXPECT_EQ(testing::cursor_pending(*a.cache, sa), 4);
  ASSERT_TRUE(testing::commit(*a.cache, {sa}, {0}).is_ok());
  const CacheBytes after = testing::snapshot(*a.cache);

  for (std::size_t i = 0; i < before.names.size(); ++i) {
    const std::string& n = before.names[i];
    if (n == "ckpt_hi" || n == "ckpt_lo" || n == "ckpt_lo_scale") {
      EXPECT_TRUE(before.data[i] == after.data[i]) << n << " changed";
    }
  }
  EXPECT_EQ(before["committed"], after["committed"]);
  EXPECT_EQ(before["folded"], after["folded"]);
  EXPECT_EQ(testing::cursor_pending(*a.cache, sa), 0);
  EXPECT_EQ(testing::slot_bytes(*a.cache, other), other_before);
  // The ring: only the 4 window records (positions 21..24) may differ.
  const StateCacheLayout& l = a.cache->layout();
  const int cap = l.ring_capacity;
  for (const testing::BufferView& bv : testing::layout_buffers(l)) {
    if (bv.name.rfind("ring_", 0) != 0) continue;
    const std::size_t rec = bv.slot_bytes / std::size_t(cap);
    const std::size_t base = std::size_t(l.layer_slot(0, sa)) * bv.slot_bytes;
    for (int pos = 0; pos < cap; ++pos) {
      const int idx = pos;  // ring index; positions 21..24 map to (21..24) & (cap - 1)
      bool in_window = false;
      for (int p = 21; p < 25; ++p) in_window |= (p & (cap - 1)) == idx;
      if (in_window) continue;
      const std::size_t off = base + std::size_t(idx) * rec;
      EXPECT_TRUE(std::equal(before[bv.name].begin() + std::ptrdiff_t(off),
                             before[bv.name].begin() + std::ptrdiff_t(off + rec),
                             after[bv.name].begin() + std::ptrdiff_t(off)))
          << bv.name << " record " << idx << " changed";
    }
  }
  // From here on A and B are the same cache, bit for bit, through two more folds.
  for (int i = 0; i < 40; ++i) {
    const Tokens t = a.tokens(1, 1);
    const Decoded da = a.decode(0, {sa}, t);
    const Decoded db = b.decode(0, {sb}, t);
    ASSERT_TRUE(da.status.is_ok() && db.status.is_ok());
    ASSERT_TRUE(testing::all_finite(da.out));
    ASSERT_EQ(da.raw, db.raw) << "step " << i << " after the verify";
    ASSERT_TRUE(testing::commit(*a.cache, {sa}, {1}).is_ok());
    ASSERT_TRUE(testing::commit(*b.cache, {sb}, {1}).is_ok());
  }
  EXPECT_TRUE(bytes_equal(export_state(*a.cache, 0, sa), export_state(*b.cache, 0, sb)));
}

INSTANTIATE_TEST_SUITE_P(
    KindPrecision, StateCacheVerify,
    ::testing::Values(VerifyCase{LayerKind::kMamba2, CheckpointPrecision::kFp32},
                      VerifyCase{LayerKind::kMamba2, CheckpointPrecision::kFp32Bf16},
                      VerifyCase{LayerKind::kMamba2, CheckpointPrecision::kFp32Fp8},
                      VerifyCase{LayerKind::kMamba2, CheckpointPrecision::kBf16},
                      VerifyCase{LayerKind::kGdn, CheckpointPrecision::kFp32},
                      VerifyCase{LayerKind::kGdn, CheckpointPrecision::kFp32Bf16},
                      VerifyCase{LayerKind::kGdn, CheckpointPrecision::kFp32Fp8},
                      VerifyCase{LayerKind::kGdn, CheckpointPrecision::kBf16}),
    ::testing::PrintToStringParamName());

// ---- pad rows and guard slots -------------------------------------------------------------

struct KindModeCase {
  LayerKind kind;
  DecodeMode mode;
  DType input;
};
void PrintTo(const KindModeCase& c, std::ostream* os) {
  *os << kind_tag(c.kind) << "_" << mode_tag(c.mode) << "_Input" << dtype_tag(c.input);
}
const auto kKindModes = ::testing::Values(
    KindModeCase{LayerKind::kMamba2, DecodeMode::kEager, DType::kF32},
    KindModeCase{LayerKind::kMamba2, DecodeMode::kReplay, DType::kF32},
    KindModeCase{LayerKind::kMamba2, DecodeMode::kReplay, DType::kBF16},
    KindModeCase{LayerKind::kGdn, DecodeMode::kEager, DType::kBF16},
    KindModeCase{LayerKind::kGdn, DecodeMode::kReplay, DType::kF32},
    KindModeCase{LayerKind::kGdn, DecodeMode::kReplay, DType::kF16});

class StateCachePadRows : public ::testing::TestWithParam<KindModeCase> {};

// A batch of pad and real rows: every pad row's output keeps its NaN poison, every real row's
// output is written, and no byte of any slot outside the batch changes (guard slots around and
// between the used ones, one of them never allocated). Commit ignores pad rows' counts.
TEST_P(StateCachePadRows, LeaveEveryByteUntouched) {
  const KindModeCase c = GetParam();
  StateCacheConfig cfg = make_config(c.kind, c.mode);
  cfg.input_dtype = c.input;
  cfg.num_layers = 2;
  cfg.capacity = 7;
  Harness h(cfg, 3);
  for (int i = 0; i < 6; ++i) testing::allocate_slot(*h.cache);  // slot 6 stays free
  const std::vector<std::int32_t> slots{-1, 2, -1, -1, 4, -1};
  const std::vector<int> guards{0, 1, 3, 5, 6};
  std::vector<std::vector<std::uint8_t>> guard_before;
  for (int g : guards) guard_before.push_back(testing::slot_bytes(*h.cache, g));
  const int T = c.mode == DecodeMode::kEager ? 1 : 3;
  const std::size_t ot = h.out_per_token();
  for (int step = 0; step < 24; ++step) {
    for (int layer = 0; layer < 2; ++layer) {
      const Decoded d = h.decode(layer, slots, h.tokens(int(slots.size()), T));
      ASSERT_TRUE(d.status.is_ok()) << d.status.to_string();
      const std::size_t row_bytes = std::size_t(T) * ot * dtype_size(c.input);
      const std::vector<std::uint8_t> poison =
          testing::encode(c.input, std::vector<float>(std::size_t(T) * ot, std::nanf("")));
      for (std::size_t b = 0; b < slots.size(); ++b) {
        if (slots[b] < 0) {
          ASSERT_TRUE(std::equal(poison.begin(), poison.end(),
                                 d.raw.begin() + std::ptrdiff_t(b * row_bytes)))
              << "pad row " << b << " output written at step " << step;
        } else {
          ASSERT_TRUE(testing::all_finite(d.out.data() + b * T * ot, std::size_t(T) * ot))
              << "real row " << b << " output not (finitely) written at step " << step;
        }
      }
    }
    if (c.mode == DecodeMode::kReplay) {
      // Pad rows carry junk counts: commit must not read them as slots or counts.
      ASSERT_TRUE(testing::commit(*h.cache, slots, {99, 2, -7, 1000, 1, 5}).is_ok());
      ASSERT_TRUE(testing::fold(*h.cache, {-1, -1}).is_ok());
    }
  }
  for (std::size_t g = 0; g < guards.size(); ++g) {
    EXPECT_EQ(testing::slot_bytes(*h.cache, guards[g]), guard_before[g])
        << "guard slot " << guards[g] << " was written";
  }
  if (c.mode == DecodeMode::kReplay) {
    EXPECT_EQ(testing::cursor_committed(*h.cache, 2), 48u);
    EXPECT_EQ(testing::cursor_committed(*h.cache, 4), 24u);
  }
}

TEST_P(StateCachePadRows, AllPadBatchWritesNothing) {
  const KindModeCase c = GetParam();
  StateCacheConfig cfg = make_config(c.kind, c.mode);
  cfg.input_dtype = c.input;
  Harness h(cfg, 4);
  const int s = testing::allocate_slot(*h.cache);
  h.step({s}, 1, 1);
  const CacheBytes before = testing::snapshot(*h.cache);
  const Decoded d = h.decode(0, {-1, -1, -1}, h.tokens(3, 1));
  ASSERT_TRUE(d.status.is_ok());
  for (float v : d.out) ASSERT_TRUE(std::isnan(v));
  if (c.mode == DecodeMode::kReplay) {
    ASSERT_TRUE(testing::commit(*h.cache, {-1, -1, -1}, {1, 1, 1}).is_ok());
  }
  ASSERT_TRUE(testing::fold(*h.cache, {-1, -1, -1}).is_ok());
  EXPECT_EQ(testing::diff(before, testing::snapshot(*h.cache)), "");
}

INSTANTIATE_TEST_SUITE_P(KindModeInput, StateCachePadRows, kKindModes,
                         ::testing::PrintToStringParamName());

// ---- rejected calls write nothing ---------------------------------------------------------

class StateCacheRejects : public ::testing::TestWithParam<KindModeCase> {};

// Each bad call returns the expected code and changes no byte of the cache and no byte of the
// output buffer. The bad value sits after valid rows, so a backend that writes before it has
// validated everything is caught.
TEST_P(StateCacheRejects, BadDecodeArgumentsWriteNothing) {
  const KindModeCase c = GetParam();
  StateCacheConfig cfg = make_config(c.kind, c.mode);
  cfg.input_dtype = c.input;
  cfg.num_layers = 2;
  cfg.capacity = 5;
  Harness h(cfg, 6);
  const int s0 = testing::allocate_slot(*h.cache);
  const int s1 = testing::allocate_slot(*h.cache);
  const int s2 = testing::allocate_slot(*h.cache);
  const int unallocated = 4;
  ASSERT_FALSE(h.cache->is_allocated(unallocated));
  h.step({s0, s1, s2}, 1, 1);
  h.step({s0, s1, s2}, 1, 1);
  const bool replay = c.mode == DecodeMode::kReplay;

  struct Case {
    std::string name;
    std::vector<std::int32_t> slots;
    int T;
    std::function<void(Mamba2DecodeArgs*, GdnDecodeArgs*)> edit;
    StatusCode want;
  };
  auto none = [](Mamba2DecodeArgs*, GdnDecodeArgs*) {};
  auto both = [](auto f) {
    return [f](Mamba2DecodeArgs* m, GdnDecodeArgs* g) {
      if (m != nullptr) f(*m);
      if (g != nullptr) f(*g);
    };
  };
  const StatusCode inv = StatusCode::kInvalidArgument;
  std::vector<Case> cases{
      {"slot out of range", {s0, s1, 5}, 1, none, inv},
      {"slot far out of range", {s0, 1000}, 1, none, inv},
      {"negative slot other than -1", {s0, -2}, 1, none, inv},
      {"slot not allocated", {s0, s1, unallocated}, 1, none, inv},
      {"duplicate slot", {s0, s1, s0}, 1, none, inv},
      {"layer out of range", {s0, s1}, 1, both([](auto& a) { a.layer = 2; }), inv},
      {"negative layer", {s0, s1}, 1, both([](auto& a) { a.layer = -1; }), inv},
      {"zero tokens", {s0, s1}, 1, both([](auto& a) { a.num_tokens = 0; }), inv},
      {"negative batch", {s0, s1}, 1, both([](auto& a) { a.batch = -1; }), inv},
      {"null slot_ids", {s0, s1}, 1, both([](auto& a) { a.slot_ids = nullptr; }), inv},
  };
  cases.push_back({"window wider than max_spec_tokens", {s0, s1}, replay ? 5 : 2, none, inv});
  if (c.kind == LayerKind::kMamba2) {
    auto m2 = [](auto f) {
      return [f](Mamba2DecodeArgs* m, GdnDecodeArgs*) { f(*m); };
    };
    cases.push_back({"null x", {s0, s1}, 1, m2([](auto& a) { a.x = nullptr; }), inv});
    cases.push_back({"null dt", {s0, s1}, 1, m2([](auto& a) { a.dt = nullptr; }), inv});
    cases.push_back({"null B", {s0, s1}, 1, m2([](auto& a) { a.B = nullptr; }), inv});
    cases.push_back({"null C", {s0, s1}, 1, m2([](auto& a) { a.C = nullptr; }), inv});
    cases.push_back({"null A", {s0, s1}, 1, m2([](auto& a) { a.A = nullptr; }), inv});
    cases.push_back({"null D", {s0, s1}, 1, m2([](auto& a) { a.D = nullptr; }), inv});
    cases.push_back({"null dt_bias", {s0, s1}, 1, m2([](auto& a) { a.dt_bias = nullptr; }), inv});
    cases.push_back({"null y", {s0, s1}, 1, m2([](auto& a) { a.y = nullptr; }), inv});
  } else {
    auto gd = [](auto f) {
      return [f](Mamba2DecodeArgs*, GdnDecodeArgs* g) { f(*g); };
    };
    cases.push_back({"null q", {s0, s1}, 1, gd([](auto& a) { a.q = nullptr; }), inv});
    cases.push_back({"null k", {s0, s1}, 1, gd([](auto& a) { a.k = nullptr; }), inv});
    cases.push_back({"null v", {s0, s1}, 1, gd([](auto& a) { a.v = nullptr; }), inv});
    cases.push_back({"null g", {s0, s1}, 1, gd([](auto& a) { a.g = nullptr; }), inv});
    cases.push_back({"null beta", {s0, s1}, 1, gd([](auto& a) { a.beta = nullptr; }), inv});
    cases.push_back({"null o", {s0, s1}, 1, gd([](auto& a) { a.o = nullptr; }), inv});
    cases.push_back({"negative scale", {s0, s1}, 1, gd([](auto& a) { a.scale = -1.0f; }), inv});
    cases.push_back({"nan scale", {s0, s1}, 1, gd([](auto& a) { a.scale = std::nanf(""); }), inv});
  }

  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    const CacheBytes before = testing::snapshot(*h.cache);
    const Tokens t = h.tokens(int(k.slots.size()), k.T);
    const Decoded d = h.decode_with(0, k.slots, t, k.edit);
    EXPECT_EQ(d.status.code(), k.want) << d.status.to_string();
    EXPECT_FALSE(d.status.message().empty());
    EXPECT_EQ(testing::diff(before, testing::snapshot(*h.cache)), "");
    for (float v : d.out) {
      if (!std::isnan(v)) {
        ADD_FAILURE() << "output written";
        break;
      }
    }
  }
  // The cache still works after all of that.
  h.step({s0, s1, s2}, 1, 1);
}

TEST_P(StateCacheRejects, WrongKindWritesNothing) {
  const KindModeCase c = GetParam();
  StateCacheConfig cfg = make_config(c.kind, c.mode);
  cfg.input_dtype = c.input;
  Harness h(cfg, 7);
  const int s = testing::allocate_slot(*h.cache);
  h.step({s}, 1, 1);
  // An op of the other kind, with perfectly good arguments for that kind.
  StateCacheConfig other = make_config(
      c.kind == LayerKind::kMamba2 ? LayerKind::kGdn : LayerKind::kMamba2, c.mode);
  other.input_dtype = c.input;
  Harness o(other, 8);
  const int os = testing::allocate_slot(*o.cache);
  ASSERT_EQ(os, s);
  const CacheBytes before = testing::snapshot(*h.cache);
  Status st;
  if (c.kind == LayerKind::kMamba2) {
    const testing::GdnCall call = testing::make_gdn_call(
        *h.cache, 0, {s}, o.tokens(1, 1).gdn, true, 0.0f);
    st = gdn_decode(*h.cache, call.args);
  } else {
    const testing::Mamba2Call call =
        testing::make_mamba2_call(*h.cache, 0, {s}, o.params(0), o.tokens(1, 1).m2);
    st = mamba2_decode(*h.cache, call.args);
  }
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_EQ(testing::diff(before, testing::snapshot(*h.cache)), "");
}

// Commit counts the windows of replay caches: replay cases only.
class StateCacheRejectsCommit : public ::testing::TestWithParam<KindModeCase> {};

TEST_P(StateCacheRejectsCommit, BadCommitWritesNothing) {
  const KindModeCase c = GetParam();
  StateCacheConfig cfg = make_config(c.kind, c.mode);
  cfg.input_dtype = c.input;
  cfg.capacity = 4;
  Harness h(cfg, 9);
  const int s0 = testing::allocate_slot(*h.cache);
  const int s1 = testing::allocate_slot(*h.cache);
  const int s2 = testing::allocate_slot(*h.cache);
  h.step({s0, s1, s2}, 1, 1);
  // A 2-token window on s0 and s1; s2 has nothing pending.
  ASSERT_TRUE(h.decode(0, {s0, s1}, h.tokens(2, 2)).status.is_ok());
  struct Case {
    std::string name;
    std::vector<std::int32_t> slots, accepted;
  };
  const std::vector<Case> cases{
      {"more than pending", {s0, s1}, {2, 3}},
      {"negative count", {s0, s1}, {1, -1}},
      {"nothing pending", {s0, s2}, {1, 1}},
      {"slot out of range", {s0, 4}, {1, 1}},
      {"slot not allocated", {s0, 3}, {1, 1}},
      {"duplicate slot", {s0, s0}, {1, 1}},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    const CacheBytes before = testing::snapshot(*h.cache);
    EXPECT_EQ(testing::commit(*h.cache, k.slots, k.accepted).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(testing::diff(before, testing::snapshot(*h.cache)), "");
  }
  {
    const CacheBytes before = testing::snapshot(*h.cache);
    CommitArgs args;
    args.batch = 1;
    const std::int32_t slot = s0;
    args.slot_ids = &slot;
    args.accepted = nullptr;
    EXPECT_EQ(state_cache_commit(*h.cache, args).code(), StatusCode::kInvalidArgument);
    args.slot_ids = nullptr;
    const std::int32_t one = 1;
    args.accepted = &one;
    EXPECT_EQ(state_cache_commit(*h.cache, args).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(testing::diff(before, testing::snapshot(*h.cache)), "");
  }
  // The window is still pending and can be committed properly.
  EXPECT_TRUE(testing::commit(*h.cache, {s0, s1}, {2, 1}).is_ok());
  EXPECT_EQ(testing::cursor_committed(*h.cache, s0), 3u);
  EXPECT_EQ(testing::cursor_committed(*h.cache, s1), 2u);
}

TEST_P(StateCacheRejects, LoadExportFoldArgumentsAndPendingWindow) {
  const KindModeCase c = GetParam();
  StateCacheConfig cfg = make_config(c.kind, c.mode);
  cfg.input_dtype = c.input;
  cfg.capacity = 3;
  Harness h(cfg, 10);
  const int s = testing::allocate_slot(*h.cache);
  h.step({s}, 1, 1);
  const std::vector<float> state = random_state(h.state_elems(), 11);
  std::vector<float> out(h.state_elems(), -7.0f);
  const StatusCode inv = StatusCode::kInvalidArgument;
  const CacheBytes before = testing::snapshot(*h.cache);
  EXPECT_EQ(state_cache_load_state(*h.cache, 1, s, state.data()).code(), inv);
  EXPECT_EQ(state_cache_load_state(*h.cache, -1, s, state.data()).code(), inv);
  EXPECT_EQ(state_cache_load_state(*h.cache, 0, 1, state.data()).code(), inv);  // unallocated
  EXPECT_EQ(state_cache_load_state(*h.cache, 0, 3, state.data()).code(), inv);
  EXPECT_EQ(state_cache_load_state(*h.cache, 0, -1, state.data()).code(), inv);
  EXPECT_EQ(state_cache_load_state(*h.cache, 0, s, nullptr).code(), inv);
  EXPECT_EQ(state_cache_export_state(*h.cache, 1, s, out.data()).code(), inv);
  EXPECT_EQ(state_cache_export_state(*h.cache, 0, 2, out.data()).code(), inv);
  EXPECT_EQ(state_cache_export_state(*h.cache, 0, s, nullptr).code(), inv);
  EXPECT_EQ(testing::fold(*h.cache, {s, 2}).code(), inv);
  EXPECT_EQ(testing::fold(*h.cache, {s, s}).code(), inv);
  {
    FoldArgs args;
    args.batch = 1;
    EXPECT_EQ(state_cache_fold(*h.cache, args).code(), inv);  // null slot_ids
  }
  EXPECT_EQ(testing::diff(before, testing::snapshot(*h.cache)), "");
  for (float v : out) ASSERT_EQ(v, -7.0f);
  if (c.mode == DecodeMode::kReplay) {
    // Load while a window is pending: refused, nothing written; fine once committed.
    ASSERT_TRUE(h.decode(0, {s}, h.tokens(1, 2)).status.is_ok());
    const CacheBytes pending = testing::snapshot(*h.cache);
    EXPECT_EQ(state_cache_load_state(*h.cache, 0, s, state.data()).code(), inv);
    EXPECT_EQ(testing::diff(pending, testing::snapshot(*h.cache)), "");
    ASSERT_TRUE(testing::commit(*h.cache, {s}, {1}).is_ok());
    EXPECT_TRUE(state_cache_load_state(*h.cache, 0, s, state.data()).is_ok());
  }
}

INSTANTIATE_TEST_SUITE_P(KindModeInput, StateCacheRejects, kKindModes,
                         ::testing::PrintToStringParamName());
INSTANTIATE_TEST_SUITE_P(
    KindInput, StateCacheRejectsCommit,
    ::testing::Values(KindModeCase{LayerKind::kMamba2, DecodeMode::kReplay, DType::kF32},
                      KindModeCase{LayerKind::kMamba2, DecodeMode::kReplay, DType::kBF16},
                      KindModeCase{LayerKind::kGdn, DecodeMode::kReplay, DType::kF32},
                      KindModeCase{LayerKind::kGdn, DecodeMode::kReplay, DType::kF16}),
    ::testing::PrintToStringParamName());

TEST(StateCacheConfigRejects, BadConfigsCreateNothing) {
  struct Case {
    std::string name;
    std::function<void(StateCacheConfig*)> edit;
  };
  const std::vector<Case> cases{
      {"zero nheads", [](auto* c) { c->mamba2.nheads = 0; }},
      {"negative head_dim", [](auto* c) { c->mamba2.head_dim = -8; }},
      {"zero dstate", [](auto* c) { c->mamba2.dstate = 0; }},
      {"zero ngroups", [](auto* c) { c->mamba2.ngroups = 0; }},
      {"ngroups does not divide nheads", [](auto* c) { c->mamba2.ngroups = 3; }},
      {"gdn Hv not a multiple of Hk",
       [](auto* c) {
         c->kind = LayerKind::kGdn;
         c->gdn.num_k_heads = 3;
       }},
      {"gdn zero head_k_dim",
       [](auto* c) {
         c->kind = LayerKind::kGdn;
         c->gdn.head_k_dim = 0;
       }},
      {"zero layers", [](auto* c) { c->num_layers = 0; }},
      {"zero capacity", [](auto* c) { c->capacity = 0; }},
      {"L < 1", [](auto* c) { c->buffer_len = 0; }},
      {"negative L", [](auto* c) { c->buffer_len = -16; }},
      {"T < 1", [](auto* c) { c->max_spec_tokens = 0; }},
      {"fp8 inputs", [](auto* c) { c->input_dtype = DType::kF8E4M3; }},
      {"fp8 eager state",
       [](auto* c) {
         c->mode = DecodeMode::kEager;
         c->state_dtype = DType::kF8E4M3;
       }},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    StateCacheConfig cfg = make_config(LayerKind::kMamba2);
    k.edit(&cfg);
    std::unique_ptr<StateCache> cache;
    const Status st = state_cache_create(cfg, &cache);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_EQ(cache, nullptr);
  }
  EXPECT_EQ(state_cache_create(make_config(LayerKind::kMamba2), nullptr).code(),
            StatusCode::kInvalidArgument);
  // A good config is accepted (the cases above fail for their edit, not the base).
  std::unique_ptr<StateCache> cache;
  EXPECT_TRUE(state_cache_create(make_config(LayerKind::kGdn), &cache).is_ok());
  EXPECT_NE(cache, nullptr);
}

// ---- slot lifecycle ------------------------------------------------------------------------

TEST(StateCacheSlots, AllocateFreeFull) {
  StateCacheConfig cfg = make_config(LayerKind::kMamba2);
  cfg.capacity = 3;
  Harness h(cfg, 12);
  StateCache& c = *h.cache;
  EXPECT_EQ(c.free_slots(), 3);
  EXPECT_EQ(state_cache_allocate_slot(c, nullptr).code(), StatusCode::kInvalidArgument);
  std::vector<int> got;
  for (int i = 0; i < 3; ++i) got.push_back(testing::allocate_slot(c));
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(c.free_slots(), 0);
  int slot = -5;
  EXPECT_EQ(state_cache_allocate_slot(c, &slot).code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(slot, -5);
  for (int s : got) EXPECT_TRUE(c.is_allocated(s));
  EXPECT_FALSE(c.is_allocated(3));
  EXPECT_FALSE(c.is_allocated(-1));

  // Decode into slot 1 (past a fold), free it, take it again: zero state, cursors at 0.
  for (int i = 0; i < 20; ++i) h.step({1}, 1, 1);
  EXPECT_NE(testing::cursor_committed(c, 1), 0u);
  EXPECT_TRUE(state_cache_free_slot(c, 1).is_ok());
  EXPECT_FALSE(c.is_allocated(1));
  EXPECT_EQ(state_cache_free_slot(c, 1).code(), StatusCode::kInvalidArgument);  // double free
  EXPECT_EQ(state_cache_free_slot(c, 3).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(state_cache_free_slot(c, -1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.free_slots(), 1);
  // A freed slot is a bad slot for every op.
  EXPECT_FALSE(h.decode(0, {0, 1}, h.tokens(2, 1)).status.is_ok());
  ASSERT_EQ(testing::allocate_slot(c), 1);
  EXPECT_EQ(testing::cursor_committed(c, 1), 0u);
  EXPECT_EQ(testing::cursor_folded(c, 0, 1), 0u);
  EXPECT_EQ(testing::cursor_pending(c, 1), 0);
  for (float v : export_state(c, 0, 1)) ASSERT_EQ(v, 0.0f);
  // And decodes from zero like a new sequence: the same output as a fresh cache's slot.
  Harness fresh(cfg, 12);
  const int fs = testing::allocate_slot(*fresh.cache);
  const Tokens t = h.tokens(1, 1);
  const Decoded a = h.decode(0, {1}, t);
  const Decoded b = fresh.decode(0, {fs}, t);
  ASSERT_TRUE(a.status.is_ok() && b.status.is_ok());
  EXPECT_EQ(a.raw, b.raw);
}

// ---- load, export, fold ----------------------------------------------------------------------

struct IoCase {
  LayerKind kind;
  DecodeMode mode;
  CheckpointPrecision precision;  // replay
  DType state;                    // eager
};
void PrintTo(const IoCase& c, std::ostream* os) {
  *os << kind_tag(c.kind) << "_" << mode_tag(c.mode)
      << (c.mode == DecodeMode::kEager ? "State" + dtype_tag(c.state) : precision_tag(c.precision));
}
class StateCacheIo : public ::testing::TestWithParam<IoCase> {};

StateCacheConfig io_config(const IoCase& c) {
  StateCacheConfig cfg = make_config(c.kind, c.mode);
  cfg.checkpoint = c.precision;
  cfg.state_dtype = c.state;
  cfg.num_layers = 2;
  cfg.capacity = 3;
  return cfg;
}

// What the cache should hold for a loaded state: exact in fp32, else rounded to the dtype
// it keeps as its state of record.
float stored(const IoCase& c, float v) {
  if (c.mode == DecodeMode::kEager) return testing::round_to(c.state, v);
  return c.precision == CheckpointPrecision::kBf16 ? testing::round_to(DType::kBF16, v) : v;
}

TEST_P(StateCacheIo, LoadExportRoundTrip) {
  const IoCase c = GetParam();
  Harness h(io_config(c), 13);
  const int s = testing::allocate_slot(*h.cache);
  const int g = testing::allocate_slot(*h.cache);
  const std::vector<std::uint8_t> guard = testing::slot_bytes(*h.cache, g);
  const std::vector<float> s0 = random_state(h.state_elems(), 14);
  const std::vector<float> s1 = random_state(h.state_elems(), 15);
  ASSERT_TRUE(state_cache_load_state(*h.cache, 0, s, s0.data()).is_ok());
  ASSERT_TRUE(state_cache_load_state(*h.cache, 1, s, s1.data()).is_ok());
  const std::vector<float> e0 = export_state(*h.cache, 0, s);
  const std::vector<float> e1 = export_state(*h.cache, 1, s);
  for (std::size_t i = 0; i < s0.size(); ++i) {
    ASSERT_EQ(e0[i], stored(c, s0[i])) << i;
    ASSERT_EQ(e1[i], stored(c, s1[i])) << i;
  }
  EXPECT_EQ(testing::slot_bytes(*h.cache, g), guard);
  // The read copy is the rounding of the master: bf16 element-wise, fp8 with a per-row scale
  // of max|row| / 448 (so each row's largest element becomes ±448).
  const StateCacheLayout& l = h.cache->layout();
  if (c.mode == DecodeMode::kReplay && l.has_lo()) {
    const std::int64_t base = l.layer_slot(0, s) * l.state_elems();
    const int cols = l.dims.cols;
    for (std::int64_t r = 0; r < l.state_rows(); ++r) {
      float amax = 0.0f;
      for (int i = 0; i < cols; ++i) amax = std::max(amax, std::fabs(s0[r * cols + i]));
      const float scale = amax / kFp8Max;
      if (l.lo_dtype() == DType::kF8E4M3) {
        ASSERT_FLOAT_EQ(l.ckpt_lo_scale[l.layer_slot(0, s) * l.state_rows() + r], scale);
      }
      for (int i = 0; i < cols; ++i) {
        const std::int64_t e = base + r * cols + i;
        if (l.lo_dtype() == DType::kBF16) {
          ASSERT_EQ(static_cast<const bf16_t*>(l.ckpt_lo)[e].bits,
                    float_to_bf16(s0[r * cols + i]).bits);
        } else {
          const float dq = to_float(static_cast<const fp8e4m3_t*>(l.ckpt_lo)[e]) * scale;
          ASSERT_LE(std::fabs(dq - s0[r * cols + i]), amax * 0.0625f) << r << "," << i;
        }
      }
    }
  }
}

// Prefill hand-off: after a load, decoding continues from the loaded state (vs the oracle
// started from the same state), and a reload empties the ring: the previous tokens are gone.
TEST_P(StateCacheIo, DecodeContinuesFromALoadedState) {
  const IoCase c = GetParam();
  StateCacheConfig cfg = io_config(c);
  cfg.num_layers = 1;
  Harness h(cfg, 16);
  const int s = testing::allocate_slot(*h.cache);
  // Tokens before the load must not survive it.
  for (int i = 0; i < 5; ++i) h.step({s}, 1, 1);
  const std::vector<float> s0 = random_state(h.state_elems(), 17, 0.3);
  ASSERT_TRUE(state_cache_load_state(*h.cache, 0, s, s0.data()).is_ok());
  const std::vector<float> e = export_state(*h.cache, 0, s);
  for (std::size_t i = 0; i < s0.size(); ++i) ASSERT_EQ(e[i], stored(c, s0[i])) << i;

  std::vector<double> ref_state(s0.begin(), s0.end());
  std::vector<double> ref(h.out_per_token());
  double worst = 0.0;
  for (int step = 0; step < 40; ++step) {
    const Tokens t = h.tokens(1, 1);
    const Decoded d = h.decode(0, {s}, t);
    ASSERT_TRUE(d.status.is_ok());
    if (c.kind == LayerKind::kMamba2) {
      const testing::Mamba2Layer& p = h.params(0);
      reference::mamba2_reference_step(cfg.mamba2, ref_state.data(), t.m2.x.data(),
                                       t.m2.dt.data(), t.m2.B.data(), t.m2.C.data(),
                                       t.m2.z.data(), p.A.data(), p.D.data(), p.dt_bias.data(),
                                       ref.data());
    } else {
      reference::gdn_reference_step(cfg.gdn, ref_state.data(), t.gdn.q.data(), t.gdn.k.data(),
                                    t.gdn.v.data(), t.gdn.g.data(), t.gdn.beta.data(), true, 0.0f,
                                    ref.data());
    }
    worst = std::max(worst, testing::rel_error(d.out, ref));
    if (c.mode == DecodeMode::kReplay) {
      ASSERT_TRUE(testing::commit(*h.cache, {s}, {1}).is_ok());
    }
  }
  const bool exact = (c.mode == DecodeMode::kEager && c.state == DType::kF32) ||
                     (c.mode == DecodeMode::kReplay && c.precision == CheckpointPrecision::kFp32);
  EXPECT_LE(worst, exact ? 1e-5 : 0.1);
  const std::vector<float> last = export_state(*h.cache, 0, s);
  EXPECT_LE(testing::rel_error(last, ref_state),
            exact || (c.mode == DecodeMode::kReplay && c.precision != CheckpointPrecision::kBf16)
                ? 1e-5
                : 0.05);
}

// An explicit fold makes the checkpoint the state (export = oracle); folding again, or
// exporting, changes no byte; a decode after it starts a new cycle.
class StateCacheFold : public ::testing::TestWithParam<IoCase> {};

TEST_P(StateCacheFold, FoldThenExportEqualsOracle) {
  const IoCase c = GetParam();
  StateCacheConfig cfg = io_config(c);
  cfg.buffer_len = 8;
  Harness h(cfg, 18);
  const int s = testing::allocate_slot(*h.cache);
  std::vector<std::vector<double>> ref(2, std::vector<double>(h.state_elems(), 0.0));
  std::vector<double> out(h.out_per_token());
  for (int step = 0; step < 13; ++step) {  // 13 = one fold at 8, then 5 unfolded
    for (int layer = 0; layer < 2; ++layer) {
      const Tokens t = h.tokens(1, 1);
      ASSERT_TRUE(h.decode(layer, {s}, t).status.is_ok());
      if (c.kind == LayerKind::kMamba2) {
        const testing::Mamba2Layer& p = h.params(layer);
        reference::mamba2_reference_step(cfg.mamba2, ref[layer].data(), t.m2.x.data(),
                                         t.m2.dt.data(), t.m2.B.data(), t.m2.C.data(),
                                         t.m2.z.data(), p.A.data(), p.D.data(),
                                         p.dt_bias.data(), out.data());
      } else {
        reference::gdn_reference_step(cfg.gdn, ref[layer].data(), t.gdn.q.data(),
                                      t.gdn.k.data(), t.gdn.v.data(), t.gdn.g.data(),
                                      t.gdn.beta.data(), true, 0.0f, out.data());
      }
    }
    ASSERT_TRUE(testing::commit(*h.cache, {s}, {1}).is_ok());
  }
  // Shared cursors: one commit per step for both layers.
  EXPECT_EQ(testing::cursor_committed(*h.cache, s), 13u);
  EXPECT_EQ(testing::cursor_folded(*h.cache, 0, s), 8u);
  EXPECT_EQ(testing::cursor_folded(*h.cache, 1, s), 8u);
  // Layers fold independently: exporting layer 1 folds layer 1 only.
  const std::vector<float> early1 = export_state(*h.cache, 1, s);
  EXPECT_EQ(testing::cursor_folded(*h.cache, 0, s), 8u);
  EXPECT_EQ(testing::cursor_folded(*h.cache, 1, s), 13u);
  ASSERT_TRUE(testing::fold(*h.cache, {-1, s}).is_ok());
  EXPECT_EQ(testing::cursor_folded(*h.cache, 0, s), 13u);
  EXPECT_EQ(testing::cursor_folded(*h.cache, 1, s), 13u);
  const CacheBytes folded = testing::snapshot(*h.cache);
  ASSERT_TRUE(testing::fold(*h.cache, {s}).is_ok());
  const std::vector<float> e0 = export_state(*h.cache, 0, s);
  const std::vector<float> e1 = export_state(*h.cache, 1, s);
  EXPECT_EQ(testing::diff(folded, testing::snapshot(*h.cache)), "");
  const double tol = c.precision == CheckpointPrecision::kBf16 ? 0.05 : 1e-5;
  EXPECT_LE(testing::rel_error(e0, ref[0]), tol);
  EXPECT_LE(testing::rel_error(e1, ref[1]), tol);
  EXPECT_TRUE(bytes_equal(e1, early1));
}

// Every checkpoint precision of a replay cache of `kind` (fp32 inputs): the cases both suites
// share.
std::vector<IoCase> replay_io_cases(LayerKind kind) {
  std::vector<IoCase> out;
  for (CheckpointPrecision p : {CheckpointPrecision::kFp32, CheckpointPrecision::kFp32Bf16,
                                CheckpointPrecision::kFp32Fp8, CheckpointPrecision::kBf16}) {
    out.push_back(IoCase{kind, DecodeMode::kReplay, p, DType::kF32});
  }
  return out;
}

// Eager caches in every state dtype of the kind, then its replay cases.
std::vector<IoCase> io_cases() {
  std::vector<IoCase> out;
  for (LayerKind kind : {LayerKind::kMamba2, LayerKind::kGdn}) {
    std::vector<DType> states = {DType::kF32, DType::kBF16};
    if (kind == LayerKind::kMamba2) states.push_back(DType::kF16);
    for (DType state : states) {
      out.push_back(IoCase{kind, DecodeMode::kEager, CheckpointPrecision::kFp32, state});
    }
    for (const IoCase& c : replay_io_cases(kind)) out.push_back(c);
  }
  return out;
}

std::vector<IoCase> fold_cases() {
  std::vector<IoCase> out = replay_io_cases(LayerKind::kMamba2);
  for (const IoCase& c : replay_io_cases(LayerKind::kGdn)) out.push_back(c);
  return out;
}

INSTANTIATE_TEST_SUITE_P(KindModePrecision, StateCacheIo, ::testing::ValuesIn(io_cases()),
                         ::testing::PrintToStringParamName());

INSTANTIATE_TEST_SUITE_P(KindPrecision, StateCacheFold, ::testing::ValuesIn(fold_cases()),
                         ::testing::PrintToStringParamName());

// Eager caches: fold is a no-op and changes no byte.
TEST(StateCacheFoldEager, IsANoOp) {
  for (LayerKind kind : {LayerKind::kMamba2, LayerKind::kGdn}) {
    Harness h(make_config(kind, DecodeMode::kEager), 19);
    const int s = testing::allocate_slot(*h.cache);
    for (int i = 0; i < 3; ++i) h.step({s}, 1, 1);
    const CacheBytes before = testing::snapshot(*h.cache);
    ASSERT_TRUE(testing::fold(*h.cache, {s}).is_ok());
    EXPECT_EQ(testing::diff(before, testing::snapshot(*h.cache)), "");
  }
}

}  // namespace
}  // namespace replayssm
