#include "bytes_model.h"

#include <algorithm>

namespace replayssm {

double bytes_model_ring_record(const StateDims& d, DType input_dtype) {
  const double act = static_cast<double>(dtype_size(input_dtype));
  return act * (double(d.heads) * d.rows + double(d.key_heads) * d.cols) + 2.0 * 4.0 * d.heads;
}

StepBytes bytes_model_step(const BytesModelCase& c) {
  const double E = static_cast<double>(c.dims.state_elems());
  const double rows = double(c.dims.heads) * c.dims.rows;
  const int T = std::max(c.spec_tokens, 1);
  StepBytes per_row;
  if (c.mode == DecodeMode::kEager) {
    const double s = static_cast<double>(dtype_size(c.state_dtype));
    per_row.state_read = E * s;
    per_row.state_write = E * s * T;
  } else {
    const int k = c.accepted > 0 ? std::min(c.accepted, T) : T;
    const int L = std::max(c.buffer_len, 1);
    const int cycle = (L + k - 1) / k;  // steps per fold cycle
    const double folds = 1.0 / cycle;   // folds per step
    switch (c.checkpoint) {
      case CheckpointPrecision::kFp32:
      case CheckpointPrecision::kBf16: {
        const double s = c.checkpoint == CheckpointPrecision::kFp32 ? 4.0 : 2.0;
        per_row.state_read = E * s;
        per_row.state_write = E * s * folds;
        break;
      }
      case CheckpointPrecision::kFp32Bf16:
      case CheckpointPrecision::kFp32Fp8: {
        const bool fp8 = c.checkpoint == CheckpointPrecision::kFp32Fp8;
        const double lo = fp8 ? 1.0 : 2.0;
        const double scales = fp8 ? rows * 4.0 : 0.0;
        per_row.state_read = E * lo + scales + E * 4.0 * folds;
        per_row.state_write = (E * (4.0 + lo) + scales) * folds;
        break;
      }
    }
    const double record = bytes_model_ring_record(c.dims, c.input_dtype);
    per_row.ring_write = record * T;
    per_row.ring_read = record * (k * (cycle - 1) / 2.0 + k);
  }
  const double b = c.batch;
  return {per_row.state_read * b, per_row.state_write * b, per_row.ring_read * b,
          per_row.ring_write * b};
}

}  // namespace replayssm
