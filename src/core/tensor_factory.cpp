#include "core/tensor_factory.h"

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "core/shape.h"
#include "kiln/ops.h"

namespace kiln::detail {

Tensor make_empty(std::vector<int64_t> sizes, DType dtype, Device device) {
  std::vector<int64_t> strides = contiguous_strides(sizes);
  return make_empty_strided(std::move(sizes), std::move(strides), dtype, device);
}

Tensor make_empty_strided(std::vector<int64_t> sizes, std::vector<int64_t> strides, DType dtype,
                          Device device) {
  check_sizes_nonnegative(sizes, "empty");
  KILN_CHECK(strides.size() == sizes.size(), ShapeError,
             "[kiln::empty_strided] " + std::to_string(sizes.size()) + " sizes but " + std::to_string(strides.size()) +
                 " strides.");
  checked_numel(sizes, "empty");
  const int64_t span = checked_storage_span(sizes, strides, "empty_strided");  // elements to cover
  int64_t nbytes = 0;
  KILN_CHECK(!__builtin_mul_overflow(span, itemsize(dtype), &nbytes), ValueError,
             "[kiln::empty] the shape " + shape_str(sizes) + " needs more bytes than fit in int64.");
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = allocate_storage(nbytes, device);
  impl->sizes = std::move(sizes);
  impl->strides = std::move(strides);
  impl->dtype = dtype;
  impl->device = device;
  impl->refresh_metadata();
  return Tensor(std::move(impl));
}

Tensor make_view(const Tensor& base, std::vector<int64_t> sizes, std::vector<int64_t> strides,
                 int64_t storage_offset) {
  const TensorImpl& b = base.impl();
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = b.storage;
  impl->lazy = b.lazy;  // a view of a value being captured is captured too (detach, saved outputs)
  impl->storage_offset = storage_offset;
  impl->sizes = std::move(sizes);
  impl->strides = std::move(strides);
  impl->dtype = b.dtype;
  impl->device = b.device;
  impl->refresh_metadata();
  return Tensor(std::move(impl));
}

Tensor wrap_scalar(const Scalar& s, std::optional<DType> dtype, Device device) {
  DType t = dtype.value_or(s.dtype());
  Tensor out = make_empty({}, t, kCPU);
  KILN_DISPATCH_ALL(t, "scalar_tensor", [&] { *static_cast<scalar_t*>(out.impl().data()) = s.checked_to<scalar_t>(); });
  out.impl().is_wrapped_number = true;
  if (!device.is_cpu()) out = out.to(device);
  return out;
}

namespace {
std::optional<DType> promote_opt(std::optional<DType> a, DType b) {
  return a ? promote_types(*a, b) : b;
}
// PyTorch's combine_categories: `higher` comes from operands of higher priority.
std::optional<DType> combine_categories(std::optional<DType> higher, std::optional<DType> lower) {
  if (!higher) return lower;
  if (!lower) return higher;
  if (is_floating_point(*higher)) return higher;
  if (*higher == DType::bool_ || is_floating_point(*lower)) return promote_types(*higher, *lower);
  return higher;
}
}  // namespace

DType result_type(std::span<const Tensor> operands) {
  std::optional<DType> dim_result, zero_result, wrapped_result;
  for (const Tensor& t : operands) {
    if (!t.defined()) continue;
    const TensorImpl& impl = t.impl();
    DType current = impl.dtype;
    if (impl.is_wrapped_number) {
      if (is_floating_point(current)) current = default_dtype();
      wrapped_result = promote_opt(wrapped_result, current);
    } else if (!impl.sizes.empty()) {
      dim_result = promote_opt(dim_result, current);
    } else {
      zero_result = promote_opt(zero_result, current);
    }
  }
  auto r = combine_categories(dim_result, combine_categories(zero_result, wrapped_result));
  return r.value_or(default_dtype());
}

bool may_overlap(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.impl().storage && a.impl().storage == b.impl().storage &&
         a.numel() > 0 && b.numel() > 0;
}

bool has_internal_overlap(const Tensor& t) {
  // Row-major tensors (most in-place targets) cannot overlap: no allocation on that path.
  if (!t.defined() || t.numel() <= 1 || t.impl().is_contiguous) return false;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims with size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.sizes()[d] == 1) continue;
    if (t.strides()[d] == 0) return true;
    dims.emplace_back(t.strides()[d], t.sizes()[d]);
  }
  // Strides that nest (each at least the extent of the smaller ones) cannot overlap.
  std::sort(dims.begin(), dims.end());
  int64_t extent = 0;  // the last offset reached by the dims so far
  bool nested = true;
  for (const auto& [stride, size] : dims) {
    if (stride <= extent) nested = false;
    extent += (size - 1) * stride;
  }
  if (nested) return false;
  constexpr int64_t kMaxChecked = int64_t{1} << 22;
  if (t.numel() > kMaxChecked) return false;
  std::vector<int64_t> offsets = {0};
  for (const auto& [stride, size] : dims) {
    const size_t n = offsets.size();
    for (int64_t i = 1; i < size; ++i)
      for (size_t k = 0; k < n; ++k) offsets.push_back(offsets[k] + i * stride);
  }
  std::sort(offsets.begin(), offsets.end());
  return std::adjacent_find(offsets.begin(), offsets.end()) != offsets.end();
}

}  // namespace kiln::detail
