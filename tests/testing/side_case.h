#pragma once
// The CUDA-vs-CPU cases of the CUDA decode tests (test_mamba2_cuda.cpp, test_gdn_cuda.cpp): one
// case type for both layer kinds (Shape is Mamba2Shape or GdnShape), its test name and printout,
// the cache it configures, the output tolerance both families share, and the real-shape cases.

#include <gtest/gtest.h>

#include <algorithm>
#include <initializer_list>
#include <ostream>
#include <string>
#include <type_traits>
#include <vector>

#include "replayssm/state_cache.h"
#include "replayssm/types.h"
#include "testing/cuda_vs_cpu.h"
#include "testing/names.h"

namespace replayssm::testing {

inline constexpr CheckpointPrecision kAllPrecisions[] = {
    CheckpointPrecision::kFp32, CheckpointPrecision::kBf16, CheckpointPrecision::kFp32Bf16,
    CheckpointPrecision::kFp32Fp8};

/// A layer shape and the short name test names give it ("small", "super120b").
template <typename Shape>
struct NamedShape {
  const char* name;
  Shape shape;
};

template <typename Shape>
struct SideCase {
  const char* name;  // the shape's
  Shape shape;
  DecodeMode mode;
  DType state = DType::kF32;                                    // eager
  CheckpointPrecision checkpoint = CheckpointPrecision::kFp32;  // replay
  DType input = DType::kF32;
  int buffer_len = 4;
  int window = 1;  // T
  int batch = 3;
  int layers = 2;
  int steps = 24;
  int stagger = 0;           // row r joins at step r·stagger
  bool qk_l2norm = true;     // GDN: normalised q and k
  bool load_initial = true;  // start from a loaded random state (the prefill hand-off)
};

inline std::string shape_tag(const Mamba2Shape& s) {
  return int_tag("H", s.nheads) + int_tag("P", s.head_dim) + int_tag("N", s.dstate) +
         int_tag("G", s.ngroups);
}
inline std::string shape_tag(const GdnShape& s) {
  return int_tag("Hk", s.num_k_heads) + int_tag("Hv", s.num_v_heads) + int_tag("K", s.head_k_dim) +
         int_tag("V", s.head_v_dim);
}

/// The test name: shape, input dtype, raw q/k (GDN), then the eager state dtype (and T when
/// > 1), or the replay checkpoint precision, L, T and stagger
/// ("small_inBF16_ReplayFp32Bf16_L4_T1_stagger1"). Batch, layers and steps follow from the shape
/// and mode (PrintTo shows them).
template <typename Shape>
std::string side_case_name(const SideCase<Shape>& c) {
  std::string n = std::string(c.name) + "_in" + dtype_tag(c.input) + (c.qk_l2norm ? "" : "_rawqk");
  if (c.mode == DecodeMode::kEager) {
    return n + "_Eager" + dtype_tag(c.state) + (c.window > 1 ? int_tag("_T", c.window) : "");
  }
  return n + "_Replay" + precision_tag(c.checkpoint) + int_tag("_L", c.buffer_len) +
         int_tag("_T", c.window) + int_tag("_stagger", c.stagger);
}
template <typename Shape>
std::string side_name(const ::testing::TestParamInfo<SideCase<Shape>>& info) {
  return side_case_name(info.param);
}
template <typename Shape>
void PrintTo(const SideCase<Shape>& c, std::ostream* os) {
  *os << side_case_name(c) << " (" << shape_tag(c.shape) << ", batch " << c.batch << ", layers "
      << c.layers << ", steps " << c.steps << (c.load_initial ? ", loaded state)" : ")");
}

/// The cache of a case: slot 0 and the last slot are guards no row uses.
template <typename Shape>
StateCacheConfig side_config(const SideCase<Shape>& c) {
  StateCacheConfig cfg;
  if constexpr (std::is_same_v<Shape, GdnShape>) {
    cfg.kind = LayerKind::kGdn;
    cfg.gdn = c.shape;
  } else {
    cfg.kind = LayerKind::kMamba2;
    cfg.mamba2 = c.shape;
  }
  cfg.num_layers = c.layers;
  cfg.capacity = c.batch + 2;
  cfg.mode = c.mode;
  cfg.input_dtype = c.input;
  cfg.state_dtype = c.state;
  cfg.buffer_len = c.buffer_len;
  cfg.max_spec_tokens = c.window;
  cfg.checkpoint = c.checkpoint;
  return cfg;
}

/// The CUDA-vs-CPU run of a case (cache, rows, steps, staggering, initial state drawn with
/// `seed` and N(0, initial_sd)); the tolerances are the caller's, per family.
template <typename Shape>
CudaVsCpuSpec side_spec(const SideCase<Shape>& c, std::uint64_t seed, double initial_sd) {
  CudaVsCpuSpec spec;
  spec.config = side_config(c);
  spec.batch = c.batch;
  spec.steps = c.steps;
  spec.stagger = c.stagger;
  spec.seed = seed;
  spec.load_initial = c.load_initial;
  spec.initial_sd = initial_sd;
  spec.qk_l2norm = c.qk_l2norm;
  return spec;
}

/// max|out_cuda − out_cpu| / max|out_cpu| allowed per call (the tests' headers say why):
/// 8e-3 for bf16 outputs, else 1e-4; at least 2e-3 with a bf16 state or read copy; `fp8` for
/// an fp8 read copy.
template <typename Shape>
double side_output_tolerance(const SideCase<Shape>& c, double fp8) {
  double tol = c.input == DType::kBF16 ? 8e-3 : 1e-4;
  const bool low_state =
      (c.mode == DecodeMode::kEager && c.state != DType::kF32) ||
      (c.mode == DecodeMode::kReplay && (c.checkpoint == CheckpointPrecision::kBf16 ||
                                         c.checkpoint == CheckpointPrecision::kFp32Bf16));
  if (low_state) tol = std::max(tol, 2e-3);
  if (c.mode == DecodeMode::kReplay && c.checkpoint == CheckpointPrecision::kFp32Fp8) tol = fp8;
  return tol;
}

/// Eager on `shape`, 12 steps, for every input × state dtype.
template <typename Shape>
void add_eager_cases(const NamedShape<Shape>& shape, std::initializer_list<DType> inputs,
                     std::initializer_list<DType> states, std::vector<SideCase<Shape>>* out) {
  for (DType input : inputs) {
    for (DType state : states) {
      SideCase<Shape> c{shape.name, shape.shape, DecodeMode::kEager};
      c.state = state;
      c.input = input;
      c.steps = 12;
      out->push_back(c);
    }
  }
}

/// Replay in every checkpoint precision, rows staggered so that folds fall on different steps
/// for different rows of one launch (mixed fill levels): plain decoding on `plain_shape` for
/// each of `plain_inputs`, and T = 4 verifies with L = 5 on `spec_shape` for each of
/// `spec_inputs`.
template <typename Shape>
void add_replay_cases(const NamedShape<Shape>& plain_shape, const NamedShape<Shape>& spec_shape,
                      std::initializer_list<DType> plain_inputs,
                      std::initializer_list<DType> spec_inputs,
                      std::vector<SideCase<Shape>>* out) {
  for (CheckpointPrecision p : kAllPrecisions) {
    for (DType input : plain_inputs) {
      SideCase<Shape> plain{plain_shape.name, plain_shape.shape, DecodeMode::kReplay};
      plain.checkpoint = p;
      plain.input = input;
      plain.stagger = 1;
      out->push_back(plain);
    }
    for (DType input : spec_inputs) {
      SideCase<Shape> spec{spec_shape.name, spec_shape.shape, DecodeMode::kReplay};
      spec.checkpoint = p;
      spec.input = input;
      spec.buffer_len = 5;
      spec.window = 4;
      spec.steps = 30;
      spec.stagger = 2;
      out->push_back(spec);
    }
  }
}

/// A replay case at a real layer shape as a serving engine runs it: bf16 activations, L = 16,
/// one layer, `batch` rows joining `stagger` steps apart, `steps` steps.
template <typename Shape>
SideCase<Shape> real_shape_replay(const NamedShape<Shape>& s, CheckpointPrecision p, int window,
                                  int batch, int stagger, int steps) {
  SideCase<Shape> c{s.name, s.shape, DecodeMode::kReplay};
  c.checkpoint = p;
  c.input = DType::kBF16;
  c.buffer_len = 16;
  c.window = window;
  c.layers = 1;
  c.batch = batch;
  c.steps = steps;
  c.stagger = stagger;
  return c;
}

/// The real layer shapes: L = 16, 4L steps, one layer, two rows folding on different steps;
/// eager in each of `eager_states`, replay in every precision, and a T = 4 verify in
/// fp32+bf16.
template <typename Shape>
void add_real_shape_cases(std::initializer_list<NamedShape<Shape>> shapes,
                          std::initializer_list<DType> eager_states,
                          std::vector<SideCase<Shape>>* out) {
  for (const NamedShape<Shape>& s : shapes) {
    for (DType state : eager_states) {
      SideCase<Shape> eager{s.name, s.shape, DecodeMode::kEager};
      eager.state = state;
      eager.input = DType::kBF16;
      eager.layers = 1;
      eager.batch = 2;
      eager.steps = 6;
      out->push_back(eager);
    }
    const auto replay = [&](CheckpointPrecision p, int window, int stagger) {
      out->push_back(real_shape_replay(s, p, window, 2, stagger, 64));
    };
    for (CheckpointPrecision p : kAllPrecisions) replay(p, 1, 5);
    // A verify window at every real shape: its staging (ring records of L − 1 + T tokens of
    // every head of a key head) is the largest a shape asks for.
    replay(CheckpointPrecision::kFp32Bf16, 4, 3);
  }
}

}  // namespace replayssm::testing
