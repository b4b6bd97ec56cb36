#include "testing/cuda_vs_cpu.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "testing/cache_bytes.h"
#include "testing/cache_ops.h"
#include "testing/compare.h"
#include "testing/family.h"

namespace replayssm::testing {

namespace {

// Every row (slots 1..batch) of every layer starts from the same N(0, sd) state in both caches.
void load_initial_states(const CudaVsCpuSpec& c, StateCache& cpu, StateCache& gpu, Rng& rng) {
  const std::size_t se = std::size_t(c.config.dims().state_elems());
  for (int layer = 0; layer < c.config.num_layers; ++layer) {
    for (int r = 0; r < c.batch; ++r) {
      std::vector<float> s(se);
      for (float& v : s) v = float(rng.normal(0.0, c.initial_sd));
      ASSERT_TRUE(state_cache_load_state(cpu, layer, r + 1, s.data()).is_ok());
      const Status st = state_cache_load_state(gpu, layer, r + 1, s.data());
      ASSERT_TRUE(st.is_ok()) << st.to_string();
    }
  }
}

// After a commit: every row's committed, pending and per-layer folded cursors agree.
void expect_same_cursors(const CudaVsCpuSpec& c, const StateCache& cpu, const StateCache& gpu,
                         int step) {
  for (int r = 0; r < c.batch; ++r) {
    ASSERT_EQ(cursor_committed(gpu, r + 1), cursor_committed(cpu, r + 1));
    ASSERT_EQ(cursor_pending(gpu, r + 1), cursor_pending(cpu, r + 1));
    for (int layer = 0; layer < c.config.num_layers; ++layer) {
      ASSERT_EQ(cursor_folded(gpu, layer, r + 1), cursor_folded(cpu, layer, r + 1))
          << "step " << step << " layer " << layer << " row " << r;
    }
  }
}

// Materialised states (a replay cache folds first) agree as well.
void expect_same_states(const CudaVsCpuSpec& c, StateCache& cpu, StateCache& gpu) {
  const std::size_t se = std::size_t(c.config.dims().state_elems());
  for (int layer = 0; layer < c.config.num_layers; ++layer) {
    for (int r = 0; r < c.batch; ++r) {
      std::vector<float> sc, sg;
      ASSERT_TRUE(export_state(cpu, layer, r + 1, &sc).is_ok());
      const Status st = export_state(gpu, layer, r + 1, &sg);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      EXPECT_LE(max_rel_diff(sg, sc, 0, se), c.state_tol) << "layer " << layer << " row " << r;
    }
  }
}

template <typename Family>
void compare_cuda_vs_cpu_impl(const CudaVsCpuSpec& c, double* worst) {
  const StateCacheConfig& cfg = c.config;
  StateCacheConfig gcfg = cfg;
  gcfg.device = Device::kCuda;
  std::unique_ptr<StateCache> cpu = create_cache(cfg);
  std::unique_ptr<StateCache> gpu = create_cache(gcfg);
  for (int i = 0; i < cfg.capacity; ++i) {
    ASSERT_EQ(allocate_slot(*cpu), allocate_slot(*gpu));
  }
  const int guard_lo = 0, guard_hi = cfg.capacity - 1;
  const int layers = cfg.num_layers, window = cfg.max_spec_tokens;

  Rng rng(c.seed);
  if (c.load_initial) {
    ASSERT_NO_FATAL_FAILURE(load_initial_states(c, *cpu, *gpu, rng));
  }
  const std::vector<std::uint8_t> guard_lo_bytes = slot_bytes(*gpu, guard_lo);
  const std::vector<std::uint8_t> guard_hi_bytes = slot_bytes(*gpu, guard_hi);

  FamilySettings settings;
  settings.cache = cfg;
  settings.gate = c.gate;
  settings.qk_l2norm = c.qk_l2norm;
  settings.recipe.unit_keys = !c.qk_l2norm;  // raw keys must keep β|k|² < 2
  const Family family(settings, rng);  // Mamba-2: every layer's A, D, dt_bias, after the states
  const int rows = c.batch + 1;  // the last row is always a pad
  const std::size_t per_row = std::size_t(window) * family.out_per_token();
  for (int step = 0; step < c.steps; ++step) {
    std::vector<std::int32_t> slots(std::size_t(rows), -1);
    for (int r = 0; r < c.batch; ++r) {
      if (step >= r * c.stagger) slots[r] = r + 1;
    }
    for (int layer = 0; layer < layers; ++layer) {
      const typename Family::Tokens tk = family.tokens(rows, window, rng);
      typename Family::Call cc = family.call(*cpu, layer, slots, tk);
      typename Family::Call gc = family.call(*gpu, layer, slots, tk);
      cc.args.fold_every = gc.args.fold_every = fold_every_at(c.fold_every, step);
      ASSERT_TRUE(Family::decode(*cpu, cc).is_ok());
      const Status st = Family::decode(*gpu, gc);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      const std::vector<float> oc = cc.output(), og = gc.output();
      for (int r = 0; r < rows; ++r) {
        const std::size_t b = r * per_row, e = b + per_row;
        if (slots[r] < 0) {
          ASSERT_TRUE(std::all_of(og.begin() + b, og.begin() + e,
                                  [](float v) { return std::isnan(v); }))
              << "step " << step << ": pad row " << r << "'s output was written";
          continue;
        }
        const double err = max_rel_diff(og, oc, b, e);
        *worst = std::max(*worst, err);
        ASSERT_LE(err, c.output_tol) << "step " << step << " layer " << layer << " row " << r;
      }
    }
    std::vector<std::int32_t> accepted(std::size_t(rows), 0);
    for (int r = 0; r < c.batch; ++r) {
      if (slots[r] >= 0) accepted[r] = window == 1 ? 1 : rng.uniform_int(0, window);
    }
    ASSERT_TRUE(commit(*cpu, slots, accepted).is_ok());
    const Status st = commit(*gpu, slots, accepted);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    ASSERT_NO_FATAL_FAILURE(expect_same_cursors(c, *cpu, *gpu, step));
  }
  EXPECT_EQ(slot_bytes(*gpu, guard_lo), guard_lo_bytes) << "guard slot written";
  EXPECT_EQ(slot_bytes(*gpu, guard_hi), guard_hi_bytes) << "guard slot written";
  expect_same_states(c, *cpu, *gpu);
}

}  // namespace

void compare_cuda_vs_cpu(const CudaVsCpuSpec& spec, double* worst) {
  with_family(spec.config.kind, [&](auto family) {
    compare_cuda_vs_cpu_impl<typename decltype(family)::type>(spec, worst);
  });
}

}  // namespace replayssm::testing
