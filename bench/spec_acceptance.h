#pragma once
/// \file spec_acceptance.h
/// How many tokens the speculative comparison (run_cuda_spec_bench) commits per verify step:
/// a fixed k for every row and step, or random acceptance, as the public kernels we compare
/// with are timed: per row and per step, k in 1..T drawn from a fixed distribution, so that
/// every row folds on its own cadence. Host code only (both CLIs parse --spec-accepted with it;
/// the CUDA cases draw their pattern with it before capture).

#include <cstdint>
#include <string>
#include <vector>

#include "replayssm/status.h"

namespace replayssm {

/// The `accepted` argument of the spec bench (run_cuda_spec_bench, run_cuda_bench_gdn_spec)
/// that asks for random acceptance instead of a fixed k (--spec-accepted random).
inline constexpr int kRandomAcceptance = -1;

/// What "random" commits, in the words of both CLIs' --spec-accepted help (the distribution of
/// random_acceptance_probabilities).
inline constexpr const char* kRandomAcceptanceHelp =
    "per row and step, k drawn from P(k = 1..4) = 0.1, 0.2, 0.3, 0.4 at T = 4 (uniform over 1..T "
    "otherwise), each row folding on its own cadence";

/// P(k) for k = 1..T: [0.1, 0.2, 0.3, 0.4] for T = 4 (the public kernels' benchmark), uniform
/// over 1..T for any other T. window >= 1.
std::vector<double> random_acceptance_probabilities(int window);

/// The mean k of that distribution (3.0 for T = 4).
double random_acceptance_mean(int window);

/// Steps of a random-acceptance graph: at least 16 distinct draws, and enough that every row
/// folds a few times, max(16, 3·ceil(L / mean)).
int random_acceptance_steps(int window, int buffer_len);

/// The pattern a random-acceptance case commits: draws[s][b] = k of row b at step s, for
/// `steps` steps of `batch` rows, from random_acceptance_probabilities(window) with a fixed
/// seed: the same (window, batch, steps) gives the same draws in every case and run, so the
/// eager baseline and every replay case commit the same pattern.
std::vector<std::vector<std::int32_t>> random_acceptance_draws(int window, int batch, int steps);

/// The mean of the draws (what the graph commits per row and step on average).
double random_acceptance_draws_mean(const std::vector<std::vector<std::int32_t>>& draws);

/// Parses a --spec-accepted value: "random" (kRandomAcceptance) or an integer in [0, window]
/// (0: all `window` tokens). Anything else is an invalid argument that names both flags, e.g.
/// "--spec-accepted must be an integer in [0, 4] (at most --spec-tokens (-T), 0 = all) or
/// 'random', got '9'". `window_flag` is the window's flag as the CLI spells it.
Status parse_spec_accepted(const std::string& text, int window, const std::string& window_flag,
                           int* accepted);

}  // namespace replayssm
