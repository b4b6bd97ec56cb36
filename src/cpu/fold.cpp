// Fold (ALGORITHM.md §5): replay a slot's committed ring records into its checkpoint. This is
// the only place a replay cache writes state. The master copy is read and written in fp32;
// the low copy is refreshed by rounding, so its rounding never enters a later update (§6).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend.h"
#include "cpu_common.h"

REPLAYSSM_CPU_BEGIN

namespace {

// Folds run inside a decode's per-(row, group or head) work, which holds scratch buffers
// 0..kFoldScratch-1 across the fold: the fold takes the ones above.
constexpr int kFoldScratch = 8;

// Requests, slice by slice, the rows [row, row + count) of the next fold block: the copy it
// reads (the master, or the low copy in the shared bf16 mode) and, beside an fp32 master, the
// low copy it overwrites, so that this memory traffic overlaps this block's FMAs. Without the
// first a fold step cost its memory time plus its FMA time; the second spares the low copy's
// stores the wait on the line reads that their misses make (no change above the 2-core
// EPYC's noise in the bench's fold steps; kept as the lines are written next anyway).
class NextRowsPrefetch {
 public:
  NextRowsPrefetch(const CheckpointHead& c, int row, int count) {
    const std::size_t first = std::size_t(row) * c.cols, elems = std::size_t(count) * c.cols;
    if (c.hi != nullptr) {
      read_ = {reinterpret_cast<const char*>(c.hi + first), elems * sizeof(float)};
      if (c.lo_bf16 != nullptr) {
        write_ = {reinterpret_cast<const char*>(c.lo_bf16 + first), elems * sizeof(bf16_t)};
      } else if (c.lo_fp8 != nullptr) {
        write_ = {reinterpret_cast<const char*>(c.lo_fp8 + first), elems * sizeof(fp8e4m3_t)};
      }
    } else if (c.lo_bf16 != nullptr) {
      read_ = {reinterpret_cast<const char*>(c.lo_bf16 + first), elems * sizeof(bf16_t)};
    }
  }
  /// Slice i of n: over i = 0 .. n-1, every cache line once. always_inline, as prefetch_bytes.
  [[gnu::always_inline]] void slice(int i, int n) const {
    const Lines r = read_.slice(i, n), w = write_.slice(i, n);
    prefetch_bytes(r.begin, r.bytes);
    prefetch_bytes_for_write(w.begin, w.bytes);
  }

 private:
  struct Lines {
    const char* begin = nullptr;
    std::size_t bytes = 0;
    /// Slice i of n of these lines.
    Lines slice(int i, int n) const {
      const std::size_t lines = (bytes + 63) / 64;
      const std::size_t first = lines * i / n, end = lines * (i + 1) / n;
      return {begin + first * 64, (end - first) * 64};
    }
  };
  Lines read_, write_;
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

// GDN, in chunks of up to kLanes records: the delta rule s ← α·s;  d = β·(v − s·k̂);  s ← s + d·k̂
// unrolled over a chunk. With λ_j the prefix sums of the chunk's log-decays, Γ_j = e^{λ_j} and
// a_j = s_0·k̂_j, every value row s of a head obeys
//   d_j = β_j·(v_j − Γ_j·a_j − Σ_{i<j} e^{λ_j−λ_i}·(k̂_i·k̂_j)·d_i)   →   d = T·(v − Γ∘a),
//   T = (I + N)^{-1}·diag(β),  N_ji = β_j·e^{λ_j−λ_i}·(k̂_i·k̂_j) for i < j,
//   s_end = Γ_last·s_0 + Σ_j d'_j·k̂_j,  d' = diag(e^{λ_last−λ_j})·d = T'·v − W·s_0,
// with T' = diag(e^{λ_last−λ_j})·T and W = T'·diag(Γ)·K̂ the same for all the head's rows.
// So a row's fold is two small matrix products with the chunk's tokens in the vector lanes,
// d' = Σ_i v_i·T'[:, i] − Σ_c s_0[c]·W[:, c] and then the rank-m update: FMA streams with no
// horizontal sum and no dependent chain, ~2·m FMAs per element, the minimum. Token by token
// (s·k̂ reduced per row and token, then an update pass over the rows) the fold step took
// ~1.7x longer on the 2-core EPYC, and so did an earlier Gram form that kept the dots and the
// m×m recurrence per row; solving the recurrence once per head, into T' and W, is the change
// that counts (docs/BENCHMARKS.md). Every exponent is ≤ 0: no overflow, no rescaling.
constexpr int kChunk = kLanes;

// One value head's chunk [first, first + size) of the records being folded, prepared.
struct GdnChunk {
  int first = 0, size = 0;
  float gamma_last = 1.0f;  // Γ at the chunk's last token
  const float* w_cols = nullptr;  // [cols][kChunk]: W[:, c], zero past `size`
  const float* t_cols = nullptr;  // [kChunk][kChunk]: T'[:, i]
};

// k̂_i·k̂_j of a chunk's keys ([size, cols], row stride cols), i < j, into gram[i][j]: the
// part of N that a key head's value heads share.
void gdn_chunk_gram(const float* keys, int size, int cols, float* gram /* [kChunk][kChunk] */) {
  for (int i = 0; i < size; ++i) {
    for (int j = i + 1; j < size; ++j) {
      gram[i * kChunk + j] = dot(keys + std::size_t(i) * cols, keys + std::size_t(j) * cols, cols);
    }
  }
}

// T', W and Γ_last of one value head's chunk, from its log-decays and β ([size] each) and
// its keys' Gram matrix. Writes kChunk·(cols + kChunk) floats at `out`.
GdnChunk prepare_gdn_chunk(int first, int size, int cols, const float* keys,
                           const float* gram, const float* log_decay, const float* beta,
                           float* out) {
  // decay[j][i] = e^{λ_j−λ_i} (i ≤ j) as running products of the α's: ≤ 1, and an underflow
  // to 0 is the right limit.
  float decay[kChunk][kChunk];
  float gamma[kChunk];
  float lambda = 0.0f;
  for (int j = 0; j < size; ++j) {
    const float alpha = std::exp(log_decay[j]);
    lambda += log_decay[j];
    gamma[j] = std::exp(lambda);
    decay[j][j] = 1.0f;
    for (int i = 0; i < j; ++i) decay[j][i] = decay[j - 1][i] * alpha;
  }
  // T by forward substitution, one column at a time: (I + N)·x = β_i·e_i.
  float t[kChunk][kChunk] = {};  // t[j][i] = T[j][i], then T'[j][i] once its rows are scaled
  for (int i = 0; i < size; ++i) {
    t[i][i] = beta[i];
    for (int j = i + 1; j < size; ++j) {
      float sum = 0.0f;
      for (int l = i; l < j; ++l) sum += decay[j][l] * gram[l * kChunk + j] * t[l][i];
      t[j][i] = -beta[j] * sum;
    }
  }
  for (int j = 0; j < size; ++j) {
    for (int i = 0; i <= j; ++i) t[j][i] *= decay[size - 1][j];
  }
  float* w_cols = out;
  float* t_cols = out + std::size_t(cols) * kChunk;
  // T'[:, i]·Γ_i, then W[:, c] = Σ_i K̂[i][c]·T'[:, i]·Γ_i.
  Lanes tg[kChunk];
  for (int i = 0; i < kChunk; ++i) {
    Lanes col{};
    for (int j = 0; j < size; ++j) col[j] = t[j][i];
    store_lanes(t_cols + i * kChunk, col);
    tg[i] = i < size ? col * gamma[i] : Lanes{};
  }
  for (int c = 0; c < cols; ++c) {
    Lanes w{};
    for (int i = 0; i < size; ++i) w += keys[std::size_t(i) * cols + c] * tg[i];
    store_lanes(w_cols + std::size_t(c) * kChunk, w);
  }
  return {first, size, gamma[size - 1], w_cols, t_cols};
}

// Folds rows [v0, v0 + R) of a head through its prepared chunks. The R rows stay in `in`
// (fp32) across the chunks; per chunk, d' of the R rows (R accumulators, one vector of W
// loaded per column feeds R FMAs), then the update, a column block at a time.
template <int R>
void fold_rows_gdn(const CheckpointHead& c, int v0, float* in, const float* keys,
                   const float* values /* [count, rows] */, const GdnChunk* chunks,
                   int num_chunks) {
  const int cols = c.cols;
  for (int r = 0; r < R; ++r) read_master_row(c, v0 + r, in + std::size_t(r) * cols);
  const NextRowsPrefetch prefetch(c, v0 + R, v0 + 2 * R <= c.rows ? R : 0);
  const int slices = (cols + kLanes - 1) / kLanes;
  for (int ch = 0; ch < num_chunks; ++ch) {
    const GdnChunk& chunk = chunks[ch];
    Lanes d[R];
    for (int r = 0; r < R; ++r) d[r] = Lanes{};
    for (int i = 0; i < chunk.size; ++i) {
      const Lanes t_col = load_lanes(chunk.t_cols + i * kChunk);
      const float* v = values + std::size_t(chunk.first + i) * c.rows + v0;
      for (int r = 0; r < R; ++r) d[r] += v[r] * t_col;
    }
    for (int col = 0; col < cols; ++col) {
      if (ch == 0 && col % kLanes == 0) prefetch.slice(col / kLanes, slices);
      const Lanes w = load_lanes(chunk.w_cols + std::size_t(col) * kChunk);
      for (int r = 0; r < R; ++r) d[r] -= in[std::size_t(r) * cols + col] * w;
    }
    alignas(64) float coeff[R][kChunk];
    for (int r = 0; r < R; ++r) store_lanes(coeff[r], d[r]);
    const float* key0 = keys + std::size_t(chunk.first) * cols;
    int n = 0;
    for (; n + kLanes <= cols; n += kLanes) {
      Lanes s[R];
      for (int r = 0; r < R; ++r) {
        s[r] = load_lanes(in + std::size_t(r) * cols + n) * chunk.gamma_last;
      }
      for (int j = 0; j < chunk.size; ++j) {
        const Lanes key = load_lanes(key0 + std::size_t(j) * cols + n);
        for (int r = 0; r < R; ++r) s[r] += coeff[r][j] * key;
      }
      for (int r = 0; r < R; ++r) store_lanes(in + std::size_t(r) * cols + n, s[r]);
    }
    for (; n < cols; ++n) {
      for (int r = 0; r < R; ++r) {
        float s = in[std::size_t(r) * cols + n] * chunk.gamma_last;
        for (int j = 0; j < chunk.size; ++j) s += coeff[r][j] * key0[std::size_t(j) * cols + n];
        in[std::size_t(r) * cols + n] = s;
      }
    }
  }
  for (int r = 0; r < R; ++r) write_row(c, v0 + r, in + std::size_t(r) * cols);
}

// Heads [head_begin, head_end) of one key head: its k̂ are converted, and their Gram matrices
// computed, once for all of them.
template <typename input_t>
void fold_heads_gdn(const StateCacheLayout& l, int layer, int slot, int head_begin,
                    int head_end, std::uint32_t first, std::uint32_t count) {
  const int rows = l.dims.rows, cols = l.dims.cols;
  const int key_head = head_begin / l.dims.heads_per_key();
  const int num_chunks = static_cast<int>((count + kChunk - 1) / kChunk);
  // The records as fp32, read once: k̂ [count, cols]; per head log-decays, β [count] and
  // v [count, rows].
  float* keys = scratch(kFoldScratch + 0, std::size_t(count) * cols);
  for (std::uint32_t j = 0; j < count; ++j) {
    const RingRecord<input_t> r = ring_record<input_t>(l, layer, slot, first + j);
    const float key_scale = r.key_scale[key_head];
    for (int k = 0; k < cols; ++k) {
      keys[std::size_t(j) * cols + k] = to_float(r.key[key_head * cols + k]) * key_scale;
    }
  }
  float* gram = scratch(kFoldScratch + 1, std::size_t(num_chunks) * kChunk * kChunk);
  for (int ch = 0; ch < num_chunks; ++ch) {
    const int begin = ch * kChunk, size = std::min<int>(kChunk, int(count) - begin);
    gdn_chunk_gram(keys + std::size_t(begin) * cols, size, cols, gram + ch * kChunk * kChunk);
  }
  float* log_decay = scratch(kFoldScratch + 2, count);
  float* beta = scratch(kFoldScratch + 3, count);
  float* values = scratch(kFoldScratch + 4, std::size_t(count) * rows);
  float* in = scratch(kFoldScratch + 5, std::size_t(kFoldRows) * cols);
  const std::size_t per_chunk = std::size_t(kChunk) * (cols + kChunk);
  float* prepared = scratch(kFoldScratch + 6, num_chunks * per_chunk);
  thread_local std::vector<GdnChunk> chunk_storage;
  chunk_storage.resize(std::size_t(num_chunks));
  GdnChunk* chunks = chunk_storage.data();
  for (int head = head_begin; head < head_end; ++head) {
    for (std::uint32_t j = 0; j < count; ++j) {
      const RingRecord<input_t> r = ring_record<input_t>(l, layer, slot, first + j);
      log_decay[j] = r.decay[head];
      beta[j] = r.write[head];
      for (int v = 0; v < rows; ++v) {
        values[std::size_t(j) * rows + v] = to_float(r.vec[head * rows + v]);
      }
    }
    for (int ch = 0; ch < num_chunks; ++ch) {
      const int begin = ch * kChunk, size = std::min<int>(kChunk, int(count) - begin);
      chunks[ch] = prepare_gdn_chunk(begin, size, cols, keys + std::size_t(begin) * cols,
                                     gram + ch * kChunk * kChunk, log_decay + begin,
                                     beta + begin, prepared + ch * per_chunk);
    }
    const CheckpointHead c = checkpoint_head(l, layer, slot, head);
    int v = 0;
    for (; v + kFoldRows <= rows; v += kFoldRows) {
      fold_rows_gdn<kFoldRows>(c, v, in, keys, values, chunks, num_chunks);
    }
    for (; v < rows; ++v) fold_rows_gdn<1>(c, v, in, keys, values, chunks, num_chunks);
  }
}

}  // namespace

void fold_heads(const StateCacheLayout& l, int layer, int slot, int head_begin, int head_end,
                std::uint32_t first, std::uint32_t count) {
  if (count == 0) return;
  dispatch_activation(l.config.input_dtype, [&](auto tag) {
    using input_t = typename decltype(tag)::type;
    switch (l.config.kind) {
      case LayerKind::kMamba2:
        fold_heads_mamba2<input_t>(l, layer, slot, head_begin, head_end, first, count);
        return;
      case LayerKind::kGdn:
        fold_heads_gdn<input_t>(l, layer, slot, head_begin, head_end, first, count);
        return;
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

REPLAYSSM_CPU_END
