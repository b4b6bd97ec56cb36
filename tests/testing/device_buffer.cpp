#include "testing/device_buffer.h"

#include <stdexcept>
#include <string>

namespace replayssm::testing {

void throw_if_error(const Status& s, const char* what) {
  if (!s.is_ok()) throw std::runtime_error(std::string(what) + ": " + s.to_string());
}

CacheBuffer::CacheBuffer(Device device, std::size_t bytes) {
  throw_if_error(buffer_.allocate(device, bytes), "CacheBuffer alloc");
}

CacheBuffer CacheBuffer::from_host(Device device, const void* data, std::size_t bytes) {
  CacheBuffer b(device, bytes);
  if (bytes > 0) b.upload(data, bytes);
  return b;
}

void CacheBuffer::upload(const void* data, std::size_t bytes) {
  throw_if_error(buffer_.upload(data, bytes), "CacheBuffer upload");
}

void CacheBuffer::download(void* data, std::size_t bytes) const {
  throw_if_error(buffer_.download(data, bytes), "CacheBuffer download");
}

std::vector<std::uint8_t> CacheBuffer::bytes() const {
  std::vector<std::uint8_t> out(size());
  if (!out.empty()) download(out.data(), out.size());
  return out;
}

}  // namespace replayssm::testing
