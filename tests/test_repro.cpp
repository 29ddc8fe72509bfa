// KILN_REPRO and minify (docs/export.md, "Repro and minify"), against a deliberate miscompile
// (KILN_TEST_MISCOMPILE, a test-only pass).
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>

#include "compile_helpers.h"
#include "kiln/export.h"

namespace kiln {
namespace {

using testing::contains;
using testing::LogCapture;
using testing::ScopedEnv;

namespace fs = std::filesystem;

class Repro : public testing::CompilerTest {
 protected:
  void SetUp() override {
    CompilerTest::SetUp();
    dir_ = fs::temp_directory_path() / ("kiln_repro_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
    CompilerTest::TearDown();
  }
  std::vector<fs::path> repros() const {
    std::vector<fs::path> out;
    for (const auto& e : fs::directory_iterator(dir_))
      if (e.path().extension() == ".kpkg") out.push_back(e.path());
    return out;
  }
  fs::path dir_;
};

// 300 pointwise nodes with one tanh in the middle. None of them contracts, so a change at the
// tanh reaches the output.
Tensor long_chain(const Tensor& x) {
  Tensor y = x;
  for (int i = 0; i < 300; ++i) {
    if (i == 150) y = tanh(y);
    else if (i % 3 == 0) y = y + 0.01;
    else if (i % 3 == 1) y = y * -1.0;
    else y = y * 1.001;
  }
  return y;
}

TEST_F(Repro, AccuracyReproOfAMiscompileMinifiesToTheOpAndNamesThePass) {
  Tensor x = randn({64});
  {
    ScopedEnv repro("KILN_REPRO", "accuracy");
    ScopedEnv where("KILN_REPRO_DIR", dir_.string());
    ScopedEnv broken("KILN_TEST_MISCOMPILE", "tanh");
    LogCapture log;
    auto f = compile(long_chain);
    f(x);
    EXPECT_TRUE(contains(log.str(), "[kiln.repro] graph"));
    EXPECT_TRUE(contains(log.str(), "kiln minify"));
  }
  ASSERT_EQ(repros().size(), 1u);
  const std::string repro = repros()[0].string();

  {
    ScopedEnv broken("KILN_TEST_MISCOMPILE", "tanh");
    compiler::MinifyResult r = compiler::minify(repro, (dir_ / "smallest.kpkg").string());
    EXPECT_EQ(r.kind, "accuracy");
    EXPECT_EQ(r.original_nodes, 300);
    EXPECT_LE(r.graph.nodes.size(), 5u) << r.str();
    bool has_tanh = false;
    for (const auto& n : r.graph.nodes) has_tanh |= n.op->name == "tanh";
    EXPECT_TRUE(has_tanh) << r.str();
    EXPECT_TRUE(contains(r.failing_op, "tanh")) << r.str();
    ASSERT_EQ(r.breaking_passes.size(), 1u) << r.str();
    EXPECT_EQ(r.breaking_passes[0], "test_miscompile");
    EXPECT_TRUE(contains(r.str(), "pass that broke it: test_miscompile"));
    // The smallest graph is a repro package of its own, and it still fails.
    compiler::MinifyResult again = compiler::minify(r.minimized_path);
    EXPECT_EQ(again.graph.nodes.size(), r.graph.nodes.size());
  }
  // Without the miscompile the repro does not fail: minify says there is nothing to do.
  try {
    compiler::minify(repro);
    FAIL() << "expected CompileError";
  } catch (const CompileError& e) {
    EXPECT_TRUE(contains(e.what(), "does not fail here"));
  }
}

TEST_F(Repro, CorrectGraphsWriteNoRepro) {
  ScopedEnv repro("KILN_REPRO", "accuracy");
  ScopedEnv where("KILN_REPRO_DIR", dir_.string());
  auto f = compile(long_chain);
  Tensor x = randn({64});
  EXPECT_TRUE(testing::close(f(x), long_chain(x)));
  EXPECT_TRUE(repros().empty());
}

TEST_F(Repro, CompileFailureWritesAReproAndSaysWhere) {
  ScopedEnv repro("KILN_REPRO", "compile");
  ScopedEnv where("KILN_REPRO_DIR", dir_.string());
  ScopedEnv broken("KILN_TEST_MISCOMPILE", "frobnicate");  // the test pass refuses it: a compile error
  auto f = compile([](const Tensor& x) { return (x * 2).sin(); });
  try {
    f(randn({8}));
    FAIL() << "expected CompileError";
  } catch (const CompileError& e) {
    EXPECT_TRUE(contains(e.what(), "Repro written to"));
    EXPECT_TRUE(contains(e.what(), "kiln minify"));
  }
  ASSERT_EQ(repros().size(), 1u);
  compiler::MinifyResult r = compiler::minify(repros()[0].string());
  EXPECT_EQ(r.kind, "compile");
  EXPECT_LE(r.graph.nodes.size(), 1u) << r.str();
  EXPECT_TRUE(contains(r.failure, "KILN_TEST_MISCOMPILE=frobnicate"));
}

TEST_F(Repro, UnknownReproModeIsAnError) {
  ScopedEnv repro("KILN_REPRO", "sometimes");
  auto f = compile([](const Tensor& x) { return x + 1; });
  try {
    f(randn({3}));
    FAIL() << "expected CompileError";
  } catch (const CompileError& e) {
    EXPECT_TRUE(contains(e.what(), "KILN_REPRO=sometimes is not one of"));
  }
}

TEST_F(Repro, MinifyRefusesFilesThatAreNotRepros) {
  auto model = models::mlp({4, 4});
  ExportedProgram p = export_program(model, randn({2, 4}));
  const std::string program = (dir_ / "program.kpkg").string();
  p.save(program);
  EXPECT_THROW(compiler::minify(program), PackageError);
}

}  // namespace
}  // namespace kiln
