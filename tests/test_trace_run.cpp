// Layer traces end to end: the golden traces (data/*_small.safetensors, computed independently
// in float64 by the token-by-token recurrence) must come out of every decode mode, and every
// kind of bad input must give a clean error naming what is wrong.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "engine/activations.h"
#include "engine/synthetic_trace.h"
#include "engine/trace_run.h"
#include "io/safetensors.h"
#include "io/trace.h"
#include "replayssm/ops.h"
#include "replayssm/version.h"
#include "testing/test_util.h"

namespace replayssm {
namespace {

using testing::rel_error;

struct Golden {
  const char* name;      // "mamba2" / "gdn"
  const char* out_name;  // "y" / "o"
};
const Golden kMamba2{"mamba2", "y"};
const Golden kGdn{"gdn", "o"};

std::string trace_path(const Golden& g) {
  return std::string("data/") + g.name + "_small.safetensors";
}
std::string expected_path(const Golden& g) {
  return std::string("data/") + g.name + "_small.expected.safetensors";
}

// A scratch file name unique to this test and process (ctest may run tests in parallel).
std::string temp_path(const std::string& tag) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string("replayssm_") + info->test_suite_name() + "_" + info->name() +
                     "_" + tag + "_" + std::to_string(::getpid()) + ".safetensors";
  std::replace(name.begin(), name.end(), '/', '_');
  return (std::filesystem::temp_directory_path() / name).string();
}

// How a case runs, and the relative error its outputs and final state may show against the
// float64 golden values (max |a − b| / max |ref| over the tensor).
struct RunCase {
  std::string label;
  TraceRunOptions options;
  double out_tol;
  double state_tol;
};

// fp32 checkpoints differ from the float64 recurrence by fp32 rounding only: measured ≈ 3e-7
// on both traces; 5e-6 leaves room for another summation order (CUDA) and still catches any
// algorithmic slip (a wrong decay or a dropped token is > 1e-3 here).
constexpr double kFp32Tol = 5e-6;
// A bf16 read copy: each checkpoint element an output reads carries <= 2^-9 ≈ 2e-3 relative
// rounding; measured 1.7e-3 to 2.5e-3 on the outputs. 1e-2 = 5 units of bf16 rounding.
constexpr double kBf16Tol = 1e-2;
// The shared bf16 checkpoint rounds the state itself at every fold, and that rounding stays
// in the state: at L = 4 the 24-token traces fold 6 times, so up to 6 · 2^-9 ≈ 1.2e-2;
// measured 7.4e-3 (Mamba-2) and 2.6e-3 (GDN).
constexpr double kSharedBf16StateTol = 1.5e-2;
// An fp8 e4m3 read copy: 3 mantissa bits, <= 2^-4 relative per element (per-row scales);
// measured 1.6e-2 to 2.4e-2 on the outputs. 0.1 is under two units of fp8 rounding.
constexpr double kFp8Tol = 1e-1;

std::vector<RunCase> golden_cases() {
  std::vector<RunCase> cases;
  const auto add = [&cases](std::string label, DecodeMode mode, int L, int T, std::uint64_t seed,
                            CheckpointPrecision checkpoint) {
    TraceRunOptions o;
    o.mode = mode;
    o.buffer_len = L;
    o.spec_tokens = T;
    o.accept_seed = seed;
    o.checkpoint = checkpoint;
    double out_tol = kFp32Tol, state_tol = kFp32Tol;
    switch (checkpoint) {
      case CheckpointPrecision::kFp32: break;
      case CheckpointPrecision::kBf16:
        out_tol = kBf16Tol;
        state_tol = kSharedBf16StateTol;
        break;
      case CheckpointPrecision::kFp32Bf16: out_tol = kBf16Tol; break;  // state is the fp32 master
      case CheckpointPrecision::kFp32Fp8: out_tol = kFp8Tol; break;
    }
    cases.push_back({std::move(label), o, out_tol, state_tol});
  };
  const auto fp32 = CheckpointPrecision::kFp32;
  add("eager", DecodeMode::kEager, 16, 1, 0, fp32);
  // Per-draft state: T + 1 state copies per slot, the commit selects the accepted one.
  for (int T : {2, 4}) {
    for (std::uint64_t seed : {1u, 7u}) {
      add("eager_spec_T" + std::to_string(T) + "_seed" + std::to_string(seed), DecodeMode::kEager,
          16, T, seed, fp32);
    }
  }
  for (int L : {1, 2, 16}) add("replay_L" + std::to_string(L), DecodeMode::kReplay, L, 1, 0, fp32);
  for (int T : {2, 4}) {
    for (std::uint64_t seed : {1u, 7u}) {
      for (int L : {2, 16}) {
        add("spec_T" + std::to_string(T) + "_seed" + std::to_string(seed) + "_L" +
                std::to_string(L),
            DecodeMode::kReplay, L, T, seed, fp32);
      }
    }
  }
  for (CheckpointPrecision c : {CheckpointPrecision::kBf16, CheckpointPrecision::kFp32Bf16,
                                CheckpointPrecision::kFp32Fp8}) {
    std::string name = checkpoint_precision_name(c);
    std::replace(name.begin(), name.end(), '+', '_');
    // L = 4: the 24-token traces fold 6 times, so the low copy is written and read often.
    add("replay_" + name + "_L4", DecodeMode::kReplay, 4, 1, 0, c);
    add("spec_" + name + "_T4_L4", DecodeMode::kReplay, 4, 4, 3, c);
  }
  return cases;
}

struct GoldenParam {
  Golden golden;
  Device device;
  RunCase run;
};

std::string param_name(const GoldenParam& p) {
  return std::string(p.golden.name) + "_" + device_name(p.device) + "_" + p.run.label;
}
// gtest prints parameters in ctest's test names: the name, not a byte dump.
void PrintTo(const GoldenParam& p, std::ostream* os) { *os << param_name(p); }

// CUDA cases exist in CUDA builds only, and skip themselves without a GPU.
std::vector<Device> devices() {
#if defined(REPLAYSSM_WITH_CUDA)
  return {Device::kCpu, Device::kCuda};
#else
  return {Device::kCpu};
#endif
}

std::vector<GoldenParam> golden_params() {
  std::vector<GoldenParam> params;
  for (Device device : devices()) {
    for (const Golden& g : {kMamba2, kGdn}) {
      for (const RunCase& c : golden_cases()) params.push_back({g, device, c});
    }
  }
  return params;
}

class GoldenTrace : public ::testing::TestWithParam<GoldenParam> {};

TEST_P(GoldenTrace, ReproducesExpectedOutputsAndState) {
  const GoldenParam& p = GetParam();
  if (p.device == Device::kCuda && !cuda_available()) GTEST_SKIP() << "no CUDA device";
  LayerTrace trace;
  Status s = trace_load(trace_path(p.golden), &trace);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  SafetensorsFile expected;
  s = safetensors_read(expected_path(p.golden), &expected);
  ASSERT_TRUE(s.is_ok()) << s.to_string();

  TraceRunOptions options = p.run.options;
  options.device = p.device;
  TraceRunResult result;
  s = trace_run(trace, options, &result);
  ASSERT_TRUE(s.is_ok()) << s.to_string();

  const std::vector<double> ref_out = expected.find(p.golden.out_name)->to_f64();
  const std::vector<double> ref_state = expected.find("state")->to_f64();
  ASSERT_EQ(result.out.size(), ref_out.size());
  ASSERT_EQ(result.state.size(), ref_state.size());
  ASSERT_TRUE(testing::all_finite(result.out));
  ASSERT_TRUE(testing::all_finite(result.state));
  EXPECT_LE(rel_error(result.out, ref_out), p.run.out_tol);
  EXPECT_LE(rel_error(result.state, ref_state), p.run.state_tol);
  if (options.spec_tokens > 1) {
    EXPECT_LT(result.decode_steps, trace.num_steps()) << "no window accepted more than 1 token";
  } else {
    EXPECT_EQ(result.decode_steps, trace.num_steps());
  }
}

INSTANTIATE_TEST_SUITE_P(AllModes, GoldenTrace, ::testing::ValuesIn(golden_params()),
                         [](const ::testing::TestParamInfo<GoldenParam>& param_info) {
                           return param_name(param_info.param);
                         });

// The acceptance pattern is the documented draw (engine/trace_run.h), so other
// implementations can reproduce a run: replaying the draw predicts the number of steps.
TEST(TraceRun, AcceptancePatternIsTheDocumentedDraw) {
  LayerTrace trace;
  ASSERT_TRUE(trace_load(trace_path(kGdn), &trace).is_ok());
  for (int T : {2, 3, 4}) {
    for (std::uint64_t seed : {0u, 5u, 99u}) {
      std::mt19937_64 accept(seed);
      std::vector<int> pos(static_cast<std::size_t>(trace.batch()), 0);
      int steps = 0;
      for (bool active = true; active; ++steps) {
        active = false;
        for (int& p : pos) {
          const int left = trace.num_steps() - p;
          if (left == 0) continue;
          p += 1 + static_cast<int>(accept() % static_cast<std::uint64_t>(std::min(T, left)));
          active = true;
        }
      }
      --steps;  // the last pass found every row done
      TraceRunOptions o;
      o.spec_tokens = T;
      o.accept_seed = seed;
      TraceRunResult r;
      ASSERT_TRUE(trace_run(trace, o, &r).is_ok());
      EXPECT_EQ(r.decode_steps, steps) << "T " << T << " seed " << seed;
    }
  }
}

// Paths the small golden traces do not cover: Mamba-2's z gate and bf16 activations, on a
// generated trace, replay against eager (same rounded inputs, so only rounding order and the
// bf16 output differ).
TEST(TraceRun, GatedMamba2AndBf16ActivationsMatchEager) {
  SyntheticTraceOptions so;
  so.num_steps = 20;
  so.batch = 3;
  so.seed = 11;
  LayerTrace trace;
  ASSERT_TRUE(synthetic_trace_mamba2({8, 16, 32, 2}, so, &trace).is_ok());
  ASSERT_FALSE(trace.mamba2.z.empty());
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    TraceRunOptions eager;
    eager.mode = DecodeMode::kEager;
    eager.input_dtype = dtype;
    TraceRunOptions replay;
    replay.buffer_len = 4;
    replay.spec_tokens = 3;
    replay.input_dtype = dtype;
    TraceRunResult a, b;
    ASSERT_TRUE(trace_run(trace, eager, &a).is_ok());
    ASSERT_TRUE(trace_run(trace, replay, &b).is_ok());
    // bf16 outputs: both round the same fp32 value to bf16 (≤ 2^-9 relative) unless the two
    // fp32 values straddle a rounding boundary: one bf16 ulp, 2^-8 of the largest output.
    const double tol = dtype == DType::kF32 ? kFp32Tol : 8e-3;
    std::vector<double> ref(a.out.begin(), a.out.end());
    EXPECT_LE(rel_error(b.out, ref), tol) << dtype_name(dtype);
    std::vector<double> ref_state(a.state.begin(), a.state.end());
    EXPECT_LE(rel_error(b.state, ref_state), kFp32Tol) << dtype_name(dtype);
  }
}

TEST(TraceRun, SaveWritesOutputsStateAndMetadata) {
  LayerTrace trace;
  ASSERT_TRUE(trace_load(trace_path(kMamba2), &trace).is_ok());
  TraceRunOptions o;
  o.buffer_len = 8;
  o.spec_tokens = 2;
  o.accept_seed = 4;
  o.checkpoint = CheckpointPrecision::kFp32Bf16;
  TraceRunResult r;
  ASSERT_TRUE(trace_run(trace, o, &r).is_ok());
  const std::string path = temp_path("out");
  ASSERT_TRUE(trace_run_save(path, trace, o, r).is_ok());
  SafetensorsFile file;
  ASSERT_TRUE(safetensors_read(path, &file).is_ok());
  std::filesystem::remove(path);
  ASSERT_NE(file.find("y"), nullptr);
  ASSERT_NE(file.find("state"), nullptr);
  EXPECT_EQ(file.find("y")->shape, (std::vector<std::int64_t>{24, 2, 4, 8}));
  EXPECT_EQ(file.find("state")->shape, (std::vector<std::int64_t>{2, 4, 8, 16}));
  EXPECT_EQ(file.find("y")->to_f32(), r.out);
  EXPECT_EQ(file.find("state")->to_f32(), r.state);
  EXPECT_EQ(file.metadata["mode"], "replay");
  EXPECT_EQ(file.metadata["buffer_len"], "8");
  EXPECT_EQ(file.metadata["checkpoint"], "fp32+bf16");
  EXPECT_EQ(file.metadata["spec_tokens"], "2");
  EXPECT_EQ(file.metadata["accept_seed"], "4");
  EXPECT_EQ(file.metadata["device"], "cpu");
  EXPECT_EQ(file.metadata["version"], REPLAYSSM_VERSION);
}

// ---------------------------------------------------------------------------------------------
// Bad input: each gives a one-line error that names the problem, never a crash.

void expect_error(const Status& s, const std::string& needle) {
  ASSERT_FALSE(s.is_ok()) << "expected an error about '" << needle << "'";
  EXPECT_NE(s.message().find(needle), std::string::npos) << s.to_string();
  EXPECT_EQ(s.message().find('\n'), std::string::npos) << s.to_string();
}

// Loads the golden trace's file, lets `edit` break it, writes and loads it back.
template <typename Edit>
Status load_edited(const Golden& g, Edit edit) {
  SafetensorsFile file;
  const Status read = safetensors_read(trace_path(g), &file);
  if (!read.is_ok()) return read;
  edit(file);
  const std::string path = temp_path("trace");
  const Status written = safetensors_write(path, file);
  if (!written.is_ok()) return written;
  LayerTrace trace;
  const Status loaded = trace_load(path, &trace);
  std::filesystem::remove(path);
  return loaded;
}

// Replaces tensor `name` with its values after `change`, same shape.
template <typename Change>
void edit_values(SafetensorsFile& file, const std::string& name, Change change) {
  SafetensorsTensor& t = file.tensors.at(name);
  std::vector<float> v = t.to_f32();
  change(v);
  t = safetensors_tensor_f32(t.shape, v);
}

TEST(TraceErrors, MissingTensor) {
  expect_error(load_edited(kMamba2, [](SafetensorsFile& f) { f.tensors.erase("dt"); }),
               "missing tensor 'dt'");
  expect_error(load_edited(kGdn, [](SafetensorsFile& f) { f.tensors.erase("beta"); }),
               "missing tensor 'beta'");
}

TEST(TraceErrors, OptionalTensorsMayBeAbsent) {
  const Status s = load_edited(kMamba2, [](SafetensorsFile& f) { f.tensors.erase("state0"); });
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

TEST(TraceErrors, UnexpectedTensor) {
  expect_error(load_edited(kMamba2, [](SafetensorsFile& f) { f.tensors["Z"] = f.tensors.at("x"); }),
               "unexpected tensor 'Z'");
}

TEST(TraceErrors, WrongShape) {
  expect_error(load_edited(kMamba2,
                           [](SafetensorsFile& f) {
                             std::vector<float> v(24 * 2 * 3, 0.5f);
                             f.tensors["dt"] = safetensors_tensor_f32({24, 2, 3}, v);
                           }),
               "trace tensor 'dt' has shape [24, 2, 3]; expected [T, batch, H] = [24, 2, 4]");
  expect_error(load_edited(kGdn,
                           [](SafetensorsFile& f) {
                             std::vector<float> v(24 * 2 * 4 * 8);
                             f.tensors["v"] = safetensors_tensor_f32({24, 2, 4, 4, 2}, v);
                           }),
               "trace tensor 'v' has shape");
  expect_error(load_edited(kMamba2,
                           [](SafetensorsFile& f) {
                             std::vector<float> v(2 * 4 * 8 * 8);
                             f.tensors["state0"] = safetensors_tensor_f32({2, 4, 8, 8}, v);
                           }),
               "'state0'");
}

TEST(TraceErrors, ShapeMismatchBlamesTheOddTensor) {
  // v with Hv = 3 beside g, beta and state0 with Hv = 4: v is the odd one, not g.
  expect_error(load_edited(kGdn,
                           [](SafetensorsFile& f) {
                             std::vector<float> v(24 * 2 * 3 * 8, 0.5f);
                             f.tensors["v"] = safetensors_tensor_f32({24, 2, 3, 8}, v);
                           }),
               "trace tensor 'v' has shape [24, 2, 3, 8]; expected [T, batch, Hv, V] = "
               "[24, 2, 4, 8] (Hv = 4 in 'g', 'beta', 'state0')");
  // x with P = 9 (the golden trace has P = 8).
  const auto widen_x = [](SafetensorsFile& f, bool with_gate) {
    if (with_gate) f.tensors["z"] = f.tensors.at("x");
    std::vector<float> x(24 * 2 * 4 * 9, 0.5f);
    f.tensors["x"] = safetensors_tensor_f32({24, 2, 4, 9}, x);
  };
  // Beside the gate z and state0 with P = 8: x is blamed, not state0.
  expect_error(load_edited(kMamba2, [&](SafetensorsFile& f) { widen_x(f, true); }),
               "trace tensor 'x' has shape [24, 2, 4, 9]; expected [T, batch, H, P] = "
               "[24, 2, 4, 8] (P = 8 in 'z', 'state0')");
  // x and state0 alone hold P: nothing says which one is wrong, so the error names both.
  expect_error(load_edited(kMamba2, [&](SafetensorsFile& f) { widen_x(f, false); }),
               "trace tensors disagree on dimension P: 8 in 'state0'; 9 in 'x'");
}

TEST(TraceErrors, MetadataIsQuotedSafely) {
  const Status s =
      load_edited(kGdn, [](SafetensorsFile& f) {
        f.metadata["layer"] = "\x1b[2J" + std::string(500, 'm');
      });
  expect_error(s, "trace metadata 'layer' is '\\x1b[2Jmmm");
  EXPECT_LT(s.message().size(), 300u) << s.message();
}

TEST(TraceErrors, GroupsMustDivideHeads) {
  // H = 4 heads but B and C with G = 3 groups.
  expect_error(load_edited(kMamba2,
                           [](SafetensorsFile& f) {
                             std::vector<float> v(24 * 2 * 3 * 16, 0.25f);
                             f.tensors["B"] = safetensors_tensor_f32({24, 2, 3, 16}, v);
                             f.tensors["C"] = safetensors_tensor_f32({24, 2, 3, 16}, v);
                           }),
               "G must divide H");
}

TEST(TraceErrors, NonFiniteAndOutOfDomainValues) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  expect_error(load_edited(kMamba2,
                           [&](SafetensorsFile& f) {
                             edit_values(f, "x", [&](std::vector<float>& v) { v[5] = nan; });
                           }),
               "trace tensor 'x' has a non-finite value");
  expect_error(load_edited(kMamba2,
                           [](SafetensorsFile& f) {
                             edit_values(f, "A", [](std::vector<float>& v) { v[2] = 0.5f; });
                           }),
               "trace tensor 'A' must be < 0");
  expect_error(load_edited(kGdn,
                           [](SafetensorsFile& f) {
                             edit_values(f, "g", [](std::vector<float>& v) { v[0] = 0.1f; });
                           }),
               "trace tensor 'g' must be <= 0");
  expect_error(load_edited(kGdn,
                           [](SafetensorsFile& f) {
                             edit_values(f, "beta", [](std::vector<float>& v) { v[7] = 1.0f; });
                           }),
               "trace tensor 'beta' must be in (0, 1)");
  expect_error(load_edited(kGdn,
                           [](SafetensorsFile& f) {
                             edit_values(f, "state0", [](std::vector<float>& v) {
                               v[1] = std::numeric_limits<float>::infinity();
                             });
                           }),
               "trace tensor 'state0' has a non-finite value");
}

TEST(TraceErrors, BadMetadata) {
  expect_error(load_edited(kGdn, [](SafetensorsFile& f) { f.metadata["qk_l2norm"] = "yes"; }),
               "'qk_l2norm'");
  expect_error(load_edited(kGdn, [](SafetensorsFile& f) { f.metadata["scale"] = "-1"; }),
               "'scale'");
  expect_error(load_edited(kGdn, [](SafetensorsFile& f) { f.metadata["layer"] = "mamba3"; }),
               "'layer'");
  expect_error(load_edited(kGdn, [](SafetensorsFile& f) { f.metadata["layer"] = "mamba2"; }),
               "missing tensor 'x'");
}

TEST(TraceErrors, AcceptsF64AndBf16Tensors) {
  // The format takes F16/BF16/F64 as well as F32: x stored as F64, D as BF16.
  const Status s = load_edited(kMamba2, [](SafetensorsFile& f) {
    const SafetensorsTensor x = f.tensors.at("x");
    f.tensors["x"] = safetensors_tensor_f64(x.shape, x.to_f64());
    SafetensorsTensor& D = f.tensors.at("D");
    D.data = activations_pack(DType::kBF16, D.to_f32());
    D.dtype = SafetensorsDType::kBF16;
  });
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

TEST(TraceErrors, TruncatedFile) {
  SafetensorsFile file;
  ASSERT_TRUE(safetensors_read(trace_path(kMamba2), &file).is_ok());
  std::vector<std::uint8_t> bytes;
  ASSERT_TRUE(safetensors_serialize(file, &bytes).is_ok());
  const std::string path = temp_path("truncated");
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  std::fwrite(bytes.data(), 1, bytes.size() - 100, f);
  std::fclose(f);
  LayerTrace trace;
  const Status s = trace_load(path, &trace);
  std::filesystem::remove(path);
  expect_error(s, "truncated");
  EXPECT_EQ(s.code(), StatusCode::kIoError);
}

TEST(TraceErrors, MissingFile) {
  LayerTrace trace;
  expect_error(trace_load("data/no_such_trace.safetensors", &trace), "cannot open");
}

TEST(TraceErrors, BadRunOptions) {
  LayerTrace trace;
  ASSERT_TRUE(trace_load(trace_path(kGdn), &trace).is_ok());
  TraceRunResult r;
  const auto run = [&](auto edit) {
    TraceRunOptions o;
    edit(o);
    return trace_run(trace, o, &r);
  };
  expect_error(run([](TraceRunOptions& o) { o.buffer_len = 0; }), "buffer_len (L) must be >= 1");
  expect_error(run([](TraceRunOptions& o) { o.spec_tokens = 0; }), "spec_tokens (T) must be >= 1");
  expect_error(run([](TraceRunOptions& o) { o.spec_tokens = 100; }), "max_spec_tokens");
  expect_error(run([](TraceRunOptions& o) { o.input_dtype = DType::kF8E4M3; }), "input dtype");
  if (!cuda_available()) {
    expect_error(run([](TraceRunOptions& o) { o.device = Device::kCuda; }), "CUDA");
  }
  // An in-memory trace whose vectors do not match its shape is caught before any decode.
  LayerTrace broken = trace;
  broken.gdn.v.pop_back();
  expect_error(trace_run(broken, TraceRunOptions{}, &r), "trace tensor 'v' holds");
}

}  // namespace
}  // namespace replayssm
