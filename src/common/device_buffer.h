#pragma once
// Memory on a cache's device (host memory for CPU caches, device memory for CUDA ones), owned
// and freed on scope exit: what the trace engine, the benches and the tests allocate for a
// decode's inputs and outputs (the tests wrap it to throw, testing/device_buffer.h). Built on backend.h's memory functions, so the same code serves
// both backends; every operation returns a Status.

#include <cstddef>
#include <utility>
#include <vector>

#include "backend.h"

namespace replayssm {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(device_, other.device_);
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) memory_free(device_, ptr_);
  }

  /// Zero-filled memory of `bytes` (at least one byte is allocated).
  Status allocate(Device device, std::size_t bytes) {
    if (ptr_ != nullptr) memory_free(device_, ptr_);
    ptr_ = nullptr;
    device_ = device;
    bytes_ = bytes;
    return memory_alloc(device, bytes == 0 ? 1 : bytes, &ptr_);
  }
  /// Copies bytes() (or the first `n`) from / to the host.
  Status upload(const void* host) { return upload(host, bytes_); }
  Status upload(const void* host, std::size_t n) {
    return memory_from_host(device_, ptr_, host, n);
  }
  Status download(void* host) const { return download(host, bytes_); }
  Status download(void* host, std::size_t n) const {
    return memory_to_host(device_, host, ptr_, n);
  }
  /// Allocates `v`'s size and copies it in.
  template <typename T>
  Status assign(Device device, const std::vector<T>& v) {
    REPLAYSSM_RETURN_IF_ERROR(allocate(device, v.size() * sizeof(T)));
    return upload(v.data());
  }

  template <typename T = void>
  [[nodiscard]] T* get() const {
    return static_cast<T*>(ptr_);
  }
  [[nodiscard]] std::size_t bytes() const { return bytes_; }
  [[nodiscard]] Device device() const { return device_; }

 private:
  Device device_ = Device::kCpu;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace replayssm
