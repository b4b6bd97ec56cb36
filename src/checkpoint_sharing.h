#pragma once
// Shared checkpoints (StateCacheConfig::share_forked_checkpoints): a fork lets its copy read
// its source's checkpoint rows (ckpt_source) instead of copying them, so that forking moves
// only ring records and cursors (copy on fold).
//
// The invariant every kernel relies on: when an op writes the checkpoint of (layer, slot), that
// slot reads its own rows and no other slot reads them. `release_checkpoints` establishes it,
// before the op, for the rows the op is about to write:
//   - a slot that borrows takes its own copy of what it reads (before a fold, which then
//     continues from it), or just stops borrowing (before an overwrite: load, restore, free);
//   - a slot that lends first gives each borrower its own copy.
// A fork onto a slot hands off what that slot lends (kHandOff), and the fork itself then
// repoints the slot. So a fork's checkpoint is copied at most once, when either side first
// writes its checkpoint (in parallel sampling both fold on the same step: the copies then cost
// what copying at the fork would have), and never when the copy is freed first. Decodes that
// fold nothing shared copy nothing. A lender never borrows: forking a copy names the first
// source, so one release pass suffices.

#include <cstdint>

#include "common/host_device.h"
#include "replayssm/status.h"
#include "replayssm/types.h"
#include "state_cache_layout.h"

namespace replayssm {

enum class ReleaseFor : std::uint8_t {
  kFold,       ///< a decode or explicit fold of num_tokens (rows whose fold is due)
  kOverwrite,  ///< the rows' checkpoints are about to be replaced (load, restore, free)
  kHandOff,    ///< fork destinations: hand off what they lend; the fork repoints them
};

struct ReleaseArgs {
  int first_layer = 0;
  int num_layers = 0;
  int batch = 0;
  const std::int32_t* slot_ids = nullptr;  ///< [batch], cache memory; -1 = pad row
  int slot = -1;  ///< when slot_ids is null: one slot, checked by the host
  ReleaseFor why = ReleaseFor::kFold;
  int num_tokens = 0;  ///< kFold: the decode's window (0 = an explicit fold)
};

/// Whether (layer, slot) borrows or lends a checkpoint.
REPLAYSSM_HD bool shares_checkpoint(const StateCacheLayout& l, int layer, int slot) {
  const std::int64_t ls = l.layer_slot(layer, slot);
  return l.ckpt_source[ls] != 0 || l.ckpt_borrowers[ls] != 0;
}

/// Whether the op that `a` precedes writes (layer, slot)'s checkpoint: the rule of the decode
/// kernels' fold (state_cache_layout.h), or always for an overwrite.
REPLAYSSM_HD bool release_applies(const StateCacheLayout& l, int layer, int slot,
                                         const ReleaseArgs& a) {
  return a.why != ReleaseFor::kFold || l.fold_due(l.unfolded(layer, slot), a.num_tokens);
}

/// Whether a borrowing row drops its borrow (and takes its own copy first when `copy`).
REPLAYSSM_HD bool release_drops_borrow(const ReleaseArgs& a) {
  return a.why != ReleaseFor::kHandOff;
}
REPLAYSSM_HD bool release_copies_borrowed(const ReleaseArgs& a) {
  return a.why == ReleaseFor::kFold;
}

/// What a fork does to (layer, dst) on a sharing cache, after the kHandOff release: dst reads
/// what src reads (src's lender, or src itself), and stops borrowing from whatever it read
/// before. Atomic on the device, where several rows may fork one source.
REPLAYSSM_HD void share_checkpoint(const StateCacheLayout& l, int layer, int src, int dst) {
  const int owner = l.checkpoint_owner(layer, src);
  if (owner == dst) return;  // only a misuse (dst the src of another row) gets here
  std::uint32_t* source = l.ckpt_source + l.layer_slot(layer, dst);
  std::uint32_t* owner_count = l.ckpt_borrowers + l.layer_slot(layer, owner);
#if defined(__CUDA_ARCH__)
  const int before = l.lender_slot(atomicExch(source, std::uint32_t(owner) + 1));
  atomicAdd(owner_count, 1u);
  if (before >= 0) atomicSub(l.ckpt_borrowers + l.layer_slot(layer, before), 1u);
#else
  const int before = l.lender_slot(*source);
  *source = std::uint32_t(owner) + 1;
  ++*owner_count;
  if (before >= 0) --l.ckpt_borrowers[l.layer_slot(layer, before)];
#endif
}

/// Releases the rows of `a` (layer range × slots) on the cache's backend; nothing when the
/// cache does not share checkpoints. CUDA: ordered on `stream`, graph-capturable; rows whose
/// slot is out of range or not allocated are skipped, as the op after it skips them.
Status release_checkpoints(StateCacheLayout& l, const ReleaseArgs& a, Stream stream);

/// The same for one slot named by the host, over `num_layers` layers from `first_layer`.
Status release_slot_checkpoints(StateCacheLayout& l, int slot, int first_layer, int num_layers,
                                ReleaseFor why, Stream stream);

}  // namespace replayssm
