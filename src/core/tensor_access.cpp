// Host access to tensor data: data_ptr, item, to_vector, operator bool.
#include <cstring>

#include "core/layer_hooks.h"
#include "core/tensor_factory.h"
#include "kiln/ops.h"

namespace kiln {

// Every host access below is a graph break inside compile(): the pending graph runs first, so the
// host sees the values eager mode would have computed by now.
static void host_read(std::string_view what) { detail::host_read_hook(what); }

void* Tensor::raw_data_ptr() const {
  host_read("Tensor::data_ptr()");
  KILN_CHECK(is_cpu(), DeviceError,
             "[kiln::data_ptr] the tensor is on " + device().str() + "; host pointers need a CPU "
             "tensor. Call .cpu() first.");
  return impl().data();
}

template <class T>
T* Tensor::data_ptr() const {
  KILN_CHECK(dtype() == dtype_of_v<T>, DTypeError,
             "[kiln::data_ptr] expected a tensor of dtype " + std::string(dtype_name(dtype_of_v<T>)) +
                 " but it has dtype " + std::string(dtype_name(dtype())) + ". Convert with .to(...).");
  return static_cast<T*>(raw_data_ptr());
}

namespace {
Scalar read_one(const Tensor& t) {
  detail::CaptureSuspended eager;
  Tensor c = t.is_cpu() ? t : t.cpu();
  const void* p = c.impl().data();
  KILN_CHECK(p != nullptr, Error,
             "[kiln::item] this tensor holds metadata only (a graph placeholder), no value: an op's meta "
             "function read a value. This is a Kiln bug; please report it.");
  return KILN_DISPATCH_ALL(t.dtype(), "item", [&]() -> Scalar { return Scalar(*static_cast<const scalar_t*>(p)); });
}
}  // namespace

Scalar Tensor::item() const {
  KILN_CHECK(numel() == 1, ValueError,
             "[kiln::item] a Tensor with " + std::to_string(numel()) +
                 " elements cannot be converted to Scalar. Reduce it first (e.g. .sum()).");
  // A wrapped host scalar holds a value the host already knows: reading it (as derivative formulas
  // and meta functions do) is not a data-dependent read and does not break the graph.
  if (!impl().is_wrapped_number || impl().lazy) host_read("Tensor::item()");
  return read_one(*this);
}

template <class T>
T Tensor::item() const {
  return item().to<T>();
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  host_read("Tensor::to_vector()");
  detail::CaptureSuspended eager;
  Tensor c = to(kCPU).to(dtype_of_v<T>).contiguous();
  std::vector<T> out(static_cast<size_t>(c.numel()));
  if (!out.empty()) std::memcpy(static_cast<void*>(out.data()), c.impl().data(), out.size() * sizeof(T));
  return out;
}

Tensor::operator bool() const {
  KILN_CHECK(numel() == 1, ValueError,
             "[kiln::bool] Boolean value of Tensor with " + std::to_string(numel()) +
                 " elements is ambiguous. Use .any() or .all().");
  host_read("Tensor::operator bool (data-dependent control flow)");
  return read_one(*this).to_bool();
}

Tensor& Tensor::requires_grad_(bool on) {
  KILN_CHECK(!on || is_floating_point(), DTypeError,
             "[kiln::requires_grad_] only tensors of floating point dtype can require gradients, got " +
                 std::string(dtype_name(dtype())) + ".");
  if (on && detail::autograd_hooks.ensure_meta) detail::autograd_hooks.ensure_meta(*this);
  impl().requires_grad = on;
  return *this;
}

#define KILN_INSTANTIATE(T)                               \
  template T* Tensor::data_ptr<T>() const;                \
  template T Tensor::item<T>() const;                     \
  template std::vector<T> Tensor::to_vector<T>() const;
KILN_INSTANTIATE(uint8_t)
KILN_INSTANTIATE(int8_t)
KILN_INSTANTIATE(int32_t)
KILN_INSTANTIATE(int64_t)
KILN_INSTANTIATE(Half)
KILN_INSTANTIATE(BFloat16)
KILN_INSTANTIATE(float)
KILN_INSTANTIATE(double)
#undef KILN_INSTANTIATE
template bool* Tensor::data_ptr<bool>() const;
template bool Tensor::item<bool>() const;
// std::vector<bool> is bit-packed: to_vector<bool> returns uint8 values.
template <>
std::vector<bool> Tensor::to_vector<bool>() const {
  auto v = to(DType::uint8).to_vector<uint8_t>();
  return std::vector<bool>(v.begin(), v.end());
}

}  // namespace kiln
