// The shapes of the protocol, the derived figures of a report, and its table and JSON forms.

#include <algorithm>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>

#include "bench.h"
#include "bytes_model.h"
#include "io/output_file.h"
#include "replayssm/version.h"

namespace replayssm {

const std::vector<BenchShape>& bench_shapes() {
  // BENCHMARKS.md, protocol: one layer of each model.
  static const std::vector<BenchShape> shapes = {
      {"nano4b", LayerKind::kMamba2, {96, 80, 128, 8}, {}},
      {"super120b", LayerKind::kMamba2, {128, 64, 128, 8}, {}},
      {"qwen35-4b", LayerKind::kGdn, {}, {16, 32, 128, 128}},
      {"qwen35-122b", LayerKind::kGdn, {}, {16, 64, 128, 128}},
  };
  return shapes;
}

const BenchShape* bench_shape_find(const std::string& name) {
  for (const BenchShape& s : bench_shapes()) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

const char* flush_pattern_name(FlushPattern pattern) {
  return pattern == FlushPattern::kAligned ? "aligned" : "staggered";
}

namespace {

// The L column: L, or "F/L" for decodes that fold every F tokens of a cache of L.
std::string cadence_label(const BenchResult& r) {
  const std::string L = std::to_string(r.buffer_len);
  return r.fold_every > 0 ? std::to_string(r.fold_every) + "/" + L : L;
}

std::string mode_label(const BenchResult& r) {
  if (r.mode == DecodeMode::kEager) return "eager";
  return std::string("replay ") + checkpoint_precision_name(r.checkpoint);
}

// The protocol's cases, one line each, then what the columns mean.
void protocol_print(const BenchReport& report, std::FILE* out) {
  const bool streams = report.cache_bytes > 0;  // CPU: how far the rotation outsizes the cache
  std::fprintf(out, "%-12s %6s %-18s %5s %-9s %11s %9s %8s %7s %8s%s\n", "shape", "batch", "mode",
               "L", "flush", "us/step", "MB/step", "GB/s", "%copy", "speedup",
               streams ? "   xLLC" : "");
  for (const BenchResult& r : report.results) {
    std::fprintf(out, "%-12s %6d %-18s %5s %-9s %11.1f %9.1f %8.1f %6.0f%% %7.2fx", r.shape.c_str(),
                 r.batch, mode_label(r).c_str(), cadence_label(r).c_str(), flush_pattern_name(r.flush),
                 r.us_per_step, r.model_bytes / 1e6, r.gbps, r.pct_of_copy, r.speedup);
    if (streams) std::fprintf(out, " %6.1fx", r.stream_bytes / double(report.cache_bytes));
    std::fprintf(out, "\n");
  }
  bool split = false;
  for (const BenchResult& r : report.results) split = split || r.us_fold_step > 0.0;
  if (split) {
    std::fprintf(out,
                 "replay steps apart (aligned flushes): us of the fold step / of a plain step\n");
    for (const BenchResult& r : report.results) {
      if (r.us_fold_step <= 0.0) continue;
      std::fprintf(out, "%-12s %6d %-18s %11.1f / %.1f\n", r.shape.c_str(), r.batch,
                   mode_label(r).c_str(), r.us_fold_step, r.us_plain_step);
    }
  }
  std::fprintf(
      out,
      "\nus/step  median time of one decode step of the whole batch (decode + commit, and the\n"
      "         fold on the step it falls due), timed over whole cycles of L steps\n"
      "MB/step  bytes the step must move by the bytes model (bench/bytes_model.h): state and\n"
      "         ring traffic; activations, the same in every mode, are not counted\n"
      "GB/s     MB/step / us/step: the bandwidth the step reaches by that model\n"
      "%%copy    that GB/s against the best bandwidth measured above (%.1f GB/s, read + write)\n"
      "speedup  eager us/step / this us/step: same shape and batch, timed in the same run\n"
      "flush    aligned: every row folds on the same step of the cycle; staggered: 1/L of the\n"
      "         rows fold on each step\n",
      report.peak_gbps());
  if (std::any_of(report.results.begin(), report.results.end(),
                  [](const BenchResult& r) { return r.fold_every > 0; })) {
    std::fprintf(out,
                 "F/L      replay decodes that fold every F tokens (fold_every) on a cache of L: "
                 "cycles,\n         staggering and the bytes model take F\n");
  }
  int layers = 1;
  for (const BenchResult& r : report.results) layers = std::max(layers, r.layers);
  if (layers > 1) {
    std::fprintf(out,
                 "layers   %d layers of one cache decoded per step, then one commit, as a model "
                 "steps:\n         us/step and MB/step are per layer step\n",
                 layers);
  }
  if (streams) {
    std::fprintf(out,
                 "xLLC     state the case cycles through (slot groups x batch x state) over the "
                 "%.0f MiB\n         last-level cache: >= %d streams it from memory, as at serving "
                 "scale\n",
                 double(report.cache_bytes) / double(1 << 20), kStreamCacheMultiple);
  }
}

// The k column: the tokens every row commits per step, or "~" and the mean of random draws.
std::string accepted_label(const SpecBenchResult& r) {
  char text[32];
  if (r.random_acceptance()) {
    std::snprintf(text, sizeof text, "~%.2f", r.accepted_mean);
  } else {
    std::snprintf(text, sizeof text, "%d", r.accepted);
  }
  return text;
}

// The speculative comparison: eager spec against replay verify, per shape × batch × checkpoint.
void spec_print(const BenchReport& report, std::FILE* out) {
  const double peak = report.peak_gbps();
  auto pct = [peak](double bytes, double us) {
    return peak > 0.0 && us > 0.0 ? 100.0 * bytes / (us * 1e3) / peak : 0.0;
  };
  std::set<std::pair<int, int>> random_windows;  // (T, L) of the random-acceptance cases
  for (const SpecBenchResult& r : report.spec) {
    if (r.random_acceptance()) random_windows.insert({r.window, r.buffer_len});
  }
  const int k_width = random_windows.empty() ? 2 : 5;  // "~3.01" where k is a mean
  std::fprintf(out, "spec verify vs eager spec (%%copy against %.1f GB/s)\n", peak);
  std::fprintf(out, "%-12s %6s %2s %*s %3s %-10s %-10s %11s %6s %11s %6s %8s %11s\n", "shape",
               "batch", "T", k_width, "k", "L", "checkpoint", "eager", "eager us", "%copy",
               "replay us", "%copy", "speedup", "vs fused");
  bool sequential = false;
  for (const SpecBenchResult& r : report.spec) {
    sequential = sequential || !r.eager_fused;
    std::fprintf(out,
                 "%-12s %6d %2d %*s %3d %-10s %-10s %11.1f %5.0f%% %11.1f %5.0f%% %7.2fx "
                 "%10.2fx\n",
                 r.shape.c_str(), r.batch, r.window, k_width, accepted_label(r).c_str(),
                 r.buffer_len, checkpoint_precision_name(r.checkpoint),
                 r.eager_fused ? "fused" : "sequential",
                 r.eager_us, pct(r.eager_bytes, r.eager_us), r.replay_us,
                 pct(r.replay_bytes, r.replay_us), r.speedup, r.speedup_fused);
  }
  std::fprintf(out,
               "eager fused: read the state once, write one state per draft (T + 1 transfers)%s\n",
               sequential ? "; sequential: T eager decodes (2T transfers), 'vs fused' against "
                            "the fused scheme's estimate eager·(T + 1)/2T"
                          : "");
  for (const auto& [T, L] : random_windows) {
    const std::vector<double> probabilities = random_acceptance_probabilities(T);
    std::string p;
    for (double x : probabilities) {
      char v[16];
      std::snprintf(v, sizeof v, "%s%.2f", p.empty() ? "" : " ", x);
      p += v;
    }
    if (std::adjacent_find(probabilities.begin(), probabilities.end(), std::not_equal_to<>()) ==
        probabilities.end()) {
      p = "1/" + std::to_string(T) + " each";  // uniform: no list of T equal numbers
    }
    std::fprintf(out,
                 "k ~m: random acceptance (T = %d, L = %d), k drawn per row and step with "
                 "P(k = 1..%d) = %s\n"
                 "      (mean %.2f; m: the mean of the draws); every row folds on its own "
                 "cadence; us per step\n"
                 "      over graphs of %d steps, eager and replay committing the same draws\n",
                 T, L, T, p.c_str(), random_acceptance_mean(T), random_acceptance_steps(T, L));
  }
}

}  // namespace

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Status validate_fold_every(const BenchOptions& o) {
  if (o.fold_every < 0 || o.fold_every > o.buffer_len) {
    return invalid_argument("fold_every must be in [1, L], or 0 for L");
  }
  return Status::ok();
}

void bench_finish(BenchReport* report, const BenchOptions& options) {
  for (BenchResult& r : report->results) {
    const BenchShape* shape = bench_shape_find(r.shape);
    if (shape == nullptr || r.us_per_step <= 0.0) continue;
    BytesModelCase c;
    c.dims = shape->dims();
    c.batch = r.batch;
    c.mode = r.mode;
    c.state_dtype = options.eager_state_dtype;
    c.checkpoint = r.checkpoint;
    c.buffer_len = r.fold_period();  // tokens per fold
    c.input_dtype = options.input_dtype;
    r.model_bytes = bytes_model_step(c).total();
    r.gbps = r.model_bytes / (r.us_per_step * 1e-6) / 1e9;
    r.pct_of_copy = report->peak_gbps() > 0.0 ? 100.0 * r.gbps / report->peak_gbps() : 0.0;
    const auto eager =
        std::find_if(report->results.begin(), report->results.end(), [&r](const BenchResult& e) {
          return e.mode == DecodeMode::kEager && e.shape == r.shape && e.batch == r.batch;
        });
    r.speedup = eager != report->results.end() ? eager->us_per_step / r.us_per_step : 0.0;
  }
}

void bench_print(const BenchReport& report, std::FILE* out) {
  std::fprintf(out, "device: %s; copy bandwidth %.1f GB/s", report.device.c_str(),
               report.copy_gbps);
  if (report.update_gbps > 0.0) {
    std::fprintf(out, ", in-place update %.1f GB/s", report.update_gbps);
  }
  std::fprintf(out, " (read + write bytes; %%copy is against %.1f GB/s)", report.peak_gbps());
  if (report.read_gbps > 0.0) {
    std::fprintf(out, "; streaming read %.1f GB/s (bytes read)", report.read_gbps);
  }
  std::fprintf(out, "\n");
  if (!report.results.empty()) protocol_print(report, out);
  if (!report.spec.empty()) spec_print(report, out);
}

Status bench_write_json(const BenchReport& report, const BenchOptions& options,
                        const std::string& path) {
  using json = nlohmann::json;
  json cases = json::array();
  for (const BenchResult& r : report.results) {
    cases.push_back({{"shape", r.shape},
                     {"batch", r.batch},
                     {"mode", decode_mode_name(r.mode)},
                     {"checkpoint", r.mode == DecodeMode::kReplay
                                        ? json(checkpoint_precision_name(r.checkpoint))
                                        : json(nullptr)},
                     {"buffer_len", r.buffer_len},
                     {"fold_every", r.fold_every},
                     {"flush", flush_pattern_name(r.flush)},
                     {"slot_groups", r.slot_groups},
                     {"layers", r.layers},
                     {"stream_bytes", r.stream_bytes},
                     {"us_per_step_median", r.us_per_step},
                     {"us_per_step_min", r.us_min},
                     {"us_fold_step", r.us_fold_step},
                     {"us_plain_step", r.us_plain_step},
                     {"model_bytes_per_step", r.model_bytes},
                     {"model_gbps", r.gbps},
                     {"pct_of_copy_bandwidth", r.pct_of_copy},
                     {"speedup_vs_eager", r.speedup}});
  }
  json spec_cases = json::array();
  for (const SpecBenchResult& r : report.spec) {
    json c = {{"shape", r.shape},
              {"batch", r.batch},
              {"window", r.window},
              // k, or "random" (the mean of the draws in accepted_mean)
              {"accepted", r.random_acceptance() ? json("random") : json(r.accepted)},
              {"random_acceptance", r.random_acceptance()},
              {"accepted_mean", r.accepted_mean},
              {"buffer_len", r.buffer_len},
              {"checkpoint", checkpoint_precision_name(r.checkpoint)},
              {"eager_spec_scheme", r.eager_fused ? "fused" : "sequential"},
              {"eager_spec_us", r.eager_us},
              {"eager_spec_fused_us", r.eager_fused_us},
              {"eager_spec_bytes", r.eager_bytes},
              {"replay_us", r.replay_us},
              {"replay_bytes", r.replay_bytes},
              {"speedup", r.speedup},
              {"speedup_vs_fused", r.speedup_fused}};
    if (r.random_acceptance()) {  // what was drawn from, and over how many steps per graph
      c["acceptance_probabilities"] = random_acceptance_probabilities(r.window);
      c["steps_per_graph"] = random_acceptance_steps(r.window, r.buffer_len);
    }
    spec_cases.push_back(c);
  }
  json doc = {{"device", report.device},
                    {"copy_gbps", report.copy_gbps},
                    {"update_gbps", report.update_gbps},
                    {"read_gbps", report.read_gbps},
                    {"cache_bytes", report.cache_bytes},
                    {"peak_gbps", report.peak_gbps()},
                    {"input_dtype", dtype_name(options.input_dtype)},
                    {"eager_state_dtype", dtype_name(options.eager_state_dtype)},
                    {"repetitions", options.repetitions},
                    {"version", REPLAYSSM_VERSION},
                    {"cases", cases}};
  if (!spec_cases.empty()) doc["spec_cases"] = spec_cases;
  std::string text;
  try {
    text = doc.dump(2);
  } catch (const json::exception& e) {  // only on invalid UTF-8, which no field holds
    return {StatusCode::kInternal, std::string("cannot encode the JSON report: ") + e.what()};
  }
  text += "\n";
  return output_file_write(path, std::span(reinterpret_cast<const std::uint8_t*>(text.data()),
                                           text.size()));
}

}  // namespace replayssm
