// The examples registry. Each example is a function writing to an ostream, registered with
// KILN_EXAMPLE; the same code builds as a standalone program (examples/<name>), runs in
// `kiln tour`, and is checked against examples/expected/<name>.txt by tests/test_examples.cpp.
#pragma once

#include <cstdlib>
#include <functional>
#include <ostream>
#include <regex>
#include <string>
#include <vector>

namespace kiln::examples {

struct Example {
  std::string name;   // file stem, e.g. "eager_basics"
  std::string title;  // heading printed by the tour
  int order;          // tour order
  std::function<void(std::ostream&)> run;
};

// All examples linked into this program, sorted by order.
std::vector<Example>& registry();
bool register_example(Example e);

// Whether KILN_EXAMPLE_QUICK=1 (set by the tests): long examples then use a small size.
inline bool quick_mode() {
  const char* v = std::getenv("KILN_EXAMPLE_QUICK");
  return v != nullptr && std::string(v) == "1";
}

// Messages name an example's file relative to the working directory when they can; the tests
// run elsewhere, so this shows every path to an example as "examples/<file>".
inline std::string stable_paths(const std::string& message) {
  static const std::regex path(R"([^\s'"(]*/(examples/[A-Za-z0-9_]+\.cpp))");
  return std::regex_replace(message, path, "$1");
}

}  // namespace kiln::examples

#define KILN_EXAMPLE_CONCAT2(a, b) a##b
#define KILN_EXAMPLE_CONCAT(a, b) KILN_EXAMPLE_CONCAT2(a, b)
// KILN_EXAMPLE(name, order, "Title") { ... write to `out` ... }
#define KILN_EXAMPLE(NAME, ORDER, TITLE)                                                       \
  static void kiln_example_##NAME(std::ostream& out);                                         \
  [[maybe_unused]] static const bool KILN_EXAMPLE_CONCAT(kiln_example_registered_, NAME) =     \
      ::kiln::examples::register_example({#NAME, TITLE, ORDER, kiln_example_##NAME});          \
  static void kiln_example_##NAME(std::ostream& out)
