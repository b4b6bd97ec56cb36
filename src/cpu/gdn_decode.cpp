// Gated DeltaNet decode on the CPU: eager, one token or a window of drafts (ALGORITHM.md §2),
// and replay with the adjoint output form (§4): the query is walked back through the window,
// newest token first, then meets the checkpoint in one mat-vec; the state is never built.
// Parallel over batch × heads (replay: key heads, each serving its value heads).

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend.h"
#include "cpu_common.h"

REPLAYSSM_CPU_BEGIN

namespace {

// 1 / sqrt(|u|² + 1e-6): the factor that L2-normalises u (fp32).
template <typename input_t>
float l2norm_factor(const input_t* u, int n) {
  float sq = 0.0f;
  for (int i = 0; i < n; ++i) sq += to_float(u[i]) * to_float(u[i]);
  return 1.0f / std::sqrt(sq + 1e-6f);
}

// u · (l2norm_factor(u) when normalising) · scale, in fp32.
template <typename input_t>
void normalise(const input_t* u, int n, bool l2norm, float scale, float* out) {
  const float f = l2norm ? scale * l2norm_factor(u, n) : scale;
  for (int i = 0; i < n; ++i) out[i] = to_float(u[i]) * f;
}

float query_scale(const GdnDecodeArgs& a, int head_k_dim) {
  return a.scale > 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(head_k_dim));
}

/// Rows per block of the eager update (see eager_decode).
constexpr int kEagerRows = 8;

// Eager decode of a window of T tokens (ALGORITHM.md §2 per token), as the Mamba-2 one: each
// state row read once from the current copy and kept in fp32 across the window, the row after
// token t stored (rounded) into copy after_tokens(current, t), o_t from the fp32 row. kInPlace
// (a one-copy cache, T = 1): rows written back where they were read, as the in-place decode
// always did.
template <typename input_t, typename state_t, bool kInPlace>
void eager_decode(StateCacheLayout& l, const GdnDecodeArgs& a) {
  const StateDims d = l.dims;
  const int V = d.rows, K = d.cols, T = kInPlace ? 1 : a.num_tokens;
  const std::vector<ActiveRow> rows = active_rows(a.slot_ids, a.batch);
  const int num_rows = static_cast<int>(rows.size());
  const float qscale = query_scale(a, K);

#pragma omp parallel for collapse(2) schedule(static)
  for (int i = 0; i < num_rows; ++i) {
    for (int h = 0; h < d.heads; ++h) {
      const ActiveRow row = rows[static_cast<std::size_t>(i)];
      const int kh = h / d.heads_per_key();
      float* q = scratch(0, std::size_t(T) * K);
      float* k = scratch(1, std::size_t(T) * K);
      float* s = scratch(2, std::size_t(kEagerRows) * K);
      float* out = scratch(3, std::size_t(T) * V);
      float* partials = scratch(4, std::size_t(T) * RowDots::kLanes * V);
      float* alpha = scratch(5, 2 * std::size_t(T));
      float* beta = alpha + T;
      // Token t's (row, head) index into [batch, T, heads] inputs.
      auto bh = [&](int t) { return (std::int64_t{row.b} * T + t) * d.heads + h; };
      for (int t = 0; t < T; ++t) {
        const std::int64_t key_off = ((std::int64_t{row.b} * T + t) * d.key_heads + kh) * K;
        normalise(static_cast<const input_t*>(a.q) + key_off, K, a.qk_l2norm, qscale,
                  q + std::size_t(t) * K);
        normalise(static_cast<const input_t*>(a.k) + key_off, K, a.qk_l2norm, 1.0f,
                  k + std::size_t(t) * K);
        alpha[t] = std::exp(a.g[bh(t)]);
        beta[t] = a.beta[bh(t)];
      }
      // The head's block in copy 0; the current copy; where each token's state goes.
      state_t* state = static_cast<state_t*>(l.state) + l.state_offset(a.layer, row.slot, 0) +
                       std::int64_t{h} * V * K;
      const int current = l.current_copy(row.slot);
      state_t* S_in = state + std::int64_t{current} * l.state_elems();
      state_t* S_out[kMaxSpecTokens];
      for (int t = 0; t < T; ++t) {
        S_out[t] = kInPlace ? S_in
                            : state + std::int64_t{l.after_tokens(current, t + 1)} * l.state_elems();
      }
      // kEagerRows rows at a time, in two passes per token: the decayed rows and their s·k̂
      // first, then the updates. Each row's update waits for its finished dot product; row by
      // row that wait (a horizontal reduction) was on the critical path of every row and held
      // the step to about half the machine's update bandwidth on the 2-core EPYC.
      for (int r0 = 0; r0 < V; r0 += kEagerRows) {
        const int n = std::min(kEagerRows, V - r0);
        for (int t = 0; t < T; ++t) {
          const float* k_t = k + std::size_t(t) * K;
          float sk[kEagerRows];
          for (int r = 0; r < n; ++r) {
            float* s_r = s + std::size_t(r) * K;
            if (t == 0) {
              const state_t* s_row = S_in + std::int64_t{r0 + r} * K;
              for (int c = 0; c < K; ++c) s_r[c] = alpha[0] * to_float(s_row[c]);
            } else {
              for (int c = 0; c < K; ++c) s_r[c] *= alpha[t];
            }
            sk[r] = dot(s_r, k_t, K);
          }
          const auto* v = static_cast<const input_t*>(a.v) + bh(t) * V;
          RowDots dots(V, partials + std::size_t(t) * RowDots::kLanes * V);
          for (int r = 0; r < n; ++r) {
            state_t* s_row = S_out[t] + std::int64_t{r0 + r} * K;
            float* s_r = s + std::size_t(r) * K;
            const float delta = beta[t] * (to_float(v[r0 + r]) - sk[r]);
            for (int c = 0; c < K; ++c) {
              s_r[c] += delta * k_t[c];
              s_row[c] = from_float<state_t>(s_r[c]);
            }
            dots.set(r0 + r, s_r, q + std::size_t(t) * K, K);
          }
        }
      }
      for (int t = 0; t < T; ++t) {
        float* out_t = out + std::size_t(t) * V;
        RowDots(V, partials + std::size_t(t) * RowDots::kLanes * V).reduce(out_t);
        auto* o = static_cast<input_t*>(a.o) + bh(t) * V;
        for (int r = 0; r < V; ++r) o[r] = from_float<input_t>(out_t[r]);
      }
    }
  }
  for (const ActiveRow& row : rows) {
    l.pending[l.layer_slot(a.layer, row.slot)] = static_cast<std::uint8_t>(T);
  }
}

// Appends the window's records: raw k and its normalisation factor per key head, v, β, g.
template <typename input_t>
void append_window(StateCacheLayout& l, const GdnDecodeArgs& a, const ActiveRow& row) {
  const StateDims d = l.dims;
  const int T = a.num_tokens, K = d.cols;
  for (int t = 0; t < T; ++t) {
    const RingRecord<input_t> rec =
        ring_record<input_t>(l, a.layer, row.slot, l.committed[row.slot] + t);
    const std::int64_t bt = std::int64_t{row.b} * T + t;
    const auto* k = static_cast<const input_t*>(a.k) + bt * l.key_elems();
    std::copy(k, k + l.key_elems(), rec.key);
    for (int kh = 0; kh < d.key_heads; ++kh) {
      rec.key_scale[kh] = a.qk_l2norm ? l2norm_factor(k + kh * K, K) : 1.0f;
    }
    const auto* v = static_cast<const input_t*>(a.v) + bt * l.vec_elems();
    std::copy(v, v + l.vec_elems(), rec.vec);
    for (int h = 0; h < d.heads; ++h) {
      rec.write[h] = a.beta[bt * d.heads + h];
      rec.decay[h] = a.g[bt * d.heads + h];
    }
  }
}

// The value heads of one key head of one row (they share q and k): fold if due, then for
// each value head h and window token t the adjoint walk
//   tq ← q̂_t;  for j = w+t … 0:  c = β_j·(k̂_j·tq);  o += c·v_j;  tq ← α_j·(tq − c·k̂_j)
// and o += S_c·tq, with S_c read once for all T tokens.
// The ring is read record by record into scratch first (k̂_j as fp32 once for all G heads; the
// G heads' v rows, β and log-decays are contiguous in a record), prefetched ahead of use:
// walking the ring in place put a dependent cache miss in every step of every head's walk,
// which made replay slower than eager on the 2-core EPYC. Then the walks run from cache, and
// the G checkpoint blocks are streamed in address order.
template <typename input_t>
void replay_key_head(StateCacheLayout& l, const GdnDecodeArgs& a, const ActiveRow& row, int kh,
                     bool fold_due) {
  const StateDims d = l.dims;
  const int V = d.rows, K = d.cols, T = a.num_tokens, G = d.heads_per_key();
  const int h0 = kh * G;
  std::uint32_t first = l.folded[l.layer_slot(a.layer, row.slot)];
  std::uint32_t w = unfolded(l, a.layer, row.slot);
  // Everything this key head reads from the ring, the fold's records included: [first, span).
  // The first key head of a row requests its own records; every key head requests the next
  // one's (same slot, same cursors) before its mat-vecs, so they arrive during that stream.
  const std::uint32_t ring_first = first, ring_span = w + static_cast<std::uint32_t>(T);
  if (kh == 0) prefetch_ring_records<input_t>(l, a.layer, row.slot, ring_first, ring_span, kh, h0, G);
  if (fold_due) {
    fold_heads(l, a.layer, row.slot, h0, h0 + G, first, w);
    first += w;
    w = 0;
  }
  const std::uint32_t count = w + static_cast<std::uint32_t>(T);
  // Staged records: k̂ [count, K]; per head h: β, α [count] and v [count, V].
  float* keys = scratch(0, std::size_t(count) * K);
  float* beta = scratch(1, std::size_t(G) * count);
  float* alpha = scratch(2, std::size_t(G) * count);
  float* vals = scratch(3, std::size_t(G) * count * V);
  for (std::uint32_t j = 0; j < count; ++j) {
    const RingRecord<input_t> rec = ring_record<input_t>(l, a.layer, row.slot, first + j);
    const float key_scale = rec.key_scale[kh];
    float* key = keys + std::size_t(j) * K;
    for (int c = 0; c < K; ++c) key[c] = to_float(rec.key[kh * K + c]) * key_scale;
    for (int hh = 0; hh < G; ++hh) {
      beta[std::size_t(hh) * count + j] = rec.write[h0 + hh];
      alpha[std::size_t(hh) * count + j] = std::exp(rec.decay[h0 + hh]);
      const input_t* v = rec.vec + std::size_t(h0 + hh) * V;
      float* dst = vals + (std::size_t(hh) * count + j) * V;
      for (int r = 0; r < V; ++r) dst[r] = to_float(v[r]);
    }
  }
  // The walks: tq [G, T, K] and the ring's part of the outputs, acc [G, T, V].
  const float qscale = query_scale(a, K);
  float* tq = scratch(4, std::size_t(G) * T * K);
  float* acc = scratch(5, std::size_t(G) * T * V);
  std::fill(acc, acc + std::size_t(G) * T * V, 0.0f);
  for (int t = 0; t < T; ++t) {
    float* q_t = tq + std::size_t(t) * K;  // head 0's slot; copied to the other heads
    normalise(static_cast<const input_t*>(a.q) +
                  ((std::int64_t{row.b} * T + t) * d.key_heads + kh) * K,
              K, a.qk_l2norm, qscale, q_t);
    for (int hh = 1; hh < G; ++hh) std::copy(q_t, q_t + K, tq + (std::size_t(hh) * T + t) * K);
  }
  for (int hh = 0; hh < G; ++hh) {
    for (int t = 0; t < T; ++t) {
      float* tq_t = tq + (std::size_t(hh) * T + t) * K;
      float* o_t = acc + (std::size_t(hh) * T + t) * V;
      for (std::uint32_t j = w + static_cast<std::uint32_t>(t) + 1; j-- > 0;) {
        const float* key = keys + std::size_t(j) * K;
        const float coeff = beta[std::size_t(hh) * count + j] * dot(key, tq_t, K);
        const float* v = vals + (std::size_t(hh) * count + j) * V;
        for (int r = 0; r < V; ++r) o_t[r] += coeff * v[r];
        const float al = alpha[std::size_t(hh) * count + j];
        for (int c = 0; c < K; ++c) tq_t[c] = al * (tq_t[c] - coeff * key[c]);
      }
    }
  }
  if (kh + 1 < d.key_heads) {
    prefetch_ring_records<input_t>(l, a.layer, row.slot, ring_first, ring_span, kh + 1, h0 + G,
                                   G);
  }
  // The checkpoints' part, one pass per head for all T tokens: acc[h][t] += S_c·tq_t.
  float* sc = scratch(6, std::size_t(T) * V);
  for (int hh = 0; hh < G; ++hh) {
    const int h = h0 + hh;
    checkpoint_matvec(checkpoint_head(l, a.layer, row.slot, h), tq + std::size_t(hh) * T * K, T,
                      sc, scratch(7, checkpoint_matvec_scratch(T, V, K)));
    for (int t = 0; t < T; ++t) {
      const float* acc_t = acc + (std::size_t(hh) * T + t) * V;
      auto* o = static_cast<input_t*>(a.o) + ((std::int64_t{row.b} * T + t) * d.heads + h) * V;
      for (int r = 0; r < V; ++r) o[r] = from_float<input_t>(acc_t[r] + sc[std::size_t(t) * V + r]);
    }
  }
}

}  // namespace

void gdn_decode(StateCacheLayout& l, const GdnDecodeArgs& args) {
  dispatch_decode(
      l,
      [&](auto in_tag, auto state_tag, auto in_place) {
        eager_decode<typename decltype(in_tag)::type, typename decltype(state_tag)::type,
                     decltype(in_place)::value>(l, args);
      },
      [&](auto in_tag) {
        using input_t = typename decltype(in_tag)::type;
        replay_rows(
            l, args.layer, args.num_tokens, args.slot_ids, args.batch, l.dims.key_heads,
            [&](const ActiveRow& row) { append_window<input_t>(l, args, row); },
            [&](const ActiveRow& row, int unit, bool fold_due) {
              replay_key_head<input_t>(l, args, row, unit, fold_due);
            });
      });
}

REPLAYSSM_CPU_END
