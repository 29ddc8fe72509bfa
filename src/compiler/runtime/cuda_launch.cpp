// Launch shapes of generated CUDA kernels (see cuda_launch.h).
#include "compiler/runtime/cuda_launch.h"

#include <atomic>

#include "kiln/error.h"

#ifdef KILN_WITH_CUDA
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

#include "kernels/cuda/autotune.h"
#include "kernels/cuda/cuda_runtime.h"
#include "kernels/cuda/jit.h"
#include "compiler/codegen/cuda/cuda_codegen.h"
#include "core/tensor_factory.h"
#endif

namespace kiln::compiler::runtime {

namespace {
std::atomic<int64_t> g_timed{0};
std::atomic<int> g_forced_block{0}, g_forced_per_sm{0};
}  // namespace

void force_launch_shape_for_test(int block, int per_sm) {
  KILN_CHECK(block == 0 || (block <= 256 && (block & (block - 1)) == 0), ValueError,
             "[kiln] force_launch_shape_for_test: block must be 0 or a power of two up to 256.");
  g_forced_per_sm.store(per_sm);
  g_forced_block.store(block);
}

int64_t generated_launches_timed() { return g_timed.load(std::memory_order_relaxed); }

#ifndef KILN_WITH_CUDA

void launch_generated(const GeneratedKernel&, std::vector<uint64_t>&, bool, const std::vector<Tensor>&,
                      const std::vector<int>&) {
  throw CompileError("[kiln::compile] a generated CUDA kernel, but Kiln was built without CUDA.");
}
void forget_tuned_launch_shapes_for_test() {}

#else

namespace {

namespace cu = kiln::cuda::detail;

// Threads a block, and the most blocks per SM (0: one per work item or per `block` elements).
struct Shape {
  int block = codegen::kCudaBlock;
  int per_sm = 16;
};

Shape default_shape(bool per_block) { return per_block ? Shape{codegen::kCudaBlock, 32} : Shape{codegen::kCudaBlock, 16}; }

int64_t grid_of(const GeneratedKernel& k, const Shape& s) {
  const int64_t wanted = k.per_block ? k.numel : (k.numel + s.block - 1) / s.block;
  const int64_t sms = cu::properties(k.device).multiProcessorCount;
  return std::max<int64_t>(1, s.per_sm > 0 ? std::min<int64_t>(wanted, sms * s.per_sm) : wanted);
}

// The candidates, the default first. A reduction's block reduces through shared memory sized for
// codegen::kCudaBlock threads and halves a power of two: its blocks stay powers of two up to that.
std::vector<Shape> candidates(const GeneratedKernel& k) {
  std::vector<Shape> all{default_shape(k.per_block)};
  const std::vector<int> blocks = k.per_block ? std::vector<int>{256, 128, 64, 32} : std::vector<int>{256, 128};
  const std::vector<int> per_sm = k.per_block ? std::vector<int>{32, 8, 0} : std::vector<int>{16, 4, 0};
  for (int b : blocks)
    for (int s : per_sm) all.push_back({b, s});
  // Shapes that launch the same grid and block are one candidate.
  std::vector<Shape> out;
  for (const Shape& s : all) {
    bool seen = false;
    for (const Shape& o : out) seen |= o.block == s.block && grid_of(k, o) == grid_of(k, s);
    if (!seen) out.push_back(s);
  }
  return out;
}

void launch_with(const GeneratedKernel& k, const Shape& s, std::vector<uint64_t>& params, cudaStream_t stream) {
  void* args[] = {params.data()};
  cu::launch(k.function, static_cast<unsigned>(grid_of(k, s)), static_cast<unsigned>(s.block), 0, stream, args);
}

std::mutex g_mutex;
std::unordered_map<const void*, Shape>& tuned_shapes() {
  static auto* shapes = new std::unordered_map<const void*, Shape>;  // per function, for the process
  return *shapes;
}

Shape tune(const GeneratedKernel& k, const std::vector<uint64_t>& params, const std::vector<Tensor>& env,
           const std::vector<int>& bindings, cudaStream_t stream) {
  const std::vector<Shape> shapes = candidates(k);
  // Elements that fit one block of the smallest size: every shape runs the same threads.
  if (shapes.size() < 2 || (!k.per_block && k.numel <= 128)) return shapes.front();
  // The timing runs write copies: the kernel may read what it writes (an optimizer's update of a
  // parameter), and the real run comes after.
  std::vector<uint64_t> scratch_params = params;
  std::vector<Tensor> scratch;
  for (size_t slot : k.written) {
    const Tensor& t = env[bindings[slot]];
    Tensor copy = kiln::detail::make_empty_strided(t.sizes().vec(), t.strides().vec(), t.dtype(), t.device());
    copy.copy_(t);
    void* ptr = copy.impl().data();
    std::memcpy(&scratch_params[slot], &ptr, sizeof(ptr));
    scratch.push_back(std::move(copy));
  }
  std::vector<float> ms;
  std::vector<std::string> labels;
  for (const Shape& s : shapes) {
    ms.push_back(cu::time_queued_runs(
        k.device, stream, [&] { return launch_with(k, s, scratch_params, stream), true; }, 3, 200000));
    labels.push_back(fmt::format("{}x{}", grid_of(k, s), s.block));
  }
  const int best = std::max(0, cu::fastest(ms));
  cu::log_autotune(fmt::format("generated kernel ({} {})", k.numel, k.per_block ? "reductions" : "elements"), labels,
                   ms, best);
  g_timed.fetch_add(1, std::memory_order_relaxed);
  return shapes[best];
}

}  // namespace

void forget_tuned_launch_shapes_for_test() {
  std::lock_guard lock(g_mutex);
  tuned_shapes().clear();
}

void launch_generated(const GeneratedKernel& k, std::vector<uint64_t>& params, bool tune_shape,
                      const std::vector<Tensor>& env, const std::vector<int>& bindings) {
  cu::DeviceGuard guard(k.device);
  cudaStream_t stream = cu::current_stream(k.device);
  Shape shape = default_shape(k.per_block);
  if (tune_shape) {
    // A CUDA graph recording cannot time (timing synchronizes): it launches what its warm-up run
    // chose, else the default.
    std::unique_lock lock(g_mutex);
    auto it = tuned_shapes().find(k.function);
    if (it != tuned_shapes().end()) {
      shape = it->second;
    } else if (!cu::capturing(k.device)) {
      lock.unlock();
      shape = tune(k, params, env, bindings, stream);
      lock.lock();
      tuned_shapes()[k.function] = shape;
    }
  }
  if (const int forced = g_forced_block.load(); forced > 0) shape = {forced, g_forced_per_sm.load()};
  launch_with(k, shape, params, stream);
}

#endif  // KILN_WITH_CUDA

}  // namespace kiln::compiler::runtime
