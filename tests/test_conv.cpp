// The fused causal conv1d of conv caches (StateCacheConfig::conv_kernel; ops.h, ConvInputs),
// both layer kinds, every checkpoint precision:
//   - a conv cache fed the pre-conv inputs decodes, bit for bit on the CPU, as a plain cache
//     fed the inputs this file convolves itself (its own loop of ops.h's formula), through
//     staggered rows, many fold cycles and verify windows with random acceptance; and within
//     the precision's bound of the float64 oracle fed those inputs;
//   - the conv window the cache keeps equals the last K - 1 accepted inputs;
//   - a forked, a truncated and a restored slot decode on as the original;
//   - bad calls are refused and change no byte.
// The CUDA cases (names containing "Cuda", label `cuda`) run the same workloads with the conv
// cache on the GPU, against the CPU plain cache and the oracle, at small and real shapes.

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "replayssm/prefix.h"
#include "testing/family.h"
#include "testing/require_gpu.h"
#include "testing/test_util.h"

namespace replayssm::testing {
namespace {

constexpr int kConvKernel = 4;

// ---- the conv, written here from ops.h's formula ---------------------------------------------

float conv_silu(const float* weight, float bias, const float* taps, int K) {
  float acc = bias;
  for (int i = 0; i < K; ++i) acc = std::fma(weight[i], taps[i], acc);
  return acc / (1.0f + std::exp(-acc));
}

// The convolved inputs, split into a family's token fields ([batch, T, ...] in channel order:
// Mamba-2 x, B, C; GDN q, k, v).
void put_convolved(Mamba2Tokens& tk, const StateCacheConfig& c, const std::vector<float>& post) {
  const int HP = c.mamba2.nheads * c.mamba2.head_dim, GN = c.mamba2.ngroups * c.mamba2.dstate;
  const int C = HP + 2 * GN, n = tk.batch * tk.T;
  for (int r = 0; r < n; ++r) {
    const float* row = post.data() + std::size_t(r) * C;
    std::copy(row, row + HP, tk.x.begin() + std::ptrdiff_t(r) * HP);
    std::copy(row + HP, row + HP + GN, tk.B.begin() + std::ptrdiff_t(r) * GN);
    std::copy(row + HP + GN, row + C, tk.C.begin() + std::ptrdiff_t(r) * GN);
  }
}
void put_convolved(GdnTokens& tk, const StateCacheConfig& c, const std::vector<float>& post) {
  const int QK = c.gdn.num_k_heads * c.gdn.head_k_dim, V = c.gdn.num_v_heads * c.gdn.head_v_dim;
  const int C = 2 * QK + V, n = tk.batch * tk.T;
  for (int r = 0; r < n; ++r) {
    const float* row = post.data() + std::size_t(r) * C;
    std::copy(row, row + QK, tk.q.begin() + std::ptrdiff_t(r) * QK);
    std::copy(row + QK, row + 2 * QK, tk.k.begin() + std::ptrdiff_t(r) * QK);
    std::copy(row + 2 * QK, row + C, tk.v.begin() + std::ptrdiff_t(r) * V);
  }
}

// A call that takes the pre-conv inputs instead of the convolved ones.
void use_conv(Mamba2Call& call, const ConvInputs& conv) {
  call.args.x = call.args.B = call.args.C = nullptr;
  call.args.conv = conv;
}
void use_conv(GdnCall& call, const ConvInputs& conv) {
  call.args.q = call.args.k = call.args.v = nullptr;
  call.args.conv = conv;
}

// One sequence's pre-conv inputs by position, what the test convolves from.
struct History {
  std::vector<std::vector<float>> rows;
  // Position p's row, zeros before the first token (the conv's left padding).
  std::vector<float> at(long p, int channels) const {
    return p < 0 ? std::vector<float>(std::size_t(channels), 0.0f) : rows[std::size_t(p)];
  }
};

struct ConvRun {
  LayerKind kind = LayerKind::kMamba2;
  Mamba2Shape mamba2{4, 16, 128, 2};
  GdnShape gdn{2, 4, 32, 16};
  CheckpointPrecision precision = CheckpointPrecision::kFp32;
  DType dtype = DType::kF32;
  int T = 1;            // widest window; windows of U{1..T} tokens, U{0..T} accepted (T > 1)
  int buffer_len = 4;
  int batch = 3;        // row r joins at step r·stagger
  int stagger = 3;
  int steps = 28;
  bool bias = true;
  Device conv_device = Device::kCpu;
  std::uint64_t seed = 7;
};

StateCacheConfig plain_config(const ConvRun& r) {
  StateCacheConfig c;
  c.kind = r.kind;
  c.mamba2 = r.mamba2;
  c.gdn = r.gdn;
  c.capacity = r.batch + 1;
  c.mode = DecodeMode::kReplay;
  c.input_dtype = r.dtype;
  c.buffer_len = r.buffer_len;
  c.max_spec_tokens = r.T;
  c.checkpoint = r.precision;
  return c;
}

double oracle_tolerance(const ConvRun& r) {
  if (r.precision == CheckpointPrecision::kFp32Fp8) return 8e-2;
  if (r.dtype != DType::kF32 || r.precision != CheckpointPrecision::kFp32) return 3e-2;
  return 1e-4;
}

// The run: a plain CPU cache fed the convolved inputs, a conv cache on conv_device fed the
// pre-conv ones (tokens `stride` = channels + 3 apart), the oracle fed the convolved ones.
template <typename Family>
void run_conv_case(const ConvRun& run) {
  const StateCacheConfig plain_cfg = plain_config(run);
  StateCacheConfig conv_cfg = plain_cfg;
  conv_cfg.conv_kernel = kConvKernel;
  conv_cfg.device = run.conv_device;
  const bool exact = run.conv_device == Device::kCpu;
  auto plain = create_cache(plain_cfg);
  auto conv = create_cache(conv_cfg);
  Rng rng(run.seed);
  FamilySettings settings;
  settings.cache = plain_cfg;
  settings.gate = true;
  const Family family(settings, rng);
  const int C = plain_cfg.conv_channels(), K = kConvKernel, stride = C + 3;
  std::vector<float> weight(std::size_t(C) * K), bias(std::size_t(C), 0.0f);
  for (float& w : weight) w = float(rng.normal(0.0, 0.5));
  if (run.bias) {
    for (float& b : bias) b = float(rng.normal(0.0, 0.3));
  }
  const auto weight_buf = CacheBuffer::from_vector(conv_cfg.device, weight);
  const auto bias_buf = CacheBuffer::from_vector(conv_cfg.device, bias);
  std::vector<int> slots;
  for (int b = 0; b < run.batch; ++b) {
    slots.push_back(allocate_slot(*plain));
    ASSERT_EQ(allocate_slot(*conv), slots.back());
  }
  std::vector<History> history(std::size_t(run.batch));
  std::vector<std::vector<double>> oracle_state(std::size_t(run.batch),
                                                std::vector<double>(family.state_elems(), 0.0));
  const std::size_t out_per_token = family.out_per_token();
  double worst_oracle = 0.0;
  for (int step = 0; step < run.steps; ++step) {
    const int T = run.T == 1 ? 1 : rng.uniform_int(1, run.T);
    std::vector<std::int32_t> ids(std::size_t(run.batch), -1);
    for (int b = 0; b < run.batch; ++b) {
      if (step >= b * run.stagger) ids[std::size_t(b)] = slots[std::size_t(b)];
    }
    // Pre-conv inputs (exact in the input dtype) and the convolved ones.
    std::vector<float> pre(std::size_t(run.batch) * T * stride, 0.0f);
    for (float& v : pre) v = round_to(run.dtype, float(rng.normal()));
    std::vector<float> post(std::size_t(run.batch) * T * C, 0.0f);
    for (int b = 0; b < run.batch; ++b) {
      if (ids[std::size_t(b)] < 0) continue;
      const long committed = long(history[std::size_t(b)].rows.size());
      for (int t = 0; t < T; ++t) {
        for (int c = 0; c < C; ++c) {
          float taps[kConvKernel];
          for (int i = 0; i < K; ++i) {
            const int d = t - (K - 1) + i;
            taps[i] = d >= 0 ? pre[(std::size_t(b) * T + std::size_t(d)) * stride + std::size_t(c)]
                             : history[std::size_t(b)].at(committed + d, C)[std::size_t(c)];
          }
          post[(std::size_t(b) * T + std::size_t(t)) * C + std::size_t(c)] = round_to(
              run.dtype, conv_silu(&weight[std::size_t(c) * K], bias[std::size_t(c)], taps, K));
        }
      }
    }
    auto tokens = family.tokens(run.batch, T, rng);
    put_convolved(tokens, plain_cfg, post);
    const auto plain_call = family.call(*plain, 0, ids, tokens);
    auto conv_call = family.call(*conv, 0, ids, tokens);
    const auto pre_buf = CacheBuffer::from_host(conv_cfg.device, encode(run.dtype, pre).data(),
                                                encode(run.dtype, pre).size());
    use_conv(conv_call, {pre_buf.get(), stride, weight_buf.as<float>(),
                         run.bias ? bias_buf.as<float>() : nullptr});
    ASSERT_TRUE(Family::decode(*plain, plain_call).is_ok());
    const Status st = Family::decode(*conv, conv_call);
    ASSERT_TRUE(st.is_ok()) << st.message();
    const std::vector<float> want = plain_call.output(), got = conv_call.output();
    for (int b = 0; b < run.batch; ++b) {
      if (ids[std::size_t(b)] < 0) continue;
      const std::size_t lo = std::size_t(b) * T * out_per_token, hi = lo + T * out_per_token;
      if (exact) {
        ASSERT_EQ(0, std::memcmp(&got[lo], &want[lo], (hi - lo) * sizeof(float)))
            << "step " << step << " row " << b;
      } else {
        // Two backends' expf and fold orders: fp32 throughout agrees to 1e-4; a rounded
        // checkpoint or bf16 activations round those differences (measured up to 1.2e-4
        // for a shared bf16 checkpoint with fp32 activations).
        const bool fp32 = run.dtype == DType::kF32 && run.precision == CheckpointPrecision::kFp32;
        ASSERT_LE(max_rel_diff(got, want, lo, hi), fp32 ? 1e-4 : 2e-2)
            << "step " << step << " row " << b;
      }
      // The float64 oracle over the window from the committed state.
      std::vector<double> S = oracle_state[std::size_t(b)], out(out_per_token);
      std::vector<float> got_row(got.begin() + std::ptrdiff_t(lo), got.begin() + std::ptrdiff_t(hi));
      std::vector<double> ref;
      for (int t = 0; t < T; ++t) {
        family.oracle(0, S.data(), tokens, b, t, out.data());
        ref.insert(ref.end(), out.begin(), out.end());
      }
      const double err = rel_error(got_row, ref);
      worst_oracle = std::max(worst_oracle, err);
      ASSERT_LE(err, oracle_tolerance(run)) << "step " << step << " row " << b;
    }
    // Accept k tokens of each row; the oracle's state and the history follow.
    std::vector<std::int32_t> accepted(std::size_t(run.batch), 0);
    for (int b = 0; b < run.batch; ++b) {
      if (ids[std::size_t(b)] < 0) continue;
      const int k = run.T == 1 ? 1 : rng.uniform_int(0, T);
      accepted[std::size_t(b)] = k;
      std::vector<double> out(out_per_token);
      for (int t = 0; t < k; ++t) {
        family.oracle(0, oracle_state[std::size_t(b)].data(), tokens, b, t, out.data());
        const float* row = &pre[(std::size_t(b) * T + std::size_t(t)) * stride];
        history[std::size_t(b)].rows.emplace_back(row, row + C);
      }
    }
    ASSERT_TRUE(commit(*plain, ids, accepted).is_ok());
    ASSERT_TRUE(commit(*conv, ids, accepted).is_ok());
  }
  // The window each slot keeps: its last K - 1 accepted inputs.
  for (int b = 0; b < run.batch; ++b) {
    std::vector<float> want;
    const long end = long(history[std::size_t(b)].rows.size());
    for (long p = end - (K - 1); p < end; ++p) {
      const auto row = history[std::size_t(b)].at(p, C);
      want.insert(want.end(), row.begin(), row.end());
    }
    std::vector<std::uint8_t> raw(want.size() * dtype_size(run.dtype));
    ASSERT_TRUE(state_cache_export_conv_window(*conv, 0, slots[std::size_t(b)], raw.data()).is_ok());
    EXPECT_EQ(decode(run.dtype, raw.data(), want.size()), want) << "row " << b;
  }
  ::testing::Test::RecordProperty("worst_oracle_error", std::to_string(worst_oracle));
}

void run_conv(const ConvRun& run) {
  with_family(run.kind, [&](auto family) { run_conv_case<typename decltype(family)::type>(run); });
}

struct ConvCase {
  LayerKind kind;
  CheckpointPrecision precision;
  DType dtype;
  int T;
};
void PrintTo(const ConvCase& c, std::ostream* os) {
  *os << kind_tag(c.kind) << "_" << precision_tag(c.precision) << "_" << dtype_tag(c.dtype)
      << "_T" << c.T;
}
std::vector<ConvCase> conv_cases() {
  std::vector<ConvCase> out;
  for (LayerKind kind : {LayerKind::kMamba2, LayerKind::kGdn}) {
    for (CheckpointPrecision p :
         {CheckpointPrecision::kFp32, CheckpointPrecision::kBf16, CheckpointPrecision::kFp32Bf16,
          CheckpointPrecision::kFp32Fp8}) {
      out.push_back({kind, p, DType::kF32, 1});
      out.push_back({kind, p, DType::kBF16, 1});
      out.push_back({kind, p, DType::kBF16, 3});
    }
  }
  return out;
}
std::string conv_case_name(const ::testing::TestParamInfo<ConvCase>& info) {
  std::ostringstream os;
  PrintTo(info.param, &os);
  std::string s = os.str();
  std::replace_if(s.begin(), s.end(), [](char ch) { return !std::isalnum(ch); }, '_');
  return s;
}

ConvRun run_of(const ConvCase& c, Device device) {
  ConvRun r;
  r.kind = c.kind;
  r.precision = c.precision;
  r.dtype = c.dtype;
  r.T = c.T;
  r.conv_device = device;
  r.steps = 7 * r.buffer_len;  // several folds per row at T = 1, more with windows
  return r;
}

class ConvFusion : public ::testing::TestWithParam<ConvCase> {};

TEST_P(ConvFusion, EqualsConvolvedInputs) { run_conv(run_of(GetParam(), Device::kCpu)); }

TEST_P(ConvFusion, CudaEqualsCpu) {
  SKIP_WITHOUT_GPU();
  run_conv(run_of(GetParam(), Device::kCuda));
}

INSTANTIATE_TEST_SUITE_P(All, ConvFusion, ::testing::ValuesIn(conv_cases()), conv_case_name);

TEST(ConvFusion, NoBiasAndOtherKernelWidths) {
  ConvRun r;
  r.bias = false;
  r.steps = 12;
  run_conv(r);
  r.kind = LayerKind::kGdn;
  run_conv(r);
}

// The real shapes on the GPU (super120b's Mamba-2 layer, qwen35-4b's GDN layer): two rows.
TEST(ConvFusion, CudaRealShapes) {
  SKIP_WITHOUT_GPU();
  for (LayerKind kind : {LayerKind::kMamba2, LayerKind::kGdn}) {
    for (CheckpointPrecision p : {CheckpointPrecision::kFp32, CheckpointPrecision::kFp32Bf16}) {
      ConvRun r;
      r.kind = kind;
      r.mamba2 = {128, 64, 128, 8};
      r.gdn = {16, 32, 128, 128};
      r.precision = p;
      r.dtype = DType::kBF16;
      r.T = 2;
      r.buffer_len = 8;
      r.batch = 2;
      r.stagger = 5;
      r.steps = 24;
      r.conv_device = Device::kCuda;
      SCOPED_TRACE(kind_tag(kind) + " " + precision_tag(p));
      run_conv(r);
    }
  }
}

// ---- prefix ops and refusals on a conv cache -------------------------------------------------

// Slots of one Mamba-2 conv cache decoding the same pre-conv inputs.
struct ConvSlots {
  StateCacheConfig config;
  std::unique_ptr<StateCache> cache;
  Mamba2Family family;
  std::vector<float> weight;
  Rng rng;

  static StateCacheConfig make_config(Device device) {
    ConvRun r;
    r.batch = 4;
    StateCacheConfig c = plain_config(r);
    c.conv_kernel = kConvKernel;
    c.device = device;
    return c;
  }
  ConvSlots(Device device, Rng seed_rng)
      : config(make_config(device)), cache(create_cache(config)),
        family(FamilySettings{config, {}, true}, seed_rng), rng(11) {
    weight.resize(std::size_t(config.conv_channels()) * kConvKernel);
    for (float& w : weight) w = float(rng.normal(0.0, 0.5));
  }
  // One token of the same inputs into every listed slot; each slot's outputs.
  std::vector<std::vector<float>> step(const std::vector<std::int32_t>& slot_ids) {
    const int C = config.conv_channels(), n = int(slot_ids.size());
    std::vector<float> one(static_cast<std::size_t>(C), 0.0f);
    for (float& v : one) v = float(rng.normal());
    std::vector<float> pre;
    for (int b = 0; b < n; ++b) pre.insert(pre.end(), one.begin(), one.end());
    auto tokens = family.tokens(1, 1, rng);
    Mamba2Tokens all = tokens;
    for (int b = 1; b < n; ++b) {
      all.dt.insert(all.dt.end(), tokens.dt.begin(), tokens.dt.end());
      all.z.insert(all.z.end(), tokens.z.begin(), tokens.z.end());
    }
    all.batch = n;
    all.x.assign(std::size_t(n) * config.mamba2.nheads * config.mamba2.head_dim, 0.0f);
    all.B.assign(std::size_t(n) * config.mamba2.ngroups * config.mamba2.dstate, 0.0f);
    all.C = all.B;
    auto call = family.call(*cache, 0, slot_ids, all);
    const auto pre_buf = CacheBuffer::from_vector(config.device, pre);
    const auto w_buf = CacheBuffer::from_vector(config.device, weight);
    use_conv(call, {pre_buf.get(), 0, w_buf.as<float>(), nullptr});
    throw_if_error(mamba2_decode(*cache, call.args), "decode");
    throw_if_error(commit(*cache, slot_ids, std::vector<std::int32_t>(std::size_t(n), 1)),
                   "commit");
    const std::vector<float> out = call.output();
    std::vector<std::vector<float>> rows;
    const std::size_t per = out.size() / std::size_t(n);
    for (int b = 0; b < n; ++b) {
      rows.emplace_back(out.begin() + std::ptrdiff_t(b * per),
                        out.begin() + std::ptrdiff_t((b + 1) * per));
    }
    return rows;
  }
};

void expect_prefix_ops_keep_the_window(Device device) {
  ConvSlots s(device, Rng(3));
  const int a = allocate_slot(*s.cache), fork_dst = allocate_slot(*s.cache);
  const int restored = allocate_slot(*s.cache), other = allocate_slot(*s.cache);
  for (int i = 0; i < 6; ++i) s.step({a});
  const std::uint32_t p = cursor_committed(*s.cache, a);
  // Fork at p, then run `a` 3 tokens on and truncate it back to p.
  const auto ids = CacheBuffer::from_vector(device, std::vector<std::int32_t>{a});
  const auto dsts = CacheBuffer::from_vector(device, std::vector<std::int32_t>{fork_dst});
  const auto pos = CacheBuffer::from_vector(device, std::vector<std::uint32_t>{p});
  ASSERT_TRUE(state_cache_fork(*s.cache, {1, ids.as<std::int32_t>(), dsts.as<std::int32_t>(),
                                          pos.as<std::uint32_t>()})
                  .is_ok());
  // An entry at p: the state (materialize) and the conv window, restored into another slot.
  const std::size_t state_elems = std::size_t(s.config.dims().state_elems());
  CacheBuffer states(device, state_elems * sizeof(float));
  ASSERT_TRUE(state_cache_materialize(*s.cache, {1, ids.as<std::int32_t>(),
                                                 pos.as<std::uint32_t>(), states.as<float>()})
                  .is_ok());
  std::vector<std::uint8_t> window(std::size_t(kConvKernel - 1) * s.config.conv_channels() *
                                   dtype_size(s.config.input_dtype));
  ASSERT_TRUE(state_cache_export_conv_window(*s.cache, 0, a, window.data()).is_ok());
  RestoreArgs restore;
  restore.slot = restored;
  restore.position = p;
  std::vector<float> host_states(state_elems);
  states.download(host_states.data(), state_elems * sizeof(float));
  restore.states = host_states.data();
  restore.conv_window = window.data();
  if (device == Device::kCpu) {  // CUDA takes device states; host ones work for both
    ASSERT_TRUE(state_cache_restore(*s.cache, restore).is_ok());
  } else {
    restore.states = states.as<float>();
    ASSERT_TRUE(state_cache_restore(*s.cache, restore).is_ok());
  }
  // Two tokens: `a` keeps p in reach (its next fold is due at committed = 8, L = 4).
  for (int i = 0; i < 2; ++i) s.step({a, other});
  ASSERT_TRUE(state_cache_truncate(*s.cache, {1, ids.as<std::int32_t>(), pos.as<std::uint32_t>()})
                  .is_ok());
  // All three now stand at p with the same history: they decode alike (the fork and the
  // truncated slot bit for bit; the restored one, whose checkpoint is the state at p where the
  // others replay records onto an older one, to rounding), and unlike `other`.
  for (int i = 0; i < 2 * s.config.buffer_len; ++i) {
    const auto out = s.step({a, fork_dst, restored, other});
    ASSERT_EQ(out[0], out[1]) << "fork, token " << i;
    ASSERT_LE(max_rel_diff(out[2], out[0], 0, out[0].size()), 1e-5) << "restore, token " << i;
    ASSERT_NE(out[0], out[3]) << "a slot with another history, token " << i;
  }
}

TEST(ConvFusion, ForkTruncateRestoreKeepTheWindow) {
  expect_prefix_ops_keep_the_window(Device::kCpu);
}
TEST(ConvFusion, CudaForkTruncateRestoreKeepTheWindow) {
  SKIP_WITHOUT_GPU();
  expect_prefix_ops_keep_the_window(Device::kCuda);
}

TEST(ConvFusion, LoadedWindowIsWhatTheConvReads) {
  // Loading the window of a sequence equals having decoded its inputs.
  ConvSlots s(Device::kCpu, Rng(5));
  const int a = allocate_slot(*s.cache), b = allocate_slot(*s.cache);
  for (int i = 0; i < 5; ++i) s.step({a});
  std::vector<float> state;
  ASSERT_TRUE(export_state(*s.cache, 0, a, &state).is_ok());
  std::vector<std::uint8_t> window(std::size_t(kConvKernel - 1) * s.config.conv_channels() *
                                   dtype_size(s.config.input_dtype));
  ASSERT_TRUE(state_cache_export_conv_window(*s.cache, 0, a, window.data()).is_ok());
  ASSERT_TRUE(state_cache_load_state(*s.cache, 0, b, state.data()).is_ok());
  ASSERT_TRUE(state_cache_load_conv_window(*s.cache, 0, b, window.data()).is_ok());
  for (int i = 0; i < 6; ++i) {
    const auto out = s.step({a, b});
    ASSERT_EQ(out[0], out[1]) << "token " << i;
  }
}

TEST(ConvFusion, RefusalsChangeNothing) {
  ConvSlots s(Device::kCpu, Rng(9));
  const int a = allocate_slot(*s.cache);
  for (int i = 0; i < 3; ++i) s.step({a});
  const CacheBytes before = snapshot(*s.cache);
  const auto tokens = s.family.tokens(1, 1, s.rng);
  const std::vector<float> pre(std::size_t(s.config.conv_channels()), 0.5f);
  const auto pre_buf = CacheBuffer::from_vector(Device::kCpu, pre);
  const auto w_buf = CacheBuffer::from_vector(Device::kCpu, s.weight);
  auto call = s.family.call(*s.cache, 0, {a}, tokens);
  // The convolved inputs on a conv cache.
  EXPECT_FALSE(mamba2_decode(*s.cache, call.args).is_ok());
  // Both.
  call.args.conv = {pre_buf.get(), 0, w_buf.as<float>(), nullptr};
  EXPECT_FALSE(mamba2_decode(*s.cache, call.args).is_ok());
  // No weights, a short stride, non-finite weights.
  use_conv(call, {pre_buf.get(), 0, nullptr, nullptr});
  EXPECT_FALSE(mamba2_decode(*s.cache, call.args).is_ok());
  use_conv(call, {pre_buf.get(), 5, w_buf.as<float>(), nullptr});
  EXPECT_FALSE(mamba2_decode(*s.cache, call.args).is_ok());
  std::vector<float> bad = s.weight;
  bad[7] = NAN;
  use_conv(call, {pre_buf.get(), 0, bad.data(), nullptr});
  EXPECT_FALSE(mamba2_decode(*s.cache, call.args).is_ok());
  // Window calls: null window, free slot, bad layer; restore without a window.
  EXPECT_FALSE(state_cache_load_conv_window(*s.cache, 0, a, nullptr).is_ok());
  std::vector<std::uint8_t> window(std::size_t(kConvKernel - 1) * s.config.conv_channels() * 4);
  EXPECT_FALSE(state_cache_load_conv_window(*s.cache, 0, a + 1, window.data()).is_ok());
  EXPECT_FALSE(state_cache_export_conv_window(*s.cache, 1, a, window.data()).is_ok());
  std::vector<float> states(std::size_t(s.config.dims().state_elems()), 0.0f);
  RestoreArgs restore;
  restore.slot = a;
  restore.states = states.data();
  EXPECT_FALSE(state_cache_restore(*s.cache, restore).is_ok());
  EXPECT_EQ(diff(before, snapshot(*s.cache)), "");

  // Conv inputs on a plain cache; conv_kernel out of range or on an eager cache.
  StateCacheConfig plain = s.config;
  plain.conv_kernel = 0;
  auto plain_cache = create_cache(plain);
  const int p = allocate_slot(*plain_cache);
  auto plain_call = s.family.call(*plain_cache, 0, {p}, tokens);
  plain_call.args.conv = {pre_buf.get(), 0, w_buf.as<float>(), nullptr};
  EXPECT_FALSE(mamba2_decode(*plain_cache, plain_call.args).is_ok());
  EXPECT_FALSE(state_cache_load_conv_window(*plain_cache, 0, p, window.data()).is_ok());
  restore.slot = p;
  restore.conv_window = window.data();
  EXPECT_FALSE(state_cache_restore(*plain_cache, restore).is_ok());
  for (int k : {1, kMaxConvKernel + 1, -1}) {
    StateCacheConfig c = s.config;
    c.conv_kernel = k;
    EXPECT_FALSE(state_cache_can_implement(c).is_ok()) << k;
  }
  StateCacheConfig eager = s.config;
  eager.mode = DecodeMode::kEager;
  EXPECT_FALSE(state_cache_can_implement(eager).is_ok());
}

}  // namespace
}  // namespace replayssm::testing
