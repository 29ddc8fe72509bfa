// The random ops whose kernels both devices register under the same function names
// (kernels/cpu/random_kernels.cpp, kernels/cuda/random_kernels.cpp): X(op name, kernel function).
// Both draw from the same Philox streams (kiln/math/philox.h), so a seed gives the same values on
// either device.
#pragma once

#define KILN_RANDOM_KERNELS(X)                                                         \
  X("uniform", uniform_kernel) X("normal", normal_kernel) X("randint", randint_kernel) \
  X("bernoulli", bernoulli_kernel) X("bernoulli.p", bernoulli_scalar_kernel)           \
  X("native_dropout", native_dropout_kernel)
