// The public decode ops: validate, then hand to the cache's backend.

#include "replayssm/ops.h"

#include "backend.h"
#include "validate.h"

namespace replayssm {

bool cuda_available() {
#if defined(REPLAYSSM_WITH_CUDA)
  return cuda::device_present();
#else
  return false;
#endif
}

Status mamba2_decode(StateCache& cache, const Mamba2DecodeArgs& args) {
  REPLAYSSM_RETURN_IF_ERROR(validate_mamba2_decode(cache, args));
  if (args.batch == 0) return Status::ok();
  if (cache.config().device == Device::kCpu) {
    cpu::mamba2_decode(cache.layout(), args);
    return Status::ok();
  }
#if defined(REPLAYSSM_WITH_CUDA)
  return cuda::mamba2_decode(cache.layout(), args);
#else
  return unsupported("built without CUDA");
#endif
}

Status gdn_decode(StateCache& cache, const GdnDecodeArgs& args) {
  REPLAYSSM_RETURN_IF_ERROR(validate_gdn_decode(cache, args));
  if (args.batch == 0) return Status::ok();
  if (cache.config().device == Device::kCpu) {
    cpu::gdn_decode(cache.layout(), args);
    return Status::ok();
  }
#if defined(REPLAYSSM_WITH_CUDA)
  return cuda::gdn_decode(cache.layout(), args);
#else
  return unsupported("built without CUDA");
#endif
}

}  // namespace replayssm
