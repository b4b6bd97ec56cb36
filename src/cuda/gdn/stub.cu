// Placeholder until the Gated DeltaNet CUDA kernels land (issue 4).

#include "backend.h"

namespace replayssm::cuda {

Status gdn_decode(StateCacheLayout&, const GdnDecodeArgs&) {
  return unsupported("gdn_decode has no CUDA kernel in this build yet");
}
Status gdn_fold(StateCacheLayout&, const FoldArgs&) {
  return unsupported("the GDN fold has no CUDA kernel in this build yet");
}

}  // namespace replayssm::cuda
