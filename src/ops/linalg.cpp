// Linear algebra. Table ops with kernels: mm, bmm, addmm, dot (GEMM through BLAS/oneDNN), and
// addmm_relu, the kiln backend's GEMM with a fused relu epilogue.
// matmul, linear and outer are composite front-ends over them and view ops, as in aten, so the
// compiler sees only the four GEMM-shaped primitives.
//
// Derivatives are PyTorch's, written with mm/bmm and transposes (so they double-backward for
// free). As in aten's mm_mat1_backward/mm_mat2_backward, the gradient of a column-major operand
// (a transposed view, e.g. linear's weight.t()) is computed as the transpose of a row-major
// product, so that it comes out with its operand's layout and needs no copy after the transpose.
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "ops/meta_checks.h"
#include "kiln/ops.h"

namespace kiln {

namespace {

std::string dtype_str(DType t) { return std::string(dtype_name(t)); }

using detail::check_same_device;

// Same dtype for both GEMM operands (PyTorch does not promote in mm), and not bool.
void check_gemm_dtypes(const std::string& op, const Tensor& a, const Tensor& b) {
  KILN_CHECK(a.dtype() == b.dtype(), DTypeError,
             "[kiln::" + op + "] expected m1 and m2 to have the same dtype, but got: " +
                 dtype_str(a.dtype()) + " != " + dtype_str(b.dtype()) + ". Convert one with .to(...).");
  KILN_CHECK(a.dtype() != DType::bool_, DTypeError,
             "[kiln::" + op + "] not implemented for dtype bool. Convert the operands with .to(...).");
}

[[noreturn]] void throw_inner_mismatch(const std::string& op, IntArrayRef a, IntArrayRef b) {
  throw ShapeError("[kiln::" + op + "] shapes " + shape_str(a) + " and " + shape_str(b) +
                   " cannot be multiplied. Inner sizes must match.");
}

void check_matrix(const std::string& op, const Tensor& t, const char* what) {
  KILN_CHECK(t.dim() == 2, ShapeError,
             "[kiln::" + op + "] " + what + " must be a matrix (2-D), but got a " +
                 std::to_string(t.dim()) + "-D tensor of shape " + shape_str(t.sizes()) + ".");
}

// A matrix stored column-major (the transpose of a contiguous one), as aten tests it.
bool is_column_major(const Tensor& t) {
  return t.dim() == 2 && t.strides()[0] == 1 && t.strides()[1] == t.sizes()[0] && t.sizes()[1] > 1;
}

bool is_one(const Scalar& s) { return s.to_double() == 1.0; }

// grad * s, skipping the multiply for s == 1 (aten's maybe_multiply).
Tensor maybe_multiply(const Tensor& grad, const Scalar& s) { return is_one(s) ? grad : mul(grad, s); }

// d(mat1 @ mat2)/d(mat1) applied to grad: grad @ mat2^T, laid out like mat1.
Tensor mm_mat1_backward(const Tensor& grad, const Tensor& mat2, const Tensor& mat1, const Scalar& alpha) {
  if (mat1.defined() && is_column_major(mat1)) return maybe_multiply(mm(mat2, grad.t()).t(), alpha);
  return maybe_multiply(mm(grad, mat2.t()), alpha);
}

// d(mat1 @ mat2)/d(mat2) applied to grad: mat1^T @ grad, laid out like mat2.
Tensor mm_mat2_backward(const Tensor& grad, const Tensor& mat1, const Tensor& mat2, const Scalar& alpha) {
  if (mat2.defined() && is_column_major(mat2)) return maybe_multiply(mm(grad.t(), mat1).t(), alpha);
  return maybe_multiply(mm(mat1.t(), grad), alpha);
}

const OpDef& kMm = register_op({
    .name = "mm",
    .schema = "mm(Tensor self, Tensor mat2) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& a = c.input(0);
      const Tensor& b = c.input(1);
      check_matrix("mm", a, "self");
      check_matrix("mm", b, "mat2");
      check_same_device("mm", {&a, &b});
      check_gemm_dtypes("mm", a, b);
      if (a.sizes()[1] != b.sizes()[0]) throw_inner_mismatch("mm", a.sizes(), b.sizes());
      return {TensorMeta{{a.sizes()[0], b.sizes()[1]}, {}, a.dtype(), a.device()}};
    },
    .derivative = {.formula = "self: grad.mm(mat2.t()); mat2: self.t().mm(grad)",
                   .save_inputs = {0, 1},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     TensorList g(2);
                     if (c.needs_grad(0)) g[0] = mm_mat1_backward(c.grad(), c.input(1), c.input(0), 1);
                     if (c.needs_grad(1)) g[1] = mm_mat2_backward(c.grad(), c.input(0), c.input(1), 1);
                     return g;
                   }},
    .lowering = lowering::Extern{},
});

const OpDef& kBmm = register_op({
    .name = "bmm",
    .schema = "bmm(Tensor self, Tensor mat2) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& a = c.input(0);
      const Tensor& b = c.input(1);
      KILN_CHECK(a.dim() == 3 && b.dim() == 3, ShapeError,
                 "[kiln::bmm] batch1 and batch2 must be 3-D tensors, but got shapes " +
                     shape_str(a.sizes()) + " and " + shape_str(b.sizes()) + ".");
      check_same_device("bmm", {&a, &b});
      check_gemm_dtypes("bmm", a, b);
      KILN_CHECK(a.sizes()[0] == b.sizes()[0], ShapeError,
                 "[kiln::bmm] batch sizes must match, but got shapes " + shape_str(a.sizes()) + " and " +
                     shape_str(b.sizes()) + ". Expand or reshape one of them.");
      if (a.sizes()[2] != b.sizes()[1]) throw_inner_mismatch("bmm", a.sizes(), b.sizes());
      return {TensorMeta{{a.sizes()[0], a.sizes()[1], b.sizes()[2]}, {}, a.dtype(), a.device()}};
    },
    .derivative = {.formula = "self: grad.bmm(mat2.transpose(1, 2)); mat2: self.transpose(1, 2).bmm(grad)",
                   .save_inputs = {0, 1},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     TensorList g(2);
                     if (c.needs_grad(0)) g[0] = bmm(c.grad(), c.input(1).transpose(1, 2));
                     if (c.needs_grad(1)) g[1] = bmm(c.input(0).transpose(1, 2), c.grad());
                     return g;
                   }},
    .lowering = lowering::Extern{},
});

// addmm(self, mat1, mat2, beta, alpha) = beta * self + alpha * (mat1 @ mat2); self broadcasts
// to the product's shape and is ignored (NaN included) when beta is 0. `op` names the caller in
// messages (addmm_relu shares the checks).
std::vector<TensorMeta> addmm_meta(const OpCall& c, const std::string& op) {
  const Tensor& self = c.input(0);
  const Tensor& a = c.input(1);
  const Tensor& b = c.input(2);
  check_matrix(op, a, "mat1");
  check_matrix(op, b, "mat2");
  check_same_device(op, {&self, &a, &b});
  check_gemm_dtypes(op, a, b);
  KILN_CHECK(self.dtype() == a.dtype(), DTypeError,
             "[kiln::" + op + "] self and mat1 must have the same dtype, but got " + dtype_str(self.dtype()) +
                 " and " + dtype_str(a.dtype()) + ". Convert one with .to(...).");
  if (a.sizes()[1] != b.sizes()[0]) throw_inner_mismatch(op, a.sizes(), b.sizes());
  std::vector<int64_t> sizes{a.sizes()[0], b.sizes()[1]};
  KILN_CHECK(self.dim() <= 2 && detail::broadcast_sizes(self.sizes(), sizes, op) == sizes, ShapeError,
             "[kiln::" + op + "] self of shape " + shape_str(self.sizes()) +
                 " cannot be broadcast to the product's shape " + shape_str(sizes) + ".");
  return {TensorMeta{std::move(sizes), {}, a.dtype(), a.device()}};
}

// addmm's gradients for the gradient `grad` of its result (attrs 0, 1: beta, alpha).
TensorList addmm_backward(const BackwardContext& c, const Tensor& grad) {
  const Scalar& beta = c.scalar_attr(0);
  const Scalar& alpha = c.scalar_attr(1);
  TensorList g(3);
  if (c.needs_grad(0)) g[0] = maybe_multiply(grad, beta);  // summed to self's shape
  if (c.needs_grad(1)) g[1] = mm_mat1_backward(grad, c.input(2), c.input(1), alpha);
  if (c.needs_grad(2)) g[2] = mm_mat2_backward(grad, c.input(1), c.input(2), alpha);
  return g;
}

const OpDef& kAddmm = register_op({
    .name = "addmm",
    .schema = "addmm(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1, Scalar alpha=1) -> Tensor",
    .meta = [](const OpCall& c) { return addmm_meta(c, "addmm"); },
    .derivative = {.formula = "self: maybe_multiply(grad, beta); mat1: mm_mat1_backward(grad, mat2, alpha); "
                              "mat2: mm_mat2_backward(grad, mat1, alpha)",
                   .save_inputs = {1, 2},
                   .fn = [](const BackwardContext& c) { return addmm_backward(c, c.grad()); }},
    .lowering = lowering::Extern{},
});

// addmm_relu: relu(addmm(...)) in one call, the relu applied in place to the fresh result while
// it is hot in cache. Made by the kiln backend's epilogue fusion (passes/fuse_gemm_epilogue.cpp);
// the derivative lets eager autograd run it too.
const OpDef& kAddmmRelu = register_op({
    .name = "addmm_relu",
    .schema = "addmm_relu(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1, Scalar alpha=1) -> Tensor",
    .meta = [](const OpCall& c) { return addmm_meta(c, "addmm_relu"); },
    .derivative = {.formula = "self: maybe_multiply(g, beta); mat1: mm_mat1_backward(g, mat2, alpha); "
                              "mat2: mm_mat2_backward(g, mat1, alpha), g = threshold_backward(grad, result, 0)",
                   .save_inputs = {1, 2},
                   .save_outputs = {0},
                   .fn = [](const BackwardContext& c) {
                     return addmm_backward(c, where(le(c.output(0), 0), 0, c.grad()));
                   }},
    .lowering = lowering::Extern{},
});

const OpDef& kDot = register_op({
    .name = "dot",
    .schema = "dot(Tensor self, Tensor tensor) -> Tensor",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const Tensor& a = c.input(0);
      const Tensor& b = c.input(1);
      KILN_CHECK(a.dim() == 1 && b.dim() == 1, ShapeError,
                 "[kiln::dot] 1D tensors expected, but got " + std::to_string(a.dim()) + "D and " +
                     std::to_string(b.dim()) + "D tensors.");
      check_same_device("dot", {&a, &b});
      KILN_CHECK(a.dtype() == b.dtype(), DTypeError,
                 "[kiln::dot] expected both vectors to have same dtype, but found " + dtype_str(a.dtype()) +
                     " and " + dtype_str(b.dtype()) + ". Convert one with .to(...).");
      KILN_CHECK(a.dtype() != DType::bool_, DTypeError,
                 "[kiln::dot] not implemented for dtype bool. Convert the operands with .to(...).");
      KILN_CHECK(a.numel() == b.numel(), ShapeError,
                 "[kiln::dot] inconsistent tensor size, expected tensor " + shape_str(a.sizes()) +
                     " and src " + shape_str(b.sizes()) +
                     " to have the same number of elements, but got " + std::to_string(a.numel()) +
                     " and " + std::to_string(b.numel()) + " elements respectively.");
      return {TensorMeta{{}, {}, a.dtype(), a.device()}};
    },
    .derivative = {.formula = "self: grad * tensor; tensor: grad * self",
                   .save_inputs = {0, 1},
                   .fn = [](const BackwardContext& c) -> TensorList {
                     TensorList g(2);
                     if (c.needs_grad(0)) g[0] = mul(c.grad(), c.input(1));
                     if (c.needs_grad(1)) g[1] = mul(c.grad(), c.input(0));
                     return g;
                   }},
    .lowering = lowering::Extern{},
});

int64_t product(IntArrayRef sizes, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= sizes[i];
  return p;
}

std::vector<int64_t> concat(IntArrayRef a, std::initializer_list<int64_t> b) {
  std::vector<int64_t> out = a.vec();
  out.insert(out.end(), b);
  return out;
}

}  // namespace

// ---------------- front-ends ----------------

Tensor mm(const Tensor& a, const Tensor& b) { return call_op1(kMm, {a, b}); }
Tensor bmm(const Tensor& a, const Tensor& b) { return call_op1(kBmm, {a, b}); }
Tensor addmm(const Tensor& self, const Tensor& m1, const Tensor& m2, Scalar beta, Scalar alpha) {
  return call_op1(kAddmm, {self, m1, m2}, {beta, alpha});
}
Tensor dot(const Tensor& a, const Tensor& b) { return call_op1(kDot, {a, b}); }

// PyTorch's matmul: dot, mm, matrix-vector via mm on an unsqueezed operand, N-D @ (1-D|2-D)
// folded into one mm, and everything else as bmm over the broadcast batch dims.
Tensor matmul(const Tensor& a, const Tensor& b) {
  const int64_t da = a.dim(), db = b.dim();
  KILN_CHECK(da > 0 && db > 0, ShapeError,
             "[kiln::matmul] both arguments to matmul need to be at least 1D, but they are " +
                 std::to_string(da) + "D and " + std::to_string(db) + "D.");
  check_same_device("matmul", {&a, &b});
  check_gemm_dtypes("matmul", a, b);
  const int64_t k = a.sizes()[da - 1];
  if (k != b.sizes()[db == 1 ? 0 : db - 2]) throw_inner_mismatch("matmul", a.sizes(), b.sizes());

  if (da == 1 && db == 1) return dot(a, b);
  if (da == 2 && db == 1) return mm(a, b.unsqueeze(1)).squeeze(1);
  if (da == 1 && db == 2) return mm(a.unsqueeze(0), b).squeeze(0);
  if (da == 2 && db == 2) return mm(a, b);
  if (da >= 3 && db <= 2) {
    // Fold a's batch dims into rows: one large GEMM instead of many small ones.
    std::vector<int64_t> lead(a.sizes().begin(), a.sizes().end() - 1);
    int64_t rows = product(a.sizes(), 0, da - 1);
    Tensor out = mm(a.reshape({rows, k}), db == 1 ? b.unsqueeze(1) : b);
    if (db == 2) lead.push_back(b.sizes()[1]);
    return out.view(lead);
  }
  const int64_t n = da >= 2 ? a.sizes()[da - 2] : 1;
  const int64_t p = db >= 2 ? b.sizes()[db - 1] : 1;
  IntArrayRef batch_a = da > 2 ? IntArrayRef(a.sizes().data(), da - 2) : IntArrayRef();
  IntArrayRef batch_b = db > 2 ? IntArrayRef(b.sizes().data(), db - 2) : IntArrayRef();
  std::vector<int64_t> batch = detail::broadcast_sizes(batch_a, batch_b, "matmul");
  int64_t nbatch = product(batch, 0, batch.size());
  Tensor a3 = (da == 1 ? a.unsqueeze(0) : a).expand(concat(batch, {n, k})).reshape({nbatch, n, k});
  Tensor b3 = (db == 1 ? b.unsqueeze(1) : b).expand(concat(batch, {k, p})).reshape({nbatch, k, p});
  Tensor out = bmm(a3, b3);
  std::vector<int64_t> sizes = batch;
  if (da >= 2) sizes.push_back(n);
  if (db >= 2) sizes.push_back(p);
  return out.view(sizes);
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  KILN_CHECK(x.dim() >= 1, ShapeError, "[kiln::linear] the input must have at least 1 dim, got a 0-dim tensor.");
  KILN_CHECK(weight.dim() == 2, ShapeError,
             "[kiln::linear] weight must be 2-D (out_features, in_features), but got shape " +
                 shape_str(weight.sizes()) + ".");
  check_same_device("linear", {&x, &weight, &bias});
  check_gemm_dtypes("linear", x, weight);
  if (x.sizes().back() != weight.sizes()[1])
    throw_inner_mismatch("linear", x.sizes(), {weight.sizes()[1], weight.sizes()[0]});
  const int64_t in = weight.sizes()[1], out_features = weight.sizes()[0];
  if (x.dim() == 2) return bias.defined() ? addmm(bias, x, weight.t()) : mm(x, weight.t());
  if (x.dim() == 1) return linear(x.unsqueeze(0), weight, bias).squeeze(0);
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end() - 1);
  Tensor y = linear(x.reshape({product(x.sizes(), 0, x.dim() - 1), in}), weight, bias);
  sizes.push_back(out_features);
  return y.view(sizes);
}

Tensor outer(const Tensor& a, const Tensor& b) {
  KILN_CHECK(a.dim() == 1 && b.dim() == 1, ShapeError,
             "[kiln::outer] expected 1-D arguments, but got " + std::to_string(a.dim()) + "-D and " +
                 std::to_string(b.dim()) + "-D.");
  check_same_device("outer", {&a, &b});
  // outer is a broadcast multiply in PyTorch, so its operands promote.
  const Tensor operands[] = {a, b};
  DType t = detail::result_type(operands);
  if (t == DType::bool_) return outer(a.to(kInt32), b.to(kInt32)).to(kBool);
  return mm(a.to(t).unsqueeze(1), b.to(t).unsqueeze(0));
}

// ---------------- Tensor methods ----------------

Tensor Tensor::matmul(const Tensor& other) const { return kiln::matmul(*this, other); }
Tensor Tensor::mm(const Tensor& other) const { return kiln::mm(*this, other); }
Tensor Tensor::bmm(const Tensor& other) const { return kiln::bmm(*this, other); }
Tensor Tensor::dot(const Tensor& other) const { return kiln::dot(*this, other); }

}  // namespace kiln
