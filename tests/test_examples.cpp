// Runs every example and compares its output with examples/expected/<name>.txt.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>

#include "example.h"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Expected files are literal text, except that `{num}` matches any decimal number: training
// examples print losses whose later digits depend on floating-point summation order (oneDNN's
// algorithm choice, thread count), so only what must hold is pinned.
std::string to_regex(const std::string& expected) {
  static const std::string special = R"(\^$.|?*+()[]{})";
  std::string out;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (expected.compare(i, 5, "{num}") == 0) {
      out += R"(-?[0-9]+(\.[0-9]+)?)";
      i += 4;
      continue;
    }
    if (special.find(expected[i]) != std::string::npos) out += '\\';
    out += expected[i];
  }
  return out;
}

::testing::AssertionResult output_matches(const std::string& actual, const std::string& expected) {
  if (expected.find("{num}") == std::string::npos) {
    if (actual == expected) return ::testing::AssertionSuccess();
  } else if (std::regex_match(actual, std::regex(to_regex(expected)))) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "output:\n" << actual << "\nexpected:\n" << expected;
}

class ExampleOutput : public ::testing::TestWithParam<std::string> {};

TEST_P(ExampleOutput, MatchesExpected) {
  // Examples with a long-running full size (train_densenet) run their quick size under test;
  // their expected files hold that output.
  setenv("KILN_EXAMPLE_QUICK", "1", /*overwrite=*/1);
  for (const auto& e : kiln::examples::registry()) {
    if (e.name != GetParam()) continue;
    std::ostringstream out;
    e.run(out);
    std::string expected_path = std::string(KILN_SOURCE_DIR) + "/examples/expected/" + e.name + ".txt";
    std::string expected = read_file(expected_path);
    ASSERT_FALSE(expected.empty()) << "missing " << expected_path;
    EXPECT_TRUE(output_matches(out.str(), expected));
    return;
  }
  FAIL() << "no example " << GetParam();
}

std::vector<std::string> example_names() {
  std::vector<std::string> names;
  for (const auto& e : kiln::examples::registry()) names.push_back(e.name);
  return names;
}

INSTANTIATE_TEST_SUITE_P(Examples, ExampleOutput, ::testing::ValuesIn(example_names()),
                         [](const auto& info) { return info.param; });

}  // namespace
