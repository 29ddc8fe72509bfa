// Progress of long work on stderr (src/core/progress.h): the line's text and counts, its delay,
// KILN_PROGRESS=0, nested tasks, and a cold compile counting its kernel builds.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>

#include "core/progress.h"
#include "kernels/autotune_scope.h"
#include "kiln/kiln.h"

using namespace kiln;
using kiln::detail::Progress;

namespace {

namespace fs = std::filesystem;

// Sets an environment variable for the scope.
struct Env {
  std::string name;
  Env(const char* n, const char* value) : name(n) { setenv(n, value, 1); }
  ~Env() { unsetenv(name.c_str()); }
};

void wait_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(Progress, ALongTaskShowsItsCountsAndEnds) {
  Env after("KILN_PROGRESS_AFTER_MS", "0");
  ::testing::internal::CaptureStderr();
  {
    Progress p("test work", "things done");
    p.add_total(3);
    p.advance();
    wait_ms(400);
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(has(err, "[kiln] test work: 1 of 3 things done, ")) << err;
  EXPECT_TRUE(has(err, " (done)\n")) << err;
}

TEST(Progress, QuickWorkAndKilnProgressZeroStaySilent) {
  ::testing::internal::CaptureStderr();
  {
    Progress quick("quick work", "things");  // the default delay is 2 s
    wait_ms(600);
  }
  {
    Env after("KILN_PROGRESS_AFTER_MS", "0");
    Env off("KILN_PROGRESS", "0");
    Progress p("silenced work", "things");
    p.add_total(1);
    wait_ms(600);
    EXPECT_EQ(Progress::current(), &p);
  }
  EXPECT_EQ(Progress::current(), nullptr);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

TEST(Progress, TheNewestTaskPastItsDelayHasTheLine) {
  Env after("KILN_PROGRESS_AFTER_MS", "0");
  ::testing::internal::CaptureStderr();
  {
    Progress outer("outer work", "rounds");
    wait_ms(600);
    {
      Progress inner("inner work", "kernels");
      EXPECT_EQ(Progress::current(), &inner);
      Progress::current()->add_total(2);
      wait_ms(600);
    }
    EXPECT_EQ(Progress::current(), &outer);
    wait_ms(600);
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  const size_t outer_line = err.find("[kiln] outer work"), inner_line = err.find("[kiln] inner work: 0 of 2 kernels");
  ASSERT_NE(outer_line, std::string::npos) << err;
  ASSERT_NE(inner_line, std::string::npos) << err;
  EXPECT_LT(outer_line, inner_line) << err;
  EXPECT_TRUE(has(err, "inner work: 0 of 2 kernels, ")) << err;
  EXPECT_TRUE(has(err.substr(inner_line), "[kiln] outer work")) << "the outer task gets the line back\n" << err;
}

// Autotuning counts the configurations it times into its scope's line, without becoming the
// thread's current task.
TEST(Progress, AutotuningCountsTheConfigurationsItTimes) {
  Env after("KILN_PROGRESS_AFTER_MS", "0");
  ::testing::internal::CaptureStderr();
  kiln::kernels::note_autotuned();  // outside a scope: nothing
  {
    kiln::kernels::AutotuneScope scope;
    for (int i = 0; i < 3; ++i) kiln::kernels::note_autotuned();
    EXPECT_EQ(Progress::current(), nullptr);
    wait_ms(600);
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(has(err, "[kiln] autotuning (max_autotune): 3 configurations timed, ")) << err;
  EXPECT_TRUE(has(err, "(done)")) << err;
}

// A cold compile (an empty kernel cache) shows the graph it compiles and counts its kernel builds.
TEST(Progress, AColdCompileCountsItsKernelBuilds) {
  std::string dir = "/tmp/kiln-progress-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  Env cache("KILN_CACHE_DIR", dir.c_str());
  Env after("KILN_PROGRESS_AFTER_MS", "0");
  compiler::reset();
  auto f = compile([](const Tensor& x) { return (x.sin() * 2 + 1).relu().sum(1); }, {.backend = std::string("kiln")});
  Tensor x = randn({8, 33});
  ::testing::internal::CaptureStderr();
  Tensor y = f(x);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(allclose(y, (x.sin() * 2 + 1).relu().sum(1), 1e-5, 1e-5));
  EXPECT_GT(compiler::counters().kernel_runs, 0) << "the compiled graph ran";
  EXPECT_TRUE(has(err, "[kiln] compiling graph ")) << err;
  EXPECT_TRUE(has(err, ": 1 of 1 kernels built, ") && has(err, "(done)")) << err;
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// Issue 24's figure: a cold compile of DenseNet-121's training step (forward, backward and Adam
// in one compiled call) shows its progress with the default delay; with KILN_PROGRESS=0 a compile
// of it that would show a line at once (KILN_PROGRESS_AFTER_MS=0) shows nothing.
TEST(Progress, ADenseNetTrainingStepsColdCompileShowsProgressAndKilnProgressZeroSilencesIt) {
  std::string dir = "/tmp/kiln-progress-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  Env cache("KILN_CACHE_DIR", dir.c_str());
  manual_seed(0);
  auto net = models::densenet121({.num_classes = 10});
  optim::Adam opt(net->parameters(), {.lr = 1e-3});
  Tensor x = randn({2, 3, 32, 32});
  Tensor y = tensor({1, 7}, kInt64);
  auto train_step = [&](const Tensor& input) {
    opt.zero_grad();
    Tensor loss = nn::functional::cross_entropy(net->forward(input), y);
    loss.backward();
    opt.step();
    return loss;
  };
  compiler::reset();
  auto step = compile(train_step, {.backend = std::string("kiln"), .name = "step"});
  ::testing::internal::CaptureStderr();
  const int64_t builds = compiler::counters().kernel_builds;
  (void)step(x);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_GT(compiler::counters().kernel_builds - builds, 0) << "a cold compile";
  EXPECT_GT(compiler::counters().graph_runs, 0);
  EXPECT_TRUE(has(err, "[kiln] compiling graph ") && has(err, "of 'step' (")) << err;
  EXPECT_TRUE(has(err, "kernels built, ") && has(err, "(done)")) << err;

  Env quiet("KILN_PROGRESS", "0");
  Env at_once("KILN_PROGRESS_AFTER_MS", "0");
  compiler::reset();  // the graphs compile again (their kernels come from the cache)
  auto again = compile(train_step, {.backend = std::string("kiln"), .name = "step"});
  ::testing::internal::CaptureStderr();
  const int64_t compiles = compiler::counters().graph_compiles;
  (void)again(x);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_GT(compiler::counters().graph_compiles - compiles, 0) << "it compiled";
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
