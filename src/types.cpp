#include "replayssm/status.h"
#include "replayssm/types.h"

namespace replayssm {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kOutOfMemory: return "out of memory";
    case StatusCode::kCudaError: return "cuda error";
    case StatusCode::kIoError: return "i/o error";
    case StatusCode::kInternal: return "internal error";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kF8E4M3: return 1;
    case DType::kU8: return 1;
    case DType::kU32: return 4;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kF8E4M3: return "f8e4m3";
    case DType::kU8: return "u8";
    case DType::kU32: return "u32";
  }
  return "?";
}

const char* device_name(Device device) { return device == Device::kCpu ? "cpu" : "cuda"; }
const char* layer_kind_name(LayerKind kind) {
  switch (kind) {
    case LayerKind::kMamba2: return "mamba2";
    case LayerKind::kGdn: return "gdn";
  }
  return "?";
}
const char* decode_mode_name(DecodeMode mode) {
  return mode == DecodeMode::kEager ? "eager" : "replay";
}

const char* checkpoint_precision_name(CheckpointPrecision precision) {
  switch (precision) {
    case CheckpointPrecision::kFp32: return "fp32";
    case CheckpointPrecision::kBf16: return "bf16";
    case CheckpointPrecision::kFp32Bf16: return "fp32+bf16";
    case CheckpointPrecision::kFp32Fp8: return "fp32+fp8";
  }
  return "?";
}

bool parse_checkpoint_precision(const std::string& text, CheckpointPrecision* out) {
  for (auto p : {CheckpointPrecision::kFp32, CheckpointPrecision::kBf16,
                 CheckpointPrecision::kFp32Bf16, CheckpointPrecision::kFp32Fp8}) {
    if (text == checkpoint_precision_name(p)) {
      *out = p;
      return true;
    }
  }
  return false;
}

}  // namespace replayssm
