// The float64 oracle. Deliberately naive: token by token, element by element, exactly as
// ALGORITHM.md §1 and §2 write it. Speed is not a goal; obviousness is.

#include "cpu/reference.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace replayssm::reference {

double softplus(double u) { return u > 20.0 ? u : std::log1p(std::exp(u)); }
double silu(double u) { return u / (1.0 + std::exp(-u)); }

void mamba2_reference_step(const Mamba2Shape& shape, double* state, const float* x,
                           const float* dt, const float* B, const float* C, const float* z,
                           const float* A, const float* D, const float* dt_bias, double* y) {
  const int H = shape.nheads, P = shape.head_dim, N = shape.dstate;
  const int heads_per_group = H / shape.ngroups;
  for (int h = 0; h < H; ++h) {
    const int g = h / heads_per_group;
    const double delta = softplus(double(dt[h]) + double(dt_bias[h]));
    const double a = std::exp(double(A[h]) * delta);
    for (int p = 0; p < P; ++p) {
      const double xp = x[h * P + p];
      double* row = state + (std::int64_t(h) * P + p) * N;
      double acc = 0.0;
      for (int n = 0; n < N; ++n) {
        row[n] = a * row[n] + delta * xp * double(B[g * N + n]);
        acc += row[n] * double(C[g * N + n]);
      }
      double out = acc + double(D[h]) * xp;
      if (z != nullptr) out *= silu(double(z[h * P + p]));
      y[h * P + p] = out;
    }
  }
}

void gdn_reference_step(const GdnShape& shape, double* state, const float* q, const float* k,
                        const float* v, const float* g, const float* beta, bool qk_l2norm,
                        float scale, double* o) {
  const int Hk = shape.num_k_heads, Hv = shape.num_v_heads;
  const int K = shape.head_k_dim, V = shape.head_v_dim;
  const int heads_per_key = Hv / Hk;
  const double s = scale == 0.0f ? 1.0 / std::sqrt(double(K)) : double(scale);
  // Normalised queries and keys of every key head.
  std::vector<double> qh(std::size_t(Hk) * K), kh(std::size_t(Hk) * K);
  for (int hk = 0; hk < Hk; ++hk) {
    double qq = 0.0, kk = 0.0;
    for (int i = 0; i < K; ++i) {
      qq += double(q[hk * K + i]) * double(q[hk * K + i]);
      kk += double(k[hk * K + i]) * double(k[hk * K + i]);
    }
    const double qn = qk_l2norm ? 1.0 / std::sqrt(qq + 1e-6) : 1.0;
    const double kn = qk_l2norm ? 1.0 / std::sqrt(kk + 1e-6) : 1.0;
    for (int i = 0; i < K; ++i) {
      qh[hk * K + i] = double(q[hk * K + i]) * qn * s;
      kh[hk * K + i] = double(k[hk * K + i]) * kn;
    }
  }
  for (int hv = 0; hv < Hv; ++hv) {
    const double* kv = kh.data() + std::size_t(hv / heads_per_key) * K;
    const double* qv = qh.data() + std::size_t(hv / heads_per_key) * K;
    const double alpha = std::exp(double(g[hv]));
    const double b = beta[hv];
    for (int r = 0; r < V; ++r) {
      double* row = state + (std::int64_t(hv) * V + r) * K;
      double sk = 0.0;
      for (int i = 0; i < K; ++i) sk += row[i] * kv[i];
      const double d = b * (double(v[hv * V + r]) - alpha * sk);
      double out = 0.0;
      for (int i = 0; i < K; ++i) {
        row[i] = alpha * row[i] + d * kv[i];
        out += row[i] * qv[i];
      }
      o[hv * V + r] = out;
    }
  }
}

}  // namespace replayssm::reference
