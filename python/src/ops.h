#pragma once
// The decode ops of the Python module.

#include <nanobind/nanobind.h>

#include "cache.h"

namespace replayssm::python {

void bind_ops(nb::module_& m);

}  // namespace replayssm::python
