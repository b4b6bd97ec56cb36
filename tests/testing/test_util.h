#pragma once
// The shared test helpers at once, for a test that uses many of them. The helpers, one header
// per concern (namespace replayssm::testing; family.h and family_cases.h are not included here:
// the drivers and the two family suites include them):
//   inputs.h         seeded realistic parameters and tokens (Rng, Recipe, make_*_tokens)
//   dtypes.h         values as the element types store them (round_to, encode, decode)
//   compare.h        finiteness and the relative error norms tolerances are stated in
//   naive.h          naive same-precision loops, the yardstick of low-precision runs
//   tolerances.h     the tolerance rules of runs (vs the naive loop, per checkpoint precision)
//   device_buffer.h  memory in a cache's memory space (CacheBuffer)
//   cache_ops.h      the cache API with host vectors (create_cache, commit, fold, ...)
//   cache_bytes.h    raw views of a cache's buffers and cursors, for bit-exact checks
//   decode_call.h    one decode call's uploaded inputs, Args and poisoned output
//   family.h         one interface over both layer families, for the drivers
//   oracle_run.h     the driver: a cache against the float64 oracle over many steps
//   window_pair.h    the driver: k single steps against one k-token window
//   cuda_vs_cpu.h    the driver: the CUDA backend against the CPU backend
//   family_cases.h   the cases both family suites run, with their bodies
//   names.h          pieces of parameterised test names

#include "testing/cache_bytes.h"
#include "testing/cache_ops.h"
#include "testing/compare.h"
#include "testing/cuda_vs_cpu.h"
#include "testing/decode_call.h"
#include "testing/device_buffer.h"
#include "testing/dtypes.h"
#include "testing/inputs.h"
#include "testing/naive.h"
#include "testing/names.h"
#include "testing/oracle_run.h"
#include "testing/tolerances.h"
#include "testing/window_pair.h"
