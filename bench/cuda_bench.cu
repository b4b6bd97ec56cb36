// The CUDA benchmark (BENCHMARKS.md, protocol): eager against replay decode of one layer at the
// real shapes, each case timed as whole fold cycles of L steps captured in one CUDA graph and
// replayed after warm-up, CUDA events around each replay, the median of >= 7. The state is
// rotated over enough slot groups that one cycle touches at least 4x the L2 (so it streams
// from HBM), and the copy bandwidth the percentages refer to is a device-to-device cudaMemcpy
// measured in the same run.
//
// Also the speculative comparison: a replay verify of T tokens (+ commit of k) against an eager
// spec step of the library (an eager cache with max_spec_tokens = T: the window reads the state
// once and writes one state copy per window position, the scheme of vLLM's spec decode; the
// commit selects the accepted copy). k is fixed, or drawn per row and step (random acceptance,
// spec_acceptance.h), as the public kernels are timed.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench.h"
#include "bytes_model.h"
#include "cuda/common/check.cuh"
#include "cuda_bench.h"
#include "cuda_bench_util.cuh"
#include "cuda_bench_gdn.h"
#include "engine/activations.h"
#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "state_cache_layout.h"

namespace replayssm {

namespace {

using cuda::cuda_status;

constexpr int kInputSets = 4;  // distinct token inputs cycled through the steps
constexpr int kMinRepetitions = 7;

// ---- small RAII helpers ------------------------------------------------------------------

using bench_cuda::AcceptedCounts;
using bench_cuda::GraphExec;
using bench_cuda::OwnedStream;
using bench_cuda::time_graph;

// Copy bandwidth: (read + write) bytes per second of a 1 GiB device-to-device cudaMemcpy,
// best of 10 after 3 warm-up copies (the clocks ramp from idle), GB/s. Measured once per
// process: every case of a sweep is compared against the same figure.
Status measure_copy_gbps(double* gbps) {
  static double measured = 0.0;
  if (measured > 0.0) {
    *gbps = measured;
    return Status::ok();
  }
  constexpr std::size_t kBytes = std::size_t{1} << 30;
  DeviceBuffer src, dst;
  REPLAYSSM_RETURN_IF_ERROR(src.allocate(Device::kCuda, kBytes));
  REPLAYSSM_RETURN_IF_ERROR(dst.allocate(Device::kCuda, kBytes));
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaMemset(src.get(), 1, kBytes));
  cudaEvent_t start, stop;
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  double best = 0.0;
  for (int rep = 0; rep < 13; ++rep) {
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventRecord(start));
    REPLAYSSM_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst.get(), src.get(), kBytes, cudaMemcpyDeviceToDevice));
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop));
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
    float ms = 0.0f;
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
    if (rep >= 3) best = std::max(best, 2.0 * double(kBytes) / (ms * 1e-3) / 1e9);
  }
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  measured = best;
  *gbps = best;
  return Status::ok();
}

Status l2_bytes(std::int64_t* bytes) {
  int device = 0, l2 = 0;
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  *bytes = l2;
  return Status::ok();
}

Status device_name(std::string* name) {
  int device = 0;
  cudaDeviceProp prop{};
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  *name = prop.name;
  return Status::ok();
}

// ---- inputs ------------------------------------------------------------------------------

// kInputSets token inputs [batch, T, ...] for one Mamba-2 shape at realistic scales (the
// synthetic trace's statistics, ALGORITHM.md / BENCHMARKS.md): never zeros, A < 0, dt_bias ≈ −4.
// (GDN shapes have their own inputs and cases, in cuda_bench_gdn.cu.)
struct Inputs {
  std::vector<DeviceBuffer> x, B, C, dt;  // per set
  DeviceBuffer A, D, dt_bias, out;
};

Status make_inputs(const BenchShape& shape, int batch, int T, DType act, Inputs* in) {
  std::mt19937_64 rng(2024);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  const StateDims d = shape.dims();
  const std::size_t bt = std::size_t(batch) * T;
  const std::size_t vec = bt * d.heads * d.rows, key = bt * d.key_heads * d.cols,
                    head = bt * d.heads;
  auto normals = [&](std::size_t n, float sd) {
    std::vector<float> v(n);
    for (float& x : v) {
      x = sd * normal(rng);
      if (x == 0.0f) x = 1e-3f;
    }
    return v;
  };
  for (int s = 0; s < kInputSets; ++s) {
    DeviceBuffer x, B, C, dt;
    REPLAYSSM_RETURN_IF_ERROR(x.assign(Device::kCuda, activations_pack(act, normals(vec, 1.0f))));
    REPLAYSSM_RETURN_IF_ERROR(B.assign(Device::kCuda, activations_pack(act, normals(key, 1.0f))));
    REPLAYSSM_RETURN_IF_ERROR(C.assign(Device::kCuda, activations_pack(act, normals(key, 1.0f))));
    REPLAYSSM_RETURN_IF_ERROR(dt.assign(Device::kCuda, normals(head, 0.5f)));  // raw dt
    in->x.push_back(std::move(x));
    in->B.push_back(std::move(B));
    in->C.push_back(std::move(C));
    in->dt.push_back(std::move(dt));
  }
  std::vector<float> A(d.heads), D(d.heads), dt_bias(d.heads);
  for (int h = 0; h < d.heads; ++h) {
    A[h] = -(1.0f + 15.0f * uni(rng));
    D[h] = 0.5f + uni(rng);
    const float delta0 = std::exp(std::log(1e-3f) + uni(rng) * (std::log(0.1f) - std::log(1e-3f)));
    dt_bias[h] = std::log(std::expm1(delta0));
  }
  REPLAYSSM_RETURN_IF_ERROR(in->A.assign(Device::kCuda, A));
  REPLAYSSM_RETURN_IF_ERROR(in->D.assign(Device::kCuda, D));
  REPLAYSSM_RETURN_IF_ERROR(in->dt_bias.assign(Device::kCuda, dt_bias));
  return in->out.allocate(Device::kCuda, vec * dtype_size(act));
}

// ---- one timed case ----------------------------------------------------------------------

// A Mamba-2 cache of `groups` slot groups of `batch` rows, one decode (+ commit) call per group
// step.
class CaseRunner {
 public:
  // Everything the runner does is ordered on `stream`.
  CaseRunner(int batch, int groups, int layers, const Inputs& inputs, cudaStream_t stream)
      : batch_(batch), groups_(groups), layers_(layers), in_(inputs), stream_(stream) {}

  // `steps`: the steps of the cycle capture() will record (random acceptance draws that many).
  // `fold_every`: the replay decodes' fold cadence (ops.h; 0 = the cache's L).
  Status init(StateCacheConfig config, int window, int accepted, int steps, int fold_every) {
    window_ = window;
    fold_every_ = fold_every;
    config.num_layers = layers_;
    config.capacity = batch_ * groups_;
    config.device = Device::kCuda;
    REPLAYSSM_RETURN_IF_ERROR(state_cache_create(config, &cache_, stream_));
    for (int g = 0; g < groups_; ++g) {
      std::vector<std::int32_t> ids;
      for (int b = 0; b < batch_; ++b) {
        int slot = -1;
        REPLAYSSM_RETURN_IF_ERROR(state_cache_allocate_slot(*cache_, &slot, stream_));
        ids.push_back(slot);
      }
      host_ids_.push_back(ids);
      DeviceBuffer buf;
      REPLAYSSM_RETURN_IF_ERROR(buf.assign(Device::kCuda, ids));
      ids_.push_back(std::move(buf));
    }
    return accepted_.init(batch_, window, accepted, steps);
  }

  // Staggered flushes: row b is pre-advanced by b mod L tokens (padding the others), so that
  // afterwards 1/L of the rows fold on each step. Run eagerly, before capture.
  Status stagger(int buffer_len) {
    for (int j = 0; j + 1 < buffer_len; ++j) {
      for (const auto& group : host_ids_) {
        std::vector<std::int32_t> ids = group;
        for (int b = 0; b < batch_; ++b) {
          if (b % buffer_len <= j) ids[std::size_t(b)] = -1;
        }
        DeviceBuffer buf;
        REPLAYSSM_RETURN_IF_ERROR(buf.assign(Device::kCuda, ids));
        REPLAYSSM_RETURN_IF_ERROR(step(buf.get<const std::int32_t>(), j));
      }
      REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    }
    return Status::ok();
  }

  // Captures `steps` steps of every group (groups interleaved step by step) into a graph.
  Status capture(int steps, GraphExec* exec) {
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    cudaGraph_t graph = nullptr;
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    const Status st = [&]() -> Status {
      for (int s = 0; s < steps; ++s) {
        for (int g = 0; g < groups_; ++g) {
          REPLAYSSM_RETURN_IF_ERROR(step(ids_[std::size_t(g)].get<const std::int32_t>(), s));
        }
      }
      return Status::ok();
    }();
    const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
    REPLAYSSM_RETURN_IF_ERROR(st);
    REPLAYSSM_CUDA_RETURN_IF_ERROR(end);
    const cudaError_t inst = cudaGraphInstantiate(&exec->exec, graph, 0);
    (void)cudaGraphDestroy(graph);
    return cuda_status(inst, "cudaGraphInstantiate");
  }

 private:
  // Step `index` of a cycle for one slot group: every layer's decode, then the commit of that
  // step's accepted counts.
  Status step(const std::int32_t* ids, int index) {
    const std::size_t s = std::size_t(index % kInputSets);
    Mamba2DecodeArgs a;
    a.batch = batch_;
    a.num_tokens = window_;
    a.slot_ids = ids;
    a.x = in_.x[s].get();
    a.dt = in_.dt[s].get<const float>();
    a.B = in_.B[s].get();
    a.C = in_.C[s].get();
    a.A = in_.A.get<const float>();
    a.D = in_.D.get<const float>();
    a.dt_bias = in_.dt_bias.get<const float>();
    a.y = in_.out.get();
    a.fold_every = fold_every_;
    for (a.layer = 0; a.layer < layers_; ++a.layer) {
      REPLAYSSM_RETURN_IF_ERROR(mamba2_decode(*cache_, a, stream_));
    }
    CommitArgs c;
    c.batch = batch_;
    c.slot_ids = ids;
    c.accepted = accepted_.at(index);
    return state_cache_commit(*cache_, c, stream_);
  }

  int batch_, groups_, layers_;
  int window_ = 1;
  int fold_every_ = 0;
  const Inputs& in_;
  cudaStream_t stream_;
  std::unique_ptr<StateCache> cache_;
  std::vector<std::vector<std::int32_t>> host_ids_;
  std::vector<DeviceBuffer> ids_;
  AcceptedCounts accepted_;  // read by the captured graph: lives as long as the runner
};

// Bytes of the copy a step streams per row, to size the slot rotation.
double read_bytes_per_row(const BenchShape& shape, DecodeMode mode, CheckpointPrecision p,
                          DType eager_state) {
  const double E = double(shape.dims().state_elems());
  return E * bytes_model_read_copy_elem(mode, eager_state, p);
}

int slot_groups(double bytes_per_row, int batch, std::int64_t min_state_bytes) {
  const double group = bytes_per_row * batch;
  return std::max(1, int(std::ceil(double(min_state_bytes) / group)));
}

struct CaseSpec {
  DecodeMode mode = DecodeMode::kEager;
  CheckpointPrecision checkpoint = CheckpointPrecision::kFp32;
  int window = 1;
  int accepted = 1;  // k, or kRandomAcceptance
};

// Times one case: µs per step (one decode + commit of the batch), median and min.
Status time_case(const BenchShape& shape, int batch, const CaseSpec& cs,
                 const BenchOptions& o, std::int64_t min_state_bytes, const Inputs& inputs,
                 BenchResult* r) {
  // An eager window's step touches every state copy of its rows (one read, T writes).
  const int copies = cs.mode == DecodeMode::kEager ? eager_state_copies(cs.window) : 1;
  const int groups = slot_groups(
      copies * o.layers * read_bytes_per_row(shape, cs.mode, cs.checkpoint, o.eager_state_dtype),
      batch, min_state_bytes);
  StateCacheConfig config;
  config.kind = shape.kind;
  config.mamba2 = shape.mamba2;
  config.gdn = shape.gdn;
  config.mode = cs.mode;
  config.input_dtype = o.input_dtype;
  config.state_dtype = o.eager_state_dtype;
  config.buffer_len = o.buffer_len;
  config.max_spec_tokens = cs.window;
  config.checkpoint = cs.checkpoint;
  config.share_forked_checkpoints = o.share_forked_checkpoints && cs.mode == DecodeMode::kReplay;
  OwnedStream stream;
  REPLAYSSM_RETURN_IF_ERROR(stream.create());
  // One graph = one fold cycle: ceil(L / k) steps (L for plain decoding). Random acceptance:
  // random_acceptance_steps distinct draws, eager and replay alike (the same pattern), over
  // which every row folds several times on its own cadence; the warm-up launch spreads the
  // rows' fold phases from the aligned start.
  // Replay cases fold every o.fold_period() tokens (o.fold_every; the spec comparison's
  // options keep 0).
  const bool random = cs.accepted == kRandomAcceptance;
  const bool replay = cs.mode == DecodeMode::kReplay;
  const int period = replay ? o.fold_period() : o.buffer_len;
  const int steps = random ? random_acceptance_steps(cs.window, o.buffer_len)
                    : replay ? (period + cs.accepted - 1) / cs.accepted
                             : o.buffer_len;
  CaseRunner runner(batch, groups, o.layers, inputs, stream.s);
  REPLAYSSM_RETURN_IF_ERROR(
      runner.init(config, cs.window, cs.accepted, steps, replay ? o.fold_every : 0));
  if (o.flush == FlushPattern::kStaggered && replay) {
    REPLAYSSM_RETURN_IF_ERROR(runner.stagger(period));
  }
  GraphExec exec;  // after the runner: destroyed first, while the buffers it reads still live
  REPLAYSSM_RETURN_IF_ERROR(runner.capture(steps, &exec));
  std::vector<double> us;
  REPLAYSSM_RETURN_IF_ERROR(time_graph(exec, stream.s, std::max(o.warmup_cycles, 1),
                                       std::max(o.repetitions, kMinRepetitions), &us));
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  for (double& u : us) u /= double(steps) * groups * o.layers;
  r->shape = shape.name;
  r->batch = batch;
  r->mode = cs.mode;
  r->checkpoint = cs.checkpoint;
  r->buffer_len = o.buffer_len;
  r->fold_every = replay ? o.fold_every : 0;
  r->flush = o.flush;
  r->slot_groups = groups;
  r->layers = o.layers;
  r->us_per_step = median(us);
  r->us_min = *std::min_element(us.begin(), us.end());
  return Status::ok();
}

Status validate(const BenchOptions& o) {
  if (o.shapes.empty() || o.batches.empty()) return invalid_argument("no shapes or batches to run");
  for (const std::string& s : o.shapes) {
    if (bench_shape_find(s) == nullptr) return invalid_argument("unknown shape '" + s + "'");
  }
  for (int b : o.batches) {
    if (b < 1) return invalid_argument("batch sizes must be >= 1");
  }
  if (o.buffer_len < 1) return invalid_argument("buffer_len (L) must be >= 1");
  REPLAYSSM_RETURN_IF_ERROR(validate_fold_every(o));
  if (o.layers < 1) return invalid_argument("layers must be >= 1");
  if (!cuda_available()) return unsupported("bench --device cuda: no CUDA GPU present");
  return Status::ok();
}

Status min_state(const BenchOptions& o, std::int64_t* bytes) {
  if (o.min_state_bytes > 0) {
    *bytes = o.min_state_bytes;
    return Status::ok();
  }
  std::int64_t l2 = 0;
  REPLAYSSM_RETURN_IF_ERROR(l2_bytes(&l2));
  *bytes = 4 * l2;
  return Status::ok();
}

// What every run starts with: the options checked, the state each case must stream, and the
// report's device and the copy bandwidth its percentages refer to.
Status start_run(const BenchOptions& options, std::int64_t* min_state_bytes, BenchReport* out) {
  REPLAYSSM_RETURN_IF_ERROR(validate(options));
  REPLAYSSM_RETURN_IF_ERROR(min_state(options, min_state_bytes));
  REPLAYSSM_RETURN_IF_ERROR(device_name(&out->device));
  if (options.progress) options.progress(0.0, "copy bandwidth");
  return measure_copy_gbps(&out->copy_gbps);
}

}  // namespace

Status run_cuda_bench(const BenchOptions& options, BenchReport* report) {
  if (report == nullptr) return invalid_argument("run_cuda_bench: report is null");
  std::int64_t min_state_bytes = 0;
  BenchReport out;
  REPLAYSSM_RETURN_IF_ERROR(start_run(options, &min_state_bytes, &out));

  const std::size_t total =
      options.shapes.size() * options.batches.size() * (1 + options.checkpoints.size());
  std::size_t done = 0;
  for (const std::string& name : options.shapes) {
    const BenchShape& shape = *bench_shape_find(name);
    if (shape.kind == LayerKind::kGdn) {  // the GDN side's cases (bench/cuda_bench_gdn.cu)
      const std::size_t cases = options.batches.size() * (1 + options.checkpoints.size());
      BenchOptions gdn = options;
      if (options.progress) {  // its fraction of its own cases, mapped onto the whole run
        gdn.progress = [&](double f, const std::string& what) {
          options.progress((double(done) + f * double(cases)) / double(total), what);
        };
      }
      REPLAYSSM_RETURN_IF_ERROR(run_cuda_bench_gdn(shape, gdn, &out));
      done += cases;
      continue;
    }
    for (int batch : options.batches) {
      Inputs inputs;
      REPLAYSSM_RETURN_IF_ERROR(make_inputs(shape, batch, 1, options.input_dtype, &inputs));
      auto run = [&](const CaseSpec& cs) -> Status {
        if (options.progress) {
          options.progress(double(done) / double(total),
                           std::string(shape.name) + " batch " + std::to_string(batch));
        }
        BenchResult r;
        REPLAYSSM_RETURN_IF_ERROR(
            time_case(shape, batch, cs, options, min_state_bytes, inputs, &r));
        out.results.push_back(r);
        ++done;
        return Status::ok();
      };
      REPLAYSSM_RETURN_IF_ERROR(run(CaseSpec{DecodeMode::kEager}));
      for (CheckpointPrecision c : options.checkpoints) {
        REPLAYSSM_RETURN_IF_ERROR(run(CaseSpec{DecodeMode::kReplay, c}));
      }
    }
  }
  if (options.progress) options.progress(1.0, "done");
  bench_finish(&out, options);
  *report = std::move(out);
  return Status::ok();
}

Status run_cuda_spec_bench(const BenchOptions& options, int window, int accepted,
                           BenchReport* report) {
  if (report == nullptr) return invalid_argument("run_cuda_spec_bench: report is null");
  if (window < 2) return invalid_argument("spec bench: the window (spec tokens) must be >= 2");
  const bool random = accepted == kRandomAcceptance;
  if (!random && (accepted < 0 || accepted > window)) {
    return invalid_argument(
        "spec bench: accepted tokens must be in [0, window] (0: all) or kRandomAcceptance");
  }
  const int k = accepted == 0 ? window : accepted;  // kRandomAcceptance stays as it is
  std::int64_t min_state_bytes = 0;
  BenchReport out;
  REPLAYSSM_RETURN_IF_ERROR(start_run(options, &min_state_bytes, &out));
  const std::size_t total = options.shapes.size() * options.batches.size();
  std::size_t done = 0;
  BenchOptions o = options;
  o.flush = FlushPattern::kAligned;
  o.layers = 1;  // a window of one layer, as the spec tables report it
  for (const std::string& name : options.shapes) {
    const BenchShape& shape = *bench_shape_find(name);
    for (int batch : options.batches) {
      if (options.progress) {
        options.progress(double(done++) / double(total),
                         std::string(shape.name) + " batch " + std::to_string(batch) +
                             " spec T=" + std::to_string(window) +
                             (random ? " k random" : " k=" + std::to_string(k)));
      }
      // What the cases commit per row and step on average: the draws are those the cases make
      // (the same window, batch and steps give the same pattern).
      const double k_mean =
          random ? random_acceptance_draws_mean(random_acceptance_draws(
                       window, batch, random_acceptance_steps(window, options.buffer_len)))
                 : double(k);
      BytesModelCase bm;
      bm.dims = shape.dims();
      bm.batch = batch;
      bm.state_dtype = options.eager_state_dtype;
      bm.buffer_len = options.buffer_len;
      bm.input_dtype = options.input_dtype;
      // The bytes model takes a whole k (its fold cycle is ceil(L / k) steps); random
      // acceptance is modelled at the draws' mean rounded, within [1, T]: an estimate, as rows
      // of random k fold every L / mean steps or so on average, not on a fixed cycle.
      bm.accepted = random ? std::clamp(int(std::lround(k_mean)), 1, window) : k;
      auto add = [&](CheckpointPrecision c, double eager_us, double replay_us) {
        SpecBenchResult s;
        s.shape = shape.name;
        s.batch = batch;
        s.window = window;
        s.accepted = k;
        s.accepted_mean = k_mean;
        s.buffer_len = options.buffer_len;
        s.checkpoint = c;
        s.eager_fused = true;  // the library's eager window: T + 1 state transfers
        s.eager_us = eager_us;
        s.eager_fused_us = eager_us;
        BytesModelCase e = bm;
        e.mode = DecodeMode::kEager;
        e.spec_tokens = window;
        s.eager_bytes = bytes_model_step(e).total();
        BytesModelCase r = bm;
        r.mode = DecodeMode::kReplay;
        r.checkpoint = c;
        r.spec_tokens = window;
        s.replay_us = replay_us;
        s.replay_bytes = bytes_model_step(r).total();
        s.speedup = eager_us / replay_us;
        s.speedup_fused = s.eager_fused_us / replay_us;
        out.spec.push_back(s);
      };
      if (shape.kind == LayerKind::kGdn) {
        // The GDN side's spec bench (cuda_bench_gdn.cu), on the same library path: an eager
        // cache with max_spec_tokens = T.
        std::vector<GdnSpecResult> gdn;
        REPLAYSSM_RETURN_IF_ERROR(run_cuda_bench_gdn_spec(shape, batch, window, k, o, &gdn));
        for (const GdnSpecResult& g : gdn) add(g.checkpoint, g.eager_us, g.replay_us);
        continue;
      }
      Inputs inputs;
      REPLAYSSM_RETURN_IF_ERROR(make_inputs(shape, batch, window, options.input_dtype, &inputs));
      BenchResult eager;
      REPLAYSSM_RETURN_IF_ERROR(time_case(
          shape, batch, CaseSpec{DecodeMode::kEager, CheckpointPrecision::kFp32, window, k}, o,
          min_state_bytes, inputs, &eager));
      const double eager_us = eager.us_per_step;
      for (CheckpointPrecision c : options.checkpoints) {
        BenchResult r;
        REPLAYSSM_RETURN_IF_ERROR(time_case(shape, batch,
                                            CaseSpec{DecodeMode::kReplay, c, window, k}, o,
                                            min_state_bytes, inputs, &r));
        add(c, eager_us, r.us_per_step);
      }
    }
  }
  if (options.progress) options.progress(1.0, "done");
  *report = std::move(out);
  return Status::ok();
}

}  // namespace replayssm
