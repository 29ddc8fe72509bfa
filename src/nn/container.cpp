// Sequential, ModuleList, ModuleDict.
#include "kiln/nn/container.h"

namespace kiln::nn {

namespace {

size_t checked_index(int64_t index, size_t size, const char* container) {
  const int64_t n = static_cast<int64_t>(size);
  const int64_t i = index < 0 ? index + n : index;
  KILN_CHECK(i >= 0 && i < n, IndexError,
             std::string("[kiln::nn::") + container + "] index " + std::to_string(index) +
                 " is out of range for " + std::to_string(n) + " modules.");
  return static_cast<size_t>(i);
}

// PyTorch's _addindent with 2 spaces.
std::string indent2(const std::string& s) {
  std::string out;
  for (char c : s) {
    out += c;
    if (c == '\n') out += "  ";
  }
  return out;
}

}  // namespace

// ---------------- Sequential ----------------

Sequential::Sequential(const std::vector<ModulePtr>& modules) {
  extend(modules);
}

Sequential::Sequential(const NamedModules& named_modules) {
  for (const auto& [name, module] : named_modules) register_module(name, module);
}

void Sequential::extend(const std::vector<ModulePtr>& modules) {
  for (const auto& m : modules) push_back(m);
}

Tensor Sequential::forward(const Tensor& input) {
  Tensor x = input;
  for (const auto& slot : child_slots())
    if (slot.module) x = slot.module->forward(x);
  return x;
}

ModulePtr Sequential::operator[](int64_t index) const {
  return child_slots()[checked_index(index, size(), "Sequential")].module;
}

void Sequential::throw_wrong_type(int64_t index) const {
  const ModulePtr& m = (*this)[index];
  throw ValueError("[kiln::nn::Sequential] module " + std::to_string(index) + " is a " +
                   (m ? m->name() : std::string("None")) + ", not the requested type.");
}

// ---------------- ModuleList ----------------

ModuleList::ModuleList(const std::vector<ModulePtr>& modules) {
  extend(modules);
}

void ModuleList::extend(const std::vector<ModulePtr>& modules) {
  for (const auto& m : modules) push_back(m);
}

ModulePtr ModuleList::operator[](int64_t index) const {
  return child_slots()[checked_index(index, size(), "ModuleList")].module;
}

void ModuleList::throw_wrong_type(int64_t index) const {
  const ModulePtr& m = (*this)[index];
  throw ValueError("[kiln::nn::ModuleList] module " + std::to_string(index) + " is a " +
                   (m ? m->name() : std::string("None")) + ", not the requested type.");
}

std::string ModuleList::str() const {
  const auto& slots = child_slots();
  if (slots.empty()) return name() + "()";
  // Runs of consecutive children with the same repr print once: "(0-2): 3 x Linear(...)".
  std::vector<std::pair<size_t, size_t>> runs;  // [start, end]
  std::vector<std::string> reprs;
  for (size_t i = 0; i < slots.size(); ++i) {
    std::string r = slots[i].module ? slots[i].module->str() : "None";
    if (!reprs.empty() && r == reprs.back()) {
      runs.back().second = i;
      continue;
    }
    runs.emplace_back(i, i);
    reprs.push_back(std::move(r));
  }
  std::string out = name() + "(\n";
  for (size_t k = 0; k < runs.size(); ++k) {
    const auto [start, end] = runs[k];
    std::string line = "(";
    line += std::to_string(start);
    if (start != end) {
      line += '-';
      line += std::to_string(end);
      line += "): ";
      line += std::to_string(end - start + 1);
      line += " x ";
    } else {
      line += "): ";
    }
    line += reprs[k];
    out += "  " + indent2(line) + "\n";
  }
  return out + ")";
}

// ---------------- ModuleDict ----------------

ModuleDict::ModuleDict(const NamedModules& modules) {
  update(modules);
}

void ModuleDict::update(const NamedModules& modules) {
  for (const auto& [key, module] : modules) register_module(key, module);
}

bool ModuleDict::contains(const std::string& key) const {
  for (const auto& slot : child_slots())
    if (slot.name == key) return true;
  return false;
}

ModulePtr ModuleDict::operator[](const std::string& key) const {
  for (const auto& slot : child_slots())
    if (slot.name == key) return slot.module;
  throw IndexError("[kiln::nn::ModuleDict] no module under the key '" + key + "'. Check keys().");
}

std::vector<std::string> ModuleDict::keys() const {
  std::vector<std::string> out;
  for (const auto& slot : child_slots()) out.push_back(slot.name);
  return out;
}

std::vector<ModulePtr> ModuleDict::values() const {
  std::vector<ModulePtr> out;
  for (const auto& slot : child_slots()) out.push_back(slot.module);
  return out;
}

NamedModules ModuleDict::items() const {
  NamedModules out;
  for (const auto& slot : child_slots()) out.emplace_back(slot.name, slot.module);
  return out;
}

void ModuleDict::throw_wrong_type(const std::string& key) const {
  const ModulePtr m = (*this)[key];
  throw ValueError("[kiln::nn::ModuleDict] module '" + key + "' is a " +
                   (m ? m->name() : std::string("None")) + ", not the requested type.");
}

}  // namespace kiln::nn
