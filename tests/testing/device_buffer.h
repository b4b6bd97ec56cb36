#pragma once
// Memory a test owns in a cache's memory space: host memory for CPU caches, device memory for
// CUDA ones (through the library's own allocation calls, so the helper library needs no CUDA
// runtime). Decode calls, commit lists and the like are uploaded into it.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "replayssm/status.h"
#include "replayssm/types.h"

namespace replayssm::testing {

/// Throws std::runtime_error("<what>: <status>") when `s` is an error: setup steps of a test
/// that have no expected failure.
void throw_if_error(const Status& s, const char* what);

class CacheBuffer {
 public:
  CacheBuffer() = default;
  CacheBuffer(Device device, std::size_t bytes);
  ~CacheBuffer();
  CacheBuffer(CacheBuffer&& o) noexcept;
  CacheBuffer& operator=(CacheBuffer&& o) noexcept;
  CacheBuffer(const CacheBuffer&) = delete;
  CacheBuffer& operator=(const CacheBuffer&) = delete;

  static CacheBuffer from_host(Device device, const void* data, std::size_t bytes);
  template <typename T>
  static CacheBuffer from_vector(Device device, const std::vector<T>& v) {
    return from_host(device, v.data(), v.size() * sizeof(T));
  }
  void upload(const void* data, std::size_t bytes);
  void download(void* data, std::size_t bytes) const;
  std::vector<std::uint8_t> bytes() const;

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  std::size_t size() const { return size_; }

 private:
  Device device_ = Device::kCpu;
  void* ptr_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace replayssm::testing
