#pragma once
// The window invariant: k single-token decodes (commit 1 each) and one k-token window (commit
// k) on the same tokens give the same outputs and states, round after round across folds.

#include <cstdint>
#include <memory>
#include <vector>

#include "replayssm/state_cache.h"

namespace replayssm::testing {

/// Two caches of one config (kind and shape from it, capacity >= batch) driven on the same
/// tokens, `batch` rows each: one decodes T-token windows and commits all T, the other decodes
/// the same tokens one at a time, committing 1 each. Row b sits in slot ws[b] of `window` and
/// ss[b] of `single`: different slots (ss is ws reversed).
struct WindowPair {
  std::unique_ptr<StateCache> window, single;
  std::vector<std::int32_t> ws, ss;
};
WindowPair make_window_pair(const StateCacheConfig& config, int batch);
/// `rounds` rounds of T = config.max_spec_tokens tokens (fp32, default recipe; Mamba-2 with a
/// gate and its layer drawn first from `seed`'s stream; GDN with qk_l2norm and the default
/// scale). *worst: max over rounds and positions t of max|o_window − o_single| / max|o_window|
/// over the batch's outputs at t. Fatal assertions on any failed call or non-finite output.
void run_window_vs_single(WindowPair& p, std::uint64_t seed, int rounds, double* worst);
/// Every row's exported layer-0 state of the single-step cache against the window cache's:
/// max|ΔS| / max|S_window| <= tol, and S_window not all zero.
void expect_window_states_match(WindowPair& p, double tol);

}  // namespace replayssm::testing
