// The fused Adam/AdamW and SGD updates on CUDA (kernels/fused_optim.h), the kernels of
// _fused_adam_ and _fused_sgd_, in the manner of
// PyTorch's multi-tensor apply: (Adam) one launch increments every step counter, then each launch
// updates up to kTensors parameters, one block per chunk of kChunk elements of one of them, with
// the tensors' addresses and the block-to-chunk table passed by value in the kernel's parameter
// block (under the 4 KB every driver takes). DenseNet-121's 364 parameters take 13 launches
// instead of about 7000. The element math is kiln/math/optim.h, the CPU kernel's.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_runtime.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/jit.h"
#include "kernels/fused_optim.h"

namespace kiln::detail {

namespace {

using cuda::detail::JitFunction;

constexpr int kThreads = 256;
constexpr int kTensors = 32;        // per update launch
constexpr int kBlocks = 256;        // per update launch
constexpr int kSteps = 480;         // step counters per increment launch
constexpr long long kChunk = 65536;  // elements per block

struct StepParams {
  float* step[kSteps];
  int n;
};

struct AdamParams {
  void* param[kTensors];
  const void* grad[kTensors];
  void* exp_avg[kTensors];
  void* exp_avg_sq[kTensors];
  void* max_exp_avg_sq[kTensors];
  const float* step[kTensors];
  long long numel[kTensors];
  int block_tensor[kBlocks];
  int block_chunk[kBlocks];
  double lr, beta1, beta2, eps, weight_decay;
  int maximize, decoupled, amsgrad;
};
struct SgdParams {
  void* param[kTensors];
  const void* grad[kTensors];
  void* momentum_buffer[kTensors];
  long long numel[kTensors];
  int block_tensor[kBlocks];
  int block_chunk[kBlocks];
  unsigned char first[kTensors];
  double lr, momentum, dampening, weight_decay;
  int nesterov, maximize;
};
static_assert(sizeof(AdamParams) <= 4096 && sizeof(StepParams) <= 4096 && sizeof(SgdParams) <= 4096,
              "a kernel's parameters must fit 4 KB");

// Packs the parameters into launches of at most kTensors tensors and kBlocks chunks of kChunk
// elements: put(slot, i) writes parameter i's addresses into `slot` of the parameter block, whose
// block table is block_tensor/block_chunk, and launch(blocks) sends one block off.
template <class Put, class Launch>
void multi_tensor_launches(std::span<const Tensor> params, int* block_tensor, int* block_chunk, Put&& put,
                           Launch&& launch) {
  int tensors = 0, blocks = 0;
  auto flush = [&] {
    if (blocks > 0) launch(blocks);
    tensors = 0;
    blocks = 0;
  };
  for (size_t i = 0; i < params.size(); ++i) {
    const long long numel = params[i].numel();
    if (numel == 0) continue;
    if (tensors == kTensors) flush();
    put(tensors++, i);
    for (long long c = 0; c < (numel + kChunk - 1) / kChunk; ++c) {
      if (blocks == kBlocks) {  // the table is full: launch it, and go on with this tensor in the next
        flush();
        put(tensors++, i);
      }
      block_tensor[blocks] = tensors - 1;
      block_chunk[blocks] = static_cast<int>(c);
      ++blocks;
    }
  }
  flush();
}

// What every fused optimizer's source starts with: the element math, the device preamble, the
// storage type T and its opmath O for dtype `t`, and the launch planning's constants.
std::string source_head(DType t) {
  std::string src = "#include \"kiln/math/optim.h\"\n";
  src += cuda::detail::device_preamble();
  src += fmt::format("typedef {} T;\ntypedef kj::opmath<T> O;\n", cuda::detail::cuda_type(t));
  src += fmt::format("constexpr int kTensors = {}, kBlocks = {}, kSteps = {};\nconstexpr long long kChunk = {};\n", kTensors,
                     kBlocks, kSteps, kChunk);
  return src;
}

}  // namespace

std::string fused_adam_source(DType t) {
  std::string src = source_head(t);
  src += R"(struct StepParams { float* step[kSteps]; int n; };
struct AdamParams {
  T* param[kTensors]; const T* grad[kTensors]; T* exp_avg[kTensors]; T* exp_avg_sq[kTensors];
  T* max_exp_avg_sq[kTensors]; const float* step[kTensors]; long long numel[kTensors];
  int block_tensor[kBlocks]; int block_chunk[kBlocks];
  double lr, beta1, beta2, eps, weight_decay;
  int maximize, decoupled, amsgrad;
};
extern "C" __global__ void kiln_adam_steps(StepParams p) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < p.n) *p.step[i] += 1.0f;
}
extern "C" __global__ void __launch_bounds__(256) kiln_fused_adam(AdamParams p) {
  const int t = p.block_tensor[blockIdx.x];
  const long long begin = (long long)p.block_chunk[blockIdx.x] * kChunk;
  const long long end = min(begin + kChunk, p.numel[t]);
  const kiln::math::AdamUpdate<O> f = kiln::math::AdamUpdate<O>::at_step(
      p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, *p.step[t], p.maximize != 0, p.decoupled != 0, p.amsgrad != 0);
  for (long long k = begin + threadIdx.x; k < end; k += blockDim.x)
    f.update(p.param[t], p.grad[t], p.exp_avg[t], p.exp_avg_sq[t], p.max_exp_avg_sq[t], k);
}
)";
  return src;
}

void fused_adam_cuda(const AdamLists& l, const AdamHyper& h) {
  if (l.params.empty()) return;
  const DType dtype = l.params[0].dtype();
  const int device = l.params[0].device().index;
  const std::vector<JitFunction> fns = cuda::detail::jit_functions(
      device, std::string("fused_adam|") + std::string(dtype_name(dtype)), {"kiln_adam_steps", "kiln_fused_adam"},
      [&] { return fused_adam_source(dtype); });
  cuda::detail::DeviceGuard guard(device);
  cudaStream_t stream = cuda::detail::current_stream(device);
  const size_t n = l.params.size();

  for (size_t first = 0; first < n; first += kSteps) {
    StepParams sp{};
    sp.n = static_cast<int>(std::min<size_t>(kSteps, n - first));
    for (int i = 0; i < sp.n; ++i) sp.step[i] = static_cast<float*>(l.steps[first + i].impl().data());
    void* args[] = {&sp};
    cuda::detail::launch(fns[0], static_cast<unsigned>((sp.n + kThreads - 1) / kThreads), kThreads, 0, stream, args);
  }

  AdamParams p{};
  p.lr = h.lr;
  p.beta1 = h.beta1;
  p.beta2 = h.beta2;
  p.eps = h.eps;
  p.weight_decay = h.weight_decay;
  p.maximize = h.maximize;
  p.decoupled = h.decoupled;
  p.amsgrad = h.amsgrad;
  multi_tensor_launches(
      l.params, p.block_tensor, p.block_chunk,
      [&](int slot, size_t i) {
        p.param[slot] = l.params[i].impl().data();
        p.grad[slot] = l.grads[i].impl().data();
        p.exp_avg[slot] = l.exp_avgs[i].impl().data();
        p.exp_avg_sq[slot] = l.exp_avg_sqs[i].impl().data();
        p.max_exp_avg_sq[slot] = h.amsgrad ? l.max_exp_avg_sqs[i].impl().data() : nullptr;
        p.step[slot] = static_cast<const float*>(l.steps[i].impl().data());
        p.numel[slot] = l.params[i].numel();
      },
      [&](int blocks) {
        void* args[] = {&p};
        cuda::detail::launch(fns[1], static_cast<unsigned>(blocks), kThreads, 0, stream, args);
      });
}

std::string fused_sgd_source(DType t) {
  std::string src = source_head(t);
  src += R"(struct SgdParams {
  T* param[kTensors]; const T* grad[kTensors]; T* momentum_buffer[kTensors]; long long numel[kTensors];
  int block_tensor[kBlocks]; int block_chunk[kBlocks]; unsigned char first[kTensors];
  double lr, momentum, dampening, weight_decay;
  int nesterov, maximize;
};
extern "C" __global__ void __launch_bounds__(256) kiln_fused_sgd(SgdParams p) {
  const int t = p.block_tensor[blockIdx.x];
  const long long begin = (long long)p.block_chunk[blockIdx.x] * kChunk;
  const long long end = min(begin + kChunk, p.numel[t]);
  T* buf = p.momentum_buffer[t];
  const kiln::math::SgdUpdate<O> f{O(p.lr), O(p.momentum), O(1.0 - p.dampening), O(p.weight_decay),
                                   p.nesterov != 0, p.maximize != 0, buf != nullptr && p.first[t] != 0};
  for (long long k = begin + threadIdx.x; k < end; k += blockDim.x) f.update(p.param[t], p.grad[t], buf, k);
}
)";
  return src;
}

void fused_sgd_cuda(const SgdLists& l, const SgdHyper& h) {
  if (l.params.empty()) return;
  const DType dtype = l.params[0].dtype();
  const int device = l.params[0].device().index;
  const std::vector<JitFunction> fns = cuda::detail::jit_functions(
      device, std::string("fused_sgd|") + std::string(dtype_name(dtype)), {"kiln_fused_sgd"},
      [&] { return fused_sgd_source(dtype); });
  cuda::detail::DeviceGuard guard(device);
  cudaStream_t stream = cuda::detail::current_stream(device);
  const bool momentum = !l.momentum_buffers.empty();
  SgdParams p{};
  p.lr = h.lr;
  p.momentum = h.momentum;
  p.dampening = h.dampening;
  p.weight_decay = h.weight_decay;
  p.nesterov = h.nesterov;
  p.maximize = h.maximize;
  multi_tensor_launches(
      l.params, p.block_tensor, p.block_chunk,
      [&](int slot, size_t i) {
        p.param[slot] = l.params[i].impl().data();
        p.grad[slot] = l.grads[i].impl().data();
        p.momentum_buffer[slot] = momentum ? l.momentum_buffers[i].impl().data() : nullptr;
        p.first[slot] = momentum && l.first[i] != 0 ? 1 : 0;
        p.numel[slot] = l.params[i].numel();
      },
      [&](int blocks) {
        void* args[] = {&p};
        cuda::detail::launch(fns[0], static_cast<unsigned>(blocks), kThreads, 0, stream, args);
      });
}

namespace {

[[maybe_unused]] const bool registered = [] {
  register_fused_optimizer_kernels(DeviceType::cuda, fused_adam_cuda, fused_sgd_cuda);
  return true;
}();

}  // namespace

}  // namespace kiln::detail
