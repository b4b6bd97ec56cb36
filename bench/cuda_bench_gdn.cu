// The Gated DeltaNet part of the CUDA benchmark (cuda_bench_gdn.h): eager against replay decode
// of one layer at the real shapes, and speculative verify against eager spec, on the GPU.
//
// The sweeps over batch, L and flush patterns run through bench/cuda_bench_main.cpp
// (replayssm_cuda_bench --shapes qwen35-4b,qwen35-122b).

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bytes_model.h"
#include "cuda_bench_gdn.h"
#include "cuda_bench_util.cuh"
#include "cuda/common/check.cuh"
#include "engine/activations.h"
#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "state_cache_layout.h"

namespace replayssm {

namespace {

using bench_cuda::AcceptedCounts;
using bench_cuda::GraphExec;
using bench_cuda::OwnedStream;
using bench_cuda::time_graph;

/// splitmix64 with Box–Muller: fast enough for the hundreds of MB of inputs a batch of 1024
/// needs, and seeded.
class FastRng {
 public:
  explicit FastRng(std::uint64_t seed) : s_(seed) {}
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }
  double normal() {
    const double u = std::max(uniform(), 1e-300), v = uniform();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
  }

 private:
  std::uint64_t next() {
    std::uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  std::uint64_t s_;
};

// Input sets cycled through the steps of a cycle (not one repeated token).
constexpr int kInputSets = 4;
// BENCHMARKS.md: the median of >= 7 repetitions (as cuda_bench.cu's Mamba-2 cases).
constexpr int kMinRepetitions = 7;

struct DeviceInputs {
  DeviceBuffer q, k, v, g, beta;
};

/// The realistic GDN statistics of engine/synthetic_trace.h: q, k, v ~ N(0, 1);
/// g = −a·softplus(u + dt_bias), a ~ U[1, 16] per head, u ~ N(0, 1), dt_bias = log(e^Δ0 − 1)
/// with Δ0 log-uniform in [1e-3, 0.1]; β = sigmoid(N(0, 1)).
Status make_inputs(const GdnShape& s, int batch, int T, DType act, std::uint64_t seed,
                   DeviceInputs* out) {
  FastRng rng(seed);
  const std::size_t qk = std::size_t(batch) * T * s.num_k_heads * s.head_k_dim;
  const std::size_t vv = std::size_t(batch) * T * s.num_v_heads * s.head_v_dim;
  const std::size_t hh = std::size_t(batch) * T * s.num_v_heads;
  std::vector<float> q(qk), k(qk), v(vv), g(hh), beta(hh), a(s.num_v_heads), bias(s.num_v_heads);
  for (float& x : q) x = float(rng.normal());
  for (float& x : k) x = float(rng.normal());
  for (float& x : v) x = float(rng.normal());
  for (int h = 0; h < s.num_v_heads; ++h) {
    a[h] = float(1.0 + 15.0 * rng.uniform());
    const double d0 = std::exp(std::log(1e-3) + (std::log(0.1) - std::log(1e-3)) * rng.uniform());
    bias[h] = float(std::log(std::expm1(d0)));
  }
  for (std::size_t i = 0; i < hh; ++i) {
    const int h = int(i % std::size_t(s.num_v_heads));
    const double u = rng.normal() + bias[h];
    const double sp = u > 20.0 ? u : std::log1p(std::exp(u));
    g[i] = float(-a[h] * sp);
    beta[i] = float(1.0 / (1.0 + std::exp(-rng.normal())));
  }
  REPLAYSSM_RETURN_IF_ERROR(out->q.assign(Device::kCuda, activations_pack(act, q)));
  REPLAYSSM_RETURN_IF_ERROR(out->k.assign(Device::kCuda, activations_pack(act, k)));
  REPLAYSSM_RETURN_IF_ERROR(out->v.assign(Device::kCuda, activations_pack(act, v)));
  REPLAYSSM_RETURN_IF_ERROR(out->g.assign(Device::kCuda, g));
  REPLAYSSM_RETURN_IF_ERROR(out->beta.assign(Device::kCuda, beta));
  return Status::ok();
}

struct CaseConfig {
  GdnShape shape;
  int batch = 1;
  int groups = 1;     ///< slot groups rotated step by step
  int layers = 1;
  int window = 1;     ///< T: the tokens each decode verifies (eager: a state copy per token)
  int accepted = 1;   ///< tokens committed per step (k), or kRandomAcceptance
  int buffer_len = 16;
  int fold_every = 0;  ///< replay decodes' fold cadence (0 = buffer_len)
  int cycle_steps = 16;
  DecodeMode mode = DecodeMode::kReplay;
  CheckpointPrecision checkpoint = CheckpointPrecision::kFp32;
  DType state_dtype = DType::kF32;
  DType input_dtype = DType::kBF16;
  bool stagger = false;
};

/// One case: a cache, its slot groups, inputs, and the cycle of steps the graph replays.
class CaseRunner {
 public:
  // Everything the runner does is ordered on `stream`.
  CaseRunner(const CaseConfig& c, cudaStream_t stream) : c_(c), stream_(stream) {}

  Status init() {
    StateCacheConfig config;
    config.kind = LayerKind::kGdn;
    config.gdn = c_.shape;
    config.num_layers = c_.layers;
    config.capacity = c_.batch * c_.groups;
    config.device = Device::kCuda;
    config.mode = c_.mode;
    config.input_dtype = c_.input_dtype;
    config.state_dtype = c_.state_dtype;
    config.buffer_len = c_.buffer_len;
    config.max_spec_tokens = c_.window;
    config.checkpoint = c_.checkpoint;
    REPLAYSSM_RETURN_IF_ERROR(state_cache_create(config, &cache_, stream_));
    for (int g = 0; g < c_.groups; ++g) {
      std::vector<std::int32_t> ids;
      for (int b = 0; b < c_.batch; ++b) {
        int slot = -1;
        REPLAYSSM_RETURN_IF_ERROR(state_cache_allocate_slot(*cache_, &slot, stream_));
        ids.push_back(slot);
      }
      host_groups_.push_back(ids);
      groups_.emplace_back();
      REPLAYSSM_RETURN_IF_ERROR(groups_.back().assign(Device::kCuda, ids));
    }
    REPLAYSSM_RETURN_IF_ERROR(accepted_.init(c_.batch, c_.window, c_.accepted, c_.cycle_steps));
    const int T = decode_tokens();
    for (int i = 0; i < kInputSets; ++i) {
      inputs_.emplace_back();
      REPLAYSSM_RETURN_IF_ERROR(
          make_inputs(c_.shape, c_.batch, T, c_.input_dtype, 4242 + i, &inputs_.back()));
    }
    const std::size_t out_bytes = std::size_t(c_.batch) * T * c_.shape.num_v_heads *
                                  c_.shape.head_v_dim * dtype_size(c_.input_dtype);
    return out_.allocate(Device::kCuda, out_bytes);
  }

  /// Staggered flushes: row b is pre-advanced by b mod L tokens (the others padded), so that
  /// afterwards 1/L of the rows fold on each step (L: the fold cadence).
  Status stagger() {
    const int L = fold_period(c_.fold_every, c_.buffer_len);
    for (int j = 0; j + 1 < L; ++j) {
      for (const auto& ids : host_groups_) {
        std::vector<std::int32_t> masked = ids;
        for (int b = 0; b < c_.batch; ++b) {
          if (b % L <= j) masked[std::size_t(b)] = -1;
        }
        DeviceBuffer d;
        REPLAYSSM_RETURN_IF_ERROR(d.assign(Device::kCuda, masked));
        REPLAYSSM_RETURN_IF_ERROR(step(d.get<std::int32_t>(), j));
        REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      }
    }
    return Status::ok();
  }

  /// One cycle: cycle_steps steps of every slot group, groups interleaved step by step.
  Status cycle() {
    for (int s = 0; s < c_.cycle_steps; ++s) {
      for (const DeviceBuffer& ids : groups_) {
        REPLAYSSM_RETURN_IF_ERROR(step(ids.get<std::int32_t>(), s));
      }
    }
    return Status::ok();
  }

  /// Layer steps per cycle (the unit of the reported time).
  [[nodiscard]] double layer_steps() const {
    return double(c_.cycle_steps) * c_.groups * c_.layers;
  }

 private:
  [[nodiscard]] int decode_tokens() const { return c_.window; }

  // Step `index` of a cycle for one slot group: every layer's decode, then the commit of that
  // step's accepted counts, in every mode, as a model steps (replay: the cursors; eager spec:
  // the accepted state copy; eager plain decoding: the committed count), and as the Mamba-2
  // side of the bench times it.
  Status step(const std::int32_t* ids, int index) {
    const DeviceInputs& in = inputs_[std::size_t(index % kInputSets)];
    for (int layer = 0; layer < c_.layers; ++layer) {
      GdnDecodeArgs a;
      a.layer = layer;
      a.batch = c_.batch;
      a.num_tokens = decode_tokens();
      a.slot_ids = ids;
      a.q = in.q.get();
      a.k = in.k.get();
      a.v = in.v.get();
      a.g = in.g.get<float>();
      a.beta = in.beta.get<float>();
      a.o = out_.get();
      a.fold_every = c_.fold_every;
      REPLAYSSM_RETURN_IF_ERROR(gdn_decode(*cache_, a, stream_));
    }
    CommitArgs commit;
    commit.batch = c_.batch;
    commit.slot_ids = ids;
    commit.accepted = accepted_.at(index);
    return state_cache_commit(*cache_, commit, stream_);
  }

  CaseConfig c_;
  cudaStream_t stream_;
  std::unique_ptr<StateCache> cache_;
  std::vector<std::vector<std::int32_t>> host_groups_;
  std::vector<DeviceBuffer> groups_;
  AcceptedCounts accepted_;  // read by the captured graph: lives as long as the runner
  DeviceBuffer out_;
  std::vector<DeviceInputs> inputs_;
};

/// Runs a case: warm-up cycles on the stream, then one cycle captured into a graph and replayed
/// `repetitions` times between events. Fills µs per layer step (median, min).
Status time_case(const CaseConfig& c, const BenchOptions& options, double* us_median,
                 double* us_min) {
  OwnedStream owned;
  REPLAYSSM_RETURN_IF_ERROR(owned.create());
  const cudaStream_t stream = owned.s;

  CaseRunner runner(c, stream);
  REPLAYSSM_RETURN_IF_ERROR(runner.init());
  if (c.stagger) REPLAYSSM_RETURN_IF_ERROR(runner.stagger());
  for (int w = 0; w < std::max(1, options.warmup_cycles); ++w) {
    REPLAYSSM_RETURN_IF_ERROR(runner.cycle());
  }
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));

  cudaGraph_t graph = nullptr;
  GraphExec exec;
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status captured = runner.cycle();
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(stream, &graph));
  REPLAYSSM_RETURN_IF_ERROR(captured);
  const cudaError_t instantiated = cudaGraphInstantiate(&exec.exec, graph, 0);
  (void)cudaGraphDestroy(graph);
  REPLAYSSM_CUDA_RETURN_IF_ERROR(instantiated);

  std::vector<double> us;  // one warm launch, then the timed ones
  REPLAYSSM_RETURN_IF_ERROR(
      time_graph(exec, stream, 1, std::max(kMinRepetitions, options.repetitions), &us));
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  for (double& u : us) u /= runner.layer_steps();
  *us_median = median(us);
  *us_min = *std::min_element(us.begin(), us.end());
  return Status::ok();
}

/// Slot groups so that one cycle step streams at least min_state_bytes of state (4 × L2 by
/// default): the checkpoint must come from HBM, not from the cache.
int slot_groups(const GdnShape& s, int batch, std::size_t bytes_per_elem,
                const BenchOptions& options) {
  std::int64_t min_bytes = options.min_state_bytes;
  if (min_bytes <= 0) {
    int device = 0, l2 = 0;
    (void)cudaGetDevice(&device);
    (void)cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
    min_bytes = 4 * std::int64_t(l2 > 0 ? l2 : 50 << 20);
  }
  const std::int64_t group = state_dims(s).state_elems() * batch * options.layers *
                            static_cast<std::int64_t>(bytes_per_elem);
  return int(std::max<std::int64_t>(1, (min_bytes + group - 1) / group));
}


}  // namespace

Status run_cuda_bench_gdn(const BenchShape& shape, const BenchOptions& options,
                          BenchReport* report) {
  if (shape.kind != LayerKind::kGdn) return invalid_argument("run_cuda_bench_gdn: not a GDN shape");
  const double cases = double(options.batches.size() * (1 + options.checkpoints.size()));
  int done = 0;
  for (int batch : options.batches) {
    const auto run = [&](DecodeMode mode, CheckpointPrecision p) -> Status {
      CaseConfig c;
      c.shape = shape.gdn;
      c.batch = batch;
      c.layers = options.layers;
      c.buffer_len = options.buffer_len;
      const bool replay = mode == DecodeMode::kReplay;
      c.fold_every = replay ? options.fold_every : 0;
      c.cycle_steps = replay ? options.fold_period() : options.buffer_len;
      c.mode = mode;
      c.checkpoint = p;
      c.state_dtype = options.eager_state_dtype;
      c.input_dtype = options.input_dtype;
      c.stagger = mode == DecodeMode::kReplay && options.flush == FlushPattern::kStaggered;
      c.groups = slot_groups(shape.gdn, batch, bytes_model_read_copy_elem(mode, c.state_dtype, p), options);
      if (options.progress) {
        const std::string what = mode == DecodeMode::kEager
                                     ? std::string("eager")
                                     : std::string("replay ") + checkpoint_precision_name(p);
        options.progress(double(done++) / cases,
                         std::string(shape.name) + " batch " + std::to_string(batch) + " " + what);
      }
      BenchResult r;
      REPLAYSSM_RETURN_IF_ERROR(time_case(c, options, &r.us_per_step, &r.us_min));
      r.shape = shape.name;
      r.batch = batch;
      r.mode = mode;
      r.checkpoint = p;
      r.buffer_len = options.buffer_len;
      r.fold_every = c.fold_every;
      r.flush = options.flush;
      r.slot_groups = c.groups;
      r.layers = c.layers;
      report->results.push_back(r);
      return Status::ok();
    };
    REPLAYSSM_RETURN_IF_ERROR(run(DecodeMode::kEager, CheckpointPrecision::kFp32));
    for (CheckpointPrecision p : options.checkpoints) {
      REPLAYSSM_RETURN_IF_ERROR(run(DecodeMode::kReplay, p));
    }
  }
  return Status::ok();
}

Status run_cuda_bench_gdn_spec(const BenchShape& shape, int batch, int window, int accepted,
                               const BenchOptions& options, std::vector<GdnSpecResult>* out) {
  if (shape.kind != LayerKind::kGdn) {
    return invalid_argument("run_cuda_bench_gdn_spec: not a GDN shape");
  }
  // Random acceptance: eager and replay step through the same random_acceptance_steps draws,
  // over which every replay row folds several times on its own cadence.
  const bool random = accepted == kRandomAcceptance;
  const int random_steps = random ? random_acceptance_steps(window, options.buffer_len) : 0;
  CaseConfig eager;
  eager.shape = shape.gdn;
  eager.batch = batch;
  eager.window = window;
  eager.accepted = accepted;  // the commit selects the accepted copy (no state moves)
  eager.buffer_len = options.buffer_len;
  eager.cycle_steps = random ? random_steps : options.buffer_len;
  eager.mode = DecodeMode::kEager;
  eager.state_dtype = options.eager_state_dtype;
  eager.input_dtype = options.input_dtype;
  // The step touches every state copy of its rows (one read, T writes).
  eager.groups = slot_groups(shape.gdn, batch,
                             eager_state_copies(window) * dtype_size(eager.state_dtype), options);
  double eager_us = 0.0, eager_min = 0.0;
  REPLAYSSM_RETURN_IF_ERROR(time_case(eager, options, &eager_us, &eager_min));
  for (CheckpointPrecision p : options.checkpoints) {
    CaseConfig c = eager;
    c.mode = DecodeMode::kReplay;
    c.checkpoint = p;
    // Whole fold cycles: with k tokens committed per step a fold falls due every ceil(L/k)
    // steps; three of them.
    c.cycle_steps = random ? random_steps
                           : 3 * ((options.buffer_len + accepted - 1) / std::max(1, accepted));
    c.groups = slot_groups(shape.gdn, batch, bytes_model_read_copy_elem(c.mode, c.state_dtype, p), options);
    GdnSpecResult r;
    double us_min = 0.0;
    REPLAYSSM_RETURN_IF_ERROR(time_case(c, options, &r.replay_us, &us_min));
    r.shape = shape.name;
    r.batch = batch;
    r.window = window;
    r.accepted = accepted;
    r.buffer_len = options.buffer_len;
    r.checkpoint = p;
    r.eager_us = eager_us;
    r.eager_fused_us = eager_us;  // the library's eager window is the fused scheme
    r.speedup = eager_us / r.replay_us;
    r.speedup_fused = r.eager_fused_us / r.replay_us;
    out->push_back(r);
  }
  return Status::ok();
}

}  // namespace replayssm
