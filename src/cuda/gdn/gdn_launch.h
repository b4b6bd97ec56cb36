#pragma once
// Host side of the GDN kernels: what gdn_decode.cu (the backend entry points) calls in
// gdn_eager.cu and gdn_replay.cu, and the launch-shape helpers they share.

#include <cuda_runtime.h>

#include <cstdint>

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "replayssm/status.h"
#include "cuda/gdn/gdn_params.cuh"
#include "cuda/gdn/gdn_staging.h"
#include "state_cache_layout.h"

namespace replayssm::cuda::gdn {

/// The decode's inputs as the kernels take them (q_scale resolved as the CPU backend does).
GdnInputs input_args(const GdnDecodeArgs& args, int head_k_dim);

/// The shared memory of a replay block for a window of `num_tokens` (0: a fold), staging
/// `heads` value heads (ReplaySmem::heads), or all of a key head's.
ReplaySmem replay_smem(const StateCacheConfig& config, int num_tokens);
ReplaySmem replay_smem(const StateCacheConfig& config, int num_tokens, int heads);

/// What one replay launch serves: one layer's decode (`decode` set), or a fold of layers
/// [first_layer, first_layer + num_layers) of the rows' slots (`decode` null).
struct ReplayWork {
  const GdnDecodeArgs* decode = nullptr;
  const std::int32_t* slot_ids = nullptr;
  int batch = 0;
  int first_layer = 0;
  int num_layers = 1;
};

/// The generic kernels (gdn_generic.cu) hold a state row over a warp, kGenericPerLane columns
/// per lane: any head_k_dim up to kGenericMaxK.
constexpr int kGenericMaxK = 512;
constexpr int kGenericPerLane = kGenericMaxK / 32;

/// Whether a cache takes the generic kernels: a head size, window width or staging the tuned
/// kernels are not built for (the tuned ones: head_k_dim in HeadKDims, head_v_dim up to
/// kMaxHeadVDim, windows in WindowWidths, staging within the device's shared memory).
Status uses_generic_kernels(const StateCacheConfig& config, bool* generic);

/// Shared memory of a generic replay block for a window of `num_tokens` (0: a fold).
int generic_smem_bytes(const StateCacheConfig& config, int num_tokens);

/// Decode of one layer (eager or replay) or a fold of layers on the generic kernels; each launch
/// moves its own fold cursors (cursors.cuh).
Status launch_generic(StateCacheLayout& cache, const ReplayWork& work, cudaStream_t stream);

/// Eager decode of one layer: on a one-copy cache (max_spec_tokens = 1) the state is updated in
/// place; on a cache with a state copy per draft the window reads the current copy once and
/// writes the state after each token into its own copy.
Status launch_eager(StateCacheLayout& cache, const GdnDecodeArgs& args, cudaStream_t stream);

/// Replay decode of one layer or a fold of layers (ReplayWork), in one launch that also moves
/// the fold cursors (state_cache/cursors.cuh).
Status launch_replay(StateCacheLayout& cache, const ReplayWork& work, cudaStream_t stream);

}  // namespace replayssm::cuda::gdn
