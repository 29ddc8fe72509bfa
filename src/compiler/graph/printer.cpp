// Printing a Graph: the FX-style table (print_tabular), the code form (str) and Graphviz (dot).
//
// Value names: ValueInfo::name when set. Otherwise the outputs of a node are named after it: a
// single output takes the node's name ("sin"), the outputs of a multi-output node are indexed like
// FX's getitem ("max[0]", "max[1]"; brackets cannot clash with a node name). Values written by
// in-place nodes keep their name. Constants (Graph::constants) are FX's get_attr rows, named
// "_tensor_constant<k>" by their index and listed before the calls; str() shows the value of a
// one-element constant. Anything else is "v<id>". Scalar slots print as "s<k>" (their
// example value is in the placeholder's comment in str()). Attrs are named after the op schema's
// non-Tensor parameters ("attr<k>" past its end) and printed in Python syntax (1, 0.5, 1e-05,
// True, None, [1, 2], 'tanh'); dtypes and devices print as Kiln names (float32, cpu). In-place
// nodes (opcode call_inplace) show their targets as an extra 'out' kwarg, like an out= call.
#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <ostream>
#include <sstream>

#include "compiler/capture/capture.h"
#include "compiler/graph/format.h"
#include "kiln/detail/tensor_impl.h"

namespace kiln::compiler {

namespace detail {

std::string_view short_dtype_name(DType t) {
  switch (t) {
    case DType::bool_:
      return "b8";
    case DType::uint8:
      return "u8";
    case DType::int8:
      return "i8";
    case DType::int32:
      return "i32";
    case DType::int64:
      return "i64";
    case DType::float16:
      return "f16";
    case DType::bfloat16:
      return "bf16";
    case DType::float32:
      return "f32";
    case DType::float64:
      return "f64";
  }
  return "?";
}

std::string type_str(DType t, const std::vector<int64_t>& sizes) {
  std::string s(short_dtype_name(t));
  s += '[';
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(sizes[i]);
  }
  s += ']';
  return s;
}

std::string type_str(const ValueInfo& v) {
  return type_str(v.dtype, v.sizes);
}


std::vector<std::string> attr_names(const OpDef& op) {
  std::vector<std::string> names;
  for (const SchemaParam& p : parse_schema_params(op.schema))
    if (!p.is_tensor()) names.push_back(p.name);
  return names;
}

std::string identifier_from(std::string_view op_name) {
  std::string s(op_name);
  for (char& c : s) {
    bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
    if (!ok) c = '_';
  }
  if (s.empty() || (s[0] >= '0' && s[0] <= '9')) s.insert(s.begin(), '_');
  return s;
}

int64_t suffix_after(std::string_view name, std::string_view base) {
  if (!name.starts_with(base)) return -1;
  if (name.size() == base.size()) return 0;
  if (name.size() < base.size() + 2 || name[base.size()] != '_') return -1;
  std::string_view digits = name.substr(base.size() + 1);
  int64_t k = -1;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), k);
  if (ec != std::errc() || end != digits.data() + digits.size()) return -1;
  return k;
}

}  // namespace detail

namespace {

// prefix + k ("s0", "n12"); a function because GCC 12 warns falsely on `"s" + std::to_string(k)`.
std::string numbered(const char* prefix, size_t k) {
  std::string s(prefix);
  s += std::to_string(k);
  return s;
}

// Python's repr of a float: shortest round trip, fixed notation for 1e-4 <= |x| < 1e16.
std::string python_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  (void)ec;
  std::string_view sci(buf, end - buf);  // "-1.2345e-05"
  size_t e = sci.find('e');
  std::string_view mantissa = sci.substr(0, e);
  int exponent = 0;
  std::from_chars(sci.data() + e + 1 + (sci[e + 1] == '+'), sci.data() + sci.size(), exponent);
  bool negative = mantissa.front() == '-';
  if (negative) mantissa.remove_prefix(1);
  std::string digits;
  for (char c : mantissa)
    if (c != '.') digits += c;
  std::string out = negative ? "-" : "";
  if (exponent >= -4 && exponent < 16) {
    if (exponent < 0) {
      out += "0." + std::string(-exponent - 1, '0') + digits;
    } else if (static_cast<size_t>(exponent) + 1 >= digits.size()) {
      out += digits + std::string(exponent + 1 - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, exponent + 1) + "." + digits.substr(exponent + 1);
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  out += exponent < 0 ? "e-" : "e+";
  int a = std::abs(exponent);
  if (a < 10) out += '0';
  out += std::to_string(a);
  return out;
}

std::string python_string(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'' || c == '\\') out += '\\';
    out += c;
  }
  return out + "'";
}

std::string attr_repr(const Attr& a) {
  return std::visit(
      [](const auto& v) -> std::string {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::monostate>) {
          return "None";
        } else if constexpr (std::is_same_v<T, bool>) {
          return v ? "True" : "False";
        } else if constexpr (std::is_same_v<T, int64_t>) {
          return std::to_string(v);
        } else if constexpr (std::is_same_v<T, double>) {
          return python_float(v);
        } else if constexpr (std::is_same_v<T, Scalar>) {
          if (v.is_boolean()) return v.to_bool() ? "True" : "False";
          if (v.is_integral()) return std::to_string(v.to_int());
          return python_float(v.to_double());
        } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
          std::string s = "[";
          for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
          return s + "]";
        } else if constexpr (std::is_same_v<T, std::string>) {
          return python_string(v);
        } else if constexpr (std::is_same_v<T, DType>) {
          return std::string(dtype_name(v));
        } else {
          return v.str();  // Device
        }
      },
      a);
}

// " = 1e-05" for a one-element constant (a decomposition's host scalar, a folded value), else "".
std::string constant_value(const Tensor& t) {
  if (!t.defined() || t.numel() != 1 || t.impl().lazy) return "";
  detail::SuspendCapture no_capture;  // reading a constant is not a host read of the user's code
  return " = " + attr_repr(Attr(t.item()));
}

// Everything the printers share, computed once per print.
struct Names {
  std::vector<std::string> values;
  std::vector<std::vector<int>> node_slots;  // per node: scalar slot index per attr, -1 if none
  std::vector<std::vector<std::string>> attr_names;

  explicit Names(const Graph& g)
      : values(g.values.size()), node_slots(g.nodes.size()), attr_names(g.nodes.size()) {
    for (size_t i = 0; i < g.nodes.size(); ++i) {
      const Node& n = g.nodes[i];
      node_slots[i].assign(n.attrs.size(), -1);
      if (n.op) attr_names[i] = detail::attr_names(*n.op);
      if (n.inplace) continue;
      for (size_t k = 0; k < n.outputs.size(); ++k) {
        int v = n.outputs[k];
        if (v < 0 || static_cast<size_t>(v) >= values.size()) continue;
        values[v] = n.outputs.size() == 1 ? n.name : n.name + "[" + std::to_string(k) + "]";
      }
    }
    for (size_t k = 0; k < g.constants.size(); ++k) {
      int v = g.constants[k].first;
      if (v >= 0 && static_cast<size_t>(v) < values.size()) values[v] = numbered("_tensor_constant", k);
    }
    for (size_t v = 0; v < values.size(); ++v) {
      if (!g.values[v].name.empty()) values[v] = g.values[v].name;
      if (values[v].empty()) values[v] = numbered("v", v);
    }
    for (size_t k = 0; k < g.scalars.size(); ++k) {
      const ScalarSlot& s = g.scalars[k];
      if (s.node >= 0 && static_cast<size_t>(s.node) < node_slots.size() && s.attr >= 0 &&
          static_cast<size_t>(s.attr) < node_slots[s.node].size())
        node_slots[s.node][s.attr] = static_cast<int>(k);
    }
  }

  std::string value(int v) const {
    if (v == -1) return "None";
    if (v < 0 || static_cast<size_t>(v) >= values.size())
      return "<bad value " + std::to_string(v) + ">";
    return values[v];
  }
  std::string attr_name(size_t node, size_t k) const {
    return k < attr_names[node].size() ? attr_names[node][k] : numbered("attr", k);
  }
  std::string attr(const Graph& g, size_t node, size_t k) const {
    int slot = node_slots[node][k];
    return slot >= 0 ? numbered("s", slot) : attr_repr(g.nodes[node].attrs[k]);
  }
};

// A Python tuple of names: "()", "(x,)", "(x, y)".
std::string tuple_repr(const std::vector<int>& ids, const Names& names, const char* prefix = "") {
  std::string s = "(";
  for (size_t i = 0; i < ids.size(); ++i)
    s += (i ? ", " : "") + std::string(prefix) + names.value(ids[i]);
  if (ids.size() == 1) s += ",";
  return s + ")";
}

std::string node_types(const Graph& g, const Node& n) {
  auto one = [&](int v) {
    return v >= 0 && static_cast<size_t>(v) < g.values.size() ? detail::type_str(g.values[v])
                                                              : std::string("?");
  };
  if (n.outputs.size() == 1) return one(n.outputs[0]);
  std::string s = "(";
  for (size_t k = 0; k < n.outputs.size(); ++k) s += (k ? ", " : "") + one(n.outputs[k]);
  return s + ")";
}

std::string dot_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

std::vector<detail::TabularRow> detail::tabular_rows(const Graph& g) {
  Names names(g);
  std::vector<TabularRow> rows;
  auto value_names = [&](const std::vector<int>& ids) {
    std::vector<std::string> out;
    for (int v : ids) out.push_back(names.value(v));
    return out;
  };
  auto value_type = [&](int v) {
    return v >= 0 && static_cast<size_t>(v) < g.values.size() ? detail::type_str(g.values[v]) : std::string("?");
  };
  for (int v : g.inputs)
    rows.push_back({"placeholder", names.value(v), names.value(v), "()", "{}", value_type(v), {}, {names.value(v)}});
  for (size_t k = 0; k < g.scalars.size(); ++k) {
    std::string s = numbered("s", k);
    rows.push_back({"placeholder", s, s, "()", "{}", "scalar", {}, {s}});
  }
  for (const auto& c : g.constants)
    rows.push_back({"get_attr", names.value(c.first), names.value(c.first), "()", "{}", value_type(c.first), {},
                    {names.value(c.first)}});
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    std::string kwargs = "{";
    for (size_t k = 0; k < n.attrs.size(); ++k)
      kwargs += (k ? ", " : "") + python_string(names.attr_name(i, k)) + ": " + names.attr(g, i, k);
    if (n.inplace) {
      kwargs += n.attrs.empty() ? "'out': " : ", 'out': ";
      kwargs += n.outputs.size() == 1 ? names.value(n.outputs[0]) : tuple_repr(n.outputs, names);
    }
    kwargs += "}";
    TabularRow row{n.inplace ? "call_inplace" : "call_function", n.name, n.op ? n.op->name : "?",
                   tuple_repr(n.inputs, names), std::move(kwargs), node_types(g, n), value_names(n.inputs),
                   value_names(n.outputs)};
    row.node = static_cast<int>(i);
    rows.push_back(std::move(row));
  }
  rows.push_back({"output", "output", "output", "(" + tuple_repr(g.outputs, names) + ",)", "{}", "",
                  value_names(g.outputs), {}});
  return rows;
}

void Graph::print_tabular(std::ostream& os) const {
  std::vector<std::array<std::string, 5>> rows;
  rows.push_back({"opcode", "name", "target", "args", "kwargs"});
  for (detail::TabularRow& r : detail::tabular_rows(*this))
    rows.push_back({std::move(r.opcode), std::move(r.name), std::move(r.target), std::move(r.args), std::move(r.kwargs)});

  std::array<size_t, 5> width{};
  for (const auto& r : rows)
    for (size_t c = 0; c < 5; ++c) width[c] = std::max(width[c], r[c].size());
  auto line = [&](const std::array<std::string, 5>& r) {
    std::string s;
    for (size_t c = 0; c < 5; ++c) {
      s += r[c];
      if (c + 1 < 5) s += std::string(width[c] - r[c].size() + 2, ' ');
    }
    while (!s.empty() && s.back() == ' ') s.pop_back();
    os << s << '\n';
  };
  line(rows[0]);
  std::array<std::string, 5> dashes;
  for (size_t c = 0; c < 5; ++c) dashes[c] = std::string(width[c], '-');
  line(dashes);
  for (size_t r = 1; r < rows.size(); ++r) line(rows[r]);
}

std::string Graph::tabular() const {
  std::ostringstream os;
  print_tabular(os);
  return os.str();
}

std::string Graph::str() const {
  Names names(*this);
  std::ostringstream os;
  for (int v : inputs) {
    os << '%' << names.value(v) << " = placeholder()  # "
       << (v >= 0 && static_cast<size_t>(v) < values.size() ? detail::type_str(values[v]) : "?")
       << '\n';
  }
  for (size_t k = 0; k < scalars.size(); ++k) {
    const ScalarSlot& s = scalars[k];
    os << "%s" << k << " = scalar()";
    if (s.node >= 0 && static_cast<size_t>(s.node) < nodes.size() && s.attr >= 0 &&
        static_cast<size_t>(s.attr) < nodes[s.node].attrs.size())
      os << "  # " << nodes[s.node].name << '.' << names.attr_name(s.node, s.attr) << " = "
         << attr_repr(nodes[s.node].attrs[s.attr]);
    os << '\n';
  }
  for (const auto& [v, t] : constants) {
    os << '%' << names.value(v) << " = get_attr()  # "
       << (v >= 0 && static_cast<size_t>(v) < values.size() ? detail::type_str(values[v]) : "?")
       << constant_value(t) << '\n';
  }
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = nodes[i];
    std::string call = (n.op ? n.op->name : "?") + "(";
    bool first = true;
    auto arg = [&](const std::string& a) {
      call += (first ? "" : ", ") + a;
      first = false;
    };
    for (int v : n.inputs) {
      std::string a = v == -1 ? "None" : "%";
      if (v != -1) a += names.value(v);
      arg(a);
    }
    for (size_t k = 0; k < n.attrs.size(); ++k) {
      int slot = names.node_slots[i][k];
      arg(names.attr_name(i, k) + "=" + (slot >= 0 ? numbered("%s", slot) : attr_repr(n.attrs[k])));
    }
    if (n.inplace) {
      std::string out;
      for (size_t k = 0; k < n.outputs.size(); ++k)
        out += (k ? ", %" : "%") + names.value(n.outputs[k]);
      arg("out=" + (n.outputs.size() == 1 ? out : "(" + out + ")"));
      os << call << ")  # " << n.name << " (in place): " << node_types(*this, n) << '\n';
      continue;
    }
    std::string lhs;
    bool indexed = n.outputs.size() > 1;
    for (size_t k = 0; k < n.outputs.size() && indexed; ++k)
      indexed = names.value(n.outputs[k]) == n.name + "[" + std::to_string(k) + "]";
    if (indexed) {
      lhs = "%" + n.name;
    } else {
      for (size_t k = 0; k < n.outputs.size(); ++k)
        lhs += (k ? ", %" : "%") + names.value(n.outputs[k]);
    }
    if (!lhs.empty()) os << lhs << " = ";
    os << call << ")";
    if (!n.outputs.empty()) os << "  # " << node_types(*this, n);
    os << '\n';
  }
  os << "return " << tuple_repr(outputs, names, "%") << '\n';
  return os.str();
}

std::string Graph::dot() const {
  Names names(*this);
  std::ostringstream os;
  os << "digraph kiln_graph {\n  node [shape=box, fontname=\"monospace\"];\n";
  // The node that last wrote each value: "in<k>", "n<i>", or empty.
  std::vector<std::string> writer(values.size());
  for (size_t k = 0; k < inputs.size(); ++k) {
    int v = inputs[k];
    if (v < 0 || static_cast<size_t>(v) >= values.size()) continue;
    writer[v] = numbered("in", k);
    os << "  " << writer[v] << " [shape=ellipse, label=\"" << dot_escape(names.value(v)) << "\\n"
       << detail::type_str(values[v]) << "\"];\n";
  }
  for (size_t k = 0; k < constants.size(); ++k) {
    int v = constants[k].first;
    if (v < 0 || static_cast<size_t>(v) >= values.size()) continue;
    writer[v] = numbered("c", k);
    os << "  " << writer[v] << " [shape=ellipse, style=dashed, label=\"" << dot_escape(names.value(v))
       << "\\n" << detail::type_str(values[v]) << "\"];\n";
  }
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = nodes[i];
    std::string id = numbered("n", i);
    os << "  " << id << " [label=\"" << dot_escape(n.name) << "\\n"
       << dot_escape(n.op ? n.op->name : "?") << (n.inplace ? " (in place)" : "") << "\\n"
       << node_types(*this, n) << "\"];\n";
    std::vector<std::string> sources;
    auto edge_from = [&](int v) {
      if (v < 0 || static_cast<size_t>(v) >= writer.size() || writer[v].empty()) return;
      if (std::find(sources.begin(), sources.end(), writer[v]) != sources.end()) return;
      sources.push_back(writer[v]);
      os << "  " << writer[v] << " -> " << id << ";\n";
    };
    for (int v : n.inputs) edge_from(v);
    if (n.inplace)
      for (int v : n.outputs) edge_from(v);  // the value it overwrites
    for (int v : n.outputs)
      if (v >= 0 && static_cast<size_t>(v) < writer.size()) writer[v] = id;
  }
  os << "  output [shape=ellipse];\n";
  std::vector<std::string> sources;
  for (int v : outputs) {
    if (v < 0 || static_cast<size_t>(v) >= writer.size() || writer[v].empty()) continue;
    if (std::find(sources.begin(), sources.end(), writer[v]) != sources.end()) continue;
    sources.push_back(writer[v]);
    os << "  " << writer[v] << " -> output;\n";
  }
  os << "}\n";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Graph& g) {
  return os << g.str();
}

}  // namespace kiln::compiler
