// Mamba-2 decode on the CPU: eager, one token or a window of drafts (ALGORITHM.md §1), and
// replay (§4 inner-product form, §5 fold, §7 windows). Parallel over batch × heads; the inner
// loops run along dstate and vectorise.

#include <cmath>
#include <vector>

#include "backend.h"
#include "cpu_common.h"

REPLAYSSM_CPU_BEGIN

namespace {

// y ← (y + D·x) · silu(z), stored in the activation dtype.
template <typename input_t>
void store_output(const float* acc, const input_t* x, const input_t* z, float D, int n,
                  input_t* y) {
  for (int p = 0; p < n; ++p) {
    float v = acc[p] + D * to_float(x[p]);
    if (z != nullptr) v *= silu(to_float(z[p]));
    y[p] = from_float<input_t>(v);
  }
}

// Eager decode of a window of T tokens (ALGORITHM.md §1 per token). Each state row is read
// once, from the slot's current copy, and kept in fp32 across the window; the row after token t
// is stored, rounded to state_t, into copy after_tokens(current, t), and y_t is taken from the
// fp32 row before that rounding. So a window of fp32 state gives exactly the outputs and states
// of its tokens decoded one at a time. kInPlace (a one-copy cache, T = 1): the row is written
// back where it was read, the loop of the in-place decode as it always was.
template <typename input_t, typename state_t, bool kInPlace>
void eager_decode(StateCacheLayout& l, const Mamba2DecodeArgs& a) {
  const StateDims d = l.dims;
  const int P = d.rows, N = d.cols, T = kInPlace ? 1 : a.num_tokens;
  const std::vector<ActiveRow> rows = active_rows(a.slot_ids, a.batch);
  const auto* x_all = static_cast<const input_t*>(a.x);
  const auto* B_all = static_cast<const input_t*>(a.B);
  const auto* C_all = static_cast<const input_t*>(a.C);
  const auto* z_all = static_cast<const input_t*>(a.z);
  auto* y_all = static_cast<input_t*>(a.y);
  const int num_rows = static_cast<int>(rows.size());

#pragma omp parallel for collapse(2) schedule(static)
  for (int i = 0; i < num_rows; ++i) {
    for (int h = 0; h < d.heads; ++h) {
      const ActiveRow row = rows[static_cast<std::size_t>(i)];
      const int g = h / d.heads_per_key();
      // Token t of this row and head: its x / z / y block, B / C vector and Δ.
      auto head_off = [&](int t) { return ((std::int64_t{row.b} * T + t) * d.heads + h) * P; };
      float* B = scratch(0, std::size_t(T) * N);
      float* C = scratch(1, std::size_t(T) * N);
      float* acc = scratch(2, std::size_t(T) * P);
      float* s = scratch(3, N);
      float* dt = scratch(5, 2 * std::size_t(T));
      float* decay = dt + T;
      for (int t = 0; t < T; ++t) {
        const std::int64_t key = ((std::int64_t{row.b} * T + t) * d.key_heads + g) * N;
        for (int n = 0; n < N; ++n) {
          B[std::size_t(t) * N + n] = to_float(B_all[key + n]);
          C[std::size_t(t) * N + n] = to_float(C_all[key + n]);
        }
        dt[t] = softplus(a.dt[(std::int64_t{row.b} * T + t) * d.heads + h] + a.dt_bias[h]);
        decay[t] = std::exp(a.A[h] * dt[t]);
      }
      // The head's block in copy 0; the current copy; where each token's state goes, and its x.
      state_t* state = static_cast<state_t*>(l.state) + l.state_offset(a.layer, row.slot, 0) +
                       std::int64_t{h} * P * N;
      const int current = l.current_copy(row.slot);
      state_t* S_in = state + std::int64_t{current} * l.state_elems();
      state_t* S_out[kMaxSpecTokens];
      const input_t* x[kMaxSpecTokens];
      for (int t = 0; t < T; ++t) {
        S_out[t] = state + std::int64_t{l.after_tokens(current, t + 1)} * l.state_elems();
        x[t] = x_all + head_off(t);
      }
      float* partials = scratch(4, std::size_t(T) * RowDots::kLanes * P);
      for (int p = 0; p < P; ++p) {
        state_t* in_row = S_in + std::int64_t{p} * N;
        for (int t = 0; t < T; ++t) {
          const float xdt = to_float(x[t][p]) * dt[t];
          const float* Bt = B + std::size_t(t) * N;
          state_t* out_row = kInPlace ? in_row : S_out[t] + std::int64_t{p} * N;
          // One loop that updates and stores, as the in-place decode always did.
          if (t == 0) {
            for (int n = 0; n < N; ++n) {
              s[n] = decay[0] * to_float(in_row[n]) + xdt * Bt[n];
              out_row[n] = from_float<state_t>(s[n]);
            }
          } else {
            for (int n = 0; n < N; ++n) {
              s[n] = decay[t] * s[n] + xdt * Bt[n];
              out_row[n] = from_float<state_t>(s[n]);
            }
          }
          RowDots(P, partials + std::size_t(t) * RowDots::kLanes * P)
              .set(p, s, C + std::size_t(t) * N, N);
        }
      }
      for (int t = 0; t < T; ++t) {
        float* acc_t = acc + std::size_t(t) * P;
        RowDots(P, partials + std::size_t(t) * RowDots::kLanes * P).reduce(acc_t);
        store_output(acc_t, x_all + head_off(t), z_all ? z_all + head_off(t) : nullptr, a.D[h],
                     P, y_all + head_off(t));
      }
    }
  }
  for (const ActiveRow& row : rows) {
    l.pending[l.layer_slot(a.layer, row.slot)] = static_cast<std::uint8_t>(T);
  }
}

// Appends the window's records: x, B as given; Δ = softplus(dt + dt_bias) and A·Δ in fp32.
template <typename input_t>
void append_window(StateCacheLayout& l, const Mamba2DecodeArgs& a, const ActiveRow& row) {
  const StateDims d = l.dims;
  const int T = a.num_tokens;
  for (int t = 0; t < T; ++t) {
    const RingRecord<input_t> rec =
        ring_record<input_t>(l, a.layer, row.slot, l.committed[row.slot] + t);
    const std::int64_t bt = std::int64_t{row.b} * T + t;
    const auto* x = static_cast<const input_t*>(a.x) + bt * l.vec_elems();
    const auto* B = static_cast<const input_t*>(a.B) + bt * l.key_elems();
    std::copy(x, x + l.vec_elems(), rec.vec);
    std::copy(B, B + l.key_elems(), rec.key);
    for (int h = 0; h < d.heads; ++h) {
      const float dt = softplus(a.dt[bt * d.heads + h] + a.dt_bias[h]);
      rec.write[h] = dt;
      rec.decay[h] = a.A[h] * dt;
    }
  }
}

// One key group of one row (the heads that share B and C): fold the committed history if
// due, then each head's window outputs
//   y_t = τ_t·(S_c·C_t) + Σ_{j ≤ w+t} s_j·(B_j·C_t)·x_j + D·x_t,
// τ_t = exp(Λ_{w+t}), s_j = Δ_j·exp(Λ_{w+t} − Λ_j), Λ = prefix sums of A·Δ (fp32).
// B_j·C_t is computed once per group, not once per head.
template <typename input_t>
void replay_group(StateCacheLayout& l, const Mamba2DecodeArgs& a, const ActiveRow& row, int g,
                  bool fold_due) {
  const StateDims d = l.dims;
  const int P = d.rows, N = d.cols, T = a.num_tokens;
  const std::uint32_t fold_first = l.folded[l.layer_slot(a.layer, row.slot)];
  const std::uint32_t fold_count = unfolded(l, a.layer, row.slot);
  // The records the outputs see: the unfolded history (none after a fold) and the window.
  const std::uint32_t first = fold_due ? fold_first + fold_count : fold_first;
  const std::uint32_t w = fold_due ? 0 : fold_count;
  const std::uint32_t count = w + static_cast<std::uint32_t>(T);

  float* C = scratch(0, std::size_t(T) * N);
  float* BC = scratch(1, std::size_t(T) * count);
  float* key = scratch(2, N);
  for (int t = 0; t < T; ++t) {
    const auto* c_in = static_cast<const input_t*>(a.C) +
                       ((std::int64_t{row.b} * T + t) * d.key_heads + g) * N;
    for (int n = 0; n < N; ++n) C[std::size_t(t) * N + n] = to_float(c_in[n]);
  }
  const int heads_per_group = d.heads_per_key();
  const int h0 = g * heads_per_group;
  float* acc = scratch(3, std::size_t(heads_per_group) * T * P);  // [head, t, p]
  auto acc_at = [&](int hh, int t) { return acc + (std::size_t(hh) * T + t) * P; };
  // Pass 1, the group's checkpoint blocks in address order (the group folded first when due):
  // acc[h][t] = S_c·C_t. Keeping this stream apart from the ring reads of pass 2 lets the
  // prefetchers run ahead across heads; interleaving them per head made the mat-vec read
  // ~1.7x slower on the 2-core EPYC (in a decode step, not in isolation).
  // The ring records pass 2 reads are requested first, so that they arrive during pass 1's
  // stream: read where used, they stalled pass 2 for ~15% of a plain fp32 step.
  prefetch_ring_records<input_t>(l, a.layer, row.slot, first, count, g, h0, heads_per_group);
  if (fold_due) fold_heads(l, a.layer, row.slot, h0, h0 + heads_per_group, fold_first, fold_count);
  for (int hh = 0; hh < heads_per_group; ++hh) {
    checkpoint_matvec(checkpoint_head(l, a.layer, row.slot, h0 + hh), C, T, acc_at(hh, 0),
                      scratch(4, checkpoint_matvec_scratch(T, P, N)));
  }
  // B_j·C_t, once per group.
  for (std::uint32_t j = 0; j < count; ++j) {
    const input_t* B = ring_record<input_t>(l, a.layer, row.slot, first + j).key + g * N;
    for (int n = 0; n < N; ++n) key[n] = to_float(B[n]);
    for (int t = 0; t < T; ++t) {
      BC[std::size_t(t) * count + j] = dot(key, C + std::size_t(t) * N, N);
    }
  }

  // Pass 2, record by record: a record holds the group's heads side by side, so each record's
  // log-decays and x rows are read as one contiguous run (head by head, each record's few
  // bytes were read at a record-sized stride, latency-bound). Per head the sums run in the
  // same order as before: τ·(S_c·C_t) first, then the records in order.
  float* cum = scratch(5, std::size_t(heads_per_group) * count);  // [head, record]: Λ_j
  float* total = scratch(6, heads_per_group);
  std::fill(total, total + heads_per_group, 0.0f);
  for (std::uint32_t j = 0; j < count; ++j) {
    const float* decay = ring_record<input_t>(l, a.layer, row.slot, first + j).decay + h0;
    for (int hh = 0; hh < heads_per_group; ++hh) {
      total[hh] += decay[hh];
      cum[std::size_t(hh) * count + j] = total[hh];
    }
  }
  for (int t = 0; t < T; ++t) {
    const std::uint32_t last = w + static_cast<std::uint32_t>(t);
    for (int hh = 0; hh < heads_per_group; ++hh) {
      const float tau = std::exp(cum[std::size_t(hh) * count + last]);
      float* acc_t = acc_at(hh, t);
      for (int p = 0; p < P; ++p) acc_t[p] *= tau;
    }
    // The ring's contribution: Σ_j s_j·(B_j·C_t)·x_j.
    for (std::uint32_t j = 0; j <= last; ++j) {
      const RingRecord<input_t> rec = ring_record<input_t>(l, a.layer, row.slot, first + j);
      const float bc = BC[std::size_t(t) * count + j];
      for (int hh = 0; hh < heads_per_group; ++hh) {
        const float* cum_h = cum + std::size_t(hh) * count;
        const float coeff = rec.write[h0 + hh] * std::exp(cum_h[last] - cum_h[j]) * bc;
        const input_t* x = rec.vec + std::size_t(h0 + hh) * P;
        float* acc_t = acc_at(hh, t);
        for (int p = 0; p < P; ++p) acc_t[p] += coeff * to_float(x[p]);
      }
    }
    for (int hh = 0; hh < heads_per_group; ++hh) {
      const std::int64_t off = ((std::int64_t{row.b} * T + t) * d.heads + h0 + hh) * P;
      const auto* x_t = static_cast<const input_t*>(a.x) + off;
      const auto* z_t = a.z ? static_cast<const input_t*>(a.z) + off : nullptr;
      store_output(acc_at(hh, t), x_t, z_t, a.D[h0 + hh], P, static_cast<input_t*>(a.y) + off);
    }
  }
}

}  // namespace

void mamba2_decode(StateCacheLayout& l, const Mamba2DecodeArgs& args) {
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
              replay_group<input_t>(l, args, row, unit, fold_due);
            });
      });
}

REPLAYSSM_CPU_END
