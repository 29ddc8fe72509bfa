// The differential test's CI slice (tests/differential/): random programs from a fixed seed, each
// run eagerly in float32, against a float64 reference, and compiled with every backend and mode
// (eager, aot_eager, kiln, kiln reduce_overhead, kiln pure), in child processes so that a crash
// or a hang is a finding. A failing program is shrunk and the test fails with its Kiln C++
// repro. scripts/difftest runs long campaigns; `kiln_difftest --replay SEED` reruns one program.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>
#include <thread>

#include "campaign.h"
#include "generator.h"
#include "interpreter.h"
#include "kernel_cache_dir.h"
#include "program.h"

namespace {

using namespace kiln::differential;

KILN_TEST_KERNEL_CACHE_DIR("kiln_test_differential");

// Same shape, dtype and bits (NaN equal to NaN).
bool identical(const kiln::Tensor& a, const kiln::Tensor& b) {
  if (a.sizes() != b.sizes() || a.dtype() != b.dtype()) return false;
  std::vector<double> x = a.detach().to_vector<double>(), y = b.detach().to_vector<double>();
  for (size_t i = 0; i < x.size(); ++i)
    if (!(x[i] == y[i] || (std::isnan(x[i]) && std::isnan(y[i])))) return false;
  return true;
}

constexpr uint64_t kSliceSeed = 20261126;
constexpr int kSlicePrograms = 240;

// The generator's programs are valid by its own type model and cover the op set: every op kind
// and every input layout appears within a few thousand seeds.
TEST(Differential, GeneratorCoversTheOpSetWithValidPrograms) {
  std::set<OpKind> kinds;
  std::set<Layout> layouts;
  std::set<kiln::DType> dtypes;
  int with_grad = 0, in_place_on_inputs = 0;
  for (uint64_t seed = 0; seed < 3000; ++seed) {
    Program p = generate_program(seed);
    Inference inf = infer(p);
    ASSERT_TRUE(inf.ok()) << "seed " << seed << ": " << inf.error << "\n"
                          << program_function_cpp(p);
    ASSERT_GE(p.inputs.size(), 1u);
    ASSERT_LE(p.ops.size(), 15u) << "seed " << seed;
    for (const Op& op : p.ops) {
      kinds.insert(op.kind);
      if (is_in_place(op.kind) &&
          inf.values[op.args[0]].storage < static_cast<int>(p.inputs.size()))
        ++in_place_on_inputs;
    }
    for (const InputSpec& in : p.inputs) {
      layouts.insert(in.layout);
      dtypes.insert(in.dtype);
      with_grad += in.requires_grad;
    }
  }
  for (int k = 0; k < kNumOpKinds; ++k)
    EXPECT_TRUE(kinds.count(static_cast<OpKind>(k)))
        << "never generated: " << op_name(static_cast<OpKind>(k));
  EXPECT_EQ(layouts.size(), 4u);
  EXPECT_EQ(dtypes,
            (std::set<kiln::DType>{kiln::kFloat32, kiln::kFloat64, kiln::kInt64, kiln::kBool}));
  EXPECT_GT(with_grad, 1000);
  EXPECT_GT(in_place_on_inputs, 100);
}

// The same seed gives the same program, so a seed in a report reproduces its failure.
TEST(Differential, ProgramsAreDeterministic) {
  for (uint64_t seed : {1u, 77u, 12345u})
    EXPECT_EQ(program_function_cpp(generate_program(seed)),
              program_function_cpp(generate_program(seed)));
}

// A merged program computes exactly what its members compute, each on its own data, so that
// bundling programs changes nothing but the number of graphs. Checked in a child process (a
// death test): the suite's own process runs no tensor ops, which keeps its forks safe.
TEST(Differential, MergedProgramsComputeWhatTheirMembersCompute) {
  EXPECT_EXIT(
      {
        std::vector<Program> members;
        std::vector<Ts> alone;
        for (uint64_t seed = 500; members.size() < 8; ++seed) {
          Program p = generate_program(seed);
          try {
            alone.push_back(run_program(p, make_inputs(p)));
            members.push_back(p);
          } catch (const kiln::Error&) {
            // a program that raises eagerly runs alone in the harness too
          }
        }
        MergedProgram merged = merge(members);
        Ts together = run_program(merged.program, make_inputs(merged.program));
        bool same = together.size() == merged.program.outputs.size();
        for (size_t m = 0; m < members.size() && same; ++m)
          for (size_t k = 0; k < alone[m].size(); ++k)
            same = same && identical(alone[m][k], together.at(merged.first_output[m] + k));
        std::exit(same ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

// The fixed slice: every program must give, in every mode, eager's outputs, gradients and input
// writes (or eager's error), and must have run compiled.
TEST(Differential, CompiledMatchesEagerOnAFixedSlice) {
  CampaignOptions options;
  options.seed = kSliceSeed;
  options.programs = kSlicePrograms;
  options.jobs = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
  options.run.timeout_seconds = 120;
  // A failing slice shrinks one program per signature, within a minute in all.
  options.shrink_budget_seconds = 60;
  options.shrink_options.jobs = options.jobs;
  options.shrink_options.max_seconds = 20;
  CampaignReport report = run_campaign(options);
  EXPECT_TRUE(report.groups.empty()) << report.table() << "\n" << report.repros();
  EXPECT_LT(report.eager_errors, kSlicePrograms / 10)
      << "the generator's type model drifted from Kiln's rules: many programs raise eagerly";
}

}  // namespace
