#pragma once
// What the current GPU allows, read once per device for both layer kinds' launch choices.

#include "replayssm/status.h"

namespace replayssm::cuda {

struct DeviceLimits {
  int sms = 0;             ///< streaming multiprocessors
  int smem_per_block = 0;  ///< shared memory one block may opt in to, bytes
  int smem_per_sm = 0;     ///< shared memory of one SM, bytes
  int smem_reserved = 0;   ///< shared memory the system reserves per block, bytes
};

/// The current device's limits (each CUDA call checked; cached per device and thread, since
/// decodes ask on every launch, also inside graph capture, where the queries are allowed).
Status device_limits(DeviceLimits* out);

/// Both families' grids hold the batch in their y dimension: at most 65535 rows per launch.
Status check_grid_rows(int batch, const char* what);

}  // namespace replayssm::cuda
