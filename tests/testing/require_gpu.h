#pragma once
// The first line of every test that needs a CUDA GPU: without one the test skips with the
// message "no CUDA GPU", which CTest's skip pattern for tests labelled `cuda` matches
// (tests/CMakeLists.txt). Header-only and without CUDA headers, for mixed CPU/CUDA binaries.

#include <gtest/gtest.h>

#include "replayssm/ops.h"

#define SKIP_WITHOUT_GPU() \
  if (!::replayssm::cuda_available()) GTEST_SKIP() << "no CUDA GPU"
