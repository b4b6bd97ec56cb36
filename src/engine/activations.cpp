#include "engine/activations.h"

#include "common/activation_types.h"

namespace replayssm {

void activations_pack(DType dtype, const float* src, std::size_t n, void* dst) {
  with_activation_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* out = static_cast<T*>(dst);
    for (std::size_t i = 0; i < n; ++i) out[i] = from_float<T>(src[i]);
  });
}

void activations_unpack(DType dtype, const void* src, std::size_t n, float* dst) {
  with_activation_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(src);
    for (std::size_t i = 0; i < n; ++i) dst[i] = to_float(in[i]);
  });
}

}  // namespace replayssm
