#pragma once
// Asynchronous global -> shared copies (cp.async, sm_80+), the way the decode kernels keep
// enough bytes in flight: a block streams its state through a ring of shared-memory tiles
// whose loads hold no registers, so the bytes in flight are bounded by shared memory rather
// than by the register file (the first replay kernel streamed into registers and, at 4 blocks
// of 128 threads per SM, moved 12-35% of copy bandwidth; see docs/BENCHMARKS_CUDA_MAMBA2.md).
//
// Group accounting is the caller's: every cp_async_commit() closes one group, and
// cp_async_wait<N>() returns once at most the N most recent groups are still in flight.

#include <cuda_runtime.h>

#include <cstdint>

namespace replayssm::cuda {

/// 16 bytes global -> shared, bypassing L1 (.cg): for data read once from shared memory.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  const auto s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

/// Asks for `bytes` of global memory to be brought into L2 (one bulk request, sm_90+; nothing
/// on older GPUs): bytes in flight that hold neither registers nor shared memory. Address and
/// length must be multiples of 16 bytes.
__device__ __forceinline__ void prefetch_l2(const void* gmem, std::uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(gmem), "r"(bytes) : "memory");
#else
  (void)gmem;
  (void)bytes;
#endif
}

/// Copies `bytes` from global to shared memory with the whole block (each thread takes every
/// blockDim.x-th piece). 16-byte cp.async when both ends and the length are 16-byte aligned;
/// otherwise plain 4- or 2-byte copies, which are complete when this returns (odd shapes in
/// tests: a head_dim of 20 bf16 values is 40 bytes). Does not commit a group.
__device__ __forceinline__ void copy_to_shared(void* smem, const void* gmem, int bytes) {
  const auto s = reinterpret_cast<std::uintptr_t>(smem);
  const auto g = reinterpret_cast<std::uintptr_t>(gmem);
  if (((s | g | std::uintptr_t(bytes)) & 15u) == 0) {
    for (int i = threadIdx.x; i < bytes / 16; i += blockDim.x) {
      cp_async_16(static_cast<char*>(smem) + i * 16, static_cast<const char*>(gmem) + i * 16);
    }
  } else if (((s | g | std::uintptr_t(bytes)) & 3u) == 0) {
    for (int i = threadIdx.x; i < bytes / 4; i += blockDim.x) {
      static_cast<std::uint32_t*>(smem)[i] = static_cast<const std::uint32_t*>(gmem)[i];
    }
  } else {
    for (int i = threadIdx.x; i < bytes / 2; i += blockDim.x) {
      static_cast<std::uint16_t*>(smem)[i] = static_cast<const std::uint16_t*>(gmem)[i];
    }
  }
}

}  // namespace replayssm::cuda
