// replayssm_conv_bench: a replay decode step with the causal conv1d fused in (a conv cache,
// StateCacheConfig::conv_kernel) against the same step with the conv run first as its own
// kernel, on the GPU at the real layer shapes (docs/BENCHMARKS.md, "Fused conv1d").
//
//   replayssm_conv_bench [--shapes super120b,qwen35-4b] [--checkpoints fp32,fp32+bf16]
//                        [--batches 1,64,256] [--L 16] [--reps 7]
//
// The separate conv is the usual decode-time update: per row, the conv state [K - 1, channels]
// (channels contiguous) and the token's pre-conv inputs are read, conv + bias + SiLU written
// straight into the dense x, B, C (q, k, v) the decode takes, and the state shifted by one
// (K - 1 rows read and written). Both variants run decode + commit per step over whole fold
// cycles with staggered rows (row b is b mod L tokens ahead), rotated over enough slot groups
// that the state comes from memory; each step is captured in a CUDA graph, median of `reps`.

#include <CLI/CLI.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bench.h"
#include "common/numeric.h"
#include "cuda/common/dispatch.cuh"
#include "cuda_bench_util.cuh"
#include "replayssm/ops.h"
#include "replayssm/state_cache.h"

namespace replayssm::bench_cuda {
namespace {

constexpr int kConvKernel = 4;  // every target model's conv1d width
constexpr std::int64_t kStreamBytes = 4ll << 27;  // 512 MiB of state per cycle: from memory

// The separate conv: one thread per (channel, row); parts = the decode's dense inputs.
struct ConvParts {
  void* out[3];  // dense [batch, part width] each, in channel order
  int first[3];  // first channel of each part
  int width[3];
};
template <typename T>
__global__ void conv_update_kernel(const T* in, T* state, const float* weight, const float* bias,
                                   const std::int32_t* slots, int channels, ConvParts parts) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.y;
  if (c >= channels || slots[b] < 0) return;  // a pad row (the staggering warm-up)
  T* s = state + std::int64_t{slots[b]} * (kConvKernel - 1) * channels + c;
  float taps[kConvKernel];
  for (int i = 0; i < kConvKernel - 1; ++i) taps[i] = to_float(s[i * channels]);
  taps[kConvKernel - 1] = to_float(in[std::int64_t{b} * channels + c]);
  float acc = bias[c];
  for (int i = 0; i < kConvKernel; ++i) acc = fmaf(weight[c * kConvKernel + i], taps[i], acc);
  for (int i = 0; i < kConvKernel - 1; ++i) s[i * channels] = from_float<T>(taps[i + 1]);
  int p = 0;
  while (p < 2 && c >= parts.first[p] + parts.width[p]) ++p;
  static_cast<T*>(parts.out[p])[std::int64_t{b} * parts.width[p] + c - parts.first[p]] =
      from_float<T>(silu(acc));
}

struct Row {
  std::string shape, variant;
  CheckpointPrecision checkpoint;
  int batch;
  double us;
};

Status run_case(const BenchShape& shape, CheckpointPrecision ckpt, int batch, int L, int reps,
                bool fused, cudaStream_t stream, double* us) {
  StateCacheConfig c;
  c.kind = shape.kind;
  c.mamba2 = shape.mamba2;
  c.gdn = shape.gdn;
  c.device = Device::kCuda;
  c.input_dtype = DType::kBF16;
  c.buffer_len = L;
  c.checkpoint = ckpt;
  c.conv_kernel = fused ? kConvKernel : 0;
  const StateDims d = c.dims();
  const std::int64_t state_bytes = d.state_elems() * 4;
  const int groups = int(std::max<std::int64_t>(1, kStreamBytes / (state_bytes * batch)));
  c.capacity = groups * batch;
  std::unique_ptr<StateCache> cache;
  REPLAYSSM_RETURN_IF_ERROR(state_cache_create(c, &cache, stream));
  std::vector<std::int32_t> ids(std::size_t(c.capacity));
  for (auto& id : ids) REPLAYSSM_RETURN_IF_ERROR(state_cache_allocate_slot(*cache, &id, stream));
  const int C = c.conv_channels(), HK = d.key_heads * d.cols, HV = d.heads * d.rows;
  const int Hd = d.heads;
  DeviceBuffer slots, in, weight, bias, conv_state, x, B, Cq, y, dt, A, D, dtb, g, beta, accepted;
  const auto alloc = [&](DeviceBuffer& buf, std::size_t bytes) { return buf.allocate(Device::kCuda, bytes); };
  REPLAYSSM_RETURN_IF_ERROR(alloc(slots, ids.size() * 4));
  REPLAYSSM_RETURN_IF_ERROR(slots.upload(ids.data(), ids.size() * 4));
  REPLAYSSM_RETURN_IF_ERROR(alloc(in, std::size_t(batch) * C * 2));
  REPLAYSSM_RETURN_IF_ERROR(alloc(weight, std::size_t(C) * kConvKernel * 4));
  REPLAYSSM_RETURN_IF_ERROR(alloc(bias, std::size_t(C) * 4));
  REPLAYSSM_RETURN_IF_ERROR(alloc(conv_state, std::size_t(c.capacity) * (kConvKernel - 1) * C * 2));
  REPLAYSSM_RETURN_IF_ERROR(alloc(x, std::size_t(batch) * HV * 2));
  REPLAYSSM_RETURN_IF_ERROR(alloc(B, std::size_t(batch) * HK * 2));
  REPLAYSSM_RETURN_IF_ERROR(alloc(Cq, std::size_t(batch) * HK * 2));
  REPLAYSSM_RETURN_IF_ERROR(alloc(y, std::size_t(batch) * HV * 2));
  REPLAYSSM_RETURN_IF_ERROR(alloc(dt, std::size_t(batch) * Hd * 4));
  REPLAYSSM_RETURN_IF_ERROR(alloc(beta, std::size_t(batch) * Hd * 4));
  REPLAYSSM_RETURN_IF_ERROR(alloc(g, std::size_t(batch) * Hd * 4));
  REPLAYSSM_RETURN_IF_ERROR(alloc(A, std::size_t(Hd) * 4));
  REPLAYSSM_RETURN_IF_ERROR(alloc(D, std::size_t(Hd) * 4));
  REPLAYSSM_RETURN_IF_ERROR(alloc(dtb, std::size_t(Hd) * 4));
  REPLAYSSM_RETURN_IF_ERROR(alloc(accepted, std::size_t(batch) * 4));
  // Values: zeros decode fine (Δ = softplus(0)); A = -1 (a decay), β = 0.5, k of norm > 0.
  const std::vector<float> minus_one(std::size_t(Hd), -1.0f), half(std::size_t(batch) * Hd, 0.5f);
  const std::vector<bf16_t> ones(std::size_t(batch) * C, float_to_bf16(0.01f));
  const std::vector<std::int32_t> one(std::size_t(batch), 1);
  REPLAYSSM_RETURN_IF_ERROR(A.upload(minus_one.data(), minus_one.size() * 4));
  REPLAYSSM_RETURN_IF_ERROR(beta.upload(half.data(), half.size() * 4));
  REPLAYSSM_RETURN_IF_ERROR(in.upload(ones.data(), ones.size() * 2));
  REPLAYSSM_RETURN_IF_ERROR(accepted.upload(one.data(), one.size() * 4));
  const ConvParts parts =
      shape.kind == LayerKind::kMamba2
          ? ConvParts{{x.get(), B.get(), Cq.get()}, {0, HV, HV + HK}, {HV, HK, HK}}
          : ConvParts{{Cq.get(), B.get(), x.get()}, {0, HK, 2 * HK}, {HK, HK, HV}};
  // One step of the rows `group_ids` (-1: skipped, as in the staggering warm-up).
  const auto step = [&](const std::int32_t* group_ids) -> Status {
    if (!fused) {
      conv_update_kernel<bf16_t><<<dim3((C + 255) / 256, batch), 256, 0, stream>>>(
          static_cast<const bf16_t*>(in.get()), static_cast<bf16_t*>(conv_state.get()),
          weight.get<float>(), bias.get<float>(), group_ids, C, parts);
      REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    }
    const ConvInputs conv = fused ? ConvInputs{in.get(), 0, weight.get<float>(), bias.get<float>()}
                                  : ConvInputs{};
    if (shape.kind == LayerKind::kMamba2) {
      Mamba2DecodeArgs a;
      a.batch = batch;
      a.slot_ids = group_ids;
      a.x = fused ? nullptr : x.get();
      a.B = fused ? nullptr : B.get();
      a.C = fused ? nullptr : Cq.get();
      a.conv = conv;
      a.dt = dt.get<float>();
      a.A = A.get<float>();
      a.D = D.get<float>();
      a.dt_bias = dtb.get<float>();
      a.y = y.get();
      REPLAYSSM_RETURN_IF_ERROR(mamba2_decode(*cache, a, stream));
    } else {
      GdnDecodeArgs a;
      a.batch = batch;
      a.slot_ids = group_ids;
      a.q = fused ? nullptr : Cq.get();
      a.k = fused ? nullptr : B.get();
      a.v = fused ? nullptr : x.get();
      a.conv = conv;
      a.g = g.get<float>();
      a.beta = beta.get<float>();
      a.o = y.get();
      REPLAYSSM_RETURN_IF_ERROR(gdn_decode(*cache, a, stream));
    }
    return state_cache_commit(*cache, {batch, group_ids, accepted.get<std::int32_t>()}, stream);
  };
  // Staggering: row b of every group first decodes b mod L tokens alone.
  DeviceBuffer warm_ids;
  REPLAYSSM_RETURN_IF_ERROR(alloc(warm_ids, std::size_t(batch) * 4));
  for (int s = 0; s < L - 1; ++s) {
    for (int grp = 0; grp < groups; ++grp) {
      std::vector<std::int32_t> w(std::size_t(batch), -1);
      for (int b = 0; b < batch; ++b) {
        if (s < b % L) w[std::size_t(b)] = ids[std::size_t(grp * batch + b)];
      }
      REPLAYSSM_RETURN_IF_ERROR(warm_ids.upload(w.data(), w.size() * 4));
      REPLAYSSM_RETURN_IF_ERROR(step(warm_ids.get<std::int32_t>()));
      REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    }
  }
  // One graph: L steps of every group (whole fold cycles).
  cudaGraph_t graph;
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int s = 0; s < L; ++s) {
    for (int grp = 0; grp < groups; ++grp) {
      REPLAYSSM_RETURN_IF_ERROR(step(slots.get<std::int32_t>() + grp * batch));
    }
  }
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(stream, &graph));
  GraphExec exec;
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec.exec, graph, 0));
  (void)cudaGraphDestroy(graph);
  std::vector<double> times;
  REPLAYSSM_RETURN_IF_ERROR(time_graph(exec, stream, 2, reps, &times));
  std::sort(times.begin(), times.end());
  *us = times[times.size() / 2] / (L * groups);
  return Status::ok();
}

}  // namespace
}  // namespace replayssm::bench_cuda

int main(int argc, char** argv) {
  using namespace replayssm;
  using namespace replayssm::bench_cuda;
  CLI::App app{"Replay decode with the conv1d fused, against a separate conv kernel + decode"};
  std::vector<std::string> shapes = {"super120b", "nano4b", "qwen35-4b", "qwen35-122b"};
  std::vector<std::string> checkpoints = {"fp32", "bf16", "fp32+bf16", "fp32+fp8"};
  std::vector<int> batches = {1, 64, 256};
  int L = 16, reps = 7;
  app.add_option("--shapes", shapes, "Layer shapes")->delimiter(',');
  app.add_option("--checkpoints", checkpoints, "Replay checkpoint precisions")
      ->delimiter(',')
      ->check(CLI::IsMember({"fp32", "bf16", "fp32+bf16", "fp32+fp8"}));
  app.add_option("--batches", batches, "Batch sizes")->delimiter(',')->check(CLI::Range(1, 4096));
  app.add_option("--L", L, "Buffer length")->check(CLI::Range(2, 64));
  app.add_option("--reps", reps, "Timed repetitions (median)")->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);
  OwnedStream stream;
  if (Status st = stream.create(); !st.is_ok()) {
    std::fprintf(stderr, "error: %s\n", st.to_string().c_str());
    return 1;
  }
  std::printf("bf16 activations, conv width %d, L = %d, staggered rows, us per step (median of %d "
              "cycles)\n", kConvKernel, L, reps);
  std::printf("%-12s %-10s %6s %14s %12s %8s\n", "shape", "checkpoint", "batch", "conv+decode",
              "fused", "saved");
  for (const std::string& name : shapes) {
    const BenchShape* shape = bench_shape_find(name);
    if (shape == nullptr) {
      std::fprintf(stderr, "error: unknown shape %s\n", name.c_str());
      return 1;
    }
    for (const std::string& ck : checkpoints) {
      CheckpointPrecision p{};
      parse_checkpoint_precision(ck, &p);
      for (int batch : batches) {
        double separate = 0.0, fused = 0.0;
        for (const bool fuse : {false, true}) {
          const Status st =
              run_case(*shape, p, batch, L, reps, fuse, stream.s, fuse ? &fused : &separate);
          if (!st.is_ok()) {
            std::fprintf(stderr, "error: %s %s batch %d: %s\n", name.c_str(), ck.c_str(), batch,
                         st.to_string().c_str());
            return 1;
          }
        }
        std::printf("%-12s %-10s %6d %14.1f %12.1f %7.1f%%\n", name.c_str(), ck.c_str(), batch,
                    separate, fused, 100.0 * (separate - fused) / separate);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
