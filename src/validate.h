#pragma once
// Argument checks shared by the state cache and the ops. Each returns a Status whose message
// names the offending value; nothing is written before all checks of a call have passed.

#include <cstdint>

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "replayssm/status.h"
#include "state_cache_layout.h"

namespace replayssm {

Status validate_layer(const StateCache& cache, int layer);
/// An allocated slot id in [0, capacity).
Status validate_slot(const StateCache& cache, int slot);
/// batch >= 0 and slot_ids non-null (when batch > 0). For a CPU cache also: every id is -1 or
/// an allocated slot, and no slot appears twice. For a CUDA cache the ids are device memory:
/// the kernels skip rows whose slot is out of range or not allocated (graph capture forbids a
/// host copy here).
Status validate_batch_slots(const StateCache& cache, int batch, const std::int32_t* slot_ids);
Status validate_no_pending(const StateCache& cache, int slot, const char* what);
Status validate_commit(const StateCache& cache, const CommitArgs& args);
Status validate_mamba2_decode(const StateCache& cache, const Mamba2DecodeArgs& args);
Status validate_gdn_decode(const StateCache& cache, const GdnDecodeArgs& args);

/// Zeroes every layer's state (or checkpoint copies and ring) of `slot`, its cursors, and
/// marks it allocated.
Status reset_slot(StateCacheLayout& cache, int slot);

}  // namespace replayssm
