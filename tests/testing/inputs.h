#pragma once
// Seeded, realistic inputs: a random number stream, the recipe that says how to draw layer
// parameters and token activations, and the drawn values as host vectors (exact in the input
// dtype, so the oracle sees what the cache stores).

#include <cstdint>
#include <random>
#include <vector>

#include "replayssm/types.h"

namespace replayssm::testing {

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : engine_(seed) {}
  double uniform(double lo, double hi);
  double normal(double mean = 0.0, double sd = 1.0);
  int uniform_int(int lo, int hi);  ///< inclusive
  std::mt19937_64& engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
};

/// How to draw parameters and inputs. Defaults are realistic: A = −exp(U(−1, 1)), dt_bias ≈ −4,
/// raw dt, x, B, C, z ~ N(0, 1); GDN q, k, v ~ N(0, 1), g = −softplus-like in [−1, 0) mostly
/// small, β = sigmoid(N(0, 1)).
struct Recipe {
  // Mamba-2
  double a_fixed = 0.0;          ///< A of every head when != 0
  double dt_bias_center = -4.0;  ///< dt_bias = center + U(−0.5, 0.5)
  double dt_sd = 1.0;            ///< raw dt ~ N(0, dt_sd)
  double d_scale = 1.0;          ///< D ~ d_scale·U(0.5, 1.5); 0 leaves only the state path
  // GDN
  double g_fixed = 0.0;          ///< g ≈ g_fixed·(1 + U(−0.1, 0.1)) when != 0
  double beta_lo = 0.0;          ///< β ~ U(beta_lo, beta_hi) when beta_hi > 0
  double beta_hi = 0.0;
  /// When > 0, every token's key is one fixed direction (the same for all tokens and rows)
  /// plus key_spread·N(0, 1) noise: nearly parallel keys, the ill-conditioned case for folds
  /// that solve the delta rule's recurrence over many tokens at once.
  double key_spread = 0.0;
  /// Without qk_l2norm the raw keys are used, so they are drawn with |k| ≈ 1 (a delta rule
  /// with β|k|² > 2 diverges); with it, k ~ N(0, 1) of any norm.
  bool unit_keys = false;
  /// Activations as sin(0.731·i + c) of their flat index instead of noise: a layout bug
  /// (swapped axes, wrong stride) moves values to where a different one is expected.
  bool structured = false;
};

struct Mamba2Layer {
  std::vector<float> A, D, dt_bias;  ///< [nheads]
};

/// One decode call's inputs, [batch, T, ...], activations already exact in the input dtype.
struct Mamba2Tokens {
  int batch = 0, T = 0;
  std::vector<float> x, dt, B, C, z;  ///< z empty: no gate
};
struct GdnTokens {
  int batch = 0, T = 0;
  std::vector<float> q, k, v, g, beta;
};

Mamba2Layer make_mamba2_layer(const Mamba2Shape& shape, const Recipe& recipe, Rng& rng);
Mamba2Tokens make_mamba2_tokens(const Mamba2Shape& shape, int batch, int T, DType input_dtype,
                                bool gate, const Recipe& recipe, Rng& rng);
GdnTokens make_gdn_tokens(const GdnShape& shape, int batch, int T, DType input_dtype,
                          const Recipe& recipe, Rng& rng);

/// Token t of every row of a window, as a one-token call's inputs ([batch, 1, ...]).
Mamba2Tokens token_at(const Mamba2Tokens& window, int t);
GdnTokens token_at(const GdnTokens& window, int t);

}  // namespace replayssm::testing
