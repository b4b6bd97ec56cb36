#include "cuda/common/device_limits.cuh"

#include <cuda_runtime.h>

#include <string>

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
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
        &d.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    REPLAYSSM_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
        &d.smem_reserved, cudaDevAttrReservedSharedMemoryPerBlock, device));
    cached = d;
    cached_device = device;
  }
  *out = cached;
  return Status::ok();
}

Status check_grid_rows(int batch, const char* what) {
  constexpr int kMaxGridY = 65535;
  if (batch <= kMaxGridY) return Status::ok();
  return unsupported(std::string(what) + " takes at most " + std::to_string(kMaxGridY) +
                     " rows per call, got " + std::to_string(batch));
}

}  // namespace replayssm::cuda
