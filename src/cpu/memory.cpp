// Host memory for CPU state caches, and the Device::kCpu arm of the memory functions.

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

#include "backend.h"

namespace replayssm {

namespace {
constexpr std::size_t kAlign = 256;
// Buffers of a few MB and more (states, checkpoints, rings) go on 2 MB-aligned memory that
// the kernel may back with transparent huge pages: a decode step streams the whole cache, and
// with 4 KB pages it walks a new page every 4 KB.
constexpr std::size_t kHugePage = std::size_t{2} << 20;
}

Status memory_alloc(Device device, std::size_t bytes, void** ptr) {
  if (device == Device::kCuda) {
#if defined(REPLAYSSM_WITH_CUDA)
    return cuda::memory_alloc(bytes, ptr);
#else
    return unsupported("built without CUDA");
#endif
  }
  const std::size_t align = bytes >= kHugePage ? kHugePage : kAlign;
  const std::size_t rounded = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded == 0 ? align : rounded);
  if (p == nullptr) {
    return {StatusCode::kOutOfMemory, "host allocation of " + std::to_string(bytes) + " bytes failed"};
  }
  if (align == kHugePage) (void)madvise(p, rounded, MADV_HUGEPAGE);  // a hint; may be refused
  std::memset(p, 0, rounded);
  *ptr = p;
  return Status::ok();
}

void memory_free(Device device, void* ptr) {
  if (device == Device::kCuda) {
#if defined(REPLAYSSM_WITH_CUDA)
    cuda::memory_free(ptr);
#endif
    return;
  }
  std::free(ptr);
}

Status memory_zero(Device device, void* ptr, std::size_t bytes) {
  if (device == Device::kCuda) {
#if defined(REPLAYSSM_WITH_CUDA)
    return cuda::memory_zero(ptr, bytes);
#else
    return unsupported("built without CUDA");
#endif
  }
  std::memset(ptr, 0, bytes);
  return Status::ok();
}

Status memory_to_host(Device device, void* host_dst, const void* src, std::size_t bytes) {
  if (device == Device::kCuda) {
#if defined(REPLAYSSM_WITH_CUDA)
    return cuda::memory_copy(host_dst, src, bytes);
#else
    return unsupported("built without CUDA");
#endif
  }
  std::memcpy(host_dst, src, bytes);
  return Status::ok();
}

Status memory_from_host(Device device, void* dst, const void* host_src, std::size_t bytes) {
  return memory_to_host(device, dst, host_src, bytes);  // both directions are a plain copy
}

}  // namespace replayssm
