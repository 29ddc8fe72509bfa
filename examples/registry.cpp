#include <algorithm>

#include "example.h"

namespace kiln::examples {

std::vector<Example>& registry() {
  static std::vector<Example> examples;
  return examples;
}

bool register_example(Example e) {
  auto& r = registry();
  r.push_back(std::move(e));
  std::stable_sort(r.begin(), r.end(), [](const Example& a, const Example& b) { return a.order < b.order; });
  return true;
}

}  // namespace kiln::examples
