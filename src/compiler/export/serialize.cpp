// The graph format (include/kiln/compiler/serialize.h, docs/export.md "Graph format").
#include "kiln/compiler/serialize.h"

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "compiler/graph/format.h"
#include "compiler/runtime/cache_files.h"

namespace kiln::compiler {

namespace {

using json = nlohmann::ordered_json;

constexpr std::string_view kFormatName = "kiln.graph";
// Bounds a file may not exceed: far above any real graph, low enough that nothing the loader
// builds from the numbers (meta tensors, alias groups) can overflow or exhaust memory.
constexpr int64_t kMaxSize = int64_t{1} << 48;
constexpr size_t kMaxRank = 64;

[[noreturn]] void refuse(const std::string& what) {
  throw GraphFormatError("[kiln::deserialize_graph] " + what);
}

// ---- attrs: {"kind": ..., "value": ...} ----

json double_json(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  return d;
}

double double_from(const json& j, const std::string& where) {
  if (j.is_number()) return j.get<double>();
  if (j.is_string()) {
    const std::string& s = j.get_ref<const std::string&>();
    if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
    if (s == "inf") return std::numeric_limits<double>::infinity();
    if (s == "-inf") return -std::numeric_limits<double>::infinity();
  }
  refuse(where + ": expected a number, got " + j.dump());
}

int64_t int_from(const json& j, const std::string& where) {
  if (!j.is_number_integer()) refuse(where + ": expected an integer, got " + j.dump());
  if (j.is_number_unsigned() && j.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    refuse(where + ": integer " + j.dump() + " is out of range");
  return j.get<int64_t>();
}

json attr_json(const Attr& a) {
  json j = json::object();
  std::visit(
      [&](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::monostate>) {
          j["kind"] = "none";
        } else if constexpr (std::is_same_v<T, bool>) {
          j["kind"] = "bool";
          j["value"] = v;
        } else if constexpr (std::is_same_v<T, int64_t>) {
          j["kind"] = "int";
          j["value"] = v;
        } else if constexpr (std::is_same_v<T, double>) {
          j["kind"] = "float";
          j["value"] = double_json(v);
        } else if constexpr (std::is_same_v<T, Scalar>) {
          j["kind"] = "scalar";
          if (v.is_boolean()) j["type"] = "bool", j["value"] = v.to_bool();
          else if (v.is_integral()) j["type"] = "int", j["value"] = v.to_int();
          else j["type"] = "float", j["value"] = double_json(v.to_double());
        } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
          j["kind"] = "ints";
          j["value"] = v;
        } else if constexpr (std::is_same_v<T, std::string>) {
          j["kind"] = "str";
          j["value"] = v;
        } else if constexpr (std::is_same_v<T, DType>) {
          j["kind"] = "dtype";
          j["value"] = std::string(dtype_name(v));
        } else if constexpr (std::is_same_v<T, Device>) {
          j["kind"] = "device";
          j["value"] = v.str();
        }
      },
      a);
  return j;
}

DType dtype_from(const json& j, const std::string& where) {
  if (!j.is_string()) refuse(where + ": expected a dtype name, got " + j.dump());
  try {
    return dtype_from_name(j.get_ref<const std::string&>());
  } catch (const Error&) {
    refuse(where + ": unknown dtype " + j.dump());
  }
}

Device device_from(const json& j, const std::string& where) {
  if (!j.is_string()) refuse(where + ": expected a device, got " + j.dump());
  try {
    return Device(std::string_view(j.get_ref<const std::string&>()));
  } catch (const Error&) {
    refuse(where + ": unknown device " + j.dump());
  }
}

const json& field(const json& j, const char* name, const std::string& where) {
  if (!j.is_object()) refuse(where + ": expected an object");
  auto it = j.find(name);
  if (it == j.end()) refuse(where + ": missing field '" + name + "'");
  return *it;
}

std::vector<int64_t> ints_from(const json& j, const std::string& where) {
  if (!j.is_array()) refuse(where + ": expected a list of integers, got " + j.dump());
  std::vector<int64_t> out;
  out.reserve(j.size());
  for (const json& e : j) out.push_back(int_from(e, where));
  return out;
}

Attr attr_from(const json& j, const std::string& where) {
  const json& kind_j = field(j, "kind", where);
  if (!kind_j.is_string()) refuse(where + ": attr kind must be a string");
  const std::string& kind = kind_j.get_ref<const std::string&>();
  if (kind == "none") return std::monostate{};
  const json& v = field(j, "value", where);
  if (kind == "bool") {
    if (!v.is_boolean()) refuse(where + ": expected true or false, got " + v.dump());
    return v.get<bool>();
  }
  if (kind == "int") return int_from(v, where);
  if (kind == "float") return double_from(v, where);
  if (kind == "scalar") {
    const json& type = field(j, "type", where);
    if (type == "bool") {
      if (!v.is_boolean()) refuse(where + ": expected true or false, got " + v.dump());
      return Scalar(v.get<bool>());
    }
    if (type == "int") return Scalar(int_from(v, where));
    if (type == "float") return Scalar(double_from(v, where));
    refuse(where + ": unknown scalar type " + type.dump());
  }
  if (kind == "ints") return ints_from(v, where);
  if (kind == "str") {
    if (!v.is_string()) refuse(where + ": expected a string, got " + v.dump());
    return v.get<std::string>();
  }
  if (kind == "dtype") return dtype_from(v, where);
  if (kind == "device") return device_from(v, where);
  refuse(where + ": unknown attr kind '" + kind + "'");
}

// ---- what a schema allows ----

// Which Attr alternatives a schema parameter type accepts (variant indices), as the op table's
// front-ends store them: ints for int[], SymInt[] and bool[N], a Scalar for Scalar, None for "?".
std::set<size_t> accepted_kinds(std::string type) {
  std::set<size_t> kinds;
  if (type.ends_with("?")) {
    kinds.insert(0);  // monostate
    type.pop_back();
  }
  auto index_of = [](auto tag) { return Attr(tag).index(); };
  if (type == "Scalar") kinds.insert(index_of(Scalar(0)));
  else if (type == "float") kinds.insert(index_of(0.0));
  else if (type == "int" || type == "SymInt") kinds.insert(index_of(int64_t{0}));
  else if (type == "bool") kinds.insert(index_of(false));
  else if (type == "str") kinds.insert(index_of(std::string()));
  else if (type == "ScalarType") kinds.insert(index_of(DType::float32));
  else if (type == "Device") kinds.insert(index_of(kCPU));
  else if (type.find('[') != std::string::npos) kinds.insert(index_of(std::vector<int64_t>{}));
  return kinds;
}

std::string_view kind_name(size_t index) {
  static constexpr std::string_view names[] = {"none", "bool", "int", "float", "scalar", "ints", "str", "dtype", "device"};
  return index < std::size(names) ? names[index] : "?";
}

// Arity and attr kinds of `n` against its op's schema, before anything runs its meta (a meta
// indexes inputs and reads attrs by position).
void check_against_schema(const Node& n, const std::string& where) {
  const auto params = detail::parse_schema_params(n.op->schema);
  std::vector<bool> optional_input;  // per fixed tensor position: may be None
  std::vector<std::string> attr_types;
  for (const auto& p : params) {
    if (!p.is_tensor()) attr_types.push_back(p.type);
    else if (p.type.find("[]") == std::string::npos) optional_input.push_back(p.type.ends_with("?"));
  }
  try {
    check_arity(*n.op, n.inputs.size(), n.attrs.size());
  } catch (const Error& e) {
    refuse(where + " has " + std::to_string(n.inputs.size()) + " tensor inputs and " +
           std::to_string(n.attrs.size()) + " attrs: " + e.what());
  }
  // Fixed tensor parameters come first in every schema with a list; None only where optional.
  for (size_t k = 0; k < n.inputs.size() && k < optional_input.size(); ++k)
    if (n.inputs[k] == -1 && !optional_input[k])
      refuse(where + " passes None as tensor input " + std::to_string(k) + ", which is not optional");
  for (size_t k = 0; k < n.attrs.size() && k < attr_types.size(); ++k) {
    const auto kinds = accepted_kinds(attr_types[k]);
    if (!kinds.empty() && !kinds.count(n.attrs[k].index()))
      refuse(where + " attr " + std::to_string(k) + " is a " + std::string(kind_name(n.attrs[k].index())) +
             " but the schema's parameter is " + attr_types[k]);
  }
}

void check_value(const ValueInfo& v, const std::string& where) {
  if (v.sizes.size() > kMaxRank) refuse(where + " has rank " + std::to_string(v.sizes.size()));
  if (!v.strides.empty() && v.strides.size() != v.sizes.size())
    refuse(where + " has " + std::to_string(v.sizes.size()) + " sizes but " + std::to_string(v.strides.size()) +
           " strides");
  int64_t numel = 1;
  for (int64_t s : v.sizes) {
    if (s < 0 || s > kMaxSize) refuse(where + " has size " + std::to_string(s));
    if (s != 0 && numel > kMaxSize / s) refuse(where + " has more than 2^48 elements");
    numel *= s;
  }
  for (int64_t s : v.strides)
    if (s < 0 || s > kMaxSize) refuse(where + " has stride " + std::to_string(s));
  if (v.storage_offset < 0 || v.storage_offset > kMaxSize)
    refuse(where + " has storage offset " + std::to_string(v.storage_offset));
}

int id_from(const json& j, const std::string& where, size_t bound, bool allow_none = false) {
  const int64_t v = int_from(j, where);
  if (allow_none && v == -1) return -1;
  if (v < 0 || v >= static_cast<int64_t>(bound)) refuse(where + ": id " + std::to_string(v) + " is out of range");
  return static_cast<int>(v);
}

const json& array_field(const json& j, const char* name, const std::string& where) {
  const json& a = field(j, name, where);
  if (!a.is_array()) refuse(where + ": field '" + name + "' must be a list");
  return a;
}

std::string string_field(const json& j, const char* name, const std::string& where) {
  const json& s = field(j, name, where);
  if (!s.is_string()) refuse(where + ": field '" + name + "' must be a string");
  return s.get<std::string>();
}

}  // namespace

std::string schema_version(const OpDef& op) {
  runtime::files::Sha256 sha;
  sha.update(op.schema);
  return sha.hex().substr(0, 16);
}

SerializedGraph serialize_graph(const Graph& g) {
  SerializedGraph out;
  json j = json::object();
  j["format"] = kFormatName;
  j["format_version"] = kGraphFormatVersion;
  j["dynamic"] = g.dynamic;
  json ops = json::object();
  for (const Node& n : g.nodes) {
    if (!n.op) throw GraphFormatError("[kiln::serialize_graph] node '" + n.name + "' has no op");
    ops[n.op->name] = schema_version(*n.op);
  }
  j["ops"] = std::move(ops);
  json values = json::array();
  for (const ValueInfo& v : g.values) {
    json jv = json::object();
    jv["name"] = v.name;
    jv["dtype"] = std::string(dtype_name(v.dtype));
    jv["device"] = v.device.str();
    jv["sizes"] = v.sizes;
    jv["strides"] = v.strides;
    jv["offset"] = v.storage_offset;
    jv["storage"] = v.storage;
    if (v.is_wrapped_number) jv["wrapped_number"] = true;
    values.push_back(std::move(jv));
  }
  j["values"] = std::move(values);
  j["inputs"] = g.inputs;
  json nodes = json::array();
  for (const Node& n : g.nodes) {
    json jn = json::object();
    jn["name"] = n.name;
    jn["op"] = n.op->name;
    jn["inputs"] = n.inputs;
    json attrs = json::array();
    for (const Attr& a : n.attrs) attrs.push_back(attr_json(a));
    jn["attrs"] = std::move(attrs);
    jn["outputs"] = n.outputs;
    if (n.inplace) jn["inplace"] = true;
    nodes.push_back(std::move(jn));
  }
  j["nodes"] = std::move(nodes);
  json scalars = json::array();
  for (const ScalarSlot& s : g.scalars) scalars.push_back(json::array({s.node, s.attr}));
  j["scalars"] = std::move(scalars);
  j["outputs"] = g.outputs;
  if (!g.free_layout_outputs.empty()) j["free_layout_outputs"] = g.free_layout_outputs;
  json constants = json::array();
  for (size_t k = 0; k < g.constants.size(); ++k) {
    std::string name = "constant_" + std::to_string(k);
    constants.push_back(json::object({{"value", g.constants[k].first}, {"tensor", name}}));
    out.constants.emplace_back(std::move(name), g.constants[k].second);
  }
  j["constants"] = std::move(constants);
  out.text = j.dump(1);
  return out;
}

Graph deserialize_graph(std::string_view text, const std::map<std::string, Tensor>& constants) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    refuse(std::string("the text is not valid JSON (") + e.what() + ")");
  }
  if (!j.is_object() || !j.contains("format") || j["format"] != kFormatName)
    refuse("the text is not a Kiln graph (no \"format\": \"kiln.graph\")");
  const int64_t version = int_from(field(j, "format_version", "the graph"), "format_version");
  if (version > kGraphFormatVersion)
    refuse("the graph has format version " + std::to_string(version) + ", newer than this Kiln reads (" +
           std::to_string(kGraphFormatVersion) + "); load it with the Kiln that wrote it or a newer one");
  if (version < 1) refuse("the graph has format version " + std::to_string(version) + ", which never existed");

  Graph g;
  const json& dynamic = field(j, "dynamic", "the graph");
  if (!dynamic.is_boolean()) refuse("field 'dynamic' must be true or false");
  g.dynamic = dynamic.get<bool>();

  // Ops: each must exist here with the schema the writer had.
  const json& ops = field(j, "ops", "the graph");
  if (!ops.is_object()) refuse("field 'ops' must be an object");
  std::map<std::string, const OpDef*> op_defs;
  for (const auto& [name, version_j] : ops.items()) {
    const OpDef* op = OpTable::instance().find(name);
    if (!op || op->schema.empty())
      refuse("the graph uses op '" + name + "', which this Kiln does not have (a custom op must be " +
             "registered before the graph is loaded)");
    if (!version_j.is_string() || version_j.get<std::string>() != schema_version(*op))
      refuse("the graph was written for another version of op '" + name + "' (schema version " +
             version_j.dump() + "; this Kiln has " + schema_version(*op) + ": " + op->schema + ")");
    op_defs[name] = op;
  }

  const json& values = array_field(j, "values", "the graph");
  for (size_t k = 0; k < values.size(); ++k) {
    const json& jv = values[k];
    const std::string where = "value " + std::to_string(k);
    ValueInfo v;
    v.name = string_field(jv, "name", where);
    v.dtype = dtype_from(field(jv, "dtype", where), where);
    v.device = device_from(field(jv, "device", where), where);
    v.sizes = ints_from(field(jv, "sizes", where), where);
    v.strides = ints_from(field(jv, "strides", where), where);
    v.storage_offset = int_from(field(jv, "offset", where), where);
    const int64_t storage = int_from(field(jv, "storage", where), where);
    if (storage < -1 || storage >= static_cast<int64_t>(values.size()))
      refuse(where + " names alias group " + std::to_string(storage) + ", out of range");
    v.storage = static_cast<int>(storage);
    if (auto it = jv.find("wrapped_number"); it != jv.end()) {
      if (!it->is_boolean()) refuse(where + ": field 'wrapped_number' must be true or false");
      v.is_wrapped_number = it->get<bool>();
    }
    check_value(v, where);
    g.values.push_back(std::move(v));
  }
  const size_t num_values = g.values.size();

  for (const json& id : array_field(j, "inputs", "the graph")) {
    const int v = id_from(id, "graph input", num_values);
    g.values[v].is_input = true;
    g.inputs.push_back(v);
  }

  const json& nodes = array_field(j, "nodes", "the graph");
  for (size_t k = 0; k < nodes.size(); ++k) {
    const json& jn = nodes[k];
    std::string where = "node " + std::to_string(k);
    Node n;
    n.name = string_field(jn, "name", where);
    where += " ('" + n.name + "')";
    const std::string op_name = string_field(jn, "op", where);
    auto op_it = op_defs.find(op_name);
    if (op_it == op_defs.end()) refuse(where + " calls op '" + op_name + "', which the graph's op list lacks");
    n.op = op_it->second;
    for (const json& id : array_field(jn, "inputs", where)) n.inputs.push_back(id_from(id, where + " input", num_values, true));
    const json& attrs = array_field(jn, "attrs", where);
    for (size_t a = 0; a < attrs.size(); ++a) n.attrs.push_back(attr_from(attrs[a], where + " attr " + std::to_string(a)));
    for (const json& id : array_field(jn, "outputs", where)) n.outputs.push_back(id_from(id, where + " output", num_values));
    if (auto it = jn.find("inplace"); it != jn.end()) {
      if (!it->is_boolean()) refuse(where + ": field 'inplace' must be true or false");
      n.inplace = it->get<bool>();
    }
    check_against_schema(n, where + ", op '" + op_name + "',");
    g.nodes.push_back(std::move(n));
  }

  for (const json& slot : array_field(j, "scalars", "the graph")) {
    if (!slot.is_array() || slot.size() != 2) refuse("a scalar slot must be [node, attr], got " + slot.dump());
    const int64_t node = int_from(slot[0], "scalar slot"), attr = int_from(slot[1], "scalar slot");
    if (node == -1 && attr == -1) {
      g.scalars.push_back({-1, -1});
      continue;
    }
    if (node < 0 || node >= static_cast<int64_t>(g.nodes.size()) || attr < 0 ||
        attr >= static_cast<int64_t>(g.nodes[node].attrs.size()))
      refuse("scalar slot " + slot.dump() + " names no attr of the graph");
    g.scalars.push_back({static_cast<int>(node), static_cast<int>(attr)});
  }
  for (const json& id : array_field(j, "outputs", "the graph")) g.outputs.push_back(id_from(id, "graph output", num_values));
  if (j.contains("free_layout_outputs")) {
    const json& flags = array_field(j, "free_layout_outputs", "the graph");
    if (flags.size() != g.outputs.size())
      refuse("field 'free_layout_outputs' has " + std::to_string(flags.size()) + " flags for " +
             std::to_string(g.outputs.size()) + " outputs");
    for (const json& f : flags) {
      if (!f.is_boolean()) refuse("field 'free_layout_outputs' must hold true or false, got " + f.dump());
      g.free_layout_outputs.push_back(f.get<bool>());
    }
  }

  for (const json& c : array_field(j, "constants", "the graph")) {
    const int v = id_from(field(c, "value", "a constant"), "a constant", num_values);
    const std::string name = string_field(c, "tensor", "a constant");
    auto it = constants.find(name);
    if (it == constants.end()) refuse("constant '" + name + "' (value " + std::to_string(v) + ") was not supplied");
    g.constants.emplace_back(v, it->second);
  }

  try {
    g.validate();
  } catch (const Error& e) {
    // validate()'s advice is for captured graphs; a loaded file is simply wrong.
    std::string why = e.what();
    if (const size_t bug = why.find(". This is a capture bug"); bug != std::string::npos) why.erase(bug);
    refuse("the graph is inconsistent: " + why + ".");
  }
  return g;
}

}  // namespace kiln::compiler
