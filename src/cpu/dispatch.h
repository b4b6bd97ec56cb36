#pragma once
// Run-time choice among the instruction-set variants of the CPU backend's hot loops (isa.h).
// dispatch.cpp defines backend.h's cpu:: entry points that are built per variant as calls into
// the chosen variant: the most capable one this CPU runs, or the one the environment variable
// REPLAYSSM_CPU_ISA names (baseline, x86-64-v3, x86-64-v4; native in a REPLAYSSM_CPU_NATIVE
// build), read once at the first call.

#include <span>
#include <string>

#include "backend.h"

/// backend.h's cpu:: entry points that each variant defines (in its namespace, with the
/// signature backend.h declares); dispatch.cpp forwards each to the chosen variant.
#define REPLAYSSM_CPU_DISPATCHED(X) \
  X(mamba2_decode)                  \
  X(gdn_decode)                     \
  X(fold_committed)

namespace replayssm::cpu {

/// One variant's entry points, typed as backend.h declares them.
struct IsaEntryPoints {
#define REPLAYSSM_CPU_ENTRY_POINT_FIELD(name) decltype(&cpu::name) name;
  REPLAYSSM_CPU_DISPATCHED(REPLAYSSM_CPU_ENTRY_POINT_FIELD)
#undef REPLAYSSM_CPU_ENTRY_POINT_FIELD
};

struct IsaVariant {
  const char* name;        // as REPLAYSSM_CPU_ISA spells it: "baseline", "x86-64-v3", ...
  bool (*runnable)();      // this CPU has every instruction the variant may use
  const IsaEntryPoints* entry_points;
};

/// The variants this build compiled, least demanding first.
std::span<const IsaVariant> isa_variants();

/// The variant for a REPLAYSSM_CPU_ISA value (null or empty: none set): the one it names when
/// this CPU runs it, else the most capable runnable one, with `note` saying why the named one
/// was passed over (empty when it was not).
const IsaVariant& isa_choose(const char* requested, std::string* note);

/// The variant the entry points run: isa_choose(getenv("REPLAYSSM_CPU_ISA")), fixed at the
/// first call, whose note (if any) goes to stderr once.
const IsaVariant& isa_active();

}  // namespace replayssm::cpu
