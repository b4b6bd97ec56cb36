// The float64 oracle (src/cpu/reference.h) checked on cases small enough to do by hand, on
// closed forms, and against the replay identities of ALGORITHM.md §4 evaluated in float64
// (which checks the algebra the library relies on, independently of the library).

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "cpu/reference.h"
#include "testing/inputs.h"

namespace replayssm {
namespace {

using reference::gdn_reference_step;
using reference::mamba2_reference_step;

const double kLn2 = std::log(2.0);

TEST(ReferenceMamba2, OneHeadScalarByHand) {
  const Mamba2Shape s{1, 1, 1, 1};
  std::vector<double> S(1, 0.0), y(1);
  const float A = -1.0f, D = 0.5f, bias = 0.0f, dt = 0.0f;  // Δ = ln 2, a = exp(-ln 2) = 1/2
  float x = 2.0f, B = 3.0f, C = 0.5f;
  mamba2_reference_step(s, S.data(), &x, &dt, &B, &C, nullptr, &A, &D, &bias, y.data());
  EXPECT_DOUBLE_EQ(S[0], 6.0 * kLn2);            // Δ·x·B
  EXPECT_DOUBLE_EQ(y[0], 3.0 * kLn2 + 1.0);      // S·C + D·x
  x = 1.0f, B = 1.0f, C = 1.0f;
  mamba2_reference_step(s, S.data(), &x, &dt, &B, &C, nullptr, &A, &D, &bias, y.data());
  EXPECT_DOUBLE_EQ(S[0], 4.0 * kLn2);            // ½·6 ln2 + ln2
  EXPECT_DOUBLE_EQ(y[0], 4.0 * kLn2 + 0.5);
}

TEST(ReferenceMamba2, TwoHeadsP2N2ByHand) {
  // H = 2 heads sharing one group, P = N = 2. Δ = ln 2 and a = ½ for both heads.
  const Mamba2Shape s{2, 2, 2, 1};
  const std::vector<float> A{-1, -1}, D{0, 1}, bias{0, 0}, dt{0, 0};
  std::vector<double> S(8, 0.0), y(4);
  {
    const std::vector<float> x{1, 2, 3, 4}, B{1, -1}, C{2, 1};
    mamba2_reference_step(s, S.data(), x.data(), dt.data(), B.data(), C.data(), nullptr,
                          A.data(), D.data(), bias.data(), y.data());
    const std::vector<double> S_want{1, -1, 2, -2, 3, -3, 4, -4};  // ·ln2: x ⊗ B per head
    for (int i = 0; i < 8; ++i) EXPECT_DOUBLE_EQ(S[i], S_want[i] * kLn2) << i;
    EXPECT_DOUBLE_EQ(y[0], 1 * kLn2);
    EXPECT_DOUBLE_EQ(y[1], 2 * kLn2);
    EXPECT_DOUBLE_EQ(y[2], 3 * (kLn2 + 1));  // + D·x with D = 1
    EXPECT_DOUBLE_EQ(y[3], 4 * (kLn2 + 1));
  }
  {
    const std::vector<float> x{1, 0, 0, 1}, B{0, 1}, C{1, 1};
    mamba2_reference_step(s, S.data(), x.data(), dt.data(), B.data(), C.data(), nullptr,
                          A.data(), D.data(), bias.data(), y.data());
    const std::vector<double> S_want{0.5, 0.5, 1, -1, 1.5, -1.5, 2, -1};
    for (int i = 0; i < 8; ++i) EXPECT_DOUBLE_EQ(S[i], S_want[i] * kLn2) << i;
    EXPECT_DOUBLE_EQ(y[0], kLn2);
    EXPECT_DOUBLE_EQ(y[1], 0.0);
    EXPECT_DOUBLE_EQ(y[2], 0.0);
    EXPECT_DOUBLE_EQ(y[3], kLn2 + 1);
  }
}

TEST(ReferenceMamba2, GateMultipliesBySiluZ) {
  const Mamba2Shape s{1, 1, 1, 1};
  std::vector<double> S(1, 0.0), y(1);
  const float A = -1.0f, D = 0.5f, bias = 0.0f, dt = 0.0f, x = 2.0f, B = 3.0f, C = 0.5f;
  const float z = 1.0f;
  mamba2_reference_step(s, S.data(), &x, &dt, &B, &C, &z, &A, &D, &bias, y.data());
  EXPECT_DOUBLE_EQ(y[0], (3.0 * kLn2 + 1.0) / (1.0 + std::exp(-1.0)));
}

TEST(ReferenceMamba2, HeadReadsItsGroup) {
  // H = 4, G = 2: heads 0, 1 read group 0, heads 2, 3 read group 1.
  const Mamba2Shape s{4, 1, 1, 2};
  const std::vector<float> A(4, -1.0f), D(4, 0.0f), bias(4, 0.0f), dt(4, 0.0f), x(4, 1.0f);
  const std::vector<float> B{1, 10}, C{1, 1};
  std::vector<double> S(4, 0.0), y(4);
  mamba2_reference_step(s, S.data(), x.data(), dt.data(), B.data(), C.data(), nullptr, A.data(),
                        D.data(), bias.data(), y.data());
  EXPECT_DOUBLE_EQ(y[0], kLn2);
  EXPECT_DOUBLE_EQ(y[1], kLn2);
  EXPECT_DOUBLE_EQ(y[2], 10 * kLn2);
  EXPECT_DOUBLE_EQ(y[3], 10 * kLn2);
}

TEST(ReferenceMamba2, SoftplusThreshold) {
  EXPECT_EQ(reference::softplus(25.0), 25.0);  // identity past 20 ...
  EXPECT_EQ(reference::softplus(20.5), 20.5);
  // ... and log1p(e^u) up to it (log1p(e^20) = 20 + 2.06e-9, visible in float64).
  EXPECT_NEAR(reference::softplus(20.0) - 20.0, std::exp(-20.0), 1e-14);
  EXPECT_DOUBLE_EQ(reference::softplus(0.0), kLn2);
  EXPECT_DOUBLE_EQ(reference::softplus(-4.0), std::log1p(std::exp(-4.0)));
  // Through the step: with S = 0, x = B = C = 1, D = 0, y = Δ.
  const Mamba2Shape s{1, 1, 1, 1};
  const float A = -1e-3f, D = 0.0f, one = 1.0f;
  for (float u : {25.0f, 19.0f}) {
    std::vector<double> S(1, 0.0), y(1);
    const float bias = 0.0f;
    mamba2_reference_step(s, S.data(), &one, &u, &one, &one, nullptr, &A, &D, &bias, y.data());
    const double want = u > 20.0f ? double(u) : std::log1p(std::exp(double(u)));
    EXPECT_DOUBLE_EQ(y[0], want) << "u = " << u;
  }
  EXPECT_NE(std::log1p(std::exp(19.0)), 19.0);  // the case above can tell the two apart
}

TEST(ReferenceMamba2, ConstantDecayMatchesClosedForm) {
  // With constant Δ, S_t = Σ_j a^{t−j}·Δ·x_j·B_j (one head, P = N = 1): 100 steps.
  const Mamba2Shape s{1, 1, 1, 1};
  const float A = -0.3f, D = 0.0f, bias = -1.0f, dt = 0.25f, C = 1.0f;
  const double delta = std::log1p(std::exp(-0.75));
  const double a = std::exp(double(A) * delta);
  testing::Rng rng(3);
  std::vector<float> xs, Bs;
  std::vector<double> S(1, 0.0), y(1);
  for (int t = 0; t < 100; ++t) {
    xs.push_back(float(rng.normal()));
    Bs.push_back(float(rng.normal()));
    mamba2_reference_step(s, S.data(), &xs.back(), &dt, &Bs.back(), &C, nullptr, &A, &D, &bias,
                          y.data());
  }
  double want = 0.0;
  for (int j = 0; j < 100; ++j) want += std::pow(a, 99 - j) * delta * xs[j] * Bs[j];
  EXPECT_NEAR(y[0], want, 1e-13 * (1.0 + std::fabs(want)));
}

// ALGORITHM.md §4, inner-product form, in float64: from a checkpoint S_c and a ring of w
// tokens, y_w = τ·(S_c·C) + Σ_{j≤w} s_j·(B_j·C)·x_j + D·x_w equals the recurrence.
TEST(ReferenceMamba2, InnerProductReplayIdentity) {
  const Mamba2Shape s{4, 3, 5, 2};
  testing::Rng rng(11);
  testing::Recipe recipe;
  const testing::Mamba2Layer p = testing::make_mamba2_layer(s, recipe, rng);
  const int H = 4, P = 3, N = 5, hpg = 2;
  std::vector<double> S(std::size_t(H) * P * N);
  for (double& e : S) e = rng.normal();
  const std::vector<double> S_c = S;
  const int w = 9;
  const testing::Mamba2Tokens tk = testing::make_mamba2_tokens(s, 1, w + 1, DType::kF32, false,
                                                               recipe, rng);
  std::vector<double> y(std::size_t(H) * P);
  for (int t = 0; t <= w; ++t) {
    mamba2_reference_step(s, S.data(), tk.x.data() + t * H * P, tk.dt.data() + t * H,
                          tk.B.data() + t * 2 * N, tk.C.data() + t * 2 * N, nullptr, p.A.data(),
                          p.D.data(), p.dt_bias.data(), y.data());
  }
  for (int h = 0; h < H; ++h) {
    const int g = h / hpg;
    std::vector<double> lambda(w + 1), delta(w + 1);
    double acc = 0.0;
    for (int j = 0; j <= w; ++j) {
      delta[j] = reference::softplus(double(tk.dt[j * H + h]) + double(p.dt_bias[h]));
      acc += double(p.A[h]) * delta[j];
      lambda[j] = acc;
    }
    const double tau = std::exp(lambda[w]);
    const float* Cw = tk.C.data() + w * 2 * N + g * N;
    for (int pp = 0; pp < P; ++pp) {
      double out = 0.0;
      for (int n = 0; n < N; ++n) out += S_c[(h * P + pp) * N + n] * Cw[n];
      out *= tau;
      for (int j = 0; j <= w; ++j) {
        double bc = 0.0;
        for (int n = 0; n < N; ++n) bc += double(tk.B[j * 2 * N + g * N + n]) * Cw[n];
        out += delta[j] * std::exp(lambda[w] - lambda[j]) * bc * tk.x[j * H * P + h * P + pp];
      }
      out += double(p.D[h]) * tk.x[w * H * P + h * P + pp];
      EXPECT_NEAR(out, y[h * P + pp], 1e-12 * (1.0 + std::fabs(y[h * P + pp])));
    }
  }
}

// ---- Gated DeltaNet -------------------------------------------------------------------------

TEST(ReferenceGdn, OrthonormalKeysByHand) {
  // Hk = Hv = 1, K = 2, V = 1. Keys along e1, e2: the delta rule is easy by hand.
  const GdnShape s{1, 1, 2, 1};
  std::vector<double> S(2, 0.0), o(1);
  const double r2 = std::sqrt(2.0);
  const double tol = 1e-6;  // the 1e-6 under the normalising root
  {
    // |k| = 5 -> k̂ = e1; α = 1; d = β·(v − S·k̂) = ½·2 = 1; S = [1, 0]; q̂ = e1/√2.
    const std::vector<float> q{3, 0}, k{5, 0}, v{2}, g{0}, beta{0.5f};
    gdn_reference_step(s, S.data(), q.data(), k.data(), v.data(), g.data(), beta.data(), true,
                       0.0f, o.data());
    EXPECT_NEAR(S[0], 1.0, tol);
    EXPECT_NEAR(S[1], 0.0, tol);
    EXPECT_NEAR(o[0], 1.0 / r2, tol);
  }
  {
    // k̂ = e2, α = ½, β = 1: d = 4 − ½·(S·e2 = 0) = 4; S = ½·[1, 0] + 4·e2 = [½, 4];
    // q̂ = (e1 + e2)/√2 · 2^-½ = (e1 + e2)/2; o = (½ + 4)/2.
    const std::vector<float> q{1, 1}, k{0, 2}, v{4}, g{float(-kLn2)}, beta{1.0f};
    gdn_reference_step(s, S.data(), q.data(), k.data(), v.data(), g.data(), beta.data(), true,
                       0.0f, o.data());
    EXPECT_NEAR(S[0], 0.5, tol);
    EXPECT_NEAR(S[1], 4.0, tol);
    EXPECT_NEAR(o[0], 2.25, tol);
  }
  {
    // k̂ = e1, β = 1, α = 1: the delta rule overwrites the e1 column with v: S = [3, 4].
    const std::vector<float> q{0, 7}, k{1, 0}, v{3}, g{0}, beta{1.0f};
    gdn_reference_step(s, S.data(), q.data(), k.data(), v.data(), g.data(), beta.data(), true,
                       0.0f, o.data());
    EXPECT_NEAR(S[0], 3.0, tol);
    EXPECT_NEAR(S[1], 4.0, tol);
    EXPECT_NEAR(o[0], 4.0 / r2, tol);
  }
}

TEST(ReferenceGdn, RawKeysAndScaleExact) {
  // Without qk_l2norm the keys are used as given and q̂ = scale·q: exact arithmetic.
  const GdnShape s{1, 1, 2, 2};
  std::vector<double> S{1, 2, 3, 4}, o(2);  // rows = value dim: S = [[1, 2], [3, 4]]
  const std::vector<float> q{1, -1}, k{0.5f, 0.0f}, v{10, 20}, g{0}, beta{0.5f};
  gdn_reference_step(s, S.data(), q.data(), k.data(), v.data(), g.data(), beta.data(), false,
                     2.0f, o.data());
  // S·k = [0.5, 1.5]; d = ½·(v − S·k) = [4.75, 9.25]; S += d·kᵀ -> [[3.375, 2], [7.625, 4]].
  EXPECT_DOUBLE_EQ(S[0], 3.375);
  EXPECT_DOUBLE_EQ(S[1], 2.0);
  EXPECT_DOUBLE_EQ(S[2], 7.625);
  EXPECT_DOUBLE_EQ(S[3], 4.0);
  // o = S·(2·q) = [2·(3.375 − 2), 2·(7.625 − 4)].
  EXPECT_DOUBLE_EQ(o[0], 2.75);
  EXPECT_DOUBLE_EQ(o[1], 7.25);
}

TEST(ReferenceGdn, ValueHeadsShareTheirKeyHead) {
  // Hk = 1, Hv = 2: both value heads use key head 0 with their own v, g, β.
  const GdnShape s{1, 2, 2, 1};
  std::vector<double> S(4, 0.0), o(2);
  const std::vector<float> q{1, 0}, k{1, 0}, v{2, 6}, g{0, 0}, beta{1.0f, 0.5f};
  gdn_reference_step(s, S.data(), q.data(), k.data(), v.data(), g.data(), beta.data(), false,
                     1.0f, o.data());
  EXPECT_DOUBLE_EQ(o[0], 2.0);
  EXPECT_DOUBLE_EQ(o[1], 3.0);
}

TEST(ReferenceGdn, UnitBetaWritesTheValue) {
  // β = 1, α = 1, |k̂| = 1: after the update S·k̂ = v exactly, whatever S was.
  const GdnShape s{1, 1, 8, 4};
  testing::Rng rng(5);
  std::vector<double> S(32);
  for (double& e : S) e = rng.normal();
  std::vector<float> q(8), k(8), v(4);
  for (float& e : q) e = float(rng.normal());
  for (float& e : k) e = float(rng.normal());
  for (float& e : v) e = float(rng.normal());
  const std::vector<float> g{0}, beta{1};
  std::vector<double> o(4);
  gdn_reference_step(s, S.data(), q.data(), k.data(), v.data(), g.data(), beta.data(), true,
                     0.0f, o.data());
  double kk = 0.0;
  for (float e : k) kk += double(e) * e;
  for (int r = 0; r < 4; ++r) {
    double sk = 0.0;
    for (int i = 0; i < 8; ++i) sk += S[r * 8 + i] * k[i] / std::sqrt(kk + 1e-6);
    EXPECT_NEAR(sk, v[r], 1e-6 * (1 + std::fabs(v[r])));
  }
}

// ALGORITHM.md §4, adjoint form, in float64: walking the query back through the window
// (t ← α_j·(t − β_j·(k̂_j·t)·k̂_j)) and reading S_c once equals the recurrence.
TEST(ReferenceGdn, AdjointReplayIdentity) {
  const GdnShape s{2, 4, 6, 3};
  const int Hk = 2, Hv = 4, K = 6, V = 3, hpk = 2;
  testing::Rng rng(21);
  std::vector<double> S(std::size_t(Hv) * V * K);
  for (double& e : S) e = rng.normal();
  const std::vector<double> S_c = S;
  const int w = 7;
  testing::Recipe recipe;
  const testing::GdnTokens tk = testing::make_gdn_tokens(s, 1, w + 1, DType::kF32, recipe, rng);
  std::vector<double> o(std::size_t(Hv) * V);
  for (int t = 0; t <= w; ++t) {
    gdn_reference_step(s, S.data(), tk.q.data() + t * Hk * K, tk.k.data() + t * Hk * K,
                       tk.v.data() + t * Hv * V, tk.g.data() + t * Hv, tk.beta.data() + t * Hv,
                       true, 0.0f, o.data());
  }
  auto unit = [&](const float* x, double scale) {
    double n = 0.0;
    for (int i = 0; i < K; ++i) n += double(x[i]) * x[i];
    std::vector<double> u(K);
    for (int i = 0; i < K; ++i) u[i] = x[i] / std::sqrt(n + 1e-6) * scale;
    return u;
  };
  for (int hv = 0; hv < Hv; ++hv) {
    const int hk = hv / hpk;
    std::vector<double> t = unit(tk.q.data() + w * Hk * K + hk * K, 1.0 / std::sqrt(double(K)));
    std::vector<double> out(V, 0.0);
    for (int j = w; j >= 0; --j) {
      const std::vector<double> kh = unit(tk.k.data() + j * Hk * K + hk * K, 1.0);
      double kt = 0.0;
      for (int i = 0; i < K; ++i) kt += kh[i] * t[i];
      const double c = double(tk.beta[j * Hv + hv]) * kt;
      for (int r = 0; r < V; ++r) out[r] += c * tk.v[j * Hv * V + hv * V + r];
      const double alpha = std::exp(double(tk.g[j * Hv + hv]));
      for (int i = 0; i < K; ++i) t[i] = alpha * (t[i] - c * kh[i]);
    }
    for (int r = 0; r < V; ++r) {
      for (int i = 0; i < K; ++i) out[r] += S_c[(hv * V + r) * K + i] * t[i];
      EXPECT_NEAR(out[r], o[hv * V + r], 1e-12 * (1.0 + std::fabs(o[hv * V + r])));
    }
  }
}

}  // namespace
}  // namespace replayssm
