// Fold (ALGORITHM.md §5): replay a slot's committed ring records into its checkpoint. This is
// the only place a replay cache writes state. The master copy is read and written in fp32;
// the low copy is refreshed by rounding, so its rounding never enters a later update (§6).

#include <cmath>
#include <cstring>
#include <vector>

#include "backend.h"
#include "cpu_common.h"

namespace replayssm::cpu {

namespace {

// Folds run inside a decode's per-(row, group or head) work, which holds scratch buffers
// 0..kFoldScratch-1 across the fold: the fold takes the ones above.
constexpr int kFoldScratch = 8;

// 16 floats as one GCC/Clang vector: one AVX-512 register, two AVX2 ones, four SSE ones,
// whatever the build targets, without intrinsics.
constexpr int kLanes = 16;
using Lanes = float __attribute__((vector_size(kLanes * sizeof(float))));
inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store_lanes(float* p, Lanes v) { std::memcpy(p, &v, sizeof v); }

// Mamba-2: S ← τ·S + Σ_j s_j·x_j·B_jᵀ, with the decays taken from fp32 prefix sums of the
// log-decays A·Δ_j (exponents of differences, all <= 0: no overflow, no running products).
template <typename input_t>
void fold_head_mamba2(const StateCacheLayout& l, int layer, int slot, int head,
                      std::uint32_t first, std::uint32_t count) {
  const int rows = l.dims.rows, cols = l.dims.cols;
  const int group = head / l.dims.heads_per_key();
  float* cum = scratch(kFoldScratch + 0, count);
  float* weight = scratch(kFoldScratch + 1, count);
  float total = 0.0f;
  for (std::uint32_t j = 0; j < count; ++j) {
    total += ring_record<input_t>(l, layer, slot, first + j).decay[head];
    cum[j] = total;
  }
  for (std::uint32_t j = 0; j < count; ++j) {
    weight[j] = ring_record<input_t>(l, layer, slot, first + j).write[head] *
                std::exp(total - cum[j]);
  }
  const float tau = std::exp(total);
  // The ring's keys [count, cols] and weighted inputs s_j·x_j [count, rows] as fp32, once.
  float* keys = scratch(kFoldScratch + 2, std::size_t(count) * cols);
  float* xw = scratch(kFoldScratch + 3, std::size_t(count) * rows);
  for (std::uint32_t j = 0; j < count; ++j) {
    const RingRecord<input_t> rec = ring_record<input_t>(l, layer, slot, first + j);
    for (int n = 0; n < cols; ++n) {
      keys[std::size_t(j) * cols + n] = to_float(rec.key[group * cols + n]);
    }
    for (int p = 0; p < rows; ++p) {
      xw[std::size_t(j) * rows + p] = weight[j] * to_float(rec.vec[head * rows + p]);
    }
  }
  const CheckpointHead c = checkpoint_head(l, layer, slot, head);
  float* row = scratch(kFoldScratch + 4, cols);
  for (int p = 0; p < rows; ++p) {
    read_master_row(c, p, row);
    const float* coeff = xw + p;  // coeff[j * rows] = s_j·x_j[p]
    // A block of 16 columns stays in one vector register across all the records (records
    // innermost); records outermost re-loaded and re-stored the row once per record, and
    // GCC vectorised a plain-array form of this loop only 4 lanes wide.
    int n = 0;
    for (; n + kLanes <= cols; n += kLanes) {
      Lanes s = load_lanes(row + n) * tau;
      for (std::uint32_t j = 0; j < count; ++j) {
        s += coeff[std::size_t(j) * rows] * load_lanes(keys + std::size_t(j) * cols + n);
      }
      store_lanes(row + n, s);
    }
    for (; n < cols; ++n) {
      float s = tau * row[n];
      for (std::uint32_t j = 0; j < count; ++j) {
        s += coeff[std::size_t(j) * rows] * keys[std::size_t(j) * cols + n];
      }
      row[n] = s;
    }
    write_row(c, p, row);
  }
}

// GDN: the delta rule token by token, each value row on its own:
//   s ← α·s;  d = β·(v − s·k̂);  s ← s + d·k̂.
template <typename input_t>
void fold_head_gdn(const StateCacheLayout& l, int layer, int slot, int head,
                   std::uint32_t first, std::uint32_t count) {
  const int rows = l.dims.rows, cols = l.dims.cols;
  const int key_head = head / l.dims.heads_per_key();
  float* keys = scratch(kFoldScratch + 0, std::size_t(count) * cols);
  float* alpha = scratch(kFoldScratch + 1, count);
  float* beta = scratch(kFoldScratch + 2, count);
  for (std::uint32_t j = 0; j < count; ++j) {
    const RingRecord<input_t> r = ring_record<input_t>(l, layer, slot, first + j);
    const float key_scale = r.key_scale[key_head];
    for (int k = 0; k < cols; ++k) {
      keys[std::size_t(j) * cols + k] = to_float(r.key[key_head * cols + k]) * key_scale;
    }
    alpha[j] = std::exp(r.decay[head]);
    beta[j] = r.write[head];
  }
  const CheckpointHead c = checkpoint_head(l, layer, slot, head);
  float* row = scratch(kFoldScratch + 3, cols);
  for (int v = 0; v < rows; ++v) {
    read_master_row(c, v, row);
    for (std::uint32_t j = 0; j < count; ++j) {
      const float* key = keys + std::size_t(j) * cols;
      const float value = to_float(ring_record<input_t>(l, layer, slot, first + j).vec[head * rows + v]);
      for (int k = 0; k < cols; ++k) row[k] *= alpha[j];
      const float d = beta[j] * (value - dot(row, key, cols));
#pragma omp simd
      for (int k = 0; k < cols; ++k) row[k] += d * key[k];
    }
    write_row(c, v, row);
  }
}

}  // namespace

void fold_head(const StateCacheLayout& l, int layer, int slot, int head, std::uint32_t first,
               std::uint32_t count) {
  if (count == 0) return;
  dispatch_activation(l.config.input_dtype, [&](auto tag) {
    using input_t = typename decltype(tag)::type;
    if (l.config.kind == LayerKind::kMamba2) {
      fold_head_mamba2<input_t>(l, layer, slot, head, first, count);
    } else {
      fold_head_gdn<input_t>(l, layer, slot, head, first, count);
    }
  });
}

void fold_committed(StateCacheLayout& l, int layer, int slot) {
  if (l.config.mode == DecodeMode::kEager) return;
  const std::uint32_t count = unfolded(l, layer, slot);
  if (count == 0) return;
  const std::uint32_t first = l.folded[l.layer_slot(layer, slot)];
#pragma omp parallel for schedule(static)
  for (int h = 0; h < l.dims.heads; ++h) fold_head(l, layer, slot, h, first, count);
  l.folded[l.layer_slot(layer, slot)] = l.committed[slot];
}

}  // namespace replayssm::cpu
