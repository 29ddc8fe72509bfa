// kiln::nn::Module: registration, traversal, mode, in-place conversion, state dicts, printing.
#include "kiln/nn/module.h"

#include <cxxabi.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <ostream>
#include <sstream>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>

#include "kiln/autograd.h"
#include "kiln/ops.h"

namespace kiln::nn {

namespace {

// Structure stamps come from one process-wide counter, so a change anywhere gives the changed
// module a stamp larger than every existing one, and the tree's maximum stamp strictly grows.
std::atomic<uint64_t> g_structure_epoch{0};
uint64_t next_stamp() {
  return g_structure_epoch.fetch_add(1, std::memory_order_relaxed) + 1;
}

// "kiln::nn::Linear" -> "Linear", "(anonymous namespace)::Net" -> "Net", "ns::Box<ns::T>" ->
// "Box<ns::T>".
std::string unqualified(const std::string& name) {
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i < name.size(); ++i) {
    char c = name[i];
    if (c == '<' || c == '(')
      ++depth;
    else if (c == '>' || c == ')')
      --depth;
    else if (depth == 0 && c == ':' && i + 1 < name.size() && name[i + 1] == ':')
      start = i + 2;
  }
  return name.substr(start);
}

std::string demangle(const char* mangled) {
  int status = 0;
  char* out = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string result = (status == 0 && out) ? out : mangled;
  std::free(out);
  return result;
}

// PyTorch's _addindent: indents every line but the first.
std::string add_indent(const std::string& s, int spaces) {
  if (s.find('\n') == std::string::npos) return s;
  std::string out;
  out.reserve(s.size() + 16);
  const std::string pad(static_cast<size_t>(spaces), ' ');
  for (char c : s) {
    out += c;
    if (c == '\n') out += pad;
  }
  return out;
}

// Moves the data of `src` into the TensorImpl behind `dst`, so that every handle sharing that
// impl (a layer's `weight` member, the registry, the optimizer's list) sees the new storage,
// sizes, strides, dtype and device. Autograd identity (requires_grad, grad hooks) is kept.
void assign_tensor_data(const Tensor& dst, const Tensor& src) {
  kiln::detail::TensorImpl& d = dst.impl();
  const kiln::detail::TensorImpl& s = src.impl();
  d.storage = s.storage;
  d.storage_offset = s.storage_offset;
  d.sizes = s.sizes;
  d.strides = s.strides;
  d.numel = s.numel;
  d.dtype = s.dtype;
  d.device = s.device;
  d.is_contiguous = s.is_contiguous;
  d.lazy = s.lazy;
}

const char* const kLoadTag = "[kiln::load_state_dict] ";

}  // namespace

std::string python_float_repr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == 0) return std::signbit(v) ? "-0.0" : "0.0";
  // Shortest round-trip digits, then Python's layout: fixed for 1e-4 <= |v| < 1e16.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  const size_t e_pos = sci.find('e');
  const int exponent = std::stoi(sci.substr(e_pos + 1));
  std::string digits = sci.substr(0, e_pos);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  std::string out;
  if (exponent >= -4 && exponent < 16) {
    if (exponent >= 0) {
      const size_t int_len = static_cast<size_t>(exponent) + 1;
      if (digits.size() <= int_len) {
        out = digits + std::string(int_len - digits.size(), '0') + ".0";
      } else {
        out = digits.substr(0, int_len) + "." + digits.substr(int_len);
      }
    } else {
      out = "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    std::string exp_digits = std::to_string(std::abs(exponent));
    if (exp_digits.size() < 2) exp_digits = "0" + exp_digits;
    out += std::string("e") + (exponent < 0 ? "-" : "+") + exp_digits;
  }
  return sign + out;
}

Module::Module() : structure_stamp_(next_stamp()) {}
Module::~Module() = default;

std::string Module::name() const {
  return unqualified(demangle(typeid(*this).name()));
}

Tensor Module::forward(const Tensor&) {
  throw Error("[kiln::nn::Module] Module [" + name() +
              "] is missing the required \"forward\" function for one tensor. Override "
              "Tensor forward(const Tensor&), or call the module's own forward overload.");
}

void Module::mark_structure_changed() {
  structure_stamp_ = next_stamp();
}

ModulePtr Module::self_ptr() const {
  auto* self = const_cast<Module*>(this);
  if (ModulePtr p = self->weak_from_this().lock()) return p;
  // Not owned by a shared_ptr (a module on the stack): a non-owning handle.
  return ModulePtr(ModulePtr(), self);
}

// ---------------- registration ----------------

void Module::check_new_name(const std::string& name, const char* kind, const char* caller) const {
  const std::string where = std::string("[kiln::nn::Module::") + caller + "] ";
  KILN_CHECK(!name.empty(), ValueError, where + kind + " name can't be empty string \"\".");
  KILN_CHECK(name.find('.') == std::string::npos, ValueError,
             where + kind + " name can't contain \".\", got: " + name + ".");
  const std::string k(kind);
  auto clash = [&](bool taken) {
    KILN_CHECK(!taken, ValueError,
               where + "attribute '" + name + "' already exists in " + this->name() +
                   " as another kind of entry. Use a different name.");
  };
  if (k != "parameter")
    for (const auto& p : parameters_) clash(p->name == name);
  if (k != "buffer")
    for (const auto& b : buffers_) clash(b->name == name);
  if (k != "module")
    for (const auto& c : children_) clash(c.name == name);
}

Tensor& Module::register_parameter(std::string name, Tensor tensor, bool requires_grad) {
  check_new_name(name, "parameter", "register_parameter");
  if (tensor.defined()) {
    if (!tensor.is_leaf()) tensor = tensor.detach();
    if (requires_grad || tensor.requires_grad()) tensor.requires_grad_(requires_grad);
  }
  mark_structure_changed();
  for (auto& p : parameters_) {
    if (p->name == name) {
      p->tensor = std::move(tensor);
      return p->tensor;
    }
  }
  parameters_.push_back(
      std::make_unique<TensorSlot>(TensorSlot{std::move(name), std::move(tensor), true}));
  return parameters_.back()->tensor;
}

Tensor& Module::register_buffer(std::string name, Tensor tensor, bool persistent) {
  check_new_name(name, "buffer", "register_buffer");
  mark_structure_changed();
  for (auto& b : buffers_) {
    if (b->name == name) {
      b->tensor = std::move(tensor);
      b->persistent = persistent;
      return b->tensor;
    }
  }
  buffers_.push_back(
      std::make_unique<TensorSlot>(TensorSlot{std::move(name), std::move(tensor), persistent}));
  return buffers_.back()->tensor;
}

void Module::register_module_impl(std::string name, ModulePtr module) {
  check_new_name(name, "module", "register_module");
  KILN_CHECK(
      module.get() != this, ValueError,
      "[kiln::nn::Module::register_module] a module cannot be its own submodule ('" + name + "').");
  mark_structure_changed();
  for (auto& c : children_) {
    if (c.name == name) {
      c.module = std::move(module);
      return;
    }
  }
  children_.push_back(ModuleSlot{std::move(name), std::move(module)});
}

// ---------------- traversal ----------------

NamedModules Module::named_modules(const std::string& prefix) const {
  NamedModules out;
  std::unordered_set<const Module*> seen;
  std::function<void(const Module&, const std::string&)> visit = [&](const Module& m,
                                                                     const std::string& p) {
    if (!seen.insert(&m).second) return;
    out.emplace_back(p, m.self_ptr());
    for (const auto& c : m.children_) {
      if (!c.module) continue;
      visit(*c.module, p.empty() ? c.name : p + "." + c.name);
    }
  };
  visit(*this, prefix);
  return out;
}

std::vector<ModulePtr> Module::modules() const {
  std::vector<ModulePtr> out;
  for (auto& [n, m] : named_modules()) out.push_back(m);
  return out;
}

NamedModules Module::named_children() const {
  NamedModules out;
  std::unordered_set<const Module*> seen;
  for (const auto& c : children_)
    if (c.module && seen.insert(c.module.get()).second) out.emplace_back(c.name, c.module);
  return out;
}

std::vector<ModulePtr> Module::children() const {
  std::vector<ModulePtr> out;
  for (auto& [n, m] : named_children()) out.push_back(m);
  return out;
}

namespace {
template <class SlotsOf>
NamedTensors named_tensors(const Module& root, bool recurse, SlotsOf slots_of) {
  NamedTensors out;
  std::unordered_set<const kiln::detail::TensorImpl*> seen;
  auto add = [&](const Module& m, const std::string& prefix) {
    for (const auto* slot : slots_of(m)) {
      if (!slot->tensor.defined() || !seen.insert(slot->tensor.unsafe_impl()).second) continue;
      out.emplace_back(prefix.empty() ? slot->name : prefix + "." + slot->name, slot->tensor);
    }
  };
  if (!recurse) {
    add(root, "");
    return out;
  }
  for (const auto& [prefix, m] : root.named_modules()) add(*m, prefix);
  return out;
}
}  // namespace

NamedTensors Module::named_parameters(bool recurse) const {
  return named_tensors(*this, recurse, [](const Module& m) {
    std::vector<const TensorSlot*> v;
    for (const auto& p : m.parameters_) v.push_back(p.get());
    return v;
  });
}

NamedTensors Module::named_buffers(bool recurse) const {
  return named_tensors(*this, recurse, [](const Module& m) {
    std::vector<const TensorSlot*> v;
    for (const auto& b : m.buffers_) v.push_back(b.get());
    return v;
  });
}

TensorList Module::parameters(bool recurse) const {
  TensorList out;
  for (auto& [n, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

TensorList Module::buffers(bool recurse) const {
  TensorList out;
  for (auto& [n, t] : named_buffers(recurse)) out.push_back(t);
  return out;
}

ModulePtr Module::get_submodule(const std::string& target) const {
  ModulePtr m = self_ptr();
  if (target.empty()) return m;
  std::string path;
  size_t start = 0;
  while (true) {
    const size_t dot = target.find('.', start);
    const std::string item =
        target.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    ModulePtr next;
    for (const auto& c : m->children_)
      if (c.name == item) next = c.module;
    KILN_CHECK(next != nullptr, IndexError,
               "[kiln::nn::Module::get_submodule] " + m->name() +
                   (path.empty() ? "" : " '" + path + "'") + " has no submodule `" + item +
                   "` (looking up '" + target + "').");
    path += (path.empty() ? "" : ".") + item;
    m = next;
    if (dot == std::string::npos) return m;
    start = dot + 1;
  }
}

Tensor& Module::get_parameter(const std::string& target) {
  const size_t dot = target.rfind('.');
  ModulePtr owner = dot == std::string::npos ? self_ptr() : get_submodule(target.substr(0, dot));
  const std::string leaf = dot == std::string::npos ? target : target.substr(dot + 1);
  for (auto& p : owner->parameters_)
    if (p->name == leaf) return p->tensor;
  throw IndexError("[kiln::nn::Module::get_parameter] " + owner->name() + " has no parameter `" +
                   leaf + "` (looking up '" + target + "').");
}

Tensor& Module::get_buffer(const std::string& target) {
  const size_t dot = target.rfind('.');
  ModulePtr owner = dot == std::string::npos ? self_ptr() : get_submodule(target.substr(0, dot));
  const std::string leaf = dot == std::string::npos ? target : target.substr(dot + 1);
  for (auto& b : owner->buffers_)
    if (b->name == leaf) return b->tensor;
  throw IndexError("[kiln::nn::Module::get_buffer] " + owner->name() + " has no buffer `" + leaf +
                   "` (looking up '" + target + "').");
}

// ---------------- mode and conversion ----------------

void Module::train(bool on) {
  if (training_ != on) {
    training_ = on;
    mark_structure_changed();
  }
  for (const auto& c : children_)
    if (c.module) c.module->train(on);
}

void Module::convert(std::optional<Device> device, std::optional<DType> dtype) {
  NoGradGuard no_grad;
  for (const auto& [prefix, m] : named_modules()) {
    bool changed = false;
    auto convert_slot = [&](TensorSlot& slot) {
      Tensor& t = slot.tensor;
      if (!t.defined()) return;
      const Device d = device.value_or(t.device());
      const DType dt = dtype && t.is_floating_point() ? *dtype : t.dtype();
      if (d == t.device() && dt == t.dtype()) return;
      Tensor grad = t.grad();
      if (grad.defined()) t.set_grad(Tensor());
      assign_tensor_data(t, t.to(d, dt));
      if (grad.defined()) t.set_grad(grad.to(d, dt));
      changed = true;
    };
    for (auto& p : m->parameters_) convert_slot(*p);
    for (auto& b : m->buffers_) convert_slot(*b);
    if (changed) m->mark_structure_changed();
  }
}

Module& Module::to(Device device) {
  convert(device, std::nullopt);
  return *this;
}

Module& Module::to(DType dtype) {
  KILN_CHECK(is_floating_point(dtype), DTypeError,
             "[kiln::nn::Module::to] nn.Module.to only accepts floating point dtypes, but got " +
                 std::string(dtype_name(dtype)) + ".");
  convert(std::nullopt, dtype);
  return *this;
}

Module& Module::to(Device device, DType dtype) {
  KILN_CHECK(is_floating_point(dtype), DTypeError,
             "[kiln::nn::Module::to] nn.Module.to only accepts floating point dtypes, but got " +
                 std::string(dtype_name(dtype)) + ".");
  convert(device, dtype);
  return *this;
}

Module& Module::to(MemoryFormat format) {
  if (format == MemoryFormat::preserve) return *this;
  NoGradGuard no_grad;
  for (const auto& [prefix, m] : named_modules()) {
    bool changed = false;
    auto convert_slot = [&](TensorSlot& slot) {
      Tensor& t = slot.tensor;
      if (!t.defined() || t.dim() != 4 || t.is_contiguous(format)) return;
      Tensor grad = t.grad();
      if (grad.defined()) t.set_grad(Tensor());
      assign_tensor_data(t, t.contiguous(format));
      if (grad.defined()) t.set_grad(grad.contiguous(format));
      changed = true;
    };
    for (auto& p : m->parameters_) convert_slot(*p);
    for (auto& b : m->buffers_) convert_slot(*b);
    if (changed) m->mark_structure_changed();
  }
  return *this;
}

Module& Module::requires_grad_(bool requires_grad) {
  for (Tensor& p : parameters()) p.requires_grad_(requires_grad);
  mark_structure_changed();
  return *this;
}

void Module::zero_grad(bool set_to_none) {
  NoGradGuard no_grad;
  for (const Tensor& p : parameters()) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    if (set_to_none) {
      p.set_grad(Tensor());
    } else if (!g.is_leaf()) {
      p.set_grad(zeros_like(g));
    } else {
      g.zero_();
    }
  }
}

Module& Module::apply(const std::function<void(Module&)>& fn) {
  for (const auto& c : children_)
    if (c.module) c.module->apply(fn);
  fn(*this);
  return *this;
}

// ---------------- state dict ----------------

void Module::append_state(const std::string& prefix, NamedTensors& out) const {
  for (const auto& p : parameters_)
    if (p->tensor.defined()) out.emplace_back(prefix + p->name, p->tensor.detach());
  for (const auto& b : buffers_)
    if (b->tensor.defined() && b->persistent)
      out.emplace_back(prefix + b->name, b->tensor.detach());
  for (const auto& c : children_)
    if (c.module) c.module->append_state(prefix + c.name + ".", out);
}

NamedTensors Module::state_dict() const {
  NamedTensors out;
  append_state("", out);
  return out;
}

void Module::collect_state_slots(const std::string& prefix,
                                 std::vector<std::pair<std::string, Tensor*>>& out) {
  for (auto& p : parameters_)
    if (p->tensor.defined()) out.emplace_back(prefix + p->name, &p->tensor);
  for (auto& b : buffers_)
    if (b->tensor.defined() && b->persistent) out.emplace_back(prefix + b->name, &b->tensor);
  for (auto& c : children_)
    if (c.module) c.module->collect_state_slots(prefix + c.name + ".", out);
}

IncompatibleKeys Module::load_state_dict(const NamedTensors& state_dict, bool strict) {
  std::unordered_map<std::string, size_t> given;
  for (size_t i = 0; i < state_dict.size(); ++i) {
    KILN_CHECK(given.emplace(state_dict[i].first, i).second, ValueError,
               std::string(kLoadTag) + "the state dict has the key \"" + state_dict[i].first +
                   "\" more than once. Keep one entry per key.");
    KILN_CHECK(state_dict[i].second.defined(), ValueError,
               std::string(kLoadTag) + "the state dict entry \"" + state_dict[i].first +
                   "\" is an undefined tensor. Drop it or give it a value.");
  }
  std::vector<std::pair<std::string, Tensor*>> slots;
  collect_state_slots("", slots);

  IncompatibleKeys result;
  std::vector<std::string> size_errors;
  std::vector<std::pair<Tensor*, Tensor>> copies;
  std::unordered_set<std::string> expected;
  for (auto& [key, slot] : slots) {
    expected.insert(key);
    auto it = given.find(key);
    if (it == given.end()) {
      result.missing_keys.push_back(key);
      continue;
    }
    Tensor src = state_dict[it->second].second;
    // PyTorch loads a 1-element 1-D value into a 0-dim entry (old checkpoints' scalars).
    if (slot->dim() == 0 && src.dim() == 1 && src.numel() == 1) src = src.reshape({});
    if (src.sizes() != slot->sizes()) {
      size_errors.push_back(
          "size mismatch for " + key + ": copying a param with shape " + shape_str(src.sizes()) +
          " from checkpoint, the shape in current model is " + shape_str(slot->sizes()) + ".");
      continue;
    }
    copies.emplace_back(slot, src);
  }
  for (const auto& [key, value] : state_dict)
    if (!expected.count(key)) result.unexpected_keys.push_back(key);

  const bool key_errors = strict && !result.empty();
  if (key_errors || !size_errors.empty()) {
    auto quoted = [](const std::vector<std::string>& keys) {
      std::string s;
      for (size_t i = 0; i < keys.size(); ++i) s += (i ? ", \"" : "\"") + keys[i] + "\"";
      return s;
    };
    std::vector<std::string> msgs;
    if (strict && !result.missing_keys.empty())
      msgs.push_back("Missing key(s) in state_dict: " + quoted(result.missing_keys) + ".");
    if (strict && !result.unexpected_keys.empty())
      msgs.push_back("Unexpected key(s) in state_dict: " + quoted(result.unexpected_keys) + ".");
    msgs.insert(msgs.end(), size_errors.begin(), size_errors.end());
    std::string msg = std::string(kLoadTag) + "Error(s) in loading state_dict for " + name() + ":";
    for (const auto& m : msgs) msg += "\n\t" + m;
    msg += "\nNothing was loaded. Fix the checkpoint or the model";
    msg += strict ? ", or pass strict=false to skip missing and unexpected keys." : ".";
    if (!size_errors.empty()) throw ShapeError(msg);
    throw ValueError(msg);
  }

  NoGradGuard no_grad;
  for (auto& [slot, src] : copies) slot->copy_(src);
  return result;
}

// ---------------- printing and structure ----------------

std::string Module::extra_repr() const {
  return "";
}

std::string Module::str() const {
  std::vector<std::string> lines;
  const std::string extra = extra_repr();
  size_t extra_lines = 0;
  if (!extra.empty()) {
    std::stringstream ss(extra);
    for (std::string line; std::getline(ss, line);) lines.push_back(line), ++extra_lines;
  }
  const size_t child_start = lines.size();
  for (const auto& c : children_)
    lines.push_back("(" + c.name + "): " + add_indent(c.module ? c.module->str() : "None", 2));
  std::string out = name() + "(";
  if (!lines.empty()) {
    if (extra_lines == 1 && lines.size() == child_start) {
      out += lines[0];
    } else {
      out += "\n";
      for (const auto& l : lines) out += "  " + l + "\n";
    }
  }
  return out + ")";
}

std::ostream& operator<<(std::ostream& os, const Module& module) {
  return os << module.str();
}

// A plain recursive walk without allocation: compile() calls this on every guarded call. A shared
// submodule is visited once per path, which only repeats a max.
uint64_t Module::structure_version() const {
  uint64_t v = structure_stamp_;
  for (const auto& c : children_)
    if (c.module) v = std::max(v, c.module->structure_version());
  return v;
}

}  // namespace kiln::nn
