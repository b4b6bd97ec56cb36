#pragma once
// What the device-agnostic code (state cache, op validation) needs from a backend's memory,
// and the entry points of each backend's ops. Arguments reaching a backend are validated, and
// the cache's configuration was accepted by that backend's can_implement at creation.

#include <cstddef>
#include <cstdint>

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "checkpoint_sharing.h"
#include "replayssm/status.h"
#include "state_cache_layout.h"

namespace replayssm {

/// Zero-filled memory on `device`, 256-byte aligned (synchronous).
Status memory_alloc(Device device, std::size_t bytes, void** ptr);
void memory_free(Device device, void* ptr);
/// Zeroes `height` runs of `width` bytes, `pitch` bytes apart, ordered on `stream`.
Status memory_zero_2d(Device device, void* ptr, std::size_t width, std::size_t pitch,
                      std::size_t height, Stream stream = kDefaultStream);
Status memory_zero(Device device, void* ptr, std::size_t bytes, Stream stream = kDefaultStream);
Status memory_set_byte(Device device, void* ptr, std::uint8_t value,
                       Stream stream = kDefaultStream);
/// Copies to host memory after the work on `stream`; returns when the copy is done.
Status memory_to_host(Device device, void* host_dst, const void* src, std::size_t bytes,
                      Stream stream = kDefaultStream);
/// Copies from host memory, ordered on `stream`; the host buffer may be reused on return.
Status memory_from_host(Device device, void* dst, const void* host_src, std::size_t bytes,
                        Stream stream = kDefaultStream);
/// kOk when `ptr` can be a buffer of a cache on `device` (CUDA: device memory of the current
/// device; CPU: any non-null pointer), else an error naming `what`.
Status memory_check_usable(Device device, const void* ptr, const char* what);

namespace cpu {
void mamba2_decode(StateCacheLayout& cache, const Mamba2DecodeArgs& args);
void gdn_decode(StateCacheLayout& cache, const GdnDecodeArgs& args);
/// Folds (layer, slot)'s committed history into its checkpoint; no-op when there is none.
void fold_committed(StateCacheLayout& cache, int layer, int slot);
void load_state(StateCacheLayout& cache, int layer, int slot, const float* state);
void export_state(const StateCacheLayout& cache, int layer, int slot, float* state);
void commit(StateCacheLayout& cache, const CommitArgs& args);
/// checkpoint_sharing.h; the slots were validated.
void release_checkpoints(StateCacheLayout& cache, const ReleaseArgs& args);
}  // namespace cpu

/// The CUDA backend (src/cuda/). A build without CUDA links cuda_unavailable.cpp instead, whose
/// functions return kUnsupported ("built without CUDA"), so callers need no #if.
namespace cuda {
bool device_present();
/// kOk when this build's kernels run `config` on the current device (shape, dtypes, precision,
/// widest window, shared memory), else kUnsupported naming what is supported; refuses when no
/// GPU is present.
Status can_implement(const StateCacheConfig& config);
Status memory_alloc(std::size_t bytes, void** ptr);  // zero-filled device memory
void memory_free(void* ptr);
Status memory_zero_2d(void* ptr, std::size_t width, std::size_t pitch, std::size_t height,
                      Stream stream);
Status memory_set_byte(void* ptr, std::uint8_t value, Stream stream);
Status memory_copy(void* dst, const void* src, std::size_t bytes, Stream stream);  // any kind
Status memory_check_usable(const void* ptr, const char* what);
Status mamba2_decode(StateCacheLayout& cache, const Mamba2DecodeArgs& args, Stream stream);
Status gdn_decode(StateCacheLayout& cache, const GdnDecodeArgs& args, Stream stream);
/// Folds the committed history of every layer of the given slots.
Status fold(StateCacheLayout& cache, const FoldArgs& args, Stream stream);
Status commit(StateCacheLayout& cache, const CommitArgs& args, Stream stream);
/// `state` may be host or device memory. Both synchronise the stream.
Status load_state(StateCacheLayout& cache, int layer, int slot, const float* state,
                  Stream stream);
Status export_state(StateCacheLayout& cache, int layer, int slot, float* state, Stream stream);
/// checkpoint_sharing.h: two launches (the copies, then the repointing), graph-capturable.
Status release_checkpoints(StateCacheLayout& cache, const ReleaseArgs& args, Stream stream);
}  // namespace cuda

}  // namespace replayssm
