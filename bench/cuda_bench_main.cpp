// replayssm_cuda_bench: the full CUDA sweep of BENCHMARKS.md in one process (what
// `replayssm bench --device cuda` runs for one L and one flush pattern, over every L and both
// flush patterns), then the speculative comparison (`replayssm bench --spec-tokens T`), both
// layer families. Prints the tables; --json writes them all in bench_write_json's format (the
// protocol's "cases" and the comparison's "spec_cases"; bench/plot.py draws it).
//
//   replayssm_cuda_bench [--shapes nano4b,super120b] [--batches 1,64,256,1024] [--L 8,16,32]
//                        [--flush aligned,staggered] [--checkpoints fp32,bf16,fp32+bf16,fp32+fp8]
//                        [--spec-window 4] [--spec-accepted 4] [--spec-batches 64,256]
//                        [--reps 7] [--json out.json]

#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "bench.h"

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::vector<int> ints(const std::string& s) {
  std::vector<int> out;
  for (const std::string& v : split(s)) out.push_back(std::stoi(v));
  return out;
}

int fail(const replayssm::Status& s) {
  std::fprintf(stderr, "replayssm_cuda_bench: %s\n", s.to_string().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace replayssm;
  std::map<std::string, std::string> arg = {
      {"--shapes", "nano4b,super120b"}, {"--batches", "1,64,256,1024"}, {"--L", "8,16,32"},
      {"--flush", "aligned,staggered"}, {"--checkpoints", "fp32,bf16,fp32+bf16,fp32+fp8"},
      {"--spec-window", "4"},           {"--spec-accepted", "4"},      {"--spec-batches", "64,256"},
      {"--reps", "7"},                  {"--json", ""}};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (arg.count(argv[i]) == 0) {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
    arg[argv[i]] = argv[i + 1];
  }
  BenchOptions o;
  o.device = Device::kCuda;
  o.shapes = split(arg["--shapes"]);
  o.batches = ints(arg["--batches"]);
  o.repetitions = std::stoi(arg["--reps"]);
  o.checkpoints.clear();
  for (const std::string& c : split(arg["--checkpoints"])) {
    CheckpointPrecision p;
    if (!parse_checkpoint_precision(c, &p)) return fail(invalid_argument("bad checkpoint " + c));
    o.checkpoints.push_back(p);
  }
  BenchReport all;
  for (int L : ints(arg["--L"])) {
    for (const std::string& f : split(arg["--flush"])) {
      BenchOptions run = o;
      run.buffer_len = L;
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
  const int window = std::stoi(arg["--spec-window"]);
  if (window > 1) {
    BenchOptions so = o;
    so.buffer_len = 16;
    so.batches = ints(arg["--spec-batches"]);
    BenchReport spec;
    if (Status s = run_cuda_spec_bench(so, window, std::stoi(arg["--spec-accepted"]), &spec);
        !s.is_ok()) {
      return fail(s);
    }
    bench_print(spec, stdout);
    if (all.device.empty()) {
      all.device = spec.device;
      all.copy_gbps = spec.copy_gbps;
    }
    all.spec = std::move(spec.spec);
  }
  const std::string path = arg["--json"];
  if (!path.empty()) {
    if (Status s = bench_write_json(all, o, path); !s.is_ok()) return fail(s);
  }
  return 0;
}
