// The prefix ops on a CPU cache (include/replayssm/prefix.h) that move bytes and cursors: read
// records, restore, fork, truncate. Materialize runs the fold's code: materialize.cpp.

#include <cstring>

#include "backend.h"
#include "prefix_backend.h"

namespace replayssm::cpu {

namespace {

// Copies `count` records between the ring of (layer, slot) from position `first` and
// `outside` (CacheRecords' layout), in the direction `to_ring` says.
void copy_records(const StateCacheLayout& l, int layer, int slot, std::uint32_t first,
                  const CacheRecords& outside, bool to_ring) {
  const SlotRuns ring = slot_runs(l, SlotPart::kRing);
  const SlotRuns out = slot_runs(l, SlotPart::kRing, &outside);
  for (int j = 0; j < outside.count; ++j) {
    const std::int64_t rec = l.ring_record(layer, slot, first + std::uint32_t(j));
    const std::int64_t at = std::int64_t{layer} * outside.count + j;
    for (int f = 0; f < ring.count; ++f) {
      char* in_ring = ring.run[f].base + rec * ring.run[f].bytes;
      char* in_out = out.run[f].base + at * out.run[f].bytes;
      const auto bytes = static_cast<std::size_t>(ring.run[f].bytes);
      if (to_ring) {
        std::memcpy(in_ring, in_out, bytes);
      } else {
        std::memcpy(in_out, in_ring, bytes);
      }
    }
  }
}

}  // namespace

void read_records(const StateCacheLayout& l, int slot, std::uint32_t first,
                  const CacheRecords& out) {
  for (int layer = 0; layer < l.config.num_layers; ++layer) {
    copy_records(l, layer, slot, first, out, /*to_ring=*/false);
  }
}

void restore(StateCacheLayout& l, const RestoreArgs& a) {
  // load_state writes every copy from the fp32 state (as a fold does) and moves the layer's
  // folded cursor to the slot's committed one: set that to the entry's position first.
  l.committed[a.slot] = a.position;
  for (int layer = 0; layer < l.config.num_layers; ++layer) {
    load_state(l, layer, a.slot, a.states + layer * l.state_elems());
    copy_records(l, layer, a.slot, a.position, a.records, /*to_ring=*/true);
    l.pending[l.layer_slot(layer, a.slot)] = 0;
  }
  l.committed[a.slot] = a.position + std::uint32_t(a.records.count);
}

void fork(StateCacheLayout& l, const ForkArgs& a) {
  const SlotRuns ckpt = slot_runs(l, SlotPart::kCheckpoint);
  const SlotRuns ring = slot_runs(l, SlotPart::kRing);
  const int layers = l.config.num_layers;
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < a.batch; ++b) {
    for (int layer = 0; layer < layers; ++layer) {
      const int src = a.src_slots[b], dst = a.dst_slots[b];
      if (src < 0) continue;
      // A shared checkpoint is not copied: the cursor loop below points dst at it.
      if (l.ckpt_source == nullptr) {
        copy_checkpoint_host(ckpt, l.layer_slot(layer, src), l.layer_slot(layer, dst));
      }
      const std::uint32_t first = l.folded[l.layer_slot(layer, src)];
      for (std::uint32_t pos = first; pos != a.positions[b]; ++pos) {
        for (int f = 0; f < ring.count; ++f) {
          const ByteRun& r = ring.run[f];
          std::memcpy(r.base + l.ring_record(layer, dst, pos) * r.bytes,
                      r.base + l.ring_record(layer, src, pos) * r.bytes, std::size_t(r.bytes));
        }
      }
    }
  }
  for (int b = 0; b < a.batch; ++b) {
    const int src = a.src_slots[b], dst = a.dst_slots[b];
    if (src < 0) continue;
    l.committed[dst] = a.positions[b];
    for (int layer = 0; layer < layers; ++layer) {
      l.folded[l.layer_slot(layer, dst)] = l.folded[l.layer_slot(layer, src)];
      l.pending[l.layer_slot(layer, dst)] = 0;
      if (l.ckpt_source != nullptr) share_checkpoint(l, layer, src, dst);
    }
  }
}

void truncate(StateCacheLayout& l, const TruncateArgs& a) {
  for (int b = 0; b < a.batch; ++b) {
    const int slot = a.slot_ids[b];
    if (slot < 0) continue;
    l.committed[slot] = a.positions[b];
    for (int layer = 0; layer < l.config.num_layers; ++layer) {
      l.pending[l.layer_slot(layer, slot)] = 0;
    }
  }
}

}  // namespace replayssm::cpu
