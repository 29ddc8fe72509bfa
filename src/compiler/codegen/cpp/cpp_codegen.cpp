// C++ source for the kernels of a Program (DESIGN §2.5, "codegen").
//
// Each kernel becomes `extern "C" void <name>(void* const* buffers, const double* scalars,
// const int64_t* int_scalars, const int64_t* z)`: a loop nest over its (coalesced) iteration
// space, OpenMP across the outer loops of large kernels, `omp simd` on the innermost loop, and the
// scalar math of kiln/math/functors.h — the functors the eager kernels use. In a static graph every
// size, stride and offset is a literal; in a dynamic one (Program::dynamic_sizes) they are the
// run-time arguments z[k] (expr_text.h's IntText), so that one source serves every size.
#include "compiler/codegen/cpp/cpp_codegen.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>

#include "core/iteration_space.h"
#include "compiler/codegen/expr_text.h"
#include "compiler/lower/loop_ir.h"
#include "compiler/lower/node_lowering.h"

namespace kiln::compiler::codegen {

using namespace lower;  // the loop IR this file prints

namespace {


constexpr int64_t kParallelThreshold = 32768;  // elements; below this a kernel runs on one thread


std::string literal(double v, DType t) {
  if (std::isnan(v)) return std::string("std::numeric_limits<") + ctype(t) + ">::quiet_NaN()";
  if (std::isinf(v))
    return std::string(v > 0 ? "" : "-") + "std::numeric_limits<" + ctype(t) + ">::infinity()";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return std::string("static_cast<") + ctype(t) + ">(" + buf + ")";
}

// The iteration space (core/iteration_space.h): size-1 dims dropped, dims ordered as the leading
// access lies in memory, largest stride outermost (a channels-last NHWC buffer of sizes (N, C, H,
// W) is walked N, H, W, C: one contiguous run, not a stride-C inner loop), and dims every access
// walks contiguously merged (reduced with reduced, kept with kept). The leading access is a
// pointwise kernel's first store, a reduction's first access (its input).
using Space = kiln::detail::IterationSpace;

Space coalesce(const Kernel& k, const std::vector<const std::vector<int64_t>*>& accesses, size_t first_store) {
  std::vector<std::vector<int64_t>> strides;
  for (const std::vector<int64_t>* a : accesses) strides.push_back(*a);
  const bool reduction = k.kind == Kernel::reduction;
  return kiln::detail::coalesce_dims(k.sizes, strides, kiln::detail::DimOrder::lead_operand,
                                     reduction ? 0 : first_store, reduction ? k.reduced : std::vector<bool>{});
}

std::string index_of(const std::vector<int64_t>& strides, int64_t offset, const std::vector<std::string>& vars,
                     const IntText& ints) {
  std::string idx = offset ? ints(offset) : "";
  for (size_t d = 0; d < strides.size(); ++d) {
    if (strides[d] == 0) continue;
    if (!idx.empty()) idx += " + ";
    idx += strides[d] == 1 ? vars[d] : vars[d] + " * " + ints(strides[d]);
  }
  return idx.empty() ? "0" : idx;
}


// One loop nest computing kernel `k` (its buffers b0, b1, ... are declared by the caller).
void emit_nest(std::ostringstream& out, const Kernel& k, const IntText& ints) {
  // Accesses: loads, stores, and a reduction's result.
  std::vector<const std::vector<int64_t>*> accesses;
  std::vector<int> load_access(k.exprs.size(), -1);
  for (size_t e = 0; e < k.exprs.size(); ++e) {
    if (k.exprs[e].kind == Expr::load) {
      load_access[e] = static_cast<int>(accesses.size());
      accesses.push_back(&k.exprs[e].strides);
    }
  }
  const size_t first_store = accesses.size();
  for (const Store& s : k.stores) accesses.push_back(&s.strides);
  const size_t result_access = accesses.size();
  if (k.kind == Kernel::reduction) accesses.push_back(&k.result.strides);
  const size_t first_epilogue_store = accesses.size();
  for (const Store& s : k.epilogue_stores) accesses.push_back(&s.strides);
  Space sp = coalesce(k, accesses, first_store);
  const size_t rank = sp.sizes.size();
  int64_t total = 1;
  for (int64_t s : sp.sizes) total *= s;

  if (total == 0) {
    // Nothing to visit; a reduction over an empty dim still writes its identity (0, NaN for a
    // mean) into every kept position.
    if (k.kind != Kernel::reduction) return;
    const std::vector<std::string> v = loop_variables(sp.sizes.size());
    std::string init = k.reduce_op == ReduceOp::sum ? literal(k.scale == 1 ? 0.0 : 0.0 * k.scale, k.acc_dtype)
                                            : literal(std::numeric_limits<double>::quiet_NaN(), k.acc_dtype);
    out << "  {\n";
    std::string indent = "  ";
    size_t opened = 0;
    for (size_t d = 0; d < sp.sizes.size(); ++d) {
      if (sp.reduced[d]) continue;
      if (sp.sizes[d] == 0) break;
      out << indent << "for (int64_t " << v[d] << " = 0; " << v[d] << " < " << ints(sp.sizes[d]) << "; ++" << v[d] << ") {\n";
      indent += "  ";
      ++opened;
    }
    bool any_kept_empty = false;
    for (size_t d = 0; d < sp.sizes.size(); ++d) any_kept_empty |= !sp.reduced[d] && sp.sizes[d] == 0;
    if (!any_kept_empty && k.result.buffer >= 0) {
      std::vector<int64_t> strides = sp.strides[result_access];
      for (size_t d = 0; d < strides.size(); ++d)
        if (sp.reduced[d]) strides[d] = 0;
      out << indent << "b" << k.result.buffer << "[" << index_of(strides, k.result.offset, v, ints) << "] = static_cast<"
         << ctype(k.buffers[k.result.buffer]) << ">(" << init << ");\n";
    }
    for (size_t i = 0; i < opened; ++i) {
      indent.resize(indent.size() - 2);
      out << indent << "}\n";
    }
    out << "  }\n";
    return;
  }
  // The nest is printed into `os` first: a dynamic graph's kernel prints it twice (see the end).
  std::ostringstream os;
  os << "  {\n";
  // Loop-invariant expressions (scalars, constants and what depends only on them) go first.
  const std::vector<bool> varies = loop_variant_exprs(
      k, [&](size_t e) { return k.exprs[e].kind == Expr::load || k.exprs[e].kind == Expr::reduced; });
  const size_t epilogue_begin = k.epilogue_begin < 0 ? k.exprs.size() : static_cast<size_t>(k.epilogue_begin);
  const std::string result_value = reduction_result(k.scale, k.mean_count, k.acc_dtype, ints, literal,
                                                    std::string("static_cast<") + ctype(k.acc_dtype) + ">");
  auto emit_expr = [&](std::ostringstream& out, size_t e, const std::string& indent, const std::vector<std::string>& vars) {
    const Expr& x = k.exprs[e];
    out << indent << "const " << ctype(x.dtype) << " e" << e << " = ";
    switch (x.kind) {
      case Expr::load:
        out << "b" << x.buffer << "[" << index_of(sp.strides[load_access[e]], x.offset, vars, ints) << "]";
        break;
      case Expr::scalar:
        out << (x.dtype == DType::int64 ? "int_scalars[" : "scalars[") << x.scalar_index << "]";
        break;
      case Expr::constant: out << literal(x.value, x.dtype); break;
      case Expr::call: out << substitute(x.code, x.args); break;
      case Expr::cat: break;  // emit_kernel turns cats into loads, one loop nest per segment
      case Expr::reduced: out << "static_cast<" << ctype(x.dtype) << ">(" << result_value << ")"; break;
    }
    out << ";\n";
  };
  const std::vector<std::string> vars = loop_variables(rank);
  for (size_t e = 0; e < k.exprs.size(); ++e)
    if (!varies[e]) emit_expr(os, e, "  ", vars);

  // Loop order: kept dims outside, reduced dims inside (pointwise: all kept).
  std::vector<size_t> kept, red;
  for (size_t d = 0; d < rank; ++d) (sp.reduced[d] ? red : kept).push_back(d);
  const bool reduction = k.kind == Kernel::reduction;
  const char* acc_t = ctype(k.acc_dtype);
  auto init = [&] { return reduce_identity(k.reduce_op, k.acc_dtype, literal); };
  // A max/min whose innermost loop is a reduced one vectorizes as an OpenMP max/min reduction:
  // the combine is a plain compare-select (x86's maxps/minps), which lets NaN through only when it
  // is the newer operand, so a float kernel also ORs an `acc_nan` flag and returns NaN at the end,
  // as kiln::math::Maximum / Minimum (eager's functors) do.
  const bool simd_extremum = reduction && k.reduce_op != ReduceOp::sum && !red.empty() &&
                             (is_floating_point(k.acc_dtype) ? k.acc_dtype == DType::float32 || k.acc_dtype == DType::float64
                                                             : k.acc_dtype != DType::bool_);
  const bool nan_flag = simd_extremum && is_floating_point(k.acc_dtype);
  const std::string element = numbered("e", k.reduce_expr);
  auto combine = [&] {
    if (!simd_extremum) return "acc = " + reduce_combine(k.reduce_op, "acc", element) + ";";
    std::string line = "acc = acc " + std::string(k.reduce_op == ReduceOp::max ? ">" : "<") + " " + element + " ? acc : " +
                       element + ";";
    if (nan_flag) line += " acc_nan |= " + element + " != " + element + ";";
    return line;
  };
  auto declare_acc = [&](const std::string& in) {
    os << in << acc_t << " acc = " << init() << ";\n";
    if (nan_flag) os << in << "int acc_nan = 0;\n";
  };
  auto nan_result = [&](const std::string& in) {
    if (nan_flag) os << in << "if (acc_nan) acc = std::numeric_limits<" << acc_t << ">::quiet_NaN();\n";
  };

  std::string indent = "  ";
  int64_t kept_total = 1;
  for (size_t d : kept) kept_total *= sp.sizes[d];
  // Parallel: the outer kept loops of a big kernel; a full sum reduction parallelizes its outer
  // reduced loop with an OpenMP reduction instead.
  // A dynamic graph decides at run time what a static one decides here (see the end).
  const bool par = ints.dynamic() || total >= kParallelThreshold;
  // A parallel loop takes one thread per kParallelThreshold elements, as eager's parallel_for does,
  // not the whole pool: on 16 cores a kernel of 40,000 elements would pay 16 threads' fork and
  // join for 2,500 elements each.
  const std::string total_text = par ? ints(total) : "";
  const std::string team = par ? " num_threads(kiln_team(" + total_text + "))" : "";
  const bool full_sum = reduction && kept.empty() && k.reduce_op == ReduceOp::sum;
  if (reduction && kept.empty()) declare_acc(indent);
  std::vector<size_t> order = kept;
  order.insert(order.end(), red.begin(), red.end());
  std::string parallel_line, serial_line;  // the outer loop's OpenMP pragma, and without 'parallel'
  for (size_t li = 0; li < order.size(); ++li) {
    size_t d = order[li];
    const bool innermost = li + 1 == order.size();
    // One pragma per loop: "parallel for" on the outer loop of a big kernel, "simd" on the
    // innermost (both: "parallel for simd").
    std::string parallel, simd;
    if (li == 0 && par && !kept.empty() && kept_total > 1) {
      int collapse = kept.size() >= 2 && !innermost && order.size() >= 3 ? 2 : 1;
      parallel = collapse > 1 ? "parallel for collapse(2)" : "parallel for";
    } else if (li == 0 && par && full_sum && !innermost) {
      parallel = "parallel for reduction(+ : acc)";
    }
    if (reduction && !kept.empty() && li == kept.size()) declare_acc(indent);
    if (innermost) {
      if (!reduction || !sp.reduced[d]) {
        simd = "simd";
      } else if (k.reduce_op == ReduceOp::sum) {
        simd = parallel.empty() ? "simd reduction(+ : acc)" : "simd";
      } else if (simd_extremum && parallel.empty()) {
        simd = std::string("simd reduction(") + (k.reduce_op == ReduceOp::max ? "max" : "min") + " : acc)" +
               (nan_flag ? " reduction(| : acc_nan)" : "");
      }
    }
    if (!parallel.empty()) {
      parallel_line = indent + "#pragma omp " + parallel + (simd.empty() ? "" : " " + simd) + team + "\n";
      serial_line = simd.empty() ? "" : indent + "#pragma omp " + simd + "\n";
      os << parallel_line;
    } else if (!simd.empty()) {
      os << indent << "#pragma omp " << simd << "\n";
    }
    os << indent << "for (int64_t " << vars[d] << " = 0; " << vars[d] << " < " << ints(sp.sizes[d]) << "; ++"
       << vars[d] << ") {\n";
    indent += "  ";
  }
  // Body. A reduction whose reduced dims all had size 1 has no reduced loop: it reduces one
  // element in place.
  const bool trivial_reduction = reduction && red.empty() && !kept.empty();
  if (trivial_reduction) os << indent << acc_t << " acc = " << init() << ";\n";
  for (size_t e = 0; e < epilogue_begin; ++e)
    if (varies[e]) emit_expr(os, e, indent, vars);
  for (size_t s = 0; s < k.stores.size(); ++s) {
    const Store& st = k.stores[s];
    os << indent << "b" << st.buffer << "[" << index_of(sp.strides[first_store + s], st.offset, vars, ints)
       << "] = static_cast<" << ctype(k.buffers[st.buffer]) << ">(e" << st.expr << ");\n";
  }
  if (reduction) os << indent << combine() << "\n";
  // A reduction's result, once per kept position, and its epilogue.
  auto finish = [&](const std::string& in) {
    if (k.result.buffer >= 0) {
      os << in << "b" << k.result.buffer << "[" << index_of(sp.strides[result_access], k.result.offset, vars, ints)
         << "] = static_cast<" << ctype(k.buffers[k.result.buffer]) << ">(" << result_value << ");\n";
    }
    for (size_t e = epilogue_begin; e < k.exprs.size(); ++e)
      if (varies[e]) emit_expr(os, e, in, vars);
    for (size_t s = 0; s < k.epilogue_stores.size(); ++s) {
      const Store& st = k.epilogue_stores[s];
      os << in << "b" << st.buffer << "[" << index_of(sp.strides[first_epilogue_store + s], st.offset, vars, ints)
         << "] = static_cast<" << ctype(k.buffers[st.buffer]) << ">(e" << st.expr << ");\n";
    }
  };
  if (trivial_reduction) finish(indent);
  // Close loops; a reduction writes its result after the reduced loops.
  for (size_t li = order.size(); li-- > 0;) {
    indent.resize(indent.size() - 2);
    os << indent << "}\n";
    if (reduction && li == kept.size() && !kept.empty()) {
      nan_result(indent);
      finish(indent);
    }
  }
  if (reduction && kept.empty()) {
    nan_result("  ");
    finish("  ");
  }
  os << "  }\n";
  // A dynamic graph's kernel chooses between the parallel nest and the same nest without its
  // OpenMP region at run time: OpenMP's own if clause still enters the runtime (about a
  // microsecond per call even when it stays on one thread), which small sizes cannot afford.
  const std::string text = os.str();
  if (!ints.dynamic() || parallel_line.empty()) {
    out << text;
    return;
  }
  std::string serial = text;
  serial.replace(serial.find(parallel_line), parallel_line.size(), serial_line);
  out << "  if (" << total_text << " >= " << kParallelThreshold << ") {\n" << text << "  } else {\n"
         << serial << "  }\n";
}

// The kernel's function. A fused cat splits the iteration space at its segment boundaries: one
// loop nest per segment, in which the cat reads one input like a plain load.
void emit_kernel(std::ostringstream& os, const Kernel& k, const IntText& ints) {
  os << "extern \"C\" void " << k.name
     << "(void* const* buffers, const double* scalars, const int64_t* int_scalars, const int64_t* z) {\n";
  os << "  (void)scalars;\n  (void)int_scalars;\n  (void)z;\n";
  std::set<int> stored;
  for (const Store& s : k.stores) stored.insert(s.buffer);
  for (const Store& s : k.epilogue_stores) stored.insert(s.buffer);
  if (k.kind == Kernel::reduction && k.result.buffer >= 0) stored.insert(k.result.buffer);
  for (size_t b = 0; b < k.buffers.size(); ++b) {
    const char* t = ctype(k.buffers[b]);
    if (stored.count(static_cast<int>(b))) {
      os << "  " << t << "* __restrict b" << b << " = static_cast<" << t << "*>(buffers[" << b << "]);\n";
    } else {
      os << "  const " << t << "* __restrict b" << b << " = static_cast<const " << t << "*>(buffers[" << b
         << "]);\n";
    }
  }
  // A fused cat: one loop nest per segment (split_at_cat_segments), each reading its input.
  std::ostringstream nests;
  const size_t first_arg = ints.dynamic() ? ints.args->size() : 0;
  for (const Kernel& piece : split_at_cat_segments(k)) emit_nest(nests, piece, ints);
  // A dynamic kernel's size arguments, read once into the locals the nests use (IntText::locals).
  if (ints.dynamic())
    for (size_t a = first_arg; a < ints.args->size(); ++a) os << "  const int64_t z" << a << " = z[" << a << "];\n";
  os << nests.str() << "}\n\n";
}

}  // namespace

std::vector<std::string> generate_cpp(Program& p, int max_kernels_per_unit) {
  std::vector<std::string> units;
  const std::string header =
      "// Generated by Kiln's C++ code generator (src/compiler/codegen/cpp/cpp_codegen.cpp).\n"
      "#include <omp.h>\n\n#include <cstdint>\n#include <cmath>\n#include <limits>\n#include \"kiln/math/functors.h\"\n\n"
      "// The threads of a parallel loop over n elements: one per " + std::to_string(kParallelThreshold) + ", at most the pool's.\n"
      "static inline int kiln_team(int64_t n) {\n"
      "  const int64_t t = (n + " + std::to_string(kParallelThreshold - 1) + ") / " + std::to_string(kParallelThreshold) + ";\n"
      "  const int pool = omp_get_max_threads();\n"
      "  return t < pool ? static_cast<int>(t < 1 ? 1 : t) : pool;\n"
      "}\n\n";
  // Kernels with the same body (the optimizer update of same-shaped parameters, a repeated block's
  // normalization) are emitted once: a duplicate takes the first one's name.
  std::map<std::string, std::string> seen;  // body -> symbol
  std::ostringstream os;
  int in_unit = 0;
  for (Kernel& k : p.kernels) {
    if (!k.device.is_cpu()) continue;  // CUDA kernels: generate_cuda (codegen/cuda)
    const std::string name = k.name;
    k.name = "KILN_KERNEL_NAME";
    std::ostringstream body;
    k.size_args.clear();
    emit_kernel(body, k, IntText{p.dynamic_sizes ? &k.size_args : nullptr, "z", /*locals=*/true});
    std::string text = body.str();
    auto [it, fresh] = seen.emplace(text, name);
    k.name = it->second;
    if (!fresh) continue;
    text.replace(text.find("KILN_KERNEL_NAME"), std::string("KILN_KERNEL_NAME").size(), name);
    if (in_unit == 0) os << header;
    os << text;
    if (++in_unit == max_kernels_per_unit) {
      units.push_back(os.str());
      os.str("");
      in_unit = 0;
    }
  }
  if (in_unit > 0) units.push_back(os.str());
  return units;
}

}  // namespace kiln::compiler::codegen
