#pragma once
// What both halves of the CUDA benchmark (cuda_bench.cu: Mamba-2, cuda_bench_gdn.cu: GDN) use:
// device memory they own, a stream, and the timed replay of a captured CUDA graph.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "common/device_buffer.h"
#include "cuda/common/check.cuh"
#include "replayssm/status.h"

namespace replayssm::bench_cuda {

/// Device memory owned by the benchmark (the library's DeviceBuffer, on the GPU).
using replayssm::DeviceBuffer;

/// A non-blocking stream of the benchmark's own (capturable into a graph).
struct OwnedStream {
  cudaStream_t s = nullptr;
  OwnedStream() = default;
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  Status create() {
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return Status::ok();
  }
  ~OwnedStream() {
    if (s != nullptr) (void)cudaStreamDestroy(s);
  }
};

struct GraphExec {
  cudaGraphExec_t exec = nullptr;
  GraphExec() = default;
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  ~GraphExec() {
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
  }
};

/// Replays `exec` (`warmup` untimed launches, then `reps` launches between events); appends
/// µs per launch, each.
inline Status time_graph(const GraphExec& exec, cudaStream_t stream, int warmup, int reps,
                         std::vector<double>* us) {
  for (int w = 0; w < warmup; ++w) {
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec.exec, stream));
  }
  cudaEvent_t start, stop;
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  for (int r = 0; r < reps; ++r) {
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventRecord(start, stream));
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec.exec, stream));
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
    float ms = 0.0f;
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
    us->push_back(double(ms) * 1e3);
  }
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  return Status::ok();
}

}  // namespace replayssm::bench_cuda
