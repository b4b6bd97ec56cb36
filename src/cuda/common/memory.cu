// Device memory for CUDA state caches, and GPU detection (backend.h's cuda:: memory functions).

#include <cuda_runtime.h>

#include <string>

#include "backend.h"
#include "cuda/common/check.cuh"
#include "cuda/common/stream.cuh"

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
  const Status zeroed = cuda_status(cudaMemset(p, 0, bytes == 0 ? 256 : bytes), "cudaMemset");
  if (!zeroed.is_ok()) {
    (void)cudaFree(p);
    return zeroed;
  }
  *ptr = p;
  return Status::ok();
}

void memory_free(void* ptr) { (void)cudaFree(ptr); }

Status memory_zero_2d(void* ptr, std::size_t width, std::size_t pitch, std::size_t height,
                      Stream stream) {
  if (height == 1) {
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ptr, 0, width, to_cuda(stream)));
  } else {
    REPLAYSSM_CUDA_RETURN_IF_ERROR(
        cudaMemset2DAsync(ptr, pitch, 0, width, height, to_cuda(stream)));
  }
  return Status::ok();
}

Status memory_set_byte(void* ptr, std::uint8_t value, Stream stream) {
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ptr, value, 1, to_cuda(stream)));
  return Status::ok();
}

Status memory_copy(void* dst, const void* src, std::size_t bytes, Stream stream) {
  REPLAYSSM_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, to_cuda(stream)));
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(to_cuda(stream)));
  return Status::ok();
}

Status memory_check_usable(const void* ptr, const char* what) {
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return invalid_argument(std::string("cache buffer ") + what +
                            " is not memory CUDA knows: " + cudaGetErrorString(err));
  }
  int device = 0;
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return invalid_argument(std::string("cache buffer ") + what +
                            " is host memory; a CUDA cache needs device memory");
  }
  if (attr.device != device) {
    return invalid_argument(std::string("cache buffer ") + what + " is on device " +
                            std::to_string(attr.device) + "; the current device is " +
                            std::to_string(device));
  }
  return Status::ok();
}

}  // namespace replayssm::cuda
