// release_checkpoints on a CPU cache (checkpoint_sharing.h): the rule, row by row.

#include "backend.h"
#include "prefix_backend.h"

namespace replayssm::cpu {

namespace {

void release_row(StateCacheLayout& l, const SlotRuns& ckpt, int layer, int slot,
                 const ReleaseArgs& a) {
  if (!shares_checkpoint(l, layer, slot) || !release_applies(l, layer, slot, a)) return;
  const std::int64_t ls = l.layer_slot(layer, slot);
  const std::uint32_t source = l.ckpt_source[ls];
  if (source != 0 && release_drops_borrow(a)) {
    const std::int64_t lender = l.checkpoint_region(layer, slot);
    if (release_copies_borrowed(a)) copy_checkpoint_host(ckpt, lender, ls);
    l.ckpt_source[ls] = 0;
    --l.ckpt_borrowers[lender];
  }
  for (int x = 0; x < l.config.capacity && l.ckpt_borrowers[ls] != 0; ++x) {
    const std::int64_t lx = l.layer_slot(layer, x);
    if (l.ckpt_source[lx] != std::uint32_t(slot) + 1) continue;
    copy_checkpoint_host(ckpt, ls, lx);
    l.ckpt_source[lx] = 0;
    --l.ckpt_borrowers[ls];
  }
}

}  // namespace

void release_checkpoints(StateCacheLayout& l, const ReleaseArgs& a) {
  const SlotRuns ckpt = slot_runs(l, SlotPart::kCheckpoint);
  const int rows = a.slot_ids != nullptr ? a.batch : 1;
  for (int b = 0; b < rows; ++b) {
    const int slot = a.slot_ids != nullptr ? a.slot_ids[b] : a.slot;
    // A fork's pad row may name any dst (prefix.h): only allocated slots take part.
    if (slot < 0 || slot >= l.config.capacity || l.allocated[slot] == 0) continue;
    for (int layer = a.first_layer; layer < a.first_layer + a.num_layers; ++layer) {
      release_row(l, ckpt, layer, slot, a);
    }
  }
}

}  // namespace replayssm::cpu
