// The loop IR of the kiln backend: what the scheduler makes of a graph and the C++ code generator
// turns into source (DESIGN §2.5).
//
// A Program is a list of steps over the graph's values. A kernel step runs one generated loop nest
// (a fused group of pointwise nodes, or a reduction with its pointwise prologue); an extern step
// runs one graph node through the eager dispatcher (GEMM, convolution, pooling, views, random ops,
// anything without a lowering). Every size, stride and offset here is the graph's concrete value;
// a static graph's kernels print them as literals, a dynamic graph's (Program::dynamic_sizes) as
// run-time arguments (Kernel::size_args), so that one source serves every size of the graph.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <functional>

#include "kiln/compiler/graph.h"

namespace kiln::compiler::lower {

// "sum", "max", "min" (the loop IR's text, logs).
inline const char* reduce_op_name(ReduceOp op) {
  return op == ReduceOp::sum ? "sum" : op == ReduceOp::max ? "max" : "min";
}

// One operation of a kernel body, in SSA form: operands are earlier expressions.
struct Expr {
  enum Kind : uint8_t {
    load,      // buffer[offset + sum(index[d] * strides[d])]
    scalar,    // a run-time scalar argument (Graph::scalars), as a double
    constant,  // a literal
    call,      // `code` with $0, $1, ... replaced by the operands
    cat,       // a load from one of several buffers, chosen by the index along `cat_dim` (a fused
               // cat: the code generator splits the loop nest at the segment boundaries)
    reduced,   // a reduction's result at the current kept position (epilogue expressions only)
  };
  struct Segment {
    int buffer = -1;
    std::vector<int64_t> strides;  // per iteration dim
    int64_t start = 0, end = 0;    // range along cat_dim
  };
  Kind kind = constant;
  DType dtype = DType::float32;  // the C++ type of the result
  int buffer = -1;               // load
  std::vector<int64_t> strides;  // load: per iteration dim (0 where broadcast)
  int64_t offset = 0;            // load
  int scalar_index = -1;         // scalar
  double value = 0;              // constant
  std::string code;              // call: "kiln::math::Exp{}($0)"
  std::vector<int> args;         // call
  int cat_dim = -1;              // cat
  std::vector<Segment> segments; // cat
};

// buffer[offset + sum(index[d] * strides[d])] = exprs[expr] (cast to the buffer's dtype).
struct Store {
  int buffer = -1;
  std::vector<int64_t> strides;
  int64_t offset = 0;
  int expr = -1;
};

struct Kernel {
  enum Kind : uint8_t { pointwise, reduction };
  Kind kind = pointwise;
  std::string name;              // C symbol: kiln_kernel_<n>
  std::vector<int64_t> sizes;    // the iteration space
  std::vector<Expr> exprs;
  std::vector<Store> stores;     // element-wise stores (pointwise; a reduction's prologue values)
  std::vector<DType> buffers;    // dtype of each buffer argument
  Device device;                 // where the kernel runs: every value it touches is there, except
  std::vector<bool> host_buffers;  // per buffer: a 0-dim CPU value read by a CUDA kernel (passed by value)
  // Reductions: dims of `sizes` that are reduced; the accumulated expression; how; the result.
  std::vector<bool> reduced;
  ReduceOp reduce_op = ReduceOp::sum;
  int reduce_expr = -1;
  DType acc_dtype = DType::float32;
  double scale = 1;              // mean: 1 / count
  int64_t mean_count = 0;        // mean: the count (a dynamic graph's kernel computes the scale)
  Store result;                  // strides over the iteration dims (0 on reduced dims); buffer -1:
                                 // only the epilogue reads it, nothing is stored
  // Reductions: pointwise work on the result (x.sum(1) * 2 + 1), evaluated once per kept position
  // after its reduced loops. Expressions from epilogue_begin on belong to it (-1: none); its
  // stores have stride 0 on the reduced dims.
  int epilogue_begin = -1;
  std::vector<Store> epilogue_stores;
  std::vector<std::string> ops;  // graph nodes fused in (for the debug dump and logs)
  std::string profile_name;      // KILN_PROFILE's row for this kernel
  // A dynamic graph's C++ kernel: the values of its run-time size arguments z[0], z[1], ...
  // (filled by the code generator, in the order it prints them).
  std::vector<int64_t> size_args;
};

struct Step {
  enum class Kind : uint8_t { kernel, node };
  Kind kind = Kind::node;
  int kernel = -1;               // kernel: index into Program::kernels
  std::vector<int> bindings;     // kernel: the value bound to each buffer
  std::vector<int> allocate;     // kernel: values this step creates (stores into fresh memory)
  std::vector<std::pair<int, int>> write_into;  // kernel: (value, graph input) stored straight
                                                // into the input's memory (elide_copy_backs)
  int node = -1;                 // node: graph node run through the dispatcher
  std::vector<int> release;      // values whose last use is this step
};

struct Program {
  Graph graph;                   // after the passes; steps refer to its values and nodes
  std::vector<Kernel> kernels;
  std::vector<Step> steps;
  int fused_nodes = 0;           // graph nodes lowered into kernels
  int extern_nodes = 0;          // graph nodes run through the dispatcher
  // Kernels take their sizes as run-time arguments (Graph::dynamic): the same graph at another
  // size generates the same sources.
  bool dynamic_sizes = false;
};

// Lowers a graph into a program: fuses pointwise chains and reduction prologues, leaves the rest
// to the dispatcher.
Program schedule(Graph graph);

// Lets kernels store a graph input's new value into the input itself where functionalize() left
// a copy back into it (an optimizer's parameter and state updates), and drops those copies.
// Returns how many it dropped. See copy_back.cpp for when it is safe.
int elide_copy_backs(Program& p);

// A kernel with a fused cat, split at the cat's segment boundaries into one kernel per non-empty
// segment: each covers its segment's range of the cat dim (loads, stores and the result shifted
// there) and reads the segment's input as a plain load. Both code generators print these pieces
// where they do not index the cat in one loop. A kernel without a cat comes back as it is.
std::vector<Kernel> split_at_cat_segments(const Kernel& k);

// Per expression of `k`, whether it varies along the loops: the expressions `is_source` picks
// (loads of memory, a cat, a reduction's result) and everything computed from them. The rest is
// loop-invariant (scalars, constants, host values), and the printers hoist it out of the loops.
std::vector<bool> loop_variant_exprs(const Kernel& k, const std::function<bool(size_t expr)>& is_source);

// The loop variables of a nest of `rank` loops: i0 (outermost), i1, ...
std::vector<std::string> loop_variables(size_t rank);

// The loop IR as text (KILN_COMPILE_DEBUG).
std::string describe(const Program& p);

}  // namespace kiln::compiler::lower
