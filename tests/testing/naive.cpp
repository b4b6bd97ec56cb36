#include "testing/naive.h"

#include <cmath>
#include <cstddef>

#include "common/numeric.h"
#include "testing/dtypes.h"

namespace replayssm::testing {

void naive_mamba2_step(const Mamba2Shape& s, DType state_dtype, DType out_dtype,
                       std::vector<float>& state, const float* x, const float* dt, const float* B,
                       const float* C, const float* z, const float* A, const float* D,
                       const float* dt_bias, float* y) {
  const int H = s.nheads, P = s.head_dim, N = s.dstate;
  const int per_group = H / s.ngroups;
  for (int h = 0; h < H; ++h) {
    const int g = h / per_group;
    const float delta = softplus(dt[h] + dt_bias[h]);
    const float a = std::exp(A[h] * delta);
    for (int p = 0; p < P; ++p) {
      const float xp = x[h * P + p];
      float* row = state.data() + (std::size_t(h) * P + p) * N;
      float acc = 0.0f;
      for (int n = 0; n < N; ++n) {
        row[n] = round_to(state_dtype, a * row[n] + delta * xp * B[g * N + n]);
        acc += row[n] * C[g * N + n];
      }
      float out = acc + D[h] * xp;
      if (z != nullptr) out *= silu(z[h * P + p]);
      y[h * P + p] = round_to(out_dtype, out);
    }
  }
}

void naive_gdn_step(const GdnShape& s, DType state_dtype, DType out_dtype,
                    std::vector<float>& state, const float* q, const float* k, const float* v,
                    const float* g, const float* beta, bool qk_l2norm, float scale, float* o) {
  const int Hk = s.num_k_heads, Hv = s.num_v_heads, K = s.head_k_dim, V = s.head_v_dim;
  const int per_key = Hv / Hk;
  const float sc = scale == 0.0f ? 1.0f / std::sqrt(float(K)) : scale;
  std::vector<float> qh(std::size_t(Hk) * K), kh(std::size_t(Hk) * K);
  for (int hk = 0; hk < Hk; ++hk) {
    float qq = 0.0f, kk = 0.0f;
    for (int i = 0; i < K; ++i) {
      qq += q[hk * K + i] * q[hk * K + i];
      kk += k[hk * K + i] * k[hk * K + i];
    }
    const float qn = qk_l2norm ? 1.0f / std::sqrt(qq + 1e-6f) : 1.0f;
    const float kn = qk_l2norm ? 1.0f / std::sqrt(kk + 1e-6f) : 1.0f;
    for (int i = 0; i < K; ++i) {
      qh[hk * K + i] = q[hk * K + i] * qn * sc;
      kh[hk * K + i] = k[hk * K + i] * kn;
    }
  }
  for (int hv = 0; hv < Hv; ++hv) {
    const float* kv = kh.data() + std::size_t(hv / per_key) * K;
    const float* qv = qh.data() + std::size_t(hv / per_key) * K;
    const float alpha = std::exp(g[hv]);
    for (int r = 0; r < V; ++r) {
      float* row = state.data() + (std::size_t(hv) * V + r) * K;
      float sk = 0.0f;
      for (int i = 0; i < K; ++i) sk += row[i] * kv[i];
      const float d = beta[hv] * (v[hv * V + r] - alpha * sk);
      float out = 0.0f;
      for (int i = 0; i < K; ++i) {
        row[i] = round_to(state_dtype, alpha * row[i] + d * kv[i]);
        out += row[i] * qv[i];
      }
      o[hv * V + r] = round_to(out_dtype, out);
    }
  }
}

}  // namespace replayssm::testing
