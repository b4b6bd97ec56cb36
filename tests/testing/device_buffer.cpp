#include "testing/device_buffer.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "backend.h"

namespace replayssm::testing {

void throw_if_error(const Status& s, const char* what) {
  if (!s.is_ok()) throw std::runtime_error(std::string(what) + ": " + s.to_string());
}

CacheBuffer::CacheBuffer(Device device, std::size_t bytes) : device_(device), size_(bytes) {
  throw_if_error(memory_alloc(device, bytes == 0 ? 1 : bytes, &ptr_), "CacheBuffer alloc");
}

CacheBuffer::~CacheBuffer() {
  if (ptr_ != nullptr) memory_free(device_, ptr_);
}

CacheBuffer::CacheBuffer(CacheBuffer&& o) noexcept
    : device_(o.device_), ptr_(std::exchange(o.ptr_, nullptr)), size_(std::exchange(o.size_, 0)) {}

CacheBuffer& CacheBuffer::operator=(CacheBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) memory_free(device_, ptr_);
    device_ = o.device_;
    ptr_ = std::exchange(o.ptr_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

CacheBuffer CacheBuffer::from_host(Device device, const void* data, std::size_t bytes) {
  CacheBuffer b(device, bytes);
  if (bytes > 0) b.upload(data, bytes);
  return b;
}

void CacheBuffer::upload(const void* data, std::size_t bytes) {
  throw_if_error(memory_from_host(device_, ptr_, data, bytes), "CacheBuffer upload");
}

void CacheBuffer::download(void* data, std::size_t bytes) const {
  throw_if_error(memory_to_host(device_, data, ptr_, bytes), "CacheBuffer download");
}

std::vector<std::uint8_t> CacheBuffer::bytes() const {
  std::vector<std::uint8_t> out(size_);
  if (size_ > 0) download(out.data(), size_);
  return out;
}

}  // namespace replayssm::testing
