#pragma once
/// \file bench.h
/// Kernel-level decode benchmarks (BENCHMARKS.md, protocol): per case, our eager decode against
/// replay at a real layer shape, measured side by side in one run, against the bytes model
/// (bytes_model.h) and the machine's measured copy bandwidth.
///
/// Backends: run_cpu_bench (cpu_bench.cpp) and run_cuda_bench (cuda_bench.cu, which hands GDN
/// shapes to cuda_bench_gdn.cu; a build without CUDA gets a clear kUnsupported from
/// cuda_bench_unavailable.cpp). Both fill the same BenchReport, which bench_print and
/// bench_write_json render (bench/plot.py draws the JSON).

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "common/layer_kind.h"
#include "replayssm/status.h"
#include "replayssm/types.h"
#include "spec_acceptance.h"

namespace replayssm {

/// One layer shape of the protocol.
struct BenchShape {
  const char* name;  ///< "nano4b", "super120b", "qwen35-4b", "qwen35-122b"
  LayerKind kind;
  Mamba2Shape mamba2;
  GdnShape gdn;
  [[nodiscard]] StateDims dims() const {
    return visit_kind(kind, [&] { return state_dims(mamba2); }, [&] { return state_dims(gdn); });
  }
};

const std::vector<BenchShape>& bench_shapes();
/// The shape called `name`, or nullptr.
const BenchShape* bench_shape_find(const std::string& name);

/// Tokens per fold of replay decodes with fold cadence `fold_every` (ops.h; 0 = L) on a cache
/// of L = `buffer_len`: what a bench's cycles, staggering and bytes model take.
inline int fold_period(int fold_every, int buffer_len) {
  return fold_every > 0 ? fold_every : buffer_len;
}

/// Aligned: every row folds on the same step (a batch of equal-length requests). Staggered:
/// row b is b mod L tokens ahead, so 1/L of the rows fold on each step.
enum class FlushPattern : std::uint8_t { kAligned, kStaggered };
const char* flush_pattern_name(FlushPattern pattern);  ///< "aligned", "staggered"

struct BenchOptions {
  Device device = Device::kCpu;
  std::vector<std::string> shapes = {"nano4b", "super120b", "qwen35-4b", "qwen35-122b"};
  std::vector<int> batches = {16, 64};
  int buffer_len = 16;  ///< L
  /// Replay decodes' fold cadence (ops.h, fold_every; 0 = L, the only value on the CPU): a
  /// plain-decoding cycle is this many steps, and staggered rows this many apart.
  int fold_every = 0;
  [[nodiscard]] int fold_period() const {
    return ::replayssm::fold_period(fold_every, buffer_len);
  }
  /// SSM layers of one cache decoded per step, then one commit (CUDA): a model's step commits
  /// once for all its layers, so the protocol's 1 layer charges a whole commit to every layer
  /// step, which at small batches is a large part of it. Times are then per layer step; the
  /// slot rotation counts every layer's state.
  int layers = 1;
  /// Replay checkpoint precisions, each measured against the same eager baseline.
  std::vector<CheckpointPrecision> checkpoints = {CheckpointPrecision::kFp32};
  DType eager_state_dtype = DType::kF32;
  DType input_dtype = DType::kBF16;  ///< activations
  FlushPattern flush = FlushPattern::kAligned;
  /// Replay caches with StateCacheConfig::share_forked_checkpoints (nothing forked): what the
  /// release pass before every decode costs.
  bool share_forked_checkpoints = false;
  int repetitions = 5;  ///< timed cycles per case; the median is reported
  int warmup_cycles = 1;
  /// Rotate over enough slot groups that one cycle touches at least this much state, so the
  /// state comes from memory and not from a cache; 0 = kStreamCacheMultiple × the last-level
  /// cache (CPU) or the L2 (CUDA).
  std::int64_t min_state_bytes = 0;
  /// CPU: when > 0, fewer slot groups where needed so that the caches of one shape and batch
  /// (eager and every replay precision, timed side by side) hold at most this many bytes; the
  /// table then shows how many times the last-level cache each case still streams.
  std::int64_t memory_budget_bytes = 0;
  /// Called with (fraction done, what runs now); may be empty.
  std::function<void(double, const std::string&)> progress;
};

struct BenchResult {
  std::string shape;
  int batch = 0;
  DecodeMode mode = DecodeMode::kEager;
  CheckpointPrecision checkpoint = CheckpointPrecision::kFp32;  ///< replay only
  int buffer_len = 0;
  int fold_every = 0;  ///< replay: the decodes' fold cadence (BenchOptions::fold_every)
  [[nodiscard]] int fold_period() const {
    return ::replayssm::fold_period(fold_every, buffer_len);
  }
  FlushPattern flush = FlushPattern::kAligned;
  int slot_groups = 1;       ///< groups of `batch` slots rotated step by step
  int layers = 1;            ///< layers decoded per step (BenchOptions::layers)
  /// CPU: bytes of eager state the rotation covers (slot_groups × batch × state), which every
  /// case's cache holds in its own format; 0 elsewhere.
  double stream_bytes = 0.0;
  double us_per_step = 0.0;  ///< median over repetitions, one decode (+ commit) of the batch
  double us_min = 0.0;       ///< fastest repetition
  double model_bytes = 0.0;  ///< bytes model, per step
  double gbps = 0.0;         ///< model_bytes / time
  double pct_of_copy = 0.0;  ///< 100 · gbps / BenchReport::peak_gbps()
  double speedup = 1.0;      ///< eager time / this time, same shape and batch, same run
  /// CPU replay with aligned flushes (0 elsewhere): medians of the step that folds and of the
  /// other steps of a cycle (their median), µs; us_per_step is their average over the cycle.
  double us_fold_step = 0.0;
  double us_plain_step = 0.0;
};

/// One shape × batch × checkpoint of the speculative comparison (`bench --spec-tokens T`;
/// BENCHMARKS.md target: a T = 4 verify >= 3x faster per step than an eager spec step). CUDA.
struct SpecBenchResult {
  std::string shape;
  int batch = 0;
  int window = 0;    ///< T
  /// Tokens committed per step (k), or kRandomAcceptance: k drawn per row and step
  /// (spec_acceptance.h), each row folding on its own cadence, eager and replay committing the
  /// same draws.
  int accepted = 0;
  double accepted_mean = 0.0;  ///< k, or the mean of the draws the graphs commit
  int buffer_len = 0;
  CheckpointPrecision checkpoint = CheckpointPrecision::kFp32;
  /// The eager spec step as measured, µs per step (median): one decode of the library's eager
  /// cache with max_spec_tokens = T, which reads the state once and writes one state copy per
  /// window position, T + 1 state transfers (vLLM's scheme), and the commit that selects the
  /// accepted copy. (eager_fused false: a step of T sequential eager decodes, 2T transfers,
  /// with eager_fused_us estimating the fused scheme as eager_us · (T + 1) / 2T; no bench
  /// reports that any more.)
  bool eager_fused = true;
  double eager_us = 0.0;
  double eager_fused_us = 0.0;  ///< = eager_us when eager_fused
  double eager_bytes = 0.0;     ///< bytes the measured eager step moves (bytes model)
  /// Replay: one decode verifying the window + a commit of k, over whole fold cycles (random
  /// acceptance: over random_acceptance_steps steps, several folds of every row).
  double replay_us = 0.0;
  double replay_bytes = 0.0;
  double speedup = 0.0;        ///< eager_us / replay_us
  double speedup_fused = 0.0;  ///< eager_fused_us / replay_us
  [[nodiscard]] bool random_acceptance() const { return accepted == kRandomAcceptance; }
};

struct BenchReport {
  std::string device;      ///< "cpu (2 threads)", a GPU's name, ...
  double copy_gbps = 0.0;  ///< measured copy bandwidth, (read + write) bytes / s / 1e9
  /// CPU only (0 elsewhere): in-place update bandwidth, (read + write) bytes / s / 1e9. Where
  /// memcpy pays a read for ownership of its destination, this is the machine's real ceiling
  /// for a state update.
  double update_gbps = 0.0;
  /// CPU only: streaming-read bandwidth, bytes read / s / 1e9. Beside update_gbps it says what
  /// halving a step's bytes can buy: where a read of N bytes costs nearly an update's 2N,
  /// replay with an fp32 checkpoint gains little over eager (docs/BENCHMARKS.md, CPU).
  double read_gbps = 0.0;
  /// CPU only: the last-level cache the rotation is sized against (last_level_cache_bytes).
  std::int64_t cache_bytes = 0;
  std::vector<BenchResult> results;
  std::vector<SpecBenchResult> spec;  ///< the speculative comparison, when one was run
  /// What pct_of_copy is measured against: the larger of the two bandwidths.
  [[nodiscard]] double peak_gbps() const {
    return copy_gbps > update_gbps ? copy_gbps : update_gbps;
  }
};

/// The rotation's default: the state one cycle touches is this many times the cache, so that
/// (with any replacement policy) it comes from memory, as at serving scale.
inline constexpr int kStreamCacheMultiple = 4;

/// Bytes of the last-level CPU cache this process can use: the sum of the distinct
/// last-level caches of the online CPUs (sysfs), else sysconf's level-3 size, else 32 MiB.
std::int64_t last_level_cache_bytes();

/// What quick runs (`bench` without --full, `demo`) give BenchOptions::memory_budget_bytes:
/// 2 GiB, or a quarter of the machine's memory where that is less.
std::int64_t bench_quick_memory_budget();

/// What both benches check of BenchOptions::fold_every before any work: in [0, buffer_len].
Status validate_fold_every(const BenchOptions& options);

Status run_cpu_bench(const BenchOptions& options, BenchReport* report);
/// Implemented in bench/cuda_bench.cu by the CUDA backend; both layer families (GDN shapes
/// through bench/cuda_bench_gdn.cu).
Status run_cuda_bench(const BenchOptions& options, BenchReport* report);
/// The speculative comparison on CUDA: per shape × batch of options, the eager spec step
/// (SpecBenchResult) against a replay verify of `window` tokens committing `accepted` (0: all),
/// in each of options.checkpoints, aligned flushes. accepted = kRandomAcceptance: every row
/// commits its own k per step, drawn as spec_acceptance.h says, over graphs of
/// random_acceptance_steps steps, the eager baseline committing the same draws. Fills
/// report->device, copy_gbps and spec.
Status run_cuda_spec_bench(const BenchOptions& options, int window, int accepted,
                           BenchReport* report);

/// The median of timed repetitions (the mean of the middle two for an even count).
double median(std::vector<double> v);

/// Fills model_bytes, gbps, pct_of_copy and speedup of every result from its timing.
void bench_finish(BenchReport* report, const BenchOptions& options);
/// A table, one line per case, and a legend of its columns (then the speculative comparison's
/// table, when there is one).
void bench_print(const BenchReport& report, std::FILE* out);
Status bench_write_json(const BenchReport& report, const BenchOptions& options,
                        const std::string& path);

}  // namespace replayssm
