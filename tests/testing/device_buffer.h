#pragma once
// Memory a test owns in a cache's memory space: host memory for CPU caches, device memory for
// CUDA ones: the library's DeviceBuffer (common/device_buffer.h), with errors thrown, as a
// test's setup wants. Decode calls, commit lists and the like are uploaded into it.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/device_buffer.h"
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

  static CacheBuffer from_host(Device device, const void* data, std::size_t bytes);
  template <typename T>
  static CacheBuffer from_vector(Device device, const std::vector<T>& v) {
    return from_host(device, v.data(), v.size() * sizeof(T));
  }
  void upload(const void* data, std::size_t bytes);
  void download(void* data, std::size_t bytes) const;
  std::vector<std::uint8_t> bytes() const;

  void* get() const { return buffer_.get(); }
  template <typename T>
  T* as() const {
    return buffer_.get<T>();
  }
  std::size_t size() const { return buffer_.bytes(); }

 private:
  DeviceBuffer buffer_;
};

}  // namespace replayssm::testing
