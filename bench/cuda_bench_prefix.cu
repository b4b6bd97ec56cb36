// The prefix ops' benchmark (cuda_bench_prefix.h). One cache of one layer with 2·batch slots:
// slots [0, batch) are the sources, [batch, 2·batch) the fork targets; every source has
// `k` committed records past its fold (its cursors set directly, the state's values do not
// change the traffic), and each op is captured once into a CUDA graph and replayed.

#include "cuda_bench_prefix.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "bench.h"
#include "bytes_model.h"
#include "checkpoint_sharing.h"
#include "common/checkpoint_traits.h"
#include "cuda_bench_util.cuh"
#include "replayssm/ops.h"
#include "replayssm/prefix.h"
#include "replayssm/state_cache.h"

namespace replayssm {

namespace {

using bench_cuda::GraphExec;
using bench_cuda::OwnedStream;
using bench_cuda::time_graph;

constexpr std::uint32_t kFolded = 1000;  // any position: only differences matter

// The baseline: a plain copy in 16-byte words, grid-stride, as fast as a state copy gets
// (cudaMemcpyAsync of the same bytes ran clearly slower on the H200).
__global__ void copy_kernel(const uint4* src, uint4* dst, std::int64_t words) {
  for (std::int64_t i = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < words;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    dst[i] = src[i];
  }
}

// Captures `enqueue(stream)` into a graph.
template <typename Enqueue>
Status capture(cudaStream_t stream, Enqueue enqueue, GraphExec* exec) {
  cudaGraph_t graph = nullptr;
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status captured = enqueue(stream);
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(stream, &graph));
  REPLAYSSM_RETURN_IF_ERROR(captured);
  const cudaError_t inst = cudaGraphInstantiate(&exec->exec, graph, 0);
  (void)cudaGraphDestroy(graph);
  REPLAYSSM_CUDA_RETURN_IF_ERROR(inst);
  return Status::ok();
}

// Captures `enqueue(stream)` into a graph and times its replays: the median µs per replay.
template <typename Enqueue>
Status time_op(cudaStream_t stream, int reps, Enqueue enqueue, double* us) {
  GraphExec exec;
  REPLAYSSM_RETURN_IF_ERROR(capture(stream, enqueue, &exec));
  std::vector<double> times;
  REPLAYSSM_RETURN_IF_ERROR(time_graph(exec, stream, 2, reps, &times));
  *us = median(times);
  return Status::ok();
}

// The cursors of every source: folded = kFolded, committed = kFolded + k; the targets the
// same with `target_k` records.
Status set_cursors(StateCache& cache, int batch, int k, int target_k = 0) {
  std::vector<std::uint32_t> committed(std::size_t(cache.config().capacity), kFolded);
  std::vector<std::uint32_t> folded(committed.size(), kFolded);
  for (int s = 0; s < batch; ++s) committed[std::size_t(s)] = kFolded + std::uint32_t(k);
  for (int s = batch; s < 2 * batch; ++s) committed[std::size_t(s)] = kFolded + std::uint32_t(target_k);
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaMemcpy(cache.buffer(CacheBufferId::kCommitted),
                                            committed.data(), committed.size() * 4,
                                            cudaMemcpyHostToDevice));
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaMemcpy(cache.buffer(CacheBufferId::kFolded), folded.data(),
                                            folded.size() * 4, cudaMemcpyHostToDevice));
  return Status::ok();
}

Status bench_case(const BenchShape& shape, CheckpointPrecision checkpoint,
                  const PrefixBenchOptions& o, cudaStream_t stream, PrefixBenchReport* report) {
  StateCacheConfig cfg;
  cfg.kind = shape.kind;
  cfg.mamba2 = shape.mamba2;
  cfg.gdn = shape.gdn;
  cfg.num_layers = 1;
  cfg.capacity = 2 * o.batch;
  cfg.device = Device::kCuda;
  cfg.input_dtype = o.input_dtype;
  cfg.buffer_len = o.buffer_len;
  cfg.max_spec_tokens = 1;
  cfg.checkpoint = checkpoint;
  const auto create = [&](bool share, std::unique_ptr<StateCache>* out) {
    StateCacheConfig c = cfg;
    c.share_forked_checkpoints = share;
    REPLAYSSM_RETURN_IF_ERROR(state_cache_create(c, out));
    for (int s = 0; s < c.capacity; ++s) {
      REPLAYSSM_RETURN_IF_ERROR(state_cache_claim_slot(**out, s));
    }
    // The claims' resets ran on the default stream, which the bench's stream does not wait for.
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
    return Status::ok();
  };
  std::unique_ptr<StateCache> cache, sharing;
  REPLAYSSM_RETURN_IF_ERROR(create(false, &cache));
  REPLAYSSM_RETURN_IF_ERROR(create(true, &sharing));
  const StateDims d = cfg.dims();
  const double E = double(d.state_elems());
  const CheckpointTraits t = checkpoint_traits(checkpoint);
  const double record = bytes_model_ring_record(d, o.input_dtype);
  const double master = t.has_hi ? 4.0 : t.lo_bytes;
  const double checkpoint_bytes = E * ((t.has_hi ? 4.0 : 0.0) + t.lo_bytes) +
                                  (t.lo_row_scale ? double(d.heads) * d.rows * 4.0 : 0.0);
  const double b = o.batch;

  std::vector<std::int32_t> src(std::size_t(o.batch)), dst(src.size());
  for (int i = 0; i < o.batch; ++i) {
    src[std::size_t(i)] = i;
    dst[std::size_t(i)] = o.batch + i;
  }
  DeviceBuffer src_ids, dst_ids, positions, states, copy_from;
  REPLAYSSM_RETURN_IF_ERROR(src_ids.assign(Device::kCuda, src));
  REPLAYSSM_RETURN_IF_ERROR(dst_ids.assign(Device::kCuda, dst));
  REPLAYSSM_RETURN_IF_ERROR(states.allocate(Device::kCuda, std::size_t(b * E * 4)));
  REPLAYSSM_RETURN_IF_ERROR(copy_from.allocate(Device::kCuda, std::size_t(b * E * 4)));

  // Forks every source of cache `c` onto its target at `positions`.
  const auto fork_on = [&](StateCache& c) {
    return [&, target = &c](cudaStream_t s) {
      ForkArgs a;
      a.batch = o.batch;
      a.src_slots = src_ids.get<const std::int32_t>();
      a.dst_slots = dst_ids.get<const std::int32_t>();
      a.positions = positions.get<const std::uint32_t>();
      return state_cache_fork(*target, a, s);
    };
  };
  double copy_gbps = 0.0;  // the state copy's, measured first
  auto add = [&](const char* op, int k, double us, double bytes, double deferred) {
    PrefixBenchRow r;
    r.shape = shape.name;
    r.checkpoint = checkpoint;
    r.op = op;
    r.records = k;
    r.us = us;
    r.model_bytes = bytes;
    r.gbps = bytes / (us * 1e-6) / 1e9;
    r.bytes_vs_copy = bytes / (b * 2.0 * E * 4.0);
    r.deferred_vs_copy = deferred / (b * 2.0 * E * 4.0);
    if (copy_gbps == 0.0) copy_gbps = r.gbps;
    r.pct_of_copy = 100.0 * r.gbps / copy_gbps;
    report->rows.push_back(r);
  };

  // The baseline: the batch's fp32 states copied (read + write E·4 each).
  double copy_us = 0.0;
  int sms = 0;
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  REPLAYSSM_RETURN_IF_ERROR(time_op(stream, o.repetitions, [&](cudaStream_t s) {
    copy_kernel<<<sms * 8, 256, 0, s>>>(copy_from.get<const uint4>(), states.get<uint4>(),
                                        std::int64_t(b * E * 4) / 16);
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return Status::ok();
  }, &copy_us));
  add("state copy", 0, copy_us, b * 2.0 * E * 4.0, 0.0);

  for (int k : {0, o.buffer_len / 2, o.buffer_len - 1}) {
    REPLAYSSM_RETURN_IF_ERROR(set_cursors(*cache, o.batch, k));
    std::vector<std::uint32_t> at(src.size(), kFolded + std::uint32_t(k));
    REPLAYSSM_RETURN_IF_ERROR(positions.assign(Device::kCuda, at));
    double us = 0.0;
    REPLAYSSM_RETURN_IF_ERROR(time_op(stream, o.repetitions, [&](cudaStream_t s) {
      MaterializeArgs a;
      a.batch = o.batch;
      a.slot_ids = src_ids.get<const std::int32_t>();
      a.positions = positions.get<const std::uint32_t>();
      a.states = states.get<float>();
      return state_cache_materialize(*cache, a, s);
    }, &us));
    add("materialize", k, us, b * (E * master + k * record + E * 4.0), 0.0);
    REPLAYSSM_RETURN_IF_ERROR(time_op(stream, o.repetitions, fork_on(*cache), &us));
    add("fork", k, us, b * 2.0 * (checkpoint_bytes + k * record), b * 2.0 * k * record);

    // The same fork on a cache that shares forked checkpoints (copy on fold): the records and
    // the cursors; its release pass finds no target lending anything.
    REPLAYSSM_RETURN_IF_ERROR(set_cursors(*sharing, o.batch, k));
    REPLAYSSM_RETURN_IF_ERROR(time_op(stream, o.repetitions, fork_on(*sharing), &us));
    add("fork shared", k, us, b * 2.0 * k * record, b * 2.0 * k * record);
  }

  // What sharing adds to a decode: the release pass over the batch. Every target reads its
  // source's checkpoint (the forks above) with k = L − 1 records: no row's fold is due, so the
  // pass only looks (the cost every decode of a sharing cache pays).
  StateCacheLayout& l = sharing->layout();
  ReleaseArgs idle;
  idle.num_layers = 1;
  idle.batch = o.batch;
  idle.slot_ids = dst_ids.get<const std::int32_t>();
  idle.why = ReleaseFor::kFold;
  idle.num_tokens = 1;
  double idle_us = 0.0;
  REPLAYSSM_RETURN_IF_ERROR(time_op(stream, o.repetitions, [&](cudaStream_t s) {
    return release_checkpoints(l, idle, s);
  }, &idle_us));
  add("release, none due", 0, idle_us, 0.0, 0.0);

  // The deferred copy: every target's first fold (L records due) takes its own checkpoint
  // from its source's rows, once. Timed per call with events, each after a fresh fork.
  const int k = o.buffer_len - 1;
  std::vector<double> first_fold;
  GraphExec fork_exec;
  {
    std::vector<std::uint32_t> at(src.size(), kFolded + std::uint32_t(k));
    REPLAYSSM_RETURN_IF_ERROR(positions.assign(Device::kCuda, at));
  }
  REPLAYSSM_RETURN_IF_ERROR(capture(stream, fork_on(*sharing), &fork_exec));
  cudaEvent_t start, stop;
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  for (int r = 0; r < o.repetitions + 1; ++r) {
    REPLAYSSM_RETURN_IF_ERROR(set_cursors(*sharing, o.batch, k));
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(fork_exec.exec, stream));
    // The targets' fold is due: L committed records past their fold.
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    REPLAYSSM_RETURN_IF_ERROR(set_cursors(*sharing, o.batch, k, o.buffer_len));
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventRecord(start, stream));
    REPLAYSSM_RETURN_IF_ERROR(release_checkpoints(l, idle, stream));
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
    float ms = 0.0f;
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
    if (r > 0) first_fold.push_back(double(ms) * 1e3);  // the first is a warm-up
  }
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  add("release, first fold", 0, median(first_fold), b * 2.0 * checkpoint_bytes, 0.0);
  return Status::ok();
}

}  // namespace

Status run_prefix_bench(const PrefixBenchOptions& o, PrefixBenchReport* report) {
  if (!cuda_available()) return unsupported("the prefix benchmark needs a GPU; none was found");
  cudaDeviceProp prop{};
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, 0));
  report->device = prop.name;
  OwnedStream stream;
  REPLAYSSM_RETURN_IF_ERROR(stream.create());
  for (const std::string& name : o.shapes) {
    const BenchShape* shape = bench_shape_find(name);
    if (shape == nullptr) return invalid_argument("unknown shape " + name);
    for (CheckpointPrecision p : o.checkpoints) {
      REPLAYSSM_RETURN_IF_ERROR(bench_case(*shape, p, o, stream.s, report));
    }
  }
  return Status::ok();
}

}  // namespace replayssm
