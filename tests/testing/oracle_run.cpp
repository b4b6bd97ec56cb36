#include "testing/oracle_run.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <set>

#include "testing/cache_bytes.h"
#include "testing/cache_ops.h"
#include "testing/compare.h"
#include "testing/dtypes.h"
#include "testing/family.h"

namespace replayssm::testing {

namespace {

FamilySettings family_settings(const RunSpec& spec) {
  FamilySettings s;
  s.cache = spec.cache;
  s.recipe = spec.recipe;
  s.gate = spec.gate;
  s.qk_l2norm = spec.qk_l2norm;
  s.scale = spec.scale;
  s.naive_state_dtype = spec.naive_state_dtype;
  return s;
}

// One run of RunSpec: run() goes through the steps below in order. A failed call stops the run;
// a failed integrity check is recorded (the first one wins) and the run goes on.
template <typename Family>
class OracleRun {
 public:
  explicit OracleRun(const RunSpec& spec)
      : spec_(spec),
        B_(spec.batch),
        T_(spec.window),
        NL_(spec.cache.num_layers),
        replay_(spec.cache.mode == DecodeMode::kReplay),
        param_rng_(spec.seed),
        input_rng_(spec.seed * 1000003 + 1),
        accept_rng_(spec.seed * 2000003 + 2),
        fam_(family_settings(spec), param_rng_),
        se_(fam_.state_elems()),
        ot_(fam_.out_per_token()) {}

  RunResult run() {
    if (!take_slots()) return res_;
    start_oracles();
    open_plain_cache();
    for (int step = 0; step < spec_.steps; ++step) {
      const StepRows rows = begin_step(step);
      StepDecodes decodes;
      if (!decode_layers(step, rows, &decodes)) return res_;
      if (!commit_step(rows)) return res_;
      if (plain_ != nullptr && !replay_on_plain(rows, decodes)) return res_;
    }
    check_untouched_slots();
    measure_exported_states();
    return res_;
  }

 private:
  // One step's batch: the slot of each row (−1 while the row pads), and what each accepts.
  struct StepRows {
    std::string at;  // "step N", for messages
    std::vector<std::int32_t> slots;
    std::vector<bool> active;
    std::vector<std::int32_t> accepted;
  };
  // What one step decoded on each layer, for the plain-decoding comparison.
  struct StepDecodes {
    std::vector<typename Family::Tokens> tokens;
    std::vector<std::vector<float>> out;
    std::vector<double> ref_max;  // max|oracle output| over the step's real rows
  };

  void fail(const std::string& msg) {
    if (res_.failure.empty()) res_.failure = msg;
  }

  // Every slot allocated, shuffled onto rows (so row b is rarely slot b), one freed again; the
  // bytes of the slots no row uses, and of each row's slot before the row joins, remembered.
  bool take_slots() {
    cfg_ = spec_.cache;
    cfg_.capacity = B_ + spec_.guard_slots + 1;
    cache_ = create_cache(cfg_);
    Rng slot_rng(spec_.seed * 7919 + 17);
    std::vector<std::int32_t> all;
    for (int i = 0; i < cfg_.capacity; ++i) all.push_back(allocate_slot(*cache_));
    std::shuffle(all.begin(), all.end(), slot_rng.engine());
    row_slot_.assign(all.begin(), all.begin() + B_);
    guards_.assign(all.begin() + B_, all.end() - 1);
    free_slot_ = all.back();
    if (Status st = state_cache_free_slot(*cache_, free_slot_); !st.is_ok()) {
      fail("free_slot: " + st.to_string());
      return false;
    }
    for (std::int32_t g : guards_) guard_bytes_.push_back(slot_bytes(*cache_, g));
    for (std::int32_t s : row_slot_) row_initial_.push_back(slot_bytes(*cache_, s));
    free_bytes_ = slot_bytes(*cache_, free_slot_);
    return true;
  }

  // Every (layer, row) starts from a zero state in the oracle and the naive loop; the output
  // poison pad rows must keep.
  void start_oracles() {
    ref_state_.assign(std::size_t(NL_) * B_, std::vector<double>(se_, 0.0));
    if (spec_.naive) naive_state_.assign(std::size_t(NL_) * B_, std::vector<float>(se_, 0.0f));
    poison_ =
        encode(cfg_.input_dtype, std::vector<float>(std::size_t(B_) * T_ * ot_, std::nanf("")));
  }

  // compare_plain: a T = 1 cache of the same config, one slot per row.
  void open_plain_cache() {
    if (!spec_.compare_plain || T_ <= 1) return;
    StateCacheConfig pc = cfg_;
    pc.max_spec_tokens = 1;
    pc.capacity = B_;
    plain_ = create_cache(pc);
    for (int b = 0; b < B_; ++b) plain_slot_.push_back(allocate_slot(*plain_));
  }

  std::vector<double>& ref_state(int layer, int b) {
    return ref_state_[std::size_t(layer) * B_ + b];
  }
  std::vector<float>& naive_state(int layer, int b) {
    return naive_state_[std::size_t(layer) * B_ + b];
  }

  // Rows that have joined by `step` take their slots (a joining row's slot must still hold
  // its allocated bytes); the ring fill levels of the batch; each row's acceptance draw.
  StepRows begin_step(int step) {
    StepRows r;
    r.at = "step " + std::to_string(step);
    r.slots.assign(std::size_t(B_), -1);
    r.active.assign(std::size_t(B_), false);
    for (int b = 0; b < B_; ++b) {
      r.active[b] = step >= b * spec_.stagger;
      if (!r.active[b]) continue;
      r.slots[b] = row_slot_[b];
      if (step == b * spec_.stagger && step > 0 &&
          slot_bytes(*cache_, row_slot_[b]) != row_initial_[b]) {
        fail(r.at + ": row " + std::to_string(b) + "'s slot changed while the row was padding");
      }
    }
    if (replay_) {
      std::set<std::uint32_t> levels;
      for (int b = 0; b < B_; ++b) {
        if (r.active[b]) {
          levels.insert(cursor_committed(*cache_, r.slots[b]) -
                        cursor_folded(*cache_, 0, r.slots[b]));
        }
      }
      res_.max_distinct_fill_levels = std::max(res_.max_distinct_fill_levels, int(levels.size()));
    }
    r.accepted.assign(std::size_t(B_), 0);
    for (int b = 0; b < B_; ++b) {
      if (r.active[b]) r.accepted[b] = T_ == 1 ? 1 : accept_rng_.uniform_int(0, T_);
    }
    return r;
  }

  // Every layer decodes fresh tokens; its outputs are checked row by row and compared with the
  // oracle's (and the naive loop's). Records the step's errors; false if a decode failed.
  bool decode_layers(int step, const StepRows& rows, StepDecodes* d) {
    double step_err = 0.0, naive_err = 0.0;
    for (int layer = 0; layer < NL_; ++layer) {
      const std::string where = rows.at + " layer " + std::to_string(layer);
      typename Family::Tokens tk = fam_.tokens(B_, T_, input_rng_);
      typename Family::Call call = fam_.call(*cache_, layer, rows.slots, tk);
      call.args.fold_every = fold_every_at(spec_.fold_every, step);
      if (Status st = Family::decode(*cache_, call); !st.is_ok()) {
        fail(where + ": decode: " + st.to_string());
        return false;
      }
      const std::vector<float> out = call.output();
      check_rows(where, rows, Family::raw_output(call), out);
      std::vector<float> got, naive_got;
      std::vector<double> want;
      for (int b = 0; b < B_; ++b) {
        if (!rows.active[b]) continue;
        advance_oracles(layer, b, tk, rows.accepted[b], &want, &naive_got);
        got.insert(got.end(), out.begin() + std::ptrdiff_t(std::size_t(b) * T_ * ot_),
                   out.begin() + std::ptrdiff_t(std::size_t(b + 1) * T_ * ot_));
      }
      step_err = std::max(step_err, rel_error(got, want));
      if (spec_.naive) naive_err = std::max(naive_err, rel_error(naive_got, want));
      double m = 0.0;
      for (double w : want) m = std::max(m, std::fabs(w));
      d->ref_max.push_back(m);
      d->out.push_back(out);
      d->tokens.push_back(std::move(tk));
    }
    res_.step_error.push_back(step_err);
    res_.max_error = std::max(res_.max_error, step_err);
    if (spec_.naive) {
      res_.naive_step_error.push_back(naive_err);
      res_.naive_max_error = std::max(res_.naive_max_error, naive_err);
    }
    return true;
  }

  // Pad rows keep their poison bit for bit; real rows are written with finite values.
  void check_rows(const std::string& where, const StepRows& rows,
                  const std::vector<std::uint8_t>& raw, const std::vector<float>& out) {
    const std::size_t row_bytes = std::size_t(T_) * ot_ * dtype_size(cfg_.input_dtype);
    for (int b = 0; b < B_; ++b) {
      if (!rows.active[b]) {
        if (!std::equal(raw.begin() + std::ptrdiff_t(b * row_bytes),
                        raw.begin() + std::ptrdiff_t((b + 1) * row_bytes),
                        poison_.begin() + std::ptrdiff_t(b * row_bytes))) {
          fail(where + ": pad row " + std::to_string(b) + "'s output was written");
        }
      } else if (!all_finite(out.data() + std::size_t(b) * T_ * ot_, std::size_t(T_) * ot_)) {
        fail(where + ": row " + std::to_string(b) + " has a non-finite (or unwritten) output");
      }
    }
  }

  // Row b's window through the oracle (and the naive loop), chained token by token; the state
  // after the accepted prefix becomes the row's state. The outputs are appended to *want
  // (*naive_got).
  void advance_oracles(int layer, int b, const typename Family::Tokens& tk, int accepted,
                       std::vector<double>* want, std::vector<float>* naive_got) {
    std::vector<double> ref(std::size_t(T_) * ot_);
    std::vector<double> S = ref_state(layer, b);
    for (int t = 0; t < T_; ++t) {
      fam_.oracle(layer, S.data(), tk, b, t, ref.data() + std::size_t(t) * ot_);
      if (t + 1 == accepted) ref_state(layer, b) = S;
    }
    want->insert(want->end(), ref.begin(), ref.end());
    if (!spec_.naive) return;
    std::vector<float> nref(std::size_t(T_) * ot_);
    std::vector<float> NS = naive_state(layer, b);
    for (int t = 0; t < T_; ++t) {
      fam_.naive(layer, NS, tk, b, t, nref.data() + std::size_t(t) * ot_);
      if (t + 1 == accepted) naive_state(layer, b) = NS;
    }
    naive_got->insert(naive_got->end(), nref.begin(), nref.end());
  }

  // Caches that hold windows (replay, eager with T > 1) commit each row's accepted count; an
  // eager T = 1 cache updated its state in place and has nothing to commit.
  bool commit_step(const StepRows& rows) {
    if (replay_ || cfg_.max_spec_tokens > 1) {
      if (Status st = commit(*cache_, rows.slots, rows.accepted); !st.is_ok()) {
        fail(rows.at + ": commit: " + st.to_string());
        return false;
      }
    }
    for (int b = 0; b < B_; ++b) res_.tokens_committed += rows.accepted[b];
    return true;
  }

  // The accepted tokens, one at a time, through the plain cache: each output must match the
  // window's at the same position. Records plain_max_error; false if a call failed.
  bool replay_on_plain(const StepRows& rows, const StepDecodes& d) {
    const int max_k = *std::max_element(rows.accepted.begin(), rows.accepted.end());
    for (int i = 0; i < max_k; ++i) {
      std::vector<std::int32_t> ps(std::size_t(B_), -1), ones(std::size_t(B_), 0);
      for (int b = 0; b < B_; ++b) {
        if (rows.active[b] && rows.accepted[b] > i) {
          ps[b] = plain_slot_[b];
          ones[b] = 1;
        }
      }
      for (int layer = 0; layer < NL_; ++layer) {
        const typename Family::Tokens ptk = token_at(d.tokens[std::size_t(layer)], i);
        const typename Family::Call call = fam_.call(*plain_, layer, ps, ptk);
        if (Status st = Family::decode(*plain_, call); !st.is_ok()) {
          fail(rows.at + ": plain decode: " + st.to_string());
          return false;
        }
        const std::vector<float> pout = call.output();
        const std::vector<float>& wout = d.out[std::size_t(layer)];
        double diff = 0.0;
        for (int b = 0; b < B_; ++b) {
          if (ps[b] < 0) continue;
          for (std::size_t e = 0; e < ot_; ++e) {
            const float p = pout[std::size_t(b) * ot_ + e];
            const float w = wout[(std::size_t(b) * T_ + i) * ot_ + e];
            diff = std::isfinite(p) ? std::max(diff, double(std::fabs(p - w)))
                                    : std::numeric_limits<double>::infinity();
          }
        }
        const double m = d.ref_max[std::size_t(layer)];
        res_.plain_max_error = std::max(res_.plain_max_error, m > 0.0 ? diff / m : diff);
      }
      if (Status st = commit(*plain_, ps, ones); !st.is_ok()) {
        fail(rows.at + ": plain commit: " + st.to_string());
        return false;
      }
    }
    return true;
  }

  void check_untouched_slots() {
    for (std::size_t g = 0; g < guards_.size(); ++g) {
      if (slot_bytes(*cache_, guards_[g]) != guard_bytes_[g]) {
        fail("guard slot " + std::to_string(guards_[g]) + " was written");
      }
    }
    if (slot_bytes(*cache_, free_slot_) != free_bytes_) {
      fail("free slot " + std::to_string(free_slot_) + " was written");
    }
  }

  // The exported state of every (layer, row that joined) against the oracle's.
  void measure_exported_states() {
    for (int layer = 0; layer < NL_; ++layer) {
      for (int b = 0; b < B_; ++b) {
        if (spec_.steps <= b * spec_.stagger) continue;
        std::vector<float> S(se_);
        if (Status st = state_cache_export_state(*cache_, layer, row_slot_[b], S.data());
            !st.is_ok()) {
          fail("export: " + st.to_string());
          return;
        }
        res_.export_error = std::max(res_.export_error, rel_error(S, ref_state(layer, b)));
      }
    }
  }

  const RunSpec& spec_;
  const int B_, T_, NL_;
  const bool replay_;
  Rng param_rng_, input_rng_, accept_rng_;
  const Family fam_;  // after param_rng_: it draws the layers' parameters from it
  const std::size_t se_, ot_;
  RunResult res_;

  StateCacheConfig cfg_;
  std::unique_ptr<StateCache> cache_;
  std::vector<std::int32_t> row_slot_, guards_;
  std::int32_t free_slot_ = -1;
  std::vector<std::vector<std::uint8_t>> guard_bytes_, row_initial_;
  std::vector<std::uint8_t> free_bytes_;

  std::vector<std::vector<double>> ref_state_;  // [layer·B + row]
  std::vector<std::vector<float>> naive_state_;
  std::vector<std::uint8_t> poison_;

  std::unique_ptr<StateCache> plain_;
  std::vector<std::int32_t> plain_slot_;
};

}  // namespace

RunResult run_mamba2(const RunSpec& spec) { return OracleRun<Mamba2Family>(spec).run(); }
RunResult run_gdn(const RunSpec& spec) { return OracleRun<GdnFamily>(spec).run(); }

RunResult run_oracle(const RunSpec& spec) {
  return with_family(spec.cache.kind, [&](auto family) {
    return OracleRun<typename decltype(family)::type>(spec).run();
  });
}

RunSpec gdn_long_memory_spec(int buffer_len, int steps) {
  RunSpec spec;
  spec.cache.kind = LayerKind::kGdn;
  spec.cache.gdn = GdnShape{2, 4, 32, 16};
  spec.cache.mode = DecodeMode::kReplay;
  spec.cache.input_dtype = DType::kF32;
  spec.cache.buffer_len = buffer_len;
  spec.recipe.g_fixed = -0.001;
  spec.recipe.beta_lo = 0.02;
  spec.recipe.beta_hi = 0.06;
  spec.batch = 2;
  spec.steps = steps;
  spec.seed = 901;
  spec.guard_slots = 0;
  return spec;
}

}  // namespace replayssm::testing
