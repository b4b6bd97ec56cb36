// Materialize on a CPU cache (include/replayssm/prefix.h): the fold's own code (fold.cpp) run
// on a layout whose checkpoint is the caller's buffer, so that its states are what a fold to
// the same position stores, bit for bit. Built once per instruction-set variant, as the fold
// is (cpu/isa.h), and dispatched with it: both run the same variant's arithmetic.

#include <vector>

#include "backend.h"
#include "cpu_common.h"
#include "prefix_backend.h"

REPLAYSSM_CPU_BEGIN

namespace {

// The buffer specs of `l` with their ring part, looked up once per call.
std::vector<CacheBufferSpec> ring_specs(const StateCacheLayout& l) {
  std::vector<CacheBufferSpec> out;
  for (const CacheBufferSpec& s : cache_buffer_specs(l.config)) {
    if (slot_part(s.id) == SlotPart::kRing) out.push_back(s);
  }
  return out;
}

// A one-layer, one-slot layout whose ring is (layer, slot)'s ring in `l` and whose checkpoint
// is an fp32 master at `out` ([heads, rows, cols]) with no other copy: fold_heads on it reads
// the cache's records and folds into `out`, leaving the cache as it was.
StateCacheLayout fold_into(const StateCacheLayout& l, const std::vector<CacheBufferSpec>& ring,
                           int layer, int slot, float* out) {
  StateCacheLayout v;
  v.config = l.config;
  v.config.num_layers = 1;
  v.config.capacity = 1;
  v.config.checkpoint = CheckpointPrecision::kFp32;
  v.dims = l.dims;
  v.ckpt = checkpoint_traits(v.config.checkpoint);
  v.ring_capacity = l.ring_capacity;
  v.ckpt_hi = out;
  for (const CacheBufferSpec& s : ring) {
    char* base = static_cast<char*>(layout_buffer(l, s.id));
    bind_layout_buffer(v, s.id, base + l.layer_slot(layer, slot) * slot_region_bytes(s));
  }
  return v;
}

}  // namespace

void materialize(const StateCacheLayout& l, const MaterializeArgs& a) {
  const std::vector<CacheBufferSpec> ring = ring_specs(l);
  const int layers = l.config.num_layers, groups = l.dims.key_heads;
  const int heads_per_key = l.dims.heads_per_key();
  const std::int64_t head_elems = std::int64_t{l.dims.rows} * l.dims.cols;
  // The heads of one key group together: they share the conversion of the records' keys.
#pragma omp parallel for collapse(3) schedule(static)
  for (int b = 0; b < a.batch; ++b) {
    for (int layer = 0; layer < layers; ++layer) {
      for (int g = 0; g < groups; ++g) {
        const int slot = a.slot_ids[b];
        if (slot < 0) continue;
        float* out = a.states + (std::int64_t{b} * layers + layer) * l.state_elems();
        const int h0 = g * heads_per_key, h1 = h0 + heads_per_key;
        for (int h = h0; h < h1; ++h) {
          const CheckpointHead c = checkpoint_head(l, layer, slot, h);
          for (int r = 0; r < l.dims.rows; ++r) {
            read_master_row(c, r, out + h * head_elems + std::int64_t{r} * l.dims.cols);
          }
        }
        const std::uint32_t first = l.folded[l.layer_slot(layer, slot)];
        const StateCacheLayout target = fold_into(l, ring, layer, slot, out);
        fold_heads(target, 0, 0, h0, h1, first, a.positions[b] - first);
      }
    }
  }
}

REPLAYSSM_CPU_END
