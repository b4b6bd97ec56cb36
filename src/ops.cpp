// The public decode ops: validate what varies per call, then hand to the cache's backend.

#include "replayssm/ops.h"

#include "backend.h"
#include "validate.h"

namespace replayssm {

bool cuda_available() { return cuda::device_present(); }

namespace {

// Rows whose fold is due stop sharing a checkpoint first (checkpoint_sharing.h).
template <typename Args>
Status release_before_decode(StateCache& cache, const Args& args, Stream stream) {
  return release_checkpoints(cache.layout(),
                             {.first_layer = args.layer, .num_layers = 1, .batch = args.batch,
                              .slot_ids = args.slot_ids, .why = ReleaseFor::kFold,
                              .num_tokens = args.num_tokens},
                             stream);
}

}  // namespace

Status mamba2_decode(StateCache& cache, const Mamba2DecodeArgs& args, Stream stream) {
  REPLAYSSM_RETURN_IF_ERROR(validate_mamba2_decode(cache, args));
  if (args.batch == 0) return Status::ok();
  REPLAYSSM_RETURN_IF_ERROR(release_before_decode(cache, args, stream));
  switch (cache.config().device) {
    case Device::kCpu:
      cpu::mamba2_decode(cache.layout(), args);
      return Status::ok();
    case Device::kCuda: return cuda::mamba2_decode(cache.layout(), args, stream);
  }
  return invalid_argument("unknown device");
}

Status gdn_decode(StateCache& cache, const GdnDecodeArgs& args, Stream stream) {
  REPLAYSSM_RETURN_IF_ERROR(validate_gdn_decode(cache, args));
  if (args.batch == 0) return Status::ok();
  REPLAYSSM_RETURN_IF_ERROR(release_before_decode(cache, args, stream));
  switch (cache.config().device) {
    case Device::kCpu:
      cpu::gdn_decode(cache.layout(), args);
      return Status::ok();
    case Device::kCuda: return cuda::gdn_decode(cache.layout(), args, stream);
  }
  return invalid_argument("unknown device");
}

}  // namespace replayssm
