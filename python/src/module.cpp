// replayssm._C: the compiled half of the Python package. The user-facing API (CacheConfig,
// StateCache, the decode functions, replayssm.torch) is Python, in python/replayssm/.

#include <nanobind/nanobind.h>

#include "cache.h"
#include "ops.h"
#include "replayssm/ops.h"

NB_MODULE(_C, m) {
  namespace py = replayssm::python;
  m.doc() = "replayssm's compiled module (use the replayssm package, not this module)";
  py::bind_cache(m);
  py::bind_ops(m);
  m.def("cuda_available", &replayssm::cuda_available,
        "Whether this build has the CUDA backend and a usable GPU is present.");
  m.def("_set_dlpack_exchange", [](bool on) { py::g_use_exchange_api = on; },
        "Read arrays through the DLPack C exchange API where their type has one (default), or "
        "always through __dlpack__ (for measurements).");
#ifdef REPLAYSSM_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
}
