// Device memory for CUDA state caches, and GPU detection.

#include <cuda_runtime.h>

#include <string>

#include "backend.h"
#include "cuda/common/check.cuh"

namespace replayssm::cuda {

bool device_present() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return count > 0;
}

Status memory_alloc(std::size_t bytes, void** ptr) {
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes == 0 ? 256 : bytes);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return {StatusCode::kOutOfMemory,
            "cudaMalloc of " + std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(err)};
  }
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaMemset(p, 0, bytes == 0 ? 256 : bytes));
  *ptr = p;
  return Status::ok();
}

void memory_free(void* ptr) { (void)cudaFree(ptr); }

Status memory_zero(void* ptr, std::size_t bytes) {
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaMemset(ptr, 0, bytes));
  return Status::ok();
}

Status memory_copy(void* dst, const void* src, std::size_t bytes) {
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  return Status::ok();
}

}  // namespace replayssm::cuda
