#pragma once
// Argument checks shared by the state cache and the ops. Each returns a Status whose message
// names the offending value; nothing is written before all checks of a call have passed.

#include <cstdint>

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "replayssm/status.h"
#include "state_cache_layout.h"

namespace replayssm {

/// kOk for a non-null pointer, else "<op>: <name> is null".
Status validate_not_null(const void* ptr, const char* op, const char* name);
Status validate_layer(const StateCache& cache, int layer);
/// An allocated slot id in [0, capacity).
Status validate_slot(const StateCache& cache, int slot);
/// batch >= 0 and slot_ids non-null (when batch > 0). For a CPU cache also: every id is -1 or
/// an allocated slot, and no slot appears twice. For a CUDA cache the ids are device memory:
/// the kernels skip rows whose slot is out of range or not allocated (graph capture forbids a
/// host copy here).
Status validate_batch_slots(const StateCache& cache, int batch, const std::int32_t* slot_ids);
/// kOk unless (layer, slot) of a cache that holds windows (replay, eager with T > 1) holds an
/// uncommitted window (reads one cursor).
Status validate_no_pending(const StateCache& cache, int layer, int slot, const char* what,
                           Stream stream);
/// Every element of a host fp32 state of `layout`'s shape is finite.
Status validate_finite_state(const StateCacheLayout& layout, const float* host_state);
Status validate_commit(const StateCache& cache, const CommitArgs& args);
/// What varies per decode call: layer, batch, window, pointers; on a CPU cache (host memory) also
/// the slot ids, that no row's layer holds an uncommitted window, and the values that
/// are cheap to check (Mamba-2: A < 0, D and dt_bias finite; GDN: g <= 0, beta in [0, 1]).
Status validate_mamba2_decode(const StateCache& cache, const Mamba2DecodeArgs& args);
Status validate_gdn_decode(const StateCache& cache, const GdnDecodeArgs& args);

}  // namespace replayssm
