// The CUDA backend's Mamba-2 entry points (src/backend.h): what this build supports (checked
// once, when a cache is created), Args into kernel Params, and the launches. Nothing here
// allocates, synchronises or copies to the host, so a whole decode step can be captured in a
// CUDA graph on the caller's stream.

#include <cuda_runtime.h>

#include <string>

#include "backend.h"
#include "cuda/common/check.cuh"
#include "cuda/common/device_limits.cuh"
#include "cuda/common/dispatch.cuh"
#include "cuda/common/stream.cuh"
#include "cuda/families.h"
#include "cuda/mamba2/mamba2_launch.h"
#include "cuda/state_cache/fold_order.cuh"

namespace replayssm::cuda {

namespace mamba2 {

Status can_implement(const StateCacheConfig& c) {
  // Shapes outside the tuned kernels' (dstate 128, head_dim <= 128) run on the generic ones.
  if (!ActivationDTypes::contains(c.input_dtype)) {
    return ActivationDTypes::error(c.input_dtype, "mamba2 input dtype");
  }
  switch (c.mode) {
    case DecodeMode::kEager:
      if (!EagerStateDTypes::contains(c.state_dtype)) {
        return EagerStateDTypes::error(c.state_dtype, "mamba2 eager state dtype");
      }
      // Both eager kernels keep a window's outputs (tuned: dot products in shared memory;
      // generic: accumulators per thread) for up to kMaxWindow tokens.
      if (c.max_spec_tokens > kMaxWindow) {
        return unsupported("mamba2 CUDA eager caches verify windows of up to " +
                           std::to_string(kMaxWindow) + " tokens; the cache's max_spec_tokens is " +
                           std::to_string(c.max_spec_tokens));
      }
      return Status::ok();
    case DecodeMode::kReplay: break;
  }
  if (!CheckpointPrecisions::contains(c.checkpoint)) {
    return CheckpointPrecisions::error(c.checkpoint, "mamba2 checkpoint precision");
  }
  if (uses_generic_kernels(c.mamba2)) {
    if (c.conv_kernel != 0) {
      return unsupported("mamba2 CUDA replay fuses the conv (conv_kernel > 0) in its tuned "
                         "kernel only: dstate 128, head_dim <= 128");
    }
    return Status::ok();
  }
  if (c.max_spec_tokens > kMaxWindow) {
    return unsupported("mamba2 CUDA replay verifies windows of up to " +
                       std::to_string(kMaxWindow) + " tokens; the cache's max_spec_tokens is " +
                       std::to_string(c.max_spec_tokens));
  }
  DeviceLimits limits;
  REPLAYSSM_RETURN_IF_ERROR(device_limits(&limits));
  const int smem = replay_smem(c, 1).bytes();
  const int budget = replay_smem_budget(limits);
  if (smem > budget) {
    return unsupported("mamba2 CUDA replay stages buffer_len - 1 + 2·max_spec_tokens ring "
                       "records in " + std::to_string(smem) +
                       " bytes of shared memory; this GPU allows " + std::to_string(budget) +
                       " (use a shorter buffer_len)");
  }
  return Status::ok();
}

namespace {

Status check_launch_shape(int batch) { return check_grid_rows(batch, "mamba2 CUDA decode"); }

}  // namespace

Status fold_layers(StateCacheLayout& cache, int first_layer, int num_layers,
                   const std::int32_t* slot_ids, int batch, cudaStream_t stream) {
  if (cache.config.mode == DecodeMode::kEager || batch == 0) return Status::ok();
  REPLAYSSM_RETURN_IF_ERROR(check_launch_shape(batch));
  for (int layer = first_layer; layer < first_layer + num_layers; ++layer) {
    Params p;
    p.cache = cache;
    p.layer = layer;
    p.batch = batch;
    p.num_tokens = 0;
    p.slot_ids = slot_ids;
    REPLAYSSM_RETURN_IF_ERROR(uses_generic_kernels(cache.config.mamba2)
                                  ? launch_generic(p, stream)
                                  : launch_replay(p, stream));
  }
  return Status::ok();
}

}  // namespace mamba2

Status mamba2_decode(StateCacheLayout& cache, const Mamba2DecodeArgs& a, Stream s) {
  REPLAYSSM_RETURN_IF_ERROR(mamba2::check_launch_shape(a.batch));
  const cudaStream_t stream = to_cuda(s);
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
  p.conv = a.conv;
  // One launch per call: a replay launch moves its own fold cursor (cursors.cuh).
  if (mamba2::uses_generic_kernels(cache.config.mamba2)) return mamba2::launch_generic(p, stream);
  if (cache.config.mode == DecodeMode::kEager) return mamba2::launch_eager(p, stream);
  return mamba2::launch_replay(p, stream);
}

}  // namespace replayssm::cuda
