#pragma once
// The instruction-set variant that a translation unit of the CPU backend's hot loops is built
// for. The build compiles those files once per variant (cmake/ReplayssmCpuIsa.cmake: on x86-64
// with GCC, baseline, x86-64-v3 and x86-64-v4; a single variant elsewhere, or `native` with
// REPLAYSSM_CPU_NATIVE), each into its own namespace, and dispatch.cpp runs the most capable
// variant this CPU supports.
//
// A variant's code sits between REPLAYSSM_CPU_BEGIN and REPLAYSSM_CPU_END: in namespace
// replayssm::cpu::<variant>, under GCC's target pragma for its level. Whatever is included
// before REPLAYSSM_CPU_BEGIN (the standard library, common/, state_cache_layout.h) keeps the
// build's baseline target, so the functions that every variant's object defines under one
// name (inline functions, template instantiations) are the same machine code in all of them
// and the linker may keep any copy. Compiling whole files with -march would make those copies
// differ, and a baseline caller could end up in an AVX-512 one.

#if !defined(REPLAYSSM_CPU_VARIANT)
// Files outside the variants (state_io.cpp, tests) see the baseline variant's helpers.
#define REPLAYSSM_CPU_VARIANT baseline
#endif

#define REPLAYSSM_CPU_PRAGMA_(text) _Pragma(#text)
#define REPLAYSSM_CPU_PRAGMA(text) REPLAYSSM_CPU_PRAGMA_(text)

#if defined(REPLAYSSM_CPU_TARGET) && !defined(__CUDACC__)
// REPLAYSSM_CPU_TARGET is "arch=x86-64-v3" or "arch=x86-64-v4": GCC keeps inlining the
// baseline helpers (numeric.h's conversions) into such code, as those levels only add
// instructions to the default x86-64 target.
#define REPLAYSSM_CPU_BEGIN                                   \
  _Pragma("GCC push_options")                                 \
  REPLAYSSM_CPU_PRAGMA(GCC target(REPLAYSSM_CPU_TARGET))      \
  namespace replayssm::cpu::REPLAYSSM_CPU_VARIANT {
#define REPLAYSSM_CPU_END \
  }                       \
  _Pragma("GCC pop_options")
#else
#define REPLAYSSM_CPU_BEGIN namespace replayssm::cpu::REPLAYSSM_CPU_VARIANT {
#define REPLAYSSM_CPU_END }
#endif

// The intrinsic paths a variant may use. The target pragma does not define __AVX2__ and its
// kin in C++ (GCC preprocesses the whole file before it parses the pragma), so the level says
// it; the baseline and native variants follow the compiler's flags.
#if !defined(REPLAYSSM_CPU_LEVEL)
#define REPLAYSSM_CPU_LEVEL 0
#endif
#if !defined(__CUDACC__) && (REPLAYSSM_CPU_LEVEL >= 3 ||                              \
                             (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)))
#define REPLAYSSM_CPU_AVX2 1  // AVX2, FMA, F16C
#else
#define REPLAYSSM_CPU_AVX2 0
#endif
#if !defined(__CUDACC__) && (REPLAYSSM_CPU_LEVEL >= 4 ||                                \
                             (REPLAYSSM_CPU_AVX2 && defined(__AVX512F__) &&             \
                              defined(__AVX512BW__) && defined(__AVX512VL__)))
#define REPLAYSSM_CPU_AVX512 1  // AVX-512 F, BW, VL (and CD, DQ)
#else
#define REPLAYSSM_CPU_AVX512 0
#endif

namespace replayssm::cpu {
namespace REPLAYSSM_CPU_VARIANT {}
// cpu::X names this file's variant's X (for the files outside the variants, the baseline's).
using namespace REPLAYSSM_CPU_VARIANT;
}  // namespace replayssm::cpu
