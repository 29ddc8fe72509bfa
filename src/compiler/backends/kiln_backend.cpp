// The `kiln` backend (alias "inductor"): graph passes (graph/pipeline.cpp) → scheduler (fusion) →
// C++ and CUDA code generation → system compiler and NVRTC (cached on disk) → an executable
// (runtime/executable.h) that runs the generated kernels and dispatches the remaining nodes
// (DESIGN §2.5).
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "compiler/capture/compile_trace.h"
#include "compiler/capture/runtime.h"
#include "compiler/codegen/cpp/cpp_codegen.h"
#include "compiler/codegen/cuda/cuda_codegen.h"
#include "compiler/graph/passes.h"
#include "compiler/graph/pipeline.h"
#include "compiler/lower/loop_ir.h"
#include "compiler/lower/memory_plan.h"
#include "compiler/runtime/cuda_graph.h"
#include "compiler/runtime/executable.h"
#include "compiler/runtime/kernel_cache.h"

namespace kiln::compiler {

namespace {

// Steps per call from which a GPU graph without CUDA graphs is likely launch-bound (at a few
// microseconds of host time per launch, a few hundred microseconds a call).
constexpr size_t kLaunchBoundSteps = 64;

// KILN_COMPILE_DEBUG=1: a folder per compiled graph with the graph, the loop IR and the sources.
void write_debug(const Graph& before, const lower::Program& p, const lower::MemoryPlan& plan,
                 const std::vector<std::string>& sources, const std::vector<codegen::CudaKernelSource>& cuda_sources) {
  const char* flag = std::getenv("KILN_COMPILE_DEBUG");
  if (!flag || std::string(flag) == "0") return;
  static std::atomic<int> counter{0};
  namespace fs = std::filesystem;
  const char* root = std::getenv("KILN_COMPILE_DEBUG_DIR");
  fs::path dir = fs::path(root ? root : "kiln_compile_debug") /
                 ("graph_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return;
  std::ofstream(dir / "graph.txt") << before.str();
  std::ofstream(dir / "graph_tabular.txt") << before.tabular();
  std::ofstream(dir / "graph.dot") << before.dot();
  std::ofstream(dir / "graph_after_passes.txt") << p.graph.str();
  std::ofstream(dir / "loop_ir.txt") << lower::describe(p) << lower::describe(plan, p);
  for (size_t i = 0; i < sources.size(); ++i) std::ofstream(dir / ("kernels_" + std::to_string(i) + ".cpp")) << sources[i];
  for (size_t i = 0; i < cuda_sources.size(); ++i) {
    if (!cuda_sources[i].source.empty())
      std::ofstream(dir / ("kernel_" + std::to_string(i) + ".cu")) << cuda_sources[i].source;  // per Program kernel
  }
  detail::log_stream() << "[kiln.compile] debug trace: " << dir.string() << "\n";
}

// KILN_PACKED_GEMM=0 runs linear layers' GEMMs through the dispatcher, as eager does (to compare).
bool packed_gemms_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("KILN_PACKED_GEMM");
    return v == nullptr || std::string(v) != "0";
  }();
  return enabled;
}

CompiledFn kiln_backend(Graph& graph, const Arguments&) {
  Graph before = graph;
  const bool dynamic_sizes = graph.dynamic;
  passes::PipelineOptions pipeline;
  if (const CompileOptions* o = compiling_options())
    if (auto it = o->options.find("layout_optimization"); it != o->options.end())
      pipeline.layout_optimization = std::get<bool>(it->second);
  passes::run_kiln_pipeline(graph, pipeline);  // compiler/graph/pipeline.cpp: the passes, in order
  auto ex = std::make_shared<runtime::Executable>();
  ex->program = lower::schedule(std::move(graph));
  ex->program.dynamic_sizes = dynamic_sizes;
  lower::elide_copy_backs(ex->program);
  const Graph& g = ex->program.graph;
  ex->slots.resize(g.nodes.size());
  // Linear layers' GEMMs with their weights packed once (runtime/packed_gemm.h).
  {
    const std::vector<char> written = passes::internal::written_memory(g);
    for (int v : g.inputs) ex->writes_inputs |= v >= 0 && written[v];
    if (packed_gemms_enabled()) {
      ex->packed_gemms.resize(g.nodes.size());
      for (const lower::Step& step : ex->program.steps)
        if (step.kind == lower::Step::Kind::node)
          ex->packed_gemms[step.node] = runtime::plan_packed_gemm(g, g.nodes[step.node], written);
    }
  }
  for (size_t k = 0; k < g.scalars.size(); ++k)
    if (g.scalars[k].node >= 0) ex->slots[g.scalars[k].node].emplace_back(g.scalars[k].attr, static_cast<int>(k));
  for (auto& k : ex->program.kernels) {
    // KILN_PROFILE=1 reports generated kernels by what they fuse: "kernel[cat+sub+mul+...]".
    std::string ops;
    for (size_t i = 0; i < k.ops.size() && i < 6; ++i) {
      std::string op = k.ops[i];
      while (!op.empty() && (std::isdigit(static_cast<unsigned char>(op.back())) || op.back() == '_')) op.pop_back();
      ops += (i ? "+" : "") + op;
    }
    if (k.ops.size() > 6) ops += "+...";
    k.profile_name = "kernel[" + ops + "]";
  }
  std::vector<std::string> sources = codegen::generate_cpp(ex->program);
  // Per Program kernel: the CUDA source of a kernel on a GPU (empty for CPU kernels).
  std::vector<codegen::CudaKernelSource> cuda_sources(ex->program.kernels.size());
  for (size_t i = 0; i < cuda_sources.size(); ++i)
    if (!ex->program.kernels[i].device.is_cpu()) cuda_sources[i] = codegen::generate_cuda(ex->program.kernels[i], ex->program.dynamic_sizes);
  // reduce_overhead: a static memory plan, so that a call allocates only its outputs.
  // max_autotune includes it too, as torch's max-autotune includes CUDA graphs (the static plan is
  // the CPU's counterpart); max_autotune_no_cudagraphs does not.
  if (const CompileOptions* opts = compiling_options();
      opts && (opts->mode == Mode::reduce_overhead || opts->mode == Mode::max_autotune)) {
    ex->plan = lower::plan_memory(ex->program);
    if (!ex->plan.empty()) ex->arena = std::make_unique<runtime::Arena>();
  }
  if (const CompileOptions* o = compiling_options()) ex->autotune = o->mode == Mode::max_autotune || o->mode == Mode::max_autotune_no_cudagraphs;
  write_debug(before, ex->program, ex->plan, sources, cuda_sources);
  if (detail::log_options().output_code) {
    for (const auto& s : sources) detail::log_stream() << "[kiln.compile] output code:\n" << s;
  }
  if (detail::compile_trace_on())
    for (size_t i = 0; i < sources.size(); ++i)
      detail::trace_event("source", {{"language", "c++"}, {"unit", i}, {"text", sources[i]}});
  runtime::prepare_cuda_kernels(*ex, cuda_sources);  // NVRTC, in batches: a call only launches
  if (!sources.empty()) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::string> flags;
    if (const char* opt = std::getenv("KILN_CPP_OPT")) flags.push_back(std::string("-O") + opt);  // e.g. 2
    ex->library = runtime::load_or_build({sources, flags, "graph of " + std::to_string(g.nodes.size()) + " ops"});
    detail::record_phase("cpp_build (kiln)",
                         std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    for (size_t i = 0; i < ex->program.kernels.size(); ++i) {
      const lower::Kernel& k = ex->program.kernels[i];
      if (k.device.is_cpu())
        ex->kernels[i] = ex->library->function<void(void* const*, const double*, const int64_t*, const int64_t*)>(k.name.c_str());
    }
  }
  runtime::flatten_steps(*ex);  // last: it points into the kernels' size arguments, which codegen fills
  if (const CompileOptions* o = compiling_options();
      o && (o->mode == Mode::reduce_overhead || o->mode == Mode::max_autotune) && runtime::CudaGraphRunner::applies(g)) {
    // On a GPU, reduce_overhead replays the whole graph as one CUDA graph.
    std::vector<char> written = passes::internal::written_memory(g);
    std::vector<bool> written_inputs;
    for (int v : g.inputs) written_inputs.push_back(v >= 0 && written[v]);
    auto runner = std::make_shared<runtime::CudaGraphRunner>([ex](const Arguments& a) { return runtime::run(*ex, a); },
                                                             std::move(written_inputs));
    return [runner](const Arguments& args) { return (*runner)(args); };
  }
  // Without CUDA graphs, a call on a GPU launches each step from the host; with many steps the
  // host bounds the call, which reduce_overhead's single graph launch removes. Say so, as torch's
  // perf_hints suggests cudagraphs.
  if (detail::log_options().perf_hints && ex->program.steps.size() >= kLaunchBoundSteps &&
      runtime::CudaGraphRunner::applies(g))
    detail::log_stream() << "[kiln.perf_hints] this graph launches " << ex->program.steps.size()
                         << " kernels and library calls from the host on every call; on a GPU that is host-bound "
                            "work, which mode = reduce_overhead replays as one CUDA graph\n";
  return [ex](const Arguments& args) { return runtime::run(*ex, args); };
}

[[maybe_unused]] const bool registered = [] {
  register_backend("kiln", kiln_backend, {"aot_autograd"});  // the saved-value partition applies
  register_backend("inductor", kiln_backend, {"aot_autograd"});
  return true;
}();

}  // namespace

}  // namespace kiln::compiler
