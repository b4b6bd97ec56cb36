#pragma once
// Host side of the Mamba-2 kernels: what mamba2_decode.cu (the backend entry points) calls in
// mamba2_eager.cu, mamba2_replay.cu and mamba2_generic.cu.

#include <cuda_runtime.h>

#include "cuda/mamba2/mamba2_params.cuh"
#include "replayssm/status.h"

namespace replayssm::cuda::mamba2 {

/// Eager decode of one layer: on a one-copy cache (max_spec_tokens = 1) the state is updated in
/// place; on a cache with a state copy per draft the window reads the current copy once and
/// writes the state after each token into its own copy.
Status launch_eager(const Params& params, cudaStream_t stream);
/// Replay decode of one layer, or (num_tokens 0) an explicit fold of it, moving the layer's
/// fold cursor (cursors.cuh).
Status launch_replay(const Params& params, cudaStream_t stream);
/// Eager and replay (and explicit folds) for shapes the tuned kernels are not built for
/// (mamba2_generic.cu): any dstate and head_dim, at a fraction of the bandwidth.
Status launch_generic(const Params& params, cudaStream_t stream);

}  // namespace replayssm::cuda::mamba2
