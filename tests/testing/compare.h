#pragma once
// Comparing outputs and states: finiteness and the relative error norms every tolerance in the
// tests is stated in.
//
// Error norm everywhere: max_i |out_i − ref_i| / max_i |ref_i| over one output tensor (one
// decode call of one layer: [batch, T, heads, rows], real rows only) or one exported state.

#include <cstddef>
#include <vector>

namespace replayssm::testing {

bool all_finite(const float* v, std::size_t n);
inline bool all_finite(const std::vector<float>& v) { return all_finite(v.data(), v.size()); }
/// max|out − ref| / max|ref|; +inf when out holds a NaN/Inf; the absolute error when ref = 0.
double rel_error(const float* out, const double* ref, std::size_t n);
double rel_error(const std::vector<float>& out, const std::vector<double>& ref);
/// max|a − b| / max|b| over [begin, end) of two fp32 arrays (the comparisons of two backends,
/// or of two caches, where b is the one taken as the reference); +inf when a holds a NaN or an
/// Inf; the absolute difference when b is all zero.
double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b, std::size_t begin,
                    std::size_t end);
/// The mean of v[from, to): the error of a stretch of steps.
double mean_of(const std::vector<double>& v, int from, int to);

}  // namespace replayssm::testing
