// Basic factories: empty, zeros, ones, the _like forms, scalar_tensor, tensor(data), from_blob.
// (full and the fill primitive live in views.cpp; arange/linspace/eye and random ones in
// range_factories.cpp and random.cpp.)
#include <cstring>

#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln {

namespace {

const OpDef& kEmpty = register_op({
    .name = "empty",
    .schema = "empty(int[] size, *, ScalarType dtype, Device device) -> Tensor",
    .kind = OpKind::factory,
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      detail::check_sizes_nonnegative(c.ints_attr(0), "empty");
      detail::checked_numel(c.ints_attr(0), "empty");
      return {TensorMeta{c.ints_attr(0).vec(), {}, c.dtype_attr(1), c.device_attr(2)}};
    },
    .lowering = lowering::Buffer{},
});

// Allocation is all an empty tensor needs; the kernel has nothing to do on any device.
[[maybe_unused]] const bool registered = [] {
  for (DeviceType d : {DeviceType::cpu, DeviceType::cuda})
    register_kernel("empty", d, [](const OpCall&, std::span<Tensor>) {});
  return true;
}();

// The _like factories take dtype and device from `t` unless the options give them. The device
// field has no "unset" state, so its default (the CPU) means "like t", as for rand_like.
TensorOptions merge(const Tensor& t, TensorOptions o) {
  if (!o.dtype) o.dtype = t.dtype();
  if (o.device == kCPU) o.device = t.device();
  return o;
}

Tensor finish(Tensor t, const TensorOptions& o) {
  if (o.requires_grad) t.requires_grad_(true);
  return t;
}

}  // namespace

Tensor empty(IntArrayRef sizes, TensorOptions o) {
  return finish(call_op1(kEmpty, {}, {sizes.vec(), o.dtype.value_or(default_dtype()), o.device}), o);
}
Tensor zeros(IntArrayRef sizes, TensorOptions o) {
  return finish(full(sizes, 0, TensorOptions(o.dtype.value_or(default_dtype()), o.device)), o);
}
Tensor ones(IntArrayRef sizes, TensorOptions o) {
  return finish(full(sizes, 1, TensorOptions(o.dtype.value_or(default_dtype()), o.device)), o);
}
Tensor empty_like(const Tensor& t, TensorOptions o) { return empty(t.sizes(), merge(t, o)); }
Tensor zeros_like(const Tensor& t, TensorOptions o) { return zeros(t.sizes(), merge(t, o)); }
Tensor ones_like(const Tensor& t, TensorOptions o) { return ones(t.sizes(), merge(t, o)); }
Tensor full_like(const Tensor& t, Scalar value, TensorOptions o) {
  o = merge(t, o);
  return finish(full(t.sizes(), value, TensorOptions(o.dtype, o.device)), o);
}
Tensor scalar_tensor(Scalar value, TensorOptions o) {
  return finish(full({}, value, TensorOptions(o.dtype.value_or(value.dtype()), o.device)), o);
}

template <class T>
Tensor tensor(const std::vector<T>& data, IntArrayRef sizes, TensorOptions o) {
  detail::check_sizes_nonnegative(sizes, "tensor");
  int64_t n = detail::checked_numel(sizes, "tensor");
  KILN_CHECK(n == static_cast<int64_t>(data.size()), ShapeError,
             "[kiln::tensor] " + std::to_string(data.size()) + " values cannot fill shape " +
                 shape_str(sizes) + " (" + std::to_string(n) + " elements).");
  Tensor t = detail::make_empty(sizes.vec(), dtype_of_v<T>, kCPU);
  if constexpr (std::is_same_v<T, bool>) {
    bool* p = static_cast<bool*>(t.impl().data());
    for (size_t i = 0; i < data.size(); ++i) p[i] = data[i];
  } else if (n > 0) {
    std::memcpy(t.impl().data(), data.data(), data.size() * sizeof(T));
  }
  DType target = o.dtype.value_or(std::is_same_v<T, double> || std::is_same_v<T, float>
                                      ? (std::is_same_v<T, double> ? DType::float64 : DType::float32)
                                      : dtype_of_v<T>);
  return finish(t.to(o.device, target), o);
}

template Tensor tensor<bool>(const std::vector<bool>&, IntArrayRef, TensorOptions);
template Tensor tensor<uint8_t>(const std::vector<uint8_t>&, IntArrayRef, TensorOptions);
template Tensor tensor<int8_t>(const std::vector<int8_t>&, IntArrayRef, TensorOptions);
template Tensor tensor<int32_t>(const std::vector<int32_t>&, IntArrayRef, TensorOptions);
template Tensor tensor<int64_t>(const std::vector<int64_t>&, IntArrayRef, TensorOptions);
template Tensor tensor<Half>(const std::vector<Half>&, IntArrayRef, TensorOptions);
template Tensor tensor<BFloat16>(const std::vector<BFloat16>&, IntArrayRef, TensorOptions);
template Tensor tensor<float>(const std::vector<float>&, IntArrayRef, TensorOptions);
template Tensor tensor<double>(const std::vector<double>&, IntArrayRef, TensorOptions);

Tensor from_blob(void* data, IntArrayRef sizes, IntArrayRef strides, DType dtype, Device device,
                 void (*deleter)(void*, void*), void* ctx) {
  KILN_CHECK(data != nullptr || detail::checked_numel(sizes, "from_blob") == 0, ValueError,
             "[kiln::from_blob] data is null.");
  KILN_CHECK(strides.empty() || strides.size() == sizes.size(), ShapeError,
             "[kiln::from_blob] got " + std::to_string(sizes.size()) + " sizes but " +
                 std::to_string(strides.size()) + " strides.");
  detail::check_sizes_nonnegative(sizes, "from_blob");
  auto impl = std::make_shared<detail::TensorImpl>();
  impl->sizes = sizes.vec();
  impl->strides = strides.empty() ? detail::contiguous_strides(impl->sizes) : strides.vec();
  int64_t span = 0;
  if (detail::checked_numel(sizes, "from_blob") > 0) {
    span = 1;
    for (size_t i = 0; i < sizes.size(); ++i) {
      KILN_CHECK(impl->strides[i] >= 0, ValueError, "[kiln::from_blob] strides must be non-negative.");
      span += (sizes[i] - 1) * impl->strides[i];
    }
  }
  auto storage = std::make_shared<detail::Storage>();
  storage->data = data;
  storage->nbytes = span * itemsize(dtype);
  storage->device = device;
  storage->free_fn = deleter;
  storage->free_context = ctx;
  impl->storage = std::move(storage);
  impl->dtype = dtype;
  impl->device = device;
  impl->refresh_metadata();
  return Tensor(std::move(impl));
}

}  // namespace kiln
