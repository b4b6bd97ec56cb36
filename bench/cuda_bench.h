#pragma once
/// \file cuda_bench.h
/// The CUDA side of the benchmarks. Its entry points, run_cuda_bench (the protocol, both layer
/// families) and run_cuda_spec_bench (speculative verify against an eager spec step), and their
/// result types are declared in bench.h, so that builds without CUDA link against
/// cuda_bench_unavailable.cpp; this header is kept for the CUDA files that include it.

#include "bench.h"
