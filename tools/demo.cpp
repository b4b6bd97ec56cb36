#include "demo.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "bench.h"
#include "engine/synthetic_trace.h"
#include "engine/trace_run.h"
#include "progress.h"
#include "replayssm/ops.h"
#include "replayssm/state_cache.h"

namespace replayssm::tools {

namespace {

// The layers shown: one of each kind, at the shapes of the small models of each family.
constexpr const char* kShapes[] = {"nano4b", "qwen35-4b"};
constexpr CheckpointPrecision kCheckpoints[] = {
    CheckpointPrecision::kFp32, CheckpointPrecision::kFp32Bf16, CheckpointPrecision::kFp32Fp8};
constexpr int kSpecTokens = 4;
constexpr int kSpeedRepetitions = 5;
// A speedup inside this band around 1 is too close to call on a shared machine.
constexpr double kClearGain = 1.05;
// A replay step that reads its copy in this fraction of eager's update time, or more, cannot
// gain much whatever the rest of it costs.
constexpr double kLittleToGain = 0.8;

// How far replay may be from eager (max |a − b| / max |b|). The outputs read the checkpoint's
// read copy; the state is the fp32 master in every mode. fp32: rounding order only (measured
// 2e-7 to 5e-7); 1e-5 still fails a dropped token or a wrong decay (> 1e-3). A bf16 copy rounds
// each element it reads by <= 2^-9 (measured ~2e-3); fp8 e4m3 by <= 2^-4 (measured ~2e-2).
constexpr double kFp32Tol = 1e-5;
constexpr double kBf16Tol = 1e-2;
constexpr double kFp8Tol = 1e-1;

double output_tolerance(CheckpointPrecision c) {
  switch (c) {
    case CheckpointPrecision::kFp32: return kFp32Tol;
    case CheckpointPrecision::kBf16:
    case CheckpointPrecision::kFp32Bf16: return kBf16Tol;
    case CheckpointPrecision::kFp32Fp8: return kFp8Tol;
  }
  return kFp32Tol;
}

// max_i |a_i − b_i| / max_i |b_i|: one scale for the whole tensor, so that near-zero elements
// do not blow it up.
double rel_error(const std::vector<float>& a, const std::vector<float>& ref) {
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, std::fabs(double(a[i]) - double(ref[i])));
    scale = std::max(scale, std::fabs(double(ref[i])));
  }
  return scale > 0.0 ? diff / scale : diff;
}

std::string replay_label(CheckpointPrecision c, int spec_tokens = 1) {
  std::string label = std::string("replay ") + checkpoint_precision_name(c);
  if (spec_tokens > 1) label += ", spec T=" + std::to_string(spec_tokens);
  return label;
}

struct AgreementRun {
  std::string label;
  TraceRunOptions options;
  double out_tol;
};

std::vector<AgreementRun> agreement_runs(const DemoOptions& o) {
  TraceRunOptions base;
  base.device = o.device;
  base.buffer_len = o.buffer_len;
  std::vector<AgreementRun> runs;
  for (CheckpointPrecision c : kCheckpoints) {
    TraceRunOptions r = base;
    r.checkpoint = c;
    runs.push_back({replay_label(c), r, output_tolerance(c)});
  }
  TraceRunOptions spec = base;
  spec.spec_tokens = kSpecTokens;
  spec.accept_seed = o.seed;
  runs.push_back({replay_label(spec.checkpoint, kSpecTokens), spec, kFp32Tol});
  return runs;
}

// Part 1 for one layer: eager, then every replay run, each compared with eager. Sets *agree to
// false when one is off by more than its tolerance.
Status agreement_layer(const BenchShape& shape, const DemoOptions& o, Progress& progress,
                       std::FILE* out, bool* agree) {
  SyntheticTraceOptions so;
  so.num_steps = o.cycles * o.buffer_len;
  so.batch = kDemoAgreementBatch;
  so.seed = o.seed;
  so.mamba2_gate = true;
  LayerTrace trace;
  const Status trace_made = visit_kind(
      shape.kind,
      [&]() -> Status {
        REPLAYSSM_RETURN_IF_ERROR(synthetic_trace_mamba2(shape.mamba2, so, &trace));
        return Status::ok();
      },
      [&]() -> Status {
        REPLAYSSM_RETURN_IF_ERROR(synthetic_trace_gdn(shape.gdn, so, &trace));
        return Status::ok();
      });
  REPLAYSSM_RETURN_IF_ERROR(trace_made);
  const auto run = [&](const std::string& label, TraceRunOptions options, TraceRunResult* r) {
    options.progress = [&](std::int64_t done, std::int64_t total) {
      progress.update(double(done) / double(total), std::string(shape.name) + " " + label);
    };
    return trace_run(trace, options, r);
  };
  TraceRunOptions eager_options;
  eager_options.mode = DecodeMode::kEager;
  eager_options.device = o.device;
  TraceRunResult eager;
  REPLAYSSM_RETURN_IF_ERROR(run("eager", eager_options, &eager));
  bool first = true;
  for (const AgreementRun& a : agreement_runs(o)) {
    TraceRunResult r;
    REPLAYSSM_RETURN_IF_ERROR(run(a.label, a.options, &r));
    const double out_err = rel_error(r.out, eager.out);
    const double state_err = rel_error(r.state, eager.state);
    const bool ok = out_err <= a.out_tol && state_err <= kFp32Tol;
    *agree = *agree && ok;
    progress.clear();  // stdout and the progress line share a terminal
    std::fprintf(out, "  %-12s %-24s %12.1e %12.1e   %s\n", first ? shape.name : "",
                 a.label.c_str(), out_err, state_err, ok ? "ok" : "BEYOND TOLERANCE");
    first = false;
  }
  return Status::ok();
}

const BenchResult* find_result(const BenchReport& report, const std::string& shape,
                               DecodeMode mode, CheckpointPrecision c) {
  for (const BenchResult& r : report.results) {
    if (r.shape == shape && r.mode == mode && (mode == DecodeMode::kEager || r.checkpoint == c)) {
      return &r;
    }
  }
  return nullptr;
}

// Bytes per state element that a replay step reads from its checkpoint (its read copy).
double read_copy_bytes(CheckpointPrecision c) {
  switch (c) {
    case CheckpointPrecision::kFp32: return 4.0;
    case CheckpointPrecision::kBf16:
    case CheckpointPrecision::kFp32Bf16: return 2.0;
    case CheckpointPrecision::kFp32Fp8: return 1.0;
  }
  return 4.0;
}

// One line on why `r` did not beat eager, from what this run measured. On the CPU the fold
// step and the plain steps are timed apart: either the plain steps alone are no faster than
// eager's (the read of the checkpoint costs what eager's update does), or they are and the fold
// step costs back what they save.
std::string why_not_faster(const BenchReport& report, const BenchResult& eager,
                           const BenchResult& r) {
  char line[512];
  if (r.us_fold_step <= 0.0 || report.read_gbps <= 0.0) {  // CUDA: no split, no read probe
    std::snprintf(line, sizeof line,
                  "eager reaches %.0f%% of the copy bandwidth, replay %.0f%% (by the bytes model)",
                  eager.pct_of_copy, r.pct_of_copy);
    return line;
  }
  // Time to stream-read N bytes over time to update N bytes in place (update_gbps counts the
  // read and the write).
  const double read_vs_update = report.update_gbps / (2.0 * report.read_gbps);
  const double floor = read_vs_update * read_copy_bytes(r.checkpoint) / 4.0;
  if (r.us_plain_step >= eager.us_per_step / kClearGain) {
    std::snprintf(line, sizeof line,
                  "its plain steps alone take %.0f us against eager's %.0f; by the bandwidths "
                  "measured above, reading its %g-byte copy takes %.2fx the time of eager's "
                  "in-place update of 4 bytes, so %s",
                  r.us_plain_step, eager.us_per_step, read_copy_bytes(r.checkpoint), floor,
                  floor >= kLittleToGain
                      ? "this copy has little to gain on this machine"
                      : "the rest of a plain step (ring reads, the outputs' arithmetic) costs "
                        "more than the smaller read saves");
  } else {
    char little[160] = "";
    if (floor >= kLittleToGain) {
      std::snprintf(little, sizeof little,
                    " (reading its %g-byte copy takes %.2fx the time of eager's update by the "
                    "bandwidths above, so they have little to gain)",
                    read_copy_bytes(r.checkpoint), floor);
    }
    std::snprintf(line, sizeof line,
                  "its plain steps are %.2fx faster than eager's%s, but the fold step, once "
                  "every %d steps, takes %.0f us (%.1f eager steps) and costs that back",
                  eager.us_per_step / r.us_plain_step, little, r.buffer_len, r.us_fold_step,
                  r.us_fold_step / eager.us_per_step);
  }
  return line;
}

// Part 2: the benchmark's cycles for both shapes at one batch, then the table and the reasons.
Status speed_part(const DemoOptions& o, int batch, Progress& progress, std::FILE* out) {
  BenchOptions b;
  b.device = o.device;
  b.shapes.assign(std::begin(kShapes), std::end(kShapes));
  b.batches = {batch};
  b.buffer_len = o.buffer_len;
  b.checkpoints.assign(std::begin(kCheckpoints), std::end(kCheckpoints));
  b.repetitions = kSpeedRepetitions;
  b.min_state_bytes = o.min_state_bytes;
  if (o.min_state_bytes == 0) b.memory_budget_bytes = bench_quick_memory_budget();
  b.progress = [&progress](double fraction, const std::string& what) {
    progress.update(fraction, what);
  };
  BenchReport report;
  const Status s =
      o.device == Device::kCpu ? run_cpu_bench(b, &report) : run_cuda_bench(b, &report);
  progress.clear();
  REPLAYSSM_RETURN_IF_ERROR(s);

  if (report.cache_bytes > 0) {
    std::fprintf(out, "  Each case cycles through");
    const char* sep = " ";
    for (const BenchResult& r : report.results) {
      if (r.mode != DecodeMode::kEager) continue;
      std::fprintf(out, "%s%.0f MB of state (%s, %.1fx the %.0f MiB last-level cache)", sep,
                   r.stream_bytes / 1e6, r.shape.c_str(),
                   r.stream_bytes / double(report.cache_bytes),
                   double(report.cache_bytes) / double(1 << 20));
      sep = "\n  and ";
    }
    std::fprintf(out, ".\n");
    bool below = false;
    for (const BenchResult& r : report.results) {
      below = below || r.stream_bytes < double(kStreamCacheMultiple) * double(report.cache_bytes);
    }
    std::fprintf(out, below ? "  Below %dx the cache (kept within the memory budget; "
                              "--min-state-mb raises it), part of it may be served from cache.\n"
                            : "  At >= %dx the cache, it streams from memory, as at serving "
                              "scale.\n",
                 kStreamCacheMultiple);
  }
  std::fprintf(out, "  Memory of this machine, measured now: ");
  if (report.read_gbps > 0.0) {
    std::fprintf(out, "in-place update %.1f GB/s (read + write), streaming read %.1f GB/s.\n",
                 report.update_gbps, report.read_gbps);
  } else {
    std::fprintf(out, "copy %.1f GB/s (read + write).\n", report.copy_gbps);
  }
  std::fprintf(out, "  Medians of %d fold cycles per mode, the modes timed in turn.\n\n",
               kSpeedRepetitions);

  std::fprintf(out, "  %-12s %-18s %11s %9s %13s   %s\n", "layer", "mode", "us/step", "vs eager",
               "model bytes", "fold step / plain step, us");
  struct Slow {
    std::string what;
    std::string why;
  };
  std::vector<Slow> slow;
  int paid = 0, cases = 0;
  for (const char* shape : kShapes) {
    const BenchResult* eager =
        find_result(report, shape, DecodeMode::kEager, CheckpointPrecision::kFp32);
    if (eager == nullptr) return {StatusCode::kInternal, "demo: no eager result"};
    std::fprintf(out, "  %-12s %-18s %11.0f %8.2fx %13.2f\n", shape, "eager", eager->us_per_step,
                 1.0, 1.0);
    for (CheckpointPrecision c : kCheckpoints) {
      const BenchResult* r = find_result(report, shape, DecodeMode::kReplay, c);
      if (r == nullptr) return {StatusCode::kInternal, "demo: no replay result"};
      std::fprintf(out, "  %-12s %-18s %11.0f %8.2fx %13.2f", "", replay_label(c).c_str(),
                   r->us_per_step, r->speedup, r->model_bytes / eager->model_bytes);
      if (r->us_fold_step > 0.0) {
        std::fprintf(out, "   %.0f / %.0f", r->us_fold_step, r->us_plain_step);
      }
      std::fprintf(out, "\n");
      ++cases;
      if (r->speedup >= kClearGain) {
        ++paid;
        continue;
      }
      char what[96];
      std::snprintf(what, sizeof what, "%s %s (%.2fx)", shape, replay_label(c).c_str(),
                    r->speedup);
      slow.push_back({what, why_not_faster(report, *eager, *r)});
    }
  }
  std::fprintf(out,
               "\n  us/step: one decode step of the whole batch; vs eager: eager's time over this\n"
               "  one's; model bytes: the bytes model's traffic per step over eager's (counted,\n"
               "  not measured: bench/bytes_model.h); fold step: the step of each cycle that\n"
               "  folds the ring into the checkpoint.\n\n");
  std::fprintf(out, "Replay was faster than eager by >= %.2fx in %d of %d cases on this machine.\n",
               kClearGain, paid, cases);
  if (!slow.empty()) std::fprintf(out, "Where it was not, why (from this run's measurements):\n");
  for (const Slow& sl : slow) {
    std::fprintf(out, "- %s: %s.\n", sl.what.c_str(), sl.why.c_str());
  }
  return Status::ok();
}

}  // namespace

Status run_demo(const DemoOptions& o, std::FILE* out) {
  if (o.buffer_len < 1 || o.buffer_len > kMaxBufferLen || o.cycles < 1 || o.batch < 0) {
    return invalid_argument("demo needs a batch >= 0, cycles >= 1 and a buffer length in [1, " +
                            std::to_string(kMaxBufferLen) + "]");
  }
  if (o.device == Device::kCuda && !cuda_available()) {
    return unsupported("demo --device cuda needs a build with CUDA and a GPU");
  }
  const int batch = o.batch > 0 ? o.batch : o.device == Device::kCpu ? kDemoBatchCpu
                                                                      : kDemoBatchCuda;
  const std::string device_label =
      o.device == Device::kCpu ? "cpu (" + std::to_string(omp_get_max_threads()) + " threads)"
                               : std::string(device_name(o.device));
  std::fprintf(
      out,
      "ReplaySSM demo on %s: replay decoding against eager decoding, one Mamba-2 layer\n"
      "(nano4b: Nemotron-3-Nano-4B's shape) and one Gated DeltaNet layer (qwen35-4b:\n"
      "Qwen3.5-4B's). Eager reads and writes each sequence's whole state on every token.\n"
      "Replay keeps a checkpoint of the state and a ring of the last L = %d tokens' inputs:\n"
      "each step reads the checkpoint and computes its outputs from it and the ring, and the\n"
      "state is written once every L tokens (the fold). Inputs are generated at model scales\n"
      "(A < 0, dt_bias near -4).\n\n",
      device_label.c_str(), o.buffer_len);
  std::fprintf(out,
               "1. Agreement with eager: batch %d, %d tokens = %d fold cycles, fp32 activations.\n"
               "   err = max |replay - eager| / max |eager| over the outputs, and over the final\n"
               "   state (which is always the fp32 checkpoint; only outputs read the bf16/fp8\n"
               "   copies). spec T=%d: windows of 1 real + %d draft tokens, 1 to %d accepted.\n"
               "   ok: within the tolerance of the copy the outputs read (fp32 %.0e, bf16 %.0e,\n"
               "   fp8 %.0e) and, for the state, %.0e.\n\n",
               kDemoAgreementBatch, o.cycles * o.buffer_len, o.cycles, kSpecTokens,
               kSpecTokens - 1, kSpecTokens, kFp32Tol, kBf16Tol, kFp8Tol, kFp32Tol);
  std::fprintf(out, "  %-12s %-24s %12s %12s\n", "layer", "mode", "err(outputs)", "err(state)");
  Progress progress("demo");
  bool agree = true;
  for (const char* name : kShapes) {
    REPLAYSSM_RETURN_IF_ERROR(agreement_layer(*bench_shape_find(name), o, progress, out, &agree));
  }
  std::fprintf(out,
               "\n2. Speed: batch %d, L = %d, bf16 activations (as served), fp32 eager state.\n",
               batch, o.buffer_len);
  std::fflush(out);
  REPLAYSSM_RETURN_IF_ERROR(speed_part(o, batch, progress, out));
  if (!agree) {
    return {StatusCode::kInternal, "replay disagreed with eager beyond its tolerance (above)"};
  }
  return Status::ok();
}

}  // namespace replayssm::tools
