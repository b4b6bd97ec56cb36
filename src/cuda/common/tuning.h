#pragma once
// Launch-shape constants that a tuning sweep may override from the environment, so that one
// build measures several choices in one device call (bench/: REPLAYSSM_TUNE_<NAME>=<int>). Read
// once per process where used; without the variable, the tuned default of the call site. Not an
// interface: the defaults are what ships and what the tests check, and every value an override
// can take leaves the results unchanged (it moves work between blocks, never what is computed).

#include <cstdlib>

namespace replayssm::cuda {

/// The value of REPLAYSSM_TUNE_<name> if it is set to a whole number, else `fallback`.
inline int tuning_value(const char* env_name, int fallback) {
  const char* v = std::getenv(env_name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long parsed = std::strtol(v, &end, 10);
  return (*end == '\0') ? static_cast<int>(parsed) : fallback;
}

}  // namespace replayssm::cuda
