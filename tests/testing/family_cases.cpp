#include "testing/family_cases.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "testing/cache_bytes.h"
#include "testing/names.h"
#include "testing/tolerances.h"
#include "testing/window_pair.h"

namespace replayssm::testing {

void PrintTo(const StructuredCase& c, std::ostream* os) {
  *os << mode_tag(c.mode) << int_tag("_L", c.L);
}

void expect_structured_matches_oracle(RunSpec spec, const StructuredCase& c, std::uint64_t seed,
                                      double tol) {
  spec.cache.buffer_len = c.L;
  spec.recipe.structured = true;
  spec.batch = 3;
  spec.steps = std::max(4 * c.L, 24) + 1;
  spec.seed = seed;
  const RunResult r = run_oracle(spec);
  ASSERT_EQ(r.failure, "");
  EXPECT_LE(r.max_error, tol);
  EXPECT_LE(r.export_error, tol);
}

void PrintTo(const WindowCase& c, std::ostream* os) {
  *os << int_tag("T", c.T) << int_tag("_L", c.L);
}

void expect_window_equals_single_steps(StateCacheConfig config, const WindowCase& c,
                                       std::uint64_t seed, double tol) {
  config.capacity = 2;
  config.buffer_len = c.L;
  config.max_spec_tokens = c.T;
  WindowPair p = make_window_pair(config, 2);
  double worst = 0.0;
  ASSERT_NO_FATAL_FAILURE(run_window_vs_single(p, seed, 4 * c.L + 6, &worst));
  EXPECT_LE(worst, tol);
  EXPECT_EQ(cursor_committed(*p.window, p.ws[0]), cursor_committed(*p.single, p.ss[0]));
  expect_window_states_match(p, tol);
}

void PrintTo(const PrecisionCase& c, std::ostream* os) {
  *os << precision_tag(c.precision) << int_tag("_L", c.L);
}

void expect_checkpoint_precision_bounds(RunSpec spec, const PrecisionCase& c, std::uint64_t seed,
                                        double fp32_tol) {
  spec.cache.buffer_len = c.L;
  spec.cache.checkpoint = c.precision;
  spec.batch = 3;
  spec.steps = 4 * c.L + 3;
  spec.seed = seed;
  const RunResult r = run_oracle(spec);
  ASSERT_EQ(r.failure, "");
  expect_checkpoint_bounds(r, c.precision, fp32_tol);
}

}  // namespace replayssm::testing
