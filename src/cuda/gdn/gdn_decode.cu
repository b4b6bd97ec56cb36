// The CUDA backend's Gated DeltaNet entry points (backend.h): cuda::gdn_decode and
// cuda::gdn_fold. Arguments arrive validated (validate.cpp); what is checked here is only what
// this build's kernels can do, against the lists in gdn_params.cuh.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "backend.h"
#include "cuda/common/cache.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/dispatch.cuh"
#include "cuda/gdn/gdn_launch.h"
#include "cuda/gdn/gdn_params.cuh"

namespace replayssm::cuda {

namespace gdn {

namespace {

struct DeviceLimits {
  int sms = 0;
  int smem_per_block = 0;
};

// Read once per device: cudaDeviceGetAttribute is cheap but not free, and is called on every
// decode (also inside graph capture, where it is allowed).
DeviceLimits device_limits() {
  static thread_local int cached_device = -1;
  static thread_local DeviceLimits cached;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return {132, 48 * 1024};
  if (device != cached_device) {
    cudaDeviceGetAttribute(&cached.sms, cudaDevAttrMultiProcessorCount, device);
    cudaDeviceGetAttribute(&cached.smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                           device);
    cached_device = device;
  }
  return cached;
}

}  // namespace

Status can_implement(const StateCacheLayout& l, int num_tokens) {
  const StateCacheConfig& c = l.config;
  REPLAYSSM_RETURN_IF_ERROR(ActivationDTypes::dispatch(
      c.input_dtype, "gdn input dtype", [](auto) { return Status::ok(); }));
  if (c.mode == DecodeMode::kEager) {
    REPLAYSSM_RETURN_IF_ERROR(EagerStateDTypes::dispatch(
        c.state_dtype, "gdn eager state dtype", [](auto) { return Status::ok(); }));
  } else {
    REPLAYSSM_RETURN_IF_ERROR(CheckpointPrecisions::dispatch(
        c.checkpoint, "gdn checkpoint precision", [](auto) { return Status::ok(); }));
  }
  REPLAYSSM_RETURN_IF_ERROR(HeadKDims::dispatch(l.dims.cols, "gdn head_k_dim",
                                                [](auto) { return Status::ok(); }));
  if (l.dims.rows > kMaxHeadVDim) {
    return unsupported("unsupported gdn head_v_dim " + std::to_string(l.dims.rows) +
                       "; supported: 1 to " + std::to_string(kMaxHeadVDim));
  }
  if (num_tokens > 0) {
    REPLAYSSM_RETURN_IF_ERROR(WindowWidths::dispatch(num_tokens, "gdn window (num_tokens)",
                                                     [](auto) { return Status::ok(); }));
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

RowTiling row_tiling(int batch, int num_k_heads, int group_rows, int granule) {
  // Enough CTAs for every SM to hold several: a replay CTA is latency-bound (gdn_params.cuh).
  const int want_ctas = 8 * device_limits().sms;
  const int ctas = std::max(1, batch * num_k_heads);
  const int max_splits = std::max(1, (group_rows + granule - 1) / granule);
  int splits = std::clamp((want_ctas + ctas - 1) / ctas, 1, max_splits);
  RowTiling t;
  t.rows_per_split = (group_rows + splits - 1) / splits;
  t.rows_per_split = (t.rows_per_split + granule - 1) / granule * granule;
  t.splits = (group_rows + t.rows_per_split - 1) / t.rows_per_split;
  return t;
}

Status check_smem(int bytes, const char* what) {
  const int limit = device_limits().smem_per_block;
  if (bytes <= limit) return Status::ok();
  return unsupported(std::string(what) + " needs " + std::to_string(bytes) +
                     " bytes of shared memory per block for this cache's buffer_len and "
                     "max_spec_tokens (ring records staged: buffer_len - 1 + 2·max_spec_tokens)"
                     "; the device gives " + std::to_string(limit));
}

}  // namespace gdn

Status gdn_decode(StateCacheLayout& l, const GdnDecodeArgs& args) {
  REPLAYSSM_RETURN_IF_ERROR(gdn::can_implement(l, args.num_tokens));
  if (args.batch == 0) return Status::ok();
  if (l.config.mode == DecodeMode::kEager) return gdn::launch_eager(l, args);
  return gdn::launch_replay(l, &args, nullptr);
}

Status gdn_fold(StateCacheLayout& l, const FoldArgs& args) {
  if (l.config.mode == DecodeMode::kEager || args.batch == 0) return Status::ok();
  REPLAYSSM_RETURN_IF_ERROR(gdn::can_implement(l, 0));
  return gdn::launch_replay(l, nullptr, &args);
}

}  // namespace replayssm::cuda
