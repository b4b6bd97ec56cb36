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
#include "cuda/state_cache/fold_order.cuh"

namespace replayssm::cuda {

namespace gdn {

namespace {

Status check_launch_shape(int batch) { return check_grid_rows(batch, "gdn CUDA decode"); }

}  // namespace

Status uses_generic_kernels(const StateCacheConfig& c, bool* generic) {
  const StateDims d = c.dims();
  *generic = !HeadKDims::contains(d.cols) || d.rows > kMaxHeadVDim;
  if (*generic || c.mode == DecodeMode::kEager) return Status::ok();
  *generic = c.max_spec_tokens > WindowWidths::max();
  if (*generic) return Status::ok();
  DeviceLimits limits;
  REPLAYSSM_RETURN_IF_ERROR(device_limits(&limits));
  // The widest window needs the most staging, or a single token its staged passes.
  const int bytes = std::max(replay_smem(c, 1).bytes, replay_smem(c, c.max_spec_tokens).bytes);
  *generic = bytes > replay_smem_budget(limits);
  return Status::ok();
}

Status can_implement(const StateCacheConfig& c) {
  const StateDims d = c.dims();
  if (!ActivationDTypes::contains(c.input_dtype)) {
    return ActivationDTypes::error(c.input_dtype, "gdn input dtype");
  }
  if (d.cols > kGenericMaxK) {
    return unsupported("unsupported gdn head_k_dim " + std::to_string(d.cols) +
                       "; supported: 1 to " + std::to_string(kGenericMaxK));
  }
  switch (c.mode) {
    case DecodeMode::kEager:
      if (!EagerStateDTypes::contains(c.state_dtype)) {
        return EagerStateDTypes::error(c.state_dtype, "gdn eager state dtype");
      }
      if (c.max_spec_tokens > kMaxEagerWindow) {
        return unsupported("gdn CUDA eager caches verify windows of up to " +
                           std::to_string(kMaxEagerWindow) +
                           " tokens; the cache's max_spec_tokens is " +
                           std::to_string(c.max_spec_tokens));
      }
      return Status::ok();
    case DecodeMode::kReplay: break;
  }
  if (!CheckpointPrecisions::contains(c.checkpoint)) {
    return CheckpointPrecisions::error(c.checkpoint, "gdn checkpoint precision");
  }
  bool generic = false;
  REPLAYSSM_RETURN_IF_ERROR(uses_generic_kernels(c, &generic));
  if (!generic) return Status::ok();
  if (c.conv_kernel != 0) {
    return unsupported("gdn CUDA replay fuses the conv (conv_kernel > 0) in its tuned kernel "
                       "only: head_k_dim a multiple of 16 up to 128, head_v_dim <= 128, "
                       "max_spec_tokens <= 8, staging within the GPU's shared memory");
  }
  DeviceLimits limits;
  REPLAYSSM_RETURN_IF_ERROR(device_limits(&limits));
  const int bytes = generic_smem_bytes(c, c.max_spec_tokens);
  if (bytes > limits.smem_per_block) {
    return unsupported("gdn CUDA replay needs " + std::to_string(bytes) +
                       " bytes of shared memory per block for this cache's head_k_dim, "
                       "buffer_len and max_spec_tokens (one coefficient per record: "
                       "buffer_len - 1 + 2·max_spec_tokens); the device gives " +
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
  in.conv = a.conv;
  in.qk_l2norm = a.qk_l2norm;
  // As the CPU backend's query_scale, so that both round q̂ alike.
  in.q_scale = a.scale > 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(head_k_dim));
  return in;
}

RowTiling row_tiling(int batch, int num_k_heads, int group_rows, int granule, int sms,
                     int ctas_per_sm, int min_splits) {
  // Enough CTAs for every SM to hold several: a replay CTA is latency-bound (gdn_params.cuh).
  const int want_ctas = ctas_per_sm * sms;
  const int ctas = std::max(1, batch * num_k_heads);
  const int max_splits = std::max(1, (group_rows + granule - 1) / granule);
  int splits = std::clamp(std::max((want_ctas + ctas - 1) / ctas, min_splits), 1, max_splits);
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
  bool generic = false;
  REPLAYSSM_RETURN_IF_ERROR(uses_generic_kernels(cache.config, &generic));
  return generic ? launch_generic(cache, work, stream) : launch_replay(cache, work, stream);
}

}  // namespace gdn

Status gdn_decode(StateCacheLayout& l, const GdnDecodeArgs& args, Stream s) {
  REPLAYSSM_RETURN_IF_ERROR(gdn::check_launch_shape(args.batch));
  gdn::ReplayWork work;
  work.decode = &args;
  work.slot_ids = args.slot_ids;
  work.batch = args.batch;
  work.first_layer = args.layer;
  bool generic = false;
  REPLAYSSM_RETURN_IF_ERROR(gdn::uses_generic_kernels(l.config, &generic));
  if (generic) return gdn::launch_generic(l, work, to_cuda(s));
  if (l.config.mode == DecodeMode::kEager) return gdn::launch_eager(l, args, to_cuda(s));
  return gdn::launch_replay(l, work, to_cuda(s));
}

}  // namespace replayssm::cuda
