// Shared by the CUDA suites (tests/test_cuda*.cpp).
#pragma once

#include <gtest/gtest.h>

#include "kiln/device.h"

// GPU tests skip on machines without a visible GPU (CI); the CudaJit.* tests, which only need
// NVRTC, run everywhere the toolkit is.
#define SKIP_WITHOUT_GPU() \
  if (!::kiln::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU visible"
