// Convolutions through cuDNN's graph API with cached execution plans (conv_graph.h).
#ifdef KILN_WITH_CUDNN

#include "kernels/cuda/conv_graph.h"

#include <cudnn.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/cuda/cuda_runtime.h"
#include "kernels/cuda/library_handles.h"
#include "kiln/error.h"

namespace kiln::cuda::detail {

namespace {

constexpr size_t kMaxWorkspace = size_t{1} << 30;  // as the legacy plans: skip engines wanting more
constexpr int kMaxConfigs = 12;                    // heuristics results tried, best first
constexpr int64_t kUidX = 'x', kUidW = 'w', kUidY = 'y';

std::atomic<int64_t> g_built{0};

struct Destroy {
  void operator()(void* d) const { cudnnBackendDestroyDescriptor(static_cast<cudnnBackendDescriptor_t>(d)); }
};
using Desc = std::unique_ptr<void, Destroy>;

// A descriptor of `type`, or nullptr when cuDNN cannot create one.
Desc make(cudnnBackendDescriptorType_t type) {
  cudnnBackendDescriptor_t d = nullptr;
  if (cudnnBackendCreateDescriptor(type, &d) != CUDNN_STATUS_SUCCESS) return nullptr;
  return Desc(d);
}

// Attribute setting that remembers the first failure, so a builder reads top to bottom and checks once.
struct Builder {
  cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
  void set(const Desc& d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
           const void* values) {
    if (status == CUDNN_STATUS_SUCCESS) status = cudnnBackendSetAttribute(d.get(), name, type, count, values);
  }
  void set_desc(const Desc& d, cudnnBackendAttributeName_t name, const Desc& value) {
    void* v = value.get();
    set(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &v);
  }
  void finalize(const Desc& d) {
    if (status == CUDNN_STATUS_SUCCESS) status = cudnnBackendFinalize(d.get());
  }
  bool ok(const Desc& d) const { return d && status == CUDNN_STATUS_SUCCESS; }
};

cudnnDataType_t data_type(DType t) {
  switch (t) {
    case DType::float16: return CUDNN_DATA_HALF;
    case DType::bfloat16: return CUDNN_DATA_BFLOAT16;
    case DType::float64: return CUDNN_DATA_DOUBLE;
    default: return CUDNN_DATA_FLOAT;
  }
}

// A 4-d operand: dims in NCHW order, strides of the layout.
Desc tensor(Builder& b, int64_t uid, DType t, bool channels_last, int64_t n, int64_t c, int64_t h, int64_t w,
            int64_t alignment) {
  Desc d = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  if (!d) return d;
  const int64_t dims[4] = {n, c, h, w};
  const int64_t nchw[4] = {c * h * w, h * w, w, 1};
  const int64_t nhwc[4] = {h * w * c, 1, w * c, c};
  const cudnnDataType_t type = data_type(t);
  b.set(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
  b.set(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims);
  b.set(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, channels_last ? nhwc : nchw);
  b.set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
  b.set(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
  b.finalize(d);
  return d;
}

// Everything a plan refers to stays alive with it.
struct GraphPlan {
  Desc x, w, y, conv, op, graph, config, plan;
  int64_t workspace = 0;
};

// Whether an engine's numerics are acceptable: float32 uses tensor cores (TF32) only when
// allowed, and float32/float64 never down-convert their inputs.
bool acceptable(cudnnBackendDescriptor_t config, DType t, bool allow_tf32) {
  Desc engine = make(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  if (!engine) return false;
  void* e = engine.get();
  int64_t n = 0;
  if (cudnnBackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &e) !=
      CUDNN_STATUS_SUCCESS)
    return false;
  std::array<cudnnBackendNumericalNote_t, CUDNN_NUMERICAL_NOTE_TYPE_COUNT> notes{};
  if (cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                               static_cast<int64_t>(notes.size()), &n, notes.data()) != CUDNN_STATUS_SUCCESS)
    return false;
  const bool full_precision = t == DType::float32 || t == DType::float64;
  for (int64_t i = 0; i < n; ++i) {
    if (full_precision && notes[i] == CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS) return false;
    if (t == DType::float32 && !allow_tf32 && notes[i] == CUDNN_NUMERICAL_NOTE_TENSOR_CORE) return false;
  }
  return true;
}

// Builds the plan, or nullptr when the graph API has none that is acceptable.
std::shared_ptr<GraphPlan> build(cudnnHandle_t handle, const ConvShape& s, ConvDirection d, bool accumulate,
                                 bool allow_tf32, int64_t alignment) {
  auto g = std::make_shared<GraphPlan>();
  Builder b;
  const DType t = s.dtype;
  g->x = tensor(b, kUidX, t, s.channels_last, s.n, s.c, s.h, s.w, alignment);
  g->w = tensor(b, kUidW, t, s.channels_last, s.o, s.c / s.groups, s.kh, s.kw, alignment);
  g->y = tensor(b, kUidY, t, s.channels_last, s.n, s.o, s.oh, s.ow, alignment);
  if (!b.ok(g->x) || !b.ok(g->w) || !b.ok(g->y)) return nullptr;

  g->conv = make(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
  if (!g->conv) return nullptr;
  const cudnnDataType_t compute = t == DType::float64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  const int64_t spatial = 2;
  b.set(g->conv, CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
  b.set(g->conv, CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode);
  b.set(g->conv, CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &spatial);
  b.set(g->conv, CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, 2, s.dilation);
  b.set(g->conv, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, 2, s.stride);
  b.set(g->conv, CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, 2, s.pad);
  b.set(g->conv, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, 2, s.pad);
  b.finalize(g->conv);
  if (!b.ok(g->conv)) return nullptr;

  // alpha = 1; beta = 1 accumulates onto the output's values (the forward's bias), else 0.
  const double alpha64 = 1.0, beta64 = accumulate ? 1.0 : 0.0;
  const float alpha32 = 1.0f, beta32 = accumulate ? 1.0f : 0.0f;
  const bool f64 = t == DType::float64;
  const cudnnBackendAttributeType_t scale_type = f64 ? CUDNN_TYPE_DOUBLE : CUDNN_TYPE_FLOAT;
  const void* alpha = f64 ? static_cast<const void*>(&alpha64) : &alpha32;
  const void* beta = f64 ? static_cast<const void*>(&beta64) : &beta32;
  // The operation's descriptor and attribute names for x, w, y (the data gradient dx, the filter
  // gradient dw and dy in the backward directions), the convolution and the scales.
  struct OperationAttributes {
    cudnnBackendDescriptorType_t type;
    cudnnBackendAttributeName_t x, w, y, conv, alpha, beta;
  };
  static constexpr OperationAttributes kOperations[] = {
      {CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
       CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
       CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
       CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA},
      {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA},
      {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA},
  };
  const OperationAttributes& a = kOperations[static_cast<int>(d)];
  g->op = make(a.type);
  if (!g->op) return nullptr;
  b.set_desc(g->op, a.x, g->x);
  b.set_desc(g->op, a.w, g->w);
  b.set_desc(g->op, a.y, g->y);
  b.set_desc(g->op, a.conv, g->conv);
  b.set(g->op, a.alpha, scale_type, 1, alpha);
  b.set(g->op, a.beta, scale_type, 1, beta);
  b.finalize(g->op);
  if (!b.ok(g->op)) return nullptr;

  g->graph = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  if (!g->graph) return nullptr;
  b.set_desc(g->graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, g->op);
  b.set(g->graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  b.finalize(g->graph);
  if (!b.ok(g->graph)) return nullptr;

  Desc heuristics = make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  if (!heuristics) return nullptr;
  const cudnnBackendHeurMode_t heur_mode = CUDNN_HEUR_MODE_A;
  b.set_desc(heuristics, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, g->graph);
  b.set(heuristics, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &heur_mode);
  b.finalize(heuristics);
  if (!b.ok(heuristics)) return nullptr;
  int64_t count = 0;
  if (cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                               nullptr) != CUDNN_STATUS_SUCCESS ||
      count <= 0)
    return nullptr;
  count = std::min<int64_t>(count, kMaxConfigs);
  std::vector<Desc> configs;
  std::vector<void*> raw;
  for (int64_t i = 0; i < count; ++i) {
    configs.push_back(make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    if (!configs.back()) return nullptr;
    raw.push_back(configs.back().get());
  }
  int64_t got = 0;
  if (cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count,
                               &got, raw.data()) != CUDNN_STATUS_SUCCESS)
    return nullptr;
  for (int64_t i = 0; i < std::min(got, count); ++i) {
    if (!acceptable(raw[i], t, allow_tf32)) continue;
    Builder pb;
    Desc plan = make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    if (!plan) continue;
    pb.set(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    pb.set_desc(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, configs[i]);
    pb.finalize(plan);
    if (!pb.ok(plan)) continue;
    int64_t bytes = 0, n = 0;
    if (cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &bytes) !=
            CUDNN_STATUS_SUCCESS ||
        bytes < 0 || static_cast<size_t>(bytes) > kMaxWorkspace)
      continue;
    g->config = std::move(configs[i]);
    g->plan = std::move(plan);
    g->workspace = bytes;
    g_built.fetch_add(1, std::memory_order_relaxed);
    return g;
  }
  return nullptr;
}

// The largest of 16, 8, 4, 2, 1 that divides every address.
int64_t alignment_of(std::initializer_list<const void*> ptrs) {
  int64_t a = 16;
  for (const void* p : ptrs)
    while (a > 1 && reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(a) != 0) a /= 2;
  return a;
}

// The configuration's fields, then handle, direction, accumulate, TF32 and alignment.
using Key = std::array<int64_t, kConvShapeFields + 5>;

std::mutex g_mutex;
// Plans by configuration and handle; nullptr where the graph API has none (the legacy API runs).
std::unordered_map<Key, std::shared_ptr<const GraphPlan>, PlanKeyHash>& cache() {
  static auto* plans = new std::unordered_map<Key, std::shared_ptr<const GraphPlan>, PlanKeyHash>;  // outlives handles
  return *plans;
}

}  // namespace

bool run_conv_graph(const ConvShape& s, ConvDirection d, bool accumulate, bool allow_tf32, void* x, void* w, void* y) {
  cudnnHandle_t handle = cudnn_handle(s.device);
  const int64_t alignment = alignment_of({x, w, y});
  const Key key = conv_plan_key<5>(s, {static_cast<int64_t>(reinterpret_cast<uintptr_t>(handle)),
                                         static_cast<int64_t>(d), accumulate, allow_tf32, alignment});
  std::shared_ptr<const GraphPlan> plan;
  bool cached = false;
  {
    std::lock_guard lock(g_mutex);
    if (auto it = cache().find(key); it != cache().end()) {
      plan = it->second;
      cached = true;
    }
  }
  if (!cached) {
    if (capturing(s.device)) return false;  // a recording takes the legacy call; its warm-up builds the plan
    plan = build(handle, s, d, accumulate, allow_tf32, alignment);
    std::lock_guard lock(g_mutex);
    if (cache().size() >= 4096) cache().clear();  // a dynamic workload's shapes pile up otherwise
    cache()[key] = plan;
  }
  if (!plan) return false;

  Tensor ws = workspace(plan->workspace, cuda_device(s.device));
  void* ws_data = ws.defined() ? ws.impl().data() : nullptr;
  Desc pack = make(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  if (!pack) return false;
  Builder b;
  const int64_t uids[3] = {kUidX, kUidW, kUidY};
  void* pointers[3] = {x, w, y};
  b.set(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 3, uids);
  b.set(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, 3, pointers);
  b.set(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws_data);
  b.finalize(pack);
  cudnnStatus_t status = b.status;
  if (status == CUDNN_STATUS_SUCCESS) status = cudnnBackendExecute(handle, plan->plan.get(), pack.get());
  if (status == CUDNN_STATUS_SUCCESS) return true;
  // Refused at run time: this configuration takes the legacy API from now on.
  std::lock_guard lock(g_mutex);
  cache()[key] = nullptr;
  return false;
}

int64_t conv_graph_plans_built() { return g_built.load(std::memory_order_relaxed); }

}  // namespace kiln::cuda::detail

#endif  // KILN_WITH_CUDNN
