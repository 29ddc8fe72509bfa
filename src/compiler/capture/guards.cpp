// Frame guards: what a cache entry assumes about the arguments and global state, checked before
// the body runs, and Dynamo's wording when a check fails (DESIGN §2.3, spec §2.1-2.3).
#include <algorithm>
#include <limits>
#include <sstream>
#include <tuple>
#include <utility>

#include "compiler/capture/runtime.h"
#include "core/shape.h"
#include "kiln/autograd.h"

namespace kiln::compiler::detail {

namespace {

// For tensor leaf i: the first earlier tensor leaf that is the same tensor, and the first on the
// same storage (-1: none). Quadratic, without allocating: argument lists are short, and this
// runs on every call of a pure function.
std::pair<int, int> aliasing_of(const std::vector<Leaf>& leaves, size_t i) {
  if (leaves[i].kind != Leaf::tensor) return {-1, -1};
  const kiln::detail::TensorImpl& t = leaves[i].t.impl();
  for (size_t k = 0; k < i; ++k) {
    if (leaves[k].kind != Leaf::tensor) continue;
    const kiln::detail::TensorImpl& u = leaves[k].t.impl();
    if (u.storage != t.storage) continue;
    int same = &u == &t ? static_cast<int>(k) : -1;
    for (size_t j = k + 1; same < 0 && j < i; ++j)
      if (leaves[j].kind == Leaf::tensor && &leaves[j].t.impl() == &t) same = static_cast<int>(j);
    return {same, static_cast<int>(k)};
  }
  return {-1, -1};
}

}  // namespace

std::string leaf_name(const std::vector<std::string>& names, int k) {
  return k < static_cast<int>(names.size()) ? names[k] : "arg" + std::to_string(k);
}

GlobalState current_global_state() {
  return GlobalState{is_grad_enabled(), is_inference_mode_enabled(), default_dtype()};
}

namespace {

bool layout_ok(LeafGuard::Layout layout, IntArrayRef sizes, IntArrayRef strides, const std::vector<int64_t>& exact) {
  switch (layout) {
    case LeafGuard::Layout::contiguous: return kiln::detail::dense_row_major(sizes, strides);
    case LeafGuard::Layout::channels_last: return kiln::detail::is_channels_last_contiguous(sizes, strides);
    case LeafGuard::Layout::exact: return strides == IntArrayRef(exact);
  }
  return false;
}

}  // namespace

GuardSet build_guards(const std::vector<Leaf>& leaves, bool values, std::string backend,
                      const std::vector<std::vector<char>>& dynamic) {
  GuardSet g;
  g.values = values;
  g.backend = std::move(backend);
  g.global = current_global_state();
  g.leaves.reserve(leaves.size());
  for (const Leaf& l : leaves) {
    LeafGuard lg;
    lg.kind = l.kind;
    switch (l.kind) {
      case Leaf::tensor: {
        const Tensor& t = l.t;
        lg.dtype = t.dtype();
        lg.device = t.device();
        lg.requires_grad = t.requires_grad();
        lg.sizes = t.sizes().vec();
        lg.strides = t.strides().vec();
        if (g.leaves.size() < dynamic.size() && !dynamic[g.leaves.size()].empty()) {
          const std::vector<char>& dims = dynamic[g.leaves.size()];
          std::vector<char> dyn(lg.sizes.size(), 0);  // sizes 0 and 1 specialize
          for (size_t d = 0; d < lg.sizes.size(); ++d) dyn[d] = d < dims.size() && dims[d] && lg.sizes[d] >= 2;
          if (std::find(dyn.begin(), dyn.end(), 1) != dyn.end()) {
            lg.dynamic = std::move(dyn);
            lg.min_size.assign(lg.sizes.size(), 2);
            lg.max_size.assign(lg.sizes.size(), std::numeric_limits<int64_t>::max());
            if (const DimMarks* m = t.impl().dim_marks.get()) {  // mark_dynamic's range
              for (size_t d = 0; d < lg.sizes.size() && d < m->kind.size(); ++d) {
                if (m->kind[d] != DimMarks::dynamic) continue;
                lg.min_size[d] = m->min[d];
                lg.max_size[d] = m->max[d];
              }
            }
            if (kiln::detail::dense_row_major(t.sizes(), t.strides())) lg.layout = LeafGuard::Layout::contiguous;
            else if (t.dim() == 4 && kiln::detail::is_channels_last_contiguous(t.sizes(), t.strides()))
              lg.layout = LeafGuard::Layout::channels_last;
          }
        }
        break;
      }
      case Leaf::integer:
      case Leaf::boolean: lg.i = l.i; break;
      case Leaf::floating: lg.d = l.d; break;
      case Leaf::string: lg.s = *l.s; break;
      case Leaf::module:
        lg.object = l.object;
        lg.version = l.version;
        break;
      case Leaf::optimizer: lg.object = l.object; break;
      case Leaf::none: break;
    }
    g.leaves.push_back(std::move(lg));
  }
  if (values) {  // pure frames replay a graph captured with this aliasing between arguments
    for (size_t i = 0; i < leaves.size(); ++i)
      std::tie(g.leaves[i].same_as, g.leaves[i].shares_storage_with) = aliasing_of(leaves, i);
  }
  g.fail_counts = std::make_unique<std::atomic<int>[]>(g.leaves.size() + 2);
  return g;
}

namespace {

// Whether leaf `l` passes guard `g` (the checks of one leaf).
bool leaf_ok(const LeafGuard& g, const Leaf& l, bool values) {
  if (g.kind != l.kind) return false;
  switch (l.kind) {
    case Leaf::tensor: {
      const kiln::detail::TensorImpl& t = l.t.impl();
      if (t.dtype != g.dtype || t.device != g.device || t.requires_grad != g.requires_grad) return false;
      if (g.dynamic.empty()) return t.sizes == g.sizes && t.strides == g.strides;
      if (t.sizes.size() != g.sizes.size()) return false;
      for (size_t d = 0; d < g.sizes.size(); ++d)
        if (g.dynamic[d] ? t.sizes[d] < g.min_size[d] || t.sizes[d] > g.max_size[d] : t.sizes[d] != g.sizes[d])
          return false;
      return layout_ok(g.layout, t.sizes, t.strides, g.strides);
    }
    case Leaf::integer:
    case Leaf::boolean: return !values || l.i == g.i;
    case Leaf::floating: return !values || l.d == g.d || (l.d != l.d && g.d != g.d);
    case Leaf::string: return !values || *l.s == g.s;
    case Leaf::module: return l.object == g.object && l.version == g.version;
    case Leaf::optimizer: return l.object == g.object;
    case Leaf::none: return true;
  }
  return true;
}

const char* kind_name(Leaf::Kind k) {
  switch (k) {
    case Leaf::tensor: return "Tensor";
    case Leaf::integer: return "int";
    case Leaf::floating: return "float";
    case Leaf::boolean: return "bool";
    case Leaf::string: return "str";
    case Leaf::module: return "nn::Module";
    case Leaf::optimizer: return "optim::Optimizer";
    case Leaf::none: return "None";
  }
  return "?";
}

std::string python_float(double d) {
  std::ostringstream os;
  os.precision(17);
  os << d;
  std::string s = os.str();
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

// Dynamo prints sizes as Python lists: [3, 3].
std::string list_str(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

}  // namespace

int check_guards(const GuardSet& g, const std::vector<Leaf>& leaves, const std::string& backend,
                 const std::vector<char>* only) {
  const int n = static_cast<int>(g.leaves.size());
  if (g.backend != backend) return n + 1;
  if (static_cast<int>(leaves.size()) != n) return 0;  // the argument structure changed
  auto checked = [&](int i) { return !only || (i < static_cast<int>(only->size()) && (*only)[i]); };
  if (checked(n) && !(current_global_state() == g.global)) return n;
  for (int i = 0; i < n; ++i) {
    if (!checked(i)) continue;
    if (!leaf_ok(g.leaves[i], leaves[i], g.values)) return i;
    if (g.values && aliasing_of(leaves, i) != std::pair{g.leaves[i].same_as, g.leaves[i].shares_storage_with})
      return i;
  }
  return -1;
}

std::string describe_failure(const GuardSet& g, int index, const std::vector<Leaf>& leaves,
                             const std::vector<std::string>& names) {
  const int n = static_cast<int>(g.leaves.size());
  if (index == n + 1) {
    return "BACKEND_MATCH failure: the entry was compiled with backend '" + g.backend +
           "' and this call uses another (force_backend or a *_then_compile stance)";
  }
  if (index == n) {
    GlobalState now = current_global_state();
    std::string r = "GLOBAL_STATE changed:";
    if (now.grad_mode != g.global.grad_mode) r += " grad_mode";
    if (now.inference_mode != g.global.inference_mode) r += " inference_mode";
    if (now.default_dtype != g.global.default_dtype) r += " default_dtype";
    return r;
  }
  if (static_cast<int>(leaves.size()) != n) {
    return "argument structure changed: expected " + std::to_string(n) + " leaves, got " +
           std::to_string(leaves.size());
  }
  const LeafGuard& lg = g.leaves[index];
  const Leaf& l = leaves[index];
  std::string name = leaf_name(names, index);
  if (lg.kind != l.kind) {
    return "expected type of '" + name + "' to be " + kind_name(lg.kind) + ", but found " + kind_name(l.kind);
  }
  switch (l.kind) {
    case Leaf::tensor: {
      const Tensor& t = l.t;
      const std::string p = "tensor '" + name + "' ";
      if (t.dtype() != lg.dtype)
        return p + "dtype mismatch. expected " + std::string(dtype_name(lg.dtype)) + ", actual " + std::string(dtype_name(t.dtype()));
      if (t.device() != lg.device)
        return p + "device mismatch. expected " + lg.device.str() + ", actual " + t.device().str();
      if (t.requires_grad() != lg.requires_grad)
        return p + "requires_grad mismatch. expected requires_grad=" + (lg.requires_grad ? "1" : "0");
      if (t.dim() != static_cast<int64_t>(lg.sizes.size()))
        return p + "rank mismatch. expected " + std::to_string(lg.sizes.size()) + ", actual " + std::to_string(t.dim());
      for (size_t d = 0; d < lg.sizes.size(); ++d) {
        if (!lg.dynamic.empty() && lg.dynamic[d]) {
          // Dynamo's wording for a symbol's lower bound (0/1 specialization).
          const int64_t size = t.sizes()[d];
          if (size < 2)
            return "2 <= " + name + ".size()[" + std::to_string(d) + "]  # sizes 0 and 1 specialize: this entry's dim " +
                   std::to_string(d) + " is dynamic for sizes >= 2, the call has " + std::to_string(size);
          if (size < lg.min_size[d])
            return std::to_string(lg.min_size[d]) + " <= " + name + ".size()[" + std::to_string(d) + "]  # the call has " +
                   std::to_string(size);
          if (size > lg.max_size[d])
            return name + ".size()[" + std::to_string(d) + "] <= " + std::to_string(lg.max_size[d]) + "  # the call has " +
                   std::to_string(size);
          continue;
        }
        if (t.sizes()[d] != lg.sizes[d])
          return p + "size mismatch at index " + std::to_string(d) + ". expected " + std::to_string(lg.sizes[d]) +
                 ", actual " + std::to_string(t.sizes()[d]);
      }
      if (lg.layout == LeafGuard::Layout::contiguous && !layout_ok(lg.layout, t.sizes(), t.strides(), lg.strides))
        return p + "stride mismatch. expected a contiguous tensor (the entry has dynamic sizes)";
      if (lg.layout == LeafGuard::Layout::channels_last && !layout_ok(lg.layout, t.sizes(), t.strides(), lg.strides))
        return p + "stride mismatch. expected a channels_last tensor (the entry has dynamic sizes)";
      for (size_t d = 0; lg.layout == LeafGuard::Layout::exact && d < lg.strides.size(); ++d)
        if (t.strides()[d] != lg.strides[d])
          return p + "stride mismatch at index " + std::to_string(d) + ". expected " +
                 std::to_string(lg.strides[d]) + ", actual " + std::to_string(t.strides()[d]);
      if (g.values) {  // Dynamo's DUPLICATE_INPUT and NO_TENSOR_ALIASING guards
        const auto [same_as, shares] = aliasing_of(leaves, static_cast<size_t>(index));
        if (lg.same_as >= 0 && same_as != lg.same_as) return name + " is " + leaf_name(names, lg.same_as);
        if (lg.shares_storage_with < 0 && shares >= 0)
          return "Duplicate tensor found where not expected! " + p + "should not alias to anything, but is aliased";
        if (shares != lg.shares_storage_with)
          return p + "storage aliasing mismatch. expected it to share storage with '" +
                 leaf_name(names, lg.shares_storage_with) + "', actual " +
                 (shares < 0 ? std::string("it shares none") : "it shares storage with '" + leaf_name(names, shares) + "'");
        if (same_as >= 0)
          return "Duplicate tensor found where not expected! " + p + "should not be the same tensor as '" +
                 leaf_name(names, same_as) + "'";
      }
      return p + "changed";
    }
    case Leaf::integer: return name + " == " + std::to_string(lg.i);
    case Leaf::boolean: return name + " == " + (lg.i ? "True" : "False");
    case Leaf::floating: return name + " == " + python_float(lg.d);
    case Leaf::string: return name + " == '" + lg.s + "'";
    case Leaf::module:
      if (l.object != lg.object) return "module '" + name + "' is a different object (ID_MATCH)";
      return "module '" + name +
             "' structure changed (a parameter, buffer, submodule or the training flag changed since it was compiled)";
    case Leaf::optimizer: return "optimizer '" + name + "' is a different object (ID_MATCH)";
    case Leaf::none: break;
  }
  return "guard failed on '" + name + "'";
}

std::vector<std::string> describe_guards(const GuardSet& g, const std::vector<std::string>& names) {
  std::vector<std::string> out;
  out.push_back("GLOBAL_STATE: grad_mode=" + std::string(g.global.grad_mode ? "True" : "False") +
                ", inference_mode=" + (g.global.inference_mode ? "True" : "False") +
                ", default_dtype=" + std::string(dtype_name(g.global.default_dtype)));
  for (size_t i = 0; i < g.leaves.size(); ++i) {
    const LeafGuard& lg = g.leaves[i];
    std::string name = leaf_name(names, static_cast<int>(i));
    switch (lg.kind) {
      case Leaf::tensor: {
        // Dynamo prints a dynamic size (and a stride that depends on one) as None, and the
        // symbol's range as a shape-env guard.
        std::string sizes = list_str(lg.sizes), strides = list_str(lg.strides);
        if (!lg.dynamic.empty()) {
          sizes = strides = "[";
          bool depends = false;  // a stride depends on the dynamic sizes of the dims inside it
          std::vector<std::string> st(lg.sizes.size());
          for (size_t d = lg.sizes.size(); d-- > 0;) {
            st[d] = depends && lg.layout != LeafGuard::Layout::exact ? "None" : std::to_string(lg.strides[d]);
            depends |= lg.dynamic[d] != 0;
          }
          if (lg.layout == LeafGuard::Layout::channels_last) std::fill(st.begin(), st.end(), std::string("None"));
          for (size_t d = 0; d < lg.sizes.size(); ++d) {
            sizes += (d ? ", " : "") + (lg.dynamic[d] ? std::string("None") : std::to_string(lg.sizes[d]));
            strides += (d ? ", " : "") + st[d];
          }
          sizes += "]";
          strides += "]";
        }
        out.push_back("TENSOR_MATCH: check_tensor(" + name + ", " + std::string(dtype_name(lg.dtype)) + ", device=" + lg.device.str() +
                      ", requires_grad=" + (lg.requires_grad ? "True" : "False") + ", size=" + sizes +
                      ", stride=" + strides + ")");
        for (size_t d = 0; d < lg.dynamic.size(); ++d)
          if (lg.dynamic[d])
            out.push_back("SHAPE_ENV: " + std::to_string(lg.min_size[d]) + " <= " + name + ".size()[" + std::to_string(d) +
                          "]" +
                          (lg.max_size[d] == std::numeric_limits<int64_t>::max()
                               ? std::string()
                               : " <= " + std::to_string(lg.max_size[d])));
        if (lg.same_as >= 0) {
          out.push_back("DUPLICATE_INPUT: " + name + " is " + leaf_name(names, lg.same_as));
        } else if (lg.shares_storage_with >= 0) {
          out.push_back("STORAGE_OVERLAPPING: " + name + " shares storage with " + leaf_name(names, lg.shares_storage_with));
        }
        break;
      }
      case Leaf::integer:
      case Leaf::boolean:
      case Leaf::floating:
      case Leaf::string:
        if (g.values) {
          std::string v = lg.kind == Leaf::floating ? python_float(lg.d)
                          : lg.kind == Leaf::string ? "'" + lg.s + "'"
                          : lg.kind == Leaf::boolean ? (lg.i ? "True" : "False")
                                                     : std::to_string(lg.i);
          out.push_back("EQUALS_MATCH: " + name + " == " + v);
        } else {
          out.push_back(std::string("TYPE_MATCH: type(") + name + ") == " + kind_name(lg.kind));
        }
        break;
      case Leaf::module:
        out.push_back("ID_MATCH: " + name + " is the compiled module; STRUCTURE_VERSION: " + name +
                      ".structure_version() == " + std::to_string(lg.version));
        break;
      case Leaf::optimizer: out.push_back("ID_MATCH: " + name + " is the compiled optimizer"); break;
      case Leaf::none: out.push_back("CONSTANT_MATCH: " + name + " is None"); break;
    }
  }
  if (g.values) {  // the tensors no other argument aliases, as Dynamo prints them
    std::string distinct;
    int count = 0;
    for (size_t i = 0; i < g.leaves.size(); ++i)
      if (g.leaves[i].kind == Leaf::tensor && g.leaves[i].shares_storage_with < 0)
        distinct += (count++ ? ", " : "") + leaf_name(names, static_cast<int>(i));
    if (count > 1) out.push_back("NO_TENSOR_ALIASING: check_no_aliasing(" + distinct + ")");
  }
  return out;
}

}  // namespace kiln::compiler::detail
