#pragma once
// Turning CUDA errors into Status: every runtime call and every launch is checked.

#include <cuda_runtime.h>

#include <string>

#include "replayssm/status.h"

namespace replayssm::cuda {

inline Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::ok();
  return {StatusCode::kCudaError, std::string(what) + ": " + cudaGetErrorString(err)};
}

}  // namespace replayssm::cuda

#define REPLAYSSM_CUDA_RETURN_IF_ERROR(expr) \
  REPLAYSSM_RETURN_IF_ERROR(::replayssm::cuda::cuda_status((expr), #expr))

/// After a kernel launch: reports a bad configuration or a launch failure.
#define REPLAYSSM_CUDA_CHECK_LAUNCH(name) \
  REPLAYSSM_RETURN_IF_ERROR(::replayssm::cuda::cuda_status(cudaGetLastError(), name))
