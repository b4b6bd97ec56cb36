#pragma once
// Pieces of parameterised test names. A case struct prints itself with PrintTo (every axis that
// varies, as [A-Za-z0-9_] only); INSTANTIATE_TEST_SUITE_P names its cases with
// ::testing::PrintToStringParamName(), so a test's name and its failure message
// ("where GetParam() = ...") read the same.

#include <string>

#include "replayssm/types.h"

namespace replayssm::testing {

/// prefix + decimal value ("L16") for test names. (Out of line: GCC 12 warns falsely about
/// "L" + std::to_string(v) inlined at -O3, PR 105651.)
std::string int_tag(const char* prefix, int value);
/// "f32" → "F32" etc. for test names.
std::string dtype_tag(DType dtype);
std::string precision_tag(CheckpointPrecision precision);
/// "Mamba2" or "Gdn".
std::string kind_tag(LayerKind kind);
/// "Eager" or "Replay".
std::string mode_tag(DecodeMode mode);
/// "Cpu" or "Cuda": a CUDA case's name holds "Cuda" (CTest's CUDA_CASES filters on it).
std::string device_tag(Device device);

}  // namespace replayssm::testing
