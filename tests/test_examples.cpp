// Runs every example and compares its output with examples/expected/<name>.txt.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <vector>
#include <algorithm>

#include "example.h"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Expected files are literal text, except that `{num}` matches any decimal number: training
// examples print losses and timings whose digits depend on the run, so only what must hold is
// pinned. Compared line by line (one small regex per line with {num}), so long outputs (a
// DenseNet graph table) stay cheap and a mismatch names its line.
std::string to_regex(const std::string& expected) {
  static const std::string special = R"(\^$.|?*+()[]{})";
  std::string out;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (expected.compare(i, 5, "{num}") == 0) {
      out += R"(-?[0-9]+(\.[0-9]+)?(e[-+]?[0-9]+)?)";
      i += 4;
      continue;
    }
    if (special.find(expected[i]) != std::string::npos) out += '\\';
    out += expected[i];
  }
  return out;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) {
      lines.push_back(text.substr(pos));
      break;
    }
    lines.push_back(text.substr(pos, nl - pos));
    pos = nl + 1;
  }
  return lines;
}

::testing::AssertionResult output_matches(const std::string& actual, const std::string& expected) {
  std::vector<std::string> a = split_lines(actual), e = split_lines(expected);
  for (size_t i = 0; i < std::max(a.size(), e.size()); ++i) {
    const std::string got = i < a.size() ? a[i] : "<end of output>";
    const std::string want = i < e.size() ? e[i] : "<end of expected>";
    bool ok = i < a.size() && i < e.size() &&
              (want.find("{num}") == std::string::npos ? got == want : std::regex_match(got, std::regex(to_regex(want))));
    if (!ok) {
      return ::testing::AssertionFailure() << "line " << i + 1 << " differs:\n  output:   " << got
                                           << "\n  expected: " << want << (actual.size() < 20000 ? "\nfull output:\n" + actual : std::string("\n(full output too long to show)"));
    }
  }
  return ::testing::AssertionSuccess();
}

class ExampleOutput : public ::testing::TestWithParam<std::string> {};

TEST_P(ExampleOutput, MatchesExpected) {
  // Examples with a long-running full size (train_densenet) run their quick size under test;
  // their expected files hold that output.
  setenv("KILN_EXAMPLE_QUICK", "1", /*overwrite=*/1);
  // run_exported loads the files export_resnet writes (ctest runs each example in its own process,
  // in any order): write them first. Both write the same tensors, each file atomically.
  if (GetParam() == "run_exported") {
    for (const auto& e : kiln::examples::registry()) {
      std::ostringstream discard;
      if (e.name == "export_resnet") e.run(discard);
    }
  }
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
