#pragma once
// The cache API with host-side vectors, for tests: creating a cache and taking slots (throwing
// on failure: setup that has no expected error), and commit, fold and export with their lists
// copied into the cache's memory.

#include <cstdint>
#include <memory>
#include <vector>

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "replayssm/status.h"

namespace replayssm::testing {

/// Creates a cache, throwing std::runtime_error on failure (tests only).
std::unique_ptr<StateCache> create_cache(const StateCacheConfig& config);
int allocate_slot(StateCache& cache);

/// state_cache_commit with host vectors (copied into cache memory).
Status commit(StateCache& cache, const std::vector<std::int32_t>& slot_ids,
              const std::vector<std::int32_t>& accepted);
Status fold(StateCache& cache, const std::vector<std::int32_t>& slot_ids);

/// state_cache_export_state into `out`, sized to the cache's state.
Status export_state(StateCache& cache, int layer, int slot, std::vector<float>* out);

}  // namespace replayssm::testing
