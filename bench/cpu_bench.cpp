// The CPU benchmark: eager against replay decode of one layer at the real shapes, timed over
// whole fold cycles of L steps after warm-up, with the state rotated over enough slots that it
// streams from memory (BENCHMARKS.md, protocol and CPU).

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench.h"
#include "engine/activations.h"
#include "engine/synthetic_trace.h"
#include "replayssm/ops.h"
#include "replayssm/state_cache.h"

namespace replayssm {

namespace {

using Clock = std::chrono::steady_clock;

// Distinct input sets cycled through the steps: real-looking, never zeros, and not one
// repeated token (which would let a cache keep the activations hot).
constexpr int kInputSets = 4;
constexpr std::uint64_t kInputSeed = 2024;

// Read + write bandwidth of main memory with all the threads the kernels use, GB/s (bytes read
// plus bytes written, per second), best of 5 over 256 MiB: `memcpy_gbps` for a memcpy split
// across threads, `update_gbps` for an in-place update a[i] = a[i]·c + 1 (the access pattern of
// an eager state update). On some machines (VMs in particular) memcpy's stores cost an extra
// read for ownership and it reaches well below what an in-place update does. `read_gbps`:
// a streaming sum, bytes read per second (the access pattern of a replay step's mat-vec).
void measure_bandwidth(double* memcpy_gbps, double* update_gbps, double* read_gbps) {
  constexpr std::size_t kBytes = std::size_t{256} << 20;
  constexpr std::size_t kChunk = std::size_t{1} << 20;
  constexpr std::int64_t kChunks = kBytes / kChunk;
  constexpr std::int64_t kFloats = kBytes / sizeof(float);
  const auto src = std::make_unique<char[]>(kBytes);
  const auto dst = std::make_unique<char[]>(kBytes);
  // First touch in the same parallel layout as the timed loops.
#pragma omp parallel for schedule(static)
  for (std::int64_t c = 0; c < kChunks; ++c) {
    std::memset(src.get() + c * kChunk, 0, kChunk);
    std::memset(dst.get() + c * kChunk, 0, kChunk);
  }
  const auto best_of_5 = [](double bytes, auto&& loop) {
    double best = 0.0;
    for (int rep = 0; rep < 5; ++rep) {
      const auto start = Clock::now();
      loop();
      const double s = std::chrono::duration<double>(Clock::now() - start).count();
      best = std::max(best, bytes / s / 1e9);
    }
    return best;
  };
  *memcpy_gbps = best_of_5(2.0 * double(kBytes), [&] {
#pragma omp parallel for schedule(static)
    for (std::int64_t c = 0; c < kChunks; ++c) {
      std::memcpy(dst.get() + c * kChunk, src.get() + c * kChunk, kChunk);
    }
  });
  float* a = reinterpret_cast<float*>(src.get());
  *update_gbps = best_of_5(2.0 * double(kBytes), [&] {
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < kFloats; ++i) a[i] = a[i] * 0.5f + 1.0f;  // stays finite
  });
  volatile float sink = 0.0f;  // keeps the sum, so the reads are not optimised away
  *read_gbps = best_of_5(double(kBytes), [&] {
    constexpr int kParts = 32;  // independent sums: one sum's add latency would bound the loop
    constexpr std::int64_t kChunkFloats = kChunk / sizeof(float);
    float sum = 0.0f;
#pragma omp parallel for schedule(static) reduction(+ : sum)
    for (std::int64_t c = 0; c < kChunks; ++c) {
      float part[kParts] = {};
      const float* chunk = a + c * kChunkFloats;
      for (std::int64_t i = 0; i < kChunkFloats; i += kParts) {
        for (int k = 0; k < kParts; ++k) part[k] += chunk[i + k];
      }
      for (int k = 0; k < kParts; ++k) sum += part[k];
    }
    sink = sum;
  });
  (void)sink;
}

// The CPU cache of one case of the benchmark.
StateCacheConfig case_config(const BenchShape& shape, const BenchOptions& options,
                             DecodeMode mode, CheckpointPrecision checkpoint, int capacity) {
  StateCacheConfig config;
  config.kind = shape.kind;
  config.mamba2 = shape.mamba2;
  config.gdn = shape.gdn;
  config.capacity = capacity;
  config.device = Device::kCpu;
  config.mode = mode;
  config.input_dtype = options.input_dtype;
  config.state_dtype = options.eager_state_dtype;
  config.buffer_len = options.buffer_len;
  config.checkpoint = checkpoint;
  return config;
}

// One step's inputs for the whole batch, in the cache's dtypes ([batch, 1, ...] windows are
// the trace's [batch, ...] rows of one step).
struct StepInputs {
  std::vector<std::uint8_t> vec;           // Mamba-2 x; GDN v
  std::vector<std::uint8_t> key_a, key_b;  // Mamba-2 B, C; GDN q, k
  std::vector<float> head_a, head_b;       // Mamba-2 dt, (none); GDN g, beta
};

template <typename T>
std::vector<T> step_slice(const std::vector<T>& all, int step, std::int64_t per_step) {
  return {all.begin() + step * per_step, all.begin() + (step + 1) * per_step};
}

// Everything the timed loop needs for one case.
class CaseRunner {
 public:
  CaseRunner(const BenchShape& shape, int batch, int groups, const BenchOptions& options)
      : shape_(shape), batch_(batch), groups_(groups), options_(options) {}

  Status init(DecodeMode mode, CheckpointPrecision checkpoint) {
    mode_ = mode;
    REPLAYSSM_RETURN_IF_ERROR(state_cache_create(
        case_config(shape_, options_, mode, checkpoint, batch_ * groups_), &cache_));
    group_slots_.assign(static_cast<std::size_t>(groups_), {});
    for (auto& group : group_slots_) {
      for (int b = 0; b < batch_; ++b) {
        int slot = -1;
        REPLAYSSM_RETURN_IF_ERROR(state_cache_allocate_slot(*cache_, &slot));
        group.push_back(slot);
      }
    }
    accepted_.assign(static_cast<std::size_t>(batch_), 1);
    REPLAYSSM_RETURN_IF_ERROR(make_inputs());
    const StateDims d = shape_.dims();
    out_.resize(static_cast<std::size_t>(std::int64_t{batch_} * d.heads * d.rows) *
                dtype_size(options_.input_dtype));
    return Status::ok();
  }

  // Staggered flushes: row b is pre-advanced by b mod L tokens (padding the others), so that
  // afterwards 1/L of the rows fold on each step (L: the fold cadence).
  Status stagger() {
    const int L = options_.fold_period();
    for (int j = 0; j + 1 < L; ++j) {
      for (const auto& group : group_slots_) {
        std::vector<std::int32_t> ids = group;
        for (int b = 0; b < batch_; ++b) {
          if (b % L <= j) ids[static_cast<std::size_t>(b)] = -1;
        }
        REPLAYSSM_RETURN_IF_ERROR(step(ids, j % kInputSets));
      }
    }
    return Status::ok();
  }

  // One fold cycle: L steps (the fold cadence) of every slot group, groups interleaved step by
  // step. `step_us`, when given, receives each step's time over all groups, µs per group.
  Status cycle(int* input_set, std::vector<double>* step_us = nullptr) {
    const int L = options_.fold_period();
    if (step_us != nullptr) step_us->assign(std::size_t(L), 0.0);
    for (int s = 0; s < L; ++s) {
      const auto start = Clock::now();
      for (const auto& group : group_slots_) {
        REPLAYSSM_RETURN_IF_ERROR(step(group, *input_set));
      }
      if (step_us != nullptr) {
        (*step_us)[std::size_t(s)] = std::chrono::duration<double>(Clock::now() - start).count() *
                                     1e6 / double(group_slots_.size());
      }
      *input_set = (*input_set + 1) % kInputSets;
    }
    return Status::ok();
  }

 private:
  Status make_inputs() {
    SyntheticTraceOptions o;
    o.num_steps = kInputSets;
    o.batch = batch_;
    o.seed = kInputSeed;
    o.mamba2_gate = false;  // serving kernels apply the gate in the following norm, not here
    LayerTrace trace;
    const DType act = options_.input_dtype;
    const Status inputs_made = visit_kind(
        shape_.kind,
        [&]() -> Status {
          REPLAYSSM_RETURN_IF_ERROR(synthetic_trace_mamba2(shape_.mamba2, o, &trace));
          const Mamba2Trace& t = trace.mamba2;
          const std::int64_t vec = std::int64_t{batch_} * t.shape.nheads * t.shape.head_dim;
          const std::int64_t key = std::int64_t{batch_} * t.shape.ngroups * t.shape.dstate;
          const std::int64_t head = std::int64_t{batch_} * t.shape.nheads;
          for (int i = 0; i < kInputSets; ++i) {
            StepInputs in;
            in.vec = activations_pack(act, step_slice(t.x, i, vec));
            in.key_a = activations_pack(act, step_slice(t.B, i, key));
            in.key_b = activations_pack(act, step_slice(t.C, i, key));
            in.head_a = step_slice(t.dt, i, head);
            inputs_.push_back(std::move(in));
          }
          A_ = t.A;
          D_ = t.D;
          dt_bias_ = t.dt_bias;
          return Status::ok();
        },
        [&]() -> Status {
          REPLAYSSM_RETURN_IF_ERROR(synthetic_trace_gdn(shape_.gdn, o, &trace));
          const GdnTrace& t = trace.gdn;
          const std::int64_t vec =
              std::int64_t{batch_} * t.shape.num_v_heads * t.shape.head_v_dim;
          const std::int64_t key =
              std::int64_t{batch_} * t.shape.num_k_heads * t.shape.head_k_dim;
          const std::int64_t head = std::int64_t{batch_} * t.shape.num_v_heads;
          for (int i = 0; i < kInputSets; ++i) {
            StepInputs in;
            in.vec = activations_pack(act, step_slice(t.v, i, vec));
            in.key_a = activations_pack(act, step_slice(t.q, i, key));
            in.key_b = activations_pack(act, step_slice(t.k, i, key));
            in.head_a = step_slice(t.g, i, head);
            in.head_b = step_slice(t.beta, i, head);
            inputs_.push_back(std::move(in));
          }
          return Status::ok();
        });
    REPLAYSSM_RETURN_IF_ERROR(inputs_made);
    return Status::ok();
  }

  // One decode of `batch` rows plus the commit of one token each.
  Status step(const std::vector<std::int32_t>& slot_ids, int input_set) {
    const StepInputs& in = inputs_[static_cast<std::size_t>(input_set)];
    const Status decoded = visit_kind(
        shape_.kind,
        [&]() -> Status {
          Mamba2DecodeArgs a;
          a.batch = batch_;
          a.slot_ids = slot_ids.data();
          a.x = in.vec.data();
          a.dt = in.head_a.data();
          a.B = in.key_a.data();
          a.C = in.key_b.data();
          a.A = A_.data();
          a.D = D_.data();
          a.dt_bias = dt_bias_.data();
          a.y = out_.data();
          a.fold_every = fold_every();
          REPLAYSSM_RETURN_IF_ERROR(mamba2_decode(*cache_, a));
          return Status::ok();
        },
        [&]() -> Status {
          GdnDecodeArgs a;
          a.batch = batch_;
          a.slot_ids = slot_ids.data();
          a.q = in.key_a.data();
          a.k = in.key_b.data();
          a.v = in.vec.data();
          a.g = in.head_a.data();
          a.beta = in.head_b.data();
          a.o = out_.data();
          a.fold_every = fold_every();
          REPLAYSSM_RETURN_IF_ERROR(gdn_decode(*cache_, a));
          return Status::ok();
        });
    REPLAYSSM_RETURN_IF_ERROR(decoded);
    CommitArgs commit;
    commit.batch = batch_;
    commit.slot_ids = slot_ids.data();
    commit.accepted = accepted_.data();
    return state_cache_commit(*cache_, commit);
  }

  // The decodes' fold cadence: the options' for replay caches (an eager cache takes 0 only).
  [[nodiscard]] int fold_every() const {
    return mode_ == DecodeMode::kReplay ? options_.fold_every : 0;
  }

  const BenchShape& shape_;
  int batch_;
  int groups_;
  const BenchOptions& options_;
  DecodeMode mode_ = DecodeMode::kEager;
  std::unique_ptr<StateCache> cache_;
  std::vector<std::vector<std::int32_t>> group_slots_;
  std::vector<std::int32_t> accepted_;
  std::vector<StepInputs> inputs_;
  std::vector<float> A_, D_, dt_bias_;
  std::vector<std::uint8_t> out_;
};

// Slot groups rotated so that one cycle touches at least min_state_bytes of state.
int slot_groups(const BenchShape& shape, int batch, const BenchOptions& options,
                std::int64_t min_state_bytes) {
  const std::int64_t group_bytes = shape.dims().state_elems() * batch *
                                   static_cast<std::int64_t>(dtype_size(options.eager_state_dtype));
  return static_cast<int>(
      std::max<std::int64_t>(1, (min_state_bytes + group_bytes - 1) / group_bytes));
}

// Bytes one slot takes in a cache of this case (state or checkpoint copies, ring, cursors),
// measured on a one-slot cache.
Status bytes_per_slot(const BenchShape& shape, const BenchOptions& options, DecodeMode mode,
                      CheckpointPrecision checkpoint, std::int64_t* bytes) {
  std::unique_ptr<StateCache> cache;
  REPLAYSSM_RETURN_IF_ERROR(
      state_cache_create(case_config(shape, options, mode, checkpoint, 1), &cache));
  *bytes = cache->bytes();
  return Status::ok();
}

// The slot groups of one shape and batch: enough to stream min_state_bytes, but no more than
// the memory budget lets all the cases (eager and each replay precision) hold at once.
Status slot_groups_within_budget(const BenchShape& shape, int batch, const BenchOptions& options,
                                 std::int64_t min_state_bytes, int* groups) {
  *groups = slot_groups(shape, batch, options, min_state_bytes);
  if (options.memory_budget_bytes <= 0) return Status::ok();
  std::int64_t per_slot = 0, bytes = 0;
  REPLAYSSM_RETURN_IF_ERROR(bytes_per_slot(shape, options, DecodeMode::kEager,
                                           CheckpointPrecision::kFp32, &per_slot));
  for (CheckpointPrecision c : options.checkpoints) {
    REPLAYSSM_RETURN_IF_ERROR(bytes_per_slot(shape, options, DecodeMode::kReplay, c, &bytes));
    per_slot += bytes;
  }
  const std::int64_t affordable = options.memory_budget_bytes / (per_slot * batch);
  *groups = static_cast<int>(std::clamp<std::int64_t>(affordable, 1, *groups));
  return Status::ok();
}

// Eager and every replay precision of one shape and batch. Their timed cycles are interleaved
// (eager, replay, eager, replay, ...) so that all of them see the same machine conditions,
// which matters on a machine shared with other work; each one's median is over its own cycles.
Status time_shape_batch(const BenchShape& shape, int batch, const BenchOptions& options,
                        std::int64_t min_state_bytes, std::vector<BenchResult>* results) {
  struct Case {
    DecodeMode mode = DecodeMode::kEager;
    CheckpointPrecision checkpoint = CheckpointPrecision::kFp32;
    std::unique_ptr<CaseRunner> runner;
    int input_set = 0;
    std::vector<double> us;
    std::vector<std::vector<double>> step_us;  // [step of the cycle][repetition]
  };
  std::vector<Case> cases(1 + options.checkpoints.size());
  cases[0].mode = DecodeMode::kEager;
  for (std::size_t i = 0; i < options.checkpoints.size(); ++i) {
    cases[i + 1].mode = DecodeMode::kReplay;
    cases[i + 1].checkpoint = options.checkpoints[i];
  }
  int groups = 1;
  REPLAYSSM_RETURN_IF_ERROR(
      slot_groups_within_budget(shape, batch, options, min_state_bytes, &groups));
  for (Case& c : cases) {
    c.runner = std::make_unique<CaseRunner>(shape, batch, groups, options);
    REPLAYSSM_RETURN_IF_ERROR(c.runner->init(c.mode, c.checkpoint));
    if (options.flush == FlushPattern::kStaggered && c.mode == DecodeMode::kReplay) {
      REPLAYSSM_RETURN_IF_ERROR(c.runner->stagger());
    }
    for (int w = 0; w < options.warmup_cycles; ++w) {
      REPLAYSSM_RETURN_IF_ERROR(c.runner->cycle(&c.input_set));
    }
  }
  const double steps_per_cycle = double(groups) * options.fold_period();
  std::vector<double> step_us;
  for (int rep = 0; rep < options.repetitions; ++rep) {
    for (Case& c : cases) {
      const auto start = Clock::now();
      REPLAYSSM_RETURN_IF_ERROR(c.runner->cycle(&c.input_set, &step_us));
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      c.us.push_back(seconds * 1e6 / steps_per_cycle);
      c.step_us.resize(step_us.size());
      for (std::size_t s = 0; s < step_us.size(); ++s) c.step_us[s].push_back(step_us[s]);
    }
  }
  for (const Case& c : cases) {
    BenchResult r;
    r.shape = shape.name;
    r.batch = batch;
    r.mode = c.mode;
    r.checkpoint = c.checkpoint;
    r.buffer_len = options.buffer_len;
    r.fold_every = c.mode == DecodeMode::kReplay ? options.fold_every : 0;
    r.flush = options.flush;
    r.slot_groups = groups;
    r.stream_bytes = double(groups) * batch * double(shape.dims().state_elems()) *
                     double(dtype_size(options.eager_state_dtype));
    r.us_per_step = median(c.us);
    r.us_min = *std::min_element(c.us.begin(), c.us.end());
    if (c.mode == DecodeMode::kReplay && options.flush == FlushPattern::kAligned &&
        c.step_us.size() > 1) {
      // With aligned flushes every row folds on the same step of the cycle: the slowest one.
      std::vector<double> medians;
      for (const std::vector<double>& s : c.step_us) medians.push_back(median(s));
      const auto fold = std::max_element(medians.begin(), medians.end());
      r.us_fold_step = *fold;
      medians.erase(fold);
      r.us_plain_step = median(medians);
    }
    results->push_back(r);
  }
  return Status::ok();
}

Status validate(const BenchOptions& o) {
  if (o.shapes.empty() || o.batches.empty()) return invalid_argument("no shapes or batches to run");
  for (const std::string& s : o.shapes) {
    if (bench_shape_find(s) == nullptr) {
      std::string names;
      for (const BenchShape& b : bench_shapes())
        names += std::string(names.empty() ? "" : ", ") + b.name;
      return invalid_argument("unknown shape '" + s + "'; shapes: " + names);
    }
  }
  for (int b : o.batches) {
    if (b < 1) return invalid_argument("batch sizes must be >= 1");
  }
  if (o.buffer_len < 1) return invalid_argument("buffer_len (L) must be >= 1");
  REPLAYSSM_RETURN_IF_ERROR(validate_fold_every(o));
  if (o.layers != 1) return invalid_argument("layers per step other than 1: the CUDA bench only");
  if (o.repetitions < 1 || o.warmup_cycles < 0) {
    return invalid_argument("repetitions must be >= 1 and warm-up cycles >= 0");
  }
  return Status::ok();
}

}  // namespace

std::int64_t last_level_cache_bytes() {
  // Each CPU lists its caches under sysfs; the highest level is the last one, and CPUs that
  // share an instance list the same shared_cpu_list, so each instance is counted once.
  int best_level = 0;
  std::map<std::string, std::int64_t> instances;  // shared_cpu_list -> bytes, at best_level
  const unsigned cpus = std::max(1u, std::thread::hardware_concurrency());
  for (unsigned cpu = 0; cpu < cpus; ++cpu) {
    for (int i = 0; i < 16; ++i) {
      const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) +
                              "/cache/index" + std::to_string(i) + "/";
      std::ifstream level_file(dir + "level"), size_file(dir + "size"),
          shared_file(dir + "shared_cpu_list");
      int level = 0;
      std::string size, shared;  // "32768K", "0-1"
      if (!(level_file >> level) || !(size_file >> size) || size.empty()) continue;
      if (!(shared_file >> shared)) shared = std::to_string(cpu);
      std::int64_t bytes = std::atoll(size.c_str());
      if (size.back() == 'K') bytes <<= 10;
      if (size.back() == 'M') bytes <<= 20;
      if (level < best_level) continue;
      if (level > best_level) instances.clear();
      best_level = level;
      instances[shared] = std::max(instances[shared], bytes);
    }
  }
  std::int64_t total = 0;
  for (const auto& [cpus_sharing, bytes] : instances) total += bytes;
  if (total > 0) return total;
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return l3 > 0 ? l3 : std::int64_t{32} << 20;
}

std::int64_t bench_quick_memory_budget() {
  const std::int64_t budget = std::int64_t{2} << 30;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return budget;
  return std::min(budget, std::int64_t{pages} * page / 4);
}

Status run_cpu_bench(const BenchOptions& options, BenchReport* report) {
  if (report == nullptr) return invalid_argument("run_cpu_bench: report is null");
  REPLAYSSM_RETURN_IF_ERROR(validate(options));
  BenchReport out;
  out.cache_bytes = last_level_cache_bytes();
  const std::int64_t min_state_bytes = options.min_state_bytes > 0
                                           ? options.min_state_bytes
                                           : kStreamCacheMultiple * out.cache_bytes;
  out.device = "cpu (" + std::to_string(omp_get_max_threads()) + " threads)";
  if (options.progress) options.progress(0.0, "memory bandwidth");
  measure_bandwidth(&out.copy_gbps, &out.update_gbps, &out.read_gbps);

  const std::size_t total = options.shapes.size() * options.batches.size();
  std::size_t done = 0;
  for (const std::string& name : options.shapes) {
    const BenchShape& shape = *bench_shape_find(name);
    for (int batch : options.batches) {
      if (options.progress) {
        options.progress(double(done) / double(total),
                         std::string(shape.name) + " batch " + std::to_string(batch));
      }
      REPLAYSSM_RETURN_IF_ERROR(
          time_shape_batch(shape, batch, options, min_state_bytes, &out.results));
      ++done;
    }
  }
  if (options.progress) options.progress(1.0, "done");
  bench_finish(&out, options);
  *report = std::move(out);
  return Status::ok();
}

}  // namespace replayssm
