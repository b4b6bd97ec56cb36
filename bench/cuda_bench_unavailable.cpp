// run_cuda_bench for builds without the CUDA benchmark (no CUDA, or bench/cuda_bench.cu not
// written yet): a clear error instead of a link failure.

#include "bench.h"

namespace replayssm {

Status run_cuda_bench(const BenchOptions& /*options*/, BenchReport* /*report*/) {
#if defined(REPLAYSSM_WITH_CUDA)
  return unsupported("this build has no CUDA benchmark (bench/cuda_bench.cu); use --device cpu");
#else
  return unsupported(
      "this build has no CUDA backend: bench --device cuda is unavailable; "
      "use --device cpu");
#endif
}

}  // namespace replayssm
