#pragma once
// One interface over the two layer families, so that each driver (oracle_run.h, window_pair.h,
// cuda_vs_cpu.h) is written once: a family draws its tokens, builds and runs its decode call,
// and steps the float64 oracle and the naive same-precision loop by one token.

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "testing/decode_call.h"
#include "testing/inputs.h"

namespace replayssm::testing {

/// How a driver draws and calls a family, beyond the cache config's shape and input dtype.
struct FamilySettings {
  StateCacheConfig cache;
  Recipe recipe;
  bool gate = false;      ///< Mamba-2: pass z
  bool qk_l2norm = true;  ///< GDN
  float scale = 0.0f;     ///< GDN; 0: 1/sqrt(head_k_dim)
  DType naive_state_dtype = DType::kF32;
};

struct Mamba2Family {
  using Tokens = Mamba2Tokens;
  using Call = Mamba2Call;

  /// Draws every layer's A, D and dt_bias from `rng`.
  Mamba2Family(const FamilySettings& settings, Rng& rng);
  std::size_t out_per_token() const;
  std::size_t state_elems() const;
  Tokens tokens(int batch, int T, Rng& rng) const;
  Call call(const StateCache& cache, int layer, const std::vector<std::int32_t>& slots,
            const Tokens& t) const;
  static Status decode(StateCache& cache, const Call& call) {
    return mamba2_decode(cache, call.args);
  }
  static std::vector<std::uint8_t> raw_output(const Call& call) { return call.y.bytes(); }
  /// Row b's token t through the float64 oracle: S advanced, the token's outputs into out.
  void oracle(int layer, double* S, const Tokens& tk, int b, int t, double* out) const;
  /// The same through the naive same-precision loop.
  void naive(int layer, std::vector<float>& S, const Tokens& tk, int b, int t, float* out) const;

  FamilySettings settings;
  std::vector<Mamba2Layer> params;  ///< per layer
};

struct GdnFamily {
  using Tokens = GdnTokens;
  using Call = GdnCall;

  /// Draws nothing: GDN layers have no parameters outside the tokens.
  GdnFamily(const FamilySettings& settings, Rng& rng);
  std::size_t out_per_token() const;
  std::size_t state_elems() const;
  Tokens tokens(int batch, int T, Rng& rng) const;
  Call call(const StateCache& cache, int layer, const std::vector<std::int32_t>& slots,
            const Tokens& t) const;
  static Status decode(StateCache& cache, const Call& call) { return gdn_decode(cache, call.args); }
  static std::vector<std::uint8_t> raw_output(const Call& call) { return call.o.bytes(); }
  void oracle(int layer, double* S, const Tokens& tk, int b, int t, double* out) const;
  void naive(int layer, std::vector<float>& S, const Tokens& tk, int b, int t, float* out) const;

  FamilySettings settings;
};

/// The fold cadence (ops.h, fold_every) of the decodes of step `step`: `cycle` repeated, or 0
/// (the cache's buffer_len) when it is empty.
inline int fold_every_at(const std::vector<int>& cycle, int step) {
  return cycle.empty() ? 0 : cycle[std::size_t(step) % cycle.size()];
}

/// f(std::type_identity<Family>{}) for the family of `kind`.
template <typename F>
decltype(auto) with_family(LayerKind kind, F&& f) {
  switch (kind) {
    case LayerKind::kMamba2: return f(std::type_identity<Mamba2Family>{});
    case LayerKind::kGdn: return f(std::type_identity<GdnFamily>{});
  }
  throw std::logic_error("unknown layer kind");
}

}  // namespace replayssm::testing
