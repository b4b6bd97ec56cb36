// The run-time choice among the CPU backend's instruction-set variants (src/cpu/dispatch.h).
// That each variant computes what the oracle does is checked by running the CPU op suites once
// per variant, forced through REPLAYSSM_CPU_ISA (tests/CMakeLists.txt); this binary runs in
// those configurations too, and checks that the forcing took effect.

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "cpu/dispatch.h"

namespace replayssm::cpu {
namespace {

const IsaVariant& most_capable_runnable() {
  const IsaVariant* best = nullptr;
  for (const IsaVariant& v : isa_variants()) {
    if (v.runnable()) best = &v;
  }
  return *best;
}

TEST(CpuIsa, VariantsAreKnownAndTheFirstRunsAnywhere) {
  const std::set<std::string> known{"baseline", "x86-64-v3", "x86-64-v4", "native"};
  std::set<std::string> seen;
  ASSERT_FALSE(isa_variants().empty());
  for (const IsaVariant& v : isa_variants()) {
    EXPECT_TRUE(known.count(v.name)) << v.name;
    EXPECT_TRUE(seen.insert(v.name).second) << v.name << " twice";
    ASSERT_NE(v.entry_points, nullptr);
    EXPECT_NE(v.entry_points->mamba2_decode, nullptr);
  }
  EXPECT_TRUE(isa_variants()[0].runnable()) << isa_variants()[0].name;
}

TEST(CpuIsa, UnsetChoosesTheMostCapableRunnable) {
  std::string note = "stale";
  EXPECT_EQ(&isa_choose(nullptr, &note), &most_capable_runnable());
  EXPECT_EQ(note, "");
  EXPECT_EQ(&isa_choose("", &note), &most_capable_runnable());
  EXPECT_EQ(note, "");
}

TEST(CpuIsa, NamedVariantIsChosenWhenRunnable) {
  for (const IsaVariant& v : isa_variants()) {
    std::string note;
    const IsaVariant& chosen = isa_choose(v.name, &note);
    if (v.runnable()) {
      EXPECT_EQ(&chosen, &v) << v.name;
      EXPECT_EQ(note, "") << v.name;
    } else {
      EXPECT_EQ(&chosen, &most_capable_runnable()) << v.name;
      EXPECT_NE(note.find("cannot run it"), std::string::npos) << note;
    }
  }
}

TEST(CpuIsa, UnknownNameFallsBackWithANote) {
  std::string note;
  EXPECT_EQ(&isa_choose("x86-64-v9", &note), &most_capable_runnable());
  EXPECT_NE(note.find("REPLAYSSM_CPU_ISA=x86-64-v9: not built (built: "), std::string::npos)
      << note;
  EXPECT_EQ(note.find('\n'), std::string::npos) << note;
}

TEST(CpuIsa, ActiveFollowsTheEnvironment) {
  const char* requested = std::getenv("REPLAYSSM_CPU_ISA");
  std::string note;
  const IsaVariant& expected = isa_choose(requested, &note);
  EXPECT_EQ(&isa_active(), &expected);
  if (requested != nullptr && *requested != '\0') {
    // ctest's forced runs: a variant this CPU cannot run is reported skipped, by the
    // library's note on stderr.
    if (!note.empty()) GTEST_SKIP() << note;
    EXPECT_STREQ(isa_active().name, requested);
  }
}

}  // namespace
}  // namespace replayssm::cpu
