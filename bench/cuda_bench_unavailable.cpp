// run_cuda_bench and run_cuda_spec_bench for builds without the CUDA benchmark (no CUDA, or
// bench/cuda_bench.cu not written yet): a clear error instead of a link failure.

#include "bench.h"

namespace replayssm {

namespace {

Status no_cuda_bench() {
#if defined(REPLAYSSM_WITH_CUDA)
  return unsupported("this build has no CUDA benchmark (bench/cuda_bench.cu); use --device cpu");
#else
  return unsupported(
      "this build has no CUDA backend: bench --device cuda is unavailable; "
      "use --device cpu");
#endif
}

}  // namespace

Status run_cuda_bench(const BenchOptions& /*options*/, BenchReport* /*report*/) {
  return no_cuda_bench();
}

Status run_cuda_spec_bench(const BenchOptions& /*options*/, int /*window*/, int /*accepted*/,
                           BenchReport* /*report*/) {
  return no_cuda_bench();
}

}  // namespace replayssm
