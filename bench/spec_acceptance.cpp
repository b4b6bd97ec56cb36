#include "spec_acceptance.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <random>

namespace replayssm {

namespace {

// The draws are host-side and seeded once, so every case of every run commits the same pattern.
constexpr std::uint32_t kRandomAcceptanceSeed = 20240917;

}  // namespace

std::vector<double> random_acceptance_probabilities(int window) {
  if (window == 4) return {0.1, 0.2, 0.3, 0.4};
  return std::vector<double>(std::size_t(std::max(window, 1)), 1.0 / std::max(window, 1));
}

double random_acceptance_mean(int window) {
  const std::vector<double> p = random_acceptance_probabilities(window);
  double mean = 0.0;
  for (std::size_t i = 0; i < p.size(); ++i) mean += double(i + 1) * p[i];
  return mean;
}

int random_acceptance_steps(int window, int buffer_len) {
  // The tolerance keeps a mean that is an exact divisor of L in floating point (12 / 3.0 where
  // the sum came out at 3.0000000000000004 or 2.9999999999999996) from adding a step.
  const int cycle =
      int(std::ceil(double(std::max(buffer_len, 1)) / random_acceptance_mean(window) - 1e-9));
  return std::max(16, 3 * cycle);
}

std::vector<std::vector<std::int32_t>> random_acceptance_draws(int window, int batch, int steps) {
  const std::vector<double> p = random_acceptance_probabilities(window);
  std::mt19937 rng(kRandomAcceptanceSeed);
  std::discrete_distribution<int> k(p.begin(), p.end());  // 0-based: k tokens = draw + 1
  std::vector<std::vector<std::int32_t>> draws(std::size_t(std::max(steps, 0)));
  for (std::vector<std::int32_t>& step : draws) {
    step.resize(std::size_t(std::max(batch, 0)));
    for (std::int32_t& row : step) row = k(rng) + 1;
  }
  return draws;
}

double random_acceptance_draws_mean(const std::vector<std::vector<std::int32_t>>& draws) {
  double sum = 0.0, n = 0.0;
  for (const std::vector<std::int32_t>& step : draws) {
    for (std::int32_t k : step) sum += k;
    n += double(step.size());
  }
  return n > 0.0 ? sum / n : 0.0;
}

Status parse_spec_accepted(const std::string& text, int window, const std::string& window_flag,
                           int* accepted) {
  if (text == "random") {
    *accepted = kRandomAcceptance;
    return Status::ok();
  }
  int k = -1;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, k);
  if (text.empty() || ec != std::errc() || ptr != end || k < 0 || k > window) {
    return invalid_argument("--spec-accepted must be an integer in [0, " + std::to_string(window) +
                            "] (at most " + window_flag + ", 0 = all) or 'random', got '" +
                            text + "'");
  }
  *accepted = k;
  return Status::ok();
}

}  // namespace replayssm
