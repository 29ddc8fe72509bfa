// C++ source for the kernels of a Program (DESIGN §2.5, "codegen").
//
// Each kernel becomes `extern "C" void <name>(void* const* buffers, const double* scalars)`: a loop
// nest over its (coalesced) iteration space with every size and stride a literal, OpenMP across
// the outer loops of large kernels, `omp simd` on the innermost loop, and the scalar math of
// kiln/math/functors.h — the functors the eager kernels use.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>

#include "compiler/codegen/expr_text.h"
#include "compiler/lower/loop_ir.h"
#include "compiler/lower/pointwise_rules.h"

namespace kiln::compiler::lower {

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

// The iteration space after dropping size-1 dims, ordering the dims as the leading access lies in
// memory, and merging dims that every access walks contiguously (and, for reductions, that are
// both reduced or both kept).
struct Space {
  std::vector<int64_t> sizes;
  std::vector<bool> reduced;
  std::vector<std::vector<int64_t>> strides;  // per access
};

// Loop order: the dims sorted by the leading access's strides, largest outermost, so that a
// channels-last (NHWC) buffer of sizes (N, C, H, W) is walked N, H, W, C — one contiguous run —
// instead of with a stride-C inner loop. The leading access is a pointwise kernel's first store, a
// reduction's first access (its input); dims it broadcasts keep their place. The sort is stable,
// so row-major kernels keep their order.
std::vector<size_t> memory_order(const Kernel& k, const std::vector<const std::vector<int64_t>*>& accesses,
                                 size_t first_store) {
  std::vector<size_t> dims;
  for (size_t d = 0; d < k.sizes.size(); ++d)
    if (k.sizes[d] != 1) dims.push_back(d);
  const size_t lead_access = k.kind == Kernel::reduction ? 0 : first_store;
  if (lead_access >= accesses.size()) return dims;
  const std::vector<int64_t>& lead = *accesses[lead_access];
  std::vector<size_t> placed;  // dims with a stride in the leading access, to be sorted
  for (size_t d : dims)
    if (lead[d] != 0) placed.push_back(d);
  std::vector<size_t> sorted = placed;
  std::stable_sort(sorted.begin(), sorted.end(), [&](size_t a, size_t b) { return lead[a] > lead[b]; });
  for (size_t i = 0, j = 0; i < dims.size(); ++i)
    if (lead[dims[i]] != 0) dims[i] = sorted[j++];
  return dims;
}

Space coalesce(const Kernel& k, const std::vector<const std::vector<int64_t>*>& accesses, size_t first_store) {
  Space s;
  const std::vector<size_t> dims = memory_order(k, accesses, first_store);
  for (size_t d : dims) {
    s.sizes.push_back(k.sizes[d]);
    s.reduced.push_back(k.kind == Kernel::reduction && k.reduced[d]);
  }
  s.strides.resize(accesses.size());
  for (size_t a = 0; a < accesses.size(); ++a)
    for (size_t d : dims) s.strides[a].push_back((*accesses[a])[d]);
  // Merge from the innermost dim outwards.
  for (size_t d = s.sizes.size(); d-- > 1;) {
    bool ok = s.reduced[d - 1] == s.reduced[d];
    for (size_t a = 0; ok && a < accesses.size(); ++a) ok = s.strides[a][d - 1] == s.strides[a][d] * s.sizes[d];
    if (!ok) continue;
    s.sizes[d - 1] *= s.sizes[d];
    s.sizes.erase(s.sizes.begin() + d);
    s.reduced.erase(s.reduced.begin() + d);
    for (auto& st : s.strides) {
      st[d - 1] = st[d];
      st.erase(st.begin() + d);
    }
  }
  return s;
}

std::string index_of(const std::vector<int64_t>& strides, int64_t offset, const std::vector<std::string>& vars) {
  std::string idx = offset ? std::to_string(offset) : "";
  for (size_t d = 0; d < strides.size(); ++d) {
    if (strides[d] == 0) continue;
    if (!idx.empty()) idx += " + ";
    idx += strides[d] == 1 ? vars[d] : vars[d] + " * " + std::to_string(strides[d]);
  }
  return idx.empty() ? "0" : idx;
}


// One loop nest computing kernel `k` (its buffers b0, b1, ... are declared by the caller).
void emit_nest(std::ostringstream& os, const Kernel& k) {
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
    std::vector<std::string> v;
    for (size_t d = 0; d < sp.sizes.size(); ++d) v.push_back(numbered("i", static_cast<int64_t>(d)));
    std::string init = k.reduce_op == "sum" ? literal(k.scale == 1 ? 0.0 : 0.0 * k.scale, k.acc_dtype)
                                            : literal(std::numeric_limits<double>::quiet_NaN(), k.acc_dtype);
    os << "  {\n";
    std::string indent = "  ";
    size_t opened = 0;
    for (size_t d = 0; d < sp.sizes.size(); ++d) {
      if (sp.reduced[d]) continue;
      if (sp.sizes[d] == 0) break;
      os << indent << "for (int64_t " << v[d] << " = 0; " << v[d] << " < " << sp.sizes[d] << "; ++" << v[d] << ") {\n";
      indent += "  ";
      ++opened;
    }
    bool any_kept_empty = false;
    for (size_t d = 0; d < sp.sizes.size(); ++d) any_kept_empty |= !sp.reduced[d] && sp.sizes[d] == 0;
    if (!any_kept_empty && k.result.buffer >= 0) {
      std::vector<int64_t> strides = sp.strides[result_access];
      for (size_t d = 0; d < strides.size(); ++d)
        if (sp.reduced[d]) strides[d] = 0;
      os << indent << "b" << k.result.buffer << "[" << index_of(strides, k.result.offset, v) << "] = static_cast<"
         << ctype(k.buffers[k.result.buffer]) << ">(" << init << ");\n";
    }
    for (size_t i = 0; i < opened; ++i) {
      indent.resize(indent.size() - 2);
      os << indent << "}\n";
    }
    os << "  }\n";
    return;
  }
  os << "  {\n";
  // Loop-invariant expressions (scalars, constants and what depends only on them) go first.
  std::vector<bool> varies(k.exprs.size(), false);
  for (size_t e = 0; e < k.exprs.size(); ++e) {
    const Expr& x = k.exprs[e];
    if (x.kind == Expr::load || x.kind == Expr::reduced) varies[e] = true;
    for (int a : x.args) varies[e] = varies[e] || varies[a];
  }
  const size_t epilogue_begin = k.epilogue_begin < 0 ? k.exprs.size() : static_cast<size_t>(k.epilogue_begin);
  const std::string result_value = k.scale != 1 ? "acc * " + literal(k.scale, k.acc_dtype) : std::string("acc");
  auto emit_expr = [&](std::ostringstream& out, size_t e, const std::string& indent, const std::vector<std::string>& vars) {
    const Expr& x = k.exprs[e];
    out << indent << "const " << ctype(x.dtype) << " e" << e << " = ";
    switch (x.kind) {
      case Expr::load:
        out << "b" << x.buffer << "[" << index_of(sp.strides[load_access[e]], x.offset, vars) << "]";
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
  std::vector<std::string> vars;
  for (size_t d = 0; d < rank; ++d) vars.push_back(numbered("i", static_cast<int64_t>(d)));
  for (size_t e = 0; e < k.exprs.size(); ++e)
    if (!varies[e]) emit_expr(os, e, "  ", vars);

  // Loop order: kept dims outside, reduced dims inside (pointwise: all kept).
  std::vector<size_t> kept, red;
  for (size_t d = 0; d < rank; ++d) (sp.reduced[d] ? red : kept).push_back(d);
  const bool reduction = k.kind == Kernel::reduction;
  const char* acc_t = ctype(k.acc_dtype);
  auto init = [&]() -> std::string {
    if (k.reduce_op == "sum") return literal(0, k.acc_dtype);
    if (k.reduce_op == "max") {
      return is_floating_point(k.acc_dtype) ? std::string("-std::numeric_limits<") + acc_t + ">::infinity()"
                                            : std::string("std::numeric_limits<") + acc_t + ">::lowest()";
    }
    return is_floating_point(k.acc_dtype) ? std::string("std::numeric_limits<") + acc_t + ">::infinity()"
                                          : std::string("std::numeric_limits<") + acc_t + ">::max()";
  };
  auto combine = [&]() -> std::string {
    std::string e = numbered("e", k.reduce_expr);
    if (k.reduce_op == "sum") return "acc = acc + " + e + ";";
    return std::string("acc = kiln::math::") + (k.reduce_op == "max" ? "Maximum" : "Minimum") + "{}(acc, " + e + ");";
  };

  std::string indent = "  ";
  int64_t kept_total = 1;
  for (size_t d : kept) kept_total *= sp.sizes[d];
  // Parallel: the outer kept loops of a big kernel; a full sum reduction parallelizes its outer
  // reduced loop with an OpenMP reduction instead.
  const bool par = total >= kParallelThreshold;
  const bool full_sum = reduction && kept.empty() && k.reduce_op == "sum";
  if (reduction && kept.empty()) os << indent << acc_t << " acc = " << init() << ";\n";
  std::vector<size_t> order = kept;
  order.insert(order.end(), red.begin(), red.end());
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
    if (reduction && !kept.empty() && li == kept.size()) {
      os << indent << acc_t << " acc = " << init() << ";\n";
    }
    if (innermost) {
      if (!reduction || !sp.reduced[d]) {
        simd = "simd";
      } else if (k.reduce_op == "sum") {
        simd = parallel.empty() ? "simd reduction(+ : acc)" : "simd";
      }
    }
    if (!parallel.empty() && !simd.empty()) {
      os << indent << "#pragma omp " << parallel << " " << simd << "\n";
    } else if (!parallel.empty() || !simd.empty()) {
      os << indent << "#pragma omp " << parallel << simd << "\n";
    }
    os << indent << "for (int64_t " << vars[d] << " = 0; " << vars[d] << " < " << sp.sizes[d] << "; ++" << vars[d]
       << ") {\n";
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
    os << indent << "b" << st.buffer << "[" << index_of(sp.strides[first_store + s], st.offset, vars)
       << "] = static_cast<" << ctype(k.buffers[st.buffer]) << ">(e" << st.expr << ");\n";
  }
  if (reduction) os << indent << combine() << "\n";
  // A reduction's result, once per kept position, and its epilogue.
  auto finish = [&](const std::string& in) {
    if (k.result.buffer >= 0) {
      os << in << "b" << k.result.buffer << "[" << index_of(sp.strides[result_access], k.result.offset, vars)
         << "] = static_cast<" << ctype(k.buffers[k.result.buffer]) << ">(" << result_value << ");\n";
    }
    for (size_t e = epilogue_begin; e < k.exprs.size(); ++e)
      if (varies[e]) emit_expr(os, e, in, vars);
    for (size_t s = 0; s < k.epilogue_stores.size(); ++s) {
      const Store& st = k.epilogue_stores[s];
      os << in << "b" << st.buffer << "[" << index_of(sp.strides[first_epilogue_store + s], st.offset, vars)
         << "] = static_cast<" << ctype(k.buffers[st.buffer]) << ">(e" << st.expr << ");\n";
    }
  };
  if (trivial_reduction) finish(indent);
  // Close loops; a reduction writes its result after the reduced loops.
  for (size_t li = order.size(); li-- > 0;) {
    indent.resize(indent.size() - 2);
    os << indent << "}\n";
    if (reduction && li == kept.size() && !kept.empty()) finish(indent);
  }
  if (reduction && kept.empty()) finish("  ");
  os << "  }\n";
}

// The kernel's function. A fused cat splits the iteration space at its segment boundaries: one
// loop nest per segment, in which the cat reads one input like a plain load.
void emit_kernel(std::ostringstream& os, const Kernel& k) {
  os << "extern \"C\" void " << k.name
     << "(void* const* buffers, const double* scalars, const int64_t* int_scalars) {\n";
  os << "  (void)scalars;\n  (void)int_scalars;\n";
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
  const Expr* cat = nullptr;
  for (const Expr& e : k.exprs)
    if (e.kind == Expr::cat) cat = &e;
  if (!cat) {
    emit_nest(os, k);
  } else {
    const size_t d = static_cast<size_t>(cat->cat_dim);
    for (size_t s = 0; s < cat->segments.size(); ++s) {
      const int64_t start = cat->segments[s].start, len = cat->segments[s].end - start;
      if (len == 0) continue;
      Kernel inst = k;
      inst.sizes[d] = len;
      for (Expr& e : inst.exprs) {
        if (e.kind == Expr::load) e.offset += start * e.strides[d];
        if (e.kind == Expr::cat) {
          Expr::Segment seg = e.segments[s];
          e.kind = Expr::load;
          e.buffer = seg.buffer;
          e.strides = seg.strides;
          e.offset = 0;
          e.segments.clear();
        }
      }
      for (Store& st : inst.stores) st.offset += start * st.strides[d];
      if (inst.kind == Kernel::reduction) inst.result.offset += start * inst.result.strides[d];
      emit_nest(os, inst);
    }
  }
  os << "}\n\n";
}

}  // namespace

std::vector<std::string> generate_cpp(Program& p, int max_kernels_per_unit) {
  std::vector<std::string> units;
  const std::string header =
      "// Generated by Kiln's C++ code generator (src/compiler/codegen/cpp/cpp_codegen.cpp).\n"
      "#include <cstdint>\n#include <cmath>\n#include <limits>\n#include \"kiln/math/functors.h\"\n\n";
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
    emit_kernel(body, k);
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

}  // namespace kiln::compiler::lower
