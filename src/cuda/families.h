#pragma once
// What the cache-level CUDA code (state_cache/) needs of each layer family's kernels. Both
// families provide the same entry points, with the same meaning; the decodes themselves are
// backend.h's cuda::mamba2_decode and cuda::gdn_decode.

#include <cuda_runtime.h>

#include <cstdint>

#include "replayssm/state_cache.h"
#include "replayssm/status.h"
#include "state_cache_layout.h"

namespace replayssm::cuda {

namespace mamba2 {
/// kOk when this build has kernels for the config on the current device, else kUnsupported
/// naming what is supported. Called once, when a cache is created.
Status can_implement(const StateCacheConfig& config);
/// Folds the committed history of layers [first_layer, first_layer + num_layers) for the rows'
/// slots (device ids; -1 = skip), then moves their `folded` cursors.
Status fold_layers(StateCacheLayout& cache, int first_layer, int num_layers,
                   const std::int32_t* slot_ids, int batch, cudaStream_t stream);
}  // namespace mamba2

namespace gdn {
Status can_implement(const StateCacheConfig& config);  ///< as mamba2::can_implement
Status fold_layers(StateCacheLayout& cache, int first_layer, int num_layers,
                   const std::int32_t* slot_ids, int batch, cudaStream_t stream);
}  // namespace gdn

}  // namespace replayssm::cuda
