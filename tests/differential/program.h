// The differential test's programs: a small IR (a list of ops over a value table) that the
// generator builds from a seed, the interpreter runs eagerly and under compile(), the shrinker
// cuts down, and the printer writes out as plain Kiln C++.
//
// Values are numbered in order: the inputs first, then the results of each op (one per op, two
// for var_mean). An in-place op's result is its target (the same tensor, written), so later uses
// of either id see the write, as in eager code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kiln/kiln.h"

namespace kiln::differential {

// How an input tensor lies over its storage.
enum class Layout : uint8_t {
  contiguous,
  permuted,  // a permuted contiguous base; layout_dims is the permutation
  strided,   // every other element of a base, from offset 1, along each of layout_dims
  expanded,  // a base of size 1 along layout_dims, expanded to sizes (stride 0)
};

// Where an input's values lie: [-2, 2], or [0.5, 2] for running variances.
enum class Domain : uint8_t { symmetric, positive };

struct InputSpec {
  uint64_t data_seed = 0;  // the data is drawn after manual_seed(data_seed)
  std::vector<int64_t> sizes;
  DType dtype = kFloat32;
  Layout layout = Layout::contiguous;
  std::vector<int64_t> layout_dims;
  Domain domain = Domain::symmetric;
  bool requires_grad = false;
};

// A host number passed to an op. Integral ones are passed and printed as integers (`pow(x, 2)`,
// `x + 3`): they keep int64 tensors int64, where a float would promote them.
struct HostScalar {
  double value = 0;
  bool integral = false;
  Scalar scalar() const;
  std::string str() const;  // "3", "2.5", "-1.0"
};

// The ops. Arguments (value ids; -1 where an optional tensor is absent), `ints` and `scalars`
// per kind; log, sqrt, rsqrt, reciprocal, div and non-integral powers take their operand through
// abs(.) + c first, so every value stays in the op's domain (see ops.cpp).
enum class OpKind : uint8_t {
  // unary pointwise: (x); gelu ints {tanh approximation}
  neg,
  abs,
  exp,
  log,
  sin,
  cos,
  tanh,
  sigmoid,
  relu,
  gelu,
  silu,
  sqrt,
  rsqrt,
  reciprocal,
  erf,
  // binary pointwise, broadcasting: (a, b); add/sub scalars {alpha}
  add,
  sub,
  mul,
  div,
  maximum,
  minimum,
  pow,
  eq,
  ne,
  lt,
  le,
  gt,
  ge,
  logical_and,
  logical_or,
  // with a host scalar: (x) scalars {s}
  add_scalar,
  sub_scalar,
  rsub_scalar,
  mul_scalar,
  div_scalar,
  pow_scalar,
  gt_scalar,
  lt_scalar,
  // (x) ints {has_min, has_max} scalars {min, max}
  clamp,
  // (x, min, max)
  clamp_tensor,
  // (condition, a, b); where_scalar (condition, a) scalars {b}
  where,
  where_scalar,
  // (start, end) scalars {weight}
  lerp,
  // (x, mask) scalars {value}
  masked_fill,
  // reductions: (x) ints {keepdim, dims...} (no dims: all); var, var_mean ints {keepdim,
  // correction, dims...}; softmax, log_softmax ints {dim}
  sum,
  mean,
  amax,
  amin,
  logsumexp,
  var,
  var_mean,
  softmax,
  log_softmax,
  // views and copies: (x) transpose {d0, d1}; permute {dims...}; reshape, view, expand {sizes...};
  // slice {dim, start, stop, step}; select {dim, index}; unsqueeze, squeeze {dim}; to_dtype {dtype}
  transpose,
  permute,
  reshape,
  view,
  slice,
  select,
  unsqueeze,
  squeeze,
  expand,
  contiguous,
  clone,
  to_dtype,
  // (tensors...) ints {dim}
  cat,
  // (a, b); linear (x, weight, bias or -1); conv2d (x, weight, bias or -1) ints {stride,
  // padding, groups}; batch_norm (x, running_mean, running_var, weight or -1, bias or -1) ints
  // {training} scalars {momentum, eps}
  matmul,
  linear,
  conv2d,
  batch_norm,
  // in place on args[0]: (target, other) add_, sub_ scalars {alpha}; mul_, div_, copy_,
  // maximum_; lerp_ scalars {weight}; masked_fill_ (target, mask) scalars {value}
  add_,
  sub_,
  mul_,
  div_,
  copy_,
  maximum_,
  lerp_,
  masked_fill_,
  // in place with host scalars: (target) add_scalar_, sub_scalar_, mul_scalar_, div_scalar_,
  // fill_, pow_ scalars {s}; clamp_ ints {has_min, has_max} scalars {min, max}
  add_scalar_,
  sub_scalar_,
  mul_scalar_,
  div_scalar_,
  fill_,
  pow_,
  clamp_,
  // in place, unary: (target)
  neg_,
  relu_,
  sigmoid_,
  tanh_,
  exp_,
  zero_,
};
inline constexpr int kNumOpKinds = static_cast<int>(OpKind::zero_) + 1;

struct Op {
  OpKind kind;
  std::vector<int> args;
  std::vector<int64_t> ints;
  std::vector<HostScalar> scalars;
};

// A returned value; the loss weighs it with random weights drawn after manual_seed(weight_seed).
struct Output {
  int value = 0;
  uint64_t weight_seed = 0;
};

// Every input and output carries its own seed, so merging programs (merge()) gives a program
// that computes exactly what its members compute, one graph for all of them.
struct Program {
  uint64_t seed = 0;  // the generator's seed
  std::vector<InputSpec> inputs;
  std::vector<Op> ops;
  std::vector<Output> outputs;
};

// The members' inputs, ops and outputs side by side (ids renumbered): one program to compile.
struct MergedProgram {
  Program program;
  std::vector<size_t> first_input, first_output;  // per member
};
MergedProgram merge(const std::vector<Program>& members);

// What the generator and the shrinker know about a value without running anything.
struct ValueType {
  std::vector<int64_t> sizes;
  DType dtype = kFloat32;
  bool requires_grad = false;
  int storage =
      -1;  // the value owning this one's memory (itself unless a view or written in place)
  bool overlapping = false;   // elements may share memory (expanded): in-place writes are refused
  bool contiguous = true;     // surely row-major, so view() applies
  bool view_of_grad = false;  // a view of a tensor that requires grad: Kiln refuses in-place writes
  bool grad_leaf = false;     // an input that requires grad (or a view of one): no in-place writes

  int64_t dim() const { return static_cast<int64_t>(sizes.size()); }
  int64_t numel() const;
};

// Each value's type, or the first reason the program would fail eagerly as far as this model of
// Kiln's rules can tell (shape and dtype rules, in-place restrictions). The generator keeps only
// ops that infer; the shrinker only tries candidates that infer.
struct Inference {
  std::vector<ValueType> values;
  std::vector<int> first_result;  // per op: the id of its first result
  std::string error;              // empty when the program is valid
  bool ok() const { return error.empty(); }
};
Inference infer(const Program& program);

int result_count(OpKind kind);
bool is_in_place(OpKind kind);
bool is_view(OpKind kind);  // the result shares its argument's memory
std::string_view op_name(OpKind kind);

// Ids of the values each op reads or writes: every value from which an output, a gradient or an
// input written in place may depend; used to remove dead ops.
std::vector<bool> live_ops(const Program& program);

// One line: "3 inputs [2, 3]f32 ...; 7 ops: mul, sum, ...".
std::string describe(const Program& program);

// The program as a function `Ts program(const Ts& in)` of plain Kiln code.
std::string program_function_cpp(const Program& program);
// make_inputs() as plain Kiln code: the same data the harness feeds the program.
std::string make_inputs_cpp(const Program& program);

// Helpers shared by ops.cpp, the generator and the shrinker.
bool is_float(DType t);
std::vector<int64_t> reduced_sizes(const std::vector<int64_t>& sizes,
                                   const std::vector<int64_t>& dims, bool keepdim);
std::string dtype_cpp(DType t);  // "kFloat32"
// The sizes of the row-major tensor an input is made as before it is viewed into its layout.
std::vector<int64_t> base_sizes(const InputSpec& in);

}  // namespace kiln::differential
