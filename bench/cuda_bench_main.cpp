// replayssm_cuda_bench: the full CUDA sweep of BENCHMARKS.md in one process (what
// `replayssm bench --device cuda` runs for one L and one flush pattern, over every L and both
// flush patterns), then the speculative comparison (`replayssm bench --spec-tokens T`), both
// layer families. Prints the tables; --json writes them all in bench_write_json's format (the
// protocol's "cases" and the comparison's "spec_cases"; bench/plot.py draws it). Staggered
// flushes come first: in serving, requests start at different steps, so every step has rows
// that fold beside rows that do not; aligned flushes (a batch of equal-length requests) are
// the comparison.
//
//   replayssm_cuda_bench [--shapes nano4b,super120b] [--batches 1,4,16,64,256,1024]
//                        [--L 8,16,32] [--fold-every 0,4] [--flush staggered,aligned]
//                        [--checkpoints fp32,bf16,fp32+bf16,fp32+fp8]
//                        [--spec-window 4] [--spec-accepted 4|random] [--spec-batches 64,256]
//                        [--spec-L 16]
//                        [--reps 7] [--layers 1] [--json out.json]
//
// --fold-every: the replay decodes' fold cadences (StateCache ops, fold_every; 0 = L) run for
// each L, as "F/L" in the L column.
// --spec-accepted: the tokens every row commits per verify step, in [0, T] (0: all T), or
// `random`: k drawn per row and step with a fixed seed, so that every row folds on its own
// cadence, as the public kernels are timed (bench/spec_acceptance.h). Checked before any work.

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "bench.h"

namespace {

int fail(const replayssm::Status& s) {
  std::fprintf(stderr, "replayssm_cuda_bench: %s\n", s.to_string().c_str());
  return 1;
}

constexpr int kMaxSpecWindow = 8;  // --spec-window's largest value

}  // namespace

int main(int argc, char** argv) {
  using namespace replayssm;
  CLI::App app{"The full CUDA sweep of BENCHMARKS.md, then the speculative comparison"};
  std::vector<std::string> shapes = {"nano4b", "super120b"};
  std::vector<int> batches = {1, 4, 16, 64, 256, 1024};
  std::vector<int> buffer_lens = {8, 16, 32};
  std::vector<std::string> flushes = {"staggered", "aligned"};
  std::vector<std::string> checkpoints = {"fp32", "bf16", "fp32+bf16", "fp32+fp8"};
  std::vector<int> spec_batches = {64, 256};
  int spec_window = 4, spec_buffer_len = 16, reps = 7, layers = 1;
  std::string spec_accepted = "4";  // an integer or "random", parsed below
  std::string json;
  app.add_option("--shapes", shapes, "Layer shapes")->delimiter(',');
  app.add_option("--batches", batches, "Batch sizes")->delimiter(',')->check(CLI::PositiveNumber);
  app.add_option("--L", buffer_lens, "Buffer lengths")->delimiter(',')->check(CLI::PositiveNumber);
  std::vector<int> fold_everys = {0};
  app.add_option("--fold-every", fold_everys,
                 "Replay decodes' fold cadences (0: L; values above an L are skipped for it)")
      ->delimiter(',')
      ->check(CLI::NonNegativeNumber);
  app.add_option("--flush", flushes, "staggered (the default first) and/or aligned")
      ->delimiter(',')
      ->check(CLI::IsMember({"aligned", "staggered"}));
  app.add_option("--checkpoints", checkpoints, "Replay checkpoint precisions")
      ->delimiter(',')
      ->check(CLI::IsMember({"fp32", "bf16", "fp32+bf16", "fp32+fp8"}));
  app.add_option("--spec-window", spec_window, "Verify window T (1: skip the comparison)")
      ->check(CLI::Range(1, kMaxSpecWindow));
  app.add_option("--spec-accepted", spec_accepted,
                 std::string("Tokens accepted per window: an integer in [0, T] (0: all T), or "
                             "random: ") +
                     kRandomAcceptanceHelp)
      ->type_name("INT|random")
      ->capture_default_str();
  app.add_option("--spec-batches", spec_batches, "Batch sizes of the comparison")->delimiter(',');
  app.add_option("--spec-L", spec_buffer_len,
                 "Buffer length L of the comparison (a model verifying 4-token windows runs "
                 "best at 8: bench_spec)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--reps", reps, "Timed repetitions (median)")->check(CLI::Range(1, 1000));
  app.add_option("--layers", layers,
                 "Layers decoded per step before its one commit (times per layer step; the "
                 "speculative comparison stays at one layer)")
      ->check(CLI::Range(1, 256));
  app.add_option("--json", json, "Write all results as JSON");
  bool share = false;
  app.add_flag("--share-forked-checkpoints", share,
               "Replay caches that share forked checkpoints (the release pass of every decode)");
  CLI11_PARSE(app, argc, argv);
  // Before any work (the sweep runs first: a typo must not cost it). With --spec-window 1 the
  // comparison is skipped and any value a window could take passes, the default among them.
  int accepted = 0;
  const bool compare = spec_window > 1;
  if (Status s = parse_spec_accepted(spec_accepted, compare ? spec_window : kMaxSpecWindow,
                                     compare ? "--spec-window" : "the largest --spec-window",
                                     &accepted);
      !s.is_ok()) {
    return fail(s);
  }

  BenchOptions o;
  o.device = Device::kCuda;
  o.shapes = shapes;
  o.batches = batches;
  o.repetitions = reps;
  o.layers = layers;
  o.share_forked_checkpoints = share;
  o.checkpoints.clear();
  for (const std::string& c : checkpoints) {
    CheckpointPrecision p;
    parse_checkpoint_precision(c, &p);  // checked by IsMember above
    o.checkpoints.push_back(p);
  }
  // Every (L, fold cadence) pair, cadences above an L skipped and one equal to it run once.
  std::vector<std::pair<int, int>> cadences;
  for (int L : buffer_lens) {
    for (int every : fold_everys) {
      const std::pair<int, int> c{L, every == L ? 0 : every};
      if (every <= L && std::find(cadences.begin(), cadences.end(), c) == cadences.end()) {
        cadences.push_back(c);
      }
    }
  }
  BenchReport all;
  for (const auto& [L, every] : cadences) {
    for (const std::string& f : flushes) {
      BenchOptions run = o;
      run.buffer_len = L;
      run.fold_every = every;
      run.flush = f == "staggered" ? FlushPattern::kStaggered : FlushPattern::kAligned;
      BenchReport report;
      if (Status s = run_cuda_bench(run, &report); !s.is_ok()) return fail(s);
      bench_print(report, stdout);
      std::fflush(stdout);
      all.device = report.device;
      all.copy_gbps = report.copy_gbps;
      all.results.insert(all.results.end(), report.results.begin(), report.results.end());
    }
  }
  if (compare) {
    BenchOptions so = o;
    so.buffer_len = spec_buffer_len;
    so.batches = spec_batches;
    BenchReport spec;
    if (Status s = run_cuda_spec_bench(so, spec_window, accepted, &spec); !s.is_ok()) {
      return fail(s);
    }
    bench_print(spec, stdout);
    if (all.device.empty()) {
      all.device = spec.device;
      all.copy_gbps = spec.copy_gbps;
    }
    all.spec = std::move(spec.spec);
  }
  if (!json.empty()) {
    if (Status s = bench_write_json(all, o, json); !s.is_ok()) return fail(s);
  }
  return 0;
}
