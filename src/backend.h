#pragma once
// What the device-agnostic code (state cache, op validation) needs from a backend's memory,
// and the entry points of each backend's ops. Arguments reaching a backend are validated.

#include <cstddef>
#include <cstdint>

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "replayssm/status.h"
#include "state_cache_layout.h"

namespace replayssm {

/// Zero-filled memory on `device`, 256-byte aligned.
Status memory_alloc(Device device, std::size_t bytes, void** ptr);
void memory_free(Device device, void* ptr);
Status memory_zero(Device device, void* ptr, std::size_t bytes);
Status memory_to_host(Device device, void* host_dst, const void* src, std::size_t bytes);
Status memory_from_host(Device device, void* dst, const void* host_src, std::size_t bytes);

namespace cpu {
void mamba2_decode(StateCacheLayout& cache, const Mamba2DecodeArgs& args);
void gdn_decode(StateCacheLayout& cache, const GdnDecodeArgs& args);
/// Folds (layer, slot)'s committed history into its checkpoint; no-op when there is none.
void fold_committed(StateCacheLayout& cache, int layer, int slot);
void load_state(StateCacheLayout& cache, int layer, int slot, const float* state);
void export_state(const StateCacheLayout& cache, int layer, int slot, float* state);
void commit(StateCacheLayout& cache, const CommitArgs& args);
}  // namespace cpu

#if defined(REPLAYSSM_WITH_CUDA)
namespace cuda {
bool device_present();
Status memory_alloc(std::size_t bytes, void** ptr);  // zero-filled device memory
void memory_free(void* ptr);
Status memory_zero(void* ptr, std::size_t bytes);
Status memory_copy(void* dst, const void* src, std::size_t bytes);  // cudaMemcpyDefault
Status mamba2_decode(StateCacheLayout& cache, const Mamba2DecodeArgs& args);
Status gdn_decode(StateCacheLayout& cache, const GdnDecodeArgs& args);
/// Folds the committed history of every layer of the given slots (dispatches on kind).
Status fold(StateCacheLayout& cache, const FoldArgs& args);
Status mamba2_fold(StateCacheLayout& cache, const FoldArgs& args);
Status gdn_fold(StateCacheLayout& cache, const FoldArgs& args);
Status commit(StateCacheLayout& cache, const CommitArgs& args);
Status load_state(StateCacheLayout& cache, int layer, int slot, const float* host_state);
Status export_state(StateCacheLayout& cache, int layer, int slot, float* host_state);
}  // namespace cuda
#endif

}  // namespace replayssm
