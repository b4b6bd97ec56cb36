// The CUDA backend's Mamba-2 entry points (src/backend.h): checks what this build supports,
// turns Args into kernel Params, and launches. Nothing here allocates, synchronises or copies
// to the host, so a whole decode step can be captured in a CUDA graph.

#include <cuda_runtime.h>

#include <string>

#include "backend.h"
#include "cuda/common/check.cuh"
#include "cuda/common/dispatch.cuh"
#include "cuda/mamba2/params.cuh"
#include "cuda/state_cache/cursors.cuh"

namespace replayssm::cuda {

namespace mamba2 {

Status can_implement(const StateCacheConfig& c) {
  // Shapes outside the tuned kernels' (dstate 128, head_dim <= 128) run on the generic ones.
  if (!ActivationDTypes::contains(c.input_dtype)) {
    return ActivationDTypes::error(c.input_dtype, "input dtype");
  }
  if (c.mode == DecodeMode::kEager) {
    if (!EagerStateDTypes::contains(c.state_dtype)) {
      return EagerStateDTypes::error(c.state_dtype, "eager state dtype");
    }
    return Status::ok();
  }
  if (!CheckpointPrecisions::contains(c.checkpoint)) {
    return CheckpointPrecisions::error(c.checkpoint, "checkpoint precision");
  }
  if (c.max_spec_tokens > kMaxWindow && !uses_generic_kernels(c.mamba2)) {
    return unsupported("mamba2 CUDA replay verifies windows of up to " +
                       std::to_string(kMaxWindow) + " tokens; the cache's max_spec_tokens is " +
                       std::to_string(c.max_spec_tokens));
  }
  return Status::ok();
}

namespace {

Status check_launch_shape(const StateCacheLayout&, int batch) {
  if (batch > 65535) {
    return unsupported("mamba2 CUDA decode takes at most 65535 rows per call, got " +
                       std::to_string(batch));
  }
  return Status::ok();
}

}  // namespace
}  // namespace mamba2

Status mamba2_decode(StateCacheLayout& cache, const Mamba2DecodeArgs& a) {
  REPLAYSSM_RETURN_IF_ERROR(mamba2::can_implement(cache.config));
  REPLAYSSM_RETURN_IF_ERROR(mamba2::check_launch_shape(cache, a.batch));
  mamba2::Params p;
  p.cache = cache;
  p.layer = a.layer;
  p.batch = a.batch;
  p.num_tokens = a.num_tokens;
  p.slot_ids = a.slot_ids;
  p.x = a.x;
  p.dt = a.dt;
  p.B = a.B;
  p.C = a.C;
  p.z = a.z;
  p.A = a.A;
  p.D = a.D;
  p.dt_bias = a.dt_bias;
  p.y = a.y;
  if (mamba2::uses_generic_kernels(cache.config.mamba2)) {
    REPLAYSSM_RETURN_IF_ERROR(mamba2::launch_generic(p));
    if (cache.config.mode == DecodeMode::kEager) return Status::ok();
  } else if (cache.config.mode == DecodeMode::kEager) {
    return mamba2::launch_eager(p);
  } else {
    REPLAYSSM_RETURN_IF_ERROR(mamba2::launch_replay(p));
  }
  return advance_folded(cache, a.layer, a.slot_ids, a.batch, a.num_tokens);
}

namespace mamba2 {

Status fold_layer(StateCacheLayout& cache, int layer, const std::int32_t* slot_ids, int batch) {
  mamba2::Params p;
  p.cache = cache;
  p.layer = layer;
  p.batch = batch;
  p.num_tokens = 0;
  p.slot_ids = slot_ids;
  REPLAYSSM_RETURN_IF_ERROR(uses_generic_kernels(cache.config.mamba2) ? launch_generic(p)
                                                                      : launch_replay(p));
  return advance_folded(cache, layer, slot_ids, batch, 0);
}

}  // namespace mamba2

Status mamba2_fold(StateCacheLayout& cache, const FoldArgs& args) {
  if (cache.config.mode == DecodeMode::kEager || args.batch == 0) return Status::ok();
  REPLAYSSM_RETURN_IF_ERROR(mamba2::can_implement(cache.config));
  REPLAYSSM_RETURN_IF_ERROR(mamba2::check_launch_shape(cache, args.batch));
  for (int layer = 0; layer < cache.config.num_layers; ++layer) {
    REPLAYSSM_RETURN_IF_ERROR(mamba2::fold_layer(cache, layer, args.slot_ids, args.batch));
  }
  return Status::ok();
}

}  // namespace replayssm::cuda
