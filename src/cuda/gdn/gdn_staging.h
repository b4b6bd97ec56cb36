#pragma once
// How a GDN launch spreads a key head's rows over CTAs, and what each replay CTA stages: host
// arithmetic only (no CUDA types), so that tests check the choices without a GPU.

#include "cuda/common/device_limits.cuh"
#include "replayssm/state_cache.h"

namespace replayssm::cuda::gdn {

/// Where a CTA's rows lie: rows [split·rows_per_split, ...) of its key head's G·V rows.
struct RowTiling {
  int splits = 1;
  int rows_per_split = 0;
};

/// Splits a key head's rows over several CTAs when batch·num_k_heads CTAs would leave SMs
/// idle (small batches): up to `ctas_per_sm` CTAs for each of the device's `sms`; `granule`
/// rows at least per CTA.
RowTiling row_tiling(int batch, int num_k_heads, int group_rows, int granule, int sms,
                     int ctas_per_sm, int min_splits);

/// How a replay launch lays out its CTAs: the row tiling, and the value heads each CTA
/// stages (gdn_params.cuh, ReplaySmem::heads).
struct ReplayStaging {
  RowTiling tiling;
  int heads = 1;
};

/// The staging of a replay launch of `batch` rows and `num_tokens` (0: a fold; `conv`: a conv
/// cache's decode, which convolves every head's channels) on a device of `limits`
/// (gdn_params.cuh, kReplayResidentFloor). Where fewer than the floor of CTAs staging all G
/// value heads fit an SM, each CTA stages only its split's heads, over further splits while
/// still fewer fit; else a CTA stages only its split's heads in verify windows, and in
/// single-token steps where that makes the whole launch resident at once.
ReplayStaging replay_staging(const StateCacheConfig& config, int batch, int num_tokens, bool conv,
                             const DeviceLimits& limits);

}  // namespace replayssm::cuda::gdn
