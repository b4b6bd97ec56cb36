// Built against an installed replayssm (tests/install/run.cmake): one Mamba-2 replay decode on
// the CPU through the public API, checked against the step written out in double.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "replayssm/ops.h"
#include "replayssm/state_cache.h"
#include "replayssm/version.h"

namespace {

int fail(const char* what, const replayssm::Status& s) {
  std::fprintf(stderr, "consumer: %s: %s\n", what, s.message().c_str());
  return 1;
}

}  // namespace

int main() {
  using namespace replayssm;
  if (std::strcmp(version(), REPLAYSSM_VERSION) != 0) {
    std::fprintf(stderr, "consumer: library %s, headers %s\n", version(), REPLAYSSM_VERSION);
    return 1;
  }
  const Mamba2Shape shape{4, 8, 16, 2};  // nheads, head_dim, dstate, ngroups
  const int H = shape.nheads, P = shape.head_dim, N = shape.dstate, G = shape.ngroups;
  StateCacheConfig config;
  config.kind = LayerKind::kMamba2;
  config.mamba2 = shape;
  config.capacity = 2;
  config.mode = DecodeMode::kReplay;
  std::unique_ptr<StateCache> cache;
  if (Status s = state_cache_create(config, &cache); !s.is_ok()) return fail("create", s);

  // Two slots with the same state and the same inputs: their outputs must agree bit for bit.
  std::vector<float> state(std::size_t(H) * P * N), x(2 * H * P), B(2 * G * N), C(2 * G * N),
      dt(2 * H), y(2 * H * P, NAN);
  for (std::size_t i = 0; i < state.size(); ++i) state[i] = std::sin(0.1f * float(i));
  for (int r = 0; r < 2; ++r) {
    for (int i = 0; i < H * P; ++i) x[r * H * P + i] = std::cos(0.3f * float(i));
    for (int i = 0; i < G * N; ++i) {
      B[r * G * N + i] = 0.05f * float(i % 7);
      C[r * G * N + i] = 0.1f - 0.01f * float(i % 5);
    }
    for (int h = 0; h < H; ++h) dt[r * H + h] = 0.2f * float(h) - 0.3f;
  }
  const std::vector<float> A{-1.0f, -0.5f, -2.0f, -0.25f}, D{0.5f, 1.0f, 0.0f, -1.0f},
      dt_bias{0.1f, -0.2f, 0.3f, 0.0f};
  std::int32_t slots[2];
  for (std::int32_t& slot : slots) {
    int s = -1;
    if (Status st = state_cache_allocate_slot(*cache, &s); !st.is_ok()) return fail("allocate", st);
    if (Status st = state_cache_load_state(*cache, 0, s, state.data()); !st.is_ok()) {
      return fail("load_state", st);
    }
    slot = s;
  }
  Mamba2DecodeArgs args;
  args.batch = 2;
  args.slot_ids = slots;
  args.x = x.data();
  args.dt = dt.data();
  args.B = B.data();
  args.C = C.data();
  args.A = A.data();
  args.D = D.data();
  args.dt_bias = dt_bias.data();
  args.y = y.data();
  if (Status s = mamba2_decode(*cache, args); !s.is_ok()) return fail("mamba2_decode", s);

  // y = exp(A·Δ)·(S·C) + Δ·(B·C)·x + D·x with Δ = softplus(dt + dt_bias).
  double worst = 0.0;
  for (int h = 0; h < H; ++h) {
    const int g = h / (H / G);
    const double u = double(dt[h]) + dt_bias[h];
    const double delta = u > 20.0 ? u : std::log1p(std::exp(u));
    double bc = 0.0;
    for (int n = 0; n < N; ++n) bc += double(B[g * N + n]) * C[g * N + n];
    for (int p = 0; p < P; ++p) {
      double sc = 0.0;
      for (int n = 0; n < N; ++n) sc += double(state[(h * P + p) * N + n]) * C[g * N + n];
      const double xp = x[h * P + p];
      const double ref = std::exp(A[h] * delta) * sc + delta * bc * xp + D[h] * xp;
      const float out = y[h * P + p], twin = y[H * P + h * P + p];
      if (!std::isfinite(out) || std::memcmp(&out, &twin, sizeof out) != 0) {
        std::fprintf(stderr, "consumer: y[%d][%d] = %g and %g for the same inputs\n", h, p,
                     double(out), double(twin));
        return 1;
      }
      worst = std::fmax(worst, std::fabs(out - ref) / (1.0 + std::fabs(ref)));
    }
  }
  if (!(worst <= 1e-5)) {
    std::fprintf(stderr, "consumer: y differs from the reference by %g\n", worst);
    return 1;
  }
  std::printf("consumer: replayssm %s decoded on the CPU (max error %.1e)\n", version(), worst);
  return 0;
}
