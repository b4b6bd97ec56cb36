// Gated DeltaNet on CUDA's generic kernels (gdn_generic.cu): the shapes, windows and buffer
// lengths the tuned kernels are not built for, against the CPU backend on the same inputs over
// several fold cycles, every mode. Tolerances as test_gdn_cuda.cpp's (its header says why).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "replayssm/ops.h"
#include "testing/cuda_test_util.h"
#include "testing/side_case.h"
#include "testing/test_util.h"

namespace replayssm {
namespace {

using SideCase = testing::SideCase<GdnShape>;
using testing::NamedShape;

const GdnShape kK8{2, 4, 8, 8};        // K below the tuned kernels' 16-column vectors
const GdnShape kK24{2, 4, 24, 40};     // K not a multiple of 16, V != K
const GdnShape kK24Odd{1, 3, 24, 12};  // G = 3
const GdnShape kK192{1, 2, 192, 64};   // K past the tuned 128
const GdnShape kK256{2, 2, 256, 256};  // K and V past 128

class GdnGenericCudaVsCpu : public ::testing::TestWithParam<SideCase> {};

TEST_P(GdnGenericCudaVsCpu, SameOutputsStatesAndCursors) {
  SKIP_WITHOUT_GPU();
  const SideCase c = GetParam();
  testing::CudaVsCpuSpec spec = testing::side_spec(c, 29, 0.05);
  // fp8: a flipped code moves one term of a K-term dot product by 2^-3 of itself; with K = 8
  // terms that can reach a larger share of max|o| than at K >= 16.
  spec.output_tol = testing::side_output_tolerance(c, c.shape.head_k_dim < 16 ? 0.25 : 0.125);
  spec.state_tol = std::max(spec.output_tol, 1e-5);
  // A shared bf16 checkpoint is the exported state itself: the CPU folds in chunk form, these
  // kernels token by token, so an element may round to the other bf16 neighbour at each fold
  // (one ulp, 2^-8 of max|S|, measured 3.7e-3 at K = 256) and such flips can add up over the
  // run's folds: two ulps.
  if (c.mode == DecodeMode::kReplay && c.checkpoint == CheckpointPrecision::kBf16) {
    spec.state_tol = std::max(spec.state_tol, std::ldexp(1.0, -7));
  }
  double worst = 0.0;
  ASSERT_NO_FATAL_FAILURE(testing::compare_cuda_vs_cpu(spec, &worst));
  RecordProperty("max_rel_diff", std::to_string(worst));
}

std::vector<SideCase> generic_cases() {
  std::vector<SideCase> out;
  constexpr auto kF32 = DType::kF32, kBF16 = DType::kBF16;
  const NamedShape<GdnShape> k8{"k8", kK8}, k24{"k24", kK24}, k24odd{"k24odd", kK24Odd};
  const NamedShape<GdnShape> k192{"k192", kK192}, k256{"k256", kK256};
  testing::add_eager_cases(k8, {kF32, kBF16}, {kF32, kBF16}, &out);
  testing::add_eager_cases(k256, {kBF16}, {kF32}, &out);
  testing::add_replay_cases(k24, k24odd, {kF32, kBF16}, {kF32}, &out);
  testing::add_replay_cases(k8, k8, {kF32}, {kBF16}, &out);
  testing::add_replay_cases(k192, k192, {kBF16}, {kBF16}, &out);
  testing::add_replay_cases(k256, k256, {kBF16}, {kF32}, &out);
  // A window wider than the tuned walks (T = 12), raw q/k.
  SideCase wide{k24.name, k24.shape, DecodeMode::kReplay};
  wide.window = 12;
  wide.buffer_len = 3;
  wide.steps = 24;
  wide.stagger = 1;
  wide.qk_l2norm = false;
  out.push_back(wide);
  // A buffer length whose staging does not fit the tuned kernel's shared memory (K = V = 128,
  // bf16: ~0.8 KB per staged record), over four fold cycles.
  SideCase long_l{"k128", GdnShape{1, 2, 128, 128}, DecodeMode::kReplay};
  long_l.checkpoint = CheckpointPrecision::kFp32Bf16;
  long_l.input = kBF16;
  long_l.buffer_len = 320;
  long_l.steps = 4 * 320 + 7;
  long_l.batch = 2;
  long_l.layers = 1;
  long_l.stagger = 37;
  out.push_back(long_l);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, GdnGenericCudaVsCpu, ::testing::ValuesIn(generic_cases()),
                         testing::side_name<GdnShape>);

}  // namespace
}  // namespace replayssm
