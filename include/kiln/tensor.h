// kiln::Tensor — a reference-counted handle to a strided n-dimensional array.
//
// Copying a Tensor copies the handle, not the data (like torch.Tensor in Python). Views
// (view, transpose, narrow, slicing, ...) share storage with their base; in-place ops (`add_`,
// `copy_`, ...) write through every view and bump the shared version counter.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "kiln/array_ref.h"
#include "kiln/detail/tensor_impl.h"
#include "kiln/device.h"
#include "kiln/dtype.h"
#include "kiln/error.h"
#include "kiln/scalar.h"

namespace kiln {

class Tensor;
using TensorList = std::vector<Tensor>;

// Factory options: zeros({2}, kFloat64), zeros({2}, kCPU), TensorOptions(dtype, device, requires_grad).
struct TensorOptions {
  std::optional<DType> dtype;  // unset: the default dtype (float32) or the factory's natural one
  Device device = kCPU;
  bool requires_grad = false;

  TensorOptions() = default;
  TensorOptions(DType t) : dtype(t) {}    // NOLINT: implicit on purpose
  TensorOptions(Device d) : device(d) {}  // NOLINT
  TensorOptions(std::optional<DType> t, Device d, bool rg = false)
      : dtype(t), device(d), requires_grad(rg) {}
};

// Slicing: x.index({Slice(0, 2), 1, None, Ellipsis, mask_tensor}).
struct Slice {
  std::optional<int64_t> start, stop;
  int64_t step = 1;
  Slice() = default;
  Slice(std::optional<int64_t> start_, std::optional<int64_t> stop_ = std::nullopt, int64_t step_ = 1)
      : start(start_), stop(stop_), step(step_) {}
};
struct NoneIndex {};
struct EllipsisIndex {};
inline constexpr NoneIndex None{};
inline constexpr EllipsisIndex Ellipsis{};

class TensorIndex;

// How a 4-D (N, C, H, W) tensor's elements lie in memory (PyTorch's torch.memory_format). Sizes
// never change with the format, only strides. See docs/memory_format.md.
enum class MemoryFormat : uint8_t {
  contiguous,     // row-major: W varies fastest (NCHW)
  channels_last,  // C varies fastest (NHWC); strides (H*W*C, 1, W*C, C)
  preserve,       // keep the source's format (conversions, clone-like copies)
};
inline constexpr MemoryFormat contiguous_format = MemoryFormat::contiguous;
inline constexpr MemoryFormat channels_last = MemoryFormat::channels_last;
inline constexpr MemoryFormat preserve_format = MemoryFormat::preserve;
const char* memory_format_name(MemoryFormat f);  // "contiguous_format", "channels_last", ...

// The most dimensions a tensor may have (NumPy 2's limit too). Every tensor Kiln creates is
// checked, so a shape from a file or a view chain can never make a loop or the printer recurse
// without bound: ShapeError "[kiln::Tensor] a tensor has at most 64 dimensions".
inline constexpr int64_t kMaxDims = 64;

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false
  explicit Tensor(std::shared_ptr<detail::TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- metadata ----
  bool defined() const { return impl_ != nullptr; }
  int64_t dim() const { return static_cast<int64_t>(impl().sizes.size()); }
  IntArrayRef sizes() const { return impl().sizes; }
  IntArrayRef strides() const { return impl().strides; }
  int64_t size(int64_t d) const;    // negative d counts from the end
  int64_t stride(int64_t d) const;
  int64_t numel() const { return impl().numel; }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().device; }
  bool is_cpu() const { return device().is_cpu(); }
  bool is_cuda() const { return device().is_cuda(); }
  bool is_contiguous() const { return impl().is_contiguous; }
  // Whether the strides are exactly `format`'s (dims of size 1 may have any stride). Only 4-D
  // tensors can be channels_last.
  bool is_contiguous(MemoryFormat format) const;
  // The format these strides resemble: channels_last for a 4-D tensor whose channels vary
  // fastest (dense or not), contiguous otherwise. Ops that pick an output layout ask this.
  MemoryFormat suggest_memory_format() const;
  bool is_floating_point() const { return kiln::is_floating_point(dtype()); }
  int64_t storage_offset() const { return impl().storage_offset; }
  int64_t element_size() const { return itemsize(dtype()); }
  int64_t nbytes() const { return numel() * element_size(); }
  // Version counter shared by all views of the storage; bumped by every in-place op.
  uint64_t version() const;
  // Whether both tensors view the same storage.
  bool is_alias_of(const Tensor& other) const;

  // ---- host access (a graph break inside compile()) ----
  template <class T> T* data_ptr() const;      // checks T matches dtype()
  void* raw_data_ptr() const;
  template <class T> T item() const;            // one-element tensors only
  Scalar item() const;
  template <class T> std::vector<T> to_vector() const;  // row-major copy, converts dtype
  explicit operator bool() const;               // is_nonzero(): one-element tensors only
  std::string str() const;                      // what operator<< prints

  // ---- views (share storage) ----
  Tensor view(IntArrayRef sizes) const;
  Tensor view_as(const Tensor& other) const { return view(other.sizes()); }
  Tensor reshape(IntArrayRef sizes) const;
  Tensor reshape_as(const Tensor& other) const { return reshape(other.sizes()); }
  Tensor permute(IntArrayRef dims) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const;
  Tensor mT() const { return transpose(-2, -1); }
  Tensor expand(IntArrayRef sizes) const;
  Tensor expand_as(const Tensor& other) const { return expand(other.sizes()); }
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim, std::optional<int64_t> start = {}, std::optional<int64_t> stop = {},
               int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;
  Tensor squeeze() const;
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor unflatten(int64_t dim, IntArrayRef sizes) const;
  Tensor movedim(int64_t source, int64_t destination) const;
  Tensor as_strided(IntArrayRef sizes, IntArrayRef strides,
                    std::optional<int64_t> storage_offset = {}) const;
  Tensor contiguous() const;
  // This tensor if is_contiguous(format), else a copy in that format (preserve: this tensor).
  Tensor contiguous(MemoryFormat format) const;
  Tensor operator[](int64_t i) const { return select(0, i); }
  // NumPy-style indexing: integers, Slice, None, Ellipsis, bool/long tensors.
  Tensor index(std::initializer_list<TensorIndex> indices) const;
  Tensor index(const std::vector<TensorIndex>& indices) const;
  // x.index_put_({...}, value): assignment through an index expression.
  Tensor& index_put_(const std::vector<TensorIndex>& indices, const Tensor& value);
  Tensor& index_put_(const std::vector<TensorIndex>& indices, Scalar value);

  // ---- conversion and copies ----
  Tensor to(DType t, bool copy = false) const;
  Tensor to(Device d, bool copy = false) const;
  Tensor to(Device d, DType t, bool copy = false) const;
  // x.to(kiln::channels_last): the same values in another memory format (a copy unless x
  // already is in it).
  Tensor to(MemoryFormat format) const { return contiguous(format); }
  Tensor cpu() const { return to(kCPU); }
  Tensor cuda(int index = 0) const { return to(cuda_device(index)); }
  Tensor clone() const;  // row-major
  // A copy in `format`; preserve: channels-last if this tensor suggests it, else row-major.
  Tensor clone(MemoryFormat format) const;
  Tensor& copy_(const Tensor& src);  // broadcasts src, converts dtype and device
  Tensor detach() const;             // shares storage, no autograd history

  // ---- autograd (see kiln/autograd.h) ----
  bool requires_grad() const { return impl().requires_grad; }
  Tensor& requires_grad_(bool on = true);  // floating-point tensors only
  Tensor grad() const;                     // undefined until a backward reaches this tensor
  void set_grad(const Tensor& g) const;    // assign or clear (undefined) the gradient
  bool is_leaf() const;                    // no grad_fn: created by the user, not by a recorded op
  std::shared_ptr<autograd::Node> grad_fn() const;
  std::string grad_fn_name() const;        // "MulBackward0", or "" for leaves
  void retain_grad() const;                // keep .grad() of a non-leaf after backward
  bool retains_grad() const;
  // Runs `hook(grad)` when this tensor's gradient is computed; a defined result replaces it.
  void register_hook(std::function<Tensor(const Tensor&)> hook) const;
  // Backpropagates from this tensor (see autograd::backward). `gradient` may be omitted for
  // one-element tensors.
  void backward(const Tensor& gradient = Tensor(), std::optional<bool> retain_graph = std::nullopt,
                bool create_graph = false) const;

  // ---- in-place ----
  Tensor& zero_();
  Tensor& fill_(Scalar value);
  Tensor& fill_(const Tensor& value);  // 0-dim value
  Tensor& add_(const Tensor& other, Scalar alpha = 1);
  Tensor& add_(Scalar other, Scalar alpha = 1);
  Tensor& sub_(const Tensor& other, Scalar alpha = 1);
  Tensor& sub_(Scalar other, Scalar alpha = 1);
  Tensor& mul_(const Tensor& other);
  Tensor& mul_(Scalar other);
  Tensor& div_(const Tensor& other);
  Tensor& div_(Scalar other);
  Tensor& neg_();
  Tensor& exp_();
  Tensor& sqrt_();
  Tensor& relu_();
  Tensor& sigmoid_();
  Tensor& tanh_();
  Tensor& clamp_(std::optional<Scalar> min, std::optional<Scalar> max = {});
  Tensor& pow_(Scalar exponent);
  Tensor& lerp_(const Tensor& end, Scalar weight);
  Tensor& addcmul_(const Tensor& t1, const Tensor& t2, Scalar value = 1);
  Tensor& addcdiv_(const Tensor& t1, const Tensor& t2, Scalar value = 1);
  Tensor& masked_fill_(const Tensor& mask, Scalar value);
  Tensor& scatter_(int64_t dim, const Tensor& index, const Tensor& src);
  Tensor& scatter_(int64_t dim, const Tensor& index, Scalar value);
  Tensor& scatter_add_(int64_t dim, const Tensor& index, const Tensor& src);
  Tensor& uniform_(double from = 0.0, double to = 1.0);
  Tensor& normal_(double mean = 0.0, double std = 1.0);
  Tensor& bernoulli_(double p = 0.5);
  Tensor& maximum_(const Tensor& other);

  // ---- method forms of common ops (see kiln/ops.h for the full list and docs) ----
  Tensor abs() const;
  Tensor neg() const;
  Tensor exp() const;
  Tensor log() const;
  Tensor sqrt() const;
  Tensor rsqrt() const;
  Tensor sin() const;
  Tensor cos() const;
  Tensor tanh() const;
  Tensor sigmoid() const;
  Tensor relu() const;
  Tensor reciprocal() const;
  Tensor sign() const;
  Tensor floor() const;
  Tensor ceil() const;
  Tensor round() const;
  Tensor pow(const Tensor& exponent) const;
  Tensor pow(Scalar exponent) const;
  Tensor clamp(std::optional<Scalar> min, std::optional<Scalar> max = {}) const;
  Tensor masked_fill(const Tensor& mask, Scalar value) const;
  Tensor sum(IntArrayRef dims = {}, bool keepdim = false, std::optional<DType> dtype = {}) const;
  Tensor mean(IntArrayRef dims = {}, bool keepdim = false) const;
  Tensor prod(std::optional<int64_t> dim = {}, bool keepdim = false) const;
  Tensor max() const;
  std::tuple<Tensor, Tensor> max(int64_t dim, bool keepdim = false) const;
  Tensor min() const;
  std::tuple<Tensor, Tensor> min(int64_t dim, bool keepdim = false) const;
  Tensor amax(IntArrayRef dims = {}, bool keepdim = false) const;
  Tensor amin(IntArrayRef dims = {}, bool keepdim = false) const;
  Tensor argmax(std::optional<int64_t> dim = {}, bool keepdim = false) const;
  Tensor argmin(std::optional<int64_t> dim = {}, bool keepdim = false) const;
  Tensor var(IntArrayRef dims = {}, int64_t correction = 1, bool keepdim = false) const;
  Tensor std(IntArrayRef dims = {}, int64_t correction = 1, bool keepdim = false) const;
  Tensor norm(Scalar p = 2, IntArrayRef dims = {}, bool keepdim = false) const;
  Tensor logsumexp(IntArrayRef dims, bool keepdim = false) const;
  Tensor any() const;
  Tensor all() const;
  Tensor cumsum(int64_t dim) const;
  Tensor softmax(int64_t dim) const;
  Tensor log_softmax(int64_t dim) const;
  Tensor matmul(const Tensor& other) const;
  Tensor mm(const Tensor& other) const;
  Tensor bmm(const Tensor& other) const;
  Tensor dot(const Tensor& other) const;
  Tensor index_select(int64_t dim, const Tensor& index) const;
  Tensor gather(int64_t dim, const Tensor& index) const;
  std::vector<Tensor> split(int64_t split_size, int64_t dim = 0) const;
  std::vector<Tensor> chunk(int64_t chunks, int64_t dim = 0) const;
  Tensor eq(const Tensor& other) const;
  Tensor ne(const Tensor& other) const;
  Tensor lt(const Tensor& other) const;
  Tensor le(const Tensor& other) const;
  Tensor gt(const Tensor& other) const;
  Tensor ge(const Tensor& other) const;
  Tensor logical_not() const;
  Tensor isnan() const;
  Tensor isfinite() const;

  // ---- internals ----
  detail::TensorImpl& impl() const {
    KILN_CHECK(impl_ != nullptr, Error,
               "[kiln::Tensor] the tensor is undefined (default-constructed). Assign a value first.");
    return *impl_;
  }
  detail::TensorImpl* unsafe_impl() const { return impl_.get(); }
  const std::shared_ptr<detail::TensorImpl>& impl_ptr() const { return impl_; }
  bool same(const Tensor& other) const { return impl_ == other.impl_; }

 private:
  std::shared_ptr<detail::TensorImpl> impl_;
};

// One entry of an index expression.
class TensorIndex {
 public:
  TensorIndex(int64_t i) : v_(i) {}  // NOLINT: implicit on purpose
  TensorIndex(int i) : v_(static_cast<int64_t>(i)) {}  // NOLINT
  TensorIndex(Slice s) : v_(s) {}  // NOLINT
  TensorIndex(NoneIndex) : v_(NoneIndex{}) {}  // NOLINT
  TensorIndex(EllipsisIndex) : v_(EllipsisIndex{}) {}  // NOLINT
  TensorIndex(Tensor t) : v_(std::move(t)) {}  // NOLINT
  const std::variant<int64_t, Slice, NoneIndex, EllipsisIndex, Tensor>& value() const { return v_; }

 private:
  std::variant<int64_t, Slice, NoneIndex, EllipsisIndex, Tensor> v_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// Arithmetic and comparison operators follow Python's (they return tensors).
Tensor operator-(const Tensor& a);
Tensor operator~(const Tensor& a);
#define KILN_BINARY_OPERATOR(OP)                        \
  Tensor operator OP(const Tensor& a, const Tensor& b); \
  Tensor operator OP(const Tensor& a, Scalar b);        \
  Tensor operator OP(Scalar a, const Tensor& b);
KILN_BINARY_OPERATOR(+)
KILN_BINARY_OPERATOR(-)
KILN_BINARY_OPERATOR(*)
KILN_BINARY_OPERATOR(/)
KILN_BINARY_OPERATOR(%)
KILN_BINARY_OPERATOR(==)
KILN_BINARY_OPERATOR(!=)
KILN_BINARY_OPERATOR(<)
KILN_BINARY_OPERATOR(<=)
KILN_BINARY_OPERATOR(>)
KILN_BINARY_OPERATOR(>=)
KILN_BINARY_OPERATOR(&)
KILN_BINARY_OPERATOR(|)
KILN_BINARY_OPERATOR(^)
#undef KILN_BINARY_OPERATOR
Tensor& operator+=(Tensor& a, const Tensor& b);
Tensor& operator+=(Tensor& a, Scalar b);
Tensor& operator-=(Tensor& a, const Tensor& b);
Tensor& operator-=(Tensor& a, Scalar b);
Tensor& operator*=(Tensor& a, const Tensor& b);
Tensor& operator*=(Tensor& a, Scalar b);
Tensor& operator/=(Tensor& a, const Tensor& b);
Tensor& operator/=(Tensor& a, Scalar b);

}  // namespace kiln
