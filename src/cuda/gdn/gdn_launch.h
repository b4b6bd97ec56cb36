#pragma once
// Host side of the GDN kernels: what gdn_decode.cu (the backend entry points) calls in
// gdn_eager.cu and gdn_replay.cu, and the launch-shape helpers they share.

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "replayssm/status.h"
#include "cuda/gdn/gdn_params.cuh"
#include "state_cache_layout.h"

namespace replayssm::cuda::gdn {

/// kOk when this build has kernels for the cache's shape, dtypes and a window of
/// `num_tokens` (0: an explicit fold), else kUnsupported naming what is supported.
Status can_implement(const StateCacheLayout& cache, int num_tokens);

/// The decode's inputs as the kernels take them (q_scale resolved as the CPU backend does).
GdnInputs input_args(const GdnDecodeArgs& args, int head_k_dim);

/// Splits a key head's rows over several CTAs when batch·num_k_heads CTAs would leave SMs
/// idle (small batches); `granule` rows at least per CTA.
RowTiling row_tiling(int batch, int num_k_heads, int group_rows, int granule);

/// kUnsupported when a CTA would need more shared memory than the device gives one.
Status check_smem(int bytes, const char* what);

/// Eager decode of one layer (T = 1): the state is updated in place.
Status launch_eager(StateCacheLayout& cache, const GdnDecodeArgs& args);

/// Replay decode of one layer (args, fold null) or explicit fold of every layer of the slots
/// (fold, args null); then the cursor move (advance_folded).
Status launch_replay(StateCacheLayout& cache, const GdnDecodeArgs* args, const FoldArgs* fold);

}  // namespace replayssm::cuda::gdn
