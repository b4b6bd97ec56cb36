#include "bytes_model.h"

#include <algorithm>

#include "common/checkpoint_traits.h"

namespace replayssm {

double bytes_model_ring_record(const StateDims& d, DType input_dtype) {
  const double act = static_cast<double>(dtype_size(input_dtype));
  return act * (double(d.heads) * d.rows + double(d.key_heads) * d.cols) + 2.0 * 4.0 * d.heads;
}

int bytes_model_read_copy_elem(DecodeMode mode, DType eager_state, CheckpointPrecision p) {
  switch (mode) {
    case DecodeMode::kEager: return static_cast<int>(dtype_size(eager_state));
    case DecodeMode::kReplay: return checkpoint_traits(p).read_bytes();
  }
  return 0;
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
    const CheckpointTraits t = checkpoint_traits(c.checkpoint);
    const double read = t.read_bytes();                     // the copy outputs read
    const double scales = t.lo_row_scale ? rows * 4.0 : 0.0;  // fp8: one scale per row
    if (t.shared_copy()) {
      // One copy: every step reads it; a fold rewrites it (the fused fold reads it once).
      per_row.state_read = E * read;
      per_row.state_write = E * read * folds;
    } else {
      // Master + read copy: steps read the low copy (and its scales); a fold reads and writes
      // the master and writes the low copy.
      per_row.state_read = E * read + scales + E * 4.0 * folds;
      per_row.state_write = (E * (4.0 + read) + scales) * folds;
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
