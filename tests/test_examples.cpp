// Runs every example and compares its output with examples/expected/<name>.txt.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "example.h"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class ExampleOutput : public ::testing::TestWithParam<std::string> {};

TEST_P(ExampleOutput, MatchesExpected) {
  for (const auto& e : kiln::examples::registry()) {
    if (e.name != GetParam()) continue;
    std::ostringstream out;
    e.run(out);
    std::string expected_path = std::string(KILN_SOURCE_DIR) + "/examples/expected/" + e.name + ".txt";
    std::string expected = read_file(expected_path);
    ASSERT_FALSE(expected.empty()) << "missing " << expected_path;
    EXPECT_EQ(out.str(), expected);
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
