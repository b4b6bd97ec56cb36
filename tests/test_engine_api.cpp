// The engine-facing API: the buffer list, caches over buffers the caller allocated (views),
// slots an engine copies itself, refusals at creation, and the misuse a decode must refuse.
// A view must behave bit for bit as an owning cache of the same config. The CUDA cases
// (names containing "Cuda", label `cuda`) run the whole step on a stream the test created and
// capture it into a CUDA graph.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#if defined(REPLAYSSM_WITH_CUDA)
#include <cuda_runtime.h>
#endif

#include "backend.h"
#include "testing/require_gpu.h"
#include "testing/test_util.h"

namespace replayssm {
namespace {

using testing::Rng;

const Mamba2Shape kM2{4, 8, 16, 2};
const GdnShape kGdn{2, 4, 16, 8};

StateCacheConfig small_config(LayerKind kind, DecodeMode mode, CheckpointPrecision p,
                              Device device = Device::kCpu) {
  StateCacheConfig c;
  c.kind = kind;
  c.mamba2 = kM2;
  c.gdn = kGdn;
  c.mode = mode;
  c.checkpoint = p;
  c.num_layers = 2;
  c.capacity = 5;
  c.buffer_len = 4;
  c.max_spec_tokens = 3;
  c.device = device;
  return c;
}

std::string config_name(const StateCacheConfig& c) {
  std::string s = std::string(layer_kind_name(c.kind)) + "_" + decode_mode_name(c.mode);
  if (c.mode == DecodeMode::kReplay) s += std::string("_") + checkpoint_precision_name(c.checkpoint);
  s += "_T" + std::to_string(c.max_spec_tokens);
  for (char& ch : s) {
    if (ch == '+') ch = '_';
  }
  return s;
}

std::vector<StateCacheConfig> every_small_config(Device device) {
  std::vector<StateCacheConfig> out;
  for (LayerKind k : {LayerKind::kMamba2, LayerKind::kGdn}) {
    // Eager with T = 3 (a state copy per draft and the current-copy index) and with T = 1.
    out.push_back(small_config(k, DecodeMode::kEager, CheckpointPrecision::kFp32, device));
    out.push_back(small_config(k, DecodeMode::kEager, CheckpointPrecision::kFp32, device));
    out.back().max_spec_tokens = 1;
    for (CheckpointPrecision p : {CheckpointPrecision::kFp32, CheckpointPrecision::kBf16,
                                  CheckpointPrecision::kFp32Bf16, CheckpointPrecision::kFp32Fp8}) {
      out.push_back(small_config(k, DecodeMode::kReplay, p, device));
    }
  }
  return out;
}

std::vector<CacheBufferSpec> specs_of(const StateCacheConfig& c) {
  std::vector<CacheBufferSpec> specs;
  const Status st = state_cache_buffers(c, &specs);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return specs;
}

// Every buffer of a cache, copied to the host, by name (the public list says which).
std::map<std::string, std::vector<std::uint8_t>> buffer_bytes(const StateCache& cache) {
  std::map<std::string, std::vector<std::uint8_t>> out;
  for (const CacheBufferSpec& s : specs_of(cache.config())) {
    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(s.bytes));
    const Status st = memory_to_host(cache.config().device, bytes.data(), cache.buffer(s.id),
                                     bytes.size());
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    out[s.name] = std::move(bytes);
  }
  return out;
}

// Buffers the test allocates itself (host: aligned_alloc; CUDA: cudaMalloc), freed with it.
class CallerBuffers {
 public:
  CallerBuffers(const StateCacheConfig& config, std::int64_t extra_offset = 0)
      : device_(config.device) {
    for (const CacheBufferSpec& s : specs_of(config)) {
      const auto bytes = static_cast<std::size_t>(s.bytes + extra_offset);
      void* p = nullptr;
      if (device_ == Device::kCpu) {
        p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
        std::memset(p, 0xA5, bytes);  // garbage: kZero must clear it
      } else {
#if defined(REPLAYSSM_WITH_CUDA)
        EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
        EXPECT_EQ(cudaMemset(p, 0xA5, bytes), cudaSuccess);
        // The poison runs on the legacy stream; a view cleared on a non-blocking stream is not
        // ordered after it (ACapturedStepOnTheEnginesStreamMatches saw 0xA5 left in free slots).
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
#endif
      }
      owned_.push_back(p);
      bindings.push_back({s.id, static_cast<char*>(p) + extra_offset, s.bytes});
    }
  }
  ~CallerBuffers() {
    for (void* p : owned_) {
      if (device_ == Device::kCpu) {
        std::free(p);
      } else {
#if defined(REPLAYSSM_WITH_CUDA)
        (void)cudaFree(p);
#endif
      }
    }
  }
  CallerBuffers(const CallerBuffers&) = delete;
  CallerBuffers& operator=(const CallerBuffers&) = delete;

  std::vector<CacheBufferBinding> bindings;

 private:
  Device device_;
  std::vector<void*> owned_;
};

std::unique_ptr<StateCache> make_view(const StateCacheConfig& c,
                                      const std::vector<CacheBufferBinding>& b, ViewInit init,
                                      Stream stream = kDefaultStream) {
  std::unique_ptr<StateCache> view;
  const Status st = state_cache_create_view(c, b, init, &view, stream);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return view;
}

// ---- the buffer list -------------------------------------------------------------------------

TEST(BufferList, ShapesBytesAndSlotAxesAsDocumented) {
  for (const StateCacheConfig& c : every_small_config(Device::kCpu)) {
    SCOPED_TRACE(config_name(c));
    const StateDims d = c.dims();
    const std::int64_t L = c.num_layers, S = c.capacity;
    std::int64_t total = 0;
    for (const CacheBufferSpec& s : specs_of(c)) {
      SCOPED_TRACE(s.name);
      EXPECT_STREQ(s.name, cache_buffer_name(s.id));
      std::int64_t elems = 1;
      for (std::int64_t n : s.shape) elems *= n;
      EXPECT_EQ(s.bytes, elems * std::int64_t(dtype_size(s.dtype)));
      EXPECT_EQ(s.shape[std::size_t(s.slot_axis)], S);
      if (s.slot_axis == 1) {
        EXPECT_EQ(s.shape[0], L);
      }
      EXPECT_EQ(s.alignment, 64);
      total += s.bytes;
    }
    const auto cache = testing::create_cache(c);
    EXPECT_EQ(cache->bytes(), total);
    EXPECT_TRUE(cache->owns_memory());
    // The documented shapes of the state and the cursors.
    std::map<std::string, CacheBufferSpec> by_name;
    for (const CacheBufferSpec& s : specs_of(c)) by_name[s.name] = s;
    const std::vector<std::int64_t> state = {L, S, d.heads, d.rows, d.cols};
    if (c.mode == DecodeMode::kEager) {
      const std::int64_t T = c.max_spec_tokens;
      const std::vector<std::int64_t> copies = {L, S, T + 1, d.heads, d.rows, d.cols};
      EXPECT_EQ(by_name.at("state").shape, T == 1 ? state : copies);
      EXPECT_EQ(by_name.count("state_current"), T == 1 ? 0u : 1u);
      if (T > 1) {
        EXPECT_EQ(by_name.at("state_current").shape, (std::vector<std::int64_t>{S}));
        EXPECT_EQ(by_name.at("state_current").dtype, DType::kU32);
      }
      EXPECT_EQ(by_name.count("ring_vec"), 0u);
    } else {
      const std::int64_t ring = cache->ring_capacity();
      EXPECT_EQ(by_name.at("ring_vec").shape, (std::vector<std::int64_t>{L, S, ring, d.heads, d.rows}));
      EXPECT_EQ(by_name.at("ring_key").shape,
                (std::vector<std::int64_t>{L, S, ring, d.key_heads, d.cols}));
      EXPECT_EQ(by_name.count("ring_key_scale"), c.kind == LayerKind::kGdn ? 1u : 0u);
      EXPECT_EQ(by_name.count("ckpt_hi"), c.checkpoint == CheckpointPrecision::kBf16 ? 0u : 1u);
      EXPECT_EQ(by_name.count("ckpt_lo"), c.checkpoint == CheckpointPrecision::kFp32 ? 0u : 1u);
      EXPECT_EQ(by_name.count("ckpt_lo_scale"),
                c.checkpoint == CheckpointPrecision::kFp32Fp8 ? 1u : 0u);
      if (by_name.count("ckpt_hi")) {
        EXPECT_EQ(by_name.at("ckpt_hi").shape, state);
      }
    }
    EXPECT_EQ(by_name.at("committed").shape, (std::vector<std::int64_t>{S}));
    EXPECT_EQ(by_name.at("folded").shape, (std::vector<std::int64_t>{L, S}));
    EXPECT_EQ(by_name.at("pending").shape, (std::vector<std::int64_t>{L, S}));
    EXPECT_EQ(by_name.at("allocated").shape, (std::vector<std::int64_t>{S}));
  }
}

TEST(BufferList, RefusesAnInvalidConfig) {
  StateCacheConfig c = small_config(LayerKind::kMamba2, DecodeMode::kReplay,
                                    CheckpointPrecision::kFp32);
  c.buffer_len = 0;
  std::vector<CacheBufferSpec> specs;
  const Status st = state_cache_buffers(c, &specs);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("buffer_len"), std::string::npos) << st.message();
}

// ---- views -------------------------------------------------------------------------------------

// The same decode/verify/commit/fold sequence on two caches of one config, inputs drawn once:
// outputs and every buffer must agree bit for bit after each step.
class TwinRun {
 public:
  TwinRun(StateCache& a, StateCache& b, std::uint64_t seed) : a_(a), b_(b), rng_(seed) {
    Rng prng(seed + 7);
    for (int l = 0; l < a.config().num_layers; ++l) {
      layers_.push_back(testing::make_mamba2_layer(a.config().mamba2, {}, prng));
    }
  }

  // One step: a window of T tokens in every layer, then a commit of `accepted[b]` per row.
  void step(const std::vector<std::int32_t>& slots, int T, const std::vector<std::int32_t>& accepted,
            Stream stream_b = kDefaultStream) {
    const StateCacheConfig& c = a_.config();
    for (int layer = 0; layer < c.num_layers; ++layer) {
      std::vector<std::uint8_t> out_a, out_b;
      if (c.kind == LayerKind::kMamba2) {
        const auto tok = testing::make_mamba2_tokens(c.mamba2, int(slots.size()), T,
                                                     c.input_dtype, true, {}, rng_);
        auto ca = testing::make_mamba2_call(a_, layer, slots, layers_[std::size_t(layer)], tok);
        auto cb = testing::make_mamba2_call(b_, layer, slots, layers_[std::size_t(layer)], tok);
        ASSERT_TRUE(mamba2_decode(a_, ca.args).is_ok());
        const Status st = mamba2_decode(b_, cb.args, stream_b);
        ASSERT_TRUE(st.is_ok()) << st.to_string();
        sync(stream_b);
        out_a = ca.y.bytes();
        out_b = cb.y.bytes();
      } else {
        const auto tok =
            testing::make_gdn_tokens(c.gdn, int(slots.size()), T, c.input_dtype, {}, rng_);
        auto ca = testing::make_gdn_call(a_, layer, slots, tok, true, 0.0f);
        auto cb = testing::make_gdn_call(b_, layer, slots, tok, true, 0.0f);
        ASSERT_TRUE(gdn_decode(a_, ca.args).is_ok());
        const Status st = gdn_decode(b_, cb.args, stream_b);
        ASSERT_TRUE(st.is_ok()) << st.to_string();
        sync(stream_b);
        out_a = ca.o.bytes();
        out_b = cb.o.bytes();
      }
      ASSERT_EQ(out_a, out_b) << "layer " << layer;
    }
    ASSERT_TRUE(testing::commit(a_, slots, accepted).is_ok());
    ASSERT_TRUE(commit_on(b_, slots, accepted, stream_b).is_ok());
    sync(stream_b);
    ASSERT_EQ(buffer_bytes(a_), buffer_bytes(b_));
  }

  static Status commit_on(StateCache& cache, const std::vector<std::int32_t>& slots,
                          const std::vector<std::int32_t>& accepted, Stream stream) {
    testing::CacheBuffer s = testing::CacheBuffer::from_vector(cache.config().device, slots);
    testing::CacheBuffer k = testing::CacheBuffer::from_vector(cache.config().device, accepted);
    CommitArgs args;
    args.batch = int(slots.size());
    args.slot_ids = s.as<const std::int32_t>();
    args.accepted = k.as<const std::int32_t>();
    const Status st = state_cache_commit(cache, args, stream);
    sync(stream);  // the id buffers are freed on return
    return st;
  }

  static void sync(Stream stream) {
#if defined(REPLAYSSM_WITH_CUDA)
    if (stream != kDefaultStream) {
      ASSERT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), cudaSuccess);
    }
#else
    (void)stream;
#endif
  }

 private:
  StateCache& a_;
  StateCache& b_;
  Rng rng_;
  std::vector<testing::Mamba2Layer> layers_;
};

// Allocates the same slots in both caches and loads the same random state into every layer.
std::vector<std::int32_t> admit(StateCache& a, StateCache& b, int n, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<std::int32_t> slots;
  for (int i = 0; i < n; ++i) {
    int sa = -1, sb = -1;
    EXPECT_TRUE(state_cache_allocate_slot(a, &sa).is_ok());
    EXPECT_TRUE(state_cache_allocate_slot(b, &sb).is_ok());
    EXPECT_EQ(sa, sb);
    std::vector<float> state(static_cast<std::size_t>(a.config().dims().state_elems()));
    for (int layer = 0; layer < a.config().num_layers; ++layer) {
      for (float& v : state) v = float(rng.normal(0.0, 0.5));
      EXPECT_TRUE(state_cache_load_state(a, layer, sa, state.data()).is_ok());
      EXPECT_TRUE(state_cache_load_state(b, layer, sb, state.data()).is_ok());
    }
    slots.push_back(sa);
  }
  return slots;
}

// A spec window (T = 3, random acceptance) and plain steps over several fold cycles, an explicit
// fold, a pad row: the view matches the owning cache bit for bit throughout.
void expect_view_matches_owner(Device device) {
  for (const StateCacheConfig& c : every_small_config(device)) {
    SCOPED_TRACE(config_name(c));
    const auto owner = testing::create_cache(c);
    CallerBuffers mem(c);
    const auto view = make_view(c, mem.bindings, ViewInit::kZero);
    ASSERT_TRUE(view);
    EXPECT_FALSE(view->owns_memory());
    EXPECT_EQ(view->free_slots(), c.capacity);
    EXPECT_EQ(buffer_bytes(*owner), buffer_bytes(*view));  // kZero cleared the garbage
    std::vector<std::int32_t> slots = admit(*owner, *view, 3, 11);
    slots.insert(slots.begin() + 1, -1);  // a pad row
    TwinRun run(*owner, *view, 5);
    Rng acc(3);
    for (int step = 0; step < 3 * c.buffer_len; ++step) {
      const int T = step % 3 == 0 ? c.max_spec_tokens : 1;
      std::vector<std::int32_t> accepted(slots.size(), 1);
      for (auto& k : accepted) k = T == 1 ? 1 : acc.uniform_int(1, T);
      ASSERT_NO_FATAL_FAILURE(run.step(slots, T, accepted));
    }
    ASSERT_TRUE(testing::fold(*owner, {slots[0]}).is_ok());
    ASSERT_TRUE(testing::fold(*view, {slots[0]}).is_ok());
    EXPECT_EQ(buffer_bytes(*owner), buffer_bytes(*view));
    std::vector<float> sa, sb;
    ASSERT_TRUE(testing::export_state(*owner, 1, slots[2], &sa).is_ok());
    ASSERT_TRUE(testing::export_state(*view, 1, slots[2], &sb).is_ok());
    EXPECT_EQ(sa, sb);
  }
}

TEST(CacheView, MatchesTheOwningCacheBitForBit) { expect_view_matches_owner(Device::kCpu); }

TEST(CacheView, AdoptKeepsSlotsStateAndCursors) {
  const StateCacheConfig c =
      small_config(LayerKind::kGdn, DecodeMode::kReplay, CheckpointPrecision::kFp32Bf16);
  const auto owner = testing::create_cache(c);
  CallerBuffers mem(c);
  auto first = make_view(c, mem.bindings, ViewInit::kZero);
  const std::vector<std::int32_t> slots = admit(*owner, *first, 2, 21);
  {
    TwinRun run(*owner, *first, 8);
    for (int step = 0; step < 6; ++step) ASSERT_NO_FATAL_FAILURE(run.step(slots, 1, {1, 1}));
  }
  first.reset();  // the view goes; the memory and its contents stay
  const auto adopted = make_view(c, mem.bindings, ViewInit::kAdopt);
  EXPECT_EQ(adopted->free_slots(), c.capacity - 2);
  for (int s : slots) EXPECT_TRUE(adopted->is_allocated(s));
  int fresh = -1;
  ASSERT_TRUE(state_cache_allocate_slot(*adopted, &fresh).is_ok());
  EXPECT_NE(fresh, slots[0]);
  EXPECT_NE(fresh, slots[1]);
  ASSERT_TRUE(state_cache_free_slot(*adopted, fresh).is_ok());
  TwinRun run(*owner, *adopted, 9);
  for (int step = 0; step < 6; ++step) ASSERT_NO_FATAL_FAILURE(run.step(slots, 1, {1, 1}));
}

TEST(CacheView, AdoptRefusesACorruptAllocatedFlag) {
  const StateCacheConfig c =
      small_config(LayerKind::kMamba2, DecodeMode::kReplay, CheckpointPrecision::kFp32);
  CallerBuffers mem(c);  // filled with 0xA5: not a flag
  std::unique_ptr<StateCache> view;
  const Status st = state_cache_create_view(c, mem.bindings, ViewInit::kAdopt, &view);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("allocated["), std::string::npos) << st.message();
  EXPECT_FALSE(view);
}

// Every wrong binding is refused with a message naming the buffer, and no cache is made.
TEST(CacheView, RefusesBadBindings) {
  const StateCacheConfig c =
      small_config(LayerKind::kMamba2, DecodeMode::kReplay, CheckpointPrecision::kFp32Fp8);
  CallerBuffers mem(c);
  CallerBuffers misaligned(c, 8);
  struct Case {
    std::string name;
    std::function<void(std::vector<CacheBufferBinding>&)> edit;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"missing", [](auto& b) { b.erase(b.begin() + 1); }, "ckpt_lo is not bound"},
      {"twice", [](auto& b) { b.push_back(b[0]); }, "ckpt_hi is bound twice"},
      {"null", [](auto& b) { b[2].data = nullptr; }, "ckpt_lo_scale is null"},
      {"short", [](auto& b) { b[3].bytes -= 1; }, "ring_vec has"},
      {"misaligned", [&](auto& b) { b[4] = misaligned.bindings[4]; }, "ring_key is not aligned"},
      {"extra", [](auto& b) { b.push_back({CacheBufferId::kState, b[0].data, b[0].bytes}); },
       "state is bound but this configuration has no such buffer"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    std::vector<CacheBufferBinding> b = mem.bindings;
    k.edit(b);
    std::unique_ptr<StateCache> view;
    const Status st = state_cache_create_view(c, b, ViewInit::kZero, &view);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(k.expect), std::string::npos) << st.message();
    EXPECT_FALSE(view);
  }
}

// Two copies of a one-row batch's inputs: rows 0 and 1 identical.
template <typename Tokens>
Tokens twice(Tokens t) {
  auto dup = [](std::vector<float>& v) { v.insert(v.end(), v.begin(), v.end()); };
  if constexpr (std::is_same_v<Tokens, testing::Mamba2Tokens>) {
    for (auto* v : {&t.x, &t.dt, &t.B, &t.C, &t.z}) dup(*v);
  } else {
    for (auto* v : {&t.q, &t.k, &t.v, &t.g, &t.beta}) dup(*v);
  }
  t.batch *= 2;
  return t;
}

// An engine copies slot `from` to slot `to` itself, through the buffer list: every buffer's
// slot region (layer by layer for per-layer buffers). Fed the same tokens, the two slots then
// give bit-identical outputs and states over several fold cycles.
TEST(CacheView, AnEngineCopiesASlotThroughTheBufferList) {
  for (const StateCacheConfig& c : every_small_config(Device::kCpu)) {
    SCOPED_TRACE(config_name(c));
    CallerBuffers mem(c);
    const auto view = make_view(c, mem.bindings, ViewInit::kZero);
    const int from = testing::allocate_slot(*view);
    Rng rng(31);
    std::vector<float> state(static_cast<std::size_t>(c.dims().state_elems()));
    for (int layer = 0; layer < c.num_layers; ++layer) {
      for (float& v : state) v = float(rng.normal(0.0, 0.5));
      ASSERT_TRUE(state_cache_load_state(*view, layer, from, state.data()).is_ok());
    }
    Rng prng(5);
    const auto params = testing::make_mamba2_layer(c.mamba2, {}, prng);
    auto step = [&](const std::vector<std::int32_t>& slots, bool dup) {
      std::vector<std::vector<std::uint8_t>> outs;
      for (int layer = 0; layer < c.num_layers; ++layer) {
        Status st;
        if (c.kind == LayerKind::kMamba2) {
          auto t = testing::make_mamba2_tokens(c.mamba2, 1, 1, c.input_dtype, true, {}, rng);
          auto call = testing::make_mamba2_call(*view, layer, slots, params, dup ? twice(t) : t);
          st = mamba2_decode(*view, call.args);
          outs.push_back(call.y.bytes());
        } else {
          auto t = testing::make_gdn_tokens(c.gdn, 1, 1, c.input_dtype, {}, rng);
          auto call = testing::make_gdn_call(*view, layer, slots, dup ? twice(t) : t, true, 0.0f);
          st = gdn_decode(*view, call.args);
          outs.push_back(call.o.bytes());
        }
        EXPECT_TRUE(st.is_ok()) << st.to_string();
      }
      EXPECT_TRUE(testing::commit(*view, slots, std::vector<std::int32_t>(slots.size(), 1)).is_ok());
      return outs;
    };
    for (int i = 0; i < 5; ++i) step({from}, false);  // mid-cycle: history in the ring
    const int to = 3;
    ASSERT_TRUE(state_cache_claim_slot(*view, to).is_ok());
    for (const CacheBufferSpec& s : specs_of(c)) {
      const std::int64_t outer = s.slot_axis == 1 ? s.shape[0] : 1;
      const std::int64_t region = s.bytes / (outer * c.capacity);
      auto* base = static_cast<char*>(view->buffer(s.id));
      for (std::int64_t o = 0; o < outer; ++o) {
        std::memcpy(base + (o * c.capacity + to) * region,
                    base + (o * c.capacity + from) * region, std::size_t(region));
      }
    }
    for (int i = 0; i < 2 * c.buffer_len; ++i) {
      for (const auto& out : step({from, to}, true)) {
        const std::size_t half = out.size() / 2;
        ASSERT_EQ(std::vector<std::uint8_t>(out.begin(), out.begin() + half),
                  std::vector<std::uint8_t>(out.begin() + half, out.end()))
            << "step " << i;
      }
    }
    std::vector<float> a, b;
    ASSERT_TRUE(testing::export_state(*view, 1, from, &a).is_ok());
    ASSERT_TRUE(testing::export_state(*view, 1, to, &b).is_ok());
    EXPECT_EQ(a, b);
  }
}

// ---- refusals at creation ----------------------------------------------------------------------

TEST(Creation, RefusesWhatNoBackendRuns) {
  struct Case {
    std::string name;
    std::function<void(StateCacheConfig&)> edit;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"zero_heads", [](auto& c) { c.mamba2.nheads = 0; }, "non-positive dimension"},
      {"groups", [](auto& c) { c.mamba2.ngroups = 3; }, "nheads must be a multiple of ngroups"},
      {"layers", [](auto& c) { c.num_layers = 0; }, "num_layers must be >= 1"},
      {"capacity", [](auto& c) { c.capacity = 0; }, "capacity must be >= 1"},
      {"input_fp8", [](auto& c) { c.input_dtype = DType::kF8E4M3; }, "unsupported input dtype f8e4m3"},
      {"long_L", [](auto& c) { c.buffer_len = kMaxBufferLen + 1; }, "buffer_len (L) must be in [1, 4096]"},
      {"wide_T", [](auto& c) { c.max_spec_tokens = kMaxSpecTokens + 1; },
       "max_spec_tokens (T) must be in [1, 64]"},
      {"eager_state_fp8",
       [](auto& c) {
         c.mode = DecodeMode::kEager;
         c.state_dtype = DType::kF8E4M3;
       },
       "unsupported eager state dtype f8e4m3"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    StateCacheConfig c =
        small_config(LayerKind::kMamba2, DecodeMode::kReplay, CheckpointPrecision::kFp32);
    k.edit(c);
    std::unique_ptr<StateCache> cache;
    const Status st = state_cache_create(c, &cache);
    EXPECT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find(k.expect), std::string::npos) << st.message();
    EXPECT_EQ(st.message().find('\n'), std::string::npos);
    EXPECT_FALSE(cache);
    EXPECT_EQ(state_cache_can_implement(c).message(), st.message());
  }
}

TEST(Creation, ACudaCacheWithoutAGpuIsRefusedAtCreation) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is present";
  StateCacheConfig c = small_config(LayerKind::kGdn, DecodeMode::kReplay,
                                    CheckpointPrecision::kFp32, Device::kCuda);
  std::unique_ptr<StateCache> cache;
  const Status st = state_cache_create(c, &cache);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_FALSE(cache);
}

// ---- misuse a decode refuses, writing nothing ------------------------------------------------

class Misuse : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = small_config(LayerKind::kMamba2, DecodeMode::kReplay, CheckpointPrecision::kFp32);
    cache_ = testing::create_cache(config_);
    Rng rng(1);
    layer_ = testing::make_mamba2_layer(kM2, {}, rng);
    slot_ = testing::allocate_slot(*cache_);
  }
  testing::Mamba2Call call(int layer, int T = 1) {
    const auto tok = testing::make_mamba2_tokens(kM2, 1, T, config_.input_dtype, false, {}, rng_);
    return testing::make_mamba2_call(*cache_, layer, {slot_}, layer_, tok);
  }
  StateCacheConfig config_;
  std::unique_ptr<StateCache> cache_;
  testing::Mamba2Layer layer_;
  int slot_ = -1;
  Rng rng_{2};
};

TEST_F(Misuse, ASecondDecodeWithoutCommitIsRefused) {
  auto first = call(0);
  ASSERT_TRUE(mamba2_decode(*cache_, first.args).is_ok());
  const auto before = buffer_bytes(*cache_);
  auto second = call(0);
  const std::vector<std::uint8_t> untouched = second.y.bytes();
  const Status st = mamba2_decode(*cache_, second.args);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("already holds an uncommitted window of 1 tokens"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(buffer_bytes(*cache_), before);
  EXPECT_EQ(second.y.bytes(), untouched);
  // The other layer may still decode this window; after the commit, layer 0 decodes again.
  auto other = call(1);
  ASSERT_TRUE(mamba2_decode(*cache_, other.args).is_ok());
  ASSERT_TRUE(testing::commit(*cache_, {slot_}, {1}).is_ok());
  auto third = call(0);
  EXPECT_TRUE(mamba2_decode(*cache_, third.args).is_ok());
}

TEST_F(Misuse, ACommitBeforeEveryLayerDecodedIsRefused) {
  auto first = call(0, 2);
  ASSERT_TRUE(mamba2_decode(*cache_, first.args).is_ok());
  const auto before = buffer_bytes(*cache_);
  const Status st = testing::commit(*cache_, {slot_}, {1});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("layer 1 decoded 0 tokens of this window but layer 0 decoded 2"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(buffer_bytes(*cache_), before);
}

TEST_F(Misuse, BadLayerParametersAreRefused) {
  struct Case {
    std::string name;
    std::function<void(testing::Mamba2Layer&)> edit;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"A_positive", [](auto& p) { p.A[1] = 1.0f; }, "A[1] = 1.000000; A must be negative"},
      {"A_zero", [](auto& p) { p.A[0] = 0.0f; }, "A[0] = 0"},
      {"A_nan", [](auto& p) { p.A[2] = NAN; }, "A[2] = nan"},
      {"D_inf", [](auto& p) { p.D[3] = INFINITY; }, "D must be finite"},
      {"dt_bias_nan", [](auto& p) { p.dt_bias[0] = NAN; }, "dt_bias must be finite"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    testing::Mamba2Layer bad = layer_;
    k.edit(bad);
    const auto tok = testing::make_mamba2_tokens(kM2, 1, 1, config_.input_dtype, false, {}, rng_);
    auto c = testing::make_mamba2_call(*cache_, 0, {slot_}, bad, tok);
    const auto before = buffer_bytes(*cache_);
    const Status st = mamba2_decode(*cache_, c.args);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(k.expect), std::string::npos) << st.message();
    EXPECT_EQ(buffer_bytes(*cache_), before);
  }
}

TEST(MisuseGdn, BadDecayAndWriteStrengthAreRefused) {
  const StateCacheConfig c =
      small_config(LayerKind::kGdn, DecodeMode::kReplay, CheckpointPrecision::kFp32);
  const auto cache = testing::create_cache(c);
  const int slot = testing::allocate_slot(*cache);
  Rng rng(4);
  for (const std::string field : {"g", "beta"}) {
    SCOPED_TRACE(field);
    auto tok = testing::make_gdn_tokens(kGdn, 1, 1, c.input_dtype, {}, rng);
    if (field == "g") tok.g[1] = 0.5f;
    if (field == "beta") tok.beta[0] = 1.5f;
    auto call = testing::make_gdn_call(*cache, 0, {slot}, tok, true, 0.0f);
    const auto before = buffer_bytes(*cache);
    const Status st = gdn_decode(*cache, call.args);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("row 0: gdn_decode: " + field + "["), std::string::npos)
        << st.message();
    EXPECT_EQ(buffer_bytes(*cache), before);
  }
}

TEST_F(Misuse, ANonFiniteStateIsNotLoaded) {
  std::vector<float> state(static_cast<std::size_t>(config_.dims().state_elems()), 0.25f);
  state[17] = NAN;
  const auto before = buffer_bytes(*cache_);
  const Status st = state_cache_load_state(*cache_, 0, slot_, state.data());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("state[17] is nan"), std::string::npos) << st.message();
  EXPECT_EQ(buffer_bytes(*cache_), before);
}

TEST_F(Misuse, ClaimingASlotInUseIsRefused) {
  const Status st = state_cache_claim_slot(*cache_, slot_);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("is in use"), std::string::npos);
  EXPECT_EQ(state_cache_claim_slot(*cache_, 99).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(state_cache_claim_slot(*cache_, 4).is_ok());
  EXPECT_TRUE(cache_->is_allocated(4));
  EXPECT_EQ(cache_->free_slots(), config_.capacity - 2);
}

// ---- CUDA: the engine's own device memory and stream, a captured step ------------------------

#if defined(REPLAYSSM_WITH_CUDA)

TEST(CudaCacheView, MatchesTheOwningCacheBitForBit) {
  SKIP_WITHOUT_GPU();
  expect_view_matches_owner(Device::kCuda);
}

TEST(CudaCacheView, RefusesHostMemory) {
  SKIP_WITHOUT_GPU();
  const StateCacheConfig c = small_config(LayerKind::kMamba2, DecodeMode::kReplay,
                                          CheckpointPrecision::kFp32, Device::kCuda);
  CallerBuffers host(small_config(LayerKind::kMamba2, DecodeMode::kReplay,
                                  CheckpointPrecision::kFp32, Device::kCpu));
  std::unique_ptr<StateCache> view;
  const Status st = state_cache_create_view(c, host.bindings, ViewInit::kZero, &view);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("device memory"), std::string::npos) << st.message();
}

TEST(CudaCreation, RefusesWhatTheKernelsDoNotRun) {
  SKIP_WITHOUT_GPU();
  struct Case {
    std::string name;
    std::function<void(StateCacheConfig&)> edit;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"gdn_head_k_dim_1024",
       [](auto& c) {
         c.kind = LayerKind::kGdn;
         c.gdn.head_k_dim = 1024;
       },
       "unsupported gdn head_k_dim 1024; supported: 1 to 512"},
      {"f16_input", [](auto& c) { c.input_dtype = DType::kF16; }, "unsupported mamba2 input dtype f16"},
      {"mamba2_wide_window",
       [](auto& c) {
         c.mamba2 = Mamba2Shape{8, 64, 128, 2};
         c.max_spec_tokens = 9;
       },
       "verifies windows of up to 8 tokens"},
      {"gdn_f16_eager_state",
       [](auto& c) {
         c.kind = LayerKind::kGdn;
         c.mode = DecodeMode::kEager;
         c.state_dtype = DType::kF16;
       },
       "unsupported gdn eager state dtype f16; supported: f32, bf16"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    StateCacheConfig c = small_config(LayerKind::kMamba2, DecodeMode::kReplay,
                                      CheckpointPrecision::kFp32, Device::kCuda);
    k.edit(c);
    std::unique_ptr<StateCache> cache;
    const Status st = state_cache_create(c, &cache);
    EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.to_string();
    EXPECT_NE(st.message().find(k.expect), std::string::npos) << st.message();
    EXPECT_FALSE(cache);
  }
}

// An engine's step: its own device buffers, its own stream, every layer's verify and the commit
// captured into one CUDA graph, replayed; the owning cache runs the same steps directly.
TEST(CudaCacheView, ACapturedStepOnTheEnginesStreamMatches) {
  SKIP_WITHOUT_GPU();
  for (LayerKind kind : {LayerKind::kMamba2, LayerKind::kGdn}) {
    StateCacheConfig c = small_config(kind, DecodeMode::kReplay, CheckpointPrecision::kFp32Bf16,
                                      Device::kCuda);
    c.input_dtype = DType::kBF16;
    SCOPED_TRACE(config_name(c));
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    const auto owner = testing::create_cache(c);
    CallerBuffers mem(c);
    const auto view = make_view(c, mem.bindings, ViewInit::kZero, stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<std::int32_t> slots = admit(*owner, *view, 3, 41);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    // Fixed inputs for every step (the graph replays the same buffers).
    Rng rng(6);
    Rng prng(7);
    const int T = c.max_spec_tokens;
    std::vector<testing::Mamba2Call> m_owner, m_view;
    std::vector<testing::GdnCall> g_owner, g_view;
    for (int layer = 0; layer < c.num_layers; ++layer) {
      if (kind == LayerKind::kMamba2) {
        const auto params = testing::make_mamba2_layer(c.mamba2, {}, prng);
        const auto tok = testing::make_mamba2_tokens(c.mamba2, 3, T, c.input_dtype, true, {}, rng);
        m_owner.push_back(testing::make_mamba2_call(*owner, layer, slots, params, tok));
        m_view.push_back(testing::make_mamba2_call(*view, layer, slots, params, tok));
      } else {
        const auto tok = testing::make_gdn_tokens(c.gdn, 3, T, c.input_dtype, {}, rng);
        g_owner.push_back(testing::make_gdn_call(*owner, layer, slots, tok, true, 0.0f));
        g_view.push_back(testing::make_gdn_call(*view, layer, slots, tok, true, 0.0f));
      }
    }
    const std::vector<std::int32_t> accepted = {1, 3, 2};
    auto ids = testing::CacheBuffer::from_vector(Device::kCuda, slots);
    auto acc = testing::CacheBuffer::from_vector(Device::kCuda, accepted);
    CommitArgs commit;
    commit.batch = 3;
    commit.slot_ids = ids.as<const std::int32_t>();
    commit.accepted = acc.as<const std::int32_t>();
    auto step = [&](StateCache& cache, bool is_view, Stream s) -> Status {
      for (int layer = 0; layer < c.num_layers; ++layer) {
        const Status st = kind == LayerKind::kMamba2
                              ? mamba2_decode(cache, (is_view ? m_view : m_owner)[layer].args, s)
                              : gdn_decode(cache, (is_view ? g_view : g_owner)[layer].args, s);
        REPLAYSSM_RETURN_IF_ERROR(st);
      }
      return state_cache_commit(cache, commit, s);
    };
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    const Status captured = step(*view, true, stream);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_TRUE(captured.is_ok()) << captured.to_string();
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    const int steps = 3 * c.buffer_len;  // several folds
    for (int i = 0; i < steps; ++i) {
      ASSERT_TRUE(step(*owner, false, kDefaultStream).is_ok());
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    }
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(buffer_bytes(*owner), buffer_bytes(*view));
    for (int layer = 0; layer < c.num_layers; ++layer) {
      if (kind == LayerKind::kMamba2) {
        EXPECT_EQ(m_owner[layer].y.bytes(), m_view[layer].y.bytes());
      } else {
        EXPECT_EQ(g_owner[layer].o.bytes(), g_view[layer].o.bytes());
      }
    }
    std::vector<float> sa, sb;
    ASSERT_TRUE(testing::export_state(*owner, 0, slots[1], &sa).is_ok());
    ASSERT_TRUE(testing::export_state(*view, 0, slots[1], &sb).is_ok());
    EXPECT_EQ(sa, sb);
    EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
    EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  }
}

#endif  // REPLAYSSM_WITH_CUDA

}  // namespace
}  // namespace replayssm
