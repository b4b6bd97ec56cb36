// Prefix caching on a replay cache (include/replayssm/prefix.h), both layer kinds, every
// checkpoint precision:
//   - materialize at every position of the window equals, bit for bit, what a fold of a copy
//     of the slot to that position stores, and the float64 oracle's state within the
//     precision's bound; the cache is not changed;
//   - a forked slot, a truncated slot and a slot restored from an exact entry decode on bit for
//     bit as the original did; one restored from an entry inside the window within the
//     precision's bound of the oracle;
//   - every refusal leaves every byte as it was;
//   - a cache that shares forked checkpoints (copy on fold) writes no checkpoint at a fork,
//     and its slots decode, fold, export and materialize bit for bit as a cache that copies
//     at fork does, through random serving (forks, frees, loads, truncations, windows).
// The CUDA cases (names containing "Cuda", label `cuda`, skipped without a GPU) run the same
// workloads on a CUDA cache against the CPU cache and the oracle, and capture the batched ops
// in a CUDA graph.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(REPLAYSSM_WITH_CUDA)
#include <cuda_runtime.h>
#endif

#include "backend.h"
#include "cache_buffers.h"
#include "common/numeric.h"
#include "cpu/reference.h"
#include "prefix_backend.h"
#include "replayssm/prefix.h"
#include "testing/require_gpu.h"
#include "testing/test_util.h"

namespace replayssm {
namespace {

using testing::CacheBuffer;
using testing::Rng;

const Mamba2Shape kM2{4, 8, 16, 2};
const GdnShape kGdn{2, 4, 16, 8};
constexpr int kBufferLen = 4;
constexpr int kLayers = 2;

// ---- the cases -------------------------------------------------------------------------------

struct PrefixCase {
  LayerKind kind;
  CheckpointPrecision precision;
  DType input = DType::kF32;
  int window = 1;  // T of every decode; T > 1 commits k ~ U{1..T}
  Device device = Device::kCpu;
  int buffer_len = kBufferLen;  // L
};

std::string case_tag(const PrefixCase& c) {
  return std::string(c.kind == LayerKind::kMamba2 ? "Mamba2" : "Gdn") + "_" +
         testing::precision_tag(c.precision) + "_in" + testing::dtype_tag(c.input) +
         testing::int_tag("_T", c.window) +
         (c.buffer_len == kBufferLen ? "" : testing::int_tag("_L", c.buffer_len));
}
std::string case_name(const ::testing::TestParamInfo<PrefixCase>& info) {
  return case_tag(info.param);
}
void PrintTo(const PrefixCase& c, std::ostream* os) { *os << case_tag(c); }

constexpr CheckpointPrecision kPrecisions[] = {
    CheckpointPrecision::kFp32, CheckpointPrecision::kBf16, CheckpointPrecision::kFp32Bf16,
    CheckpointPrecision::kFp32Fp8};

// Every kind × precision with plain decoding (the continuation tests compare bit for bit, so
// they need one fold schedule), and with `spec` also windows of 3 and bf16 inputs.
std::vector<PrefixCase> cases(bool spec, Device device = Device::kCpu) {
  std::vector<PrefixCase> out;
  for (LayerKind k : {LayerKind::kMamba2, LayerKind::kGdn}) {
    for (CheckpointPrecision p : kPrecisions) {
      out.push_back({k, p, DType::kF32, 1, device});
      if (spec) out.push_back({k, p, DType::kF32, 3, device});
    }
    if (spec) out.push_back({k, CheckpointPrecision::kFp32Bf16, DType::kBF16, 1, device});
    // More records than the CUDA kernel stages at once (32).
    if (spec) out.push_back({k, CheckpointPrecision::kFp32Bf16, DType::kF32, 1, device, 40});
  }
  return out;
}

StateCacheConfig case_config(const PrefixCase& c, int capacity) {
  StateCacheConfig cfg;
  cfg.kind = c.kind;
  cfg.mamba2 = kM2;
  cfg.gdn = kGdn;
  cfg.num_layers = kLayers;
  cfg.capacity = capacity;
  cfg.device = c.device;
  cfg.input_dtype = c.input;
  cfg.buffer_len = c.buffer_len;
  cfg.max_spec_tokens = c.window;
  cfg.checkpoint = c.precision;
  return cfg;
}

// Bounds against the float64 oracle (u: the read copy's unit roundoff). States: a fold keeps
// an fp32 master except in shared bf16, whose rounding accumulates. Outputs read the low copy.
double state_bound(CheckpointPrecision p) {
  return p == CheckpointPrecision::kBf16 ? 4.0 / 256 : 1e-5;
}
double output_bound(CheckpointPrecision p) {
  switch (p) {
    case CheckpointPrecision::kFp32: return 1e-5;
    case CheckpointPrecision::kBf16: return 4.0 / 256;
    case CheckpointPrecision::kFp32Bf16: return 2.0 / 256;
    case CheckpointPrecision::kFp32Fp8: return 2.0 / 16;
  }
  return 0.0;
}

// ---- a workload: sequences of tokens per layer, the oracle's states and outputs --------------

struct Row {
  int slot;
  int seq;
  int first;  // the sequence position of the row's first token
};

class Workload {
 public:
  Workload(const StateCacheConfig& cfg, int sequences, int length, std::uint64_t seed)
      : cfg_(cfg), length_(length) {
    Rng rng(seed);
    const testing::Recipe recipe;
    const StateDims d = cfg.dims();
    for (int layer = 0; layer < cfg.num_layers; ++layer) {
      m2_params_.push_back(testing::make_mamba2_layer(kM2, recipe, rng));
    }
    for (int s = 0; s < sequences; ++s) {
      for (int layer = 0; layer < cfg.num_layers; ++layer) {
        if (cfg.kind == LayerKind::kMamba2) {
          m2_.push_back(testing::make_mamba2_tokens(kM2, 1, length, cfg.input_dtype, true,
                                                    recipe, rng));
        } else {
          gdn_.push_back(testing::make_gdn_tokens(kGdn, 1, length, cfg.input_dtype, recipe, rng));
        }
        std::vector<float> init(std::size_t(d.state_elems()));
        for (float& v : init) v = float(rng.normal(0.0, 0.5));
        initial_.push_back(init);
        run_oracle(layer);
      }
    }
  }

  int length() const { return length_; }
  std::size_t state_elems() const { return std::size_t(cfg_.dims().state_elems()); }
  std::size_t out_per_token() const {
    return std::size_t(cfg_.dims().heads) * std::size_t(cfg_.dims().rows);
  }
  /// The oracle's state of (seq, layer) after its first n tokens, and output of token t.
  const std::vector<double>& state(int seq, int layer, int n) const {
    return states_[index(seq, layer)][std::size_t(n)];
  }
  const std::vector<double>& output(int seq, int layer, int t) const {
    return outputs_[index(seq, layer)][std::size_t(t)];
  }

  /// Loads every layer's initial state of `seq` into `slot` (the prefill hand-off).
  void load(StateCache& cache, int slot, int seq) const {
    for (int layer = 0; layer < cfg_.num_layers; ++layer) {
      const std::vector<float>& s = initial_[index(seq, layer)];
      CacheBuffer buf = CacheBuffer::from_vector(cache.config().device, s);
      ASSERT_TRUE(state_cache_load_state(cache, layer, slot, buf.as<const float>()).is_ok());
    }
  }

  /// One decode of every layer: row r verifies tokens first..first+T-1 of its sequence in its
  /// slot. Returns the outputs, [layer][row, T, heads·rows].
  std::vector<std::vector<float>> decode(StateCache& cache, const std::vector<Row>& rows,
                                         int T) const {
    std::vector<std::int32_t> slots;
    for (const Row& r : rows) slots.push_back(r.slot);
    std::vector<std::vector<float>> out;
    const auto run = [&](const auto& call, const Status& st) {
      EXPECT_TRUE(st.is_ok()) << st.to_string();
      out.push_back(call.output());
    };
    using testing::GdnTokens;
    using testing::Mamba2Tokens;
    for (int layer = 0; layer < cfg_.num_layers; ++layer) {
      if (cfg_.kind == LayerKind::kMamba2) {
        const Mamba2Tokens t = gather(m2_, layer, rows, T,
                                      {&Mamba2Tokens::x, &Mamba2Tokens::dt, &Mamba2Tokens::B,
                                       &Mamba2Tokens::C, &Mamba2Tokens::z});
        const auto call =
            testing::make_mamba2_call(cache, layer, slots, m2_params_[std::size_t(layer)], t);
        run(call, mamba2_decode(cache, call.args));
      } else {
        const GdnTokens t = gather(gdn_, layer, rows, T,
                                   {&GdnTokens::q, &GdnTokens::k, &GdnTokens::v, &GdnTokens::g,
                                    &GdnTokens::beta});
        const auto call = testing::make_gdn_call(cache, layer, slots, t, true, 0.0f);
        run(call, gdn_decode(cache, call.args));
      }
    }
    return out;
  }

  /// decode() with T = 1 and a commit of the token: the next token of each row.
  std::vector<std::vector<float>> step(StateCache& cache, const std::vector<Row>& rows) const {
    auto out = decode(cache, rows, 1);
    std::vector<std::int32_t> slots, ones;
    for (const Row& r : rows) {
      slots.push_back(r.slot);
      ones.push_back(1);
    }
    EXPECT_TRUE(testing::commit(cache, slots, ones).is_ok());
    return out;
  }

 private:
  std::size_t index(int seq, int layer) const {
    return std::size_t(seq) * std::size_t(cfg_.num_layers) + std::size_t(layer);
  }
  // The rows' tokens of one layer as one decode's batch: each field of `fields` gathered.
  template <typename Tokens>
  Tokens gather(const std::vector<Tokens>& all, int layer, const std::vector<Row>& rows, int T,
                std::initializer_list<std::vector<float> Tokens::*> fields) const {
    Tokens t;
    t.batch = int(rows.size());
    t.T = T;
    for (const Row& r : rows) {
      for (auto f : fields) append(all[index(r.seq, layer)].*f, r.first, T, &(t.*f));
    }
    return t;
  }
  // Tokens first..first+T-1 of a [1, length, e] field, appended to `out`.
  void append(const std::vector<float>& f, int first, int T, std::vector<float>* out) const {
    if (f.empty()) return;
    const std::size_t e = f.size() / std::size_t(length_);
    out->insert(out->end(), f.begin() + std::ptrdiff_t(std::size_t(first) * e),
                f.begin() + std::ptrdiff_t(std::size_t(first + T) * e));
  }
  void run_oracle(int layer) {
    const StateDims d = cfg_.dims();
    std::vector<double> S(initial_.back().begin(), initial_.back().end());
    std::vector<std::vector<double>> states = {S}, outputs;
    std::vector<double> y(out_per_token());
    for (int t = 0; t < length_; ++t) {
      if (cfg_.kind == LayerKind::kMamba2) {
        const testing::Mamba2Tokens& k = m2_.back();
        const testing::Mamba2Layer& p = m2_params_[std::size_t(layer)];
        const std::size_t i = std::size_t(t);
        reference::mamba2_reference_step(
            kM2, S.data(), k.x.data() + i * d.heads * d.rows, k.dt.data() + i * d.heads,
            k.B.data() + i * d.key_heads * d.cols, k.C.data() + i * d.key_heads * d.cols,
            k.z.data() + i * d.heads * d.rows, p.A.data(), p.D.data(), p.dt_bias.data(),
            y.data());
      } else {
        const testing::GdnTokens& k = gdn_.back();
        const std::size_t i = std::size_t(t);
        reference::gdn_reference_step(kGdn, S.data(), k.q.data() + i * d.key_heads * d.cols,
                                      k.k.data() + i * d.key_heads * d.cols,
                                      k.v.data() + i * d.heads * d.rows, k.g.data() + i * d.heads,
                                      k.beta.data() + i * d.heads, true, 0.0f, y.data());
      }
      states.push_back(S);
      outputs.push_back(y);
    }
    states_.push_back(std::move(states));
    outputs_.push_back(std::move(outputs));
  }
  StateCacheConfig cfg_;
  int length_;
  std::vector<testing::Mamba2Layer> m2_params_;
  std::vector<testing::Mamba2Tokens> m2_;  // [seq][layer]
  std::vector<testing::GdnTokens> gdn_;    // [seq][layer]
  std::vector<std::vector<float>> initial_;
  std::vector<std::vector<std::vector<double>>> states_, outputs_;  // [seq][layer][n]
};

// ---- helpers ---------------------------------------------------------------------------------

void claim(StateCache& cache, std::initializer_list<int> slots) {
  for (int s : slots) EXPECT_TRUE(state_cache_claim_slot(cache, s).is_ok());
}

// The positions in reach of `slot`: [max over layers of folded, committed].
std::pair<std::uint32_t, std::uint32_t> reach(const StateCache& cache, int slot) {
  std::uint32_t lo = 0;
  for (int layer = 0; layer < cache.config().num_layers; ++layer) {
    lo = std::max(lo, testing::cursor_folded(cache, layer, slot));
  }
  return {lo, testing::cursor_committed(cache, slot)};
}

// The bytes of one buffer's region of (layer, slot) (or of the slot, for per-slot buffers).
std::vector<std::uint8_t> region(const StateCache& cache, CacheBufferId id, int layer, int slot) {
  for (const CacheBufferSpec& s : cache_buffer_specs(cache.config())) {
    if (s.id != id) continue;
    const std::int64_t bytes = slot_region_bytes(s);
    const std::int64_t index = s.slot_axis == 1
                                   ? std::int64_t{layer} * cache.config().capacity + slot
                                   : slot;
    std::vector<std::uint8_t> out(static_cast<std::size_t>(bytes));
    EXPECT_TRUE(memory_to_host(cache.config().device, out.data(),
                               static_cast<const char*>(cache.buffer(id)) + index * bytes,
                               out.size())
                    .is_ok());
    return out;
  }
  return {};
}

// What a fold to p stores, by the cache's own ops and none of prefix.h: slot `src` copied into
// `scratch` through the buffer list (every slot sits at its index of every buffer), its
// committed cursor set to p, folded, exported (CPU caches).
std::vector<std::vector<float>> fold_to(StateCache& cache, int src, std::uint32_t p,
                                        int scratch) {
  for (const CacheBufferSpec& s : cache_buffer_specs(cache.config())) {
    if (s.id == CacheBufferId::kAllocated) continue;
    const std::int64_t bytes = slot_region_bytes(s);
    for (std::int64_t o = 0; o < slot_region_count(s); ++o) {
      char* base = static_cast<char*>(cache.buffer(s.id)) + o * cache.config().capacity * bytes;
      std::memcpy(base + scratch * bytes, base + src * bytes, std::size_t(bytes));
    }
  }
  cache.layout().committed[scratch] = p;
  EXPECT_TRUE(testing::fold(cache, {scratch}).is_ok());
  std::vector<std::vector<float>> out(std::size_t(cache.config().num_layers));
  for (int layer = 0; layer < cache.config().num_layers; ++layer) {
    EXPECT_TRUE(testing::export_state(cache, layer, scratch, &out[std::size_t(layer)]).is_ok());
  }
  return out;
}

// state_cache_materialize of (slot, position) pairs, the states as host fp32, [pair][layer].
// The output starts as a sentinel; a pair with slot -1 must leave it.
constexpr float kSentinel = -1234.5f;
std::vector<std::vector<std::vector<float>>> materialize(
    StateCache& cache, const std::vector<std::int32_t>& slots,
    const std::vector<std::uint32_t>& positions, Status* status = nullptr) {
  const Device dev = cache.config().device;
  const std::size_t n = std::size_t(cache.config().dims().state_elems());
  const std::size_t layers = std::size_t(cache.config().num_layers);
  std::vector<float> host(slots.size() * layers * n, kSentinel);
  CacheBuffer s = CacheBuffer::from_vector(dev, slots);
  CacheBuffer p = CacheBuffer::from_vector(dev, positions);
  CacheBuffer out = CacheBuffer::from_vector(dev, host);
  MaterializeArgs a;
  a.batch = int(slots.size());
  a.slot_ids = s.as<const std::int32_t>();
  a.positions = p.as<const std::uint32_t>();
  a.states = out.as<float>();
  const Status st = state_cache_materialize(cache, a);
  if (status != nullptr) {
    *status = st;
  } else {
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }
  out.download(host.data(), host.size() * 4);
  std::vector<std::vector<std::vector<float>>> res(slots.size());
  for (std::size_t b = 0; b < slots.size(); ++b) {
    for (std::size_t l = 0; l < layers; ++l) {
      const auto at = host.begin() + std::ptrdiff_t((b * layers + l) * n);
      res[b].emplace_back(at, at + std::ptrdiff_t(n));
    }
  }
  return res;
}

Status fork(StateCache& cache, const std::vector<std::int32_t>& src,
            const std::vector<std::int32_t>& dst, const std::vector<std::uint32_t>& positions) {
  const Device dev = cache.config().device;
  CacheBuffer s = CacheBuffer::from_vector(dev, src);
  CacheBuffer d = CacheBuffer::from_vector(dev, dst);
  CacheBuffer p = CacheBuffer::from_vector(dev, positions);
  ForkArgs a;
  a.batch = int(src.size());
  a.src_slots = s.as<const std::int32_t>();
  a.dst_slots = d.as<const std::int32_t>();
  a.positions = p.as<const std::uint32_t>();
  return state_cache_fork(cache, a);
}

Status truncate(StateCache& cache, const std::vector<std::int32_t>& slots,
                const std::vector<std::uint32_t>& positions) {
  const Device dev = cache.config().device;
  CacheBuffer s = CacheBuffer::from_vector(dev, slots);
  CacheBuffer p = CacheBuffer::from_vector(dev, positions);
  TruncateArgs a;
  a.batch = int(slots.size());
  a.slot_ids = s.as<const std::int32_t>();
  a.positions = p.as<const std::uint32_t>();
  return state_cache_truncate(cache, a);
}

// A stored entry in cache memory: every layer's state and `count` records.
struct Entry {
  CacheBuffer states, vec, key, key_scale, write, decay;
  CacheRecords records;
  std::vector<float> host_states;
};

Entry make_entry(const StateCache& cache, const std::vector<std::vector<float>>& states,
                 int count) {
  const StateCacheConfig& c = cache.config();
  const StateDims d = c.dims();
  Entry e;
  for (const auto& s : states) e.host_states.insert(e.host_states.end(), s.begin(), s.end());
  e.states = CacheBuffer::from_vector(c.device, e.host_states);
  const std::size_t n = std::size_t(c.num_layers) * std::size_t(std::max(count, 1));
  const std::size_t in = dtype_size(c.input_dtype);
  e.vec = CacheBuffer(c.device, n * std::size_t(d.heads * d.rows) * in);
  e.key = CacheBuffer(c.device, n * std::size_t(d.key_heads * d.cols) * in);
  e.key_scale = CacheBuffer(c.device, n * std::size_t(d.key_heads) * 4);
  e.write = CacheBuffer(c.device, n * std::size_t(d.heads) * 4);
  e.decay = CacheBuffer(c.device, n * std::size_t(d.heads) * 4);
  e.records.count = count;
  e.records.vec = e.vec.get();
  e.records.key = e.key.get();
  e.records.key_scale = c.kind == LayerKind::kGdn ? e.key_scale.as<float>() : nullptr;
  e.records.write = e.write.as<float>();
  e.records.decay = e.decay.as<float>();
  return e;
}

// The entry of `slot` at position p with the records p..committed-1.
Entry take_entry(StateCache& cache, int slot, std::uint32_t p) {
  const std::uint32_t committed = testing::cursor_committed(cache, slot);
  Entry e = make_entry(cache, materialize(cache, {slot}, {p})[0], int(committed - p));
  const Status st = state_cache_read_records(cache, slot, p, e.records);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return e;
}

Status restore(StateCache& cache, int slot, std::uint32_t position, const Entry& e) {
  RestoreArgs a;
  a.slot = slot;
  a.position = position;
  a.states = e.states.as<const float>();
  a.records = e.records;
  return state_cache_restore(cache, a);
}

double rel_to_oracle(const std::vector<float>& v, const std::vector<double>& ref,
                     std::size_t begin = 0, std::size_t count = 0) {
  if (count == 0) count = v.size();
  return testing::rel_error(v.data() + begin, ref.data(), count);
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// A sequence's outputs by position, [layer][position] -> that token's output.
using Recorded = std::vector<std::vector<std::vector<float>>>;

// Runs sequence `seq` alone through `length` tokens of a fresh slot of `cache`, one token a
// step, recording every output: what a slot continuing the same sequence must reproduce.
Recorded record(StateCache& cache, const Workload& w, int slot, int seq) {
  w.load(cache, slot, seq);
  Recorded rec(static_cast<std::size_t>(kLayers));
  for (int t = 0; t < w.length(); ++t) {
    const auto out = w.step(cache, {{slot, seq, t}});
    for (int l = 0; l < kLayers; ++l) rec[std::size_t(l)].push_back(out[std::size_t(l)]);
  }
  return rec;
}

// Decodes `rows` on, one token a step, until each reaches the end of its sequence; every output
// must equal `rec`'s bit for bit (rec[row] records the row's sequence).
void expect_continues_as(StateCache& cache, const Workload& w, std::vector<Row> rows,
                         const std::vector<const Recorded*>& rec) {
  while (true) {
    std::vector<Row> live;
    std::vector<std::size_t> which;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (rows[i].first < w.length()) {
        live.push_back(rows[i]);
        which.push_back(i);
      }
    }
    if (live.empty()) return;
    const auto out = w.step(cache, live);
    const std::size_t per = w.out_per_token();
    for (std::size_t j = 0; j < live.size(); ++j) {
      for (int l = 0; l < kLayers; ++l) {
        const std::vector<float>& o = out[std::size_t(l)];
        const std::vector<float> got(o.begin() + std::ptrdiff_t(j * per),
                                     o.begin() + std::ptrdiff_t((j + 1) * per));
        ASSERT_TRUE(same_bits(got, (*rec[which[j]])[std::size_t(l)][std::size_t(live[j].first)]))
            << "row " << which[j] << " (slot " << live[j].slot << "), layer " << l
            << ", position " << live[j].first;
      }
      ++rows[which[j]].first;
    }
  }
}

// ---- materialize -----------------------------------------------------------------------------

// Two sequences in slots 3 and 1 (the second joining 3 steps late) decode windows of T tokens,
// committing k ~ U{1..T} (1 for T = 1), for 6 fold cycles of kBufferLen (2 of a longer L), on
// one cache or several in lockstep.
class TwoSequences {
 public:
  static constexpr int kSlot[2] = {3, 1};

  explicit TwoSequences(const PrefixCase& c)
      : T_(c.window),
        length_(std::max(6 * kBufferLen, 2 * c.buffer_len) + T_),
        work_(cpu_config(c), 2, length_ + T_, 17) {}

  const Workload& work() const { return work_; }
  void admit(StateCache& cache) const {
    claim(cache, {kSlot[0], kSlot[1]});
    work_.load(cache, kSlot[0], 0);
    work_.load(cache, kSlot[1], 1);
  }
  bool done() const { return pos_[0] >= length_ - T_; }
  /// One step on every cache: the same windows and accepted counts.
  void step(std::initializer_list<StateCache*> caches) {
    std::vector<Row> rows = {{kSlot[0], 0, pos_[0]}};
    if (steps_++ >= 3) rows.push_back({kSlot[1], 1, pos_[1]});
    std::vector<std::int32_t> slots, accepted;
    for (const Row& r : rows) {
      slots.push_back(r.slot);
      accepted.push_back(T_ == 1 ? 1 : accept_.uniform_int(1, T_));
    }
    for (StateCache* cache : caches) {
      work_.decode(*cache, rows, T_);
      EXPECT_TRUE(testing::commit(*cache, slots, accepted).is_ok());
    }
    for (std::size_t i = 0; i < rows.size(); ++i) pos_[rows[i].seq] += accepted[i];
  }
  /// Every position in reach of both sequences in `cache`, as (slot, position, sequence).
  void pairs(const StateCache& cache, std::vector<std::int32_t>* slots,
             std::vector<std::uint32_t>* positions, std::vector<int>* seqs) {
    for (int q = 0; q < 2; ++q) {
      const auto [lo, hi] = reach(cache, kSlot[q]);
      EXPECT_EQ(hi, std::uint32_t(pos_[q]));
      max_records_ = std::max(max_records_, int(hi - lo));
      for (std::uint32_t p = lo; p <= hi; ++p) {
        slots->push_back(kSlot[q]);
        positions->push_back(p);
        seqs->push_back(q);
      }
    }
  }
  std::uint32_t position(int seq) const { return std::uint32_t(pos_[seq]); }
  /// The most records between a fold and a position that pairs() listed.
  int max_records() const { return max_records_; }

 private:
  static StateCacheConfig cpu_config(PrefixCase c) {
    c.device = Device::kCpu;
    return case_config(c, 6);
  }
  int T_, length_;
  Workload work_;
  Rng accept_{5};
  int pos_[2] = {0, 0};
  int steps_ = 0;
  int max_records_ = 0;
};


class Materialize : public ::testing::TestWithParam<PrefixCase> {};

// Two sequences (the second joins 3 steps late) decode 6 fold cycles; after every commit, every
// position in reach of each is materialized in one batched call with a pad row, and checked
// against a fold of a copy of the slot to that position and against the oracle.
TEST_P(Materialize, EveryPositionInReachIsTheFoldToItAndTheOracle) {
  const PrefixCase& c = GetParam();
  auto cache = testing::create_cache(case_config(c, 6));
  TwoSequences run(c);
  const Workload& w = run.work();
  const int scratch = 4;
  run.admit(*cache);
  claim(*cache, {scratch});
  double worst = 0.0;
  int checked = 0;
  for (int step = 0; !run.done(); ++step) {
    run.step({cache.get()});
    std::vector<std::int32_t> pair_slots = {-1};
    std::vector<std::uint32_t> pair_pos = {0};
    std::vector<int> pair_seq = {-1};
    run.pairs(*cache, &pair_slots, &pair_pos, &pair_seq);
    const testing::CacheBytes before = testing::snapshot(*cache);
    const auto got = materialize(*cache, pair_slots, pair_pos);
    ASSERT_EQ(testing::diff(testing::snapshot(*cache), before), "") << "materialize wrote the cache";
    for (const auto& layer : got[0]) {
      ASSERT_TRUE(std::all_of(layer.begin(), layer.end(), [](float v) { return v == kSentinel; }))
          << "the pad row's output was written";
    }
    for (std::size_t b = 1; b < pair_slots.size(); ++b) {
      const auto fold = fold_to(*cache, pair_slots[b], pair_pos[b], scratch);
      for (int l = 0; l < kLayers; ++l) {
        std::vector<float> m = got[b][std::size_t(l)];
        // Shared bf16: a fold stores the state rounded into its only copy.
        if (c.precision == CheckpointPrecision::kBf16) testing::round_all(DType::kBF16, &m);
        ASSERT_TRUE(same_bits(m, fold[std::size_t(l)]))
            << "step " << step << ", slot " << pair_slots[b] << ", position " << pair_pos[b]
            << ", layer " << l << ": not the state a fold to it stores";
        const double err =
            rel_to_oracle(got[b][std::size_t(l)], w.state(pair_seq[b], l, int(pair_pos[b])));
        worst = std::max(worst, err);
        ASSERT_LE(err, state_bound(c.precision))
            << "step " << step << ", position " << pair_pos[b] << ", layer " << l;
      }
      ++checked;
    }
  }
  // Every position of a window was reached, and the states really moved.
  EXPECT_GT(checked, 6 * kBufferLen);
  if (c.buffer_len > 32) {
    EXPECT_GT(run.max_records(), 32) << "no position needed two chunks of the CUDA kernel";
  }
  EXPECT_GT(worst, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Prefix, Materialize, ::testing::ValuesIn(cases(true)), case_name);

// ---- fork, truncate, restore: decoding on --------------------------------------------------

class Continue : public ::testing::TestWithParam<PrefixCase> {
 protected:
  static constexpr int kLength = 5 * kBufferLen;
  // The source: sequence 0 in slot 0, run to 2L + 2 tokens (folded at 2L, 2 beyond).
  static constexpr int kSource = 0, kRunTo = 2 * kBufferLen + 2;

  void SetUp() override { set_up(/*share=*/false); }
  // The source decoded to kRunTo in cache_ (sharing forked checkpoints when `share`), and the
  // outputs of the same sequence in a cache that copies at fork.
  void set_up(bool share) {
    const PrefixCase& c = GetParam();
    if (c.device == Device::kCuda) {
      SKIP_WITHOUT_GPU();
    }
    cfg_ = case_config(c, 8);
    cfg_.share_forked_checkpoints = share;
    work_ = std::make_unique<Workload>(cfg_, 1, kLength, 29);
    auto ref = testing::create_cache(case_config(c, 8));
    claim(*ref, {5});
    recorded_ = record(*ref, *work_, 5, 0);
    cache_ = testing::create_cache(cfg_);
    claim(*cache_, {kSource});
    work_->load(*cache_, kSource, 0);
    for (int t = 0; t < kRunTo; ++t) work_->step(*cache_, {{kSource, 0, t}});
  }

  StateCacheConfig cfg_;
  std::unique_ptr<Workload> work_;
  Recorded recorded_;
  std::unique_ptr<StateCache> cache_;
};

// Every position in reach forked at once into its own slot: each copy holds the source's
// checkpoint and records and decodes on exactly as the source did; the source is untouched.
TEST_P(Continue, ForkedSlotsDecodeOnAsTheSourceDid) {
  StateCache& cache = *cache_;
  const auto [lo, hi] = reach(cache, kSource);
  ASSERT_EQ(hi - lo, 2u);  // three positions
  std::vector<std::int32_t> src, dst;
  std::vector<std::uint32_t> at;
  std::vector<Row> rows;
  for (std::uint32_t p = lo; p <= hi; ++p) {
    const int t = 1 + int(p - lo) * 2;  // slots 1, 3, 5: not adjacent to the source
    claim(cache, {t});
    src.push_back(kSource);
    dst.push_back(t);
    at.push_back(p);
    rows.push_back({t, 0, int(p)});
  }
  src.push_back(-1);  // a pad row
  dst.push_back(-1);
  at.push_back(0);
  const std::vector<std::uint8_t> source = testing::slot_bytes(cache, kSource);
  const std::vector<std::uint8_t> pad_slot = testing::slot_bytes(cache, 6);
  ASSERT_TRUE(fork(cache, src, dst, at).is_ok());
  EXPECT_EQ(testing::slot_bytes(cache, kSource), source) << "fork wrote its source";
  EXPECT_EQ(testing::slot_bytes(cache, 6), pad_slot);
  for (const Row& r : rows) {
    EXPECT_EQ(testing::cursor_committed(cache, r.slot), std::uint32_t(r.first));
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_EQ(testing::cursor_folded(cache, l, r.slot), testing::cursor_folded(cache, l, kSource));
      for (CacheBufferId id : {CacheBufferId::kCkptHi, CacheBufferId::kCkptLo,
                               CacheBufferId::kCkptLoScale}) {
        EXPECT_EQ(region(cache, id, l, r.slot), region(cache, id, l, kSource))
            << cache_buffer_name(id) << " of layer " << l;
      }
    }
  }
  expect_continues_as(cache, *work_, rows, {&recorded_, &recorded_, &recorded_});
}

// The common case of parallel sampling: a fork at the committed end, source and copy decoding
// the same tokens side by side.
TEST_P(Continue, ForkAtTheEndDecodesBesideTheSource) {
  StateCache& cache = *cache_;
  claim(cache, {7});
  ASSERT_TRUE(fork(cache, {kSource}, {7}, {std::uint32_t(kRunTo)}).is_ok());
  expect_continues_as(cache, *work_, {{kSource, 0, kRunTo}, {7, 0, kRunTo}},
                      {&recorded_, &recorded_});
}

// Every position in reach: three copies of the source truncated to each in one call decode on
// exactly as the source did from there.
TEST_P(Continue, TruncatedSlotsDecodeOnFromThatPosition) {
  StateCache& cache = *cache_;
  const auto [lo, hi] = reach(cache, kSource);
  std::vector<std::int32_t> slots;
  std::vector<std::uint32_t> at;
  std::vector<Row> rows;
  for (std::uint32_t p = lo; p <= hi; ++p) {
    const int t = 2 + int(p - lo);
    claim(cache, {t});
    ASSERT_TRUE(fork(cache, {kSource}, {t}, {hi}).is_ok());
    slots.push_back(t);
    at.push_back(p);
    rows.push_back({t, 0, int(p)});
  }
  // Also a slot with an uncommitted window: truncating drops it.
  work_->decode(cache, {{slots.back(), 0, int(hi)}}, 1);
  ASSERT_TRUE(truncate(cache, slots, at).is_ok());
  for (const Row& r : rows) {
    EXPECT_EQ(testing::cursor_committed(cache, r.slot), std::uint32_t(r.first));
    EXPECT_EQ(testing::cursor_pending(cache, r.slot), 0);
  }
  expect_continues_as(cache, *work_, rows, {&recorded_, &recorded_, &recorded_});
}

// An entry at the source's last fold with the records after it, restored into a fresh slot
// at another position: the slot's checkpoint copies are the source's, bit for bit (the fold's
// rounding), and it decodes on exactly as the source did.
TEST_P(Continue, RestoredExactEntryDecodesOnAsTheSourceDid) {
  StateCache& cache = *cache_;
  const auto [lo, hi] = reach(cache, kSource);
  const Entry e = take_entry(cache, kSource, lo);
  ASSERT_EQ(e.records.count, int(hi - lo));
  claim(cache, {4});
  work_->load(cache, 4, 0);  // something to overwrite
  const std::uint32_t at = 1000;  // any position: only differences of positions matter
  ASSERT_TRUE(restore(cache, 4, at, e).is_ok());
  EXPECT_EQ(testing::cursor_committed(cache, 4), at + (hi - lo));
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(testing::cursor_folded(cache, l, 4), at);
    for (CacheBufferId id :
         {CacheBufferId::kCkptHi, CacheBufferId::kCkptLo, CacheBufferId::kCkptLoScale}) {
      EXPECT_EQ(region(cache, id, l, 4), region(cache, id, l, kSource))
          << cache_buffer_name(id) << " of layer " << l;
    }
  }
  // Restored positions are `at`-based; the workload's are the sequence's.
  const Workload& w = *work_;
  int t = int(hi);
  while (t < w.length()) {
    const auto out = w.decode(cache, {{4, 0, t}}, 1);
    ASSERT_TRUE(testing::commit(cache, {4}, {1}).is_ok());
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(same_bits(out[std::size_t(l)], recorded_[std::size_t(l)][std::size_t(t)]))
          << "layer " << l << ", position " << t;
    }
    ++t;
  }
}

// Entries at every position after the fold, with and without the records after them: the
// restored slots decode on within the precision's bound of the oracle, and with an fp32
// checkpoint within fp32 rounding of the source.
TEST_P(Continue, RestoredEntriesInsideTheWindowDecodeOnWithinTheBound) {
  StateCache& cache = *cache_;
  const PrefixCase& c = GetParam();
  const auto [lo, hi] = reach(cache, kSource);
  const Workload& w = *work_;
  for (std::uint32_t p0 = lo + 1; p0 <= hi; ++p0) {
    for (bool with_records : {true, false}) {
      SCOPED_TRACE("entry at " + std::to_string(p0) + (with_records ? " + records" : ""));
      Entry e = take_entry(cache, kSource, p0);
      if (!with_records) e.records.count = 0;
      claim(cache, {6});
      ASSERT_TRUE(restore(cache, 6, p0, e).is_ok());
      int t = int(p0) + e.records.count;
      while (t < w.length()) {
        const auto out = w.decode(cache, {{6, 0, t}}, 1);
        ASSERT_TRUE(testing::commit(cache, {6}, {1}).is_ok());
        for (int l = 0; l < kLayers; ++l) {
          const std::vector<float>& o = out[std::size_t(l)];
          ASSERT_LE(rel_to_oracle(o, w.output(0, l, t)), output_bound(c.precision))
              << "layer " << l << ", position " << t;
          if (c.precision == CheckpointPrecision::kFp32) {
            ASSERT_LE(testing::max_rel_diff(o, recorded_[std::size_t(l)][std::size_t(t)], 0,
                                            o.size()),
                      1e-5);
          }
        }
        ++t;
      }
      ASSERT_TRUE(state_cache_free_slot(cache, 6).is_ok());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Prefix, Continue, ::testing::ValuesIn(cases(false)), case_name);
// The same on CUDA caches: forks, truncations and exact restores decode on bit for bit as the
// CUDA cache did, so a restored CUDA slot also holds the checkpoint bytes its source's folds
// wrote.
INSTANTIATE_TEST_SUITE_P(CudaPrefix, Continue, ::testing::ValuesIn(cases(false, Device::kCuda)),
                         case_name);

// ---- shared checkpoints (share_forked_checkpoints: copy on fold) ----------------------------

std::uint32_t u32_of(const StateCache& cache, CacheBufferId id, int layer, int slot) {
  const std::vector<std::uint8_t> bytes = region(cache, id, layer, slot);
  std::uint32_t v = 0;
  std::memcpy(&v, bytes.data(), sizeof v);
  return v;
}
// The slot whose checkpoint (layer, slot) reads, -1 for its own; how many read slot's.
int lender_of(const StateCache& cache, int layer, int slot) {
  return int(u32_of(cache, CacheBufferId::kCkptSource, layer, slot)) - 1;
}
int borrowers_of(const StateCache& cache, int layer, int slot) {
  return int(u32_of(cache, CacheBufferId::kCkptBorrowers, layer, slot));
}

// The bookkeeping of a sharing cache: each slot's borrower count is the number of slots that
// name it, only allocated slots take part, and a lender never borrows.
void expect_sharing_consistent(const StateCache& cache) {
  const int slots = cache.config().capacity;
  for (int l = 0; l < cache.config().num_layers; ++l) {
    std::vector<int> named(std::size_t(slots), 0);
    for (int x = 0; x < slots; ++x) {
      const int lender = lender_of(cache, l, x);
      if (lender < 0) continue;
      ASSERT_LT(lender, slots) << "layer " << l << ", slot " << x;
      EXPECT_TRUE(cache.is_allocated(x) && cache.is_allocated(lender)) << "slot " << x;
      EXPECT_EQ(lender_of(cache, l, lender), -1) << "slot " << lender << " lends and borrows";
      ++named[std::size_t(lender)];
    }
    for (int s = 0; s < slots; ++s) {
      EXPECT_EQ(borrowers_of(cache, l, s), named[std::size_t(s)]) << "layer " << l << ", slot " << s;
    }
  }
}

// Whether any slot of the cache still shares a checkpoint.
bool any_sharing(const StateCache& cache) {
  for (int l = 0; l < cache.config().num_layers; ++l) {
    for (int s = 0; s < cache.config().capacity; ++s) {
      if (lender_of(cache, l, s) >= 0) return true;
    }
  }
  return false;
}

const CacheBufferId kCheckpointIds[] = {CacheBufferId::kCkptHi, CacheBufferId::kCkptLo,
                                        CacheBufferId::kCkptLoScale};

// Every checkpoint and ring region of a slot, every layer (what a fork must not write).
std::vector<std::uint8_t> checkpoint_and_ring(const StateCache& cache, int slot) {
  std::vector<std::uint8_t> out;
  for (const CacheBufferSpec& s : cache_buffer_specs(cache.config())) {
    if (slot_part(s.id) == SlotPart::kOther) continue;
    for (int l = 0; l < cache.config().num_layers; ++l) {
      const std::vector<std::uint8_t> r = region(cache, s.id, l, slot);
      out.insert(out.end(), r.begin(), r.end());
    }
  }
  return out;
}

// The Continue workload on a cache that shares forked checkpoints: every fork, however the
// source and its copies go on (side by side, one after the other, freed, overwritten, forked
// again), decodes on bit for bit as the source did, and the bookkeeping stays consistent.
class Shared : public Continue {
 protected:
  void SetUp() override { set_up(/*share=*/true); }
  // Forks kSource onto `dst` at its committed end.
  void fork_at_end(int src, int dst) {
    claim(*cache_, {dst});
    ASSERT_TRUE(fork(*cache_, {src}, {dst}, {std::uint32_t(kRunTo)}).is_ok());
  }
};

// A fork writes none of the copy's checkpoint rows (nor the source's): the copies read the
// source's until each folds, and they then decode on as the source did.
TEST_P(Shared, ForkCopiesNoCheckpointAndCopiesDecodeOn) {
  StateCache& cache = *cache_;
  const auto [lo, hi] = reach(cache, kSource);
  std::vector<std::int32_t> src, dst;
  std::vector<std::uint32_t> at;
  std::vector<Row> rows;
  for (std::uint32_t p = lo; p <= hi; ++p) {
    const int t = 1 + int(p - lo) * 2;
    claim(cache, {t});
    src.push_back(kSource);
    dst.push_back(t);
    at.push_back(p);
    rows.push_back({t, 0, int(p)});
  }
  std::vector<std::vector<std::uint8_t>> before;
  for (const Row& r : rows) {
    std::vector<std::uint8_t> b;
    for (int l = 0; l < kLayers; ++l) {
      for (CacheBufferId id : kCheckpointIds) {
        const auto reg = region(cache, id, l, r.slot);
        b.insert(b.end(), reg.begin(), reg.end());
      }
    }
    before.push_back(b);
  }
  const std::vector<std::uint8_t> source = checkpoint_and_ring(cache, kSource);
  ASSERT_TRUE(fork(cache, src, dst, at).is_ok());
  EXPECT_EQ(checkpoint_and_ring(cache, kSource), source) << "fork wrote its source";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    std::vector<std::uint8_t> b;
    for (int l = 0; l < kLayers; ++l) {
      for (CacheBufferId id : kCheckpointIds) {
        const auto reg = region(cache, id, l, rows[i].slot);
        b.insert(b.end(), reg.begin(), reg.end());
      }
      EXPECT_EQ(lender_of(cache, l, rows[i].slot), kSource);
    }
    EXPECT_EQ(b, before[i]) << "fork copied a checkpoint into slot " << rows[i].slot;
  }
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(borrowers_of(cache, l, kSource), 3);
  expect_sharing_consistent(cache);
  expect_continues_as(cache, *work_, rows, {&recorded_, &recorded_, &recorded_});
  expect_sharing_consistent(cache);
  EXPECT_FALSE(any_sharing(cache)) << "every copy has folded: none should borrow still";
}

// Parallel sampling: source and copy fold on the same steps.
TEST_P(Shared, SourceAndCopyDecodeSideBySide) {
  fork_at_end(kSource, 7);
  expect_continues_as(*cache_, *work_, {{kSource, 0, kRunTo}, {7, 0, kRunTo}},
                      {&recorded_, &recorded_});
  expect_sharing_consistent(*cache_);
  EXPECT_FALSE(any_sharing(*cache_));
}

// The source folds first, while the copy waits: the copy is handed its own checkpoint then.
TEST_P(Shared, SourceRunsAheadThenTheCopyDecodes) {
  fork_at_end(kSource, 7);
  expect_continues_as(*cache_, *work_, {{kSource, 0, kRunTo}}, {&recorded_});
  expect_sharing_consistent(*cache_);
  EXPECT_FALSE(any_sharing(*cache_));
  expect_continues_as(*cache_, *work_, {{7, 0, kRunTo}}, {&recorded_});
}

// The source freed, taken again and loaded, or overwritten in place: the copy keeps its state.
TEST_P(Shared, FreedOrOverwrittenSourceLeavesTheCopy) {
  fork_at_end(kSource, 7);
  fork_at_end(kSource, 6);
  ASSERT_TRUE(state_cache_free_slot(*cache_, kSource).is_ok());
  expect_sharing_consistent(*cache_);
  claim(*cache_, {kSource});
  work_->load(*cache_, kSource, 0);
  fork_at_end(7, 2);  // 2 and 6 now read 7's rows ...
  work_->load(*cache_, 7, 0);  // ... which a load into 7 replaces
  expect_sharing_consistent(*cache_);
  expect_continues_as(*cache_, *work_, {{6, 0, kRunTo}, {2, 0, kRunTo}},
                      {&recorded_, &recorded_});
}

// A fork of a copy names the first source; a fork onto the slot a copy reads from hands that
// slot's rows to the copy first.
TEST_P(Shared, ForksOfCopiesAndOntoTheirSource) {
  fork_at_end(kSource, 3);
  fork_at_end(3, 5);
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(lender_of(*cache_, l, 5), kSource);
    EXPECT_EQ(borrowers_of(*cache_, l, kSource), 2);
  }
  ASSERT_TRUE(fork(*cache_, {5}, {kSource}, {std::uint32_t(kRunTo)}).is_ok());
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(lender_of(*cache_, l, kSource), 5);
    EXPECT_EQ(lender_of(*cache_, l, 3), -1);
    EXPECT_EQ(lender_of(*cache_, l, 5), -1);
  }
  expect_sharing_consistent(*cache_);
  expect_continues_as(*cache_, *work_, {{kSource, 0, kRunTo}, {3, 0, kRunTo}, {5, 0, kRunTo}},
                      {&recorded_, &recorded_, &recorded_});
}

// Materialize and export of a copy read the rows it shares: the source's states, bit for bit.
TEST_P(Shared, MaterializeAndExportOfACopy) {
  fork_at_end(kSource, 3);
  const auto [lo, hi] = reach(*cache_, kSource);
  for (std::uint32_t p = lo; p <= hi; ++p) {
    const auto copy = materialize(*cache_, {3}, {p});
    const auto source = materialize(*cache_, {kSource}, {p});
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_TRUE(same_bits(copy[0][std::size_t(l)], source[0][std::size_t(l)])) << "p " << p;
    }
  }
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> copy, source;
    ASSERT_TRUE(testing::export_state(*cache_, l, 3, &copy).is_ok());
    ASSERT_TRUE(testing::export_state(*cache_, l, kSource, &source).is_ok());
    EXPECT_TRUE(same_bits(copy, source)) << "layer " << l;
  }
  expect_sharing_consistent(*cache_);
}

// Refused calls on a cache that shares (a copy borrowing its source's rows) change no byte:
// every check runs before the release pass. (CPU caches: CUDA ones skip bad rows on the device.)
TEST_P(Shared, RefusedCallsChangeNothing) {
  if (GetParam().device == Device::kCuda) GTEST_SKIP() << "CPU caches refuse; CUDA ones skip";
  fork_at_end(kSource, 3);
  claim(*cache_, {4});
  const testing::CacheBytes before = testing::snapshot(*cache_);
  const auto expect_refused = [&](const Status& st) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_EQ(testing::diff(testing::snapshot(*cache_), before), "") << st.message();
  };
  expect_refused(fork(*cache_, {kSource}, {3}, {std::uint32_t(kRunTo + 1)}));  // out of reach
  expect_refused(fork(*cache_, {3}, {3}, {std::uint32_t(kRunTo)}));            // onto itself
  expect_refused(fork(*cache_, {kSource, 3}, {4, kSource}, {std::uint32_t(kRunTo), 0u}));
  std::vector<float> nan_state(std::size_t(cfg_.dims().state_elems()), 0.0f);
  nan_state[1] = std::numeric_limits<float>::quiet_NaN();
  expect_refused(state_cache_load_state(*cache_, 0, kSource, nan_state.data()));
  expect_refused(state_cache_free_slot(*cache_, 5));  // not allocated
  expect_refused(testing::fold(*cache_, {6}));
}

INSTANTIATE_TEST_SUITE_P(Prefix, Shared, ::testing::ValuesIn(cases(false)), case_name);
INSTANTIATE_TEST_SUITE_P(CudaPrefix, Shared, ::testing::ValuesIn(cases(false, Device::kCuda)),
                         case_name);

// Random serving on two caches, one that copies at fork and one that shares: decodes of T-token
// windows with random accepted counts (so copies and sources fold on different steps), forks
// at random positions in reach, frees, explicit folds, loads, truncations, exports and
// materializations. Every output and state of the sharing cache equals the copying one's, bit
// for bit, and its bookkeeping stays consistent.
class SharedTwin : public ::testing::TestWithParam<PrefixCase> {};

TEST_P(SharedTwin, RandomServingMatchesACacheThatCopiesAtFork) {
  const PrefixCase& c = GetParam();
  if (c.device == Device::kCuda) {
    SKIP_WITHOUT_GPU();
  }
  constexpr int kSlots = 8;
  const StateCacheConfig copy_cfg = case_config(c, kSlots);
  StateCacheConfig share_cfg = copy_cfg;
  share_cfg.share_forked_checkpoints = true;
  const int T = c.window, L = c.buffer_len;
  const int length = 6 * L + 2 * T;
  const Workload w(copy_cfg, 2, length, 53);
  const auto copying = testing::create_cache(copy_cfg);
  const auto sharing = testing::create_cache(share_cfg);
  const std::initializer_list<StateCache*> both = {copying.get(), sharing.get()};
  std::map<int, Row> live;  // slot -> its sequence and next position
  Rng rng(std::uint64_t(1000 + 7 * T + L));
  const auto admit = [&](int slot, int seq) {
    for (StateCache* cache : both) {
      claim(*cache, {slot});
      w.load(*cache, slot, seq);
    }
    live[slot] = {slot, seq, 0};
  };
  const auto random_live = [&] {
    auto it = live.begin();
    std::advance(it, rng.uniform_int(0, int(live.size()) - 1));
    return it->first;
  };
  const auto random_reach = [&](int slot) {
    const auto [lo, hi] = reach(*copying, slot);
    EXPECT_EQ(reach(*sharing, slot), std::make_pair(lo, hi));
    return lo + std::uint32_t(rng.uniform_int(0, int(hi - lo)));
  };
  admit(0, 0);
  admit(1, 1);
  const int actions = 40 + 8 * L;
  for (int a = 0; a < actions; ++a) {
    SCOPED_TRACE("action " + std::to_string(a));
    const int kind = rng.uniform_int(0, 19);
    if (kind < 10) {  // a decode step of every live slot with T tokens left
      std::vector<Row> rows;
      for (const auto& [slot, r] : live) {
        if (r.first + T <= length) rows.push_back(r);
      }
      if (rows.empty()) continue;
      const auto out_copy = w.decode(*copying, rows, T);
      const auto out_share = w.decode(*sharing, rows, T);
      for (int l = 0; l < kLayers; ++l) {
        ASSERT_TRUE(same_bits(out_copy[std::size_t(l)], out_share[std::size_t(l)]))
            << "layer " << l;
      }
      std::vector<std::int32_t> slots, accepted;
      for (const Row& r : rows) {
        slots.push_back(r.slot);
        accepted.push_back(rng.uniform_int(1, T));
      }
      for (StateCache* cache : both) ASSERT_TRUE(testing::commit(*cache, slots, accepted).is_ok());
      for (std::size_t i = 0; i < rows.size(); ++i) live[rows[i].slot].first += accepted[i];
    } else if (kind < 13) {  // a fork onto a free slot, at a random position in reach
      int dst = -1;
      for (int s = 0; s < kSlots; ++s) {
        if (!live.count(s)) dst = s;
      }
      if (dst < 0) continue;
      const int src = random_live();
      const std::uint32_t p = random_reach(src);
      for (StateCache* cache : both) {
        claim(*cache, {dst});
        ASSERT_TRUE(fork(*cache, {src}, {dst}, {p}).is_ok());
      }
      live[dst] = {dst, live[src].seq, int(p)};
    } else if (kind < 15) {  // a request finishes (one stays)
      if (live.size() < 2) continue;
      const int slot = random_live();
      for (StateCache* cache : both) ASSERT_TRUE(state_cache_free_slot(*cache, slot).is_ok());
      live.erase(slot);
    } else if (kind == 15) {
      const int slot = random_live();
      for (StateCache* cache : both) ASSERT_TRUE(testing::fold(*cache, {slot}).is_ok());
    } else if (kind == 16) {  // a prefill hand-off into a live slot
      const int slot = random_live();
      for (StateCache* cache : both) w.load(*cache, slot, live[slot].seq);
    } else if (kind == 17) {
      const int slot = random_live();
      const std::uint32_t p = random_reach(slot);
      for (StateCache* cache : both) ASSERT_TRUE(truncate(*cache, {slot}, {p}).is_ok());
      live[slot].first = int(p);
    } else if (kind == 18) {
      const int slot = random_live(), layer = rng.uniform_int(0, kLayers - 1);
      std::vector<float> a_state, b_state;
      ASSERT_TRUE(testing::export_state(*copying, layer, slot, &a_state).is_ok());
      ASSERT_TRUE(testing::export_state(*sharing, layer, slot, &b_state).is_ok());
      ASSERT_TRUE(same_bits(a_state, b_state)) << "export of slot " << slot;
    } else {
      const int slot = random_live();
      const std::uint32_t p = random_reach(slot);
      const auto a_states = materialize(*copying, {slot}, {p});
      const auto b_states = materialize(*sharing, {slot}, {p});
      for (int l = 0; l < kLayers; ++l) {
        ASSERT_TRUE(same_bits(a_states[0][std::size_t(l)], b_states[0][std::size_t(l)]))
            << "materialize of slot " << slot << " at " << p;
      }
    }
    expect_sharing_consistent(*sharing);
    // A request at the end of its sequence leaves; an empty batch admits a new one.
    for (auto it = live.begin(); it != live.end();) {
      if (it->second.first + T > length && live.size() > 1) {
        for (StateCache* cache : both) {
          ASSERT_TRUE(state_cache_free_slot(*cache, it->first).is_ok());
        }
        it = live.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const auto& [slot, r] : live) {
    for (int l = 0; l < kLayers; ++l) {
      std::vector<float> a_state, b_state;
      ASSERT_TRUE(testing::export_state(*copying, l, slot, &a_state).is_ok());
      ASSERT_TRUE(testing::export_state(*sharing, l, slot, &b_state).is_ok());
      EXPECT_TRUE(same_bits(a_state, b_state)) << "slot " << slot << ", layer " << l;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Prefix, SharedTwin, ::testing::ValuesIn(cases(true)), case_name);
INSTANTIATE_TEST_SUITE_P(CudaPrefix, SharedTwin, ::testing::ValuesIn(cases(true, Device::kCuda)),
                         case_name);

// ---- refusals --------------------------------------------------------------------------------

class Refuse : public ::testing::TestWithParam<LayerKind> {
 protected:
  void SetUp() override {
    PrefixCase c{GetParam(), CheckpointPrecision::kFp32Fp8};
    cfg_ = case_config(c, 6);
    work_ = std::make_unique<Workload>(cfg_, 1, 3 * kBufferLen, 41);
    cache_ = testing::create_cache(cfg_);
    claim(*cache_, {0, 2, 3});  // 1, 4, 5 stay free
    work_->load(*cache_, 0, 0);
    for (int t = 0; t < kBufferLen + 2; ++t) work_->step(*cache_, {{0, 0, t}});
    work_->load(*cache_, 2, 0);
    before_ = testing::snapshot(*cache_);
  }
  // The call was refused with kInvalidArgument naming `what`, and no byte changed.
  void expect_refused(const Status& st, const std::string& what) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find(what), std::string::npos) << st.message();
    EXPECT_EQ(testing::diff(testing::snapshot(*cache_), before_), "") << st.message();
  }

  StateCacheConfig cfg_;
  std::unique_ptr<Workload> work_;
  std::unique_ptr<StateCache> cache_;
  testing::CacheBytes before_;
};

TEST_P(Refuse, MaterializeOutOfReachOrUnallocated) {
  const auto [lo, hi] = reach(*cache_, 0);
  ASSERT_EQ(lo, std::uint32_t(kBufferLen));
  for (std::uint32_t bad : {lo - 1, hi + 1, 0u, 0xffffffffu}) {
    Status st;
    const auto got = materialize(*cache_, {0, 0}, {hi, bad}, &st);
    expect_refused(st, "out of reach");
    EXPECT_EQ(got[0][0][0], kSentinel) << "a refused call wrote a state";
  }
  Status st;
  materialize(*cache_, {0, 1}, {hi, 0}, &st);
  expect_refused(st, "not allocated");
  materialize(*cache_, {0, 6}, {hi, 0}, &st);
  expect_refused(st, "out of range");
  MaterializeArgs a;
  a.batch = 1;
  expect_refused(state_cache_materialize(*cache_, a), "slot_ids is null");
  a.batch = -1;
  expect_refused(state_cache_materialize(*cache_, a), "batch");
}

TEST_P(Refuse, ForkBadPairs) {
  const auto [lo, hi] = reach(*cache_, 0);
  expect_refused(fork(*cache_, {0}, {3}, {hi + 1}), "out of reach");
  expect_refused(fork(*cache_, {0}, {3}, {lo - 1}), "out of reach");
  expect_refused(fork(*cache_, {0}, {1}, {hi}), "not allocated");
  expect_refused(fork(*cache_, {1}, {3}, {0}), "not allocated");
  expect_refused(fork(*cache_, {0}, {0}, {hi}), "onto itself");
  expect_refused(fork(*cache_, {0, 0}, {3, 3}, {hi, lo}), "appears twice");
  expect_refused(fork(*cache_, {0, 3}, {3, 2}, {hi, 0}), "is the src of a row");
  expect_refused(fork(*cache_, {0}, {-1}, {hi}), "dst slot is -1");
  expect_refused(fork(*cache_, {0}, {9}, {hi}), "out of range");
}

TEST_P(Refuse, TruncateBadPositions) {
  const auto [lo, hi] = reach(*cache_, 0);
  expect_refused(truncate(*cache_, {0}, {hi + 1}), "out of reach");
  expect_refused(truncate(*cache_, {0}, {lo - 1}), "out of reach");
  expect_refused(truncate(*cache_, {0, 0}, {lo, lo}), "appears twice");
  expect_refused(truncate(*cache_, {1}, {0}), "not allocated");
}

TEST_P(Refuse, ReadRecordsOutsideTheCommittedHistory) {
  const auto [lo, hi] = reach(*cache_, 0);
  Entry e = make_entry(*cache_, {}, int(hi - lo));
  expect_refused(state_cache_read_records(*cache_, 0, lo + 1, e.records), "out of reach");
  expect_refused(state_cache_read_records(*cache_, 0, lo - 1, e.records), "out of reach");
  e.records.count = cfg_.buffer_len + cfg_.max_spec_tokens;
  expect_refused(state_cache_read_records(*cache_, 0, lo, e.records), "records");
  e.records.count = 1;
  e.records.decay = nullptr;
  expect_refused(state_cache_read_records(*cache_, 0, lo, e.records), "records.decay is null");
  expect_refused(state_cache_read_records(*cache_, 1, lo, e.records), "not allocated");
}

TEST_P(Refuse, RestoreBadEntries) {
  const auto [lo, hi] = reach(*cache_, 0);
  Entry good = take_entry(*cache_, 0, lo);
  before_ = testing::snapshot(*cache_);
  {
    Entry e = take_entry(*cache_, 0, lo);
    e.host_states[e.host_states.size() - 3] = std::numeric_limits<float>::quiet_NaN();
    e.states.upload(e.host_states.data(), e.host_states.size() * 4);
    expect_refused(restore(*cache_, 3, 0, e), "finite");
  }
  {
    Entry e = take_entry(*cache_, 0, lo);
    e.records.count = cfg_.buffer_len + cfg_.max_spec_tokens;
    expect_refused(restore(*cache_, 3, 0, e), "records");
    e.records.count = 1;
    e.records.vec = nullptr;
    expect_refused(restore(*cache_, 3, 0, e), "records.vec is null");
    if (cfg_.kind == LayerKind::kGdn) {
      e.records.vec = e.vec.get();
      e.records.key_scale = nullptr;
      expect_refused(restore(*cache_, 3, 0, e), "records.key_scale is null");
    }
  }
  expect_refused(restore(*cache_, 1, 0, good), "not allocated");
  // A slot with an uncommitted window.
  work_->decode(*cache_, {{3, 0, 0}}, 1);
  before_ = testing::snapshot(*cache_);
  expect_refused(restore(*cache_, 3, 0, good), "uncommitted window");
  (void)hi;
}

TEST_P(Refuse, EagerCaches) {
  StateCacheConfig c = cfg_;
  c.mode = DecodeMode::kEager;
  auto eager = testing::create_cache(c);
  claim(*eager, {0, 1});
  Status st;
  materialize(*eager, {0}, {0}, &st);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.to_string();
  EXPECT_EQ(fork(*eager, {0}, {1}, {0}).code(), StatusCode::kUnsupported);
  EXPECT_EQ(truncate(*eager, {0}, {0}).code(), StatusCode::kUnsupported);
  // Sharing forked checkpoints is a replay cache's option.
  c.share_forked_checkpoints = true;
  st = state_cache_can_implement(c);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("share_forked_checkpoints"), std::string::npos) << st.message();
}

INSTANTIATE_TEST_SUITE_P(Prefix, Refuse, ::testing::Values(LayerKind::kMamba2, LayerKind::kGdn),
                         [](const ::testing::TestParamInfo<LayerKind>& i) {
                           return std::string(i.param == LayerKind::kMamba2 ? "Mamba2" : "Gdn");
                         });

// ---- CUDA ------------------------------------------------------------------------------------

class CudaMaterialize : public ::testing::TestWithParam<PrefixCase> {};

// Materialize's workload on a CPU and a CUDA cache side by side (same tokens, slots and
// accepted counts): after every commit both hold the same cursors, and the CUDA states at
// every position in reach are within the bound of the oracle and of the CPU's. Rows the kernel
// must skip or poison ride along: a pad row, a free slot and an id out of range (untouched),
// a position past the committed end (NaN). The cache is not changed.
TEST_P(CudaMaterialize, MatchesTheCpuCacheAndTheOracle) {
  SKIP_WITHOUT_GPU();
  const PrefixCase& c = GetParam();
  PrefixCase on_cpu = c;
  on_cpu.device = Device::kCpu;
  auto gpu = testing::create_cache(case_config(c, 6));
  auto cpu = testing::create_cache(case_config(on_cpu, 6));
  TwoSequences run(c);
  const Workload& w = run.work();
  const int free_slot = 0;
  run.admit(*gpu);
  run.admit(*cpu);
  double worst = 0.0;
  for (int step = 0; !run.done(); ++step) {
    run.step({gpu.get(), cpu.get()});
    std::vector<std::int32_t> pair_slots, gpu_slots;
    std::vector<std::uint32_t> pair_pos, gpu_pos;
    std::vector<int> pair_seq, gpu_seq;
    run.pairs(*cpu, &pair_slots, &pair_pos, &pair_seq);
    run.pairs(*gpu, &gpu_slots, &gpu_pos, &gpu_seq);
    ASSERT_EQ(gpu_pos, pair_pos) << "the caches' cursors differ";
    const std::size_t real = pair_slots.size();
    const auto want = materialize(*cpu, pair_slots, pair_pos);
    const std::uint32_t past_end = run.position(0) + 1;
    for (auto [s, p] : {std::pair<std::int32_t, std::uint32_t>{-1, 0}, {free_slot, 0}, {99, 0},
                        {TwoSequences::kSlot[0], past_end}}) {
      pair_slots.push_back(s);
      pair_pos.push_back(p);
    }
    const testing::CacheBytes before = testing::snapshot(*gpu);
    const auto got = materialize(*gpu, pair_slots, pair_pos);
    ASSERT_EQ(testing::diff(testing::snapshot(*gpu), before), "") << "materialize wrote the cache";
    for (std::size_t b = 0; b < real; ++b) {
      for (int l = 0; l < kLayers; ++l) {
        const std::vector<float>& g = got[b][std::size_t(l)];
        const double vs_cpu = testing::max_rel_diff(g, want[b][std::size_t(l)], 0, g.size());
        const double vs_oracle = rel_to_oracle(g, w.state(pair_seq[b], l, int(pair_pos[b])));
        worst = std::max(worst, vs_cpu);
        ASSERT_LE(vs_cpu, 2 * state_bound(c.precision))
            << "step " << step << ", slot " << pair_slots[b] << ", position " << pair_pos[b]
            << ", layer " << l;
        ASSERT_LE(vs_oracle, state_bound(c.precision))
            << "step " << step << ", slot " << pair_slots[b] << ", position " << pair_pos[b]
            << ", layer " << l;
      }
    }
    for (std::size_t b = real; b < real + 3; ++b) {
      for (const auto& layer : got[b]) {
        ASSERT_TRUE(std::all_of(layer.begin(), layer.end(), [](float v) { return v == kSentinel; }))
            << "skipped row " << b - real << " was written";
      }
    }
    for (const auto& layer : got[real + 3]) {
      ASSERT_TRUE(std::all_of(layer.begin(), layer.end(), [](float v) { return std::isnan(v); }))
          << "a position out of reach did not give NaNs";
    }
  }
  EXPECT_GT(worst, 0.0);  // two backends' arithmetic: a difference, within the bound
  if (c.buffer_len > 32) {
    EXPECT_GT(run.max_records(), 32) << "the kernel staged one chunk only";
  }
}

INSTANTIATE_TEST_SUITE_P(Prefix, CudaMaterialize, ::testing::ValuesIn(cases(true, Device::kCuda)),
                         case_name);

// A CUDA cache of either kind, its slot 0 run past a fold (in reach: [L, L + 2]), slot 2 loaded,
// slot 3 claimed, slots 1, 4, 5 free.
struct CudaFixture {
  std::unique_ptr<Workload> work;
  std::unique_ptr<StateCache> cache;
  std::uint32_t lo = 0, hi = 0;

  explicit CudaFixture(LayerKind kind) {
    PrefixCase c{kind, CheckpointPrecision::kFp32Fp8};
    c.device = Device::kCuda;
    const StateCacheConfig cfg = case_config(c, 6);
    work = std::make_unique<Workload>(cfg, 1, 3 * kBufferLen, 41);
    cache = testing::create_cache(cfg);
    claim(*cache, {0, 2, 3});
    work->load(*cache, 0, 0);
    for (int t = 0; t < kBufferLen + 2; ++t) work->step(*cache, {{0, 0, t}});
    work->load(*cache, 2, 0);
    std::tie(lo, hi) = reach(*cache, 0);
  }
};

// Bad rows of the device lists are skipped beside good ones; the single-slot ops refuse on the
// host with nothing changed.
TEST(CudaPrefixRows, BadRowsAreSkippedAndBadEntriesRefused) {
  SKIP_WITHOUT_GPU();
  for (LayerKind kind : {LayerKind::kMamba2, LayerKind::kGdn}) {
    SCOPED_TRACE(kind == LayerKind::kMamba2 ? "mamba2" : "gdn");
    CudaFixture f(kind);
    StateCache& cache = *f.cache;
    const auto slot1 = testing::slot_bytes(cache, 1), slot2 = testing::slot_bytes(cache, 2);
    // Fork: 0 -> 3 at lo + 1 is good; past the end, onto itself, onto a free slot, ids out of
    // range are not.
    ASSERT_TRUE(fork(cache, {0, 0, 0, 0, 99, 0}, {3, 2, 0, 1, 2, 99},
                     {f.lo + 1, f.hi + 1, f.hi, f.hi, f.hi, f.hi})
                    .is_ok());
    EXPECT_EQ(testing::cursor_committed(cache, 3), f.lo + 1);
    EXPECT_EQ(testing::slot_bytes(cache, 1), slot1);
    EXPECT_EQ(testing::slot_bytes(cache, 2), slot2);
    // Truncate: 3 -> lo is good; 0 past its end or before its fold, a free slot, 99 are not.
    ASSERT_TRUE(truncate(cache, {3, 0, 0, 1, 99}, {f.lo, f.hi + 1, f.lo - 1, 0, 0}).is_ok());
    EXPECT_EQ(testing::cursor_committed(cache, 3), f.lo);
    EXPECT_EQ(testing::cursor_committed(cache, 0), f.hi);
    EXPECT_EQ(testing::slot_bytes(cache, 1), slot1);
    // Restore refuses a non-finite entry and a slot with an uncommitted window; read_records
    // refuses positions out of reach; nothing is written.
    Entry e = take_entry(cache, 0, f.lo);
    const testing::CacheBytes before = testing::snapshot(cache);
    Entry bad = take_entry(cache, 0, f.lo);
    bad.host_states[5] = std::numeric_limits<float>::infinity();
    bad.states.upload(bad.host_states.data(), bad.host_states.size() * 4);
    Status st = restore(cache, 2, 0, bad);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find("finite"), std::string::npos) << st.message();
    st = state_cache_read_records(cache, 0, f.lo + 1, e.records);
    EXPECT_NE(st.message().find("out of reach"), std::string::npos) << st.to_string();
    EXPECT_EQ(testing::diff(testing::snapshot(cache), before), "");
    f.work->decode(cache, {{2, 0, 0}}, 1);
    const testing::CacheBytes pending = testing::snapshot(cache);
    st = restore(cache, 2, 0, e);
    EXPECT_NE(st.message().find("uncommitted window"), std::string::npos) << st.to_string();
    EXPECT_EQ(testing::diff(testing::snapshot(cache), pending), "");
  }
}

#if defined(REPLAYSSM_WITH_CUDA)
// Materialize, fork and truncate captured on the engine's stream into a CUDA graph and
// replayed: the same bytes as the same calls made directly on a twin cache.
TEST(CudaPrefixGraph, CapturedOpsMatchDirectCalls) {
  SKIP_WITHOUT_GPU();
  for (LayerKind kind : {LayerKind::kMamba2, LayerKind::kGdn}) {
    SCOPED_TRACE(kind == LayerKind::kMamba2 ? "mamba2" : "gdn");
    CudaFixture direct(kind), graphed(kind);
    const StateCacheConfig& cfg = direct.cache->config();
    const std::size_t n = std::size_t(cfg.num_layers) * std::size_t(cfg.dims().state_elems());
    const auto dev = Device::kCuda;
    CacheBuffer mat_slots = CacheBuffer::from_vector(dev, std::vector<std::int32_t>{0, 0});
    CacheBuffer mat_pos = CacheBuffer::from_vector(dev, std::vector<std::uint32_t>{direct.lo, direct.hi});
    CacheBuffer fork_src = CacheBuffer::from_vector(dev, std::vector<std::int32_t>{0});
    CacheBuffer fork_dst = CacheBuffer::from_vector(dev, std::vector<std::int32_t>{3});
    CacheBuffer fork_pos = CacheBuffer::from_vector(dev, std::vector<std::uint32_t>{direct.lo + 1});
    CacheBuffer cut_pos = CacheBuffer::from_vector(dev, std::vector<std::uint32_t>{direct.lo});
    const auto run = [&](StateCache& cache, float* out, Stream s) -> Status {
      MaterializeArgs m;
      m.batch = 2;
      m.slot_ids = mat_slots.as<const std::int32_t>();
      m.positions = mat_pos.as<const std::uint32_t>();
      m.states = out;
      REPLAYSSM_RETURN_IF_ERROR(state_cache_materialize(cache, m, s));
      ForkArgs fa;
      fa.batch = 1;
      fa.src_slots = fork_src.as<const std::int32_t>();
      fa.dst_slots = fork_dst.as<const std::int32_t>();
      fa.positions = fork_pos.as<const std::uint32_t>();
      REPLAYSSM_RETURN_IF_ERROR(state_cache_fork(cache, fa, s));
      TruncateArgs ta;
      ta.batch = 1;
      ta.slot_ids = fork_src.as<const std::int32_t>();
      ta.positions = cut_pos.as<const std::uint32_t>();
      return state_cache_truncate(cache, ta, s);
    };
    CacheBuffer out_direct(dev, 2 * n * 4), out_graphed(dev, 2 * n * 4);
    ASSERT_TRUE(run(*direct.cache, out_direct.as<float>(), kDefaultStream).is_ok());

    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    const Status captured = run(*graphed.cache, out_graphed.as<float>(), stream);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_TRUE(captured.is_ok()) << captured.to_string();
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    EXPECT_EQ(testing::diff(testing::snapshot(*graphed.cache), testing::snapshot(*direct.cache)),
              "");
    EXPECT_EQ(out_graphed.bytes(), out_direct.bytes());
    EXPECT_EQ(testing::cursor_committed(*graphed.cache, 0), graphed.lo);
    EXPECT_EQ(testing::cursor_committed(*graphed.cache, 3), graphed.lo + 1);
    EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
    EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  }
}
#endif

}  // namespace
}  // namespace replayssm
