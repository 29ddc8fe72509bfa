// export_program (kiln/export.h): captures fn as one graph, lifts the tensors it reads that are not
// arguments into named weights, learns how the graph's integers depend on the dynamic sizes, and
// builds the program's kernels once so that the package can carry them.
//
// Dynamic sizes without symbolic shapes: fn is captured at the example sizes and at the 2^d corners
// of a unit box around them (d dynamic dimensions), every capture's graph must have the same
// structure, and each integer that differs between captures (a size, a stride, a view's shape
// attr) is fitted exactly as a multilinear polynomial of the sizes, which is what products of
// dimensions give. One more capture at other sizes checks every fit; a graph that depends on a
// size in another way (size // 2, a branch on the size) is refused there. At run time the graph
// for new sizes is the polynomials evaluated and then validated op by op (Graph::validate).
#include <algorithm>
#include <chrono>
#include <ctime>
#include <limits>
#include <set>
#include <unordered_map>

#include "compiler/capture/runtime.h"
#include "compiler/export/program.h"
#include "compiler/graph/passes.h"
#include "core/shape.h"
#include "kiln/autograd.h"
#include "kiln/compiler/serialize.h"
#include "kiln/cuda.h"
#include "kiln/ops.h"

#ifndef KILN_VERSION
#define KILN_VERSION "unknown"
#endif

namespace kiln::detail {

using compiler::Graph;
using compiler::ValueInfo;

std::optional<int64_t> eval_sym(const SymExpr& e, const std::vector<int64_t>& s) {
  __int128 sum = 0;
  for (const SymTerm& t : e) {
    __int128 term = t.coef;
    for (size_t i = 0; i < s.size(); ++i)
      if (t.mask >> i & 1u) {
        term *= s[i];
        if (term > std::numeric_limits<int64_t>::max() || term < std::numeric_limits<int64_t>::min()) return std::nullopt;
      }
    sum += term;
    if (sum > std::numeric_limits<int64_t>::max() || sum < std::numeric_limits<int64_t>::min()) return std::nullopt;
  }
  return static_cast<int64_t>(sum);
}

std::string dims_text(const std::vector<DynamicDimSpec>& dims, const std::vector<int64_t>& values) {
  std::string out;
  for (size_t i = 0; i < dims.size() && i < values.size(); ++i)
    out += (i ? ", " : "") + dims[i].name + "=" + std::to_string(values[i]);
  return out;
}

std::string sym_text(const SymExpr& e, const std::vector<DynamicDimSpec>& dims) {
  std::string out;
  int64_t constant = 0;
  for (const SymTerm& t : e) {
    if (t.mask == 0) {
      constant += t.coef;
      continue;
    }
    std::string product;
    for (size_t i = 0; i < dims.size(); ++i)
      if (t.mask >> i & 1u) product += (product.empty() ? "" : "*") + dims[i].name;
    const int64_t c = t.coef;
    if (out.empty()) out = c == 1 ? product : c == -1 ? "-" + product : std::to_string(c) + "*" + product;
    else out += (c < 0 ? " - " : " + ") + (c == 1 || c == -1 ? product : std::to_string(c < 0 ? -c : c) + "*" + product);
  }
  if (out.empty()) return std::to_string(constant);
  if (constant != 0) out += (constant < 0 ? " - " : " + ") + std::to_string(constant < 0 ? -constant : constant);
  return out;
}

namespace {

Tensor laid_out(const Tensor& t, const ValueInfo& v, bool copy) {
  if (v.storage_offset == 0 && dense_row_major(v.sizes, v.strides)) {
    Tensor moved = t.to(v.device);
    return copy && moved.unsafe_impl() == t.unsafe_impl() ? moved.clone() : moved.contiguous();
  }
  const int64_t span = storage_span(v.sizes, v.strides);
  const int64_t extent = span == 0 ? 0 : v.storage_offset + span;
  Tensor buffer = zeros({std::max<int64_t>(extent, 1)}, TensorOptions(v.dtype, v.device));
  Tensor view = as_strided(buffer, v.sizes, v.strides, v.storage_offset);
  NoGradGuard no_grad;
  view.copy_(t);
  return view;
}

}  // namespace

bool has_layout(const Tensor& t, const ValueInfo& v) {
  return t.sizes() == IntArrayRef(v.sizes) && t.strides() == IntArrayRef(v.strides) && t.storage_offset() == v.storage_offset;
}

Tensor with_layout(const Tensor& t, const ValueInfo& v) { return laid_out(t, v, false); }
Tensor copy_with_layout(const Tensor& t, const ValueInfo& v) { return laid_out(t, v, true); }

namespace {

[[noreturn]] void export_error(const std::string& what) {
  throw CompileError("[kiln::export_program] " + what);
}

// One capture of fn: its graph, the tensors of its placeholders, and how its results map.
struct Capture {
  Graph graph;
  std::vector<Tensor> placeholder_tensors;
  std::vector<const Storage*> output_storages;
  int graphs = 0;
  std::vector<Binding> placeholders;
  std::vector<ResultRef> results;
};

// Runs a captured graph for the capture's own call without writing the caller's tensors: the
// placeholders the graph writes are copies (a training step's updates must not touch the model
// being exported).
compiler::CompiledFn isolated_runner(const Graph& g) {
  const std::vector<char> written = compiler::passes::internal::written_memory(g);
  std::vector<std::optional<ValueInfo>> copy(g.inputs.size());  // the layout of each written placeholder
  for (size_t k = 0; k < g.inputs.size(); ++k)
    if (written[g.inputs[k]]) copy[k] = g.values[g.inputs[k]];
  compiler::CompiledFn run = compiler::interpreter(g);
  return [run, copy](const compiler::Arguments& args) {
    std::vector<Tensor> tensors(args.tensors.begin(), args.tensors.end());
    for (size_t k = 0; k < tensors.size(); ++k)
      if (copy[k]) tensors[k] = copy_with_layout(tensors[k], *copy[k]);
    return run(compiler::Arguments{tensors, args.scalars});
  };
}

// Calls fn once (through compile() with a recording backend) with `args` in place of the tensor
// arguments, and maps placeholders and results.
Capture capture_once(const ExportCall& call, const ExportOptions& options, const std::vector<Tensor>& args,
                     const std::vector<Tensor>& replacement) {
  auto cap = std::make_shared<Capture>();
  CompileOptions co;
  co.fullgraph = true;
  co.dynamic = false;
  co.name = options.name;
  co.arg_names = options.arg_names;
  co.backend = compiler::BackendFn([cap](Graph& g, const compiler::Arguments& example) -> compiler::CompiledFn {
    ++cap->graphs;
    cap->graph = g;
    cap->placeholder_tensors.assign(example.tensors.begin(), example.tensors.end());
    return isolated_runner(g);
  });
  const compiler::detail::FlushObserver observer = [cap](const std::vector<const Storage*>& outputs) {
    cap->output_storages = outputs;
  };
  std::vector<Tensor> results;
  {
    const compiler::detail::FlushObserver* saved = std::exchange(compiler::detail::t_flush_observer, &observer);
    struct Restore {
      const compiler::detail::FlushObserver* saved;
      ~Restore() { compiler::detail::t_flush_observer = saved; }
    } restore{saved};
    std::optional<NoGradGuard> no_grad;
    if (!options.training) no_grad.emplace();
    results = call.call(co, replacement);
  }
  if (cap->graphs == 0)
    export_error("fn did no tensor work that could be captured (no graph). Is the stance force_eager, or does fn "
                 "only return its arguments?");
  if (cap->graphs > 1)
    export_error("fn produced " + std::to_string(cap->graphs) +
                 " graphs; a program is one graph. Does fn call other compiled functions?");
  const Graph& g = cap->graph;
  // Placeholders: an argument (by identity), else a weight.
  for (size_t k = 0; k < g.inputs.size(); ++k) {
    const Tensor& t = cap->placeholder_tensors[k];
    Binding b{Binding::weight, static_cast<int>(k)};
    for (size_t i = 0; i < args.size(); ++i)
      if (args[i].defined() && args[i].unsafe_impl() == t.unsafe_impl()) {
        b = {Binding::input, static_cast<int>(i)};
        break;
      }
    cap->placeholders.push_back(b);
  }
  // Results: a value of the graph in the memory of a graph output (or of a placeholder) with the
  // result's layout. A view of an output that is not an output itself (fn returned y.view(...)
  // of an intermediate y) becomes one, so that the program returns it.
  Graph& graph = cap->graph;
  std::unordered_map<const Storage*, int> group_of;
  for (size_t k = 0; k < cap->output_storages.size() && k < graph.outputs.size(); ++k)
    group_of.emplace(cap->output_storages[k], graph.values[graph.outputs[k]].storage);
  for (size_t k = 0; k < graph.inputs.size(); ++k)
    group_of.emplace(cap->placeholder_tensors[k].impl().storage.get(), graph.values[graph.inputs[k]].storage);
  for (size_t r = 0; r < results.size(); ++r) {
    const Tensor& t = results[r];
    auto it = group_of.find(t.impl().storage.get());
    int value = -1;
    if (it != group_of.end()) {
      for (int o : graph.outputs)
        if (value < 0 && graph.values[o].storage == it->second && has_layout(t, graph.values[o])) value = o;
      for (size_t v = 0; v < graph.values.size() && value < 0; ++v)
        if (graph.values[v].storage == it->second && has_layout(t, graph.values[v])) value = static_cast<int>(v);
    }
    if (value < 0)
      export_error("result " + std::to_string(r) +
                   " of fn is a tensor that the captured graph did not compute and that is not an argument. A "
                   "program returns tensors computed from its arguments (and weights).");
    std::optional<ResultRef> ref;
    for (size_t k = 0; k < graph.inputs.size() && !ref; ++k)
      if (graph.inputs[k] == value && cap->placeholders[k].kind == Binding::input)
        ref = ResultRef{ResultRef::input, cap->placeholders[k].index};
    if (!ref) {
      auto pos = std::find(graph.outputs.begin(), graph.outputs.end(), value);
      if (pos == graph.outputs.end()) pos = graph.outputs.insert(graph.outputs.end(), value);
      ref = ResultRef{ResultRef::graph_output, static_cast<int>(pos - graph.outputs.begin())};
    }
    cap->results.push_back(*ref);
  }
  return std::move(*cap);
}

// ---- comparing captures ----

// Every integer of the graph in a fixed order, with where it lives.
void collect_ints(const Graph& g, std::vector<int64_t>& values, std::vector<IntSlot>* where) {
  auto add = [&](int64_t v, IntSlot::Kind kind, int a, int b, int c) {
    values.push_back(v);
    if (where) where->push_back(IntSlot{kind, a, b, c, {}});
  };
  for (size_t i = 0; i < g.values.size(); ++i) {
    const ValueInfo& v = g.values[i];
    for (size_t d = 0; d < v.sizes.size(); ++d) add(v.sizes[d], IntSlot::size, static_cast<int>(i), static_cast<int>(d), 0);
    for (size_t d = 0; d < v.strides.size(); ++d) add(v.strides[d], IntSlot::stride, static_cast<int>(i), static_cast<int>(d), 0);
    add(v.storage_offset, IntSlot::offset, static_cast<int>(i), 0, 0);
  }
  for (size_t n = 0; n < g.nodes.size(); ++n)
    for (size_t a = 0; a < g.nodes[n].attrs.size(); ++a) {
      const Attr& attr = g.nodes[n].attrs[a];
      if (const auto* i = std::get_if<int64_t>(&attr)) add(*i, IntSlot::attr, static_cast<int>(n), static_cast<int>(a), 0);
      if (const auto* l = std::get_if<std::vector<int64_t>>(&attr))
        for (size_t e = 0; e < l->size(); ++e) add((*l)[e], IntSlot::attr_elem, static_cast<int>(n), static_cast<int>(a), static_cast<int>(e));
    }
}

std::string slot_text(const Graph& g, const IntSlot& s) {
  switch (s.kind) {
    case IntSlot::size: return "the size of dim " + std::to_string(s.b) + " of %" + g.values[s.a].name;
    case IntSlot::stride: return "the stride of dim " + std::to_string(s.b) + " of %" + g.values[s.a].name;
    case IntSlot::offset: return "the storage offset of %" + g.values[s.a].name;
    case IntSlot::attr: return "attr " + std::to_string(s.b) + " of node %" + g.nodes[s.a].name;
    case IntSlot::attr_elem:
      return "element " + std::to_string(s.c) + " of attr " + std::to_string(s.b) + " of node %" + g.nodes[s.a].name;
  }
  return "?";
}

// Where two captures' graphs differ other than in integers; empty when they do not.
std::string structure_difference(const Capture& a, const Capture& b) {
  const Graph& x = a.graph;
  const Graph& y = b.graph;
  if (x.nodes.size() != y.nodes.size())
    return std::to_string(x.nodes.size()) + " nodes at the example sizes, " + std::to_string(y.nodes.size()) + " here";
  if (x.values.size() != y.values.size() || x.inputs != y.inputs || x.outputs != y.outputs)
    return "the graph's values, inputs or outputs differ";
  for (size_t n = 0; n < x.nodes.size(); ++n) {
    const compiler::Node& p = x.nodes[n];
    const compiler::Node& q = y.nodes[n];
    const std::string where = "node %" + p.name + " (" + p.op->name + ")";
    if (p.op != q.op) return where + " is " + q.op->name + " here";
    if (p.inputs != q.inputs || p.outputs != q.outputs || p.inplace != q.inplace || p.attrs.size() != q.attrs.size())
      return where + " has other inputs or outputs";
    for (size_t k = 0; k < p.attrs.size(); ++k) {
      if (p.attrs[k].index() != q.attrs[k].index()) return where + ": attr " + std::to_string(k) + " has another kind";
      if (std::holds_alternative<int64_t>(p.attrs[k])) continue;
      if (const auto* l = std::get_if<std::vector<int64_t>>(&p.attrs[k])) {
        if (l->size() != std::get<std::vector<int64_t>>(q.attrs[k]).size())
          return where + ": attr " + std::to_string(k) + " has another length";
        continue;
      }
      if (!(p.attrs[k] == q.attrs[k]))
        return where + ": attr " + std::to_string(k) +
               " (a number computed on the host) changes with the size; a program can only follow sizes and "
               "integer attrs";
    }
  }
  for (size_t i = 0; i < x.values.size(); ++i) {
    const ValueInfo& v = x.values[i];
    const ValueInfo& w = y.values[i];
    if (v.dtype != w.dtype || v.device != w.device || v.storage != w.storage || v.is_input != w.is_input ||
        v.sizes.size() != w.sizes.size() || v.is_wrapped_number != w.is_wrapped_number)
      return "value %" + v.name + " has another dtype, device, rank or alias group";
  }
  if (x.scalars.size() != y.scalars.size()) return "the scalar slots differ";
  for (size_t s = 0; s < x.scalars.size(); ++s)
    if (x.scalars[s].node != y.scalars[s].node || x.scalars[s].attr != y.scalars[s].attr) return "the scalar slots differ";
  if (x.constants.size() != y.constants.size()) return "the graph's constants differ";
  for (size_t c = 0; c < x.constants.size(); ++c)
    if (x.constants[c].first != y.constants[c].first || !equal(x.constants[c].second, y.constants[c].second))
      return "constant %" + x.values[x.constants[c].first].name + " differs";
  for (size_t k = 0; k < a.placeholders.size(); ++k) {
    const std::string where = "placeholder %" + x.values[x.inputs[k]].name;
    if (a.placeholders[k].kind != b.placeholders[k].kind || a.placeholders[k].index != b.placeholders[k].index)
      return where + " is another argument";
    if (a.placeholders[k].kind != Binding::weight) continue;
    const Tensor& p = a.placeholder_tensors[k];
    const Tensor& q = b.placeholder_tensors[k];
    // A host number the body turns into a tensor on each call is new each time: compare values.
    if (x.values[x.inputs[k]].is_wrapped_number) {
      if (!equal(p, q))
        return where + " (a number computed on the host) changes with the size; a program can only follow sizes";
    } else if (p.unsafe_impl() != q.unsafe_impl()) {
      return where + " is another tensor";
    }
  }
  if (a.results.size() != b.results.size()) return "fn returns another number of tensors";
  for (size_t r = 0; r < a.results.size(); ++r)
    if (a.results[r].kind != b.results[r].kind || a.results[r].index != b.results[r].index)
      return "result " + std::to_string(r) + " comes from another value";
  return {};
}

// ---- the dynamic dimensions ----

struct DimUse {
  int arg;
  int64_t dim;
};

struct Symbol {
  DynamicDimSpec spec;
  std::vector<DimUse> uses;
  int64_t grid = 0;    // the second value of the unit box
  int64_t check = 0;   // the value of the checking capture (== example when it cannot move)
};

std::vector<Symbol> collect_symbols(const ExportCall& call, const ExportOptions& options,
                                    const std::vector<std::string>& arg_names) {
  std::vector<Symbol> symbols;
  auto add = [&](int arg, int64_t dim, std::string name, int64_t lo, int64_t hi) {
    const Tensor& t = call.tensor_args[static_cast<size_t>(arg)];
    const int64_t rank = t.dim();
    if (dim < -rank || dim >= rank)
      throw ValueError("[kiln::export_program] dim " + std::to_string(dim) + " is out of range for " + arg_names[arg] +
                       ", which has " + std::to_string(rank) + " dimensions.");
    if (dim < 0) dim += rank;
    if (name.empty()) name = arg_names[arg] + "_dim" + std::to_string(dim);
    const int64_t size = t.size(dim);
    lo = std::max<int64_t>(lo, 2);
    if (size < 2)
      throw ValueError("[kiln::export_program] " + arg_names[arg] + " dim " + std::to_string(dim) + " is dynamic ('" + name +
                       "') but has size " + std::to_string(size) +
                       " in the example; sizes 0 and 1 always specialize. Export with an example of size 2 or more.");
    if (size < lo || size > hi)
      throw ValueError("[kiln::export_program] " + arg_names[arg] + " dim " + std::to_string(dim) + " has size " +
                       std::to_string(size) + ", outside the range of dynamic dim '" + name + "'.");
    for (Symbol& s : symbols) {
      for (const DimUse& u : s.uses)
        if (u.arg == arg && u.dim == dim) {
          if (s.spec.name != name)
            throw ValueError("[kiln::export_program] " + arg_names[arg] + " dim " + std::to_string(dim) +
                             " is marked dynamic twice, as '" + s.spec.name + "' and as '" + name + "'.");
          return;
        }
      if (s.spec.name == name) {
        if (s.spec.example != size)
          throw ValueError("[kiln::export_program] dynamic dim '" + name + "' has size " + std::to_string(s.spec.example) +
                           " in one argument and " + std::to_string(size) + " in " + arg_names[arg] +
                           "; dims that share a name must be equal in the example.");
        s.spec.min = std::max(s.spec.min, lo);
        s.spec.max = std::min(s.spec.max, hi);
        s.uses.push_back({arg, dim});
        return;
      }
    }
    Symbol s;
    s.spec = DynamicDimSpec{name, lo, hi, size};
    s.uses.push_back({arg, dim});
    symbols.push_back(std::move(s));
  };
  for (const ExportDim& d : options.dynamic) {
    if (d.arg < 0 || static_cast<size_t>(d.arg) >= call.tensor_args.size() || !call.tensor_args[d.arg].defined())
      throw ValueError("[kiln::export_program] ExportDim names argument " + std::to_string(d.arg) +
                       ", which is not a tensor argument of fn.");
    add(d.arg, d.dim, d.name, d.range.min.value_or(2), d.range.max.value_or(std::numeric_limits<int64_t>::max()));
  }
  for (size_t i = 0; i < call.tensor_args.size(); ++i) {
    const Tensor& t = call.tensor_args[i];
    if (!t.defined() || !t.impl().dim_marks) continue;
    const compiler::DimMarks& m = *t.impl().dim_marks;
    for (size_t d = 0; d < m.kind.size(); ++d)
      if (m.kind[d] == compiler::DimMarks::dynamic || (m.kind[d] == compiler::DimMarks::maybe_dynamic && t.size(d) >= 2))
        add(static_cast<int>(i), static_cast<int64_t>(d), "", m.min[d], m.max[d]);
  }
  constexpr size_t kMaxSymbols = 6;
  if (symbols.size() > kMaxSymbols)
    throw ValueError("[kiln::export_program] " + std::to_string(symbols.size()) + " dynamic dims; a program takes at most " +
                     std::to_string(kMaxSymbols) + " (each doubles the captures export makes). Give dims that are always "
                     "equal the same name.");
  for (Symbol& s : symbols) {
    const int64_t a = s.spec.example, lo = s.spec.min, hi = s.spec.max;
    s.grid = a < hi ? a + 1 : a - 1;
    if (s.grid < lo) s.grid = a;  // a range of one size: nothing to learn
    s.check = a + 2 <= hi ? a + 2 : (a - 2 >= lo && a - 2 != s.grid ? a - 2 : a);
  }
  return symbols;
}

std::vector<DynamicDimSpec> specs_of(const std::vector<Symbol>& symbols) {
  std::vector<DynamicDimSpec> specs;
  for (const Symbol& s : symbols) specs.push_back(s.spec);
  return specs;
}

// The tensor arguments at sizes `values`: generated tensors (normal floats, zero integers) for
// the arguments with a dynamic dim, undefined (keep the example) for the others.
std::vector<Tensor> arguments_at(const ExportCall& call, const std::vector<Symbol>& symbols,
                                 const std::vector<int64_t>& values) {
  std::vector<std::vector<int64_t>> sizes(call.tensor_args.size());  // empty: no dynamic dim
  for (size_t s = 0; s < symbols.size(); ++s)
    for (const DimUse& u : symbols[s].uses) {
      if (sizes[u.arg].empty()) sizes[u.arg] = call.tensor_args[u.arg].sizes().vec();
      sizes[u.arg][u.dim] = values[s];
    }
  std::vector<Tensor> out(call.tensor_args.size());
  for (size_t i = 0; i < out.size(); ++i) {
    if (sizes[i].empty()) continue;
    const Tensor& example = call.tensor_args[i];
    TensorOptions o(example.dtype(), example.device());
    out[i] = is_floating_point(example.dtype()) ? randn(sizes[i], o) : zeros(sizes[i], o);
  }
  return out;
}

// Fits every integer that differs between the corner captures as a multilinear polynomial of the
// sizes (exact: the corners are one apart in each size) and checks it on `check`.
std::vector<IntSlot> fit_slots(const std::vector<Capture>& corners, const std::vector<Symbol>& symbols,
                               const Capture& check, const std::vector<int64_t>& check_values) {
  const size_t d = symbols.size();
  std::vector<IntSlot> where;
  std::vector<std::vector<int64_t>> ints(corners.size());
  collect_ints(corners[0].graph, ints[0], &where);
  for (size_t c = 1; c < corners.size(); ++c) collect_ints(corners[c].graph, ints[c], nullptr);
  std::vector<int64_t> checked;
  collect_ints(check.graph, checked, nullptr);
  std::vector<IntSlot> slots;
  for (size_t k = 0; k < where.size(); ++k) {
    bool varies = checked[k] != ints[0][k];
    for (size_t c = 1; c < corners.size() && !varies; ++c) varies = ints[c][k] != ints[0][k];
    if (!varies) continue;
    // Möbius inversion over the corners: value(corner T) = sum over S within T of c_S, where the
    // basis of S is prod over i in S of delta_i * (s_i - a_i), delta_i = grid_i - a_i = +-1.
    std::vector<__int128> coef(corners.size());
    for (uint32_t S = 0; S < corners.size(); ++S) {
      __int128 c = 0;
      for (uint32_t T = S;; T = (T - 1) & S) {
        const int sign = (__builtin_popcount(S ^ T) & 1) ? -1 : 1;
        c += sign * static_cast<__int128>(ints[T][k]);
        if (T == 0) break;
      }
      coef[S] = c;
    }
    // Expand into monomials of the sizes themselves.
    std::map<uint32_t, __int128> monomials;
    for (uint32_t S = 0; S < corners.size(); ++S) {
      if (coef[S] == 0) continue;
      __int128 scale = coef[S];
      for (size_t i = 0; i < d; ++i)
        if (S >> i & 1u) scale *= symbols[i].grid - symbols[i].spec.example;
      for (uint32_t U = S;; U = (U - 1) & S) {
        __int128 m = scale;
        for (size_t i = 0; i < d; ++i)
          if ((S & ~U) >> i & 1u) m *= -symbols[i].spec.example;
        monomials[U] += m;
        if (U == 0) break;
      }
    }
    IntSlot slot = where[k];
    for (const auto& [mask, c] : monomials) {
      if (c == 0) continue;
      if (c > std::numeric_limits<int64_t>::max() || c < std::numeric_limits<int64_t>::min())
        export_error(slot_text(corners[0].graph, slot) + " grows too fast with the dynamic sizes.");
      slot.expr.push_back(SymTerm{mask, static_cast<int64_t>(c)});
    }
    std::optional<int64_t> predicted = eval_sym(slot.expr, check_values);
    if (!predicted || *predicted != checked[k]) {
      const std::vector<DynamicDimSpec> specs = specs_of(symbols);
      export_error(slot_text(corners[0].graph, slot) + " is " + std::to_string(checked[k]) + " at " +
                   dims_text(specs, check_values) + ", not " + sym_text(slot.expr, specs) + " as the nearby sizes suggest: the graph depends on a dynamic size in "
                   "a way a program cannot follow (integer division, a branch on the size). Keep that dim static.");
    }
    slots.push_back(std::move(slot));
  }
  return slots;
}

std::string clean_weight_name(std::string name, size_t k) {
  if (name.rfind("self.", 0) == 0) return name.substr(5);
  if (name.rfind("input_", 0) == 0 || name.empty()) return "tensor_" + std::to_string(k);
  return name;
}

TensorSpec spec_of(const std::string& name, const ValueInfo& v) {
  TensorSpec s{name, v.dtype, v.device, v.sizes, {}};
  for (int64_t size : v.sizes) s.dims.push_back(std::to_string(size));
  return s;
}

}  // namespace

ExportedProgram export_program_impl(ExportCall call, ExportOptions options, std::source_location) {
  KILN_CHECK(!compiler::is_compiling(), CompileError,
             "[kiln::export_program] called inside a compiled function; export from ordinary code.");
  std::vector<std::string> arg_names;
  for (size_t i = 0; i < call.tensor_args.size(); ++i)
    arg_names.push_back(i < options.arg_names.size() ? options.arg_names[i] : "arg" + std::to_string(i));
  for (size_t i = 0; i < call.tensor_args.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (call.tensor_args[i].defined() && call.tensor_args[j].defined() &&
          call.tensor_args[i].unsafe_impl() == call.tensor_args[j].unsafe_impl())
        throw ValueError("[kiln::export_program] " + arg_names[j] + " and " + arg_names[i] +
                         " are the same tensor; pass distinct tensors (a program's inputs are separate).");
  // (For a module, compile() names its own tensors "self.*" and these are forward's arguments.)
  options.arg_names = arg_names;
  std::vector<Symbol> symbols = collect_symbols(call, options, arg_names);

  // The captures are static (the marks are what export reads, not what compile() should act on).
  std::vector<std::shared_ptr<const compiler::DimMarks>> saved_marks;
  for (const Tensor& t : call.tensor_args) {
    saved_marks.push_back(t.defined() ? t.impl().dim_marks : nullptr);
    if (t.defined()) t.impl().dim_marks.reset();
  }
  struct RestoreMarks {
    const ExportCall& call;
    std::vector<std::shared_ptr<const compiler::DimMarks>>& marks;
    ~RestoreMarks() {
      for (size_t i = 0; i < call.tensor_args.size(); ++i)
        if (call.tensor_args[i].defined()) call.tensor_args[i].impl().dim_marks = marks[i];
    }
  } restore_marks{call, saved_marks};

  std::vector<Capture> corners;
  corners.push_back(capture_once(call, options, call.tensor_args, std::vector<Tensor>(call.tensor_args.size())));
  std::vector<IntSlot> slots;
  std::vector<int64_t> check_values;
  for (const Symbol& s : symbols) check_values.push_back(s.check);
  if (!symbols.empty()) {
    const size_t n = size_t{1} << symbols.size();
    auto capture_at = [&](const std::vector<int64_t>& values) {
      std::vector<Tensor> replacement = arguments_at(call, symbols, values);
      std::vector<Tensor> args = call.tensor_args;
      for (size_t i = 0; i < args.size(); ++i)
        if (replacement[i].defined()) args[i] = replacement[i];
      const std::string at = dims_text(specs_of(symbols), values);
      Capture c;
      try {
        c = capture_once(call, options, args, replacement);
      } catch (const Error& e) {
        export_error("capturing fn at " + at + " (to learn how the graph follows the dynamic dims) failed: " + e.what() +
                     " If some dims must be equal, give them one name in ExportOptions::dynamic.");
      }
      if (std::string diff = structure_difference(corners[0], c); !diff.empty())
        export_error("the graph at " + at + " differs from the graph at the example sizes: " + diff +
                     ". A program is one graph for every size; keep that dim static.");
      return c;
    };
    for (uint32_t mask = 1; mask < n; ++mask) {
      std::vector<int64_t> values;
      for (size_t i = 0; i < symbols.size(); ++i) values.push_back(mask >> i & 1u ? symbols[i].grid : symbols[i].spec.example);
      corners.push_back(capture_at(values));
    }
    Capture check = capture_at(check_values);
    slots = fit_slots(corners, symbols, check, check_values);
  }
  Capture& base = corners[0];

  auto p = std::make_shared<Program>();
  p->name = options.name.empty() ? call.default_name : options.name;
  p->origin = "the program exported in this process";
  p->training = options.training;
  p->mode = options.mode;
  p->options = options.options;
  p->slots = std::move(slots);
  p->placeholders = base.placeholders;
  p->results = base.results;
  p->dims = specs_of(symbols);

  // Inputs: one per tensor argument.
  for (size_t i = 0; i < call.tensor_args.size(); ++i) {
    const Tensor& t = call.tensor_args[i];
    if (!t.defined()) continue;
    TensorSpec spec{arg_names[i], t.dtype(), t.device(), t.sizes().vec(), {}};
    std::vector<int> dims(static_cast<size_t>(t.dim()), -1);
    for (size_t s = 0; s < symbols.size(); ++s)
      for (const DimUse& u : symbols[s].uses)
        if (u.arg == static_cast<int>(i)) dims[u.dim] = static_cast<int>(s);
    for (size_t d = 0; d < dims.size(); ++d) spec.dims.push_back(dims[d] < 0 ? std::to_string(spec.sizes[d]) : p->dims[dims[d]].name);
    p->inputs.push_back(std::move(spec));
    p->input_dims.push_back(std::move(dims));
  }
  // Input bindings count tensor arguments only.
  std::vector<int> input_index(call.tensor_args.size(), -1);
  for (size_t i = 0, k = 0; i < call.tensor_args.size(); ++i)
    if (call.tensor_args[i].defined()) input_index[i] = static_cast<int>(k++);
  for (Binding& b : p->placeholders)
    if (b.kind == Binding::input) b.index = input_index[b.index];
  for (ResultRef& r : p->results)
    if (r.kind == ResultRef::input) r.index = input_index[r.index];

  // The graph, exactly as a package gives it back (names included), so that the kernels built here
  // are the ones a loader asks for.
  {
    Graph g = base.graph;
    g.dynamic = !p->dims.empty();
    compiler::SerializedGraph text = compiler::serialize_graph(g);
    std::map<std::string, Tensor> constants(text.constants.begin(), text.constants.end());
    p->graph = compiler::deserialize_graph(text.text, constants);
  }
  const Graph& g = p->graph;
  const std::vector<char> written = compiler::passes::internal::written_memory(g);

  // Weights: copies of the tensors the graph reads that are not arguments, laid out as captured.
  std::set<std::string> weight_names;
  for (size_t k = 0; k < g.inputs.size(); ++k) {
    Binding& b = p->placeholders[k];
    const ValueInfo& v = g.values[g.inputs[k]];
    p->written_placeholders.push_back(written[g.inputs[k]]);
    if (b.kind != Binding::weight) continue;
    std::string name = clean_weight_name(v.name, k);
    if (weight_names.count(name)) name += "_" + std::to_string(k);
    weight_names.insert(name);
    b.index = static_cast<int>(p->weights.size());
    p->weights.push_back(spec_of(name, v));
    p->weight_tensors.push_back(copy_with_layout(base.placeholder_tensors[k].detach(), v));
    p->writes_weights |= written[g.inputs[k]] != 0;
  }
  // Outputs.
  auto size_text = [&](int value, size_t d) -> std::string {
    for (const IntSlot& s : p->slots)
      if (s.kind == IntSlot::size && s.a == value && s.b == static_cast<int>(d)) return sym_text(s.expr, p->dims);
    return std::to_string(g.values[value].sizes[d]);
  };
  for (size_t r = 0; r < p->results.size(); ++r) {
    const ResultRef& ref = p->results[r];
    if (ref.kind == ResultRef::input) {
      TensorSpec s = p->inputs[ref.index];
      s.name = "output_" + std::to_string(r);
      p->outputs.push_back(std::move(s));
      continue;
    }
    const int value = g.outputs[ref.index];
    TensorSpec s = spec_of("output_" + std::to_string(r), g.values[value]);
    for (size_t d = 0; d < s.dims.size(); ++d) s.dims[d] = size_text(value, d);
    p->outputs.push_back(std::move(s));
  }

  // Build the kernels here, recording them for the package: at the example sizes, and for a
  // dynamic program at the checking sizes too (its kernels should be the same; if not, both go in).
  p->kiln_version = KILN_VERSION;
  p->created = compiler::detail::utc_now();
  {
    compiler::runtime::BundleRecorder recorder;
    std::vector<int64_t> example;
    for (const Symbol& s : symbols) example.push_back(s.spec.example);
    p->instance(example);
    if (!symbols.empty() && check_values != example) p->instance(check_values);
    // On a GPU, eager kernels that dispatched nodes use are built when first run: run the program
    // once (on copies: nothing the user or the program holds changes) so that they are recorded too.
    bool on_gpu = false;
    for (const TensorSpec& s : p->inputs) on_gpu |= s.device.is_cuda();
    for (const TensorSpec& s : p->weights) on_gpu |= s.device.is_cuda();
    if (on_gpu) {
      std::vector<Tensor> inputs;
      for (const Tensor& t : call.tensor_args)
        if (t.defined()) inputs.push_back(t.detach().clone());
      NamedTensors state;
      for (size_t k = 0; k < p->placeholders.size(); ++k)
        if (const Binding& b = p->placeholders[k]; b.kind == Binding::weight)
          state.emplace_back(p->weights[b.index].name, copy_with_layout(p->weight_tensors[b.index], g.values[g.inputs[k]]));
      ExportedProgram(p).run(inputs, state);
    }
    for (auto& l : recorder.libraries()) p->libraries.push_back(std::make_shared<const compiler::runtime::BundledLibrary>(std::move(l)));
    for (auto& b : recorder.blobs()) p->blobs.push_back(std::make_shared<const compiler::runtime::BundledBlob>(std::move(b)));
  }
  for (const auto& l : p->libraries) {
    if (p->compiler.empty()) p->compiler = l->compiler;
    if (p->cpu_features.empty()) p->cpu_features = compiler::runtime::isa_features(l->target_macros);
  }
#ifdef KILN_WITH_CUDA
  std::vector<TensorSpec> specs = p->inputs;
  specs.insert(specs.end(), p->weights.begin(), p->weights.end());
  for (const TensorSpec& w : specs)
    if (w.device.is_cuda() && p->gpu.empty()) {
      cuda::DeviceProperties props = cuda::get_device_properties(w.device.index);
      p->gpu = props.name + " (sm_" + std::to_string(props.major) + std::to_string(props.minor) + ")";
    }
#endif
  return ExportedProgram(std::move(p));
}

}  // namespace kiln::detail
