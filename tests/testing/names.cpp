#include "testing/names.h"

namespace replayssm::testing {

std::string int_tag(const char* prefix, int value) {
  std::string s(prefix);
  s += std::to_string(value);
  return s;
}

std::string dtype_tag(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF8E4M3: return "F8E4M3";
    case DType::kU8: return "U8";
    case DType::kU32: return "U32";
  }
  return "X";
}

std::string precision_tag(CheckpointPrecision p) {
  switch (p) {
    case CheckpointPrecision::kFp32: return "Fp32";
    case CheckpointPrecision::kBf16: return "SharedBf16";
    case CheckpointPrecision::kFp32Bf16: return "Fp32Bf16";
    case CheckpointPrecision::kFp32Fp8: return "Fp32Fp8";
  }
  return "X";
}

std::string kind_tag(LayerKind kind) {
  switch (kind) {
    case LayerKind::kMamba2: return "Mamba2";
    case LayerKind::kGdn: return "Gdn";
  }
  return "X";
}

std::string device_tag(Device device) { return device == Device::kCuda ? "Cuda" : "Cpu"; }

std::string mode_tag(DecodeMode mode) {
  switch (mode) {
    case DecodeMode::kEager: return "Eager";
    case DecodeMode::kReplay: return "Replay";
  }
  return "X";
}

}  // namespace replayssm::testing
