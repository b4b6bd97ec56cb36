#pragma once
// REPLAYSSM_HD marks a small function that host code (both backends' host sides, the CPU
// backend, benches, tests) and CUDA device code share: one definition of each rule.

#if defined(__CUDACC__)
#define REPLAYSSM_HD __host__ __device__ __forceinline__
#else
#define REPLAYSSM_HD inline
#endif
