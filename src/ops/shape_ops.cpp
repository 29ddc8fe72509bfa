// Shape ops that copy: cat and padding (table ops), and the composites built from them and from
// views: stack (unsqueeze + cat), split / chunk (narrow views), pad (dispatches on the mode).
//
// Table ops: cat, constant_pad_nd, reflection_pad{1,2,3}d, replication_pad{1,2,3}d, and the
// derivatives of the mode pads, reflection_pad{1,2,3}d_backward / replication_pad{1,2,3}d_backward
// (each the other's derivative). cat's gradient is narrowed per input, constant_pad_nd's is
// constant_pad_nd with the pads negated.
#include <algorithm>
#include <numeric>

#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln {

using detail::wrap_dim;

namespace {

std::string list_str(IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

void check_same_device(std::span<const Tensor> ts, const std::string& op) {
  const Tensor* first = nullptr;
  for (const Tensor& t : ts) {
    if (!t.defined()) continue;
    if (!first) {
      first = &t;
      continue;
    }
    KILN_CHECK(t.device() == first->device(), DeviceError,
               "[kiln::" + op + "] expected all tensors to be on the same device, but found at least two "
               "devices, " + first->device().str() + " and " + t.device().str() + ". Move them to one device.");
  }
}

// PyTorch's legacy rule: 1-D tensors of size 0 take part in cat whatever their shape.
bool cat_skipped(const Tensor& t) { return t.dim() == 1 && t.sizes()[0] == 0; }

std::vector<TensorMeta> cat_meta(const OpCall& c) {
  std::span<const Tensor> ts = c.inputs;
  KILN_CHECK(!ts.empty(), ValueError,
             "[kiln::cat] expected a non-empty list of tensors. Pass at least one tensor.");
  for (size_t i = 0; i < ts.size(); ++i) {
    KILN_CHECK(ts[i].defined(), ValueError,
               "[kiln::cat] tensor number " + std::to_string(i) + " in the list is undefined.");
    KILN_CHECK(ts[i].dim() > 0, ShapeError,
               "[kiln::cat] zero-dimensional tensor (at position " + std::to_string(i) +
                   ") cannot be concatenated. Unsqueeze it, or use stack.");
  }
  check_same_device(ts, "cat");
  DType dtype = detail::result_type(ts);
  const Tensor* ref = nullptr;
  for (const Tensor& t : ts)
    if (!cat_skipped(t)) {
      ref = &t;
      break;
    }
  if (!ref) return {TensorMeta{{0}, {}, dtype, ts[0].device()}};
  int64_t dim = wrap_dim(c.int_attr(0), ref->dim(), "cat");
  std::vector<int64_t> sizes = ref->sizes().vec();
  sizes[dim] = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    const Tensor& t = ts[i];
    if (cat_skipped(t)) continue;
    KILN_CHECK(t.dim() == ref->dim(), ShapeError,
               "[kiln::cat] Tensors must have same number of dimensions: got " + std::to_string(ref->dim()) +
                   " and " + std::to_string(t.dim()) + ".");
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (d == dim) continue;
      KILN_CHECK(t.sizes()[d] == ref->sizes()[d], ShapeError,
                 "[kiln::cat] Sizes of tensors must match except in dimension " + std::to_string(dim) +
                     ". Expected size " + std::to_string(ref->sizes()[d]) + " but got size " +
                     std::to_string(t.sizes()[d]) + " for tensor number " + std::to_string(i) +
                     " in the list.");
    }
    sizes[dim] += t.sizes()[dim];
  }
  detail::checked_numel(sizes, "cat");
  // PyTorch's rule: the inputs' memory format when they all suggest the same one, else
  // contiguous. Inputs without elements have no say.
  int voters = 0, channels_last_votes = 0;
  for (const Tensor& t : ts) {
    if (t.numel() == 0) continue;
    ++voters;
    channels_last_votes += t.suggest_memory_format() == MemoryFormat::channels_last;
  }
  bool channels_last = sizes.size() == 4 && voters > 0 && channels_last_votes == voters;
  std::vector<int64_t> strides = detail::format_strides(sizes, channels_last);
  return {TensorMeta{std::move(sizes), std::move(strides), dtype, ts[0].device()}};
}

const OpDef& kCat = register_op({
    .name = "cat",
    .schema = "cat(Tensor[] tensors, int dim=0) -> Tensor",
    .meta = cat_meta,
    .derivative = {.formula = "tensors: grad.narrow(dim, offset_i, tensors[i].size(dim)) for each input",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     const size_t n = c.input_info.size();
                     auto skipped = [&](size_t i) {
                       const auto& s = c.input_info[i].sizes;
                       return s.size() == 1 && s[0] == 0;
                     };
                     TensorList out(n);
                     size_t ref = 0;
                     while (ref < n && skipped(ref)) ++ref;
                     const int64_t ndim = ref < n ? static_cast<int64_t>(c.input_info[ref].sizes.size()) : 1;
                     const int64_t dim = ref < n ? wrap_dim(c.int_attr(0), ndim, "cat") : 0;
                     int64_t offset = 0;
                     for (size_t i = 0; i < n; ++i) {
                       if (skipped(i)) {
                         // A legacy empty input took no part: its gradient is empty too.
                         if (c.needs_grad(i)) out[i] = zeros({0}, TensorOptions(c.grad().dtype(), c.grad().device()));
                         continue;
                       }
                       const int64_t len = c.input_info[i].sizes[dim];
                       if (c.needs_grad(i)) out[i] = c.grad().narrow(dim, offset, len);
                       offset += len;
                     }
                     return out;
                   }},
    .lowering = lowering::Extern{},
});

const OpDef& constant_pad_op();

// constant_pad_nd(self, pad, value): pad pairs from the last dim backwards; negative pads crop.
const OpDef& kConstantPad = register_op({
    .name = "constant_pad_nd",
    .schema = "constant_pad_nd(Tensor self, SymInt[] pad, Scalar value=0) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      IntArrayRef pad = c.ints_attr(0);
      KILN_CHECK(pad.size() % 2 == 0, ValueError,
                 "[kiln::constant_pad_nd] Length of pad must be even but instead it equals " +
                     std::to_string(pad.size()) + ".");
      int64_t npad = static_cast<int64_t>(pad.size()) / 2;
      KILN_CHECK(npad <= x.dim(), ValueError,
                 "[kiln::constant_pad_nd] Length of pad should be no more than twice the number of "
                 "dimensions of the input. Pad length is " + std::to_string(pad.size()) +
                     " while the input has " + std::to_string(x.dim()) + " dimensions.");
      std::vector<int64_t> sizes = x.sizes().vec();
      for (int64_t i = 0; i < npad; ++i) {
        int64_t d = x.dim() - 1 - i;
        int64_t out = sizes[d] + pad[2 * i] + pad[2 * i + 1];
        KILN_CHECK(out >= 0, ShapeError,
                   "[kiln::constant_pad_nd] The input size " + std::to_string(sizes[d]) + ", plus negative "
                   "padding " + std::to_string(pad[2 * i]) + " and " + std::to_string(pad[2 * i + 1]) +
                       " resulted in a negative output size, which is invalid. Check dimension " +
                       std::to_string(d) + " of your input.");
        sizes[d] = out;
      }
      detail::checked_numel(sizes, "constant_pad_nd");
      return {TensorMeta{std::move(sizes), {}, x.dtype(), x.device()}};
    },
    .derivative = {.formula = "self: constant_pad_nd(grad, -pad, 0)",
                   .fn = [](const BackwardContext& c) -> TensorList {
                     std::vector<int64_t> neg = c.ints_attr(0).vec();
                     for (int64_t& p : neg) p = -p;
                     return {call_op1(constant_pad_op(), {c.grad()}, {std::move(neg), Scalar(0)})};
                   }},
    .lowering = lowering::Extern{},
});

const OpDef& constant_pad_op() { return kConstantPad; }

// reflection_pad{k}d / replication_pad{k}d: the last k dims padded, input of k+1 or k+2 dims.
std::vector<TensorMeta> mode_pad_meta(const OpCall& c, int64_t k, bool reflect) {
  const std::string& op = c.name();
  const Tensor& x = c.input(0);
  IntArrayRef pad = c.ints_attr(0);
  KILN_CHECK(static_cast<int64_t>(pad.size()) == 2 * k, ValueError,
             "[kiln::" + op + "] padding size is expected to be " + std::to_string(2 * k) + ", but got: " +
                 std::to_string(pad.size()) + ".");
  bool ok_dim = x.dim() == k + 1 || x.dim() == k + 2;
  for (int64_t d = x.dim() - k - 1; ok_dim && d < x.dim(); ++d)
    if (d >= 0 && x.sizes()[d] == 0) ok_dim = false;
  KILN_CHECK(ok_dim, ShapeError,
             "[kiln::" + op + "] Expected " + std::to_string(k + 1) + "D or " + std::to_string(k + 2) +
                 "D (batch mode) tensor with possibly 0 batch size and other non-zero dimensions for "
                 "input, but got: " + shape_str(x.sizes()) + ".");
  std::vector<int64_t> sizes = x.sizes().vec();
  static const char* kNames[] = {"W", "H", "D"};
  std::string in_desc, out_desc;
  bool too_small = false;
  for (int64_t i = 0; i < k; ++i) {
    int64_t d = x.dim() - 1 - i;
    int64_t n = sizes[d], l = pad[2 * i], r = pad[2 * i + 1];
    if (reflect) {
      KILN_CHECK(l < n && r < n, ValueError,
                 "[kiln::" + op + "] Padding size should be less than the corresponding input dimension, "
                 "but got: padding (" + std::to_string(l) + ", " + std::to_string(r) + ") at dimension " +
                     std::to_string(d) + " of input " + shape_str(x.sizes()) + ".");
    }
    sizes[d] = n + l + r;
    if (sizes[d] < 1) too_small = true;
    in_desc = std::string(kNames[i]) + ": " + std::to_string(n) + (in_desc.empty() ? "" : ", ") + in_desc;
    out_desc = std::string(kNames[i]) + ": " + std::to_string(sizes[d]) + (out_desc.empty() ? "" : " ") + out_desc;
  }
  KILN_CHECK(!too_small, ShapeError,
             "[kiln::" + op + "] input (" + in_desc + ") is too small. Calculated output " + out_desc +
                 ". Use smaller negative padding.");
  return {TensorMeta{std::move(sizes), {}, x.dtype(), x.device()}};
}

// The forward op's derivative calls its backward op and the backward op's calls the forward
// op; both entries are looked up by name (the table's references stay valid).
OpDef mode_pad_def(const std::string& name, int64_t k, bool reflect) {
  const OpDef* backward = &OpTable::instance().entry(name + "_backward");
  return OpDef{
      .name = name,
      .schema = name + "(Tensor self, SymInt[" + std::to_string(2 * k) + "] padding) -> Tensor",
      .meta = [k, reflect](const OpCall& c) { return mode_pad_meta(c, k, reflect); },
      .derivative = {.formula = "self: " + name + "_backward(grad, self.sizes(), padding)",
                     .fn = [backward](const BackwardContext& c) -> TensorList {
                       return {call_op1(*backward, {c.grad()}, {c.input_info[0].sizes, c.attrs[0]})};
                     }},
      .lowering = lowering::Extern{},
  };
}

// {reflection,replication}_pad{k}d_backward(grad_output, input_size, padding): the gradient of
// the input, each grad_output element added to the input element it was copied from. Takes the
// input's sizes rather than the input itself, so the forward node saves nothing.
OpDef mode_pad_backward_def(const std::string& forward_name, int64_t k, bool reflect) {
  const std::string name = forward_name + "_backward";
  const OpDef* forward = &OpTable::instance().entry(forward_name);
  return OpDef{
      .name = name,
      .schema = name + "(Tensor grad_output, SymInt[] input_size, SymInt[" + std::to_string(2 * k) +
                "] padding) -> Tensor",
      .meta = [k, reflect, name](const OpCall& c) -> std::vector<TensorMeta> {
        const Tensor& grad = c.input(0);
        IntArrayRef in = c.ints_attr(0), pad = c.ints_attr(1);
        KILN_CHECK(is_floating_point(grad.dtype()), DTypeError,
                   "[kiln::" + name + "] expected a floating-point grad_output, got " +
                       std::string(dtype_name(grad.dtype())) + ".");
        KILN_CHECK(static_cast<int64_t>(pad.size()) == 2 * k, ValueError,
                   "[kiln::" + name + "] padding size is expected to be " + std::to_string(2 * k) + ", but got: " +
                       std::to_string(pad.size()) + ".");
        const int64_t nd = static_cast<int64_t>(in.size());
        KILN_CHECK(nd == k + 1 || nd == k + 2, ShapeError,
                   "[kiln::" + name + "] expected an input_size of " + std::to_string(k + 1) + " or " +
                       std::to_string(k + 2) + " dims, got " + list_str(in) + ".");
        detail::check_sizes_nonnegative(in, name);
        std::vector<int64_t> expected = in.vec();
        for (int64_t i = 0; i < k; ++i) {
          const int64_t d = nd - 1 - i, n = in[d], l = pad[2 * i], r = pad[2 * i + 1];
          KILN_CHECK(n > 0 && (!reflect || (l < n && r < n)) && n + l + r >= 1, ValueError,
                     "[kiln::" + name + "] padding (" + std::to_string(l) + ", " + std::to_string(r) +
                         ") is invalid for dimension " + std::to_string(d) + " of size " + std::to_string(n) + ".");
          expected[d] = n + l + r;
        }
        KILN_CHECK(grad.sizes() == IntArrayRef(expected), ShapeError,
                   "[kiln::" + name + "] grad_output of shape " + list_str(grad.sizes()) +
                       " does not match the padded input's shape " + list_str(expected) + ".");
        return {TensorMeta{in.vec(), {}, grad.dtype(), grad.device()}};
      },
      .derivative = {.formula = "grad_output: " + forward_name + "(grad, padding)",
                     .fn = [forward](const BackwardContext& c) -> TensorList {
                       return {call_op1(*forward, {c.grad()}, {c.attrs[1]})};
                     }},
      .lowering = lowering::Extern{},
  };
}

const OpDef* const kReflectionPad[3] = {&register_op(mode_pad_def("reflection_pad1d", 1, true)),
                                        &register_op(mode_pad_def("reflection_pad2d", 2, true)),
                                        &register_op(mode_pad_def("reflection_pad3d", 3, true))};
const OpDef* const kReplicationPad[3] = {&register_op(mode_pad_def("replication_pad1d", 1, false)),
                                         &register_op(mode_pad_def("replication_pad2d", 2, false)),
                                         &register_op(mode_pad_def("replication_pad3d", 3, false))};
[[maybe_unused]] const OpDef* const kModePadBackward[6] = {
    &register_op(mode_pad_backward_def("reflection_pad1d", 1, true)),
    &register_op(mode_pad_backward_def("reflection_pad2d", 2, true)),
    &register_op(mode_pad_backward_def("reflection_pad3d", 3, true)),
    &register_op(mode_pad_backward_def("replication_pad1d", 1, false)),
    &register_op(mode_pad_backward_def("replication_pad2d", 2, false)),
    &register_op(mode_pad_backward_def("replication_pad3d", 3, false))};

}  // namespace

// ---------------- front-ends ----------------

Tensor cat(const TensorList& tensors, int64_t dim) { return call_op1(kCat, tensors, {dim}); }

Tensor stack(const TensorList& tensors, int64_t dim) {
  KILN_CHECK(!tensors.empty(), ValueError, "[kiln::stack] stack expects a non-empty TensorList.");
  for (size_t i = 0; i < tensors.size(); ++i) {
    KILN_CHECK(tensors[i].defined(), ValueError,
               "[kiln::stack] tensor number " + std::to_string(i) + " in the list is undefined.");
    KILN_CHECK(tensors[i].sizes() == tensors[0].sizes(), ShapeError,
               "[kiln::stack] stack expects each tensor to be equal size, but got " +
                   shape_str(tensors[0].sizes()) + " at entry 0 and " + shape_str(tensors[i].sizes()) +
                   " at entry " + std::to_string(i) + ".");
  }
  int64_t d = wrap_dim(dim, tensors[0].dim() + 1, "stack");
  TensorList parts;
  parts.reserve(tensors.size());
  for (const Tensor& t : tensors) parts.push_back(unsqueeze(t, d));
  return cat(parts, d);
}

std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim) {
  KILN_CHECK(x.dim() != 0, ShapeError, "[kiln::split] split expects at least a 1-dimensional tensor.");
  KILN_CHECK(split_size >= 0, ValueError,
             "[kiln::split] split expects split_size be non-negative, but got split_size=" +
                 std::to_string(split_size) + ".");
  int64_t d = wrap_dim(dim, x.dim(), "split");
  int64_t n = x.sizes()[d];
  KILN_CHECK(split_size != 0 || n == 0, ValueError,
             "[kiln::split] split_size can only be 0 if dimension size is 0, but got dimension size of " +
                 std::to_string(n) + ".");
  int64_t num_splits = split_size == 0 ? 1 : std::max<int64_t>((n + split_size - 1) / split_size, 1);
  int64_t last = split_size - (split_size * num_splits - n);
  std::vector<Tensor> out;
  out.reserve(num_splits);
  for (int64_t i = 0; i < num_splits; ++i)
    out.push_back(narrow(x, d, i * split_size, i + 1 < num_splits ? split_size : last));
  return out;
}

std::vector<Tensor> split(const Tensor& x, IntArrayRef split_sizes, int64_t dim) {
  KILN_CHECK(x.dim() != 0, ShapeError, "[kiln::split] split expects at least a 1-dimensional tensor.");
  int64_t d = wrap_dim(dim, x.dim(), "split");
  int64_t n = x.sizes()[d];
  int64_t total = 0;
  for (int64_t s : split_sizes) {
    KILN_CHECK(s >= 0, ValueError,
               "[kiln::split_with_sizes] split_with_sizes expects split_sizes have only non-negative "
               "entries, but got split_sizes=" + list_str(split_sizes) + ".");
    total += s;
  }
  KILN_CHECK(total == n, ShapeError,
             "[kiln::split_with_sizes] split_with_sizes expects split_sizes to sum exactly to " +
                 std::to_string(n) + " (input tensor's size at dimension " + std::to_string(d) +
                 "), but got split_sizes=" + list_str(split_sizes) + ".");
  std::vector<Tensor> out;
  out.reserve(split_sizes.size());
  int64_t start = 0;
  for (int64_t s : split_sizes) {
    out.push_back(narrow(x, d, start, s));
    start += s;
  }
  return out;
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  KILN_CHECK(x.dim() != 0, ShapeError, "[kiln::chunk] chunk expects at least a 1-dimensional tensor.");
  KILN_CHECK(chunks > 0, ValueError,
             "[kiln::chunk] chunk expects `chunks` to be greater than 0, got: " + std::to_string(chunks) + ".");
  int64_t d = wrap_dim(dim, x.dim(), "chunk");
  int64_t n = x.sizes()[d];
  int64_t split_size = (n + chunks - 1) / chunks;
  // With size 0 and split_size 0, split would lose the number of chunks: keep them all, empty.
  if (split_size == 0 && n == 0) return split(x, std::vector<int64_t>(chunks, 0), d);
  return split(x, split_size, d);
}

Tensor pad(const Tensor& x, IntArrayRef pad, const std::string& mode, double value) {
  KILN_CHECK(pad.size() % 2 == 0, ValueError, "[kiln::pad] Padding length must be divisible by 2.");
  KILN_CHECK(static_cast<int64_t>(pad.size()) <= 2 * x.dim(), ValueError,
             "[kiln::pad] Padding length should be less than or equal to two times the input dimension "
             "but got padding length " + std::to_string(pad.size()) + " and input of dimension " +
                 std::to_string(x.dim()) + ".");
  if (mode == "constant") return call_op1(kConstantPad, {x}, {pad.vec(), Scalar(value)});
  bool reflect = mode == "reflect";
  KILN_CHECK(reflect || mode == "replicate", ValueError,
             "[kiln::pad] Unrecognised padding mode \"" + mode + "\". Use \"constant\", \"reflect\" or "
             "\"replicate\".");
  KILN_CHECK(value == 0.0, ValueError,
             "[kiln::pad] Padding mode \"" + mode + "\" doesn't take in value argument.");
  int64_t k = static_cast<int64_t>(pad.size()) / 2;
  KILN_CHECK(k >= 1 && k <= 3 && (x.dim() == k + 1 || x.dim() == k + 2), ShapeError,
             "[kiln::pad] Only 2D, 3D, 4D, 5D padding with non-constant padding are supported for now "
             "(got padding length " + std::to_string(pad.size()) + " for an input of dimension " +
                 std::to_string(x.dim()) + "). Give 2 pad values for 2D/3D input, 4 for 3D/4D, 6 for 4D/5D.");
  const OpDef& op = reflect ? *kReflectionPad[k - 1] : *kReplicationPad[k - 1];
  return call_op1(op, {x}, {pad.vec()});
}

// ---------------- Tensor methods ----------------

std::vector<Tensor> Tensor::split(int64_t split_size, int64_t dim) const {
  return kiln::split(*this, split_size, dim);
}
std::vector<Tensor> Tensor::chunk(int64_t chunks, int64_t dim) const { return kiln::chunk(*this, chunks, dim); }

}  // namespace kiln
