// Fold (ALGORITHM.md §5): replay a slot's committed ring records into its checkpoint. This is
// the only place a replay cache writes state. The master copy is read and written in fp32;
// the low copy is refreshed by rounding, so its rounding never enters a later update (§6).

#include <algorithm>
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

// Requests, slice by slice, the rows [row, row + count) that the next fold block reads (the
// master, or the low copy in the shared bf16 mode), so that their memory traffic overlaps this
// block's FMAs: without it a fold step cost its memory time plus its FMA time.
class NextRowsPrefetch {
 public:
  NextRowsPrefetch(const CheckpointHead& c, int row, int count) {
    const std::size_t first = std::size_t(row) * c.cols, elems = std::size_t(count) * c.cols;
    if (c.hi != nullptr) {
      base_ = reinterpret_cast<const char*>(c.hi + first);
      bytes_ = elems * sizeof(float);
    } else if (c.lo_bf16 != nullptr) {
      base_ = reinterpret_cast<const char*>(c.lo_bf16 + first);
      bytes_ = elems * sizeof(bf16_t);
    }
  }
  /// Slice i of n: over i = 0 .. n-1, every cache line once. always_inline, as prefetch_bytes.
  [[gnu::always_inline]] void slice(int i, int n) const {
    const std::size_t lines = (bytes_ + 63) / 64;
    const std::size_t begin = lines * i / n, end = lines * (i + 1) / n;
    prefetch_bytes(base_ + begin * 64, (end - begin) * 64);
  }

 private:
  const char* base_ = nullptr;
  std::size_t bytes_ = 0;
};

// Rows of a Mamba-2 head folded together: the rank-`count` update is a small matrix product
// (rows × count) · (count × cols), and blocking it over rows lets each key vector, loaded
// once, feed kFoldRows FMAs. One row at a time, a fold step cost ~3x its memory traffic on
// the 2-core EPYC (load-bound: a key load and a broadcast per FMA); with 8 rows it is
// FMA-bound. The sum order per element is unchanged: τ·s first, then the records in order.
constexpr int kFoldRows = 8;

template <int R>
void fold_rows_mamba2(const CheckpointHead& c, int p0, float* in, float tau, const float* keys,
                      const float* xw /* [count, c.rows] */, std::uint32_t count, float* out) {
  const int cols = c.cols;
  // The R master rows are contiguous: read them into `in` in address order first. Loading
  // them column block by column block instead (R interleaved streams) left the fold
  // load-stalled at ~2/3 of its time (the prefetchers follow one stream, see
  // checkpoint_matvec).
  const float* master[R];
  for (int r = 0; r < R; ++r) {
    read_master_row(c, p0 + r, in + std::size_t(r) * cols);
    master[r] = in + std::size_t(r) * cols;
  }
  const NextRowsPrefetch prefetch(c, p0 + R, p0 + 2 * R <= c.rows ? R : 0);
  const int blocks = cols / kLanes;
  int n = 0;
  for (; n + kLanes <= cols; n += kLanes) {
    prefetch.slice(n / kLanes, blocks);
    Lanes s[R];
    for (int r = 0; r < R; ++r) s[r] = load_lanes(master[r] + n) * tau;
    for (std::uint32_t j = 0; j < count; ++j) {
      const Lanes key = load_lanes(keys + std::size_t(j) * cols + n);
      const float* coeff = xw + std::size_t(j) * c.rows + p0;  // s_j·x_j[p0 + r]
      for (int r = 0; r < R; ++r) s[r] += coeff[r] * key;
    }
    for (int r = 0; r < R; ++r) store_lanes(out + std::size_t(r) * cols + n, s[r]);
  }
  for (; n < cols; ++n) {
    for (int r = 0; r < R; ++r) {
      float s = tau * master[r][n];
      for (std::uint32_t j = 0; j < count; ++j) {
        s += xw[std::size_t(j) * c.rows + p0 + r] * keys[std::size_t(j) * cols + n];
      }
      out[std::size_t(r) * cols + n] = s;
    }
  }
  for (int r = 0; r < R; ++r) write_row(c, p0 + r, out + std::size_t(r) * cols);
}

// Mamba-2: S ← τ·S + Σ_j s_j·x_j·B_jᵀ, with the decays taken from fp32 prefix sums of the
// log-decays A·Δ_j (exponents of differences, all <= 0: no overflow, no running products).
// Heads [head_begin, head_end) share one key group, and the ring is read record by record:
// a record holds a group's heads side by side, so its log-decays, write factors and x rows
// for all the heads are one contiguous run each (read head by head, every value was a
// separate cache miss at a record-sized stride: ~5 ms of latency per fold step at the
// super120b shape, batch 64, on the 2-core EPYC). The keys are converted once per group.
template <typename input_t>
void fold_heads_mamba2(const StateCacheLayout& l, int layer, int slot, int head_begin,
                       int head_end, std::uint32_t first, std::uint32_t count) {
  const int rows = l.dims.rows, cols = l.dims.cols;
  const int heads = head_end - head_begin;
  const int group = head_begin / l.dims.heads_per_key();
  float* cum = scratch(kFoldScratch + 0, std::size_t(heads) * count);  // [head, record]
  float* total = scratch(kFoldScratch + 1, heads);
  std::fill(total, total + heads, 0.0f);
  for (std::uint32_t j = 0; j < count; ++j) {
    const float* decay = ring_record<input_t>(l, layer, slot, first + j).decay + head_begin;
    for (int hh = 0; hh < heads; ++hh) {
      total[hh] += decay[hh];
      cum[std::size_t(hh) * count + j] = total[hh];
    }
  }
  // The ring's keys [count, cols] and weighted inputs s_j·x_j [head, count, rows] as fp32.
  float* keys = scratch(kFoldScratch + 2, std::size_t(count) * cols);
  float* xw = scratch(kFoldScratch + 3, std::size_t(heads) * count * rows);
  for (std::uint32_t j = 0; j < count; ++j) {
    const RingRecord<input_t> rec = ring_record<input_t>(l, layer, slot, first + j);
    for (int n = 0; n < cols; ++n) {
      keys[std::size_t(j) * cols + n] = to_float(rec.key[group * cols + n]);
    }
    for (int hh = 0; hh < heads; ++hh) {
      const int h = head_begin + hh;
      const float weight = rec.write[h] * std::exp(total[hh] - cum[std::size_t(hh) * count + j]);
      float* dst = xw + (std::size_t(hh) * count + j) * rows;
      for (int p = 0; p < rows; ++p) dst[p] = weight * to_float(rec.vec[h * rows + p]);
    }
  }
  float* out = scratch(kFoldScratch + 4, std::size_t(kFoldRows) * cols);
  float* in = scratch(kFoldScratch + 5, std::size_t(kFoldRows) * cols);
  for (int hh = 0; hh < heads; ++hh) {
    const CheckpointHead c = checkpoint_head(l, layer, slot, head_begin + hh);
    const float tau = std::exp(total[hh]);
    const float* xw_h = xw + std::size_t(hh) * count * rows;
    int p = 0;
    for (; p + kFoldRows <= rows; p += kFoldRows) {
      fold_rows_mamba2<kFoldRows>(c, p, in, tau, keys, xw_h, count, out);
    }
    for (; p < rows; ++p) fold_rows_mamba2<1>(c, p, in, tau, keys, xw_h, count, out);
  }
}

// GDN: the delta rule token by token, each value row on its own:
//   s ← α·s;  d = β·(v − s·k̂);  s ← s + d·k̂.
// Rows are folded kFoldRows at a time, token by token across the block: a row's tokens form a
// dependent chain (each d needs the finished s·k̂), and one row at a time that chain's
// reduction latency set the fold's speed (a fold step cost ~3x an eager step on the 2-core
// EPYC); R independent rows keep the pipelines full. s·k̂ keeps 16 partial sums, added up
// once per row and token. The block is carried as s = Γ·ŝ, Γ the product of the decays so
// far, so a token costs two passes over a row (ŝ·k̂, then ŝ += (d/Γ)·k̂) instead of three
// (s ← α·s first); Γ is multiplied back into ŝ before 1/Γ could overflow, and at the end.
// Measured and not kept: the Gram form (each row's d_j from its dot products with the keys and
// a count×count scalar recurrence whose coefficients e^{Λ_j−Λ_i}·k̂_i·k̂_j all rows share, then
// Mamba-2's rank-count update): same fold-step time on the 2-core EPYC (qwen35-4b, batch 64:
// ~38-40 ms either way), so the fold step is not bound by these passes' dependent chains.
constexpr float kGdnFoldRescaleBelow = 1e-12f;

template <int R>
void fold_rows_gdn(const CheckpointHead& c, int v0, float* in, const float* keys,
                   const float* alpha, const float* beta, const float* values /* [count, rows] */,
                   std::uint32_t count) {
  const int cols = c.cols;
  for (int r = 0; r < R; ++r) read_master_row(c, v0 + r, in + std::size_t(r) * cols);
  const NextRowsPrefetch prefetch(c, v0 + R, v0 + 2 * R <= c.rows ? R : 0);
  const int blocks = cols / kLanes;
  float gamma = 1.0f;  // the same for every row of a head
  auto rescale = [&] {
    for (int r = 0; r < R; ++r) {
      float* s = in + std::size_t(r) * cols;
      for (int n = 0; n < cols; ++n) s[n] *= gamma;
    }
    gamma = 1.0f;
  };
  for (std::uint32_t j = 0; j < count; ++j) {
    if (int(j) < blocks) prefetch.slice(int(j), std::min<int>(blocks, int(count)));
    const float* key = keys + std::size_t(j) * cols;
    gamma *= alpha[j];
    const float inv_gamma = 1.0f / gamma;
    // s·k̂ of the R rows: 16 partial sums per row, the rows interleaved (R independent FMA
    // chains, each key vector loaded once), then the R sums together (lanes outer, rows
    // inner: R-wide vector adds; summing each row's lanes on its own was a chain of 16 scalar
    // adds per row and token, a third of the fold's time).
    Lanes acc[R];
    for (int r = 0; r < R; ++r) acc[r] = Lanes{};
    int n = 0;
    for (; n + kLanes <= cols; n += kLanes) {
      const Lanes k = load_lanes(key + n);
      for (int r = 0; r < R; ++r) acc[r] += load_lanes(in + std::size_t(r) * cols + n) * k;
    }
    alignas(64) float part[R][kLanes];
    float sk[R] = {};
    for (int r = 0; r < R; ++r) {
      store_lanes(part[r], acc[r]);
      const float* s = in + std::size_t(r) * cols;
      for (int m = n; m < cols; ++m) sk[r] += s[m] * key[m];
    }
    for (int k = 0; k < kLanes; ++k) {
      for (int r = 0; r < R; ++r) sk[r] += part[r][k];
    }
    float d[R];
    for (int r = 0; r < R; ++r) {
      d[r] = beta[j] * (values[std::size_t(j) * c.rows + v0 + r] - gamma * sk[r]) * inv_gamma;
    }
    for (n = 0; n + kLanes <= cols; n += kLanes) {
      const Lanes k = load_lanes(key + n);
      for (int r = 0; r < R; ++r) {
        float* s = in + std::size_t(r) * cols + n;
        store_lanes(s, load_lanes(s) + d[r] * k);
      }
    }
    for (int r = 0; r < R; ++r) {
      float* s = in + std::size_t(r) * cols;
      for (int m = n; m < cols; ++m) s[m] += d[r] * key[m];
    }
    if (gamma < kGdnFoldRescaleBelow) rescale();
  }
  rescale();
  for (int r = 0; r < R; ++r) write_row(c, v0 + r, in + std::size_t(r) * cols);
}

// Heads [head_begin, head_end) of one key head: its k̂ are converted once for all of them.
template <typename input_t>
void fold_heads_gdn(const StateCacheLayout& l, int layer, int slot, int head_begin,
                    int head_end, std::uint32_t first, std::uint32_t count) {
  const int rows = l.dims.rows, cols = l.dims.cols;
  const int key_head = head_begin / l.dims.heads_per_key();
  // The records as fp32, read once: k̂ [count, cols]; per head α, β [count], v [count, rows].
  float* keys = scratch(kFoldScratch + 0, std::size_t(count) * cols);
  for (std::uint32_t j = 0; j < count; ++j) {
    const RingRecord<input_t> r = ring_record<input_t>(l, layer, slot, first + j);
    const float key_scale = r.key_scale[key_head];
    for (int k = 0; k < cols; ++k) {
      keys[std::size_t(j) * cols + k] = to_float(r.key[key_head * cols + k]) * key_scale;
    }
  }
  float* alpha = scratch(kFoldScratch + 1, count);
  float* beta = scratch(kFoldScratch + 2, count);
  float* values = scratch(kFoldScratch + 3, std::size_t(count) * rows);
  float* in = scratch(kFoldScratch + 4, std::size_t(kFoldRows) * cols);
  for (int head = head_begin; head < head_end; ++head) {
    for (std::uint32_t j = 0; j < count; ++j) {
      const RingRecord<input_t> r = ring_record<input_t>(l, layer, slot, first + j);
      alpha[j] = std::exp(r.decay[head]);
      beta[j] = r.write[head];
      for (int v = 0; v < rows; ++v) {
        values[std::size_t(j) * rows + v] = to_float(r.vec[head * rows + v]);
      }
    }
    const CheckpointHead c = checkpoint_head(l, layer, slot, head);
    int v = 0;
    for (; v + kFoldRows <= rows; v += kFoldRows) {
      fold_rows_gdn<kFoldRows>(c, v, in, keys, alpha, beta, values, count);
    }
    for (; v < rows; ++v) fold_rows_gdn<1>(c, v, in, keys, alpha, beta, values, count);
  }
}

}  // namespace

void fold_heads(const StateCacheLayout& l, int layer, int slot, int head_begin, int head_end,
                std::uint32_t first, std::uint32_t count) {
  if (count == 0) return;
  dispatch_activation(l.config.input_dtype, [&](auto tag) {
    using input_t = typename decltype(tag)::type;
    if (l.config.kind == LayerKind::kMamba2) {
      fold_heads_mamba2<input_t>(l, layer, slot, head_begin, head_end, first, count);
    } else {
      fold_heads_gdn<input_t>(l, layer, slot, head_begin, head_end, first, count);
    }
  });
}

void fold_head(const StateCacheLayout& l, int layer, int slot, int head, std::uint32_t first,
               std::uint32_t count) {
  fold_heads(l, layer, slot, head, head + 1, first, count);
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
