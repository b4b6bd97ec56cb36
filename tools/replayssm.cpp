// `replayssm`: the command-line front end. Subcommands:
//   run    one layer trace through the library (TRACE_FORMAT.md, "The command")
//   bench  eager vs replay decode timings at the real layer shapes (BENCHMARKS.md)
//   demo   replay against eager on generated traces, with timings
// Every failure prints one line "error: ..." on stderr and exits non-zero.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <new>
#include <string>
#include <vector>

#include "bench.h"
#include "demo.h"
#include "engine/trace_run.h"
#include "io/trace.h"
#include "progress.h"
#include "replayssm/ops.h"
#include "replayssm/version.h"

namespace replayssm::tools {

namespace {

int fail(const std::string& message) {
  std::fprintf(stderr, "error: %s\n", message.c_str());
  return 1;
}
int fail(const Status& status) { return fail(status.message()); }

Device default_device() { return cuda_available() ? Device::kCuda : Device::kCpu; }

// Upper bound of count options (batch, L, cycles): a typo should fail here, not as an
// allocation of absurd size.
constexpr int kMaxCount = 1 << 20;

// Fails early (before a long run) when `path` cannot be created; leaves no file behind.
Status check_writable(const std::string& path) {
  std::error_code ec;
  const bool existed = std::filesystem::exists(path, ec);
  std::FILE* f = std::fopen(path.c_str(), "ab");  // "a": an existing file stays intact
  if (f == nullptr) {
    return {StatusCode::kIoError, "cannot create '" + path + "': " + std::strerror(errno)};
  }
  std::fclose(f);
  if (!existed) std::filesystem::remove(path, ec);
  return Status::ok();
}

// Option values as typed on the command line, converted after parsing.
const std::map<std::string, Device> kDevices = {{"cpu", Device::kCpu}, {"cuda", Device::kCuda}};
const std::map<std::string, DecodeMode> kModes = {{"eager", DecodeMode::kEager},
                                                  {"replay", DecodeMode::kReplay}};
const std::map<std::string, DType> kActivationDTypes = {
    {"f32", DType::kF32}, {"bf16", DType::kBF16}, {"f16", DType::kF16}};
const std::map<std::string, FlushPattern> kFlushPatterns = {
    {"aligned", FlushPattern::kAligned}, {"staggered", FlushPattern::kStaggered}};

std::vector<std::string> checkpoint_names() {
  std::vector<std::string> names;
  for (CheckpointPrecision p : {CheckpointPrecision::kFp32, CheckpointPrecision::kBf16,
                                CheckpointPrecision::kFp32Bf16, CheckpointPrecision::kFp32Fp8}) {
    names.push_back(checkpoint_precision_name(p));
  }
  return names;
}

template <typename T>
std::vector<std::string> keys(const std::map<std::string, T>& m) {
  std::vector<std::string> k;
  for (const auto& [name, unused] : m) k.push_back(name);
  return k;
}

CheckpointPrecision checkpoint_from(const std::string& name) {
  CheckpointPrecision p = CheckpointPrecision::kFp32;
  (void)parse_checkpoint_precision(name, &p);  // the option's IsMember check ran first
  return p;
}

struct RunArgs {
  std::string trace_path;
  std::string out_path;
  std::string mode = "replay";
  int buffer_len = 16;
  int spec_tokens = 1;
  std::uint64_t accept_seed = 0;
  std::string checkpoint = "fp32";
  std::string device = device_name(default_device());
  std::string input_dtype = "f32";
};

void add_run(CLI::App& app, RunArgs& a) {
  CLI::App* run = app.add_subcommand(
      "run", "Decode a layer trace (safetensors) and write its outputs and final state");
  run->add_option("--trace", a.trace_path, "Input trace (TRACE_FORMAT.md)")->required();
  run->add_option("--out", a.out_path, "Output file: y or o, and state (F32)")->required();
  run->add_option("--mode", a.mode, "eager or replay")
      ->check(CLI::IsMember(keys(kModes)))
      ->capture_default_str();
  run->add_option("--buffer-len,-L", a.buffer_len, "Replay: tokens per fold cycle (>= 1)")
      ->capture_default_str();
  run->add_option("--spec-tokens,-T", a.spec_tokens,
                  "Verify window: 1 = plain decoding; T > 1 = 1 real + T-1 draft tokens")
      ->capture_default_str();
  run->add_option("--accept-seed", a.accept_seed, "With T > 1: seed of the acceptance pattern")
      ->capture_default_str();
  run->add_option("--checkpoint", a.checkpoint, "Replay checkpoint precision")
      ->check(CLI::IsMember(checkpoint_names()))
      ->capture_default_str();
  run->add_option("--device", a.device, "cpu or cuda (default: cuda when a GPU is present)")
      ->check(CLI::IsMember(keys(kDevices)))
      ->capture_default_str();
  run->add_option("--input-dtype", a.input_dtype,
                  "Activation dtype in the cache (inputs are rounded to it)")
      ->check(CLI::IsMember(keys(kActivationDTypes)))
      ->capture_default_str();
}

int do_run(const RunArgs& a) {
  if (Status s = check_writable(a.out_path); !s.is_ok()) return fail(s);
  LayerTrace trace;
  if (Status s = trace_load(a.trace_path, &trace); !s.is_ok()) return fail(s);
  TraceRunOptions o;
  o.mode = kModes.at(a.mode);
  o.buffer_len = a.buffer_len;
  o.spec_tokens = a.spec_tokens;
  o.accept_seed = a.accept_seed;
  o.checkpoint = checkpoint_from(a.checkpoint);
  o.device = kDevices.at(a.device);
  o.input_dtype = kActivationDTypes.at(a.input_dtype);
  Progress progress("run");
  o.progress = [&progress](std::int64_t done, std::int64_t total) {
    progress.update(double(done) / double(total));
  };
  TraceRunResult result;
  const Status ran = trace_run(trace, o, &result);
  progress.clear();
  if (!ran.is_ok()) return fail(ran);
  if (Status s = trace_run_save(a.out_path, trace, o, result); !s.is_ok()) return fail(s);
  std::string how = a.mode;
  if (o.mode == DecodeMode::kReplay) {
    how += " L=" + std::to_string(o.buffer_len) + " T=" + std::to_string(o.spec_tokens) + " " +
           a.checkpoint;
  }
  std::printf("%s: %s layer, %d steps x batch %d, %s on %s: %d decode steps, %.3f ms each\n",
              a.out_path.c_str(), layer_kind_name(trace.kind), trace.num_steps(), trace.batch(),
              how.c_str(), a.device.c_str(), result.decode_steps,
              1e3 * result.decode_seconds / std::max(result.decode_steps, 1));
  return 0;
}

struct BenchArgs {
  std::string device = device_name(default_device());
  std::vector<std::string> shapes = {"all"};
  std::vector<int> batches = {16, 64};
  int buffer_len = 16;
  std::vector<std::string> checkpoints = {"fp32", "fp32+bf16"};  // plain, and the mode to serve with
  std::string flush = "aligned";
  std::string eager_state = "f32";
  int repetitions = 5;
  double min_state_mb = 0.0;
  int spec_tokens = 1;
  int spec_accepted = 0;
  std::string json_path;
};

void add_bench(CLI::App& app, BenchArgs& a) {
  CLI::App* bench = app.add_subcommand(
      "bench", "Time eager against replay decode of one layer at the real model shapes");
  bench->add_option("--device", a.device, "cpu or cuda (default: cuda when a GPU is present)")
      ->check(CLI::IsMember(keys(kDevices)))
      ->capture_default_str();
  std::vector<std::string> shape_names = {"all"};
  for (const BenchShape& s : bench_shapes()) shape_names.push_back(s.name);
  bench->add_option("--shape", a.shapes, "Layer shapes, comma-separated, or all")
      ->delimiter(',')
      ->check(CLI::IsMember(shape_names))
      ->capture_default_str();
  bench->add_option("--batch", a.batches, "Batch sizes, comma-separated")
      ->delimiter(',')
      ->check(CLI::Range(1, kMaxCount))
      ->capture_default_str();
  bench->add_option("--buffer-len,-L", a.buffer_len, "Tokens per fold cycle")
      ->check(CLI::Range(1, kMaxCount))
      ->capture_default_str();
  bench->add_option("--checkpoint", a.checkpoints, "Replay checkpoint precisions, comma-separated")
      ->delimiter(',')
      ->check(CLI::IsMember(checkpoint_names()))
      ->capture_default_str();
  bench->add_option("--flush", a.flush, "aligned: all rows fold on one step; staggered: spread")
      ->check(CLI::IsMember(keys(kFlushPatterns)))
      ->capture_default_str();
  bench->add_option("--eager-state", a.eager_state, "State dtype of the eager baseline")
      ->check(CLI::IsMember(keys(kActivationDTypes)))
      ->capture_default_str();
  bench->add_option("--repetitions", a.repetitions, "Timed cycles per case (median reported)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  bench
      ->add_option("--min-state-mb", a.min_state_mb,
                   "State touched per cycle, rotated over slots (0: 4 x last-level cache)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  bench
      ->add_option("--spec-tokens,-T", a.spec_tokens,
                   "Verify window: 1 = the protocol's plain decoding; T > 1 = replay verifying "
                   "T tokens against eager speculative decoding, which writes a state per draft "
                   "(Mamba-2: one fused kernel; GDN: T eager decodes). cuda only")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  bench
      ->add_option("--spec-accepted", a.spec_accepted,
                   "With T > 1: tokens committed per verify step (0 = all T)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  bench->add_option("--json", a.json_path,
                    "Also write the results as JSON (bench/plot.py draws it)");
}

int do_bench(const BenchArgs& a) {
  const bool spec = a.spec_tokens > 1;
  if (spec && a.device != "cuda") {
    return fail("--spec-tokens > 1 needs --device cuda (the CPU benchmark has no speculative "
                "comparison)");
  }
  if (a.spec_accepted > a.spec_tokens) {
    return fail("--spec-accepted must be at most --spec-tokens");
  }
  if (!a.json_path.empty()) {
    if (Status s = check_writable(a.json_path); !s.is_ok()) return fail(s);
  }
  BenchOptions o;
  o.device = kDevices.at(a.device);
  o.shapes.clear();
  for (const std::string& s : a.shapes) {
    if (s != "all") {
      o.shapes.push_back(s);
      continue;
    }
    for (const BenchShape& shape : bench_shapes()) o.shapes.push_back(shape.name);
  }
  o.batches = a.batches;
  o.buffer_len = a.buffer_len;
  o.checkpoints.clear();
  for (const std::string& c : a.checkpoints) o.checkpoints.push_back(checkpoint_from(c));
  o.flush = kFlushPatterns.at(a.flush);
  o.eager_state_dtype = kActivationDTypes.at(a.eager_state);
  o.repetitions = a.repetitions;
  o.min_state_bytes = static_cast<std::int64_t>(a.min_state_mb * 1e6);
  Progress progress("bench");
  o.progress = [&progress](double fraction, const std::string& what) {
    progress.update(fraction, what);
  };
  BenchReport report;
  Status s;
  if (spec) {
    s = run_cuda_spec_bench(o, a.spec_tokens, a.spec_accepted, &report);
  } else {
    s = o.device == Device::kCpu ? run_cpu_bench(o, &report) : run_cuda_bench(o, &report);
  }
  progress.clear();
  if (!s.is_ok()) return fail(s);
  bench_print(report, stdout);
  if (!a.json_path.empty()) {
    if (Status w = bench_write_json(report, o, a.json_path); !w.is_ok()) return fail(w);
  }
  return 0;
}

struct DemoArgs {
  std::string device = device_name(default_device());
  DemoOptions options;
};

void add_demo(CLI::App& app, DemoArgs& a) {
  CLI::App* demo = app.add_subcommand(
      "demo",
      "Show replay matching eager decode, and how much faster it is, on generated "
      "traces at real layer shapes");
  demo->add_option("--device", a.device, "cpu or cuda (default: cuda when a GPU is present)")
      ->check(CLI::IsMember(keys(kDevices)))
      ->capture_default_str();
  demo->add_option("--batch", a.options.batch, "Sequences")
      ->check(CLI::Range(1, kMaxCount))
      ->capture_default_str();
  demo->add_option("--buffer-len,-L", a.options.buffer_len, "Tokens per fold cycle")
      ->check(CLI::Range(1, kMaxCount))
      ->capture_default_str();
  demo->add_option("--cycles", a.options.cycles, "Fold cycles to decode (tokens = cycles x L)")
      ->check(CLI::Range(1, kMaxCount))
      ->capture_default_str();
  demo->add_option("--seed", a.options.seed, "Seed of the generated inputs")->capture_default_str();
}

int do_demo(DemoArgs& a) {
  a.options.device = kDevices.at(a.device);
  if (Status s = run_demo(a.options, stdout); !s.is_ok()) return fail(s);
  return 0;
}

}  // namespace

bool has_subcommand(const CLI::App& app, const std::string& name) {
  try {
    (void)app.get_subcommand(name);
    return true;
  } catch (const CLI::OptionNotFound&) {
    return false;
  }
}

int main(int argc, char** argv) {
  CLI::App app("replayssm " REPLAYSSM_VERSION
               ": decode hybrid SSM layers (Mamba-2, Gated DeltaNet) by replay");
  app.require_subcommand(1);
  app.set_version_flag("--version", replayssm::version());
  RunArgs run_args;
  BenchArgs bench_args;
  DemoArgs demo_args;
  add_run(app, run_args);
  add_bench(app, bench_args);
  add_demo(app, demo_args);
  // CLI11 would report a misspelt subcommand as a missing one.
  if (argc > 1 && argv[1][0] != '-' && !has_subcommand(app, argv[1])) {
    return fail(std::string("unknown subcommand '") + argv[1] +
                "'; expected run, bench or demo (see --help)");
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    return fail(std::string(e.what()) + " (see --help)");
  }
  // The library returns Status, but an allocation can still throw (a trace too large for the
  // host's memory): report it like any other error rather than abort.
  try {
    if (app.got_subcommand("run")) return do_run(run_args);
    if (app.got_subcommand("bench")) return do_bench(bench_args);
    return do_demo(demo_args);
  } catch (const std::bad_alloc&) {
    return fail("out of host memory");
  } catch (const std::exception& e) {
    return fail(std::string("unexpected exception: ") + e.what());
  }
}

}  // namespace replayssm::tools

int main(int argc, char** argv) { return replayssm::tools::main(argc, argv); }
