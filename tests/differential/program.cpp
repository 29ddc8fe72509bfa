#include "program.h"

#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include "ops.h"

namespace kiln::differential {

Scalar HostScalar::scalar() const {
  if (integral) return Scalar(static_cast<int64_t>(value));
  return Scalar(value);
}

std::string HostScalar::str() const {
  if (integral) return std::to_string(static_cast<int64_t>(value));
  // The shortest text that reads back as the same double, always with a '.' or an exponent.
  char text[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(text, sizeof text, "%.*g", precision, value);
    if (std::strtod(text, nullptr) == value) break;
  }
  std::string s = text;
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

int64_t ValueType::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

bool is_float(DType t) {
  return kiln::is_floating_point(t);
}

std::vector<int64_t> reduced_sizes(const std::vector<int64_t>& sizes,
                                   const std::vector<int64_t>& dims, bool keepdim) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < sizes.size(); ++i) {
    bool reduced = dims.empty();
    for (int64_t d : dims) reduced |= d == static_cast<int64_t>(i);
    if (!reduced) {
      out.push_back(sizes[i]);
    } else if (keepdim) {
      out.push_back(1);
    }
  }
  return out;
}

std::vector<int64_t> base_sizes(const InputSpec& in) {
  std::vector<int64_t> base = in.sizes;
  if (in.layout == Layout::permuted) {
    for (size_t d = 0; d < base.size(); ++d) base[in.layout_dims[d]] = in.sizes[d];
  } else if (in.layout == Layout::strided) {
    for (int64_t d : in.layout_dims) base[d] = 2 * in.sizes[d] + 1;
  } else if (in.layout == Layout::expanded) {
    for (int64_t d : in.layout_dims) base[d] = 1;
  }
  return base;
}

std::string dtype_cpp(DType t) {
  switch (t) {
    case kFloat32:
      return "kFloat32";
    case kFloat64:
      return "kFloat64";
    case kInt64:
      return "kInt64";
    case kBool:
      return "kBool";
    default:
      return "DType::" + std::string(dtype_name(t));
  }
}

int result_count(OpKind kind) {
  return rule(kind).results;
}
bool is_in_place(OpKind kind) {
  return rule(kind).in_place;
}
std::string_view op_name(OpKind kind) {
  return rule(kind).name;
}

bool is_view(OpKind kind) {
  switch (kind) {
    case OpKind::transpose:
    case OpKind::permute:
    case OpKind::reshape:
    case OpKind::view:
    case OpKind::slice:
    case OpKind::select:
    case OpKind::unsqueeze:
    case OpKind::squeeze:
    case OpKind::expand:
    case OpKind::contiguous:
    case OpKind::to_dtype:
      return true;
    default:
      return false;
  }
}

namespace {

bool all_contiguous(std::span<const ValueType* const> args) {
  for (const ValueType* a : args)
    if (a && (!a->contiguous || a->overlapping)) return false;
  return true;
}

// Storage, contiguity and view flags of a new result from its kind and arguments.
void set_memory_facts(const Op& op, std::span<const ValueType* const> args, ValueType& r, int id) {
  const ValueType& x = *args[0];
  bool alias = is_view(op.kind);
  if (op.kind == OpKind::contiguous) alias = x.contiguous && !x.overlapping;
  if (op.kind == OpKind::to_dtype) alias = x.dtype == r.dtype;
  // reshape copies a tensor it cannot view; whether it can is not modelled, so it counts as a
  // view (for the in-place restrictions) that may not be contiguous.
  if (!alias) {
    r.storage = id;
    r.overlapping = false;
    r.contiguous =
        op.kind == OpKind::clone || op.kind == OpKind::contiguous || all_contiguous(args);
    r.view_of_grad = false;
    r.grad_leaf = false;
    return;
  }
  r.storage = x.storage;
  r.grad_leaf = x.grad_leaf;
  r.view_of_grad = x.view_of_grad || x.requires_grad;
  r.overlapping = x.overlapping;
  switch (op.kind) {
    case OpKind::view:
      r.contiguous = true;
      break;
    case OpKind::reshape:
    case OpKind::unsqueeze:
    case OpKind::squeeze:
    case OpKind::contiguous:
    case OpKind::to_dtype:
      r.contiguous = x.contiguous;
      break;
    case OpKind::expand:
      r.contiguous = x.contiguous && r.numel() == x.numel();
      r.overlapping = x.overlapping || r.numel() != x.numel();
      break;
    default:
      r.contiguous = false;
      break;
  }
  if (op.kind == OpKind::contiguous || op.kind == OpKind::to_dtype) r.view_of_grad = x.view_of_grad;
}

}  // namespace

Inference infer(const Program& program) {
  Inference inf;
  auto fail = [&](std::string why) {
    inf.error = std::move(why);
    return inf;
  };
  for (size_t i = 0; i < program.inputs.size(); ++i) {
    const InputSpec& in = program.inputs[i];
    ValueType v;
    v.sizes = in.sizes;
    v.dtype = in.dtype;
    for (int64_t s : in.sizes)
      if (s < 1) return fail("input " + std::to_string(i) + " has an empty dim");
    if (in.requires_grad && !is_float(in.dtype))
      return fail("an integral input cannot require grad");
    v.requires_grad = in.requires_grad;
    v.grad_leaf = in.requires_grad;
    v.storage = static_cast<int>(i);
    v.overlapping = in.layout == Layout::expanded;
    v.contiguous = in.layout == Layout::contiguous;
    inf.values.push_back(v);
  }
  for (size_t k = 0; k < program.ops.size(); ++k) {
    const Op& op = program.ops[k];
    const OpRule& r = rule(op.kind);
    const int first = static_cast<int>(inf.values.size());
    inf.first_result.push_back(first);
    std::vector<const ValueType*> args;
    for (size_t a = 0; a < op.args.size(); ++a) {
      int id = op.args[a];
      if (id < -1 || id >= first)
        return fail("op " + std::to_string(k) + " reads an undefined value");
      // Only optional tensors (biases, batch-norm weights) may be absent.
      if (id == -1 && !(a >= 2 && (op.kind == OpKind::linear || op.kind == OpKind::conv2d)) &&
          !(a >= 3 && op.kind == OpKind::batch_norm))
        return fail("op " + std::to_string(k) + " lacks a required tensor");
      args.push_back(id >= 0 ? &inf.values[id] : nullptr);
    }
    if (args.empty() || !args[0]) return fail("op " + std::to_string(k) + " has no input");
    std::vector<ValueType> results;
    if (std::string e = r.infer(op, args, results); !e.empty())
      return fail("op " + std::to_string(k) + " (" + std::string(r.name) + "): " + e);
    if (r.in_place) {
      // The target (and everything sharing its memory) now holds the written value.
      int storage = args[0]->storage;
      bool grad = results[0].requires_grad;
      for (ValueType& v : inf.values)
        if (v.storage == storage) v.requires_grad = v.requires_grad || grad;
    } else {
      for (size_t j = 0; j < results.size(); ++j)
        set_memory_facts(op, args, results[j], first + static_cast<int>(j));
    }
    for (ValueType& v : results) inf.values.push_back(std::move(v));
  }
  if (program.outputs.empty()) return fail("the program returns nothing");
  for (const Output& out : program.outputs)
    if (out.value < 0 || out.value >= static_cast<int>(inf.values.size()))
      return fail("an output is not a value");
  return inf;
}

MergedProgram merge(const std::vector<Program>& members) {
  MergedProgram m;
  m.program.seed = members.empty() ? 0 : members.front().seed;
  // Inputs first (the value table's order), then each member's ops.
  for (const Program& p : members) {
    m.first_input.push_back(m.program.inputs.size());
    m.program.inputs.insert(m.program.inputs.end(), p.inputs.begin(), p.inputs.end());
  }
  int next_result = static_cast<int>(m.program.inputs.size());
  for (size_t i = 0; i < members.size(); ++i) {
    const Program& p = members[i];
    const int inputs = static_cast<int>(p.inputs.size());
    const int result_base = next_result;
    auto remap = [&](int id) {
      if (id < 0) return id;
      return id < inputs ? static_cast<int>(m.first_input[i]) + id : result_base + (id - inputs);
    };
    for (Op op : p.ops) {
      for (int& a : op.args) a = remap(a);
      next_result += result_count(op.kind);
      m.program.ops.push_back(std::move(op));
    }
    m.first_output.push_back(m.program.outputs.size());
    for (Output out : p.outputs) {
      out.value = remap(out.value);
      m.program.outputs.push_back(out);
    }
  }
  return m;
}

std::vector<bool> live_ops(const Program& program) {
  Inference inf = infer(program);
  std::vector<bool> live(program.ops.size(), false);
  if (!inf.ok()) return std::vector<bool>(program.ops.size(), true);
  const int num_inputs = static_cast<int>(program.inputs.size());
  // A value is needed when it is returned; an op is live when it makes a needed value, or writes
  // memory that an input or a needed value shares (in place or as batch_norm's running stats).
  std::vector<bool> needed(inf.values.size(), false);
  for (const Output& out : program.outputs) needed[out.value] = true;
  auto storage_needed = [&](int storage) {
    if (storage < num_inputs) return true;
    for (size_t v = 0; v < needed.size(); ++v)
      if (needed[v] && inf.values[v].storage == storage) return true;
    return false;
  };
  for (int k = static_cast<int>(program.ops.size()) - 1; k >= 0; --k) {
    const Op& op = program.ops[k];
    int first = inf.first_result[k];
    bool makes_needed = false;
    for (int j = 0; j < result_count(op.kind); ++j) makes_needed |= needed[first + j];
    bool writes_needed = is_in_place(op.kind) && storage_needed(inf.values[op.args[0]].storage);
    if (op.kind == OpKind::batch_norm && op.ints[0])
      writes_needed |= storage_needed(inf.values[op.args[1]].storage) ||
                       storage_needed(inf.values[op.args[2]].storage);
    if (!makes_needed && !writes_needed) continue;
    live[k] = true;
    for (int a : op.args)
      if (a >= 0) needed[a] = true;
    // A view's base must be computed too: it is the memory the view reads.
    for (int a : op.args)
      if (a >= 0) needed[inf.values[a].storage] = true;
  }
  return live;
}

namespace {

std::string sizes_text(const std::vector<int64_t>& sizes) {
  std::string s = "{";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "}";
}

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::contiguous:
      return "contiguous";
    case Layout::permuted:
      return "permuted";
    case Layout::strided:
      return "strided";
    case Layout::expanded:
      return "expanded";
  }
  return "?";
}

// The value names the printed program uses: inputs in0.., results v<id>; an in-place result
// keeps its target's name, since it is the same tensor.
std::vector<std::string> value_names(const Program& program) {
  // Built with += (GCC 12 warns falsely on `"v" + std::to_string(k)` here).
  auto name = [](const char* prefix, size_t k) {
    std::string s = prefix;
    s += std::to_string(k);
    return s;
  };
  std::vector<std::string> names;
  for (size_t i = 0; i < program.inputs.size(); ++i) names.push_back(name("in", i));
  for (const Op& op : program.ops) {
    if (is_in_place(op.kind)) {
      names.push_back(
          op.args[0] >= 0 && op.args[0] < static_cast<int>(names.size()) ? names[op.args[0]] : "?");
      continue;
    }
    for (int j = 0; j < result_count(op.kind); ++j) names.push_back(name("v", names.size()));
  }
  return names;
}

}  // namespace

std::string describe(const Program& program) {
  std::ostringstream os;
  os << program.inputs.size() << " inputs (";
  for (size_t i = 0; i < program.inputs.size(); ++i) {
    const InputSpec& in = program.inputs[i];
    os << (i ? ", " : "") << dtype_name(in.dtype) << sizes_text(in.sizes);
    if (in.layout != Layout::contiguous) os << " " << layout_name(in.layout);
    if (in.requires_grad) os << " grad";
  }
  os << "), " << program.ops.size() << " ops (";
  for (size_t k = 0; k < program.ops.size(); ++k)
    os << (k ? ", " : "") << op_name(program.ops[k].kind);
  os << ")";
  return os.str();
}

std::string program_function_cpp(const Program& program) {
  std::vector<std::string> names = value_names(program);
  std::ostringstream os;
  os << "Ts program(const Ts& in) {\n";
  for (size_t i = 0; i < program.inputs.size(); ++i)
    os << "  Tensor in" << i << " = in[" << i << "];\n";
  int id = static_cast<int>(program.inputs.size());
  for (const Op& op : program.ops) {
    std::vector<std::string> args;
    for (int a : op.args) args.push_back(a >= 0 ? names[a] : "Tensor()");
    std::string text = rule(op.kind).print(op, args);
    if (is_in_place(op.kind)) {
      os << "  " << text << ";\n";
    } else if (result_count(op.kind) == 2) {
      os << "  auto [" << names[id] << ", " << names[id + 1] << "] = " << text << ";\n";
    } else {
      os << "  Tensor " << names[id] << " = " << text << ";\n";
    }
    id += result_count(op.kind);
  }
  os << "  return {";
  for (size_t i = 0; i < program.outputs.size(); ++i)
    os << (i ? ", " : "") << names[program.outputs[i].value];
  os << "};\n}\n";
  return os.str();
}

std::string make_inputs_cpp(const Program& program) {
  std::ostringstream os;
  os << "// The harness's inputs: float32 data in [-2, 2] (variances in [0.5, 2]), int64 in [-3, "
        "3],\n"
        "// each made row-major and then viewed into its layout.\n";
  os << "Ts make_inputs() {\n";
  for (size_t i = 0; i < program.inputs.size(); ++i) {
    const InputSpec& in = program.inputs[i];
    os << "  manual_seed(" << in.data_seed << ");\n";
    const std::vector<int64_t> base = base_sizes(in);
    std::string data;
    if (is_float(in.dtype)) {
      data = in.domain == Domain::positive ? "rand(" + sizes_text(base) + ") * 1.5 + 0.5"
                                           : "rand(" + sizes_text(base) + ") * 4 - 2";
      if (in.dtype != kFloat32) data = "(" + data + ").to(" + dtype_cpp(in.dtype) + ")";
    } else if (in.dtype == kBool) {
      data = "rand(" + sizes_text(base) + ") < 0.5";
    } else {
      data = "randint(-3, 4, " + sizes_text(base) + ")";
      if (in.dtype != kInt64) data = "(" + data + ").to(" + dtype_cpp(in.dtype) + ")";
    }
    std::string view;
    if (in.layout == Layout::permuted) {
      // base dim layout_dims[d] becomes dim d
      view = ".permute(" + sizes_text(in.layout_dims) + ")";
    } else if (in.layout == Layout::strided) {
      for (int64_t d : in.layout_dims)
        view += ".slice(" + std::to_string(d) + ", 1, " + std::to_string(base[d]) + ", 2)";
    } else if (in.layout == Layout::expanded) {
      view = ".expand(" + sizes_text(in.sizes) + ")";
    }
    std::string grad = in.requires_grad ? ".requires_grad_()" : "";
    os << "  Tensor in" << i << " = ";
    if (view.empty() && grad.empty()) {
      os << data << ";\n";
    } else {
      os << "(" << data << ")" << view << grad << ";\n";
    }
  }
  os << "  return {";
  for (size_t i = 0; i < program.inputs.size(); ++i) os << (i ? ", " : "") << "in" << i;
  os << "};\n}\n";
  return os.str();
}

}  // namespace kiln::differential
