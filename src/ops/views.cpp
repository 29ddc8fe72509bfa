// View ops (share storage with their input) and the copy/fill primitives.
//
// Table ops: view, permute, expand, slice, select, squeeze, unsqueeze, as_strided (views);
// copy, fill (compute). Everything else here (reshape, transpose, narrow, flatten, contiguous,
// clone, to, ...) is composed from them.
#include <algorithm>
#include <numeric>

#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln {

using detail::wrap_dim;

namespace {

const OpDef& slice_backward_op();
const OpDef& select_backward_op();

TensorMeta view_meta(const Tensor& x, std::vector<int64_t> sizes, std::vector<int64_t> strides,
                     int64_t offset) {
  return TensorMeta{std::move(sizes), std::move(strides), x.dtype(), x.device(), offset};
}

const OpDef& kView = register_op({
    .name = "view",
    .schema = "view(Tensor(a) self, int[] size) -> Tensor(a)",
    .kind = OpKind::view,
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      auto sizes = detail::infer_size(c.ints_attr(0), x.numel(), "view");
      auto strides = detail::compute_view_strides(x.sizes(), x.strides(), sizes);
      KILN_CHECK(strides.has_value(), ShapeError,
                 "[kiln::view] view size " + shape_str(sizes) +
                     " is not compatible with the input's size and stride (at least one dimension "
                     "spans across two contiguous subspaces). Use .reshape(...) instead.");
      return {view_meta(x, std::move(sizes), std::move(*strides), x.storage_offset())};
    },
    .derivative = {.formula = "self: grad.reshape(self.sizes())",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     return {c.grad().reshape(c.input_info[0].sizes)};
                   }},
    .lowering = lowering::View{},
});

const OpDef& kPermute = register_op({
    .name = "permute",
    .schema = "permute(Tensor(a) self, int[] dims) -> Tensor(a)",
    .kind = OpKind::view,
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      IntArrayRef dims = c.ints_attr(0);
      KILN_CHECK(static_cast<int64_t>(dims.size()) == x.dim(), ShapeError,
                 "[kiln::permute] number of dims don't match: the input has " + std::to_string(x.dim()) +
                     " dims but " + std::to_string(dims.size()) + " were given.");
      auto mask = detail::dim_mask(dims, x.dim(), "permute");
      std::vector<int64_t> sizes, strides;
      for (int64_t d : dims) {
        int64_t w = wrap_dim(d, x.dim(), "permute");
        sizes.push_back(x.sizes()[w]);
        strides.push_back(x.strides()[w]);
      }
      return {view_meta(x, std::move(sizes), std::move(strides), x.storage_offset())};
    },
    .derivative = {.formula = "self: grad.permute(inverse(dims))",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     IntArrayRef dims = c.ints_attr(0);
                     int64_t n = static_cast<int64_t>(dims.size());
                     std::vector<int64_t> inverse(n);
                     for (int64_t i = 0; i < n; ++i) inverse[wrap_dim(dims[i], n, "permute")] = i;
                     return {c.grad().permute(inverse)};
                   }},
    .lowering = lowering::View{},
});

const OpDef& kExpand = register_op({
    .name = "expand",
    .schema = "expand(Tensor(a) self, int[] size) -> Tensor(a)",
    .kind = OpKind::view,
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      IntArrayRef target = c.ints_attr(0);
      KILN_CHECK(static_cast<int64_t>(target.size()) >= x.dim(), ShapeError,
                 "[kiln::expand] the number of sizes provided (" + std::to_string(target.size()) +
                     ") must be greater or equal to the number of dimensions in the tensor (" +
                     std::to_string(x.dim()) + ").");
      size_t lead = target.size() - x.dim();
      std::vector<int64_t> sizes(target.size()), strides(target.size());
      for (size_t i = 0; i < target.size(); ++i) {
        if (i < lead) {
          KILN_CHECK(target[i] >= 0, ShapeError,
                     "[kiln::expand] the expanded size of the tensor (" + std::to_string(target[i]) +
                         ") isn't allowed in a leading, non-existing dimension " + std::to_string(i) + ".");
          sizes[i] = target[i];
          strides[i] = 0;
          continue;
        }
        int64_t have = x.sizes()[i - lead];
        int64_t want = target[i] == -1 ? have : target[i];
        if (have == want) {
          sizes[i] = have;
          strides[i] = x.strides()[i - lead];
        } else {
          KILN_CHECK(have == 1, ShapeError,
                     "[kiln::expand] the expanded size of the tensor (" + std::to_string(want) +
                         ") must match the existing size (" + std::to_string(have) +
                         ") at non-singleton dimension " + std::to_string(i) + ". Target sizes: " +
                         shape_str(target) + ". Tensor sizes: " + shape_str(x.sizes()) + ".");
          sizes[i] = want;
          strides[i] = 0;
        }
      }
      return {view_meta(x, std::move(sizes), std::move(strides), x.storage_offset())};
    },
    .derivative = {.formula = "self: grad.sum_to(self.sizes())",
                   .fn = [](const BackwardContext& c) -> TensorList { return {c.grad()}; }},
    .lowering = lowering::View{},
});

// slice(self, dim, start, stop, step): Python slice semantics (clamped, negative from the end).
const OpDef& kSlice = register_op({
    .name = "slice",
    .schema = "slice(Tensor(a) self, int dim, int? start, int? stop, int step=1) -> Tensor(a)",
    .kind = OpKind::view,
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      KILN_CHECK(x.dim() > 0, IndexError, "[kiln::slice] cannot slice a 0-dim tensor.");
      int64_t dim = wrap_dim(c.int_attr(0), x.dim(), "slice");
      int64_t step = c.int_attr(3);
      KILN_CHECK(step > 0, ValueError, "[kiln::slice] slice step must be positive, got " +
                                           std::to_string(step) + ". Use flip for reversed order.");
      int64_t n = x.sizes()[dim];
      auto clampi = [n](int64_t v) {
        if (v < 0) v += n;
        return std::clamp<int64_t>(v, 0, n);
      };
      int64_t start = c.has_attr(1) ? clampi(c.int_attr(1)) : 0;
      int64_t stop = c.has_attr(2) ? clampi(c.int_attr(2)) : n;
      int64_t len = stop > start ? (stop - start + step - 1) / step : 0;
      auto sizes = x.sizes().vec();
      auto strides = x.strides().vec();
      sizes[dim] = len;
      int64_t offset = x.storage_offset() + (len > 0 ? start * strides[dim] : 0);
      strides[dim] *= step;
      return {view_meta(x, std::move(sizes), std::move(strides), offset)};
    },
    .derivative = {.formula = "self: slice_backward(grad, self.sizes(), dim, start, stop, step)",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     return {call_op1(slice_backward_op(), {c.grad()},
                                      {c.input_info[0].sizes, c.attrs[0], c.attrs[1], c.attrs[2], c.attrs[3]})};
                   }},
    .lowering = lowering::View{},
});

const OpDef& kSelect = register_op({
    .name = "select",
    .schema = "select(Tensor(a) self, int dim, int index) -> Tensor(a)",
    .kind = OpKind::view,
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      KILN_CHECK(x.dim() > 0, IndexError, "[kiln::select] select() cannot be applied to a 0-dim tensor.");
      int64_t dim = wrap_dim(c.int_attr(0), x.dim(), "select");
      int64_t n = x.sizes()[dim];
      int64_t index = c.int_attr(1);
      KILN_CHECK(index >= -n && index < n, IndexError,
                 "[kiln::select] index " + std::to_string(index) + " is out of bounds for dimension " +
                     std::to_string(dim) + " with size " + std::to_string(n) + ".");
      if (index < 0) index += n;
      auto sizes = x.sizes().vec();
      auto strides = x.strides().vec();
      int64_t offset = x.storage_offset() + index * strides[dim];
      sizes.erase(sizes.begin() + dim);
      strides.erase(strides.begin() + dim);
      return {view_meta(x, std::move(sizes), std::move(strides), offset)};
    },
    .derivative = {.formula = "self: select_backward(grad, self.sizes(), dim, index)",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     return {call_op1(select_backward_op(), {c.grad()},
                                      {c.input_info[0].sizes, c.attrs[0], c.attrs[1]})};
                   }},
    .lowering = lowering::View{},
});

// squeeze(self, dims): removes the listed dims of size 1 (all size-1 dims when dims is empty).
const OpDef& kSqueeze = register_op({
    .name = "squeeze",
    .schema = "squeeze(Tensor(a) self, int[] dims) -> Tensor(a)",
    .kind = OpKind::view,
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      auto mask = detail::dim_mask(c.ints_attr(0), x.dim(), "squeeze");
      std::vector<int64_t> sizes, strides;
      for (int64_t d = 0; d < x.dim(); ++d) {
        if (mask[d] && x.sizes()[d] == 1) continue;
        sizes.push_back(x.sizes()[d]);
        strides.push_back(x.strides()[d]);
      }
      return {view_meta(x, std::move(sizes), std::move(strides), x.storage_offset())};
    },
    .derivative = {.formula = "self: grad.reshape(self.sizes())",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     return {c.grad().reshape(c.input_info[0].sizes)};
                   }},
    .lowering = lowering::View{},
});

const OpDef& kUnsqueeze = register_op({
    .name = "unsqueeze",
    .schema = "unsqueeze(Tensor(a) self, int dim) -> Tensor(a)",
    .kind = OpKind::view,
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      int64_t dim = wrap_dim(c.int_attr(0), x.dim() + 1, "unsqueeze");
      auto sizes = x.sizes().vec();
      auto strides = x.strides().vec();
      int64_t st = dim < x.dim() ? sizes[dim] * strides[dim] : 1;
      sizes.insert(sizes.begin() + dim, 1);
      strides.insert(strides.begin() + dim, st);
      return {view_meta(x, std::move(sizes), std::move(strides), x.storage_offset())};
    },
    .derivative = {.formula = "self: grad.reshape(self.sizes())",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     return {c.grad().reshape(c.input_info[0].sizes)};
                   }},
    .lowering = lowering::View{},
});

const OpDef& kAsStrided = register_op({
    .name = "as_strided",
    .schema = "as_strided(Tensor(a) self, int[] size, int[] stride, int storage_offset) -> Tensor(a)",
    .kind = OpKind::view,
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      IntArrayRef sizes = c.ints_attr(0), strides = c.ints_attr(1);
      int64_t offset = c.int_attr(2);
      KILN_CHECK(sizes.size() == strides.size(), ShapeError,
                 "[kiln::as_strided] got " + std::to_string(sizes.size()) + " sizes but " +
                     std::to_string(strides.size()) + " strides; give one stride per size.");
      detail::check_sizes_nonnegative(sizes, "as_strided");
      KILN_CHECK(offset >= 0, ValueError, "[kiln::as_strided] storage_offset must be non-negative.");
      // Overflow-checked: a layout whose last element lies past int64 must not wrap around to
      // an address inside the storage.
      const int64_t span = detail::checked_storage_span(sizes, strides, "as_strided");
      const int64_t capacity = x.impl().storage->nbytes / x.element_size();
      int64_t end = 0;  // one past the last element touched
      KILN_CHECK(span == 0 || (!__builtin_add_overflow(offset, span, &end) && end <= capacity), IndexError,
                 "[kiln::as_strided] sizes " + shape_str(sizes) + ", strides " + shape_str(strides) +
                     " and offset " + std::to_string(offset) + " reach beyond the storage of " +
                     std::to_string(capacity) + " elements.");
      return {view_meta(x, sizes.vec(), strides.vec(), offset)};
    },
    .lowering = lowering::View{},
});

// copy(src, dtype, device, channels_last): a new tensor with src's values converted, row-major
// or (4-D only) channels-last; also the out= target of copy_.
const OpDef& kCopy = register_op({
    .name = "copy",
    .schema = "copy(Tensor src, *, ScalarType dtype, Device device, bool channels_last=False) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& src = c.input(0);
      const bool channels_last = c.has_attr(2) && c.bool_attr(2);
      KILN_CHECK(!channels_last || src.dim() == 4, ShapeError,
                 "[kiln::contiguous] channels_last needs a 4-D (N, C, H, W) tensor, got " +
                     std::to_string(src.dim()) + " dims. Use a 4-D tensor or contiguous_format.");
      return {TensorMeta{src.sizes().vec(), detail::format_strides(src.sizes(), channels_last), c.dtype_attr(0),
                         c.device_attr(1)}};
    },
    .pointwise = true,
    .derivative = {.formula = "src: grad.to(src.dtype(), src.device())",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     return {c.grad().to(c.input_info[0].device, c.input_info[0].dtype)};
                   }},
    .lowering = lowering::Pointwise{[](ScalarExprBuilder& b) { return b.input(0, b.output_dtype()); }},
});

// fill(value, size, dtype, device): a tensor of `size` filled with the 0-dim `value`.
const OpDef& kFill = register_op({
    .name = "fill",
    .schema = "fill(Tensor value, int[] size, *, ScalarType dtype, Device device) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      KILN_CHECK(c.input(0).dim() == 0, ShapeError,
                 "[kiln::fill_] fill_ only supports 0-dimension value tensors but got tensor with " +
                     std::to_string(c.input(0).dim()) + " dimensions.");
      detail::check_sizes_nonnegative(c.ints_attr(0), "fill");
      return {TensorMeta{c.ints_attr(0).vec(), {}, c.dtype_attr(1), c.device_attr(2)}};
    },
    .pointwise = true,
    .overlapping_output_ok = true,
    .derivative = {.formula = "value: grad.sum()",
                   .fn = [](const BackwardContext& c) -> TensorList { return {c.grad().sum()}; }},
    .lowering = lowering::Extern{},
});

// The derivatives of slice and select: a zero tensor of the input's shape with the gradient
// written into the sliced region. Table ops (not in-place code) so that they are themselves
// differentiable and capturable.
const OpDef& kSliceBackward = register_op({
    .name = "slice_backward",
    .schema = "slice_backward(Tensor grad, int[] input_sizes, int dim, int? start, int? stop, int step) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      return {TensorMeta{c.ints_attr(0).vec(), {}, c.input(0).dtype(), c.input(0).device()}};
    },
    .derivative = {.formula = "grad: grad.slice(dim, start, stop, step)",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     return {call_op1(kSlice, {c.grad()}, {c.attrs[1], c.attrs[2], c.attrs[3], c.attrs[4]})};
                   }},
    .lowering = lowering::Extern{},
});

const OpDef& kSelectBackward = register_op({
    .name = "select_backward",
    .schema = "select_backward(Tensor grad, int[] input_sizes, int dim, int index) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      return {TensorMeta{c.ints_attr(0).vec(), {}, c.input(0).dtype(), c.input(0).device()}};
    },
    .derivative = {.formula = "grad: grad.select(dim, index)",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     return {call_op1(kSelect, {c.grad()}, {c.attrs[1], c.attrs[2]})};
                   }},
    .lowering = lowering::Extern{},
});

const OpDef& slice_backward_op() { return kSliceBackward; }
const OpDef& select_backward_op() { return kSelectBackward; }

// Device-generic kernels: zero the output, then copy the gradient into the region.
[[maybe_unused]] const bool backward_kernels_registered = [] {
  for (DeviceType d : {DeviceType::cpu, DeviceType::cuda}) {
    register_kernel("slice_backward", d, [](const OpCall& c, std::span<Tensor> outs) {
      outs[0].zero_();
      call_op1(kSlice, {outs[0]}, {c.attrs[1], c.attrs[2], c.attrs[3], c.attrs[4]}).copy_(c.input(0));
    });
    register_kernel("select_backward", d, [](const OpCall& c, std::span<Tensor> outs) {
      outs[0].zero_();
      call_op1(kSelect, {outs[0]}, {c.attrs[1], c.attrs[2]}).copy_(c.input(0));
    });
  }
  return true;
}();

}  // namespace

// ---------------- front-ends ----------------

Tensor view(const Tensor& x, IntArrayRef sizes) { return call_op1(kView, {x}, {sizes.vec()}); }
Tensor permute(const Tensor& x, IntArrayRef dims) { return call_op1(kPermute, {x}, {dims.vec()}); }
Tensor expand(const Tensor& x, IntArrayRef sizes) { return call_op1(kExpand, {x}, {sizes.vec()}); }
Tensor select(const Tensor& x, int64_t dim, int64_t index) { return call_op1(kSelect, {x}, {dim, index}); }
Tensor squeeze(const Tensor& x) { return call_op1(kSqueeze, {x}, {std::vector<int64_t>{}}); }
Tensor squeeze(const Tensor& x, int64_t dim) {
  return call_op1(kSqueeze, {x}, {std::vector<int64_t>{dim}});
}
Tensor unsqueeze(const Tensor& x, int64_t dim) { return call_op1(kUnsqueeze, {x}, {dim}); }

Tensor as_strided(const Tensor& x, IntArrayRef sizes, IntArrayRef strides, std::optional<int64_t> offset) {
  return call_op1(kAsStrided, {x}, {sizes.vec(), strides.vec(), offset.value_or(x.storage_offset())});
}

Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  int64_t n = x.dim();
  if (n == 0) {
    wrap_dim(d0, n, "transpose");
    wrap_dim(d1, n, "transpose");
    return view(x, {});
  }
  d0 = wrap_dim(d0, n, "transpose");
  d1 = wrap_dim(d1, n, "transpose");
  std::vector<int64_t> dims(n);
  std::iota(dims.begin(), dims.end(), 0);
  std::swap(dims[d0], dims[d1]);
  return permute(x, dims);
}

Tensor t(const Tensor& x) {
  KILN_CHECK(x.dim() <= 2, ShapeError,
             "[kiln::t] t() expects a tensor with <= 2 dimensions, but self is " +
                 std::to_string(x.dim()) + "D. Use transpose(d0, d1) or mT() instead.");
  return x.dim() < 2 ? view(x, x.sizes()) : transpose(x, 0, 1);
}

Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length) {
  KILN_CHECK(x.dim() > 0, IndexError, "[kiln::narrow] narrow() cannot be applied to a 0-dim tensor.");
  int64_t d = wrap_dim(dim, x.dim(), "narrow");
  int64_t n = x.sizes()[d];
  KILN_CHECK(start >= -n && start <= n, IndexError,
             "[kiln::narrow] start (" + std::to_string(start) + ") is out of range for dimension " +
                 std::to_string(d) + " of size " + std::to_string(n) + ".");
  if (start < 0) start += n;
  KILN_CHECK(length >= 0 && start + length <= n, IndexError,
             "[kiln::narrow] start (" + std::to_string(start) + ") + length (" + std::to_string(length) +
                 ") exceeds dimension size (" + std::to_string(n) + ").");
  return call_op1(kSlice, {x}, {d, start, start + length, int64_t{1}});
}

Tensor reshape(const Tensor& x, IntArrayRef sizes) {
  auto target = detail::infer_size(sizes, x.numel(), "reshape");
  if (detail::compute_view_strides(x.sizes(), x.strides(), target)) return view(x, target);
  return view(contiguous(x), target);
}

Tensor flatten(const Tensor& x, int64_t start_dim, int64_t end_dim) {
  if (x.dim() == 0) return reshape(x, {1});
  int64_t s = wrap_dim(start_dim, x.dim(), "flatten");
  int64_t e = wrap_dim(end_dim, x.dim(), "flatten");
  KILN_CHECK(s <= e, ValueError, "[kiln::flatten] start_dim (" + std::to_string(s) +
                                     ") cannot come after end_dim (" + std::to_string(e) + ").");
  std::vector<int64_t> sizes;
  for (int64_t d = 0; d < s; ++d) sizes.push_back(x.sizes()[d]);
  int64_t m = 1;
  for (int64_t d = s; d <= e; ++d) m *= x.sizes()[d];
  sizes.push_back(m);
  for (int64_t d = e + 1; d < x.dim(); ++d) sizes.push_back(x.sizes()[d]);
  return reshape(x, sizes);
}

Tensor unflatten(const Tensor& x, int64_t dim, IntArrayRef sizes) {
  KILN_CHECK(x.dim() > 0, ShapeError, "[kiln::unflatten] cannot unflatten a 0-dim tensor.");
  int64_t d = wrap_dim(dim, x.dim(), "unflatten");
  KILN_CHECK(!sizes.empty(), ShapeError, "[kiln::unflatten] sizes must be non-empty.");
  auto inner = detail::infer_size(sizes, x.sizes()[d], "unflatten");
  std::vector<int64_t> out(x.sizes().begin(), x.sizes().begin() + d);
  out.insert(out.end(), inner.begin(), inner.end());
  out.insert(out.end(), x.sizes().begin() + d + 1, x.sizes().end());
  return view(x, out);
}

Tensor contiguous(const Tensor& x) { return x.is_contiguous() ? x : clone(x); }

Tensor clone(const Tensor& x) { return call_op1(kCopy, {x}, {x.dtype(), x.device()}); }

// ---------------- Tensor methods ----------------

int64_t Tensor::size(int64_t d) const { return impl().sizes.empty() ? 1 : impl().sizes[wrap_dim(d, dim(), "size")]; }
int64_t Tensor::stride(int64_t d) const {
  return impl().sizes.empty() ? 1 : impl().strides[wrap_dim(d, dim(), "stride")];
}

Tensor Tensor::view(IntArrayRef s) const { return kiln::view(*this, s); }
Tensor Tensor::reshape(IntArrayRef s) const { return kiln::reshape(*this, s); }
Tensor Tensor::permute(IntArrayRef dims) const { return kiln::permute(*this, dims); }
Tensor Tensor::transpose(int64_t d0, int64_t d1) const { return kiln::transpose(*this, d0, d1); }
Tensor Tensor::t() const { return kiln::t(*this); }
Tensor Tensor::expand(IntArrayRef s) const { return kiln::expand(*this, s); }
Tensor Tensor::narrow(int64_t d, int64_t start, int64_t len) const { return kiln::narrow(*this, d, start, len); }
Tensor Tensor::slice(int64_t d, std::optional<int64_t> start, std::optional<int64_t> stop, int64_t step) const {
  Attr a = start ? Attr(*start) : Attr();
  Attr b = stop ? Attr(*stop) : Attr();
  return call_op1(kSlice, {*this}, {d, a, b, step});
}
Tensor Tensor::select(int64_t d, int64_t i) const { return kiln::select(*this, d, i); }
Tensor Tensor::squeeze() const { return kiln::squeeze(*this); }
Tensor Tensor::squeeze(int64_t d) const { return kiln::squeeze(*this, d); }
Tensor Tensor::unsqueeze(int64_t d) const { return kiln::unsqueeze(*this, d); }
Tensor Tensor::flatten(int64_t s, int64_t e) const { return kiln::flatten(*this, s, e); }
Tensor Tensor::unflatten(int64_t d, IntArrayRef s) const { return kiln::unflatten(*this, d, s); }
Tensor Tensor::movedim(int64_t source, int64_t destination) const {
  int64_t n = dim();
  int64_t s = wrap_dim(source, n, "movedim"), d = wrap_dim(destination, n, "movedim");
  std::vector<int64_t> order;
  for (int64_t i = 0; i < n; ++i)
    if (i != s) order.push_back(i);
  if (n > 0) order.insert(order.begin() + d, s);
  return kiln::permute(*this, order);
}
Tensor Tensor::as_strided(IntArrayRef s, IntArrayRef st, std::optional<int64_t> off) const {
  return kiln::as_strided(*this, s, st, off);
}
Tensor Tensor::contiguous() const { return kiln::contiguous(*this); }
Tensor Tensor::clone(MemoryFormat format) const {
  if (format == MemoryFormat::preserve) format = suggest_memory_format();
  if (format == MemoryFormat::contiguous) return kiln::clone(*this);
  return call_op1(kCopy, {*this}, {dtype(), device(), true});
}

Tensor Tensor::contiguous(MemoryFormat format) const {
  if (format == MemoryFormat::preserve || is_contiguous(format)) return *this;
  if (format == MemoryFormat::contiguous) return kiln::contiguous(*this);
  return call_op1(kCopy, {*this}, {dtype(), device(), true});
}

bool Tensor::is_contiguous(MemoryFormat format) const {
  switch (format) {
    case MemoryFormat::contiguous: return is_contiguous();
    case MemoryFormat::channels_last: return detail::is_channels_last_contiguous(sizes(), strides());
    case MemoryFormat::preserve: break;
  }
  throw ValueError("[kiln::is_contiguous] preserve_format is not a memory format a tensor can be in; ask about "
                   "contiguous_format or channels_last.");
}

MemoryFormat Tensor::suggest_memory_format() const {
  return detail::strides_like_channels_last(sizes(), strides()) ? MemoryFormat::channels_last
                                                                : MemoryFormat::contiguous;
}

const char* memory_format_name(MemoryFormat f) {
  switch (f) {
    case MemoryFormat::contiguous: return "contiguous_format";
    case MemoryFormat::channels_last: return "channels_last";
    case MemoryFormat::preserve: return "preserve_format";
  }
  return "unknown";
}
Tensor Tensor::clone() const { return kiln::clone(*this); }

Tensor Tensor::to(DType t, bool copy) const { return to(device(), t, copy); }
Tensor Tensor::to(Device d, bool copy) const { return to(d, dtype(), copy); }
Tensor Tensor::to(Device d, DType t, bool copy) const {
  if (!copy && d == device() && t == dtype()) return *this;
  // preserve_format, as PyTorch's to(): a channels-last tensor stays channels-last.
  if (dim() == 4 && !is_contiguous() && is_contiguous(MemoryFormat::channels_last))
    return call_op1(kCopy, {*this}, {t, d, true});
  return call_op1(kCopy, {*this}, {t, d});
}

Tensor& Tensor::copy_(const Tensor& src) {
  Tensor s = src.dim() <= dim() && src.sizes() == sizes() ? src : kiln::expand(src, sizes());
  Tensor out[1] = {*this};
  call_op_out(kCopy, {s}, {dtype(), device()}, out);
  return *this;
}

Tensor& Tensor::fill_(Scalar value) {
  Tensor out[1] = {*this};
  call_op_out(kFill, {detail::wrap_scalar(value, dtype())}, {sizes().vec(), dtype(), device()}, out);
  return *this;
}

Tensor& Tensor::fill_(const Tensor& value) {
  KILN_CHECK(value.dim() == 0, ShapeError,
             "[kiln::fill_] fill_ only supports 0-dimension value tensors but got tensor with " +
                 std::to_string(value.dim()) + " dimensions.");
  Tensor out[1] = {*this};
  call_op_out(kFill, {value.to(kCPU).to(dtype())}, {sizes().vec(), dtype(), device()}, out);
  return *this;
}

Tensor& Tensor::zero_() { return fill_(0); }

Tensor Tensor::detach() const {
  Tensor d = detail::make_view(*this, sizes().vec(), strides().vec(), storage_offset());
  return d;
}

uint64_t Tensor::version() const { return impl().storage->version.load(std::memory_order_relaxed); }
bool Tensor::is_alias_of(const Tensor& other) const {
  return defined() && other.defined() && impl().storage == other.impl().storage;
}

Tensor full(IntArrayRef sizes, Scalar value, TensorOptions o) {
  DType t = o.dtype.value_or(value.dtype());
  Tensor v = detail::wrap_scalar(value, t);
  return call_op1(kFill, {v}, {sizes.vec(), t, o.device});
}

}  // namespace kiln
