// `replayssm`: the command-line front end. Subcommands:
//   run    one layer trace through the library (TRACE_FORMAT.md, "The command")
//   bench  eager vs replay decode timings at the real layer shapes (BENCHMARKS.md)
//   demo   replay against eager on generated traces, with timings
// Every failure prints one line "error: ..." on stderr and exits non-zero.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <new>
#include <string>
#include <vector>

#include "bench.h"
#include "demo.h"
#include "engine/trace_run.h"
#include "io/output_file.h"
#include "io/trace.h"
#include "progress.h"
#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "replayssm/version.h"

namespace replayssm::tools {

namespace {

int fail(const std::string& message) {
  std::fprintf(stderr, "error: %s\n", message.c_str());
  return 1;
}
int fail(const Status& status) { return fail(status.message()); }

Device default_device() { return cuda_available() ? Device::kCuda : Device::kCpu; }

// Upper bound of count options (batch, cycles): a typo should fail here, not as an
// allocation of absurd size.
constexpr int kMaxCount = 1 << 20;

// The flag as the user knows it: "--buffer-len (-L)".
std::string flag_text(const CLI::Option* option) {
  std::string text = "--" + option->get_lnames().front();
  for (const std::string& s : option->get_snames()) text += " (-" + s + ")";
  return text;
}

// Integer options with a range: the range goes into --help, and check() tests every value
// after parsing, before any work, with an error that names the flag as typed
// ("--buffer-len (-L) must be in [1, 4096], got 5000").
class RangeChecks {
 public:
  CLI::Option* add(CLI::Option* option, const int* value, int lo, int hi) {
    return add(option, [value] { return std::vector<int>{*value}; }, lo, hi);
  }
  CLI::Option* add(CLI::Option* option, const std::vector<int>* values, int lo, int hi) {
    return add(option, [values] { return *values; }, lo, hi);
  }
  [[nodiscard]] Status check() const {
    for (const Check& c : checks_) {
      if (c.option->count() == 0) continue;  // a default, which may stand for "chosen later"
      for (int v : c.values()) {
        if (v < c.lo || v > c.hi) {
          return invalid_argument(flag_text(c.option) + " must be in [" + std::to_string(c.lo) +
                                  ", " + std::to_string(c.hi) + "], got " + std::to_string(v));
        }
      }
    }
    return Status::ok();
  }

 private:
  struct Check {
    const CLI::Option* option;
    std::function<std::vector<int>()> values;
    int lo, hi;
  };
  CLI::Option* add(CLI::Option* option, std::function<std::vector<int>()> values, int lo, int hi) {
    option->description(option->get_description() + " [" + std::to_string(lo) + ", " +
                        std::to_string(hi) + "]");
    checks_.push_back({option, std::move(values), lo, hi});
    return option;
  }
  std::vector<Check> checks_;
};

// `--device cuda` fails here, before any work, where the library could not run it.
Status check_device(Device device) {
  if (device != Device::kCuda || cuda_available()) return Status::ok();
#if defined(REPLAYSSM_WITH_CUDA)
  return unsupported("--device cuda: no CUDA GPU is visible to this process; use --device cpu");
#else
  return unsupported(
      "--device cuda: this build has no CUDA backend (built without nvcc or with "
      "REPLAYSSM_ENABLE_CUDA=OFF); use --device cpu");
#endif
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
  RangeChecks ranges;
  CLI::Option* buffer_len_option = nullptr;
  CLI::Option* checkpoint_option = nullptr;
};

void add_run(CLI::App& app, RunArgs& a) {
  CLI::App* run = app.add_subcommand(
      "run", "Decode a layer trace (safetensors) and write its outputs and final state");
  run->add_option("--trace", a.trace_path, "Input trace (docs/TRACE_FORMAT.md)")->required();
  run->add_option("--out", a.out_path, "Output file: y or o, and state (F32)")->required();
  run->add_option("--mode", a.mode, "eager or replay")
      ->check(CLI::IsMember(keys(kModes)))
      ->capture_default_str();
  a.buffer_len_option = a.ranges.add(
      run->add_option("--buffer-len,-L", a.buffer_len, "Replay: tokens per fold cycle")
          ->capture_default_str(),
      &a.buffer_len, 1, kMaxBufferLen);
  a.ranges.add(run->add_option("--spec-tokens,-T", a.spec_tokens,
                               "Verify window: 1 = plain decoding; T > 1 = 1 real + T-1 draft "
                               "tokens (eager: T + 1 state copies per slot)")
                   ->capture_default_str(),
               &a.spec_tokens, 1, kMaxSpecTokens);
  run->add_option("--accept-seed", a.accept_seed, "With T > 1: seed of the acceptance pattern")
      ->capture_default_str();
  a.checkpoint_option = run->add_option("--checkpoint", a.checkpoint, "Replay checkpoint precision")
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

// An option the chosen mode would ignore is an error: the user meant something else.
Status check_eager_options(const RunArgs& a) {
  if (kModes.at(a.mode) != DecodeMode::kEager) return Status::ok();
  for (const CLI::Option* o : {a.checkpoint_option, a.buffer_len_option}) {
    if (o->count() > 0) {
      return invalid_argument(flag_text(o) +
                              " applies to --mode replay only (an eager run updates the whole "
                              "state every token: no checkpoint, no fold cycle)");
    }
  }
  return Status::ok();
}

// The output must not replace the input it is computed from.
Status check_out_is_not_trace(const RunArgs& a) {
  std::error_code ec;
  if (std::filesystem::equivalent(a.trace_path, a.out_path, ec) && !ec) {
    return invalid_argument("--out '" + a.out_path + "' is the input trace (--trace '" +
                            a.trace_path + "'); write the outputs to another file");
  }
  return Status::ok();
}

int do_run(const RunArgs& a) {
  if (Status s = check_device(kDevices.at(a.device)); !s.is_ok()) return fail(s);
  if (Status s = check_eager_options(a); !s.is_ok()) return fail(s);
  if (Status s = check_out_is_not_trace(a); !s.is_ok()) return fail(s);
  if (Status s = output_file_check(a.out_path); !s.is_ok()) return fail(s);
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
  } else if (o.spec_tokens > 1) {
    how += " T=" + std::to_string(o.spec_tokens);
  }
  std::printf("%s: %s layer, %d steps x batch %d, %s on %s: %d decode steps, %.3f ms each\n",
              a.out_path.c_str(), layer_kind_name(trace.kind), trace.num_steps(), trace.batch(),
              how.c_str(), a.device.c_str(), result.decode_steps,
              1e3 * result.decode_seconds / std::max(result.decode_steps, 1));
  return 0;
}

// `bench` without --full: one shape of each layer kind at one serving batch, the plain and the
// recommended checkpoint, few repetitions, within a memory budget: about a minute on a 2-core
// CPU. --full: the protocol of BENCHMARKS.md.
struct BenchArgs {
  std::string device = device_name(default_device());
  bool full = false;
  std::vector<std::string> shapes = {"nano4b", "qwen35-4b"};
  std::vector<int> batches = {64};
  int buffer_len = 16;
  int fold_every = 0;  // the decodes' fold cadence (ops.h); 0: buffer_len
  std::vector<std::string> checkpoints = {"fp32", "fp32+bf16"};  // plain, and the one to serve
  std::string flush = "staggered";  // the serving case: rows fold on different steps
  std::string eager_state = "f32";
  int repetitions = 3;
  int layers = 1;
  double min_state_mb = 0.0;
  int spec_tokens = 1;
  std::string spec_accepted = "0";  // an integer or "random": parse_spec_accepted
  std::string json_path;
  RangeChecks ranges;
  CLI::Option* shape_option = nullptr;
  CLI::Option* batch_option = nullptr;
  CLI::Option* checkpoint_option = nullptr;
  CLI::Option* repetitions_option = nullptr;
  CLI::Option* min_state_option = nullptr;
};

const std::vector<int> kFullBatchesCpu = {16, 64};
const std::vector<int> kFullBatchesCuda = {1, 64, 256, 1024};
constexpr int kFullRepetitions = 5;

void add_bench(CLI::App& app, BenchArgs& a) {
  CLI::App* bench = app.add_subcommand(
      "bench", "Time eager against replay decode of one layer at the real model shapes");
  bench->add_option("--device", a.device, "cpu or cuda (default: cuda when a GPU is present)")
      ->check(CLI::IsMember(keys(kDevices)))
      ->capture_default_str();
  bench->add_flag("--full", a.full,
                  "The whole protocol (docs/BENCHMARKS.md): every shape, batches 16,64 (cpu) or "
                  "1,64,256,1024 (cuda), all four checkpoints, 5 repetitions, no memory budget; "
                  "minutes and several GB on a small CPU. Options given explicitly still apply");
  std::vector<std::string> shape_names = {"all"};
  for (const BenchShape& s : bench_shapes()) shape_names.push_back(s.name);
  a.shape_option = bench->add_option("--shape", a.shapes, "Layer shapes, comma-separated, or all")
                       ->delimiter(',')
                       ->check(CLI::IsMember(shape_names))
                       ->capture_default_str();
  a.batch_option = a.ranges.add(
      bench->add_option("--batch", a.batches, "Batch sizes, comma-separated")
          ->delimiter(',')
          ->capture_default_str(),
      &a.batches, 1, kMaxCount);
  a.ranges.add(bench->add_option("--buffer-len,-L", a.buffer_len, "Tokens per fold cycle")
                   ->capture_default_str(),
               &a.buffer_len, 1, kMaxBufferLen);
  a.ranges.add(bench
                   ->add_option("--fold-every", a.fold_every,
                                "Replay decodes fold every this many tokens of a cache of "
                                "--buffer-len (at most it; 0: the buffer length)")
                   ->capture_default_str(),
               &a.fold_every, 0, kMaxBufferLen);
  a.ranges.add(bench
                   ->add_option("--layers", a.layers,
                                "Layers of one cache decoded per step before its one commit, as a "
                                "model steps; times are per layer step (the speculative comparison: one "
                                "layer). cuda only")
                   ->capture_default_str(),
               &a.layers, 1, 256);
  a.checkpoint_option = bench
                            ->add_option("--checkpoint", a.checkpoints,
                                         "Replay checkpoint precisions, comma-separated")
                            ->delimiter(',')
                            ->check(CLI::IsMember(checkpoint_names()))
                            ->capture_default_str();
  bench->add_option("--flush", a.flush, "aligned: all rows fold on one step; staggered: spread")
      ->check(CLI::IsMember(keys(kFlushPatterns)))
      ->capture_default_str();
  bench->add_option("--eager-state", a.eager_state, "State dtype of the eager baseline")
      ->check(CLI::IsMember(keys(kActivationDTypes)))
      ->capture_default_str();
  a.repetitions_option = a.ranges.add(
      bench->add_option("--repetitions", a.repetitions, "Timed cycles per case (median reported)")
          ->capture_default_str(),
      &a.repetitions, 1, 1000);
  a.min_state_option =
      bench
          ->add_option("--min-state-mb", a.min_state_mb,
                       "State touched per cycle, rotated over slots (0: 4 x the last-level "
                       "cache, or the L2 on cuda; without --full, the CPU keeps all the "
                       "caches of a case within 2 GiB or a quarter of memory)")
          ->check(CLI::NonNegativeNumber)
          ->capture_default_str();
  a.ranges.add(bench
                   ->add_option("--spec-tokens,-T", a.spec_tokens,
                                "Verify window: 1 = the protocol's plain decoding; T > 1 = replay "
                                "verifying T tokens against eager speculative decoding, which "
                                "writes a state per draft (an eager cache with "
                                "max_spec_tokens = T, both families). cuda only")
                   ->capture_default_str(),
               &a.spec_tokens, 1, kMaxSpecTokens);
  bench
      ->add_option("--spec-accepted", a.spec_accepted,
                   std::string("With T > 1: tokens committed per verify step, an integer in "
                               "[0, T] (0 = all T), or random: ") +
                       kRandomAcceptanceHelp + ", as the public kernels are timed")
      ->type_name("INT|random")
      ->capture_default_str();
  bench->add_option("--json", a.json_path,
                    "Also write the results as JSON (bench/plot.py draws it)");
}

// --full replaces the quick defaults of the options not given explicitly.
void apply_full(BenchArgs& a) {
  if (a.shape_option->count() == 0) a.shapes = {"all"};
  if (a.batch_option->count() == 0) {
    a.batches = a.device == "cuda" ? kFullBatchesCuda : kFullBatchesCpu;
  }
  if (a.checkpoint_option->count() == 0) a.checkpoints = checkpoint_names();
  if (a.repetitions_option->count() == 0) a.repetitions = kFullRepetitions;
}

int do_bench(BenchArgs& a) {
  const bool spec = a.spec_tokens > 1;
  // The arguments first, then the device: a bad value is reported as such on any machine.
  int spec_accepted = 0;
  if (Status s = parse_spec_accepted(a.spec_accepted, a.spec_tokens, "--spec-tokens (-T)",
                                     &spec_accepted);
      !s.is_ok()) {
    return fail(s);
  }
  if (Status s = check_device(kDevices.at(a.device)); !s.is_ok()) return fail(s);
  if (spec && a.device != "cuda") {
    return fail("--spec-tokens (-T) > 1 needs --device cuda (the CPU benchmark has no "
                "speculative comparison)");
  }
  if (!a.json_path.empty()) {
    if (Status s = output_file_check(a.json_path); !s.is_ok()) return fail(s);
  }
  if (a.full) apply_full(a);
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
  o.fold_every = a.fold_every;
  o.checkpoints.clear();
  for (const std::string& c : a.checkpoints) o.checkpoints.push_back(checkpoint_from(c));
  o.flush = kFlushPatterns.at(a.flush);
  o.eager_state_dtype = kActivationDTypes.at(a.eager_state);
  o.repetitions = a.repetitions;
  o.layers = a.layers;
  o.min_state_bytes = static_cast<std::int64_t>(a.min_state_mb * 1e6);
  if (!a.full && a.min_state_option->count() == 0) {
    o.memory_budget_bytes = bench_quick_memory_budget();
  }
  Progress progress("bench", 0.0);  // the first line at once: the bandwidth probe takes seconds
  o.progress = [&progress](double fraction, const std::string& what) {
    progress.update(fraction, what);
  };
  BenchReport report;
  Status s;
  if (spec) {
    s = run_cuda_spec_bench(o, a.spec_tokens, spec_accepted, &report);
  } else {
    s = o.device == Device::kCpu ? run_cpu_bench(o, &report) : run_cuda_bench(o, &report);
  }
  progress.clear();
  if (!s.is_ok()) return fail(s);
  bench_print(report, stdout);
  if (!a.full) std::printf("(a quick run: --full runs the whole protocol, docs/BENCHMARKS.md)\n");
  if (!a.json_path.empty()) {
    if (Status w = bench_write_json(report, o, a.json_path); !w.is_ok()) return fail(w);
  }
  return 0;
}

struct DemoArgs {
  std::string device = device_name(default_device());
  DemoOptions options;
  double min_state_mb = 0.0;
  RangeChecks ranges;
};

void add_demo(CLI::App& app, DemoArgs& a) {
  CLI::App* demo = app.add_subcommand(
      "demo",
      "Replay against eager decoding at real layer shapes: how far apart their outputs are, "
      "and their speed on this machine with the state streaming from memory");
  demo->add_option("--device", a.device, "cpu or cuda (default: cuda when a GPU is present)")
      ->check(CLI::IsMember(keys(kDevices)))
      ->capture_default_str();
  a.ranges.add(demo->add_option("--batch", a.options.batch,
                                "Sequences in the speed part (default: " +
                                    std::to_string(kDemoBatchCpu) + " on cpu, " +
                                    std::to_string(kDemoBatchCuda) + " on cuda)"),
               &a.options.batch, 1, kMaxCount);
  a.ranges.add(demo->add_option("--buffer-len,-L", a.options.buffer_len, "Tokens per fold cycle")
                   ->capture_default_str(),
               &a.options.buffer_len, 1, kMaxBufferLen);
  a.ranges.add(demo->add_option("--cycles", a.options.cycles,
                                "Fold cycles the agreement part decodes (tokens = cycles x L)")
                   ->capture_default_str(),
               &a.options.cycles, 1, kMaxCount);
  demo->add_option("--seed", a.options.seed, "Seed of the generated inputs")->capture_default_str();
  demo->add_option("--min-state-mb", a.min_state_mb,
                   "Speed part: state touched per cycle (0: 4 x the last-level cache, within "
                   "2 GiB or a quarter of memory)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
}

int do_demo(DemoArgs& a) {
  a.options.device = kDevices.at(a.device);
  if (Status s = check_device(a.options.device); !s.is_ok()) return fail(s);
  a.options.min_state_bytes = static_cast<std::int64_t>(a.min_state_mb * 1e6);
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
  for (const RangeChecks* ranges : {&run_args.ranges, &bench_args.ranges, &demo_args.ranges}) {
    if (Status s = ranges->check(); !s.is_ok()) return fail(s.message() + " (see --help)");
  }
  // Past a file size limit (ulimit -f) a write fails with EFBIG, reported like a full disk,
  // instead of the signal killing the tool with a partial file.
  std::signal(SIGXFSZ, SIG_IGN);
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
