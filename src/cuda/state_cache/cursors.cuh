#pragma once
// Cursor updates on the device, shared by both layer kinds' decode kernels.

#include <cuda_runtime.h>

#include <cstdint>

#include "replayssm/status.h"
#include "state_cache_layout.h"

namespace replayssm::cuda {

/// The second launch of every replay decode (and explicit fold) of one layer: for each row
/// whose fold was due (StateCacheLayout::fold_due with this num_tokens), folded = committed.
///
/// Why a launch of its own: the fold is fused into the decode per head, and every head's block
/// decides from `folded`; one block moving the cursor while another has yet to read it would
/// split the decision. Costs one tiny kernel (~2 µs of a graph) per layer step.
Status advance_folded(const StateCacheLayout& cache, int layer, const std::int32_t* slot_ids,
                      int batch, int num_tokens, cudaStream_t stream);

}  // namespace replayssm::cuda
