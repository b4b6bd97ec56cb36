// replayssm_prefix_bench: materialize and fork of a batch of (slot, position) pairs against a
// plain copy of their fp32 states, on the GPU at the real layer shapes (cuda_bench_prefix.h).
//
//   replayssm_prefix_bench [--shapes super120b,qwen35-122b] [--checkpoints fp32,fp32+bf16]
//                          [--batch 256] [--L 16] [--reps 7]

#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "cuda_bench_prefix.h"

int main(int argc, char** argv) {
  using namespace replayssm;
  CLI::App app{"Prefix ops (materialize, fork) against a full state copy, on the GPU"};
  PrefixBenchOptions o;
  std::vector<std::string> checkpoints = {"fp32", "fp32+bf16"};
  app.add_option("--shapes", o.shapes, "Layer shapes")->delimiter(',');
  app.add_option("--checkpoints", checkpoints, "Replay checkpoint precisions")
      ->delimiter(',')
      ->check(CLI::IsMember({"fp32", "bf16", "fp32+bf16", "fp32+fp8"}));
  app.add_option("--batch", o.batch, "(slot, position) pairs per call")->check(CLI::Range(1, 65535));
  app.add_option("--L", o.buffer_len, "Buffer length")->check(CLI::Range(2, 64));
  app.add_option("--reps", o.repetitions, "Timed repetitions (median)")->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);
  o.checkpoints.clear();
  for (const std::string& c : checkpoints) {
    CheckpointPrecision p{};
    parse_checkpoint_precision(c, &p);
    o.checkpoints.push_back(p);
  }

  PrefixBenchReport report;
  const Status st = run_prefix_bench(o, &report);
  if (!st.is_ok()) {
    std::fprintf(stderr, "error: %s\n", st.to_string().c_str());
    return 1;
  }
  std::printf("%s, batch %d pairs, one layer, L = %d, records of %s\n", report.device.c_str(),
              o.batch, o.buffer_len, dtype_name(o.input_dtype));
  std::printf("%-12s %-10s %-20s %3s %10s %9s %8s %7s %10s %10s\n", "shape", "checkpoint", "op",
              "k", "us", "MB", "GB/s", "%copy", "vs copy", "deferred");
  for (const PrefixBenchRow& r : report.rows) {
    std::printf("%-12s %-10s %-20s %3d %10.1f %9.1f %8.1f %6.0f%% %9.1f%%", r.shape.c_str(),
                checkpoint_precision_name(r.checkpoint), r.op.c_str(), r.records, r.us,
                r.model_bytes / 1e6, r.gbps, r.pct_of_copy, 100.0 * r.bytes_vs_copy);
    if (r.op == "fork" || r.op == "fork shared") {
      std::printf(" %9.1f%%", 100.0 * r.deferred_vs_copy);
    }
    std::printf("\n");
  }
  return 0;
}
