// export_program, packages and load_program (kiln/export.h, docs/export.md).
#include <gtest/gtest.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "compile_helpers.h"
#include "compiler/export/package.h"
#include "kiln/export.h"
#include "kiln/models.h"

namespace kiln {
namespace {

using testing::close;
using testing::contains;
using testing::Delta;

namespace fs = std::filesystem;

class Export : public testing::CompilerTest {
 protected:
  void SetUp() override {
    CompilerTest::SetUp();
    dir_ = fs::temp_directory_path() / ("kiln_export_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
    CompilerTest::TearDown();
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

std::shared_ptr<nn::Sequential> small_mlp() {
  manual_seed(7);
  return models::mlp({8, 16, 4}, "gelu");
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST_F(Export, ModuleRunsLikeEagerAndFromItsPackage) {
  auto model = small_mlp();
  Tensor x = randn({4, 8});
  Tensor expected;
  {
    NoGradGuard no_grad;
    expected = model->forward(x);
  }
  ExportedProgram p = export_program(model, x);
  ASSERT_EQ(p.inputs().size(), 1u);
  EXPECT_EQ(p.inputs()[0].dims, (std::vector<std::string>{"4", "8"}));
  ASSERT_EQ(p.outputs().size(), 1u);
  EXPECT_EQ(p.weights().size(), 4u);
  EXPECT_EQ(p.weights()[0].name, "0.weight");
  Delta delta;
  std::vector<Tensor> out = p.run({x});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(close(out[0], expected));
  EXPECT_GT(delta.now().kernel_runs + delta.now().dispatched_nodes, 0);

  p.save(path("mlp.kpkg"));
  ExportedProgram q = load_program(path("mlp.kpkg"));
  EXPECT_EQ(q.name(), p.name());
  std::vector<Tensor> again = q.run({x});
  EXPECT_TRUE(equal(again[0], out[0]));
  EXPECT_TRUE(contains(q.summary(), "inputs (1):\n  arg0: f32[4, 8] on cpu"));
}

TEST_F(Export, ExportDoesNotChangeTheModel) {
  auto model = small_mlp();
  NamedTensors before;
  for (auto& [n, t] : model->named_parameters()) before.emplace_back(n, t.clone());
  ExportedProgram p = export_program(model, randn({4, 8}));
  auto after = model->named_parameters();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(equal(after[i].second, before[i].second));
}

// save() writes a package whole or not at all (io/atomic_file.h): saving over a package replaces
// it and leaves no temporary file beside it; a save into a missing directory throws, naming it.
TEST_F(Export, SaveReplacesAPackageAtomicallyAndNamesAMissingDirectory) {
  ExportedProgram p = export_program(small_mlp(), randn({4, 8}));
  p.save(path("a.kpkg"));
  p.save(path("a.kpkg"));
  int files = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir_)) ++files;
  EXPECT_EQ(files, 1);
  EXPECT_NO_THROW(load_program(path("a.kpkg")));
  const std::string missing = path("no/such/dir/b.kpkg");
  const std::string message = error_of([&] { p.save(missing); });
  EXPECT_NE(message.find("[kiln::ExportedProgram::save] " + missing + ": cannot create a temporary file in " +
                         path("no/such/dir")),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("Check that the directory exists and is writable."), std::string::npos) << message;
}

TEST_F(Export, DynamicBatchRunsAtOtherSizes) {
  auto model = small_mlp();
  Tensor x = randn({4, 8});
  ExportOptions options;
  options.dynamic = {{0, 0, "batch", {}}};
  ExportedProgram p = export_program(model, x, options);
  ASSERT_EQ(p.dynamic_dims().size(), 1u);
  EXPECT_EQ(p.dynamic_dims()[0].name, "batch");
  EXPECT_EQ(p.inputs()[0].dims, (std::vector<std::string>{"batch", "8"}));
  EXPECT_EQ(p.outputs()[0].dims, (std::vector<std::string>{"batch", "4"}));
  p.save(path("dyn.kpkg"));
  ExportedProgram q = load_program(path("dyn.kpkg"));
  for (int64_t b : {2, 3, 4, 9, 33}) {
    Tensor xb = randn({b, 8});
    Tensor expected;
    {
      NoGradGuard no_grad;
      expected = model->forward(xb);
    }
    EXPECT_TRUE(close(q.run({xb})[0], expected)) << "batch " << b;
  }
}

TEST_F(Export, ViewShapesFollowTheDynamicSizes) {
  manual_seed(3);
  Tensor w = randn({6});
  auto fn = [w](const Tensor& x) {
    Tensor y = x.reshape({x.size(0) * 2, 6}) * w;  // a view attr of 2*batch
    return y.sum(1).reshape({x.size(0), 2});
  };
  Tensor x = randn({5, 12});
  compiler::mark_dynamic(x, 0);
  ExportedProgram p = export_program(fn, x);
  EXPECT_EQ(p.dynamic_dims()[0].name, "arg0_dim0");
  EXPECT_EQ(p.weights().size(), 1u);
  for (int64_t b : {2, 7, 16}) {
    Tensor xb = randn({b, 12});
    EXPECT_TRUE(close(p.run({xb})[0], fn(xb))) << "batch " << b;
  }
}

TEST_F(Export, SizeDependenceAProgramCannotFollowIsRefused) {
  auto fn = [](const Tensor& x) { return x.reshape({x.size(0) / 2, -1}); };  // integer division
  Tensor x = randn({4, 3});
  ExportOptions options;
  options.dynamic = {{0, 0, "n", {}}};
  std::string e = error_of([&] { export_program(fn, x, options); });
  EXPECT_TRUE(contains(e, "[kiln::export_program]"));
}

TEST_F(Export, InputsAreCheckedAgainstTheirSpecs) {
  auto model = small_mlp();
  ExportOptions options;
  options.dynamic = {{0, 0, "batch", {2, 64}}};
  ExportedProgram p = export_program(model, randn({4, 8}), options);
  EXPECT_TRUE(contains(error_of([&] { p.run({}); }), "takes 1 input, got 0"));
  EXPECT_TRUE(contains(error_of([&] { p.run({randn({4, 8}, kFloat64)}); }), "has dtype float64"));
  EXPECT_TRUE(contains(error_of([&] { p.run({randn({4, 9})}); }), "that dim is static"));
  EXPECT_TRUE(contains(error_of([&] { p.run({randn({65, 8})}); }), "outside its range [2, 64]"));
  EXPECT_TRUE(contains(error_of([&] { p.run({randn({8})}); }), "has 1 dimensions"));
  EXPECT_THROW(ExportedProgram().run({}), ValueError);
  // A transposed input is copied to the exported layout.
  Tensor xt = randn({8, 4}).t();
  Tensor expected;
  {
    NoGradGuard no_grad;
    expected = model->forward(xt);
  }
  EXPECT_TRUE(close(p.run({xt})[0], expected));
}

TEST_F(Export, GraphBreakIsAnErrorNamingTheLine) {
  auto fn = [](const Tensor& x) {
    Tensor y = x * 2;
    if (y.sum().item<float>() > 0) return y + 1;
    return y - 1;
  };
  std::string e = error_of([&] { export_program(fn, randn({3})); });
  EXPECT_TRUE(contains(e, "test_export.cpp:"));
}

TEST_F(Export, EightThreadsShareOneLoadedProgram) {
  auto model = small_mlp();
  ExportOptions options;
  options.dynamic = {{0, 0, "batch", {}}};
  export_program(model, randn({4, 8}), options).save(path("threads.kpkg"));
  ExportedProgram q = load_program(path("threads.kpkg"));
  std::vector<Tensor> xs, expected;
  for (int i = 0; i < 8; ++i) {
    xs.push_back(randn({2 + i, 8}));
    q.run({xs.back()});  // the first call of a size may pack the weights (ulps apart from later calls)
    expected.push_back(q.run({xs.back()})[0]);
  }
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&, i] {
      for (int r = 0; r < 50; ++r)
        if (!equal(q.run({xs[i]})[0], expected[i])) ++mismatches;
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST_F(Export, TrainingStepUpdatesTheProgramsStateLikeEager) {
  manual_seed(11);
  auto eager_model = models::mlp({8, 16, 4});
  auto exported_model = models::mlp({8, 16, 4});
  exported_model->load_state_dict(eager_model->state_dict());
  optim::SGD eager_opt(eager_model->parameters(), {.lr = 0.1, .momentum = 0.9});
  optim::SGD export_opt(exported_model->parameters(), {.lr = 0.1, .momentum = 0.9});
  auto step = [](nn::Sequential& m, optim::SGD& opt, const Tensor& x, const Tensor& y) {
    opt.zero_grad();
    Tensor loss = mse_loss(m.forward(x), y);
    loss.backward();
    opt.step();
    return loss.detach();
  };
  Tensor x = randn({4, 8}), y = randn({4, 4});
  // One eager step each first, so that the momentum buffers exist.
  step(*eager_model, eager_opt, x, y);
  step(*exported_model, export_opt, x, y);
  ExportOptions options;
  options.training = true;
  ExportedProgram p = export_program(step, *exported_model, export_opt, x, y, options);
  EXPECT_TRUE(p.writes_weights());
  NamedTensors model_after_export;
  for (auto& [n, t] : exported_model->named_parameters()) model_after_export.emplace_back(n, t.clone());
  p.save(path("step.kpkg"));
  ExportedProgram q = load_program(path("step.kpkg"));
  for (int i = 0; i < 3; ++i) {
    Tensor xi = randn({4, 8}), yi = randn({4, 4});
    Tensor expected = step(*eager_model, eager_opt, xi, yi);
    std::vector<Tensor> out = q.run({xi, yi});
    ASSERT_EQ(out.size(), 1u);
    EXPECT_TRUE(close(out[0], expected)) << "step " << i;
  }
  // The program trained its own copies: the exported model is as export left it.
  p.run({x, y});
  auto exported_params = exported_model->named_parameters();
  for (size_t i = 0; i < exported_params.size(); ++i) EXPECT_TRUE(equal(exported_params[i].second, model_after_export[i].second));
  NamedTensors state = q.state();
  auto params = eager_model->named_parameters();
  for (auto& [name, t] : params) {
    auto it = std::find_if(state.begin(), state.end(), [&](const auto& s) { return s.first.find(name) != std::string::npos; });
    ASSERT_NE(it, state.end()) << name;
    EXPECT_TRUE(close(it->second, t, {1e-5, 1e-5})) << name;
  }
}

// ---- another process, with no compiler ----

// Runs `kiln run` on `package` in a child process whose PATH holds no compiler, whose KILN_CXX
// points nowhere and whose kernel cache is empty: the package's own binaries must be enough.
int run_without_compiler(const std::string& package, const std::string& in, const std::string& out,
                         const std::string& cache, std::string& log, bool bundled_binaries = true) {
  const std::string kiln = std::string(KILN_BINARY_DIR) + "/bin/kiln";
  const std::string log_path = out + ".log";
  std::vector<std::string> argv = {kiln, "run", package, "--inputs", in, "--out", out};
  if (!bundled_binaries) argv.push_back("--no-bundled-binaries");
  std::vector<std::string> env = {"PATH=/nonexistent", "KILN_CXX=/nonexistent/c++", "KILN_CACHE_DIR=" + cache,
                                  "HOME=" + cache};
  // Where the loader finds Kiln's own dependencies (oneDNN, cuDNN) and which GPU: not compilers.
  for (const char* keep : {"LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES"})
    if (const char* v = std::getenv(keep)) env.push_back(std::string(keep) + "=" + v);
  std::vector<char*> a, e;
  for (auto& s : argv) a.push_back(s.data());
  a.push_back(nullptr);
  for (auto& s : env) e.push_back(s.data());
  e.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = 0;
  int rc = posix_spawn(&pid, kiln.c_str(), &actions, nullptr, a.data(), e.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return -1;
  int status = 0;
  waitpid(pid, &status, 0);
  std::ifstream lf(log_path);
  log.assign((std::istreambuf_iterator<char>(lf)), std::istreambuf_iterator<char>());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// The demonstration: ResNet-18 and a GPT-2-style decoder exported here with a dynamic
// batch, run by another process at two batch sizes without any compiler; outputs are this
// process's, bit for bit.
TEST_F(Export, AnotherProcessWithoutACompilerRunsResNetAndGPTAtTwoBatchSizes) {
  manual_seed(5);
  auto resnet = models::resnet18({.num_classes = 10});
  resnet->eval();
  auto gpt = std::make_shared<models::GPT>(models::GPTConfig::tiny());
  gpt->eval();
  ExportOptions options;
  options.dynamic = {{0, 0, "batch", {}}};
  struct Case {
    std::string name;
    ExportedProgram program;
    std::vector<Tensor> inputs;  // one per batch size
  };
  std::vector<Case> cases;
  cases.push_back({"resnet18", export_program(resnet, randn({2, 3, 32, 32}), options),
                   {randn({3, 3, 32, 32}), randn({5, 3, 32, 32})}});
  cases.push_back({"gpt", export_program(gpt, randint(0, 64, {2, 16}), options),
                   {randint(0, 64, {3, 16}), randint(0, 64, {6, 16})}});
  const std::string cache = path("empty_cache");
  fs::create_directories(cache);
  fs::permissions(cache, fs::perms::owner_all, fs::perm_options::replace);
  for (Case& c : cases) {
    const std::string package = path(c.name + ".kpkg");
    c.program.save(package);
    ExportedProgram here = load_program(package);  // a fresh program: the same first call as the child's
    for (size_t b = 0; b < c.inputs.size(); ++b) {
      const std::string in = path(c.name + std::to_string(b) + "_in.safetensors");
      const std::string out = path(c.name + std::to_string(b) + "_out.safetensors");
      save_safetensors(in, {{"arg0", c.inputs[b]}});
      Tensor expected = here.run({c.inputs[b]})[0];
      std::string log;
      ASSERT_EQ(run_without_compiler(package, in, out, cache, log), 0) << c.name << " batch " << b << ":\n" << log;
      NamedTensors got = load_safetensors(out);
      ASSERT_EQ(got.size(), 1u);
      EXPECT_TRUE(equal(got[0].second, expected)) << c.name << " at batch " << c.inputs[b].size(0);
    }
  }
  // The child found nothing to build: its cache holds no kernel library.
  for (const auto& entry : fs::recursive_directory_iterator(cache))
    EXPECT_NE(entry.path().extension(), ".so") << entry.path();
  // And it could not have: without the package's binaries the same child fails, saying why.
  std::string log;
  EXPECT_NE(run_without_compiler(path("gpt.kpkg"), path("gpt0_in.safetensors"), path("refused.safetensors"), cache, log,
                                 /*bundled_binaries=*/false),
            0);
  EXPECT_TRUE(contains(log, "bundled binaries are turned off")) << log;
  EXPECT_TRUE(contains(log, "cannot run the C++ compiler")) << log;
}

// On a GPU: a program exported on cuda runs in another process from its package, its CUDA
// binaries taken from the package (the child's kernel cache starts empty and ends with no cubin).
TEST_F(Export, CudaProgramRunsInAnotherProcessFromItsPackage) {
  if (!cuda::is_available()) GTEST_SKIP() << "no GPU";
  manual_seed(9);
  auto model = models::resnet18({.num_classes = 10});
  model->to(cuda_device());
  model->eval();
  ExportOptions options;
  options.dynamic = {{0, 0, "batch", {}}};
  const std::string package = path("cuda.kpkg");
  export_program(model, randn({2, 3, 32, 32}, cuda_device()), options).save(package);
  ExportedProgram here = load_program(package);
  Tensor x = randn({3, 3, 32, 32});
  save_safetensors(path("cuda_in.safetensors"), {{"arg0", x}});
  Tensor expected = here.run({x.to(cuda_device())})[0].to(kCPU);
  const std::string cache = path("empty_cuda_cache");
  fs::create_directories(cache);
  fs::permissions(cache, fs::perms::owner_all, fs::perm_options::replace);
  std::string log;
  ASSERT_EQ(run_without_compiler(package, path("cuda_in.safetensors"), path("cuda_out.safetensors"), cache, log), 0) << log;
  NamedTensors got = load_safetensors(path("cuda_out.safetensors"));
  EXPECT_TRUE(close(got[0].second, expected, {1e-4, 1e-4}));
  for (const auto& entry : fs::recursive_directory_iterator(cache))
    EXPECT_NE(entry.path().parent_path().filename().string().rfind("cuda", 0), 0u) << "built in the child: " << entry.path();
}

// ---- damaged packages ----

std::map<std::string, std::string> sections_of(const std::string& file) {
  return compiler::exporting::read_package(file);
}

void write_sections(const std::string& file, const std::map<std::string, std::string>& sections,
                    const std::vector<std::string>& order) {
  std::vector<compiler::exporting::Section> list;
  for (const auto& name : order) list.push_back({name, sections.at(name)});
  compiler::exporting::write_package(file, list);
}

std::vector<std::string> section_order(const std::string& file) {
  // The manifest lists sections in file order; read it back from the JSON.
  std::ifstream in(file, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[8 + i]);
  std::string manifest = bytes.substr(80, n);
  std::vector<std::string> names;
  for (size_t p = manifest.find("\"name\":\""); p != std::string::npos; p = manifest.find("\"name\":\"", p + 1)) {
    size_t start = p + 8;
    names.push_back(manifest.substr(start, manifest.find('"', start) - start));
  }
  return names;
}

TEST_F(Export, DamagedPackagesAreRefused) {
  auto model = small_mlp();
  const std::string good = path("good.kpkg");
  export_program(model, randn({4, 8})).save(good);
  std::ifstream in(good, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto write = [&](const std::string& name, const std::string& content) {
    std::ofstream(path(name), std::ios::binary) << content;
    return path(name);
  };
  // A flipped byte in the kernel binary.
  {
    const std::string so = sections_of(good).at("kernels/0/library.so");
    size_t at = bytes.find(so);
    ASSERT_NE(at, std::string::npos);
    std::string bad = bytes;
    bad[at + so.size() / 2] ^= 0x20;
    std::string e = error_of([&] { load_program(write("flipped.kpkg", bad)); });
    EXPECT_TRUE(contains(e, "section 'kernels/0/library.so' does not match its SHA-256")) << e;
  }
  // A truncated file (the weights are cut).
  {
    std::string e = error_of([&] { load_program(write("truncated.kpkg", bytes.substr(0, bytes.size() - 100))); });
    EXPECT_TRUE(contains(e, "truncated or damaged")) << e;
  }
  // Not a package at all.
  EXPECT_TRUE(contains(error_of([&] { load_program(write("text.kpkg", "hello")); }), "not a Kiln package"));
  EXPECT_THROW(load_program(path("missing.kpkg")), PackageError);
  const auto order = section_order(good);
  // An unknown op (the hashes are right: the package was re-written, not damaged).
  {
    auto sections = sections_of(good);
    std::string& graph = sections.at("graph.json");
    size_t at = graph.find("\"addmm\"");
    ASSERT_NE(at, std::string::npos);
    graph.replace(at, 7, "\"frobnicate\"");
    write_sections(path("unknown_op.kpkg"), sections, order);
    std::string e = error_of([&] { load_program(path("unknown_op.kpkg")); });
    EXPECT_TRUE(contains(e, "frobnicate")) << e;
  }
  // A program format from the future.
  {
    auto sections = sections_of(good);
    std::string& program = sections.at("program.json");
    size_t at = program.find("\"version\": 1");
    ASSERT_NE(at, std::string::npos) << program;
    program.replace(at, 12, "\"version\": 99");
    write_sections(path("future.kpkg"), sections, order);
    std::string e = error_of([&] { load_program(path("future.kpkg")); });
    EXPECT_TRUE(contains(e, "version is 99")) << e;
  }
  // A kernel library's build record without its binary (a re-written package, not a damaged one).
  {
    auto sections = sections_of(good);
    std::vector<std::string> without;
    for (const auto& name : order)
      if (name != "kernels/0/library.so") without.push_back(name);
    write_sections(path("no_binary.kpkg"), sections, without);
    try {
      load_program(path("no_binary.kpkg"));
      ADD_FAILURE() << "expected PackageError";
    } catch (const PackageError& e) {
      EXPECT_TRUE(contains(e.what(), "no section 'kernels/0/library.so'")) << e.what();
    }
  }
  // A weight whose bytes do not match its spec.
  {
    auto sections = sections_of(good);
    sections.at("weights.safetensors") = safetensors_bytes({{"0.weight", randn({2, 2})}});
    write_sections(path("weights.kpkg"), sections, order);
    std::string e = error_of([&] { load_program(path("weights.kpkg")); });
    EXPECT_TRUE(contains(e, "weight")) << e;
  }
}

}  // namespace
}  // namespace kiln
