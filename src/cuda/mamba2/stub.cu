// Placeholder until the Mamba-2 CUDA kernels land (issue 3).

#include "backend.h"

namespace replayssm::cuda {

Status mamba2_decode(StateCacheLayout&, const Mamba2DecodeArgs&) {
  return unsupported("mamba2_decode has no CUDA kernel in this build yet");
}
Status mamba2_fold(StateCacheLayout&, const FoldArgs&) {
  return unsupported("the Mamba-2 fold has no CUDA kernel in this build yet");
}

}  // namespace replayssm::cuda
