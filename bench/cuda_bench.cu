// The CUDA benchmark (BENCHMARKS.md, protocol): eager against replay decode of one layer at the
// real shapes, each case timed as whole fold cycles of L steps captured in one CUDA graph and
// replayed after warm-up, CUDA events around each replay, the median of >= 7. The state is
// rotated over enough slot groups that one cycle touches at least 4x the L2 (so it streams
// from HBM), and the copy bandwidth the percentages refer to is a device-to-device cudaMemcpy
// measured in the same run.
//
// Also the speculative comparison: a replay verify of T tokens (+ commit of k) against an eager
// spec step that reads the state once and writes one state per window position (the scheme of
// vLLM's spec decode), the latter a bench-only kernel built from the library's tile shape.

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
#include "common/numeric.h"
#include "cuda/common/check.cuh"
#include "cuda/common/dispatch.cuh"
#include "cuda/common/vec.cuh"
#include "cuda/mamba2/mamba2_params.cuh"
#include "cuda_bench.h"
#include "cuda_bench_util.cuh"
#include "cuda_bench_gdn.h"
#include "engine/activations.h"
#include "replayssm/ops.h"
#include "replayssm/state_cache.h"

namespace replayssm {

namespace {

using cuda::cuda_status;

constexpr int kInputSets = 4;  // distinct token inputs cycled through the steps
constexpr int kMinRepetitions = 7;

// ---- small RAII helpers ------------------------------------------------------------------

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
  CaseRunner(int batch, int groups, const Inputs& inputs, cudaStream_t stream)
      : batch_(batch), groups_(groups), in_(inputs), stream_(stream) {}

  Status init(StateCacheConfig config, int window, int accepted) {
    window_ = window;
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
    return accepted_.assign(Device::kCuda,
                            std::vector<std::int32_t>(std::size_t(batch_), accepted));
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
        REPLAYSSM_RETURN_IF_ERROR(step(buf.get<const std::int32_t>(), j % kInputSets));
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
          REPLAYSSM_RETURN_IF_ERROR(step(ids_[std::size_t(g)].get<const std::int32_t>(), s % kInputSets));
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
  Status step(const std::int32_t* ids, int set) {
    const std::size_t s = std::size_t(set);
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
    REPLAYSSM_RETURN_IF_ERROR(mamba2_decode(*cache_, a, stream_));
    CommitArgs c;
    c.batch = batch_;
    c.slot_ids = ids;
    c.accepted = accepted_.get<const std::int32_t>();
    return state_cache_commit(*cache_, c, stream_);
  }

  int batch_, groups_;
  int window_ = 1;
  const Inputs& in_;
  cudaStream_t stream_;
  std::unique_ptr<StateCache> cache_;
  std::vector<std::vector<std::int32_t>> host_ids_;
  std::vector<DeviceBuffer> ids_;
  DeviceBuffer accepted_;
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
  int accepted = 1;
};

// Times one case: µs per step (one decode + commit of the batch), median and min.
Status time_case(const BenchShape& shape, int batch, const CaseSpec& cs,
                 const BenchOptions& o, std::int64_t min_state_bytes, const Inputs& inputs,
                 BenchResult* r) {
  const int groups =
      slot_groups(read_bytes_per_row(shape, cs.mode, cs.checkpoint, o.eager_state_dtype), batch,
                  min_state_bytes);
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
  OwnedStream stream;
  REPLAYSSM_RETURN_IF_ERROR(stream.create());
  CaseRunner runner(batch, groups, inputs, stream.s);
  REPLAYSSM_RETURN_IF_ERROR(runner.init(config, cs.window, cs.accepted));
  if (o.flush == FlushPattern::kStaggered && cs.mode == DecodeMode::kReplay) {
    REPLAYSSM_RETURN_IF_ERROR(runner.stagger(o.buffer_len));
  }
  // One graph = one fold cycle: ceil(L / k) steps (L for plain decoding).
  const int steps = cs.mode == DecodeMode::kReplay
                        ? (o.buffer_len + cs.accepted - 1) / cs.accepted
                        : o.buffer_len;
  GraphExec exec;
  REPLAYSSM_RETURN_IF_ERROR(runner.capture(steps, &exec));
  std::vector<double> us;
  REPLAYSSM_RETURN_IF_ERROR(time_graph(exec, stream.s, std::max(o.warmup_cycles, 1),
                                       std::max(o.repetitions, kMinRepetitions), &us));
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  for (double& u : us) u /= double(steps) * groups;
  r->shape = shape.name;
  r->batch = batch;
  r->mode = cs.mode;
  r->checkpoint = cs.checkpoint;
  r->buffer_len = o.buffer_len;
  r->flush = o.flush;
  r->slot_groups = groups;
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

// ---- the eager speculative step (bench only) ---------------------------------------------

namespace mamba2 = cuda::mamba2;

// An eager spec step as vLLM runs it: read the state once, then for each window position t
// update it in registers and write it to its own copy t (T + 1 state transfers), with y_t.
struct EagerSpecParams {
  int batch, T, H, P, G;
  void* state;              // [batch][T][H][P][N]; copy 0 is the state read
  const void* x;            // [batch, T, H, P]
  const float* dt;          // [batch, T, H]
  const void* B;            // [batch, T, G, N]
  const void* C;            // [batch, T, G, N]
  const float* A;
  const float* D;
  const float* dt_bias;
  void* y;                  // [batch, T, H, P]
};

template <typename input_t, typename state_t>
__global__ void __launch_bounds__(mamba2::kMaxThreads)
    eager_spec_kernel(const __grid_constant__ EagerSpecParams p) {
  using Split = cuda::RowSplit<mamba2::kDstate, mamba2::kLanesPerRow>;
  constexpr int kN = Split::kPerLane;
  constexpr int kRows = mamba2::kRowsPerThread;
  __shared__ float dots[mamba2::kMaxWindow][mamba2::kMaxHeadDim];
  const int h = blockIdx.x, b = blockIdx.y;
  const int lane = threadIdx.x % mamba2::kLanesPerRow;
  const int row0 = threadIdx.x / mamba2::kLanesPerRow;
  const int rows_per_pass = blockDim.x / mamba2::kLanesPerRow;
  const int g = h / (p.H / p.G);
  const std::int64_t head_elems = std::int64_t{p.P} * mamba2::kDstate;
  auto copy = [&](int t) {
    return static_cast<state_t*>(p.state) + ((std::int64_t{b} * p.T + t) * p.H + h) * head_elems;
  };
  typename Split::template Fragment<state_t> st[kRows];
  float s[kRows][kN];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int row = row0 + i * rows_per_pass;
    if (row < p.P) st[i].template load<cuda::CacheOp::kStreaming>(copy(0) + row * mamba2::kDstate, lane);
  }
#pragma unroll
  for (int i = 0; i < kRows; ++i) st[i].unpack(s[i]);
  for (int t = 0; t < p.T; ++t) {
    const std::int64_t bt = std::int64_t{b} * p.T + t;
    typename Split::template Fragment<input_t, state_t> b_in, c_in;
    b_in.load(static_cast<const input_t*>(p.B) + (bt * p.G + g) * mamba2::kDstate, lane);
    c_in.load(static_cast<const input_t*>(p.C) + (bt * p.G + g) * mamba2::kDstate, lane);
    float Bv[kN], Cv[kN];
    b_in.unpack(Bv);
    c_in.unpack(Cv);
    const float delta = softplus(p.dt[bt * p.H + h] + p.dt_bias[h]);
    const float decay = expf(p.A[h] * delta);
    const auto* x = static_cast<const input_t*>(p.x) + (bt * p.H + h) * p.P;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int row = row0 + i * rows_per_pass;
      const float xdt = row < p.P ? to_float(x[row]) * delta : 0.0f;
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < kN; ++e) {
        s[i][e] = decay * s[i][e] + xdt * Bv[e];
        dot += s[i][e] * Cv[e];
      }
      st[i].pack(s[i]);
      if (row < p.P) {
        st[i].template store<cuda::CacheOp::kStreaming>(copy(t) + row * mamba2::kDstate, lane);
      }
      dot = cuda::group_sum<mamba2::kLanesPerRow>(dot);
      if (row < p.P && lane == 0) dots[t][row] = dot;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < p.T * p.P; i += blockDim.x) {
    const int t = i / p.P, r = i - t * p.P;
    const std::int64_t off = ((std::int64_t{b} * p.T + t) * p.H + h) * p.P + r;
    const float out = dots[t][r] + p.D[h] * to_float(static_cast<const input_t*>(p.x)[off]);
    static_cast<input_t*>(p.y)[off] = from_float<input_t>(out);
  }
}

Status launch_eager_spec(const EagerSpecParams& p, DType input, DType state, cudaStream_t stream) {
  return cuda::ActivationDTypes::dispatch(input, "input dtype", [&](auto in) {
    return cuda::StateDTypes::dispatch(state, "state dtype", [&](auto st) {
      const dim3 grid(unsigned(p.H), unsigned(p.batch));
      eager_spec_kernel<cuda::dtype_t<in.value>, cuda::dtype_t<st.value>>
          <<<grid, mamba2::block_threads(p.P), 0, stream>>>(p);
      return cuda_status(cudaGetLastError(), "eager spec kernel");
    });
  });
}

Status time_eager_spec(const BenchShape& shape, int batch, int T, const BenchOptions& o,
                       std::int64_t min_state_bytes, const Inputs& in, double* us_out) {
  const Mamba2Shape& m = shape.mamba2;
  if (m.dstate != mamba2::kDstate || m.head_dim > mamba2::kMaxHeadDim || T > mamba2::kMaxWindow) {
    return unsupported("eager spec bench: shape or window outside the kernel's tile");
  }
  const double row_bytes =
      double(state_dims(m).state_elems()) * double(dtype_size(o.eager_state_dtype)) * T;
  const int groups = slot_groups(row_bytes, batch, min_state_bytes);
  std::vector<DeviceBuffer> states(static_cast<std::size_t>(groups));
  for (DeviceBuffer& s : states) {
    REPLAYSSM_RETURN_IF_ERROR(s.allocate(Device::kCuda, std::size_t(row_bytes) * batch));
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaMemset(s.get(), 0, std::size_t(row_bytes) * batch));
  }
  OwnedStream stream;
  REPLAYSSM_RETURN_IF_ERROR(stream.create());
  cudaGraph_t graph = nullptr;
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeThreadLocal));
  const int steps = o.buffer_len;
  const Status st = [&]() -> Status {
    for (int s = 0; s < steps; ++s) {
      for (int g = 0; g < groups; ++g) {
        const std::size_t set = std::size_t(s % kInputSets);
        const EagerSpecParams p{batch, T, m.nheads, m.head_dim, m.ngroups,
                                states[std::size_t(g)].get(), in.x[set].get(),
                                in.dt[set].get<const float>(), in.B[set].get(),
                                in.C[set].get(), in.A.get<const float>(),
                                in.D.get<const float>(), in.dt_bias.get<const float>(),
                                in.out.get()};
        REPLAYSSM_RETURN_IF_ERROR(launch_eager_spec(p, o.input_dtype, o.eager_state_dtype, stream.s));
      }
    }
    return Status::ok();
  }();
  const cudaError_t end = cudaStreamEndCapture(stream.s, &graph);
  REPLAYSSM_RETURN_IF_ERROR(st);
  REPLAYSSM_CUDA_RETURN_IF_ERROR(end);
  GraphExec exec;
  const cudaError_t inst = cudaGraphInstantiate(&exec.exec, graph, 0);
  (void)cudaGraphDestroy(graph);
  REPLAYSSM_CUDA_RETURN_IF_ERROR(inst);
  std::vector<double> us;
  REPLAYSSM_RETURN_IF_ERROR(time_graph(exec, stream.s, 2, std::max(o.repetitions, kMinRepetitions), &us));
  for (double& u : us) u /= double(steps) * groups;
  *us_out = median(us);
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
  if (accepted < 0 || accepted > window) {
    return invalid_argument("spec bench: accepted tokens must be in [0, window] (0: all)");
  }
  const int k = accepted == 0 ? window : accepted;
  std::int64_t min_state_bytes = 0;
  BenchReport out;
  REPLAYSSM_RETURN_IF_ERROR(start_run(options, &min_state_bytes, &out));
  const std::size_t total = options.shapes.size() * options.batches.size();
  std::size_t done = 0;
  BenchOptions o = options;
  o.flush = FlushPattern::kAligned;
  for (const std::string& name : options.shapes) {
    const BenchShape& shape = *bench_shape_find(name);
    for (int batch : options.batches) {
      if (options.progress) {
        options.progress(double(done++) / double(total),
                         std::string(shape.name) + " batch " + std::to_string(batch) +
                             " spec T=" + std::to_string(window));
      }
      BytesModelCase bm;
      bm.dims = shape.dims();
      bm.batch = batch;
      bm.state_dtype = options.eager_state_dtype;
      bm.buffer_len = options.buffer_len;
      bm.input_dtype = options.input_dtype;
      bm.accepted = k;
      auto add = [&](CheckpointPrecision c, double eager_us, bool fused, double replay_us) {
        SpecBenchResult s;
        s.shape = shape.name;
        s.batch = batch;
        s.window = window;
        s.accepted = k;
        s.buffer_len = options.buffer_len;
        s.checkpoint = c;
        s.eager_fused = fused;
        s.eager_us = eager_us;
        s.eager_fused_us = fused ? eager_us : eager_us * double(window + 1) / double(2 * window);
        BytesModelCase e = bm;
        e.mode = DecodeMode::kEager;
        e.spec_tokens = fused ? window : 1;  // fused: T + 1 transfers; else T decodes of 2
        s.eager_bytes = bytes_model_step(e).total() * (fused ? 1.0 : double(window));
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
        // The GDN side's spec bench (cuda_bench_gdn.cu): its eager spec step is T sequential
        // eager decodes of the library's kernel (no fused eager-spec kernel for GDN).
        std::vector<GdnSpecResult> gdn;
        REPLAYSSM_RETURN_IF_ERROR(run_cuda_bench_gdn_spec(shape, batch, window, k, o, &gdn));
        for (const GdnSpecResult& g : gdn) add(g.checkpoint, g.eager_us, false, g.replay_us);
        continue;
      }
      Inputs inputs;
      REPLAYSSM_RETURN_IF_ERROR(make_inputs(shape, batch, window, options.input_dtype, &inputs));
      double eager_us = 0.0;
      REPLAYSSM_RETURN_IF_ERROR(
          time_eager_spec(shape, batch, window, o, min_state_bytes, inputs, &eager_us));
      for (CheckpointPrecision c : options.checkpoints) {
        BenchResult r;
        REPLAYSSM_RETURN_IF_ERROR(time_case(shape, batch,
                                            CaseSpec{DecodeMode::kReplay, c, window, k}, o,
                                            min_state_bytes, inputs, &r));
        add(c, eager_us, true, r.us_per_step);
      }
    }
  }
  if (options.progress) options.progress(1.0, "done");
  *report = std::move(out);
  return Status::ok();
}

}  // namespace replayssm
