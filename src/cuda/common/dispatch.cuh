#pragma once
// Runtime values -> template parameters, from one list per axis.
//
// Each axis of what the CUDA backend supports (activation dtypes, state dtypes, checkpoint
// precisions, ...) is written once as a `Supported<...>` list. The same list drives the
// dispatch switch and the error text, so the two cannot drift:
//
//   using InputDTypes = Supported<DType::kF32, DType::kBF16>;
//   return InputDTypes::dispatch(cfg.input_dtype, "input dtype", [&](auto in) {
//     using input_t = dtype_t<in.value>;
//     return launch<input_t>(...);          // must return Status
//   });
//   // -> "unsupported input dtype f16; supported: f32, bf16" for anything else.

#include <string>
#include <type_traits>

#include "common/numeric.h"
#include "replayssm/status.h"
#include "replayssm/types.h"

namespace replayssm::cuda {

/// The C++ element type of a DType (numeric.h's storage structs; conversions in numeric.h).
template <DType D>
struct DTypeOf;
template <>
struct DTypeOf<DType::kF32> {
  using type = float;
};
template <>
struct DTypeOf<DType::kBF16> {
  using type = bf16_t;
};
template <>
struct DTypeOf<DType::kF16> {
  using type = f16_t;
};
template <>
struct DTypeOf<DType::kF8E4M3> {
  using type = fp8e4m3_t;
};
template <DType D>
using dtype_t = typename DTypeOf<D>::type;

inline std::string value_name(DType v) { return dtype_name(v); }
inline std::string value_name(CheckpointPrecision v) { return checkpoint_precision_name(v); }
inline std::string value_name(DecodeMode v) { return decode_mode_name(v); }
inline std::string value_name(int v) { return std::to_string(v); }

/// The supported values of one axis. `dispatch(v, what, f)` calls
/// `f(std::integral_constant<value_type, V>{})` for the V equal to v and returns its Status,
/// or kUnsupported "unsupported <what> <v>; supported: <names()>" when v is not listed.
template <auto... Vs>
struct Supported {
  using value_type = std::common_type_t<decltype(Vs)...>;

  static constexpr bool contains(value_type v) { return ((v == Vs) || ...); }
  /// The largest listed value.
  static constexpr value_type max() {
    const value_type values[] = {Vs...};
    value_type m = values[0];
    for (value_type v : values) m = v > m ? v : m;
    return m;
  }

  /// "f32, bf16"
  static std::string names() {
    std::string out;
    ((out += (out.empty() ? "" : ", ") + value_name(Vs)), ...);
    return out;
  }

  static Status error(value_type v, const char* what) {
    return unsupported(std::string("unsupported ") + what + " " + value_name(v) +
                       "; supported: " + names());
  }

  template <typename F>
  static Status dispatch(value_type v, const char* what, F&& f) {
    return dispatch_from<Vs...>(v, what, f);
  }

 private:
  template <auto V, auto... Rest, typename F>
  static Status dispatch_from(value_type v, const char* what, F& f) {
    if (v == V) return f(std::integral_constant<value_type, V>{});
    if constexpr (sizeof...(Rest) > 0) {
      return dispatch_from<Rest...>(v, what, f);
    } else {
      return error(v, what);
    }
  }
};

/// Activation dtypes (inputs, ring records, outputs) the CUDA kernels are built for. f16
/// activations would double every kernel's instantiations for a dtype no target model uses.
using ActivationDTypes = Supported<DType::kF32, DType::kBF16>;

/// Eager state dtypes (state_cache.h: f32, bf16, f16), for whole-state copies and eager kernels.
using StateDTypes = Supported<DType::kF32, DType::kBF16, DType::kF16>;

/// Checkpoint precisions of replay caches (ALGORITHM.md §6): all four.
using CheckpointPrecisions =
    Supported<CheckpointPrecision::kFp32, CheckpointPrecision::kBf16,
              CheckpointPrecision::kFp32Bf16, CheckpointPrecision::kFp32Fp8>;

}  // namespace replayssm::cuda
