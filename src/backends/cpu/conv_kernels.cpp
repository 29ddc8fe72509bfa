// CPU kernel for conv2d.
//
// float32 and bfloat16 run on oneDNN. A plan (primitive, chosen layouts, reorders) is built once
// per shape/parameter set and kept in a process-wide cache; oneDNN picks its blocked layouts
// ("any") and the plan reorders the plain NCHW input/output around the convolution, except for
// 1x1/stride-1 convolutions, which run on plain NCHW directly (oneDNN's GEMM path there beats
// reordering). float16 computes through float32. float64, and any configuration oneDNN
// rejects, use im2col + GEMM (also the path for everything when KILN_ONEDNN=0).
//
// Thread safety: the cache is guarded by a mutex and plans are immutable once built; oneDNN
// primitives may execute concurrently. Scratchpads and reorder buffers are per thread (user
// scratchpad mode), so concurrent calls never share memory.
#include <cblas.h>
#include <oneapi/dnnl/dnnl.hpp>

#include <array>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <string_view>
#include <unordered_map>

#include "backends/cpu/loops.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cpu {

namespace {

using dnnl::memory;
using Tag = memory::format_tag;

// KILN_ONEDNN=0 turns oneDNN off (the im2col + GEMM path runs instead), to bisect a wrong result.
bool onednn_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("KILN_ONEDNN");
    return v == nullptr || std::string_view(v) != "0";
  }();
  return enabled;
}

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::stream& thread_stream() {
  thread_local dnnl::stream stream(cpu_engine());
  return stream;
}

// A growable 64-byte-aligned buffer, reused across calls on one thread.
class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  ~ScratchBuffer() { std::free(data_); }

  void* get(size_t bytes) {
    if (bytes > capacity_) {
      std::free(data_);
      capacity_ = (bytes + 63) / 64 * 64;
      data_ = std::aligned_alloc(64, capacity_);
      if (!data_) {
        capacity_ = 0;
        throw std::bad_alloc();
      }
    }
    return data_;
  }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

enum Slot { kSrcSlot, kWeightsSlot, kDstSlot, kScratchSlot, kNumSlots };
ScratchBuffer& thread_buffer(Slot slot) {
  thread_local std::array<ScratchBuffer, kNumSlots> buffers;
  return buffers[slot];
}

struct ConvShape {
  int64_t n, c, h, w, o, kh, kw, oh, ow;
  int64_t stride[2], pad[2], dilation[2], groups;
  bool bias;
};

struct ConvKey {
  std::array<int64_t, 16> dims;
  DType dtype;
  bool operator==(const ConvKey&) const = default;
};

struct ConvKeyHash {
  size_t operator()(const ConvKey& k) const {
    size_t h = static_cast<size_t>(k.dtype);
    for (int64_t v : k.dims) h = h * 1000003u ^ std::hash<int64_t>{}(v);
    return h;
  }
};

ConvKey make_key(const ConvShape& s, DType dtype) {
  return {{s.n, s.c, s.h, s.w, s.o, s.kh, s.kw, s.stride[0], s.stride[1], s.pad[0], s.pad[1], s.dilation[0],
           s.dilation[1], s.groups, s.bias, 0},
          dtype};
}

// Everything needed to run one convolution configuration.
struct ConvPlan {
  dnnl::convolution_forward conv;
  memory::desc src_user, weights_user, dst_user, bias;
  memory::desc src, weights, dst, scratchpad;
  dnnl::reorder src_reorder, weights_reorder, dst_reorder;
  bool reorder_src = false, reorder_weights = false, reorder_dst = false;
};

memory::data_type onednn_type(DType t) { return t == DType::bfloat16 ? memory::data_type::bf16 : memory::data_type::f32; }

// Builds a plan; nullptr when oneDNN has no implementation for it.
std::shared_ptr<const ConvPlan> build_plan(const ConvShape& s, DType dtype) {
  const auto dt = onednn_type(dtype);
  const memory::dims src_dims{s.n, s.c, s.h, s.w}, dst_dims{s.n, s.o, s.oh, s.ow};
  const memory::dims weight_dims = s.groups == 1 ? memory::dims{s.o, s.c, s.kh, s.kw}
                                                 : memory::dims{s.groups, s.o / s.groups, s.c / s.groups, s.kh, s.kw};
  const bool pointwise = s.kh == 1 && s.kw == 1 && s.stride[0] == 1 && s.stride[1] == 1 && s.pad[0] == 0 &&
                         s.pad[1] == 0 && s.groups == 1;
  const Tag act = pointwise ? Tag::nchw : Tag::any;
  try {
    auto plan = std::make_shared<ConvPlan>();
    plan->src_user = memory::desc(src_dims, dt, Tag::nchw);
    plan->dst_user = memory::desc(dst_dims, dt, Tag::nchw);
    plan->weights_user = memory::desc(weight_dims, dt, s.groups == 1 ? Tag::oihw : Tag::goihw);
    if (s.bias) plan->bias = memory::desc({s.o}, memory::data_type::f32, Tag::x);
    const memory::dims strides{s.stride[0], s.stride[1]}, padding{s.pad[0], s.pad[1]},
        dilation{s.dilation[0] - 1, s.dilation[1] - 1};  // oneDNN counts dilation from 0
    dnnl::convolution_forward::desc desc =
        s.bias ? dnnl::convolution_forward::desc(
                     dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct,
                     memory::desc(src_dims, dt, act), memory::desc(weight_dims, dt, Tag::any), plan->bias,
                     memory::desc(dst_dims, dt, act), strides, dilation, padding, padding)
               : dnnl::convolution_forward::desc(
                     dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct,
                     memory::desc(src_dims, dt, act), memory::desc(weight_dims, dt, Tag::any),
                     memory::desc(dst_dims, dt, act), strides, dilation, padding, padding);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::convolution_forward::primitive_desc pd(desc, attr, cpu_engine());
    // oneDNN's reference kernels are slower than im2col + GEMM.
    if (std::string_view(pd.impl_info_str()).starts_with("ref")) return nullptr;
    plan->conv = dnnl::convolution_forward(pd);
    plan->src = pd.src_desc();
    plan->weights = pd.weights_desc();
    plan->dst = pd.dst_desc();
    plan->scratchpad = pd.scratchpad_desc();
    auto make_reorder = [](const memory::desc& from, const memory::desc& to) {
      return dnnl::reorder(dnnl::reorder::primitive_desc(cpu_engine(), from, cpu_engine(), to));
    };
    if ((plan->reorder_src = plan->src != plan->src_user))
      plan->src_reorder = make_reorder(plan->src_user, plan->src);
    if ((plan->reorder_weights = plan->weights != plan->weights_user))
      plan->weights_reorder = make_reorder(plan->weights_user, plan->weights);
    if ((plan->reorder_dst = plan->dst != plan->dst_user))
      plan->dst_reorder = make_reorder(plan->dst, plan->dst_user);
    return plan;
  } catch (const dnnl::error&) {
    return nullptr;
  }
}

// The cached plan for this configuration (built on first use); nullptr if oneDNN can't run it.
std::shared_ptr<const ConvPlan> find_plan(const ConvShape& s, DType dtype) {
  static std::mutex mutex;
  static std::unordered_map<ConvKey, std::shared_ptr<const ConvPlan>, ConvKeyHash> cache;
  const ConvKey key = make_key(s, dtype);
  {
    std::lock_guard lock(mutex);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  auto plan = build_plan(s, dtype);  // outside the lock: building can take milliseconds
  std::lock_guard lock(mutex);
  return cache.emplace(key, std::move(plan)).first->second;
}

void run_plan(const ConvPlan& p, const void* x, const void* w, const void* bias, void* y) {
  dnnl::engine& engine = cpu_engine();
  dnnl::stream& stream = thread_stream();
  memory src_user(p.src_user, engine, const_cast<void*>(x));
  memory weights_user(p.weights_user, engine, const_cast<void*>(w));
  memory dst_user(p.dst_user, engine, y);
  memory src = p.reorder_src ? memory(p.src, engine, thread_buffer(kSrcSlot).get(p.src.get_size())) : src_user;
  memory weights = p.reorder_weights
                       ? memory(p.weights, engine, thread_buffer(kWeightsSlot).get(p.weights.get_size()))
                       : weights_user;
  memory dst = p.reorder_dst ? memory(p.dst, engine, thread_buffer(kDstSlot).get(p.dst.get_size())) : dst_user;
  memory scratchpad(p.scratchpad, engine, thread_buffer(kScratchSlot).get(std::max<size_t>(1, p.scratchpad.get_size())));
  if (p.reorder_src) p.src_reorder.execute(stream, src_user, src);
  if (p.reorder_weights) p.weights_reorder.execute(stream, weights_user, weights);
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, src},
                                       {DNNL_ARG_WEIGHTS, weights},
                                       {DNNL_ARG_DST, dst},
                                       {DNNL_ARG_SCRATCHPAD, scratchpad}};
  if (bias) args.emplace(DNNL_ARG_BIAS, memory(p.bias, engine, const_cast<void*>(bias)));
  p.conv.execute(stream, args);
  if (p.reorder_dst) p.dst_reorder.execute(stream, dst, dst_user);
  stream.wait();
}

// ---------------- im2col + GEMM fallback ----------------

template <class T>
void gemm_contiguous(int64_t m, int64_t n, int64_t k, const T* a, const T* b, T* c) {
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
                static_cast<int>(k), 1.0f, a, static_cast<int>(k), b, static_cast<int>(n), 0.0f, c,
                static_cast<int>(n));
  else
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
                static_cast<int>(k), 1.0, a, static_cast<int>(k), b, static_cast<int>(n), 0.0, c,
                static_cast<int>(n));
}

// x, w, y contiguous; bias contiguous or null.
template <class T>
void conv_im2col(const ConvShape& s, const T* x, const T* w, const T* bias, T* y) {
  const int64_t cg = s.c / s.groups, og = s.o / s.groups;
  const int64_t k = cg * s.kh * s.kw, p = s.oh * s.ow;
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  KILN_CHECK(k <= kMaxInt && p <= kMaxInt && og <= kMaxInt, ValueError,
             "[kiln::conv2d] the convolution is too large for the float64 path (GEMM sizes exceed int32).");
  const bool direct = s.kh == 1 && s.kw == 1 && s.stride[0] == 1 && s.stride[1] == 1 && s.pad[0] == 0 &&
                      s.pad[1] == 0;
  std::vector<T> col(direct ? 0 : static_cast<size_t>(k * p));
  for (int64_t n = 0; n < s.n; ++n) {
    for (int64_t g = 0; g < s.groups; ++g) {
      const T* xg = x + (n * s.c + g * cg) * s.h * s.w;
      if (!direct) {
        parallel_for(k, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, p)), [&](int64_t begin, int64_t end) {
          for (int64_t row = begin; row < end; ++row) {
            const int64_t c = row / (s.kh * s.kw), ki = row / s.kw % s.kh, kj = row % s.kw;
            T* out = col.data() + row * p;
            for (int64_t oh = 0; oh < s.oh; ++oh) {
              const int64_t ih = oh * s.stride[0] - s.pad[0] + ki * s.dilation[0];
              for (int64_t ow = 0; ow < s.ow; ++ow) {
                const int64_t iw = ow * s.stride[1] - s.pad[1] + kj * s.dilation[1];
                out[oh * s.ow + ow] =
                    ih >= 0 && ih < s.h && iw >= 0 && iw < s.w ? xg[(c * s.h + ih) * s.w + iw] : T(0);
              }
            }
          }
        });
      }
      T* yg = y + (n * s.o + g * og) * p;
      gemm_contiguous<T>(og, p, k, w + g * og * k, direct ? xg : col.data(), yg);
      if (bias) {
        for (int64_t o = 0; o < og; ++o) {
          const T b = bias[g * og + o];
          for (int64_t i = 0; i < p; ++i) yg[o * p + i] += b;
        }
      }
    }
  }
}

void fill_with_bias(Tensor& out, const Tensor& bias) {
  if (!bias.defined()) {
    out.zero_();
    return;
  }
  out.copy_(bias.view({1, bias.numel(), 1, 1}));
}

void conv2d_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  const Tensor& bias = call.input(2);
  if (out.numel() == 0) return;
  const Tensor x = call.input(0).contiguous();
  const Tensor w = call.input(1).contiguous();
  auto pair = [&](size_t i, int d) { IntArrayRef v = call.ints_attr(i); return v.size() == 1 ? v[0] : v[d]; };
  ConvShape s{x.sizes()[0], x.sizes()[1], x.sizes()[2], x.sizes()[3], w.sizes()[0], w.sizes()[2], w.sizes()[3],
              out.sizes()[2], out.sizes()[3], {pair(0, 0), pair(0, 1)}, {pair(1, 0), pair(1, 1)},
              {pair(2, 0), pair(2, 1)}, call.int_attr(3), bias.defined()};
  if (s.c == 0) return fill_with_bias(out, bias);
  Tensor y = out.is_contiguous() ? out : detail::make_empty(out.sizes().vec(), out.dtype(), out.device());
  const DType t = x.dtype();
  bool done = false;
  if ((t == DType::float32 || t == DType::bfloat16) && onednn_enabled()) {
    if (auto plan = find_plan(s, t)) {
      Tensor b = bias.defined() ? bias.to(kFloat32).contiguous() : Tensor();
      run_plan(*plan, x.impl().data(), w.impl().data(), b.defined() ? b.impl().data() : nullptr, y.impl().data());
      done = true;
    }
  }
  if (!done) {
    if (t == DType::float64) {
      Tensor b = bias.defined() ? bias.contiguous() : Tensor();
      conv_im2col<double>(s, x.data_ptr<double>(), w.data_ptr<double>(), b.defined() ? b.data_ptr<double>() : nullptr,
                          y.data_ptr<double>());
    } else if (t == DType::float32) {
      Tensor b = bias.defined() ? bias.contiguous() : Tensor();
      conv_im2col<float>(s, x.data_ptr<float>(), w.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                         y.data_ptr<float>());
    } else {  // float16, or bfloat16 without oneDNN support: compute in float32
      Tensor y32 = conv2d(x.to(kFloat32), w.to(kFloat32), bias.defined() ? bias.to(kFloat32) : Tensor(),
                          IntArrayRef(s.stride, 2), IntArrayRef(s.pad, 2), IntArrayRef(s.dilation, 2), s.groups);
      y.copy_(y32);
    }
  }
  if (!y.same(out)) out.copy_(y);
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("conv2d", DeviceType::cpu, conv2d_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
