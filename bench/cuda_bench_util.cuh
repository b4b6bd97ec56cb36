#pragma once
// What both halves of the CUDA benchmark (cuda_bench.cu: Mamba-2, cuda_bench_gdn.cu: GDN) use:
// device memory they own, a stream, the accepted counts their commits read, and the timed
// replay of a captured CUDA graph.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/device_buffer.h"
#include "cuda/common/check.cuh"
#include "replayssm/status.h"
#include "spec_acceptance.h"

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

/// The accepted counts [batch] a case's commits read, on the device, by step: a fixed k is one
/// array that every step reads; random acceptance (kRandomAcceptance) is one array per step of
/// the pattern (random_acceptance_draws), step s of a cycle reading array s. A captured graph
/// holds these pointers, so the counts must outlive it. Every slot group commits the same draws:
/// the groups only spread the state over memory, and eager and replay cases, which rotate
/// different numbers of groups, then commit the same pattern.
class AcceptedCounts {
 public:
  /// `steps`: the steps of the cycle the graph captures (random acceptance draws that many).
  Status init(int batch, int window, int accepted, int steps) {
    std::vector<std::vector<std::int32_t>> counts;
    if (accepted == kRandomAcceptance) {
      if (steps < 1) return invalid_argument("random acceptance needs at least one step");
      counts = random_acceptance_draws(window, batch, steps);
    } else {
      counts.emplace_back(std::size_t(batch), accepted);
    }
    per_step_.clear();
    for (const std::vector<std::int32_t>& step : counts) {
      per_step_.emplace_back();
      REPLAYSSM_RETURN_IF_ERROR(per_step_.back().assign(Device::kCuda, step));
    }
    return Status::ok();
  }
  /// The counts step `step` of a cycle commits (a fixed k: the same array for every step).
  [[nodiscard]] const std::int32_t* at(int step) const {
    return per_step_[std::size_t(step) % per_step_.size()].get<const std::int32_t>();
  }

 private:
  std::vector<DeviceBuffer> per_step_;
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
