// An engine's decode loop on a replay state cache, with speculative windows, checked against
// eager decoding of the tokens it accepts. One Gated DeltaNet layer kind (two layers sharing
// the cache's cursors), the serving configuration (fp32 master + bf16 read copy), on the CPU;
// on a CUDA cache the same calls take device pointers (slot ids and accepted counts included).
//
// Per step, for every sequence: verify a window of T tokens (1 real + T-1 drafts) in every
// layer, then commit the k the engine accepts. Nothing is written to the state by a verify;
// rejected drafts are dropped by the commit's cursor move. Exits non-zero if anything fails
// or the replay cache's outputs or final state drift from eager decoding.
//
//   build/examples/speculative_decode

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"

namespace {

using namespace replayssm;

constexpr GdnShape kShape{4, 8, 64, 64};  // Hk, Hv, K, V: a scaled-down Qwen3.5 layer
constexpr int kLayers = 2, kSequences = 3, kWindow = 4, kSteps = 40;

#define CHECK_OK(expr)                                                                     \
  do {                                                                                     \
    const Status s_ = (expr);                                                              \
    if (!s_.is_ok()) {                                                                     \
      std::fprintf(stderr, "%s failed: %s\n", #expr, s_.to_string().c_str());              \
      return 1;                                                                            \
    }                                                                                      \
  } while (0)

// One window's inputs for every sequence, [sequence, token, ...], fp32 activations.
struct Window {
  std::vector<float> q, k, v, g, beta;
};

Window random_window(int T, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  const std::size_t st = std::size_t(kSequences) * T;
  Window w;
  w.q.resize(st * kShape.num_k_heads * kShape.head_k_dim);
  w.k.resize(w.q.size());
  w.v.resize(st * kShape.num_v_heads * kShape.head_v_dim);
  w.g.resize(st * kShape.num_v_heads);
  w.beta.resize(w.g.size());
  for (float& x : w.q) x = normal(rng);
  for (float& x : w.k) x = normal(rng);
  for (float& x : w.v) x = normal(rng);
  for (float& x : w.g) x = -0.1f * unit(rng);  // log-decays: long memory
  for (float& x : w.beta) x = 0.2f + 0.6f * unit(rng);
  return w;
}

GdnDecodeArgs decode_args(int layer, int batch, int T, const std::int32_t* slots,
                          const Window& w, float* out) {
  GdnDecodeArgs a;
  a.layer = layer;
  a.batch = batch;
  a.num_tokens = T;
  a.slot_ids = slots;
  a.q = w.q.data();
  a.k = w.k.data();
  a.v = w.v.data();
  a.g = w.g.data();
  a.beta = w.beta.data();
  a.o = out;
  return a;
}

// Token t of sequence s of a window of T tokens, as a window of one token for sequence s.
Window token_of(const Window& w, int T, int s, int t) {
  const auto slice = [&](const std::vector<float>& x) {
    const std::size_t per = x.size() / (std::size_t(kSequences) * T);
    const auto begin = x.begin() + std::ptrdiff_t((std::size_t(s) * T + t) * per);
    return std::vector<float>(begin, begin + std::ptrdiff_t(per));
  };
  return {slice(w.q), slice(w.k), slice(w.v), slice(w.g), slice(w.beta)};
}

int run() {
  StateCacheConfig config;
  config.kind = LayerKind::kGdn;
  config.gdn = kShape;
  config.num_layers = kLayers;
  config.capacity = 8;
  config.device = Device::kCpu;
  config.input_dtype = DType::kF32;
  config.mode = DecodeMode::kReplay;
  config.buffer_len = 16;
  config.max_spec_tokens = kWindow;
  config.checkpoint = CheckpointPrecision::kFp32Bf16;
  std::unique_ptr<StateCache> replay;
  CHECK_OK(state_cache_create(config, &replay));

  // The reference: an eager cache fed only the accepted tokens, one at a time.
  StateCacheConfig eager_config = config;
  eager_config.mode = DecodeMode::kEager;
  eager_config.max_spec_tokens = 1;
  std::unique_ptr<StateCache> eager;
  CHECK_OK(state_cache_create(eager_config, &eager));

  // Admit the sequences: a slot each, with the state its prefill left (here: random).
  std::mt19937 rng(2026);
  const std::size_t state_elems = std::size_t(kShape.num_v_heads) * kShape.head_v_dim *
                                   kShape.head_k_dim;
  std::vector<std::int32_t> slots(kSequences), eager_slots(kSequences);
  for (int s = 0; s < kSequences; ++s) {
    CHECK_OK(state_cache_allocate_slot(*replay, &slots[s]));
    CHECK_OK(state_cache_allocate_slot(*eager, &eager_slots[s]));
    for (int layer = 0; layer < kLayers; ++layer) {
      std::normal_distribution<float> normal(0.0f, 0.1f);
      std::vector<float> prefill(state_elems);
      for (float& x : prefill) x = normal(rng);
      CHECK_OK(state_cache_load_state(*replay, layer, slots[s], prefill.data()));
      CHECK_OK(state_cache_load_state(*eager, layer, eager_slots[s], prefill.data()));
    }
  }

  const std::size_t out_per_token = std::size_t(kShape.num_v_heads) * kShape.head_v_dim;
  std::vector<float> out(std::size_t(kSequences) * kWindow * out_per_token);
  std::vector<float> eager_out(out_per_token);
  std::uniform_int_distribution<int> accept(1, kWindow);
  double max_out_error = 0.0, max_out = 0.0;
  int accepted_total = 0;
  for (int step = 0; step < kSteps; ++step) {
    // Each layer's verify: T outputs per sequence from its checkpoint and ring. (An engine
    // runs the model between the layers; here every layer gets the same kind of inputs.)
    std::vector<Window> windows;
    for (int layer = 0; layer < kLayers; ++layer) windows.push_back(random_window(kWindow, rng));
    std::vector<std::vector<float>> outputs(kLayers);
    for (int layer = 0; layer < kLayers; ++layer) {
      CHECK_OK(gdn_decode(*replay, decode_args(layer, kSequences, kWindow, slots.data(),
                                               windows[layer], out.data())));
      outputs[layer] = out;
    }
    // The engine's acceptance (the real token and 0..T-1 drafts), then one commit for all
    // layers: committed += k; the rest of the window is forgotten.
    std::vector<std::int32_t> accepted(kSequences);
    for (int& k : accepted) k = accept(rng);
    CommitArgs commit;
    commit.batch = kSequences;
    commit.slot_ids = slots.data();
    commit.accepted = accepted.data();
    CHECK_OK(state_cache_commit(*replay, commit));

    // Eager decoding of the accepted tokens gives the same outputs.
    for (int s = 0; s < kSequences; ++s) {
      for (int t = 0; t < accepted[s]; ++t) {
        for (int layer = 0; layer < kLayers; ++layer) {
          const Window one = token_of(windows[layer], kWindow, s, t);
          CHECK_OK(gdn_decode(*eager, decode_args(layer, 1, 1, &eager_slots[s], one,
                                                  eager_out.data())));
          const float* got = outputs[layer].data() + (std::size_t(s) * kWindow + t) * out_per_token;
          for (std::size_t i = 0; i < out_per_token; ++i) {
            max_out_error = std::max(max_out_error, double(std::abs(got[i] - eager_out[i])));
            max_out = std::max(max_out, double(std::abs(eager_out[i])));
          }
        }
        const std::int32_t one_token = 1;
        CommitArgs eager_commit;
        eager_commit.batch = 1;
        eager_commit.slot_ids = &eager_slots[s];
        eager_commit.accepted = &one_token;
        CHECK_OK(state_cache_commit(*eager, eager_commit));
      }
      accepted_total += accepted[s];
    }
  }

  // Preemption or debugging: export a sequence's state (folds its history first).
  double max_state_error = 0.0, max_state = 0.0;
  std::vector<float> a(state_elems), b(state_elems);
  for (int s = 0; s < kSequences; ++s) {
    for (int layer = 0; layer < kLayers; ++layer) {
      CHECK_OK(state_cache_export_state(*replay, layer, slots[s], a.data()));
      CHECK_OK(state_cache_export_state(*eager, layer, eager_slots[s], b.data()));
      for (std::size_t i = 0; i < state_elems; ++i) {
        max_state_error = std::max(max_state_error, double(std::abs(a[i] - b[i])));
        max_state = std::max(max_state, double(std::abs(b[i])));
      }
    }
    CHECK_OK(state_cache_free_slot(*replay, slots[s]));
  }

  const double out_error = max_out_error / max_out, state_error = max_state_error / max_state;
  std::printf("%d steps of %d-token windows, %d tokens accepted over %d sequences\n", kSteps,
              kWindow, accepted_total, kSequences);
  std::printf("outputs vs eager: %.2e (bf16 read copy)   state vs eager: %.2e (fp32 master)\n",
              out_error, state_error);
  // Outputs carry the bf16 copy's rounding (~2^-9 relative); the master none of it.
  const bool ok = out_error < 2e-2 && state_error < 1e-4;
  std::printf("%s\n", ok ? "ok" : "FAILED: replay drifted from eager decoding");
  return ok ? 0 : 1;
}

}  // namespace

int main() { return run(); }
