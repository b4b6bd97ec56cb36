#pragma once
// The public API's opaque Stream (types.h) as the CUDA stream it is.

#include <cuda_runtime.h>

#include "replayssm/types.h"

namespace replayssm::cuda {

inline cudaStream_t to_cuda(Stream stream) { return static_cast<cudaStream_t>(stream); }

}  // namespace replayssm::cuda
