#include "cuda/common/device_limits.cuh"

#include <cuda_runtime.h>

#include "cuda/common/check.cuh"

namespace replayssm::cuda {

Status device_limits(DeviceLimits* out) {
  static thread_local int cached_device = -1;
  static thread_local DeviceLimits cached;
  int device = 0;
  REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (device != cached_device) {
    DeviceLimits d;
    REPLAYSSM_CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device));
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
        &d.smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    cached = d;
    cached_device = device;
  }
  *out = cached;
  return Status::ok();
}

}  // namespace replayssm::cuda
