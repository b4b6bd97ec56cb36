#include "demo.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "bench.h"
#include "bytes_model.h"
#include "engine/synthetic_trace.h"
#include "engine/trace_run.h"
#include "progress.h"

namespace replayssm::tools {

namespace {

// max_i |a_i − b_i| / max_i |b_i|: the library's error norm (one scale for the whole tensor,
// so that near-zero elements do not blow it up).
double rel_error(const std::vector<float>& a, const std::vector<float>& ref) {
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, std::fabs(double(a[i]) - double(ref[i])));
    scale = std::max(scale, std::fabs(double(ref[i])));
  }
  return scale > 0.0 ? diff / scale : diff;
}

struct DemoRun {
  const char* label;
  TraceRunOptions options;
};

std::vector<DemoRun> demo_runs(const DemoOptions& o) {
  TraceRunOptions base;
  base.device = o.device;
  base.buffer_len = o.buffer_len;
  std::vector<DemoRun> runs;
  TraceRunOptions eager = base;
  eager.mode = DecodeMode::kEager;
  runs.push_back({"eager", eager});
  for (CheckpointPrecision c : {CheckpointPrecision::kFp32, CheckpointPrecision::kFp32Bf16,
                                CheckpointPrecision::kFp32Fp8}) {
    TraceRunOptions r = base;
    r.checkpoint = c;
    runs.push_back({nullptr, r});
  }
  TraceRunOptions spec = base;
  spec.spec_tokens = 4;
  spec.accept_seed = o.seed;
  runs.push_back({"replay fp32 spec T=4", spec});
  return runs;
}

std::string run_label(const DemoRun& run) {
  if (run.label != nullptr) return run.label;
  return std::string("replay ") + checkpoint_precision_name(run.options.checkpoint);
}

double model_bytes(const LayerTrace& trace, const TraceRunOptions& o) {
  BytesModelCase c;
  c.dims = trace.dims();
  c.batch = trace.batch();
  c.mode = o.mode;
  c.checkpoint = o.checkpoint;
  c.buffer_len = o.buffer_len;
  c.input_dtype = o.input_dtype;
  return bytes_model_step(c).total();
}

Status demo_layer(const BenchShape& shape, const DemoOptions& o, Progress& progress,
                  double progress_base, std::FILE* out) {
  SyntheticTraceOptions so;
  so.num_steps = o.cycles * o.buffer_len;
  so.batch = o.batch;
  so.seed = o.seed;
  so.mamba2_gate = true;
  LayerTrace trace;
  if (shape.kind == LayerKind::kMamba2) {
    REPLAYSSM_RETURN_IF_ERROR(synthetic_trace_mamba2(shape.mamba2, so, &trace));
  } else {
    REPLAYSSM_RETURN_IF_ERROR(synthetic_trace_gdn(shape.gdn, so, &trace));
  }
  const StateDims d = trace.dims();
  progress.clear();  // before each print: stdout and the progress line share a terminal
  std::fprintf(out, "\n%s layer, %s shape: %d heads x %d x %d state (%.1f MB fp32 per sequence)\n",
               shape.kind == LayerKind::kMamba2 ? "Mamba-2" : "Gated DeltaNet", shape.name, d.heads,
               d.rows, d.cols, double(d.state_elems()) * 4 / 1e6);
  std::fprintf(out, "  %-22s %12s %12s %12s %9s %10s\n", "mode", "err(out)", "err(state)",
               "ms/step", "speedup", "bytes/eager");

  const std::vector<DemoRun> runs = demo_runs(o);
  TraceRunResult eager;
  double eager_bytes = 0.0;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    TraceRunOptions options = runs[i].options;
    const double base = progress_base + 0.5 * double(i) / double(runs.size());
    options.progress = [&](std::int64_t done, std::int64_t total) {
      progress.update(base + 0.5 * double(done) / double(total) / double(runs.size()),
                      std::string(shape.name) + " " + run_label(runs[i]));
    };
    TraceRunResult r;
    REPLAYSSM_RETURN_IF_ERROR(trace_run(trace, options, &r));
    // Time per step of the real stream: a spec run's fewer, wider steps advance it as far.
    const double ms = 1e3 * r.decode_seconds / trace.num_steps();
    const double bytes = model_bytes(trace, options);
    progress.clear();
    if (i == 0) {
      eager = r;
      eager_bytes = bytes;
      std::fprintf(out, "  %-22s %12s %12s %12.2f %8.2fx %10.2f\n", run_label(runs[i]).c_str(),
                   "(reference)", "(reference)", ms, 1.0, 1.0);
      continue;
    }
    const double eager_ms = 1e3 * eager.decode_seconds / trace.num_steps();
    char bytes_ratio[16] = "-";  // the model covers plain steps; a spec step's k varies
    if (options.spec_tokens == 1)
      std::snprintf(bytes_ratio, sizeof bytes_ratio, "%.2f", bytes / eager_bytes);
    std::fprintf(out, "  %-22s %12.2e %12.2e %12.2f %8.2fx %10s\n", run_label(runs[i]).c_str(),
                 rel_error(r.out, eager.out), rel_error(r.state, eager.state), ms, eager_ms / ms,
                 bytes_ratio);
  }
  return Status::ok();
}

}  // namespace

Status run_demo(const DemoOptions& o, std::FILE* out) {
  if (o.batch < 1 || o.buffer_len < 1 || o.cycles < 1) {
    return invalid_argument("demo needs batch, buffer length and cycles >= 1");
  }
  const std::string device_label =
      o.device == Device::kCpu ? "cpu (" + std::to_string(omp_get_max_threads()) + " threads)"
                               : std::string(device_name(o.device));
  std::fprintf(out,
               "ReplaySSM demo: eager decode writes the whole state every token; replay keeps a\n"
               "checkpoint plus a ring of the last L tokens' inputs and writes the state once\n"
               "per L tokens. Same outputs, about half the memory traffic.\n\n"
               "device %s, batch %d, %d tokens = %d fold cycles of L = %d, fp32 activations,\n"
               "random inputs at real scales (A < 0, dt_bias near -4).\n",
               device_label.c_str(), o.batch, o.cycles * o.buffer_len, o.cycles, o.buffer_len);
  Progress progress("demo");
  REPLAYSSM_RETURN_IF_ERROR(demo_layer(*bench_shape_find("nano4b"), o, progress, 0.0, out));
  REPLAYSSM_RETURN_IF_ERROR(demo_layer(*bench_shape_find("qwen35-4b"), o, progress, 0.5, out));
  progress.clear();
  std::fprintf(
      out,
      "\nerr: max |x - eager| / max |eager| over the layer's outputs (or final state).\n"
      "fp32 replay differs from eager by rounding order only; a bf16/fp8 read copy adds\n"
      "its rounding to the outputs but never to the state, which stays fp32.\n"
      "bytes/eager: the bytes model's traffic per step against eager's (bench/bytes_model.h).\n"
      "spec T=4: windows of 1 real + 3 draft tokens, a random 1..4 accepted; time per\n"
      "token of the real stream.\n");
  return Status::ok();
}

}  // namespace replayssm::tools
