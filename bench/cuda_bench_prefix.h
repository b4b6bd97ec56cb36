#pragma once
/// \file cuda_bench_prefix.h
/// The prefix ops on the GPU (include/replayssm/prefix.h) at the real layer shapes, one layer:
/// `batch` pairs materialized or forked in one call, each replayed from a CUDA graph, against a
/// plain copy of the same pairs' fp32 states (what an engine without replay moves to keep or
/// fork a state), with the bytes each must move:
///   materialize    read the master (E·4, or E·2 in shared bf16) + k ring records, write E·4
///   fork           read + write every checkpoint copy (+ fp8 scales) and k ring records
///   fork shared    read + write k ring records (share_forked_checkpoints: the checkpoint is
///                  copied on fold)
///   state copy     read + write E·4
/// per pair, E the state's elements, k = p − folded the records between the last fold and p.
/// And what sharing costs: the release pass before a decode when no row is due (per call),
/// and when every copy's first fold is due (the deferred copy of every checkpoint copy).

#include <string>
#include <vector>

#include "replayssm/status.h"
#include "replayssm/types.h"

namespace replayssm {

struct PrefixBenchOptions {
  std::vector<std::string> shapes = {"super120b", "qwen35-122b"};
  std::vector<CheckpointPrecision> checkpoints = {CheckpointPrecision::kFp32,
                                                  CheckpointPrecision::kFp32Bf16};
  int batch = 256;
  int buffer_len = 16;                ///< L; records k run over 0, L/2 and L − 1
  DType input_dtype = DType::kBF16;  ///< the ring's records
  int repetitions = 7;                ///< timed graph replays; the median is reported
};

struct PrefixBenchRow {
  std::string shape;
  CheckpointPrecision checkpoint = CheckpointPrecision::kFp32;
  std::string op;   ///< "materialize", "fork", "fork shared", "state copy", "release, ..."
  int records = 0;  ///< k
  double us = 0.0;  ///< median per call of the whole batch
  double model_bytes = 0.0;
  double gbps = 0.0;
  double pct_of_copy = 0.0;    ///< of the measured state copy's GB/s
  double bytes_vs_copy = 0.0;  ///< model bytes / the state copy's
  /// forks only: a shared fork's model bytes / the state copy's.
  double deferred_vs_copy = 0.0;
};

struct PrefixBenchReport {
  std::string device;
  std::vector<PrefixBenchRow> rows;
};

/// Runs every shape × checkpoint of `options` (CUDA; kUnsupported without a GPU).
Status run_prefix_bench(const PrefixBenchOptions& options, PrefixBenchReport* report);

}  // namespace replayssm
