#include "testing/inputs.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "testing/dtypes.h"

namespace replayssm::testing {

double Rng::uniform(double lo, double hi) {
  return std::uniform_real_distribution<double>(lo, hi)(engine_);
}
double Rng::normal(double mean, double sd) {
  return std::normal_distribution<double>(mean, sd)(engine_);
}
int Rng::uniform_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(engine_); }

namespace {

// n activations: N(0, sd) or, structured, sin(0.731·i + phase)·sd.
std::vector<float> activations(std::size_t n, double sd, const Recipe& recipe, Rng& rng) {
  std::vector<float> v(n);
  if (recipe.structured) {
    const double phase = rng.uniform(0.0, 6.283185307179586);
    for (std::size_t i = 0; i < n; ++i) v[i] = float(sd * std::sin(0.731 * double(i) + phase));
  } else {
    for (float& e : v) e = float(rng.normal(0.0, sd));
  }
  return v;
}

double softplus_d(double u) { return u > 20.0 ? u : std::log1p(std::exp(u)); }

// Token t of every row of a [batch, T, e] field, as a [batch, 1, e] field.
std::vector<float> gather_token(const std::vector<float>& f, int batch, int T, int t) {
  if (f.empty()) return {};
  const std::size_t e = f.size() / (std::size_t(batch) * T);
  std::vector<float> out(std::size_t(batch) * e);
  for (int b = 0; b < batch; ++b) {
    std::copy_n(f.begin() + std::ptrdiff_t((std::size_t(b) * T + t) * e), e,
                out.begin() + std::ptrdiff_t(std::size_t(b) * e));
  }
  return out;
}

}  // namespace

Mamba2Layer make_mamba2_layer(const Mamba2Shape& s, const Recipe& r, Rng& rng) {
  Mamba2Layer p;
  for (int h = 0; h < s.nheads; ++h) {
    p.A.push_back(r.a_fixed != 0.0 ? float(r.a_fixed) : float(-std::exp(rng.uniform(-1.0, 1.0))));
    p.D.push_back(float(r.d_scale * rng.uniform(0.5, 1.5)));
    p.dt_bias.push_back(float(r.dt_bias_center + rng.uniform(-0.5, 0.5)));
  }
  return p;
}

Mamba2Tokens make_mamba2_tokens(const Mamba2Shape& s, int batch, int T, DType input_dtype,
                                bool gate, const Recipe& r, Rng& rng) {
  Mamba2Tokens t;
  t.batch = batch;
  t.T = T;
  const std::size_t bt = std::size_t(batch) * T;
  t.x = activations(bt * s.nheads * s.head_dim, 1.0, r, rng);
  t.dt.resize(bt * s.nheads);
  for (float& e : t.dt) e = float(rng.normal(0.0, r.dt_sd));
  t.B = activations(bt * s.ngroups * s.dstate, 1.0, r, rng);
  t.C = activations(bt * s.ngroups * s.dstate, 1.0, r, rng);
  if (gate) t.z = activations(bt * s.nheads * s.head_dim, 1.0, r, rng);
  round_all(input_dtype, &t.x);
  round_all(input_dtype, &t.B);
  round_all(input_dtype, &t.C);
  round_all(input_dtype, &t.z);
  return t;
}

GdnTokens make_gdn_tokens(const GdnShape& s, int batch, int T, DType input_dtype,
                          const Recipe& r, Rng& rng) {
  GdnTokens t;
  t.batch = batch;
  t.T = T;
  const std::size_t bt = std::size_t(batch) * T;
  const double key_sd = r.unit_keys ? 1.0 / std::sqrt(double(s.head_k_dim)) : 1.0;
  t.q = activations(bt * s.num_k_heads * s.head_k_dim, key_sd, r, rng);
  t.k = activations(bt * s.num_k_heads * s.head_k_dim, key_sd, r, rng);
  if (r.key_spread > 0.0) {
    const std::size_t per_token = std::size_t(s.num_k_heads) * s.head_k_dim;
    for (std::size_t i = 0; i < t.k.size(); ++i) {
      const double direction = std::sin(0.37 * double(i % per_token) + 1.0);
      t.k[i] = float(key_sd * (direction + r.key_spread * rng.normal()));
    }
  }
  t.v = activations(bt * s.num_v_heads * s.head_v_dim, 1.0, r, rng);
  t.g.resize(bt * s.num_v_heads);
  t.beta.resize(bt * s.num_v_heads);
  for (float& g : t.g) {
    if (r.g_fixed != 0.0) {
      g = float(r.g_fixed * (1.0 + rng.uniform(-0.1, 0.1)));
    } else {
      // −exp(A_log)·softplus(a + dt_bias), as a model computes it, clamped to [−1, 0).
      const double v = std::exp(rng.uniform(-1.0, 0.5)) * softplus_d(rng.normal() - 3.0);
      g = float(-std::clamp(v, 1e-6, 1.0));
    }
  }
  for (float& b : t.beta) {
    b = r.beta_hi > 0.0 ? float(rng.uniform(r.beta_lo, r.beta_hi))
                        : float(1.0 / (1.0 + std::exp(-rng.normal())));
  }
  round_all(input_dtype, &t.q);
  round_all(input_dtype, &t.k);
  round_all(input_dtype, &t.v);
  return t;
}

Mamba2Tokens token_at(const Mamba2Tokens& w, int t) {
  Mamba2Tokens o;
  o.batch = w.batch;
  o.T = 1;
  o.x = gather_token(w.x, w.batch, w.T, t);
  o.dt = gather_token(w.dt, w.batch, w.T, t);
  o.B = gather_token(w.B, w.batch, w.T, t);
  o.C = gather_token(w.C, w.batch, w.T, t);
  o.z = gather_token(w.z, w.batch, w.T, t);
  return o;
}

GdnTokens token_at(const GdnTokens& w, int t) {
  GdnTokens o;
  o.batch = w.batch;
  o.T = 1;
  o.q = gather_token(w.q, w.batch, w.T, t);
  o.k = gather_token(w.k, w.batch, w.T, t);
  o.v = gather_token(w.v, w.batch, w.T, t);
  o.g = gather_token(w.g, w.batch, w.T, t);
  o.beta = gather_token(w.beta, w.batch, w.T, t);
  return o;
}

}  // namespace replayssm::testing
