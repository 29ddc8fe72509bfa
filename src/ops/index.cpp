// Indexing ops: index_select, gather, scatter (src / value), scatter_add, index (advanced
// indexing), index_put, embedding, one_hot; and embedding_dense_backward, the derivative of
// embedding.
//
// Derivatives follow PyTorch's derivatives.yaml and are written with these ops, so that they are
// themselves differentiable: index_select and index go back through index_put(accumulate=True)
// into zeros, gather through scatter_add, scatter/scatter_add's src through gather.
//
// Index values are data, so meta checks index dtypes, ranks and shapes, and the kernels check
// every index value (IndexError, before any write). Bool/uint8 masks are turned into int64
// index tensors (their nonzero positions) by the front-ends here, before the table op, because
// the result's shape depends on the mask's contents: the "index" and "index_put" ops only see
// int64/int32 indices.
#include <algorithm>
#include <numeric>

#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/autograd.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln {

namespace cpu {
// Defined in kernels/cpu/index_kernels.cpp (a host read, whatever the mask's device).
std::vector<Tensor> nonzero_indices(const Tensor& mask, bool linear);
}  // namespace cpu

namespace detail {
std::vector<Tensor> expand_index_masks(const Tensor& self, const std::vector<Tensor>& indices);
}  // namespace detail

using detail::wrap_dim;

namespace {

// The most index tensors an index / index_put derivative saves (one per dim of self).
constexpr int kMaxIndexTensors = 64;

// The ops' entries, for derivatives that use ops defined further down.
const OpDef& gather_op();
const OpDef& scatter_value_op();
const OpDef& scatter_add_op();
const OpDef& index_op();
const OpDef& index_put_op();
const OpDef& embedding_op();
const OpDef& embedding_backward_op();

// Inputs that a derivative may save by position: index's and index_put's index tensors (at most
// one per dim of self). Positions past the op's inputs are ignored when saving.
std::vector<int> index_slots(int first) {
  std::vector<int> v;
  for (int i = first; i < first + kMaxIndexTensors; ++i) v.push_back(i);
  return v;
}

TensorOptions options_of(const Tensor& t) { return TensorOptions(t.dtype(), t.device()); }

std::string list_str(IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

std::string name_of(DType t) { return std::string(dtype_name(t)); }

void check_device(const Tensor& self, const Tensor& other, const std::string& op, const std::string& what) {
  KILN_CHECK(other.device() == self.device(), DeviceError,
             "[kiln::" + op + "] expected " + what + " to be on the same device as self (" +
                 self.device().str() + "), but it is on " + other.device().str() + ". Move it with .to(...).");
}

int64_t nonempty_dim(const Tensor& t) { return std::max<int64_t>(t.dim(), 1); }
int64_t nonempty_size(const Tensor& t, int64_t d) { return t.dim() == 0 ? 1 : t.sizes()[d]; }

// grad.gather(dim, index), zero-padded up to `sizes`: the gradient of the src of scatter /
// scatter_add, whose src may be larger than index (its extra elements get zero gradient).
Tensor gather_to(const Tensor& grad, int64_t dim, const Tensor& index, IntArrayRef sizes) {
  if (index.numel() == 0) return zeros(sizes, options_of(grad));
  Tensor g = call_op1(gather_op(), {grad, index}, {dim});
  if (g.sizes() == sizes) return g;
  // A 0-dim index or src stands for one element of size-1 dim (PyTorch's ensure_nonempty_dim).
  if (g.dim() != static_cast<int64_t>(sizes.size())) g = g.reshape(sizes.empty() ? IntArrayRef{} : IntArrayRef{1});
  if (g.sizes() == sizes) return g;
  std::vector<int64_t> widths;
  for (int64_t d = g.dim() - 1; d >= 0; --d) {
    widths.push_back(0);
    widths.push_back(sizes[d] - g.sizes()[d]);
  }
  return pad(g, widths);
}

// scatter(grad, dim, index, 0): the gradient of the positions scatter overwrote is zero.
Tensor zero_scattered(const Tensor& grad, int64_t dim, const Tensor& index) {
  return call_op1(scatter_value_op(), {grad, index}, {dim, Scalar(0)});
}

// ---------------- index_select ----------------

const OpDef& kIndexSelect = register_op({
    .name = "index_select",
    .schema = "index_select(Tensor self, int dim, Tensor index) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      const Tensor& index = c.input(1);
      int64_t dim = wrap_dim(c.int_attr(0), x.dim(), "index_select");
      KILN_CHECK(index.dim() <= 1, IndexError,
                 "[kiln::index_select] index_select(): Index is supposed to be a vector, got shape " +
                     shape_str(index.sizes()) + ". Flatten it first.");
      KILN_CHECK(index.dtype() == kInt64 || index.dtype() == kInt32, DTypeError,
                 "[kiln::index_select] index_select(): Expected dtype int32 or int64 for index, got " +
                     name_of(index.dtype()) + ".");
      check_device(x, index, "index_select", "index");
      std::vector<int64_t> sizes = x.sizes().vec();
      if (x.dim() == 0) {
        KILN_CHECK(index.numel() == 1, IndexError,
                   "[kiln::index_select] index_select(): Index to scalar can have only 1 value, got " +
                       std::to_string(index.numel()) + " value(s).");
      } else {
        sizes[dim] = index.numel();
      }
      return {TensorMeta{std::move(sizes), {}, x.dtype(), x.device()}};
    },
    .derivative = {.formula = "self: zeros(self.sizes()).index_add(dim, index, grad)  "
                              "(as index_put(zeros, [None] * dim + [index], grad, accumulate=True))",
                   .save_inputs = {1},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     const std::vector<int64_t>& sizes = c.input_info[0].sizes;
                     if (sizes.empty()) return {c.grad().reshape({})};
                     int64_t dim = wrap_dim(c.int_attr(0), static_cast<int64_t>(sizes.size()), "index_select");
                     std::vector<Tensor> inputs{zeros(sizes, options_of(c.grad())), c.grad()};
                     for (int64_t d = 0; d < dim; ++d) inputs.emplace_back();
                     inputs.push_back(c.input(1).reshape({-1}));
                     return {call_op1(index_put_op(), std::move(inputs), {true})};
                   }},
    .lowering = lowering::Extern{},
});

// ---------------- gather / scatter ----------------

void check_int64_index(const Tensor& index, const std::string& op) {
  KILN_CHECK(index.dtype() == kInt64, DTypeError,
             "[kiln::" + op + "] " + op + "(): Expected dtype int64 for index, got " + name_of(index.dtype()) +
                 ". Convert it with .to(kInt64).");
}

const OpDef& kGather = register_op({
    .name = "gather",
    .schema = "gather(Tensor self, int dim, Tensor index, *, bool sparse_grad=False) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      const Tensor& index = c.input(1);
      int64_t dim = wrap_dim(c.int_attr(0), x.dim(), "gather");
      check_int64_index(index, "gather");
      check_device(x, index, "gather", "index");
      if (index.numel() != 0) {
        KILN_CHECK(nonempty_dim(index) == nonempty_dim(x), ShapeError,
                   "[kiln::gather] Index tensor must have the same number of dimensions as input tensor "
                   "(got " + std::to_string(index.dim()) + " and " + std::to_string(x.dim()) + ").");
        for (int64_t d = 0; d < nonempty_dim(x); ++d) {
          if (d == dim) continue;
          KILN_CHECK(nonempty_size(index, d) <= nonempty_size(x, d), ShapeError,
                     "[kiln::gather] Size does not match at dimension " + std::to_string(d) + " expected index " +
                         list_str(index.sizes()) + " to be no larger than self " + list_str(x.sizes()) +
                         " apart from dimension " + std::to_string(dim) + ".");
        }
      }
      return {TensorMeta{index.sizes().vec(), {}, x.dtype(), x.device()}};
    },
    .derivative = {.formula = "self: zeros(self.sizes()).scatter_add(dim, index, grad)",
                   .save_inputs = {1},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     Tensor z = zeros(c.input_info[0].sizes, options_of(c.grad()));
                     return {call_op1(scatter_add_op(), {z, c.input(1), c.grad()}, {c.int_attr(0)})};
                   }},
    .lowering = lowering::Extern{},
});

// PyTorch's scatter_gather_dtype_check + scatter_shape_check. src is undefined for the value form.
std::vector<TensorMeta> scatter_meta(const OpCall& c, const std::string& op, const Tensor& src) {
  const Tensor& x = c.input(0);
  const Tensor& index = c.input(1);
  int64_t dim = wrap_dim(c.int_attr(0), x.dim(), op);
  check_int64_index(index, op);
  check_device(x, index, op, "index");
  if (src.defined()) {
    check_device(x, src, op, "src");
    KILN_CHECK(src.dtype() == x.dtype(), DTypeError,
               "[kiln::" + op + "] " + op + "(): Expected self.dtype to be equal to src.dtype (got " +
                   name_of(x.dtype()) + " and " + name_of(src.dtype()) + "). Convert src first.");
  }
  if (index.numel() != 0) {
    KILN_CHECK(nonempty_dim(x) == nonempty_dim(index), ShapeError,
               "[kiln::" + op + "] Index tensor must have the same number of dimensions as self tensor (got " +
                   std::to_string(index.dim()) + " and " + std::to_string(x.dim()) + ").");
    if (src.defined()) {
      KILN_CHECK(nonempty_dim(src) == nonempty_dim(index), ShapeError,
                 "[kiln::" + op + "] Index tensor must have the same number of dimensions as src tensor (got " +
                     std::to_string(index.dim()) + " and " + std::to_string(src.dim()) + ").");
    }
    bool wrong = false;
    for (int64_t d = 0; d < nonempty_dim(x); ++d) {
      if (d != dim && nonempty_size(index, d) > nonempty_size(x, d)) wrong = true;
      if (src.defined() && nonempty_size(index, d) > nonempty_size(src, d)) wrong = true;
    }
    KILN_CHECK(!wrong, ShapeError,
               "[kiln::" + op + "] Expected index " + list_str(index.sizes()) + " to be smaller than self " +
                   list_str(x.sizes()) + " apart from dimension " + std::to_string(dim) +
                   (src.defined() ? " and to be smaller size than src " + list_str(src.sizes()) : std::string()) + ".");
  }
  return {TensorMeta{x.sizes().vec(), {}, x.dtype(), x.device()}};
}

const OpDef& kScatter = register_op({
    .name = "scatter",
    .schema = "scatter.src(Tensor self, int dim, Tensor index, Tensor src) -> Tensor",
    .meta = [](const OpCall& c) { return scatter_meta(c, "scatter", c.input(2)); },
    .derivative = {.formula = "self: grad.scatter(dim, index, 0); src: grad.gather(dim, index)",
                   .save_inputs = {1},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     int64_t dim = c.int_attr(0);
                     TensorList out(3);
                     if (c.needs_grad(0)) out[0] = zero_scattered(c.grad(), dim, c.input(1));
                     if (c.needs_grad(2)) out[2] = gather_to(c.grad(), dim, c.input(1), c.input_info[2].sizes);
                     return out;
                   }},
    .lowering = lowering::Extern{},
});

const OpDef& kScatterValue = register_op({
    .name = "scatter.value",
    .schema = "scatter.value(Tensor self, int dim, Tensor index, Scalar value) -> Tensor",
    .meta = [](const OpCall& c) { return scatter_meta(c, "scatter", Tensor()); },
    .derivative = {.formula = "self: grad.scatter(dim, index, 0)",
                   .save_inputs = {1},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     return {zero_scattered(c.grad(), c.int_attr(0), c.input(1))};
                   }},
    .lowering = lowering::Extern{},
});

const OpDef& kScatterAdd = register_op({
    .name = "scatter_add",
    .schema = "scatter_add(Tensor self, int dim, Tensor index, Tensor src) -> Tensor",
    .meta = [](const OpCall& c) { return scatter_meta(c, "scatter_add", c.input(2)); },
    .derivative = {.formula = "self: grad; src: grad.gather(dim, index)",
                   .save_inputs = {1},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     TensorList out(3);
                     if (c.needs_grad(0)) out[0] = c.grad();
                     if (c.needs_grad(2)) out[2] = gather_to(c.grad(), c.int_attr(0), c.input(1), c.input_info[2].sizes);
                     return out;
                   }},
    .lowering = lowering::Extern{},
});

// ---------------- index / index_put ----------------

// The shape of x[indices] for int64/int32 index tensors, one per leading dim (undefined = all).
// Indexed dims that are adjacent put the broadcast index shape in their place; otherwise it goes
// first (PyTorch's rule).
std::vector<int64_t> index_result_sizes(const Tensor& self, std::span<const Tensor> indices, const std::string& op) {
  KILN_CHECK(static_cast<int64_t>(indices.size()) <= self.dim(), IndexError,
             "[kiln::" + op + "] too many indices for tensor of dimension " + std::to_string(self.dim()) +
                 " (got " + std::to_string(indices.size()) + ").");
  std::vector<int64_t> bshape;
  std::string shapes;
  int64_t first = -1, last = -1;
  bool adjacent = true;
  for (size_t i = 0; i < indices.size(); ++i) {
    const Tensor& idx = indices[i];
    if (!idx.defined()) continue;
    DType t = idx.dtype();
    KILN_CHECK(t != kBool && t != kUInt8, DTypeError,
               "[kiln::" + op + "] the op takes int64/int32 index tensors; bool and uint8 masks are "
               "expanded by kiln::index, kiln::index_put and Tensor::index, so call those.");
    KILN_CHECK(t == kInt64 || t == kInt32, DTypeError,
               "[kiln::" + op + "] tensors used as indices must be long, int, byte or bool tensors, got " +
                   name_of(t) + ".");
    KILN_CHECK(idx.device() == self.device() || idx.is_cpu(), DeviceError,
               "[kiln::" + op + "] indices should be either on cpu or on the same device as the indexed "
               "tensor (" + self.device().str() + ").");
    if (first >= 0 && last != static_cast<int64_t>(i) - 1) adjacent = false;
    if (first < 0) first = static_cast<int64_t>(i);
    last = static_cast<int64_t>(i);
    shapes += (shapes.empty() ? "" : ", ") + list_str(idx.sizes());
    // Broadcast, reporting every shape on failure like PyTorch.
    size_t n = std::max(bshape.size(), static_cast<size_t>(idx.dim()));
    std::vector<int64_t> b(n);
    bool ok = true;
    for (size_t k = 0; k < n; ++k) {
      int64_t a = k < n - bshape.size() ? 1 : bshape[k - (n - bshape.size())];
      int64_t s = k < n - idx.dim() ? 1 : idx.sizes()[k - (n - idx.dim())];
      if (a != s && a != 1 && s != 1) ok = false;
      b[k] = a == 1 ? s : a;
    }
    if (!ok) {
      std::string all;
      for (const Tensor& j : indices)
        if (j.defined()) all += (all.empty() ? "" : ", ") + list_str(j.sizes());
      throw IndexError("[kiln::" + op + "] shape mismatch: indexing tensors could not be broadcast together "
                       "with shapes " + all + ".");
    }
    bshape = std::move(b);
  }
  if (first < 0) return self.sizes().vec();
  std::vector<int64_t> out;
  auto indexed = [&](int64_t d) { return d < static_cast<int64_t>(indices.size()) && indices[d].defined(); };
  if (adjacent) {
    for (int64_t d = 0; d < first; ++d) out.push_back(self.sizes()[d]);
    out.insert(out.end(), bshape.begin(), bshape.end());
    for (int64_t d = last + 1; d < self.dim(); ++d) out.push_back(self.sizes()[d]);
  } else {
    out = bshape;
    for (int64_t d = 0; d < self.dim(); ++d)
      if (!indexed(d)) out.push_back(self.sizes()[d]);
  }
  detail::checked_numel(out, op);
  return out;
}

const OpDef& kIndex = register_op({
    .name = "index",
    .schema = "index.Tensor(Tensor self, Tensor?[] indices) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      auto sizes = index_result_sizes(x, c.inputs.subspan(1), "index");
      return {TensorMeta{std::move(sizes), {}, x.dtype(), x.device()}};
    },
    .derivative = {.formula = "self: index_put(zeros(self.sizes()), indices, grad, accumulate=True)",
                   .save_inputs = index_slots(1),
                   .fn = [](const BackwardContext& c) -> TensorList {
                     KILN_CHECK(c.inputs.size() <= 1 + kMaxIndexTensors, Error,
                                "[kiln::index] the derivative supports at most " + std::to_string(kMaxIndexTensors) +
                                    " index tensors.");
                     std::vector<Tensor> inputs{zeros(c.input_info[0].sizes, options_of(c.grad())), c.grad()};
                     for (size_t i = 1; i < c.inputs.size(); ++i) inputs.push_back(c.input(i));
                     return {call_op1(index_put_op(), std::move(inputs), {true})};
                   }},
    .lowering = lowering::Extern{},
});

// Inputs: self, values, then the indices (one per leading dim of self, undefined = all of it).
// values comes before the variable-length indices (aten puts it after them) so that the
// derivative can save the indices by position without keeping values alive.
const OpDef& kIndexPut = register_op({
    .name = "index_put",
    .schema = "index_put(Tensor self, Tensor values, Tensor?[] indices, bool accumulate=False) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      KILN_CHECK(c.inputs.size() >= 2, ValueError, "[kiln::index_put] expected self, values and indices.");
      const Tensor& values = c.input(1);
      KILN_CHECK(values.defined(), ValueError, "[kiln::index_put] values is undefined.");
      auto indices = c.inputs.subspan(2);
      auto sizes = index_result_sizes(x, indices, "index_put");
      KILN_CHECK(values.dtype() == x.dtype(), DTypeError,
                 "[kiln::index_put] Index put requires the source and destination dtypes match, got " +
                     name_of(x.dtype()) + " for the destination and " + name_of(values.dtype()) +
                     " for the source. Convert the values with .to(...).");
      check_device(x, values, "index_put", "values");
      bool ok = values.dim() <= static_cast<int64_t>(sizes.size());
      for (int64_t i = 0; ok && i < values.dim(); ++i) {
        int64_t v = values.sizes()[values.dim() - 1 - i];
        int64_t r = sizes[sizes.size() - 1 - i];
        if (v != 1 && v != r) ok = false;
      }
      KILN_CHECK(ok, ShapeError,
                 "[kiln::index_put] shape mismatch: value tensor of shape " + list_str(values.sizes()) +
                     " cannot be broadcast to indexing result of shape " + list_str(sizes) + ".");
      return {TensorMeta{x.sizes().vec(), {}, x.dtype(), x.device()}};
    },
    .derivative = {.formula = "self: accumulate ? grad : grad.index_put(indices, 0, false); "
                              "values: grad.index(indices) (summed to values' shape)",
                   .save_inputs = index_slots(2),
                   .fn = [](const BackwardContext& c) -> TensorList {
                     KILN_CHECK(c.inputs.size() <= 2 + kMaxIndexTensors, Error,
                                "[kiln::index_put] the derivative supports at most " + std::to_string(kMaxIndexTensors) +
                                    " index tensors.");
                     TensorList out(c.input_info.size());
                     std::vector<Tensor> indices(c.inputs.begin() + 2, c.inputs.end());
                     if (c.needs_grad(0)) {
                       if (c.bool_attr(0)) {
                         out[0] = c.grad();
                       } else {
                         std::vector<Tensor> inputs{c.grad(), zeros({}, options_of(c.grad()))};
                         inputs.insert(inputs.end(), indices.begin(), indices.end());
                         out[0] = call_op1(index_put_op(), std::move(inputs), {false});
                       }
                     }
                     if (c.needs_grad(1)) {
                       std::vector<Tensor> inputs{c.grad()};
                       inputs.insert(inputs.end(), indices.begin(), indices.end());
                       out[1] = call_op1(index_op(), std::move(inputs));  // the engine sums it to values' shape
                     }
                     return out;
                   }},
    .lowering = lowering::Extern{},
});

// ---------------- embedding / one_hot ----------------

const OpDef& kEmbedding = register_op({
    .name = "embedding",
    .schema = "embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1, bool scale_grad_by_freq=False, "
              "bool sparse=False) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& weight = c.input(0);
      const Tensor& indices = c.input(1);
      KILN_CHECK(weight.dim() == 2, ShapeError,
                 "[kiln::embedding] 'weight' must be 2-D, got shape " + shape_str(weight.sizes()) + ".");
      KILN_CHECK(indices.dtype() == kInt64 || indices.dtype() == kInt32, DTypeError,
                 "[kiln::embedding] Expected tensor for argument #1 'indices' to have one of the following "
                 "scalar types: Long, Int; but got " + name_of(indices.dtype()) + " instead.");
      check_device(weight, indices, "embedding", "indices");
      std::vector<int64_t> sizes = indices.sizes().vec();
      sizes.push_back(weight.sizes()[1]);
      return {TensorMeta{std::move(sizes), {}, weight.dtype(), weight.device()}};
    },
    .derivative = {.formula = "weight: embedding_dense_backward(grad, indices, weight.size(0), padding_idx, "
                              "scale_grad_by_freq)",
                   .save_inputs = {1},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     KILN_CHECK(!c.bool_attr(2), Error,
                                "[kiln::embedding] sparse gradients are not supported; use sparse=False.");
                     return {call_op1(embedding_backward_op(), {c.grad(), c.input(1)},
                                      {c.input_info[0].sizes[0], c.int_attr(0), c.bool_attr(1)})};
                   }},
    .lowering = lowering::Extern{},
});

// The gradient of embedding's weight: grad_output rows summed into the rows their indices name
// (divided by each index's count with scale_grad_by_freq); the padding_idx row (-1: none) gets
// no gradient.
const OpDef& kEmbeddingBackward = register_op({
    .name = "embedding_dense_backward",
    .schema = "embedding_dense_backward(Tensor grad_output, Tensor indices, SymInt num_weights, SymInt padding_idx, "
              "bool scale_grad_by_freq) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& grad = c.input(0);
      const Tensor& indices = c.input(1);
      const int64_t rows = c.int_attr(0);
      KILN_CHECK(is_floating_point(grad.dtype()), DTypeError,
                 "[kiln::embedding_dense_backward] expected a floating-point grad_output, got " +
                     name_of(grad.dtype()) + ".");
      KILN_CHECK(indices.dtype() == kInt64 || indices.dtype() == kInt32, DTypeError,
                 "[kiln::embedding_dense_backward] expected indices of dtype int64 or int32, got " +
                     name_of(indices.dtype()) + ".");
      check_device(grad, indices, "embedding_dense_backward", "indices");
      KILN_CHECK(rows >= 0, ValueError,
                 "[kiln::embedding_dense_backward] num_weights must be non-negative, got " + std::to_string(rows) + ".");
      bool ok = grad.dim() == indices.dim() + 1;
      for (int64_t d = 0; ok && d < indices.dim(); ++d) ok = grad.sizes()[d] == indices.sizes()[d];
      KILN_CHECK(ok, ShapeError,
                 "[kiln::embedding_dense_backward] grad_output of shape " + list_str(grad.sizes()) +
                     " does not match indices of shape " + list_str(indices.sizes()) +
                     " (expected the indices' shape plus the embedding dim).");
      return {TensorMeta{{rows, grad.sizes().back()}, {}, grad.dtype(), grad.device()}};
    },
    .derivative = {.formula = "grad_output: embedding(grad, indices) with padding_idx positions zeroed "
                              "(divided by the index counts with scale_grad_by_freq)",
                   .save_inputs = {1},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     const Tensor& indices = c.input(1);
                     Tensor g = call_op1(embedding_op(), {c.grad(), indices}, {int64_t{-1}, false, false});
                     const int64_t pad = c.int_attr(1);
                     if (pad >= 0) g = where(eq(indices, pad).unsqueeze(-1), zeros({}, options_of(g)), g);
                     if (c.bool_attr(2)) {
                       std::vector<int64_t> one_col = indices.sizes().vec();
                       one_col.push_back(1);
                       Tensor counts = call_op1(embedding_backward_op(), {ones(one_col, options_of(g)), indices},
                                                {c.int_attr(0), int64_t{-1}, false});
                       g = g / call_op1(embedding_op(), {counts, indices}, {int64_t{-1}, false, false});
                     }
                     return {g};
                   }},
    .lowering = lowering::Extern{},
});

const OpDef& kOneHot = register_op({
    .name = "one_hot",
    .schema = "one_hot(Tensor self, int num_classes=-1) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& x = c.input(0);
      KILN_CHECK(x.dtype() == kInt64, DTypeError,
                 "[kiln::one_hot] one_hot is only applicable to index tensor of type LongTensor (int64), got " +
                     name_of(x.dtype()) + ".");
      int64_t n = c.int_attr(0);
      KILN_CHECK(n >= 0, ValueError,
                 "[kiln::one_hot] num_classes must be non-negative, got " + std::to_string(n) + ".");
      std::vector<int64_t> sizes = x.sizes().vec();
      sizes.push_back(n);
      detail::checked_numel(sizes, "one_hot");
      return {TensorMeta{std::move(sizes), {}, kInt64, x.device()}};
    },
    .lowering = lowering::Extern{},
});

const OpDef& gather_op() { return kGather; }
const OpDef& scatter_value_op() { return kScatterValue; }
const OpDef& scatter_add_op() { return kScatterAdd; }
const OpDef& index_op() { return kIndex; }
const OpDef& index_put_op() { return kIndexPut; }
const OpDef& embedding_op() { return kEmbedding; }
const OpDef& embedding_backward_op() { return kEmbeddingBackward; }

bool is_mask(const Tensor& t) { return t.defined() && (t.dtype() == kBool || t.dtype() == kUInt8); }

// The nonzero positions of a bool/uint8 mask (a host read): one int64 tensor per mask dim, or
// one of flat positions when `linear`.
std::vector<Tensor> mask_to_indices(const Tensor& mask, bool linear) {
  std::vector<Tensor> out = cpu::nonzero_indices(mask.to(kCPU), linear);
  if (!mask.is_cpu())
    for (Tensor& t : out) t = t.to(mask.device());
  return out;
}

// Checks that a k-dim mask matches self's dims [start, start + k).
void check_mask(const Tensor& self, const Tensor& mask, int64_t start) {
  KILN_CHECK(mask.dim() > 0, IndexError,
             "[kiln::index] a 0-dim bool index is only meaningful in an index expression; use "
             "x.index({..., mask}) (it adds a dim of size 1 or 0).");
  KILN_CHECK(start + mask.dim() <= self.dim(), IndexError,
             "[kiln::index] too many indices for tensor of dimension " + std::to_string(self.dim()) +
                 " (the mask of shape " + shape_str(mask.sizes()) + " starts at dimension " +
                 std::to_string(start) + ").");
  for (int64_t j = 0; j < mask.dim(); ++j) {
    KILN_CHECK(mask.sizes()[j] == self.sizes()[start + j], IndexError,
               "[kiln::index] The shape of the mask " + list_str(mask.sizes()) + " at index " + std::to_string(j) +
                   " does not match the shape of the indexed tensor " + list_str(self.sizes()) + " at index " +
                   std::to_string(start + j) + ".");
  }
}

// The one mask among the indices and its slot, when it is the only defined index.
std::optional<size_t> sole_mask(const std::vector<Tensor>& indices) {
  std::optional<size_t> slot;
  for (size_t i = 0; i < indices.size(); ++i) {
    if (!indices[i].defined()) continue;
    if (slot || !is_mask(indices[i])) return std::nullopt;
    slot = i;
  }
  return slot;
}

// What the index ops receive: self (possibly a view) and int64/int32 indices per dim.
struct PreparedIndex {
  Tensor self;
  std::vector<Tensor> indices;
  bool merged = false;  // self is a view with the mask's dims merged into one
};

PreparedIndex prepare_index(const Tensor& self, const std::vector<Tensor>& indices) {
  // A sole mask over dims that can be viewed as one takes a single linear index: one gather
  // instead of one coordinate tensor per mask dim.
  if (auto slot = sole_mask(indices)) {
    const Tensor& mask = indices[*slot];
    int64_t start = static_cast<int64_t>(*slot);
    check_mask(self, mask, start);
    std::vector<int64_t> merged(self.sizes().begin(), self.sizes().begin() + start);
    merged.push_back(mask.numel());
    merged.insert(merged.end(), self.sizes().begin() + start + mask.dim(), self.sizes().end());
    if (detail::compute_view_strides(self.sizes(), self.strides(), merged)) {
      std::vector<Tensor> idx(static_cast<size_t>(start));
      idx.push_back(mask_to_indices(mask, true)[0]);
      return {view(self, merged), std::move(idx), true};
    }
  }
  return {self, detail::expand_index_masks(self, indices), false};
}

// PyTorch's canDispatchToMaskedFill: self[mask] = one value is masked_fill. Returns the mask
// shaped to broadcast against self, or an undefined tensor.
Tensor masked_fill_mask(const Tensor& self, const std::vector<Tensor>& indices, const Tensor& values) {
  if (values.numel() != 1 || !values.is_cpu()) return Tensor();
  auto slot = sole_mask(indices);
  if (!slot || indices[*slot].device() != self.device()) return Tensor();
  const Tensor& mask = indices[*slot];
  int64_t start = static_cast<int64_t>(*slot);
  check_mask(self, mask, start);
  std::vector<int64_t> shape = mask.sizes().vec();
  shape.resize(static_cast<size_t>(self.dim() - start), 1);
  Tensor m = mask.dtype() == kBool ? mask : mask.to(kBool);
  return m.reshape(shape);
}

}  // namespace

namespace detail {

// PyTorch's expandTensors: a k-dim bool/uint8 mask in the list stands for k consecutive dims and
// becomes k int64 index tensors (its nonzero positions). Other entries stand for one dim each.
std::vector<Tensor> expand_index_masks(const Tensor& self, const std::vector<Tensor>& indices) {
  std::vector<Tensor> out;
  out.reserve(indices.size());
  for (const Tensor& idx : indices) {
    if (!idx.defined() || (idx.dtype() != kBool && idx.dtype() != kUInt8)) {
      out.push_back(idx);
      continue;
    }
    check_mask(self, idx, static_cast<int64_t>(out.size()));
    for (Tensor& t : mask_to_indices(idx, false)) out.push_back(std::move(t));
  }
  return out;
}

// self[indices] = values (or += with accumulate), in place through call_op_out.
Tensor& index_put_inplace(Tensor& self, const std::vector<Tensor>& indices, const Tensor& values, bool accumulate) {
  // Recorded for autograd: write into self itself (not a view of it with merged dims, whose new
  // history would not reach self), and keep values' gradient (masked_fill takes a number).
  const bool recorded = is_grad_enabled() && (self.requires_grad() || values.requires_grad());
  if (!accumulate && !(values.requires_grad() && is_grad_enabled())) {
    if (Tensor mask = masked_fill_mask(self, indices, values); mask.defined()) return self.masked_fill_(mask, values.item());
  }
  PreparedIndex p = recorded ? PreparedIndex{self, detail::expand_index_masks(self, indices), false}
                             : prepare_index(self, indices);
  std::vector<Tensor> inputs{p.self, values};
  for (Tensor& t : p.indices) inputs.push_back(std::move(t));
  Tensor out[1] = {p.self};  // self, or a view of it with merged dims
  call_op_out(kIndexPut, std::move(inputs), {accumulate}, out);
  return self;
}

}  // namespace detail

// ---------------- front-ends ----------------

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  return call_op1(kIndexSelect, {x, index}, {dim});
}
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) { return call_op1(kGather, {x, index}, {dim}); }
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  return call_op1(kScatter, {x, index, src}, {dim});
}
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, Scalar value) {
  return call_op1(kScatterValue, {x, index}, {dim, value});
}
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  return call_op1(kScatterAdd, {x, index, src}, {dim});
}

Tensor index(const Tensor& x, const std::vector<Tensor>& indices) {
  PreparedIndex p = prepare_index(x, indices);
  std::vector<Tensor> inputs{p.self};
  for (Tensor& t : p.indices) inputs.push_back(std::move(t));
  return call_op1(kIndex, std::move(inputs));
}

Tensor index_put(const Tensor& x, const std::vector<Tensor>& indices, const Tensor& values, bool accumulate) {
  // masked_fill takes a number: not when values needs a gradient.
  if (!accumulate && !(values.requires_grad() && is_grad_enabled())) {
    if (Tensor mask = masked_fill_mask(x, indices, values); mask.defined()) return masked_fill(x, mask, values.item());
  }
  PreparedIndex p = prepare_index(x, indices);
  std::vector<Tensor> inputs{p.self, values};
  for (Tensor& t : p.indices) inputs.push_back(std::move(t));
  Tensor out = call_op1(kIndexPut, std::move(inputs), {accumulate});
  return p.merged ? out.view(x.sizes()) : out;
}

Tensor embedding(const Tensor& weight, const Tensor& indices, std::optional<int64_t> padding_idx) {
  int64_t pad = -1;
  if (padding_idx) {
    int64_t n = weight.dim() > 0 ? weight.sizes()[0] : 0;
    KILN_CHECK(*padding_idx < n && *padding_idx >= -n, IndexError,
               "[kiln::embedding] Padding_idx must be within num_embeddings (got " + std::to_string(*padding_idx) +
                   " for " + std::to_string(n) + " embeddings).");
    pad = *padding_idx < 0 ? *padding_idx + n : *padding_idx;
  }
  // padding_idx only changes the gradient (the padding row gets none); the forward is a lookup.
  return call_op1(kEmbedding, {weight, indices}, {pad, false, false});
}

Tensor one_hot(const Tensor& indices, int64_t num_classes) {
  KILN_CHECK(indices.dtype() == kInt64, DTypeError,
             "[kiln::one_hot] one_hot is only applicable to index tensor of type LongTensor (int64), got " +
                 name_of(indices.dtype()) + ".");
  if (indices.numel() == 0) {
    KILN_CHECK(num_classes > 0, ValueError,
               "[kiln::one_hot] Can not infer total number of classes from empty tensor. Pass num_classes.");
  } else if (num_classes == -1) {
    // Inferring the class count reads the values (a host read, as in PyTorch).
    Tensor c = indices.to(kCPU).contiguous();
    const int64_t* p = c.data_ptr<int64_t>();
    int64_t mx = p[0];
    for (int64_t i = 1; i < c.numel(); ++i) mx = std::max(mx, p[i]);
    KILN_CHECK(mx >= 0, IndexError, "[kiln::one_hot] Class values must be non-negative.");
    num_classes = mx + 1;
  } else {
    KILN_CHECK(num_classes >= 0, IndexError, "[kiln::one_hot] Class values must be smaller than num_classes.");
  }
  return call_op1(kOneHot, {indices}, {num_classes});
}

// ---------------- Tensor methods ----------------

Tensor Tensor::index_select(int64_t dim, const Tensor& index) const { return kiln::index_select(*this, dim, index); }
Tensor Tensor::gather(int64_t dim, const Tensor& index) const { return kiln::gather(*this, dim, index); }

Tensor& Tensor::scatter_(int64_t dim, const Tensor& index, const Tensor& src) {
  Tensor out[1] = {*this};
  call_op_out(kScatter, {*this, index, src}, {dim}, out);
  return *this;
}
Tensor& Tensor::scatter_(int64_t dim, const Tensor& index, Scalar value) {
  Tensor out[1] = {*this};
  call_op_out(kScatterValue, {*this, index}, {dim, value}, out);
  return *this;
}
Tensor& Tensor::scatter_add_(int64_t dim, const Tensor& index, const Tensor& src) {
  Tensor out[1] = {*this};
  call_op_out(kScatterAdd, {*this, index, src}, {dim}, out);
  return *this;
}

}  // namespace kiln
