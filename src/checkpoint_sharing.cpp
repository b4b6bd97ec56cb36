// release_checkpoints (checkpoint_sharing.h): hands the call to the cache's backend.

#include "checkpoint_sharing.h"

#include "backend.h"

namespace replayssm {

Status release_checkpoints(StateCacheLayout& l, const ReleaseArgs& a, Stream stream) {
  if (l.ckpt_source == nullptr || a.num_layers == 0) return Status::ok();
  if (a.slot_ids != nullptr && a.batch == 0) return Status::ok();
  switch (l.config.device) {
    case Device::kCpu:
      cpu::release_checkpoints(l, a);
      return Status::ok();
    case Device::kCuda: return cuda::release_checkpoints(l, a, stream);
  }
  return invalid_argument("unknown device");
}

Status release_slot_checkpoints(StateCacheLayout& l, int slot, int first_layer, int num_layers,
                                ReleaseFor why, Stream stream) {
  return release_checkpoints(l,
                             {.first_layer = first_layer, .num_layers = num_layers, .batch = 1,
                              .slot = slot, .why = why},
                             stream);
}

}  // namespace replayssm
