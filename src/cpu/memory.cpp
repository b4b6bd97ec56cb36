// Host memory for CPU state caches, and the device-agnostic memory functions of backend.h:
// the Device::kCpu arm here, the Device::kCuda arm in src/cuda/common/memory.cu.

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
}  // namespace

Status memory_alloc(Device device, std::size_t bytes, void** ptr) {
  if (device == Device::kCuda) return cuda::memory_alloc(bytes, ptr);
  const std::size_t align = bytes >= kHugePage ? kHugePage : kAlign;
  const std::size_t rounded = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded == 0 ? align : rounded);
  if (p == nullptr) {
    return {StatusCode::kOutOfMemory,
            "host allocation of " + std::to_string(bytes) + " bytes failed"};
  }
  if (align == kHugePage) (void)madvise(p, rounded, MADV_HUGEPAGE);  // a hint; may be refused
  std::memset(p, 0, rounded);
  *ptr = p;
  return Status::ok();
}

void memory_free(Device device, void* ptr) {
  if (device == Device::kCuda) return cuda::memory_free(ptr);
  std::free(ptr);
}

Status memory_zero_2d(Device device, void* ptr, std::size_t width, std::size_t pitch,
                      std::size_t height, Stream stream) {
  if (device == Device::kCuda) return cuda::memory_zero_2d(ptr, width, pitch, height, stream);
  for (std::size_t i = 0; i < height; ++i) std::memset(static_cast<char*>(ptr) + i * pitch, 0, width);
  return Status::ok();
}

Status memory_zero(Device device, void* ptr, std::size_t bytes, Stream stream) {
  return memory_zero_2d(device, ptr, bytes, bytes, 1, stream);
}

Status memory_set_byte(Device device, void* ptr, std::uint8_t value, Stream stream) {
  if (device == Device::kCuda) return cuda::memory_set_byte(ptr, value, stream);
  *static_cast<std::uint8_t*>(ptr) = value;
  return Status::ok();
}

Status memory_to_host(Device device, void* host_dst, const void* src, std::size_t bytes,
                      Stream stream) {
  if (device == Device::kCuda) return cuda::memory_copy(host_dst, src, bytes, stream);
  std::memcpy(host_dst, src, bytes);
  return Status::ok();
}

Status memory_from_host(Device device, void* dst, const void* host_src, std::size_t bytes,
                        Stream stream) {
  return memory_to_host(device, dst, host_src, bytes, stream);  // both are a plain copy
}

Status memory_check_usable(Device device, const void* ptr, const char* what) {
  if (device == Device::kCuda) return cuda::memory_check_usable(ptr, what);
  if (ptr == nullptr) return invalid_argument(std::string(what) + " is null");
  return Status::ok();
}

}  // namespace replayssm
