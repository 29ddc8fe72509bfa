// Eager CUDA kernels of conv2d, conv2d_relu, conv2d_bn and convolution_backward on cuDNN, with
// the CPU kernels' semantics (kernels/cpu/conv_kernels.cpp):
//   - the layout: channels-last (NHWC activations, OHWI weights) when the input or the weight
//     suggests channels_last (the rule ops/conv.cpp's metas give the results), else NCHW. Operands
//     not dense in that layout are copied into it, results are written in place when their
//     memory has it and through a temporary otherwise. A configuration cuDNN has no NHWC
//     algorithm for (float64, say) runs in NCHW.
//   - math: float32 may use TF32 tensor cores when cudnn_allow_tf32() (PyTorch's default, on);
//     float16/bfloat16 accumulate in float32; float64 in float64.
//   - the bias is written into the output first and the convolution accumulates onto it
//     (beta = 1), so a 16-bit result is rounded once; the relu of conv2d_relu runs in place after
//     it (the same functor as the CPU's); conv2d_bn folds the batch norm into the weights and
//     bias with Kiln's CUDA pointwise ops, as the CPU kernel folds it, cached the same way.
//   - convolution_backward runs cuDNN's backward-data and backward-filter for the gradients
//     output_mask asks for; the bias gradient is an NVRTC reduction of grad_output that sums in
//     float32 (float64 for float64) and rounds once, as on the CPU.
//
// Each call first tries a cached execution plan of cuDNN's graph API (conv_graph.h: cuDNN's legacy
// calls rebuild a plan inside every call, most of an eager step's host time). The legacy plans
// (descriptors and the algorithm cudnnGet*Algorithm_v7 ranks first among those cuDNN
// supports for the configuration and precision setting; the next one when cuDNN refuses it at
// run time) are cached per configuration, layout and direction: they choose the layout, and run
// what the graph API has no plan for. Under compile()'s max_autotune
// (an AutotuneScope, kernels/autotune_scope.h; not under KILN_CONV_AUTOTUNE=0) a configuration's
// first plan is chosen by timing instead: every algorithm the heuristics offer runs on scratch
// operands and the fastest is cached as its own plan (never while a CUDA graph records:
// timing synchronizes; a recording takes the plan its warm-up run timed). cuDNN's legacy API takes int
// sizes: tensors of 2^31 elements or more are refused with a ShapeError.
#ifdef KILN_WITH_CUDNN

#include <cudnn.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <array>
#include <atomic>
#include <climits>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/autotune_scope.h"
#include "kernels/cuda/autotune.h"
#include "kernels/fold_batch_norm.h"
#include "kernels/cuda/conv_graph.h"
#include "kernels/cuda/conv_kernels.h"
#include "kernels/cuda/cuda_runtime.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/jit.h"
#include "kernels/cuda/library_handles.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cuda::detail {

namespace {

void check_cudnn(cudnnStatus_t status, const std::string& op) {
  if (status == CUDNN_STATUS_SUCCESS) [[likely]]
    return;
  std::string msg = "[kiln::" + op + "] cuDNN error: " + cudnnGetErrorString(status) + ".";
  if (status == CUDNN_STATUS_ALLOC_FAILED)
    msg +=
        " The GPU is out of memory: free tensors, call kiln::cuda::empty_cache(), or use smaller "
        "batches.";
  throw DeviceError(msg);
}

using Direction = ConvDirection;
using ConvParams = ConvShape;  // one configuration: sizes (NCHW order), parameters, dtype, layout, device

ConvParams conv_params(const Tensor& input, const Tensor& weight, IntArrayRef out_sizes,
                       const AttrAccess& a) {
  auto pair = [&](size_t i, int d) {
    IntArrayRef v = a.ints_attr(i);
    return v.size() == 1 ? v[0] : v[d];
  };
  return {input.sizes()[0],
          input.sizes()[1],
          input.sizes()[2],
          input.sizes()[3],
          weight.sizes()[0],
          weight.sizes()[2],
          weight.sizes()[3],
          out_sizes[2],
          out_sizes[3],
          {pair(0, 0), pair(0, 1)},
          {pair(1, 0), pair(1, 1)},
          {pair(2, 0), pair(2, 1)},
          a.int_attr(3),
          input.dtype(),
          false,
          input.device().index};
}

// cuDNN's legacy API counts elements, sizes and parameters in int.
void check_int_sizes(const std::string& op, std::initializer_list<const Tensor*> tensors,
                     const AttrAccess& attrs) {
  for (const Tensor* t : tensors) {
    KILN_CHECK(
        !t->defined() || t->numel() <= INT_MAX, ShapeError,
        "[kiln::" + op +
            "] cuDNN convolutions take tensors of fewer than 2^31 elements, but got one of shape " +
            shape_str(t->sizes()) + ". Split the batch into smaller ones.");
  }
  for (size_t i = 0; i < 3; ++i)
    for (int64_t v : attrs.ints_attr(i))
      KILN_CHECK(
          v <= INT_MAX, ShapeError,
          "[kiln::" + op +
              "] cuDNN convolutions take strides, padding and dilation below 2^31, but got " +
              std::to_string(v) + ". Use smaller values.");
}

cudnnDataType_t data_type(DType t) {
  switch (t) {
    case DType::float16:
      return CUDNN_DATA_HALF;
    case DType::bfloat16:
      return CUDNN_DATA_BFLOAT16;
    case DType::float64:
      return CUDNN_DATA_DOUBLE;
    default:
      return CUDNN_DATA_FLOAT;
  }
}

// cuDNN descriptors, destroyed with their owner.
struct TensorDesc {
  cudnnTensorDescriptor_t d = nullptr;
  TensorDesc() { check_cudnn(cudnnCreateTensorDescriptor(&d), "conv2d"); }
  ~TensorDesc() { cudnnDestroyTensorDescriptor(d); }
  TensorDesc(const TensorDesc&) = delete;
  TensorDesc& operator=(const TensorDesc&) = delete;
  // A dense 4-d tensor (sizes in NCHW order) in `channels_last` or NCHW memory order.
  void set(DType t, bool channels_last, int64_t n, int64_t c, int64_t h, int64_t w) {
    check_cudnn(cudnnSetTensor4dDescriptor(d, channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                           data_type(t), static_cast<int>(n), static_cast<int>(c),
                                           static_cast<int>(h), static_cast<int>(w)),
                "conv2d");
  }
};

struct FilterDesc {
  cudnnFilterDescriptor_t d = nullptr;
  FilterDesc() { check_cudnn(cudnnCreateFilterDescriptor(&d), "conv2d"); }
  ~FilterDesc() { cudnnDestroyFilterDescriptor(d); }
  FilterDesc(const FilterDesc&) = delete;
  FilterDesc& operator=(const FilterDesc&) = delete;
};

struct ConvDesc {
  cudnnConvolutionDescriptor_t d = nullptr;
  ConvDesc() { check_cudnn(cudnnCreateConvolutionDescriptor(&d), "conv2d"); }
  ~ConvDesc() { cudnnDestroyConvolutionDescriptor(d); }
  ConvDesc(const ConvDesc&) = delete;
  ConvDesc& operator=(const ConvDesc&) = delete;
};

// Everything one direction of one configuration needs. Immutable once built: cuDNN only reads
// descriptors, so threads share plans.
struct ConvPlan {
  TensorDesc x, y;
  FilterDesc w;
  ConvDesc conv;
  int algorithm = 0;  // the direction's cudnnConvolution*Algo_t
  size_t workspace = 0;
  uint32_t excluded = 0;  // algorithms (bit per enum value) that failed at run time
};

// Whether cuDNN refused a call for want of support (before running anything).
bool is_not_supported(cudnnStatus_t status) {
#if CUDNN_MAJOR >= 9
  return status >= CUDNN_STATUS_NOT_SUPPORTED && status < CUDNN_STATUS_INTERNAL_ERROR;
#else
  return status == CUDNN_STATUS_NOT_SUPPORTED;
#endif
}

// The math mode to run a result of cudnnGet*Algorithm_v7 in, if it is acceptable: float32 uses
// TF32 only when allowed (otherwise FMA math, which PyTorch asserts the results come with);
// float32/float64 never down-convert their inputs.
std::optional<cudnnMathType_t> math_mode(cudnnMathType_t math, DType t, bool allow_tf32) {
  if (t == DType::float32 && !allow_tf32) {
    if (math == CUDNN_FMA_MATH || math == CUDNN_DEFAULT_MATH) return CUDNN_FMA_MATH;
    return std::nullopt;
  }
  if ((t == DType::float32 || t == DType::float64) && math == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION)
    return std::nullopt;
  return math;
}

constexpr size_t kMaxWorkspace = size_t{1}
                                 << 30;  // skip algorithms that want more scratch than this

// An algorithm a plan may take: one cuDNN supports here, in an acceptable math mode, with bounded
// scratch.
struct Candidate {
  int algo;
  cudnnMathType_t math;
  size_t bytes;
};

// The first `limit` candidates of a heuristics ranking (cuDNN ranks by expected speed), in its
// order, skipping the plan's excluded algorithms.
template <class Perf>
std::vector<Candidate> candidates_of(ConvPlan& plan, const Perf* perf, int count, DType t, bool allow_tf32,
                                     const std::function<cudnnStatus_t(int, size_t*)>& workspace_size,
                                     size_t limit) {
  std::vector<Candidate> out;
  for (int i = 0; i < count && out.size() < limit; ++i) {
    const int algo = static_cast<int>(perf[i].algo);
    if (perf[i].status != CUDNN_STATUS_SUCCESS || (algo < 32 && (plan.excluded >> algo) & 1u)) continue;
    const std::optional<cudnnMathType_t> math = math_mode(perf[i].mathType, t, allow_tf32);
    if (!math || cudnnSetConvolutionMathType(plan.conv.d, *math) != CUDNN_STATUS_SUCCESS) continue;
    size_t bytes = 0;
    if (workspace_size(algo, &bytes) != CUDNN_STATUS_SUCCESS || bytes > kMaxWorkspace) continue;
    out.push_back({algo, *math, bytes});
  }
  return out;
}

// Makes `c` the plan's algorithm, its math mode the descriptor's.
void take(ConvPlan& plan, const Candidate& c) {
  check_cudnn(cudnnSetConvolutionMathType(plan.conv.d, c.math), "conv2d");
  plan.algorithm = c.algo;
  plan.workspace = c.bytes;
}

// Takes the heuristics' first candidate. False: none.
template <class Perf>
bool choose(ConvPlan& plan, const Perf* perf, int count, DType t, bool allow_tf32,
            const std::function<cudnnStatus_t(int, size_t*)>& workspace_size) {
  const std::vector<Candidate> first = candidates_of(plan, perf, count, t, allow_tf32, workspace_size, 1);
  if (first.empty()) return false;
  take(plan, first.front());
  return true;
}

// The scaling factors of a cuDNN call: double for float64 data, float otherwise.
struct Scale {
  float f;
  double d;
  const void* of(DType t) const { return t == DType::float64 ? static_cast<const void*>(&d) : &f; }
};
constexpr Scale kOne{1.0f, 1.0}, kZero{0.0f, 0.0};

// Operands of one configuration for timing candidates (x, w, y: input, weight, output in the
// plan's layout; a backward direction reads and writes the same three), and the scales. They
// hold 0.5, not zeros: cuDNN's direct engines skip zero weights, so zeroed operands made them
// look several times faster than they are (DenseNet inference under max_autotune ran 2.3x
// slower than under reduce_overhead). No random fill: timing must not move the RNG streams.
struct Scratch {
  Tensor xt, wt, yt;
  void *x, *w, *y;
  const void *one, *zero;
  explicit Scratch(const ConvParams& p) : one(kOne.of(p.dtype)), zero(kZero.of(p.dtype)) {
    const Device d = cuda_device(p.device);
    auto make = [&](std::vector<int64_t> sizes) {
      Tensor t = full(sizes, 0.5, TensorOptions(p.dtype, d));
      return p.channels_last ? t.contiguous(MemoryFormat::channels_last) : t;
    };
    xt = make({p.n, p.c, p.h, p.w});
    wt = make({p.o, p.c / p.groups, p.kh, p.kw});
    yt = make({p.n, p.o, p.oh, p.ow});
    x = xt.impl().data();
    w = wt.impl().data();
    y = yt.impl().data();
  }
};

// max_autotune: times the heuristics' first 8 candidates (candidates_of), in their order, on
// scratch operands (time_queued_runs, fastest: autotune.h) and takes the fastest. Sets the
// winner's math mode.
template <class Perf, class Run>
bool choose_timed(ConvPlan& plan, const Perf* perf, int count, const ConvParams& p, bool allow_tf32,
                  const std::function<cudnnStatus_t(int, size_t*)>& workspace_size, Run run) {
  const std::vector<Candidate> candidates = candidates_of(plan, perf, count, p.dtype, allow_tf32, workspace_size, 8);
  if (candidates.empty()) return false;
  Scratch m(p);
  cudaStream_t stream = current_stream(p.device);
  std::vector<float> ms;
  std::vector<std::string> labels;
  for (const Candidate& c : candidates) {
    check_cudnn(cudnnSetConvolutionMathType(plan.conv.d, c.math), "conv2d (max_autotune)");
    Tensor ws = workspace(static_cast<int64_t>(c.bytes), cuda_device(p.device));
    void* ws_data = ws.defined() ? ws.impl().data() : nullptr;
    // A refused algorithm is not a candidate.
    ms.push_back(time_queued_runs(p.device, stream, [&] { return run(c.algo, ws_data, c.bytes, m) == CUDNN_STATUS_SUCCESS; }));
    labels.push_back(fmt::format("algo{}/math{}", c.algo, static_cast<int>(c.math)));
  }
  const int best = fastest(ms);
  log_autotune(fmt::format("conv n{} c{} {}x{} o{} k{}x{} s{} {}", p.n, p.c, p.h, p.w, p.o, p.kh, p.kw, p.stride[0],
                           p.channels_last ? "nhwc" : "nchw"),
               labels, ms, best);
  if (best < 0) return false;
  take(plan, candidates[best]);
  return true;
}

std::atomic<int64_t> g_timed_plans{0};  // conv_plans_timed()

// Builds the plan of `p` for `direction`, skipping the `excluded` algorithms, its algorithm timed
// when `timed`; nullptr when cuDNN has no algorithm for it.
std::shared_ptr<const ConvPlan> build_plan(const ConvParams& p, Direction direction,
                                           bool allow_tf32, uint32_t excluded, bool timed) {
  auto plan = std::make_shared<ConvPlan>();
  plan->excluded = excluded;
  const DType t = p.dtype;
  plan->x.set(t, p.channels_last, p.n, p.c, p.h, p.w);
  plan->y.set(t, p.channels_last, p.n, p.o, p.oh, p.ow);
  check_cudnn(cudnnSetFilter4dDescriptor(plan->w.d, data_type(t),
                                         p.channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                         static_cast<int>(p.o), static_cast<int>(p.c / p.groups),
                                         static_cast<int>(p.kh), static_cast<int>(p.kw)),
              "conv2d");
  const cudnnDataType_t compute = t == DType::float64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
  auto to_int = [](int64_t v) { return static_cast<int>(v); };  // checked by check_int_sizes
  check_cudnn(cudnnSetConvolution2dDescriptor(plan->conv.d, to_int(p.pad[0]), to_int(p.pad[1]),
                                              to_int(p.stride[0]), to_int(p.stride[1]),
                                              to_int(p.dilation[0]), to_int(p.dilation[1]),
                                              CUDNN_CROSS_CORRELATION, compute),
              "conv2d");
  check_cudnn(cudnnSetConvolutionGroupCount(plan->conv.d, static_cast<int>(p.groups)), "conv2d");
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
  if (t == DType::float16 || t == DType::bfloat16)
    math = CUDNN_TENSOR_OP_MATH;
  else if (t == DType::float32 && !allow_tf32)
    math = CUDNN_FMA_MATH;
  check_cudnn(cudnnSetConvolutionMathType(plan->conv.d, math), "conv2d");

  cudnnHandle_t handle = cudnn_handle(p.device);
  int count = 0;
  bool found = false;
  // The heuristics' ranking, taken as is or timed (max_autotune).
  auto pick = [&](const auto* perf, const std::function<cudnnStatus_t(int, size_t*)>& bytes_of, auto run) {
    return timed ? choose_timed(*plan, perf, count, p, allow_tf32, bytes_of, run)
                 : choose(*plan, perf, count, t, allow_tf32, bytes_of);
  };
  switch (direction) {
    case Direction::forward: {
      std::array<cudnnConvolutionFwdAlgoPerf_t, CUDNN_CONVOLUTION_FWD_ALGO_COUNT> perf{};
      const int n = static_cast<int>(perf.size());
      check_cudnn(cudnnGetConvolutionForwardAlgorithm_v7(handle, plan->x.d, plan->w.d, plan->conv.d, plan->y.d, n,
                                                         &count, perf.data()),
                  "conv2d");
      auto bytes_of = [&](int algo, size_t* bytes) {
        return cudnnGetConvolutionForwardWorkspaceSize(handle, plan->x.d, plan->w.d, plan->conv.d, plan->y.d,
                                                       static_cast<cudnnConvolutionFwdAlgo_t>(algo), bytes);
      };
      found = pick(perf.data(), bytes_of, [&](int algo, void* ws, size_t bytes, Scratch& m) {
        return cudnnConvolutionForward(handle, m.one, plan->x.d, m.x, plan->w.d, m.w, plan->conv.d,
                                       static_cast<cudnnConvolutionFwdAlgo_t>(algo), ws, bytes, m.zero, plan->y.d, m.y);
      });
      break;
    }
    case Direction::backward_data: {
      std::array<cudnnConvolutionBwdDataAlgoPerf_t, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT> perf{};
      const int n = static_cast<int>(perf.size());
      check_cudnn(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, plan->w.d, plan->y.d, plan->conv.d, plan->x.d,
                                                              n, &count, perf.data()),
                  "convolution_backward");
      auto bytes_of = [&](int algo, size_t* bytes) {
        return cudnnGetConvolutionBackwardDataWorkspaceSize(handle, plan->w.d, plan->y.d, plan->conv.d, plan->x.d,
                                                            static_cast<cudnnConvolutionBwdDataAlgo_t>(algo), bytes);
      };
      found = pick(perf.data(), bytes_of, [&](int algo, void* ws, size_t bytes, Scratch& m) {
        return cudnnConvolutionBackwardData(handle, m.one, plan->w.d, m.w, plan->y.d, m.y, plan->conv.d,
                                            static_cast<cudnnConvolutionBwdDataAlgo_t>(algo), ws, bytes, m.zero,
                                            plan->x.d, m.x);
      });
      break;
    }
    case Direction::backward_filter: {
      std::array<cudnnConvolutionBwdFilterAlgoPerf_t, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT>
          perf{};
      const int n = static_cast<int>(perf.size());
      check_cudnn(cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, plan->x.d, plan->y.d, plan->conv.d,
                                                                plan->w.d, n, &count, perf.data()),
                  "convolution_backward");
      auto bytes_of = [&](int algo, size_t* bytes) {
        return cudnnGetConvolutionBackwardFilterWorkspaceSize(handle, plan->x.d, plan->y.d, plan->conv.d, plan->w.d,
                                                              static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo), bytes);
      };
      found = pick(perf.data(), bytes_of, [&](int algo, void* ws, size_t bytes, Scratch& m) {
        return cudnnConvolutionBackwardFilter(handle, m.one, plan->x.d, m.x, plan->y.d, m.y, plan->conv.d,
                                              static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo), ws, bytes, m.zero,
                                              plan->w.d, m.w);
      });
      break;
    }
  }
  if (found && timed) g_timed_plans.fetch_add(1, std::memory_order_relaxed);
  return found ? plan : nullptr;
}

[[noreturn]] void throw_no_algorithm(const std::string& op, const ConvParams& p);

// The configuration's fields, then direction, TF32 and whether the algorithm was timed.
using PlanKey = std::array<int64_t, kConvShapeFields + 3>;
constexpr size_t kTimedField = kConvShapeFields + 2;

// The cached plan of `p` for `direction` (nullptr: cuDNN has none). With `failed`, replaces the
// cached plan by one that no longer uses failed's algorithm (nor those it had excluded). The
// current device must be p.device.
std::shared_ptr<const ConvPlan> find_plan(const ConvParams& p, Direction direction,
                                          const ConvPlan* failed = nullptr) {
  const bool allow_tf32 = p.dtype == DType::float32 && cudnn_allow_tf32();
  // max_autotune times the algorithms (choose_timed). A CUDA graph recording cannot time (timing
  // synchronizes): it takes the plan its warm-up run timed, else the heuristics' plan.
  bool timed = kiln::kernels::convolutions_autotuned();
  PlanKey key = conv_plan_key<3>(p, {static_cast<int64_t>(direction), allow_tf32, timed});
  static std::mutex mutex;
  static auto* cache =
      new std::unordered_map<PlanKey, std::shared_ptr<const ConvPlan>, PlanKeyHash>;
  if (!failed) {
    std::lock_guard lock(mutex);
    if (auto it = cache->find(key); it != cache->end()) return it->second;
  }
  if (timed && capturing(p.device)) {
    timed = false;
    key[kTimedField] = 0;
    std::lock_guard lock(mutex);
    if (auto it = cache->find(key); !failed && it != cache->end()) return it->second;
  }
  const uint32_t excluded =
      failed ? failed->excluded | (failed->algorithm < 32 ? 1u << failed->algorithm : 0u) : 0u;
  auto plan = build_plan(p, direction, allow_tf32, excluded, timed);
  std::lock_guard lock(mutex);
  if (cache->size() >= 4096) cache->clear();  // shapes of a dynamic workload pile up otherwise
  (*cache)[key] = plan;
  return plan;
}

// Runs `call(plan)` on the cached plan of p and `direction`. cudnnGet*Algorithm_v7 ranks
// algorithms by heuristics, and cuDNN may still refuse the one it ranked first when it runs; then
// the next acceptable one takes its place (in the cache too), as PyTorch falls through its list.
template <class Call>
void run_plan(const ConvParams& p, Direction direction, const std::string& op, Call call) {
  std::shared_ptr<const ConvPlan> plan = find_plan(p, direction);
  if (!plan) throw_no_algorithm(op, p);
  for (;;) {
    const cudnnStatus_t status = call(*plan);
    if (status == CUDNN_STATUS_SUCCESS) return;
    if (!is_not_supported(status)) check_cudnn(status, op);
    plan = find_plan(p, direction, plan.get());
    if (!plan) check_cudnn(status, op);  // no algorithm left: cuDNN's own reason
  }
}

// Runs one direction through a cached graph-API plan (conv_graph.h), unless max_autotune times
// the legacy algorithms for this call or KILN_CUDNN_GRAPH=0; false: the caller takes the legacy
// API.
bool graph_ran(const ConvParams& p, Direction d, bool accumulate, void* x, void* w, void* y) {
  static const bool enabled = [] {
    const char* v = std::getenv("KILN_CUDNN_GRAPH");
    return !(v && std::string(v) == "0");
  }();
  if (!enabled || kiln::kernels::convolutions_autotuned()) return false;
  return run_conv_graph(p, d, accumulate, p.dtype == DType::float32 && cudnn_allow_tf32(), x, w, y);
}

MemoryFormat format_of(bool channels_last) {
  return channels_last ? kiln::channels_last : contiguous_format;
}

// `out` itself when it is dense in `format`, else a new tensor that is.
Tensor dense_buffer(const Tensor& out, MemoryFormat format) {
  if (out.is_contiguous(format)) return out;
  const bool channels_last = format == kiln::channels_last;
  return kiln::detail::make_empty_strided(out.sizes().vec(),
                                          channels_last ? kiln::detail::channels_last_strides(out.sizes())
                                                        : kiln::detail::contiguous_strides(out.sizes().vec()),
                                          out.dtype(), out.device());
}

// [kiln::op] no algorithm: what to do.
[[noreturn]] void throw_no_algorithm(const std::string& op, const ConvParams& p) {
  throw DeviceError("[kiln::" + op + "] cuDNN has no algorithm for this " +
                    std::string(dtype_name(p.dtype)) + " convolution (input " +
                    shape_str({p.n, p.c, p.h, p.w}) + ", weight " +
                    shape_str({p.o, p.c / p.groups, p.kh, p.kw}) + ", groups " +
                    std::to_string(p.groups) + "). Try float32, or run it on the CPU.");
}

// Sets p's layout to channels-last when preferred and cuDNN has a plan there for every direction
// in `directions`, else to NCHW (where it must have them all). Throws when cuDNN has none.
void choose_layout(ConvParams& p, bool prefer_channels_last,
                   const std::vector<Direction>& directions, const std::string& op) {
  for (bool channels_last : {true, false}) {
    // cuDNN's float64 kernels are NCHW ones: its backward-filter heuristics offered an NHWC
    // float64 plan that crashed on an H100 (cuDNN 9). NCHW float64 works; the result is the same.
    if (channels_last && (!prefer_channels_last || p.dtype == DType::float64)) continue;
    p.channels_last = channels_last;
    bool all = true;
    for (Direction d : directions) all = all && find_plan(p, d) != nullptr;
    if (all) return;
  }
  throw_no_algorithm(op, p);
}

bool prefers_channels_last(const Tensor& input, const Tensor& weight) {
  return input.suggest_memory_format() == MemoryFormat::channels_last ||
         weight.suggest_memory_format() == MemoryFormat::channels_last;
}

void fill_with_bias(Tensor& out, const Tensor& bias) {
  if (bias.defined())
    out.copy_(bias.view({1, bias.numel(), 1, 1}));
  else
    out.zero_();
}

// conv2d (inputs input, weight, bias?; attrs stride, padding, dilation, groups), then a relu.
void conv2d_impl(const OpCall& call, Tensor& out, bool relu) {
  const std::string& op = call.name();
  const Tensor& input = call.input(0);
  const Tensor& weight = call.input(1);
  const Tensor& bias = call.input(2);
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device().index);
  if (input.numel() == 0) {  // no input channels (or rows): the bias alone
    fill_with_bias(out, bias);
    if (relu) out.relu_();
    return;
  }
  check_int_sizes(op, {&input, &weight, &out}, call);
  ConvParams p = conv_params(input, weight, out.sizes(), call);
  choose_layout(p, prefers_channels_last(input, weight), {Direction::forward},
                op);  // decides the layout
  const MemoryFormat format = format_of(p.channels_last);
  const Tensor x = input.contiguous(format);
  const Tensor w = weight.contiguous(format);
  Tensor y = dense_buffer(out, format);
  const DType t = p.dtype;
  const Scale* beta = &kZero;
  if (bias.defined()) {  // the convolution accumulates onto the bias: one rounding
    y.copy_(bias.view({1, bias.numel(), 1, 1}));
    beta = &kOne;
  }
  if (!graph_ran(p, Direction::forward, bias.defined(), x.impl().data(), w.impl().data(),
                 y.impl().data()))
    run_plan(p, Direction::forward, op, [&](const ConvPlan& plan) {
      Tensor ws = workspace(static_cast<int64_t>(plan.workspace), out.device());
      return cudnnConvolutionForward(cudnn_handle(p.device), kOne.of(t), plan.x.d, x.impl().data(),
                                     plan.w.d, w.impl().data(), plan.conv.d,
                                     static_cast<cudnnConvolutionFwdAlgo_t>(plan.algorithm),
                                     ws.defined() ? ws.impl().data() : nullptr, plan.workspace,
                                     beta->of(t), plan.y.d, y.impl().data());
    });
  if (relu) y.relu_();
  if (!y.same(out)) out.copy_(y);
}

// ---------------- conv2d_bn ----------------

void conv2d_bn_kernel(const OpCall& call, std::span<Tensor> outs) {
  DeviceGuard guard(outs[0].device().index);
  // While a CUDA graph records, the fold runs as kernels inside the graph (no cache).
  const bool recording = capturing(call.input(1).device().index);
  auto [folded_w, folded_b] = kiln::detail::fold_batch_norm(call, /*use_cache=*/!recording);
  std::vector<Tensor> inputs{call.input(0), folded_w, folded_b};
  std::vector<Attr> attrs{call.attrs[0], call.attrs[1], call.attrs[2], call.attrs[3]};
  conv2d_impl(OpCall(call.op, inputs, attrs), outs[0], call.bool_attr(5));
}

// ---------------- backward ----------------

// grad_bias[o] = the sum of grad_output[:, o] over N, H and W, read with any strides, accumulated
// in float32 (float64 for float64) and rounded once, as the CPU's. One block strides over the
// elements of one channel and reduces its partial sums in shared memory; blocks stride over
// channels.
constexpr int kBiasGradBlock = 256;

struct BiasGradParams {  // mirrors the kernel's Params
  const void* dy;
  void* db;
  int64_t n, o, h, w, stride_n, stride_o, stride_h, stride_w, stride_db;
};

std::string bias_grad_source(DType t) {
  const bool half = t == DType::float16 || t == DType::bfloat16;
  return fmt::format(R"(#include "kiln/half.h"
typedef {0} T;
typedef {1} Acc;
struct Params {{
  const char* dy; char* db;
  long long n, o, h, w, stride_n, stride_o, stride_h, stride_w, stride_db;
}};
extern "C" __global__ void __launch_bounds__({2}) kiln_conv_bias_grad(Params p) {{
  __shared__ Acc partial[{2}];
  const long long per_channel = p.n * p.h * p.w;
  for (long long c = blockIdx.x; c < p.o; c += gridDim.x) {{
    const T* dy = reinterpret_cast<const T*>(p.dy) + c * p.stride_o;
    Acc acc = 0;
    for (long long i = threadIdx.x; i < per_channel; i += {2}) {{
      const long long x = i % p.w, r = i / p.w, y = r % p.h, n = r / p.h;
      acc += static_cast<Acc>({3}(dy[n * p.stride_n + y * p.stride_h + x * p.stride_w]));
    }}
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (int s = {2} / 2; s > 0; s >>= 1) {{
      if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
      __syncthreads();
    }}
    if (threadIdx.x == 0) reinterpret_cast<T*>(p.db)[c * p.stride_db] = T(partial[0]);
    __syncthreads();
  }}
}}
)",
                     cuda_type(t), t == DType::float64 ? "double" : "float", kBiasGradBlock,
                     half ? "static_cast<float>" : "");
}

void bias_grad(const Tensor& grad, Tensor& out) {
  if (grad.numel() == 0) {
    out.zero_();
    return;
  }
  const DType t = grad.dtype();
  const int device = grad.device().index;
  BiasGradParams p{grad.impl().data(), out.impl().data(), grad.sizes()[0],   grad.sizes()[1],
                   grad.sizes()[2],    grad.sizes()[3],   grad.strides()[0], grad.strides()[1],
                   grad.strides()[2],  grad.strides()[3], out.strides()[0]};
  JitFunction f = jit_function(device, std::string("conv_bias_grad|") + cuda_type(t),
                               "kiln_conv_bias_grad", [&] { return bias_grad_source(t); });
  const int64_t blocks =
      std::min<int64_t>(p.o, int64_t{properties(device).multiProcessorCount} * 8);
  void* args[] = {&p};
  launch(f, static_cast<unsigned>(blocks), kBiasGradBlock, 0, current_stream(device), args);
  check_launch("convolution_backward");
}

void convolution_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  const std::string& op = call.name();
  IntArrayRef mask = call.ints_attr(4);
  const bool need_dx = mask[0] != 0, need_dw = mask[1] != 0, need_db = mask[2] != 0;
  const Tensor& grad = call.input(0);
  const Tensor& input = call.input(1);
  const Tensor& weight = call.input(2);
  DeviceGuard guard(grad.device().index);
  check_int_sizes(op, {&grad, &input, &weight}, call);
  const bool prefer_cl = prefers_channels_last(input, weight);
  if (grad.numel() == 0 || input.numel() == 0 || weight.numel() == 0) {  // nothing reaches dx or dw
    if (need_dx) outs[0].zero_();
    if (need_dw) outs[1].zero_();
    if (need_db) bias_grad(grad, outs[2]);
    return;
  }
  ConvParams p = conv_params(input, weight, grad.sizes(), call);
  std::vector<Direction> directions;
  if (need_dx) directions.push_back(Direction::backward_data);
  if (need_dw) directions.push_back(Direction::backward_filter);
  if (!directions.empty()) choose_layout(p, prefer_cl, directions, op);  // decides the layout
  const MemoryFormat format = format_of(p.channels_last);
  const DType t = p.dtype;
  const Tensor dy = need_dx || need_dw ? grad.contiguous(format) : Tensor();
  if (need_dx) {
    const Tensor w = weight.contiguous(format);
    Tensor dx = dense_buffer(outs[0], format);
    if (!graph_ran(p, Direction::backward_data, false, dx.impl().data(), w.impl().data(),
                   dy.impl().data()))
      run_plan(p, Direction::backward_data, op, [&](const ConvPlan& plan) {
        Tensor ws = workspace(static_cast<int64_t>(plan.workspace), grad.device());
        return cudnnConvolutionBackwardData(
            cudnn_handle(p.device), kOne.of(t), plan.w.d, w.impl().data(), plan.y.d,
            dy.impl().data(), plan.conv.d,
            static_cast<cudnnConvolutionBwdDataAlgo_t>(plan.algorithm),
            ws.defined() ? ws.impl().data() : nullptr, plan.workspace, kZero.of(t), plan.x.d,
            dx.impl().data());
      });
    if (!dx.same(outs[0])) outs[0].copy_(dx);
  }
  if (need_dw) {
    const Tensor x = input.contiguous(format);
    Tensor dw = dense_buffer(outs[1], format);
    if (!graph_ran(p, Direction::backward_filter, false, x.impl().data(), dw.impl().data(),
                   dy.impl().data()))
      run_plan(p, Direction::backward_filter, op, [&](const ConvPlan& plan) {
        Tensor ws = workspace(static_cast<int64_t>(plan.workspace), grad.device());
        return cudnnConvolutionBackwardFilter(
            cudnn_handle(p.device), kOne.of(t), plan.x.d, x.impl().data(), plan.y.d,
            dy.impl().data(), plan.conv.d,
            static_cast<cudnnConvolutionBwdFilterAlgo_t>(plan.algorithm),
            ws.defined() ? ws.impl().data() : nullptr, plan.workspace, kZero.of(t), plan.w.d,
            dw.impl().data());
      });
    if (!dw.same(outs[1])) outs[1].copy_(dw);
  }
  if (need_db) bias_grad(grad, outs[2]);  // reads any strides
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("conv2d", DeviceType::cuda, [](const OpCall& call, std::span<Tensor> outs) {
    conv2d_impl(call, outs[0], false);
  });
  register_kernel("conv2d_relu", DeviceType::cuda, [](const OpCall& call, std::span<Tensor> outs) {
    conv2d_impl(call, outs[0], true);
  });
  register_kernel("conv2d_bn", DeviceType::cuda, conv2d_bn_kernel);
  register_kernel("convolution_backward", DeviceType::cuda, convolution_backward_kernel);
  return true;
}();

}  // namespace

std::string conv_bias_grad_source_for_test(DType t) {
  return bias_grad_source(t);
}

int64_t conv_plans_timed() { return g_timed_plans.load(std::memory_order_relaxed); }

}  // namespace kiln::cuda::detail

#endif  // KILN_WITH_CUDNN
