#pragma once
// Programmatic dependent launch (sm_90+) for the kernels of a decode step. A kernel launched
// with launch_programmatic may be scheduled while the previous kernel of its stream is still
// running its last blocks; it calls grid_dependency_wait() before it touches global memory
// (any of it may be the previous kernel's output: an engine's projection, another layer's
// decode, a commit), then allow_dependents(), so that the next such kernel is scheduled into
// the SMs its own tail leaves idle. The dependency is unchanged; what overlaps is the launch
// latency and block scheduling of one kernel with the tail of the one before, which is most
// of a step at small batch. A graph captures it as a programmatic edge; on older GPUs both
// device calls compile to nothing and the launch is an ordinary one.

#include <cuda_runtime.h>

#include <unordered_map>

#include "cuda/common/check.cuh"
#include "replayssm/status.h"

namespace replayssm::cuda {

/// Waits until the stream's previous kernel has completed and its writes are visible.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// Lets the stream's next programmatic kernel be scheduled once every block of this one has
/// called it (or exited). Called after grid_dependency_wait, so that a kernel never runs
/// beside the one two before it.
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// Lets `kernel` launch with `dynamic_bytes` of dynamic shared memory. A block may take 48 KB
/// without opting in, its static shared memory included (the replay kernels have some:
/// fold_order.cuh), so the opt-in is decided on the sum; below it the driver call is skipped.
/// The static size is fixed when the kernel is compiled: asked once per kernel and thread.
template <typename Params>
Status allow_dynamic_smem(void (*kernel)(Params), int dynamic_bytes, const char* name) {
  constexpr int kSmemWithoutOptIn = 48 * 1024;
  static thread_local std::unordered_map<const void*, int> static_bytes;
  const void* key = reinterpret_cast<const void*>(kernel);
  auto known = static_bytes.find(key);
  if (known == static_bytes.end()) {
    cudaFuncAttributes attributes{};
    REPLAYSSM_RETURN_IF_ERROR(cuda_status(cudaFuncGetAttributes(&attributes, kernel), name));
    known = static_bytes.emplace(key, int(attributes.sharedSizeBytes)).first;
  }
  if (known->second + dynamic_bytes <= kSmemWithoutOptIn) return Status::ok();
  return cuda_status(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_bytes),
      name);
}

/// kernel<<<grid, block, smem, stream>>>(params) as a programmatic dependent launch.
template <typename Params>
Status launch_programmatic(void (*kernel)(Params), dim3 grid, dim3 block, int smem,
                           cudaStream_t stream, const Params& params, const char* name) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<std::size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cuda_status(cudaLaunchKernelEx(&config, kernel, params), name);
}

}  // namespace replayssm::cuda
