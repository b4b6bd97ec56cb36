#include "engine/activations.h"

#include "common/numeric.h"

namespace replayssm {

namespace {

// Calls fn(T{}) with T the C++ type of an activation dtype.
template <typename Fn>
void with_activation_type(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32: fn(float{}); return;
    case DType::kBF16: fn(bf16_t{}); return;
    case DType::kF16: fn(f16_t{}); return;
    case DType::kF8E4M3:  // not activation dtypes: caches refuse them
    case DType::kU8:
    case DType::kU32:
      return;
  }
}

}  // namespace

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
