// The spec bench's random acceptance (bench/spec_acceptance.h): the distribution the public
// kernels are timed with, the draws every case commits, and the --spec-accepted values.

#include <gtest/gtest.h>

#include <numeric>

#include "spec_acceptance.h"

namespace replayssm {
namespace {

TEST(SpecAcceptance, DistributionOfThePublicKernelsAtT4UniformElsewhere) {
  EXPECT_EQ(random_acceptance_probabilities(4), (std::vector<double>{0.1, 0.2, 0.3, 0.4}));
  EXPECT_NEAR(random_acceptance_mean(4), 3.0, 1e-12);
  for (int T : {1, 2, 3, 5, 8}) {
    const std::vector<double> p = random_acceptance_probabilities(T);
    ASSERT_EQ(p.size(), std::size_t(T));
    for (double x : p) EXPECT_DOUBLE_EQ(x, 1.0 / T);
    EXPECT_NEAR(random_acceptance_mean(T), (T + 1) / 2.0, 1e-12) << "T = " << T;
  }
}

TEST(SpecAcceptance, StepsAtLeast16AndThreeFoldCycles) {
  EXPECT_EQ(random_acceptance_steps(4, 16), 18);  // 3 · ceil(16 / 3)
  EXPECT_EQ(random_acceptance_steps(4, 8), 16);   // 3 · ceil(8 / 3) = 9: the floor of 16
  EXPECT_EQ(random_acceptance_steps(4, 24), 24);  // 24 / 3 exactly: 3 · 8, no extra cycle
  EXPECT_EQ(random_acceptance_steps(4, 32), 33);  // 3 · ceil(32 / 3)
  EXPECT_EQ(random_acceptance_steps(2, 16), 33);  // mean 1.5: 3 · ceil(10.67)
  EXPECT_EQ(random_acceptance_steps(8, 16), 16);  // mean 4.5: 3 · 4 = 12
}

TEST(SpecAcceptance, DrawsAreSeededInRangeAndFollowTheDistribution) {
  const auto draws = random_acceptance_draws(4, 256, 18);
  ASSERT_EQ(draws.size(), 18u);
  std::vector<int> counts(5, 0);
  for (const auto& step : draws) {
    ASSERT_EQ(step.size(), 256u);
    for (std::int32_t k : step) {
      ASSERT_GE(k, 1);
      ASSERT_LE(k, 4);
      ++counts[std::size_t(k)];
    }
  }
  // The same arguments give the same pattern (eager and replay cases commit the same draws).
  EXPECT_EQ(random_acceptance_draws(4, 256, 18), draws);
  // Steps differ from each other (a graph of distinct draws, not one step repeated).
  EXPECT_NE(draws[0], draws[1]);
  // 4608 draws: each frequency within 0.03 of its probability (about 4 standard deviations).
  const double n = 18.0 * 256;
  for (int k = 1; k <= 4; ++k) EXPECT_NEAR(counts[std::size_t(k)] / n, 0.1 * k, 0.03) << k;
  EXPECT_NEAR(random_acceptance_draws_mean(draws), 3.0, 0.05);
}

TEST(SpecAcceptance, ParsesIntegersInRangeAndRandom) {
  int k = 99;
  ASSERT_TRUE(parse_spec_accepted("random", 4, "--spec-tokens (-T)", &k).is_ok());
  EXPECT_EQ(k, kRandomAcceptance);
  for (int v = 0; v <= 4; ++v) {
    ASSERT_TRUE(parse_spec_accepted(std::to_string(v), 4, "--spec-tokens (-T)", &k).is_ok());
    EXPECT_EQ(k, v);
  }
}

TEST(SpecAcceptance, RefusesAnythingElseNamingTheRange) {
  for (const char* bad : {"9", "5", "-1", "sometimes", "", "3x", " 3", "3.0", "Random"}) {
    int k = 7;
    const Status s = parse_spec_accepted(bad, 4, "--spec-tokens (-T)", &k);
    ASSERT_FALSE(s.is_ok()) << "'" << bad << "'";
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(s.message(), std::string("--spec-accepted must be an integer in [0, 4] (at most "
                                       "--spec-tokens (-T), 0 = all) or 'random', got '") +
                               bad + "'");
    EXPECT_EQ(k, 7) << "a refused value leaves the output alone";
  }
}

}  // namespace
}  // namespace replayssm
