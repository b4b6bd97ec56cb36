#pragma once
// The conv window of conv caches (StateCacheConfig::conv_kernel > 0): the public load and
// export (state_cache.h), the CPU decodes' conv, and the copy of a window between slots. The
// CUDA kernels apply the same rule (common/causal_conv.h) inside their staging.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "replayssm/ops.h"
#include "replayssm/prefix.h"
#include "replayssm/status.h"
#include "state_cache_layout.h"

namespace replayssm {

/// Bytes of one layer's window outside the cache: [K - 1, conv_channels] in the input dtype.
std::size_t conv_window_bytes(const StateCacheLayout& l);

/// The K - 1 conv rows before position `end` of (layer, slot): written from `rows`, or read
/// into `rows` ([K - 1, conv_channels] in the input dtype, oldest first; host memory, or for a
/// CUDA cache also device memory). Synchronise the stream on CUDA caches.
Status write_conv_window(StateCacheLayout& l, int layer, int slot, std::uint32_t end,
                         const void* rows, Stream stream);
Status read_conv_window(const StateCacheLayout& l, int layer, int slot, std::uint32_t end,
                        void* rows, Stream stream);

namespace cpu {

/// A CPU decode's window after the conv, split into the parts the op takes, each dense
/// [batch, T, part channels] in the input dtype: Mamba-2 x, B, C = vec, key, query;
/// GDN q, k, v = query, key, vec. Pad rows are left zero. Reads only.
struct ConvOutputs {
  std::vector<std::byte> vec, key, query;
};
ConvOutputs conv_outputs(const StateCacheLayout& l, int layer, int batch, int T,
                         const std::int32_t* slot_ids, const ConvInputs& conv);

/// Writes the window's pre-conv inputs into the conv ring at committed + t (after the decode).
void append_conv_inputs(StateCacheLayout& l, int layer, int batch, int T,
                        const std::int32_t* slot_ids, const ConvInputs& conv);

/// Fork: the conv window at positions[b] of every layer of src_slots[b] onto dst_slots[b].
void fork_conv_window(StateCacheLayout& l, const ForkArgs& args);

}  // namespace cpu
}  // namespace replayssm
