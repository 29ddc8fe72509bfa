// Low-level tensor construction used by the dispatcher, meta functions and kernels.
#pragma once

#include <span>
#include <vector>

#include "kiln/tensor.h"

namespace kiln::detail {

// Uninitialized contiguous tensor.
Tensor make_empty(std::vector<int64_t> sizes, DType dtype, Device device);
// Uninitialized tensor with the given strides (storage sized to cover them).
Tensor make_empty_strided(std::vector<int64_t> sizes, std::vector<int64_t> strides, DType dtype,
                          Device device);
// A view of base's storage. Does not check bounds: callers (view meta functions) do.
Tensor make_view(const Tensor& base, std::vector<int64_t> sizes, std::vector<int64_t> strides,
                 int64_t storage_offset);
// A 0-dim CPU tensor holding a host scalar, flagged as a wrapped number for type promotion.
// dtype: the scalar's natural dtype (bool, int64, or the default float dtype) unless given.
Tensor wrap_scalar(const Scalar& s, std::optional<DType> dtype = std::nullopt, Device device = kCPU);

// PyTorch's result_type over op operands (undefined tensors are skipped): dimensioned tensors
// decide within a category; 0-dim tensors and wrapped numbers only raise the category.
DType result_type(std::span<const Tensor> operands);

// Whether the memory ranges of a and b may overlap (same storage).
bool may_overlap(const Tensor& a, const Tensor& b);

// Whether two elements of `t` are one memory location (an expanded tensor, an as_strided view
// with overlapping strides). Exact: a stride of 0 over a size > 1, or layouts whose strides do not
// nest, checked element by element up to 2^22 elements; larger undecided layouts count as
// non-overlapping, as in PyTorch.
bool has_internal_overlap(const Tensor& t);

}  // namespace kiln::detail
