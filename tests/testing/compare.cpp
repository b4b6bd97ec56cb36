#include "testing/compare.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace replayssm::testing {

bool all_finite(const float* v, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(v[i])) return false;
  }
  return true;
}

double rel_error(const float* out, const double* ref, std::size_t n) {
  double max_diff = 0.0, max_ref = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(out[i])) return std::numeric_limits<double>::infinity();
    max_diff = std::max(max_diff, std::fabs(double(out[i]) - ref[i]));
    max_ref = std::max(max_ref, std::fabs(ref[i]));
  }
  return max_ref > 0.0 ? max_diff / max_ref : max_diff;
}

double rel_error(const std::vector<float>& out, const std::vector<double>& ref) {
  if (out.size() != ref.size()) return std::numeric_limits<double>::infinity();
  return rel_error(out.data(), ref.data(), out.size());
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b, std::size_t begin,
                    std::size_t end) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = begin; i < end; ++i) {
    if (!std::isfinite(a[i])) return std::numeric_limits<double>::infinity();
    num = std::max(num, std::fabs(double(a[i]) - double(b[i])));
    den = std::max(den, std::fabs(double(b[i])));
  }
  return den > 0.0 ? num / den : num;
}

double mean_of(const std::vector<double>& v, int from, int to) {
  return std::accumulate(v.begin() + from, v.begin() + to, 0.0) / double(to - from);
}

}  // namespace replayssm::testing
