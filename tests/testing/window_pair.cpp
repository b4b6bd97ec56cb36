#include "testing/window_pair.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "testing/cache_ops.h"
#include "testing/compare.h"
#include "testing/family.h"

namespace replayssm::testing {

namespace {

template <typename Family>
void run_window_vs_single_impl(WindowPair& p, std::uint64_t seed, int rounds, double* worst) {
  const StateCacheConfig& cfg = p.window->config();
  const int batch = int(p.ws.size());
  const int T = cfg.max_spec_tokens;
  FamilySettings settings;
  settings.cache = cfg;
  settings.gate = true;
  settings.qk_l2norm = true;
  Rng rng(seed);
  const Family family(settings, rng);  // Mamba-2: the layer's A, D, dt_bias first
  const std::size_t ot = family.out_per_token();
  const std::vector<std::int32_t> full(std::size_t(batch), T), one(std::size_t(batch), 1);
  for (int round = 0; round < rounds; ++round) {
    const typename Family::Tokens tk = family.tokens(batch, T, rng);
    const typename Family::Call wc = family.call(*p.window, 0, p.ws, tk);
    ASSERT_TRUE(Family::decode(*p.window, wc).is_ok());
    ASSERT_TRUE(commit(*p.window, p.ws, full).is_ok());
    const std::vector<float> wout = wc.output();
    ASSERT_TRUE(all_finite(wout));
    for (int t = 0; t < T; ++t) {
      const typename Family::Call sc = family.call(*p.single, 0, p.ss, token_at(tk, t));
      ASSERT_TRUE(Family::decode(*p.single, sc).is_ok());
      ASSERT_TRUE(commit(*p.single, p.ss, one).is_ok());
      const std::vector<float> sout = sc.output();
      ASSERT_TRUE(all_finite(sout));
      double diff = 0.0, mag = 0.0;
      for (int b = 0; b < batch; ++b) {
        for (std::size_t e = 0; e < ot; ++e) {
          const double w = wout[(std::size_t(b) * T + t) * ot + e];
          diff = std::max(diff, std::fabs(w - sout[std::size_t(b) * ot + e]));
          mag = std::max(mag, std::fabs(w));
        }
      }
      *worst = std::max(*worst, diff / mag);
    }
  }
}

}  // namespace

WindowPair make_window_pair(const StateCacheConfig& config, int batch) {
  WindowPair p;
  p.window = create_cache(config);
  p.single = create_cache(config);
  for (int b = 0; b < batch; ++b) {
    p.ws.push_back(allocate_slot(*p.window));
    p.ss.push_back(allocate_slot(*p.single));
  }
  std::reverse(p.ss.begin(), p.ss.end());  // different slot per row in the two caches
  return p;
}

void run_window_vs_single(WindowPair& p, std::uint64_t seed, int rounds, double* worst) {
  with_family(p.window->config().kind, [&](auto family) {
    run_window_vs_single_impl<typename decltype(family)::type>(p, seed, rounds, worst);
  });
}

void expect_window_states_match(WindowPair& p, double tol) {
  for (std::size_t b = 0; b < p.ws.size(); ++b) {
    std::vector<float> a, s;
    ASSERT_TRUE(export_state(*p.window, 0, p.ws[b], &a).is_ok());
    ASSERT_TRUE(export_state(*p.single, 0, p.ss[b], &s).is_ok());
    double diff = 0.0, mag = 0.0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      diff = std::max(diff, double(std::fabs(a[i] - s[i])));
      mag = std::max(mag, double(std::fabs(a[i])));
    }
    EXPECT_GT(mag, 0.0);
    EXPECT_LE(diff / mag, tol);
  }
}

}  // namespace replayssm::testing
