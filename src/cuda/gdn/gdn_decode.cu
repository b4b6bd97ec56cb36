// The CUDA backend's Gated DeltaNet entry points (backend.h, families.h): what this build
// supports (checked once, when a cache is created, against the lists in gdn_params.cuh),
// cuda::gdn_decode and the folds. Arguments arrive validated (validate.cpp).

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "backend.h"
#include "cuda/common/check.cuh"
#include "cuda/common/device_limits.cuh"
#include "cuda/common/dispatch.cuh"
#include "cuda/common/stream.cuh"
#include "cuda/families.h"
#include "cuda/gdn/gdn_launch.h"
#include "cuda/gdn/gdn_params.cuh"

namespace replayssm::cuda {

namespace gdn {

namespace {

// The grid's y dimension holds the batch.
Status check_launch_shape(int batch) {
  if (batch > 65535) {
    return unsupported("gdn CUDA decode takes at most 65535 rows per call, got " +
                       std::to_string(batch));
  }
  return Status::ok();
}

}  // namespace

Status can_implement(const StateCacheConfig& c) {
  const StateDims d = c.dims();
  if (!ActivationDTypes::contains(c.input_dtype)) {
    return ActivationDTypes::error(c.input_dtype, "gdn input dtype");
  }
  if (!HeadKDims::contains(d.cols)) return HeadKDims::error(d.cols, "gdn head_k_dim");
  if (d.rows > kMaxHeadVDim) {
    return unsupported("unsupported gdn head_v_dim " + std::to_string(d.rows) +
                       "; supported: 1 to " + std::to_string(kMaxHeadVDim));
  }
  switch (c.mode) {
    case DecodeMode::kEager:
      if (!EagerStateDTypes::contains(c.state_dtype)) {
        return EagerStateDTypes::error(c.state_dtype, "gdn eager state dtype");
      }
      return Status::ok();
    case DecodeMode::kReplay: break;
  }
  if (!CheckpointPrecisions::contains(c.checkpoint)) {
    return CheckpointPrecisions::error(c.checkpoint, "gdn checkpoint precision");
  }
  // Every window up to max_spec_tokens must be one the kernels are built for.
  for (int t = 1; t <= c.max_spec_tokens; ++t) {
    if (!WindowWidths::contains(t)) {
      return unsupported("gdn CUDA replay verifies windows of " + WindowWidths::names() +
                         " tokens; the cache's max_spec_tokens is " +
                         std::to_string(c.max_spec_tokens));
    }
  }
  DeviceLimits limits;
  REPLAYSSM_RETURN_IF_ERROR(device_limits(&limits));
  const int bytes = replay_smem(c, c.max_spec_tokens).bytes;  // the widest window needs most
  if (bytes > limits.smem_per_block) {
    return unsupported("gdn CUDA replay needs " + std::to_string(bytes) +
                       " bytes of shared memory per block for this cache's buffer_len and "
                       "max_spec_tokens (ring records staged: buffer_len - 1 + "
                       "2·max_spec_tokens); the device gives " +
                       std::to_string(limits.smem_per_block) + " (use a shorter buffer_len)");
  }
  return Status::ok();
}

GdnInputs input_args(const GdnDecodeArgs& a, int head_k_dim) {
  GdnInputs in;
  in.slot_ids = a.slot_ids;
  in.q = a.q;
  in.k = a.k;
  in.v = a.v;
  in.g = a.g;
  in.beta = a.beta;
  in.o = a.o;
  in.qk_l2norm = a.qk_l2norm;
  // As the CPU backend's query_scale, so that both round q̂ alike.
  in.q_scale = a.scale > 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(head_k_dim));
  return in;
}

RowTiling row_tiling(int batch, int num_k_heads, int group_rows, int granule, int sms) {
  // Enough CTAs for every SM to hold several: a replay CTA is latency-bound (gdn_params.cuh).
  const int want_ctas = 8 * sms;
  const int ctas = std::max(1, batch * num_k_heads);
  const int max_splits = std::max(1, (group_rows + granule - 1) / granule);
  int splits = std::clamp(std::max((want_ctas + ctas - 1) / ctas, kMinRowSplits), 1, max_splits);
  RowTiling t;
  t.rows_per_split = (group_rows + splits - 1) / splits;
  t.rows_per_split = (t.rows_per_split + granule - 1) / granule * granule;
  t.splits = (group_rows + t.rows_per_split - 1) / t.rows_per_split;
  return t;
}

Status fold_layers(StateCacheLayout& cache, int first_layer, int num_layers,
                   const std::int32_t* slot_ids, int batch, cudaStream_t stream) {
  if (cache.config.mode == DecodeMode::kEager || batch == 0) return Status::ok();
  REPLAYSSM_RETURN_IF_ERROR(check_launch_shape(batch));
  ReplayWork work;
  work.slot_ids = slot_ids;
  work.batch = batch;
  work.first_layer = first_layer;
  work.num_layers = num_layers;
  return launch_replay(cache, work, stream);
}

}  // namespace gdn

Status gdn_decode(StateCacheLayout& l, const GdnDecodeArgs& args, Stream s) {
  REPLAYSSM_RETURN_IF_ERROR(gdn::check_launch_shape(args.batch));
  if (l.config.mode == DecodeMode::kEager) return gdn::launch_eager(l, args, to_cuda(s));
  gdn::ReplayWork work;
  work.decode = &args;
  work.slot_ids = args.slot_ids;
  work.batch = args.batch;
  work.first_layer = args.layer;
  return gdn::launch_replay(l, work, to_cuda(s));
}

}  // namespace replayssm::cuda
