// CPU kernels for conv2d and convolution_backward.
//
// float32 and bfloat16 run on oneDNN. A plan (primitive, chosen layouts, reorders) is built once
// per shape/parameter set and kept in a process-wide cache; oneDNN picks its blocked layouts
// ("any") and the plan reorders the plain NCHW input/output around the convolution, except for
// 1x1/stride-1 convolutions, which run on plain NCHW directly (oneDNN's GEMM path there beats
// reordering; KILN_CONV_1X1=blocked turns that off). float16 computes through float32. float64,
// and any configuration oneDNN rejects, use im2col + GEMM (also the path for everything when
// KILN_ONEDNN=0).
//
// Channels-last: when the input or the weight suggests channels_last (the rule the metas in
// ops/conv.cpp use for the result's layout), the plan runs oneDNN on plain NHWC activations
// (src, dst, diff_src, diff_dst): no activation reorders at all, 1x1 included. Weights stay in
// their user layout (OIHW, or OHWI for a channels-last weight) and are reordered into oneDNN's
// choice as in the NCHW path. Plans are keyed by configuration and layout. A configuration oneDNN
// has no fast NHWC kernel for, and the float64/fallback paths, run in NCHW through copies.
// Outputs are written in place when they have the plan's layout, else through a temporary.
//
// convolution_backward mirrors this: a cached backward plan per configuration, layout and output
// mask holds oneDNN's backward-data and backward-weights primitives (built against a
// forward_training hint with the forward's layout choice: blocked "any" layouts, plain NCHW for
// 1x1/stride-1, plain NHWC for channels-last), the gradient is reordered into the blocked layout
// once and shared by both primitives when they agree on it, and the bias gradient comes out of
// backward-weights. 1x1/stride-1 float32 weight gradients are threaded GEMMs instead, in both
// layouts, and so are their channels-last input gradients. float64 and fallbacks run
// col2im/im2col + GEMM; float16 computes through float32.
//
// Autotuning (conv_autotune.h, compile()'s max_autotune): plans also come in a Winograd variant
// (blocked layouts only, reordered from and to the user's NCHW or NHWC), and channels-last 3x3
// convolutions can also run Kiln's own Winograd (winograd_nhwc.h, no plan: called directly). Inside
// an AutotuneScope (kernels/autotune_scope.h) a float32 call whose configuration has a Winograd
// times the candidates once per configuration, layout and direction on scratch outputs and keeps
// the fastest; conv2d_relu and conv2d_bn share conv2d's forward choice. Outside a scope only
// direct plans run.
//
// Thread safety: the cache is guarded by a mutex and plans are immutable once built; oneDNN
// primitives may execute concurrently. Scratchpads and reorder buffers are per thread (user
// scratchpad mode), so concurrent calls never share memory.
#include <cblas.h>
#include <fmt/format.h>
#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kernels/autotune_scope.h"
#include "kernels/cpu/conv_autotune.h"
#include "kernels/cpu/conv_kernels.h"
#include "kernels/cpu/onednn.h"
#include "kernels/cpu/loops.h"
#include "kernels/cpu/winograd_nhwc.h"
#include "kernels/fold_batch_norm.h"
#include "core/layer_hooks.h"
#include "core/shape.h"
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

using onednn::cpu_engine;
using onednn::thread_stream;

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

enum Slot {
  kSrcSlot,
  kWeightsSlot,
  kDstSlot,
  kScratchSlot,
  // backward
  kDiffDstSlot,
  kDiffDstWeightsSlot,  // diff_dst for backward-weights when its layout differs from backward-data's
  kDiffSrcSlot,
  kDiffWeightsSlot,
  kDiffBiasSlot,
  kScratch2Slot,
  kNumSlots
};
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
  ConvAlgorithm algorithm = ConvAlgorithm::direct;
  bool operator==(const ConvKey&) const = default;
};

struct ConvKeyHash {
  size_t operator()(const ConvKey& k) const {
    size_t h = static_cast<size_t>(k.dtype) * 31u + static_cast<size_t>(k.algorithm);
    for (int64_t v : k.dims) h = h * 1000003u ^ std::hash<int64_t>{}(v);
    return h;
  }
};

// The memory layouts a plan runs on: activations NCHW or NHWC; user weights OIHW or OHWI.
struct Layout {
  bool channels_last = false;  // activations (src, dst and their gradients) are NHWC
  bool weight_channels_last = false;

  MemoryFormat activations() const { return channels_last ? kiln::channels_last : contiguous_format; }
  MemoryFormat weights() const { return weight_channels_last ? kiln::channels_last : contiguous_format; }
};

// The layout a convolution runs in: channels-last when the input or the weight suggests it
// (PyTorch's rule, the one ops/conv.cpp's metas give the result); user weights in OHWI when the
// weight itself suggests channels_last.
Layout preferred_layout(const Tensor& input, const Tensor& weight) {
  const bool weight_cl = weight.suggest_memory_format() == MemoryFormat::channels_last;
  const bool cl = weight_cl || input.suggest_memory_format() == MemoryFormat::channels_last;
  return {cl, weight_cl};
}

ConvKey make_key(const ConvShape& s, DType dtype, Layout layout, ConvAlgorithm algorithm = ConvAlgorithm::direct) {
  return {{s.n, s.c, s.h, s.w, s.o, s.kh, s.kw, s.stride[0], s.stride[1], s.pad[0], s.pad[1], s.dilation[0],
           s.dilation[1], s.groups, s.bias, (layout.channels_last ? 1 : 0) | (layout.weight_channels_last ? 2 : 0)},
          dtype,
          algorithm};
}

// oneDNN descriptors of the user (Kiln) buffers in `layout`.
memory::desc activation_desc(const memory::dims& dims, memory::data_type dt, Layout layout) {
  return memory::desc(dims, dt, layout.channels_last ? Tag::nhwc : Tag::nchw);
}
memory::desc user_weights_desc(const memory::dims& dims, memory::data_type dt, Layout layout) {
  const bool grouped = dims.size() == 5;
  if (layout.weight_channels_last) return memory::desc(dims, dt, grouped ? Tag::gohwi : Tag::ohwi);
  return memory::desc(dims, dt, grouped ? Tag::goihw : Tag::oihw);
}

// Everything needed to run one convolution configuration.
struct ConvPlan {
  dnnl::convolution_forward conv;
  memory::desc src_user, weights_user, dst_user, bias;
  memory::desc src, weights, dst, scratchpad;
  dnnl::reorder src_reorder, weights_reorder, dst_reorder;
  bool reorder_src = false, reorder_weights = false, reorder_dst = false;
};

// 1x1/stride-1 convolutions run on plain NCHW (oneDNN's GEMM path there beats reordering);
// everything else lets oneDNN pick blocked layouts.
bool plain_layout(const ConvShape& s) {
  static const bool blocked_1x1 = [] {  // kill switch: KILN_CONV_1X1=blocked
    const char* v = std::getenv("KILN_CONV_1X1");
    return v != nullptr && std::string_view(v) == "blocked";
  }();
  if (blocked_1x1) return false;
  return s.kh == 1 && s.kw == 1 && s.stride[0] == 1 && s.stride[1] == 1 && s.pad[0] == 0 && s.pad[1] == 0 &&
         s.groups == 1;
}

// The activation tag the primitive is built with: the user's NHWC as is; for NCHW, plain for
// 1x1/stride-1 and oneDNN's blocked choice otherwise.
Tag primitive_activation_tag(const ConvShape& s, Layout layout) {
  if (layout.channels_last) return Tag::nhwc;
  return plain_layout(s) ? Tag::nchw : Tag::any;
}

// oneDNN's jit 1x1 backward-weights (jit_avx2_1x1 / jit_avx512_common_1x1 /
// jit_avx512_core_bf16_1x1 _convolution_bwd_weights_t; 2.6 up to at least 3.9) writes past its
// scratchpad when it reduces a strided 1x1 convolution to unit stride ("rtus": 1x1 kernel,
// non-unit stride, no padding) on an NHWC source whose channel count is below, or not a multiple
// of, its channel block (16 floats; 8 on AVX2): rtus_prepare_space_info books is * ic elements of
// workspace per thread for NHWC, but the kernel addresses it at sp * ic_block, so each thread
// writes into the next one's part and the last one past the scratchpad (the heap corruption
// behind "free(): invalid size"; PyTorch's mkldnn path has it too; oneDNN issue #6035). Measured
// with libdnnl 2.6.3: only backward-weights, only NHWC, only with 2+ threads; blocked layouts
// book factor * is * ic_block and are fine. Such primitives are built on blocked activations.
bool onednn_nhwc_strided_1x1_weights_overruns(const ConvShape& s) {
  return s.kh == 1 && s.kw == 1 && (s.stride[0] != 1 || s.stride[1] != 1) && s.pad[0] == 0 && s.pad[1] == 0 &&
         s.groups == 1 && s.c % 16 != 0;
}

memory::data_type onednn_type(DType t) { return t == DType::bfloat16 ? memory::data_type::bf16 : memory::data_type::f32; }

// The oneDNN algorithm of a plan.
dnnl::algorithm onednn_algorithm(ConvAlgorithm a) {
  return a == ConvAlgorithm::winograd ? dnnl::algorithm::convolution_winograd : dnnl::algorithm::convolution_direct;
}

// Builds a plan; nullptr when oneDNN has no implementation for it. Winograd runs on blocked
// layouts only (the plan reorders from and to the user's NCHW or NHWC) and as forward_training:
// for inference oneDNN transforms the weights in their reorder, single-threaded (measured 0.4 ms
// per call on DenseNet-121's 128->32 3x3 weights, more than the convolution at 8x8).
std::shared_ptr<const ConvPlan> build_plan(const ConvShape& s, DType dtype, Layout layout,
                                           ConvAlgorithm algorithm = ConvAlgorithm::direct) {
  const auto dt = onednn_type(dtype);
  const memory::dims src_dims{s.n, s.c, s.h, s.w}, dst_dims{s.n, s.o, s.oh, s.ow};
  const memory::dims weight_dims = s.groups == 1 ? memory::dims{s.o, s.c, s.kh, s.kw}
                                                 : memory::dims{s.groups, s.o / s.groups, s.c / s.groups, s.kh, s.kw};
  const bool winograd = algorithm == ConvAlgorithm::winograd;
  const Tag act = winograd ? Tag::any : primitive_activation_tag(s, layout);
  const auto prop = winograd ? dnnl::prop_kind::forward_training : dnnl::prop_kind::forward_inference;
  const dnnl::algorithm alg = onednn_algorithm(algorithm);
  try {
    auto plan = std::make_shared<ConvPlan>();
    plan->src_user = activation_desc(src_dims, dt, layout);
    plan->dst_user = activation_desc(dst_dims, dt, layout);
    plan->weights_user = user_weights_desc(weight_dims, dt, layout);
    if (s.bias) plan->bias = memory::desc({s.o}, memory::data_type::f32, Tag::x);
    const memory::dims strides{s.stride[0], s.stride[1]}, padding{s.pad[0], s.pad[1]},
        dilation{s.dilation[0] - 1, s.dilation[1] - 1};  // oneDNN counts dilation from 0
    dnnl::convolution_forward::desc desc =
        s.bias ? dnnl::convolution_forward::desc(prop, alg, memory::desc(src_dims, dt, act),
                                                 memory::desc(weight_dims, dt, Tag::any), plan->bias,
                                                 memory::desc(dst_dims, dt, act), strides, dilation, padding, padding)
               : dnnl::convolution_forward::desc(prop, alg, memory::desc(src_dims, dt, act),
                                                 memory::desc(weight_dims, dt, Tag::any),
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
std::shared_ptr<const ConvPlan> find_plan(const ConvShape& s, DType dtype, Layout layout,
                                          ConvAlgorithm algorithm = ConvAlgorithm::direct) {
  static std::mutex mutex;
  static std::unordered_map<ConvKey, std::shared_ptr<const ConvPlan>, ConvKeyHash> cache;
  const ConvKey key = make_key(s, dtype, layout, algorithm);
  {
    std::lock_guard lock(mutex);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  auto plan = build_plan(s, dtype, layout, algorithm);  // outside the lock: building can take milliseconds
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

// Row-major C (m x n) = op(A) op(B) + beta * C, op(A) m x k, op(B) k x n; lda/ldb/ldc are the
// row strides of A, B, C as stored.
template <class T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc) {
  if constexpr (std::is_same_v<T, float>) {
    if (dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc) ==
        dnnl_success)
      return;
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f, a, static_cast<int>(lda), b,
                static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
  } else {
    cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0, a, static_cast<int>(lda), b,
                static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
  }
}

template <class T>
void gemm_contiguous(int64_t m, int64_t n, int64_t k, const T* a, const T* b, T* c) {
  gemm<T>(false, false, m, n, k, a, k, b, n, T(0), c, n);
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

// `out` itself when it is dense in `format` (4-D results only can be channels-last), else a new
// tensor in that format for the caller to copy back.
Tensor dense_buffer(const Tensor& out, MemoryFormat format) {
  const bool channels_last = format == MemoryFormat::channels_last && out.dim() == 4;
  if (channels_last ? out.is_contiguous(kiln::channels_last) : out.is_contiguous()) return out;
  if (!channels_last) return detail::make_empty(out.sizes().vec(), out.dtype(), out.device());
  return detail::make_empty_strided(out.sizes().vec(), detail::channels_last_strides(out.sizes()), out.dtype(),
                                    out.device());
}

// Whether Kiln's Winograd runs this configuration in this layout (any direction).
bool winograd_nhwc_runs(const ConvShape& s, Layout layout) {
  return layout.channels_last &&
         winograd_nhwc_applies(s.kh, s.kw, s.stride, s.dilation, s.groups, s.pad, s.bias, s.oh, s.ow);
}

void run_winograd_nhwc_forward(const ConvShape& s, Layout layout, const void* x, const void* w, void* y) {
  winograd_nhwc_forward(static_cast<const float*>(x), s.n, s.h, s.w, s.c, static_cast<const float*>(w),
                        layout.weight_channels_last, s.o, s.pad, static_cast<float*>(y), s.oh, s.ow);
}

void run_winograd_nhwc_backward_data(const ConvShape& s, Layout layout, const void* dy, const void* w, void* dx) {
  winograd_nhwc_backward_data(static_cast<const float*>(dy), s.n, s.oh, s.ow, s.o, static_cast<const float*>(w),
                              layout.weight_channels_last, s.c, s.pad, static_cast<float*>(dx), s.h, s.w);
}

void run_winograd_nhwc_backward_weights(const ConvShape& s, Layout layout, const void* x, const void* dy, void* dw) {
  winograd_nhwc_backward_weights(static_cast<const float*>(x), s.n, s.h, s.w, s.c, static_cast<const float*>(dy), s.o,
                                 s.oh, s.ow, s.pad, static_cast<float*>(dw), layout.weight_channels_last);
}

// max_autotune's forward choice (below, with the backward's): a plan to run, or nullptr when
// Kiln's Winograd (winograd_nhwc) won.
std::shared_ptr<const ConvPlan> autotuned_plan(const ConvShape& s, DType dtype, Layout layout,
                                               std::shared_ptr<const ConvPlan> direct, const void* x, const void* w,
                                               const void* bias);

void conv2d_impl(const OpCall& call, std::span<Tensor> outs, bool relu) {
  Tensor& out = outs[0];
  const Tensor& input = call.input(0);
  const Tensor& weight = call.input(1);
  const Tensor& bias = call.input(2);
  if (out.numel() == 0) return;
  auto pair = [&](size_t i, int d) { IntArrayRef v = call.ints_attr(i); return v.size() == 1 ? v[0] : v[d]; };
  ConvShape s{input.sizes()[0], input.sizes()[1], input.sizes()[2], input.sizes()[3], weight.sizes()[0],
              weight.sizes()[2], weight.sizes()[3], out.sizes()[2], out.sizes()[3], {pair(0, 0), pair(0, 1)},
              {pair(1, 0), pair(1, 1)}, {pair(2, 0), pair(2, 1)}, call.int_attr(3), bias.defined()};
  if (s.c == 0) {
    fill_with_bias(out, bias);
    if (relu) out.relu_();
    return;
  }
  const DType t = input.dtype();
  // oneDNN in the layout the inputs suggest; NCHW where it has no fast kernel for NHWC.
  Layout layout;
  std::shared_ptr<const ConvPlan> plan;
  if ((t == DType::float32 || t == DType::bfloat16) && onednn_enabled()) {
    const Layout preferred = preferred_layout(input, weight);
    if ((plan = find_plan(s, t, preferred))) layout = preferred;
    else if (preferred.channels_last) plan = find_plan(s, t, Layout{});
  }
  // Copies only for inputs not dense in the plan's layout (the fallbacks below run NCHW).
  const Tensor x = input.contiguous(layout.activations());
  const Tensor w = weight.contiguous(layout.weights());
  Tensor y = dense_buffer(out, layout.activations());
  if (plan) {
    Tensor b = bias.defined() ? bias.to(kFloat32).contiguous() : Tensor();
    const void* b_data = b.defined() ? b.impl().data() : nullptr;
    // max_autotune: direct or a Winograd, whichever timed fastest for this configuration.
    if (t == DType::float32 && kernels::convolutions_autotuned())
      plan = autotuned_plan(s, t, layout, std::move(plan), x.impl().data(), w.impl().data(), b_data);
    if (plan) run_plan(*plan, x.impl().data(), w.impl().data(), b_data, y.impl().data());
    else run_winograd_nhwc_forward(s, layout, x.impl().data(), w.impl().data(), y.impl().data());
  } else if (t == DType::float64) {
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
  // The relu runs in place on the result while it is hot in cache. (oneDNN 2.7's relu post-op
  // picked a 3x slower implementation for 1x1 NCHW convolutions here: measured 1125 vs 348 us.)
  if (relu) y.relu_();
  if (!y.same(out)) out.copy_(y);
}

// conv2d_bn: the batch norm folded into the weights and bias (cached: kernels/fold_batch_norm.h),
// then one convolution and the relu in place.
void conv2d_bn_kernel(const OpCall& call, std::span<Tensor> outs) {
  auto [folded_w, folded_b] = kiln::detail::fold_batch_norm(call, /*use_cache=*/true);
  std::vector<Tensor> inputs{call.input(0), folded_w, folded_b};
  std::vector<Attr> attrs{call.attrs[0], call.attrs[1], call.attrs[2], call.attrs[3]};
  conv2d_impl(OpCall(call.op, inputs, attrs), outs, call.bool_attr(5));
}

// ---------------- backward: oneDNN ----------------

// Everything needed to run one convolution backward configuration. Each primitive is present
// only when the output mask asks for its result.
struct BackwardPlan {
  bool data = false, weights = false, bias = false;  // bias: computed by backward-weights
  dnnl::convolution_backward_data bwd_data;
  dnnl::convolution_backward_weights bwd_weights;
  memory::desc src_user, weights_user, dst_user, bias_desc;
  memory::desc data_diff_dst, data_weights, data_diff_src, data_scratchpad;
  memory::desc weights_src, weights_diff_dst, weights_diff_weights, weights_scratchpad;
  dnnl::reorder data_diff_dst_reorder, weights_diff_dst_reorder, weights_reorder, src_reorder, diff_src_reorder,
      diff_weights_reorder;
  bool reorder_data_diff_dst = false, reorder_weights_diff_dst = false, share_diff_dst = false,
       reorder_weights = false, reorder_src = false, reorder_diff_src = false, reorder_diff_weights = false;
};

struct BackwardKey {
  ConvKey conv;
  int mask;
  bool operator==(const BackwardKey&) const = default;
};

struct BackwardKeyHash {
  size_t operator()(const BackwardKey& k) const { return ConvKeyHash{}(k.conv) * 31u + static_cast<size_t>(k.mask); }
};

dnnl::reorder make_reorder(const memory::desc& from, const memory::desc& to) {
  return dnnl::reorder(dnnl::reorder::primitive_desc(cpu_engine(), from, cpu_engine(), to));
}

// Builds a backward plan (s.bias: the bias gradient is wanted) with backward-data and
// backward-weights in the given algorithms; nullptr when oneDNN has no fast implementation for a
// requested part. Winograd primitives run on blocked layouts (as the Winograd forward does).
std::shared_ptr<const BackwardPlan> build_backward_plan(const ConvShape& s, DType dtype, Layout layout,
                                                        bool need_data, bool need_weights,
                                                        ConvAlgorithm data_algorithm = ConvAlgorithm::direct,
                                                        ConvAlgorithm weights_algorithm = ConvAlgorithm::direct) {
  const auto dt = onednn_type(dtype);
  const memory::dims src_dims{s.n, s.c, s.h, s.w}, dst_dims{s.n, s.o, s.oh, s.ow};
  const memory::dims weight_dims = s.groups == 1 ? memory::dims{s.o, s.c, s.kh, s.kw}
                                                 : memory::dims{s.groups, s.o / s.groups, s.c / s.groups, s.kh, s.kw};
  const memory::dims strides{s.stride[0], s.stride[1]}, padding{s.pad[0], s.pad[1]},
      dilation{s.dilation[0] - 1, s.dilation[1] - 1};
  auto is_ref = [](const char* impl) { return std::string_view(impl).starts_with("ref"); };
  try {
    auto plan = std::make_shared<BackwardPlan>();
    plan->src_user = activation_desc(src_dims, dt, layout);
    plan->dst_user = activation_desc(dst_dims, dt, layout);
    plan->weights_user = user_weights_desc(weight_dims, dt, layout);
    const memory::desc weights_any(weight_dims, dt, Tag::any);
    const bool with_bias = s.bias && need_weights;
    if (with_bias) plan->bias_desc = memory::desc({s.o}, memory::data_type::f32, Tag::x);
    // Per algorithm: the activation descs its primitives are built with, and the forward they
    // belong to (a hint for oneDNN's layout choice).
    struct Variant {
      memory::desc src_any, dst_any;
      std::optional<dnnl::convolution_forward::primitive_desc> hint;
    };
    std::array<Variant, 3> variants;  // direct, Winograd, direct on blocked activations
    auto variant = [&](ConvAlgorithm algorithm, bool blocked = false) -> Variant& {
      Variant& v = variants[blocked ? 2 : static_cast<size_t>(algorithm)];
      if (v.hint) return v;
      const Tag act =
          algorithm == ConvAlgorithm::winograd || blocked ? Tag::any : primitive_activation_tag(s, layout);
      v.src_any = memory::desc(src_dims, dt, act);
      v.dst_any = memory::desc(dst_dims, dt, act);
      const dnnl::algorithm alg = onednn_algorithm(algorithm);
      dnnl::convolution_forward::desc fwd_desc =
          with_bias ? dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, alg, v.src_any, weights_any,
                                                      plan->bias_desc, v.dst_any, strides, dilation, padding, padding)
                    : dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, alg, v.src_any, weights_any,
                                                      v.dst_any, strides, dilation, padding, padding);
      v.hint.emplace(fwd_desc, cpu_engine());
      return v;
    };
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (need_data) {
      const Variant& v = variant(data_algorithm);
      dnnl::convolution_backward_data::desc desc(onednn_algorithm(data_algorithm), v.src_any, weights_any, v.dst_any,
                                                 strides, dilation, padding, padding);
      dnnl::convolution_backward_data::primitive_desc pd(desc, attr, cpu_engine(), *v.hint);
      if (is_ref(pd.impl_info_str())) return nullptr;
      plan->data = true;
      plan->bwd_data = dnnl::convolution_backward_data(pd);
      plan->data_diff_dst = pd.diff_dst_desc();
      plan->data_weights = pd.weights_desc();
      plan->data_diff_src = pd.diff_src_desc();
      plan->data_scratchpad = pd.scratchpad_desc();
      if ((plan->reorder_data_diff_dst = plan->data_diff_dst != plan->dst_user))
        plan->data_diff_dst_reorder = make_reorder(plan->dst_user, plan->data_diff_dst);
      if ((plan->reorder_weights = plan->data_weights != plan->weights_user))
        plan->weights_reorder = make_reorder(plan->weights_user, plan->data_weights);
      if ((plan->reorder_diff_src = plan->data_diff_src != plan->src_user))
        plan->diff_src_reorder = make_reorder(plan->data_diff_src, plan->src_user);
    }
    if (need_weights) {
      // NHWC backward-weights of a strided 1x1 convolution overruns its scratchpad
      // (onednn_nhwc_strided_1x1_weights_overruns): that primitive reads blocked activations,
      // which the plan reorders from the user's NHWC (src_reorder, weights_diff_dst_reorder).
      const bool avoid_nhwc = layout.channels_last && onednn_nhwc_strided_1x1_weights_overruns(s);
      const Variant& v = variant(weights_algorithm, avoid_nhwc);
      const dnnl::algorithm alg = onednn_algorithm(weights_algorithm);
      dnnl::convolution_backward_weights::desc desc =
          with_bias ? dnnl::convolution_backward_weights::desc(alg, v.src_any, weights_any, plan->bias_desc, v.dst_any,
                                                               strides, dilation, padding, padding)
                    : dnnl::convolution_backward_weights::desc(alg, v.src_any, weights_any, v.dst_any, strides,
                                                               dilation, padding, padding);
      dnnl::convolution_backward_weights::primitive_desc pd(desc, attr, cpu_engine(), *v.hint);
      if (is_ref(pd.impl_info_str())) return nullptr;
      // Never hand oneDNN the overrunning configuration, even should "any" pick NHWC: without a
      // plan the caller falls back to the NCHW plan (rtus does not apply to plain NCHW).
      if (avoid_nhwc && pd.src_desc() == memory::desc(src_dims, dt, Tag::nhwc)) return nullptr;
      plan->weights = true;
      plan->bias = with_bias;
      plan->bwd_weights = dnnl::convolution_backward_weights(pd);
      plan->weights_src = pd.src_desc();
      plan->weights_diff_dst = pd.diff_dst_desc();
      plan->weights_diff_weights = pd.diff_weights_desc();
      plan->weights_scratchpad = pd.scratchpad_desc();
      plan->share_diff_dst = plan->data && plan->weights_diff_dst == plan->data_diff_dst;
      if (!plan->share_diff_dst && (plan->reorder_weights_diff_dst = plan->weights_diff_dst != plan->dst_user))
        plan->weights_diff_dst_reorder = make_reorder(plan->dst_user, plan->weights_diff_dst);
      if ((plan->reorder_src = plan->weights_src != plan->src_user))
        plan->src_reorder = make_reorder(plan->src_user, plan->weights_src);
      if ((plan->reorder_diff_weights = plan->weights_diff_weights != plan->weights_user))
        plan->diff_weights_reorder = make_reorder(plan->weights_diff_weights, plan->weights_user);
    }
    return plan;
  } catch (const dnnl::error&) {
    return nullptr;
  }
}

std::shared_ptr<const BackwardPlan> find_backward_plan(const ConvShape& s, DType dtype, Layout layout,
                                                       bool need_data, bool need_weights,
                                                       ConvAlgorithm data_algorithm = ConvAlgorithm::direct,
                                                       ConvAlgorithm weights_algorithm = ConvAlgorithm::direct) {
  static std::mutex mutex;
  static std::unordered_map<BackwardKey, std::shared_ptr<const BackwardPlan>, BackwardKeyHash> cache;
  const int mask = (need_data ? 1 : 0) | (need_weights ? 2 : 0) |
                   (need_data && data_algorithm == ConvAlgorithm::winograd ? 4 : 0) |
                   (need_weights && weights_algorithm == ConvAlgorithm::winograd ? 8 : 0);
  const BackwardKey key{make_key(s, dtype, layout), mask};
  {
    std::lock_guard lock(mutex);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  auto plan = build_backward_plan(s, dtype, layout, need_data, need_weights, data_algorithm, weights_algorithm);
  std::lock_guard lock(mutex);
  return cache.emplace(key, std::move(plan)).first->second;
}

// Runs a backward plan on the user buffers of its layout. dx/dw/db are written where the plan computes
// them (db as float32).
void run_backward_plan(const BackwardPlan& p, const void* x, const void* w, const void* dy, void* dx, void* dw,
                       float* db) {
  dnnl::engine& engine = cpu_engine();
  dnnl::stream& stream = thread_stream();
  auto buffer = [&](Slot slot, const memory::desc& d) {
    return memory(d, engine, thread_buffer(slot).get(std::max<size_t>(1, d.get_size())));
  };
  memory dst_user(p.dst_user, engine, const_cast<void*>(dy));
  memory data_diff_dst;
  if (p.data) {
    data_diff_dst = p.reorder_data_diff_dst ? buffer(kDiffDstSlot, p.data_diff_dst) : dst_user;
    if (p.reorder_data_diff_dst) p.data_diff_dst_reorder.execute(stream, dst_user, data_diff_dst);
  }
  if (p.weights) {
    // Backward-weights first: it reads diff_dst while it is fresh in cache after the reorder.
    memory weights_diff_dst = p.share_diff_dst ? data_diff_dst
                              : p.reorder_weights_diff_dst ? buffer(kDiffDstWeightsSlot, p.weights_diff_dst)
                                                           : dst_user;
    if (!p.share_diff_dst && p.reorder_weights_diff_dst)
      p.weights_diff_dst_reorder.execute(stream, dst_user, weights_diff_dst);
    memory src_user(p.src_user, engine, const_cast<void*>(x));
    memory src = p.reorder_src ? buffer(kSrcSlot, p.weights_src) : src_user;
    if (p.reorder_src) p.src_reorder.execute(stream, src_user, src);
    memory weights_user(p.weights_user, engine, dw);
    memory diff_weights = p.reorder_diff_weights ? buffer(kDiffWeightsSlot, p.weights_diff_weights) : weights_user;
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, src},
                                         {DNNL_ARG_DIFF_DST, weights_diff_dst},
                                         {DNNL_ARG_DIFF_WEIGHTS, diff_weights},
                                         {DNNL_ARG_SCRATCHPAD, buffer(kScratchSlot, p.weights_scratchpad)}};
    if (p.bias) args.emplace(DNNL_ARG_DIFF_BIAS, memory(p.bias_desc, engine, db));
    p.bwd_weights.execute(stream, args);
    if (p.reorder_diff_weights) p.diff_weights_reorder.execute(stream, diff_weights, weights_user);
  }
  if (p.data) {
    memory weights_user(p.weights_user, engine, const_cast<void*>(w));
    memory weights = p.reorder_weights ? buffer(kWeightsSlot, p.data_weights) : weights_user;
    if (p.reorder_weights) p.weights_reorder.execute(stream, weights_user, weights);
    memory src_user(p.src_user, engine, dx);
    memory diff_src = p.reorder_diff_src ? buffer(kDiffSrcSlot, p.data_diff_src) : src_user;
    p.bwd_data.execute(stream, {{DNNL_ARG_DIFF_DST, data_diff_dst},
                                {DNNL_ARG_WEIGHTS, weights},
                                {DNNL_ARG_DIFF_SRC, diff_src},
                                {DNNL_ARG_SCRATCHPAD, buffer(kScratch2Slot, p.data_scratchpad)}});
    if (p.reorder_diff_src) p.diff_src_reorder.execute(stream, diff_src, src_user);
  }
  stream.wait();
}

// ---------------- autotuning (max_autotune): direct vs Winograd ----------------

// A decision holds for the thread count it was timed at: which algorithm wins moves with the
// cores it gets (Winograd's transforms scale differently from a direct kernel), so a process that
// changes its thread count times again.
struct DecisionKey {
  ConvKey conv;
  ConvDirection direction;
  int threads;
  bool operator==(const DecisionKey&) const = default;
};

struct DecisionKeyHash {
  size_t operator()(const DecisionKey& k) const {
    return (ConvKeyHash{}(k.conv) * 7u + static_cast<size_t>(k.direction)) * 31u + static_cast<size_t>(k.threads);
  }
};

// One key's decision, made once: std::call_once makes a racing thread wait for the first one's
// timing (and lets the next caller time again if it threw). `timed` and `decision` are written
// once, under the cache mutex, inside the call_once.
struct DecisionEntry {
  std::once_flag once;
  bool timed = false;  // false: Winograd can't run this configuration (direct, nothing timed)
  ConvAutotuneDecision decision;
};

struct DecisionCache {
  std::mutex mutex;
  std::unordered_map<DecisionKey, std::shared_ptr<DecisionEntry>, DecisionKeyHash> entries;
};

DecisionCache& decision_cache() {
  static DecisionCache cache;
  return cache;
}

std::string describe(const ConvShape& s, DType dtype, Layout layout) {
  return fmt::format("{} {} input {}x{}x{}x{}, weight {}x{}x{}x{}{}, stride {}x{}, padding {}x{}, "
                     "dilation {}x{}, groups {}{}",
                     dtype_name(dtype), layout.channels_last ? "NHWC" : "NCHW", s.n, s.c, s.h, s.w, s.o,
                     s.c / s.groups, s.kh, s.kw, layout.weight_channels_last ? " (OHWI)" : "", s.stride[0],
                     s.stride[1], s.pad[0], s.pad[1], s.dilation[0], s.dilation[1], s.groups,
                     s.bias ? ", bias" : "");
}

// Milliseconds of `run(algorithm)` for each of `algorithms`, the fastest of five runs after two
// warm-up runs, alternating so that load on the machine hits all alike. The fastest, not the
// median: on a loaded machine a run that loses its cores takes scheduler quanta (measured 16-56 ms
// for 0.05-3 ms convolutions), and only the undisturbed runs measure the kernels.
std::vector<double> time_algorithms(const std::vector<ConvAlgorithm>& algorithms,
                                    const std::function<void(ConvAlgorithm)>& run) {
  constexpr int kWarmup = 2, kRuns = 5;
  for (int i = 0; i < kWarmup; ++i)
    for (ConvAlgorithm a : algorithms) run(a);
  std::vector<double> best(algorithms.size(), std::numeric_limits<double>::infinity());
  for (int i = 0; i < kRuns; ++i)
    for (size_t k = 0; k < algorithms.size(); ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      run(algorithms[k]);
      best[k] = std::min(best[k], std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  return best;
}

// The algorithm for this configuration, layout and direction: the cached decision, else timed
// now. `alternatives` lists the Winograd algorithms that can run it (nothing to time when empty);
// `run` runs one algorithm on scratch outputs. An alternative must beat direct by 5%: within
// noise, the direct plan (eager's numerics) stays.
ConvAlgorithm autotuned_algorithm(ConvDirection direction, const ConvShape& s, DType dtype, Layout layout,
                                  const std::function<std::vector<ConvAlgorithm>()>& alternatives,
                                  const std::function<void(ConvAlgorithm)>& run) {
  DecisionCache& cache = decision_cache();
  const int threads = max_threads();
  const DecisionKey key{make_key(s, dtype, layout), direction, threads};
  std::shared_ptr<DecisionEntry> entry;
  {
    std::lock_guard lock(cache.mutex);
    auto& slot = cache.entries[key];
    if (!slot) slot = std::make_shared<DecisionEntry>();
    entry = slot;
  }
  std::call_once(entry->once, [&] {
    ConvAutotuneDecision d;
    d.config = describe(s, dtype, layout);
    d.input = {s.n, s.c, s.h, s.w};
    d.weight = {s.o, s.c / s.groups, s.kh, s.kw};
    d.channels_last = layout.channels_last;
    d.direction = direction;
    d.threads = threads;
    std::vector<ConvAlgorithm> algorithms = alternatives();
    const bool timed = !algorithms.empty();
    if (timed) {
      algorithms.insert(algorithms.begin(), ConvAlgorithm::direct);
      const std::vector<double> ms = time_algorithms(algorithms, run);
      kernels::note_autotuned();  // the progress line of long autotuning
      double best = std::numeric_limits<double>::infinity();
      for (size_t k = 0; k < algorithms.size(); ++k) {
        switch (algorithms[k]) {
          case ConvAlgorithm::direct: d.direct_ms = ms[k]; break;
          case ConvAlgorithm::winograd: d.winograd_ms = ms[k]; break;
          case ConvAlgorithm::winograd_nhwc: d.winograd_nhwc_ms = ms[k]; break;
        }
        if (k > 0 && ms[k] < 0.95 * ms[0] && ms[k] < best) {
          best = ms[k];
          d.chosen = algorithms[k];
        }
      }
      if (kiln::detail::perf_hints_enabled())
        kiln::detail::log_stream() << "[kiln.compile] conv autotune: " << d.str() << "\n";
    }
    std::lock_guard lock(cache.mutex);
    entry->decision = std::move(d);
    entry->timed = timed;
  });
  if (!entry->timed) return ConvAlgorithm::direct;
  const ConvAutotuneDecision& d = entry->decision;
  const kernels::ConvAutotuneMode mode = kernels::conv_autotune_mode();
  if (mode == kernels::ConvAutotuneMode::force_winograd_nhwc && d.winograd_nhwc_ms >= 0)
    return ConvAlgorithm::winograd_nhwc;
  if (mode == kernels::ConvAutotuneMode::force_winograd) {
    if (d.winograd_ms >= 0) return ConvAlgorithm::winograd;
    if (!onednn_winograd_available()) {
      static std::once_flag once;
      std::call_once(once, [] {
        kiln::detail::log_warning(
            "KILN_CONV_AUTOTUNE=winograd: oneDNN has no Winograd convolution on this CPU (it needs "
            "AVX-512), so the forced convolutions run the timed choice instead; "
            "KILN_CONV_AUTOTUNE=winograd_nhwc forces Kiln's own Winograd, which runs everywhere.");
      });
    }
  }
  return d.chosen;
}

// The forward plan autotuning picks for a float32 call with direct plan `direct` (x, w, bias: the
// call's operands in the plan's layout).
std::shared_ptr<const ConvPlan> autotuned_plan(const ConvShape& s, DType dtype, Layout layout,
                                               std::shared_ptr<const ConvPlan> direct, const void* x, const void* w,
                                               const void* bias) {
  std::shared_ptr<const ConvPlan> winograd;
  ScratchBuffer out;  // never the caller's output
  const ConvAlgorithm a = autotuned_algorithm(
      ConvDirection::forward, s, dtype, layout,
      [&] {
        std::vector<ConvAlgorithm> alternatives;
        if ((winograd = find_plan(s, dtype, layout, ConvAlgorithm::winograd))) alternatives.push_back(ConvAlgorithm::winograd);
        if (winograd_nhwc_runs(s, layout)) alternatives.push_back(ConvAlgorithm::winograd_nhwc);
        return alternatives;
      },
      [&](ConvAlgorithm algorithm) {
        void* y = out.get(direct->dst_user.get_size());
        if (algorithm == ConvAlgorithm::winograd_nhwc) return run_winograd_nhwc_forward(s, layout, x, w, y);
        run_plan(algorithm == ConvAlgorithm::winograd ? *winograd : *direct, x, w, bias, y);
      });
  if (a == ConvAlgorithm::winograd_nhwc) return nullptr;
  if (a != ConvAlgorithm::winograd) return direct;
  if (!winograd) winograd = find_plan(s, dtype, layout, ConvAlgorithm::winograd);
  return winograd ? winograd : direct;
}

// The backward plan autotuning picks for a float32 call that needs backward-data (need_data)
// and/or oneDNN's backward-weights (need_weights; s.bias: with the bias gradient): each direction
// timed on its own. x, w, dy: the call's operands in the plan's layout (x only with need_weights,
// w only with need_data). When Kiln's Winograd wins backward-data (backward-weights),
// *data_by_winograd_nhwc (*weights_by_winograd_nhwc) is set and the plan returned leaves that
// gradient out (nullptr when it has nothing else to do).
std::shared_ptr<const BackwardPlan> autotuned_backward_plan(const ConvShape& s, DType dtype, Layout layout,
                                                            bool need_data, bool need_weights,
                                                            std::shared_ptr<const BackwardPlan> direct, const void* x,
                                                            const void* w, const void* dy, bool* data_by_winograd_nhwc,
                                                            bool* weights_by_winograd_nhwc) {
  *data_by_winograd_nhwc = false;
  *weights_by_winograd_nhwc = false;
  ConvAlgorithm data_algorithm = ConvAlgorithm::direct, weights_algorithm = ConvAlgorithm::direct;
  ScratchBuffer out, out_bias;  // never the caller's outputs
  if (need_data) {
    ConvShape data_shape = s;
    data_shape.bias = false;  // the bias gradient comes from backward-weights
    std::shared_ptr<const BackwardPlan> plans[2];
    data_algorithm = autotuned_algorithm(
        ConvDirection::backward_data, data_shape, dtype, layout,
        [&] {
          std::vector<ConvAlgorithm> alternatives;
          plans[0] = find_backward_plan(data_shape, dtype, layout, true, false);
          if (!plans[0]) return alternatives;
          plans[1] = find_backward_plan(data_shape, dtype, layout, true, false, ConvAlgorithm::winograd);
          if (plans[1]) alternatives.push_back(ConvAlgorithm::winograd);
          if (winograd_nhwc_runs(data_shape, layout)) alternatives.push_back(ConvAlgorithm::winograd_nhwc);
          return alternatives;
        },
        [&](ConvAlgorithm algorithm) {
          void* dx = out.get(plans[0]->src_user.get_size());
          if (algorithm == ConvAlgorithm::winograd_nhwc) return run_winograd_nhwc_backward_data(s, layout, dy, w, dx);
          run_backward_plan(*plans[static_cast<int>(algorithm)], nullptr, w, dy, dx, nullptr, nullptr);
        });
    if (data_algorithm == ConvAlgorithm::winograd_nhwc) {
      *data_by_winograd_nhwc = true;
      need_data = false;
      data_algorithm = ConvAlgorithm::direct;
    }
  }
  if (need_weights) {
    std::shared_ptr<const BackwardPlan> plans[2];
    weights_algorithm = autotuned_algorithm(
        ConvDirection::backward_weights, s, dtype, layout,
        [&] {
          std::vector<ConvAlgorithm> alternatives;
          plans[0] = find_backward_plan(s, dtype, layout, false, true);
          if (!plans[0]) return alternatives;
          plans[1] = find_backward_plan(s, dtype, layout, false, true, ConvAlgorithm::direct, ConvAlgorithm::winograd);
          if (plans[1]) alternatives.push_back(ConvAlgorithm::winograd);
          if (winograd_nhwc_runs(s, layout)) alternatives.push_back(ConvAlgorithm::winograd_nhwc);
          return alternatives;
        },
        [&](ConvAlgorithm algorithm) {
          void* dw = out.get(plans[0]->weights_user.get_size());
          if (algorithm == ConvAlgorithm::winograd_nhwc) return run_winograd_nhwc_backward_weights(s, layout, x, dy, dw);
          const BackwardPlan& p = *plans[static_cast<int>(algorithm)];
          run_backward_plan(p, x, nullptr, dy, nullptr, dw,
                            p.bias ? static_cast<float*>(out_bias.get(p.bias_desc.get_size())) : nullptr);
        });
    if (weights_algorithm == ConvAlgorithm::winograd_nhwc) {
      *weights_by_winograd_nhwc = true;
      need_weights = false;
      weights_algorithm = ConvAlgorithm::direct;
    }
  }
  if (!need_data && !need_weights) return nullptr;
  const bool own = *data_by_winograd_nhwc || *weights_by_winograd_nhwc;
  if (!own && data_algorithm == ConvAlgorithm::direct && weights_algorithm == ConvAlgorithm::direct) return direct;
  auto tuned = find_backward_plan(s, dtype, layout, need_data, need_weights, data_algorithm, weights_algorithm);
  if (tuned || !own) return tuned ? tuned : direct;
  *data_by_winograd_nhwc = *weights_by_winograd_nhwc = false;  // no such plan: the direct one does it all
  return direct;
}

// ---------------- backward: col2im/im2col + GEMM ----------------

// x (C x H x W plane group) -> col (k x p); the forward's im2col.
template <class T>
void im2col(const ConvShape& s, const T* xg, int64_t cg, T* col) {
  const int64_t p = s.oh * s.ow, k = cg * s.kh * s.kw;
  parallel_for(k, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, p)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t c = row / (s.kh * s.kw), ki = row / s.kw % s.kh, kj = row % s.kw;
      T* out = col + row * p;
      for (int64_t oh = 0; oh < s.oh; ++oh) {
        const int64_t ih = oh * s.stride[0] - s.pad[0] + ki * s.dilation[0];
        for (int64_t ow = 0; ow < s.ow; ++ow) {
          const int64_t iw = ow * s.stride[1] - s.pad[1] + kj * s.dilation[1];
          out[oh * s.ow + ow] = ih >= 0 && ih < s.h && iw >= 0 && iw < s.w ? xg[(c * s.h + ih) * s.w + iw] : T(0);
        }
      }
    }
  });
}

// dxg (C x H x W) += col2im(col); parallel over channels, so no two threads touch one plane.
template <class T>
void col2im_add(const ConvShape& s, const T* col, int64_t cg, T* dxg) {
  const int64_t p = s.oh * s.ow;
  parallel_for(cg, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, p * s.kh * s.kw)),
               [&](int64_t begin, int64_t end) {
                 for (int64_t c = begin; c < end; ++c) {
                   T* plane = dxg + c * s.h * s.w;
                   for (int64_t ki = 0; ki < s.kh; ++ki)
                     for (int64_t kj = 0; kj < s.kw; ++kj) {
                       const T* in = col + ((c * s.kh + ki) * s.kw + kj) * p;
                       for (int64_t oh = 0; oh < s.oh; ++oh) {
                         const int64_t ih = oh * s.stride[0] - s.pad[0] + ki * s.dilation[0];
                         if (ih < 0 || ih >= s.h) continue;
                         for (int64_t ow = 0; ow < s.ow; ++ow) {
                           const int64_t iw = ow * s.stride[1] - s.pad[1] + kj * s.dilation[1];
                           if (iw >= 0 && iw < s.w) plane[ih * s.w + iw] += in[oh * s.ow + ow];
                         }
                       }
                     }
                 }
               });
}

// Contiguous x, w, dy; dx/dw (zeroed here) where non-null.
template <class T>
void conv_backward_im2col(const ConvShape& s, const T* x, const T* w, const T* dy, T* dx, T* dw) {
  const int64_t cg = s.c / s.groups, og = s.o / s.groups;
  const int64_t k = cg * s.kh * s.kw, p = s.oh * s.ow;
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  KILN_CHECK(k <= kMaxInt && p <= kMaxInt && og <= kMaxInt, ValueError,
             "[kiln::convolution_backward] the convolution is too large for the GEMM path (sizes exceed int32).");
  const bool direct = s.kh == 1 && s.kw == 1 && s.stride[0] == 1 && s.stride[1] == 1 && s.pad[0] == 0 &&
                      s.pad[1] == 0;
  std::vector<T> col(direct ? 0 : static_cast<size_t>(k * p));
  if (dx) std::fill_n(dx, s.n * s.c * s.h * s.w, T(0));
  if (dw) std::fill_n(dw, s.o * k, T(0));
  for (int64_t n = 0; n < s.n; ++n) {
    for (int64_t g = 0; g < s.groups; ++g) {
      const T* dyg = dy + (n * s.o + g * og) * p;  // og x p
      const T* wg = w + g * og * k;                // og x k
      if (dw) {  // dw_g (og x k) += dy_g (og x p) . col^T (p x k)
        const T* xg = x + (n * s.c + g * cg) * s.h * s.w;
        if (!direct) im2col(s, xg, cg, col.data());
        gemm<T>(false, true, og, k, p, dyg, p, direct ? xg : col.data(), p, T(1), dw + g * og * k, k);
      }
      if (dx) {  // col (k x p) = w_g^T (k x og) . dy_g (og x p), scattered back by col2im
        T* dxg = dx + (n * s.c + g * cg) * s.h * s.w;
        if (direct) {
          gemm<T>(true, false, k, p, og, wg, k, dyg, p, T(0), dxg, p);
        } else {
          gemm<T>(true, false, k, p, og, wg, k, dyg, p, T(0), col.data(), p);
          col2im_add(s, col.data(), cg, dxg);
        }
      }
    }
  }
}

// Splits the weight gradient dW (O x C) of a 1x1 convolution into one block of rows or columns
// per thread (whichever dim is longer), with boundaries on multiples of 16 (one AVX-512 vector of
// floats), and calls block(lo, hi, split_columns) for each: no reduction across threads.
template <class Block>
void for_each_weight_grad_block(const ConvShape& s, Block&& block) {
  const bool split_columns = s.c >= s.o;
  const int64_t extent = split_columns ? s.c : s.o;
  const int64_t threads = max_threads();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, extent / 16));
  parallel_for(parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) {
      const int64_t lo = extent * part / parts / 16 * 16;
      const int64_t hi = part + 1 == parts ? extent : extent * (part + 1) / parts / 16 * 16;
      if (hi > lo) block(lo, hi, split_columns);
    }
  });
}

// Weight gradient of a 1x1/stride-1 float32 convolution: dW (O x C) = sum_n dy[n] (O x P) x[n]^T
// (P x C); each thread runs single-threaded GEMMs over the images into its own block of dW.
void pointwise_weight_grad(const ConvShape& s, const float* x, const float* dy, float* dw) {
  const int64_t p = s.h * s.w;
  for_each_weight_grad_block(s, [&](int64_t lo, int64_t hi, bool split_columns) {
    for (int64_t n = 0; n < s.n; ++n) {
      const float* dyn = dy + n * s.o * p;
      const float* xn = x + n * s.c * p;
      const float beta = n == 0 ? 0.0f : 1.0f;
      if (split_columns)
        gemm<float>(false, true, s.o, hi - lo, p, dyn, p, xn + lo * p, p, beta, dw + lo, s.c);
      else
        gemm<float>(false, true, hi - lo, s.c, p, dyn + lo * p, p, xn, p, beta, dw + lo * s.c, s.c);
    }
  });
}

// The NHWC form: with x (R x C) and dy (R x O) row-major over the R = N * H * W pixels, dW
// (O x C) = dy^T x is one GEMM per thread block.
void pointwise_weight_grad_channels_last(const ConvShape& s, const float* x, const float* dy, float* dw) {
  const int64_t rows = s.n * s.h * s.w;
  for_each_weight_grad_block(s, [&](int64_t lo, int64_t hi, bool split_columns) {
    if (split_columns)
      gemm<float>(true, false, s.o, hi - lo, rows, dy, s.o, x + lo, s.c, 0.0f, dw + lo, s.c);
    else
      gemm<float>(true, false, hi - lo, s.c, rows, dy + lo, s.o, x, s.c, 0.0f, dw + lo * s.c, s.c);
  });
}

// Per-channel sum of dy (N x O x P) over N and P.
template <class T>
void bias_grad(const ConvShape& s, const T* dy, T* db) {
  using Acc = opmath_t<T>;
  const int64_t p = s.oh * s.ow;
  parallel_for(s.o, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, s.n * p)), [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      double total = 0;
      for (int64_t n = 0; n < s.n; ++n) {
        const T* row = dy + (n * s.o + o) * p;
        Acc sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < p; ++i) sum += static_cast<Acc>(row[i]);
        total += static_cast<double>(sum);
      }
      db[o] = static_cast<T>(total);
    }
  });
}

// Per-channel sum of a channels-last dy (N * P rows of O channels). Each thread sums a block of
// channels over all rows, in chunks of rows added into double (as bias_grad does per image).
template <class T>
void bias_grad_channels_last(const ConvShape& s, const T* dy, T* db) {
  using Acc = opmath_t<T>;
  const int64_t rows = s.n * s.oh * s.ow;
  constexpr int64_t kRowChunk = 1024;
  parallel_for(s.o, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, rows)), [&](int64_t begin, int64_t end) {
    const int64_t width = end - begin;
    std::vector<double> total(static_cast<size_t>(width), 0.0);
    std::vector<Acc> chunk(static_cast<size_t>(width));
    for (int64_t r0 = 0; r0 < rows; r0 += kRowChunk) {
      std::fill(chunk.begin(), chunk.end(), Acc(0));
      Acc* sum = chunk.data();
      for (int64_t r = r0; r < std::min(rows, r0 + kRowChunk); ++r) {
        const T* row = dy + r * s.o + begin;
#pragma omp simd
        for (int64_t o = 0; o < width; ++o) sum[o] += static_cast<Acc>(row[o]);
      }
      for (int64_t o = 0; o < width; ++o) total[o] += static_cast<double>(sum[o]);
    }
    for (int64_t o = 0; o < width; ++o) db[begin + o] = static_cast<T>(total[o]);
  });
}

// ---------------- backward kernel ----------------

// An output to write into, dense in the plan's layout: out itself, or a temporary copied back by
// finish().
struct OutputBuffer {
  Tensor& out;
  Tensor buf;
  OutputBuffer(Tensor& o, MemoryFormat format) : out(o), buf(dense_buffer(o, format)) {}
  void* data() const { return buf.impl().data(); }
  void finish() {
    if (!buf.same(out)) out.copy_(buf);
  }
};

void convolution_backward_kernel(const OpCall& call, std::span<Tensor> outs) {
  IntArrayRef mask = call.ints_attr(4);
  const bool need_dx = mask[0] != 0, need_dw = mask[1] != 0, need_db = mask[2] != 0;
  const Tensor& grad = call.input(0);
  const Tensor& input = call.input(1);
  const Tensor& weight = call.input(2);
  auto pair = [&](size_t i, int d) { IntArrayRef v = call.ints_attr(i); return v.size() == 1 ? v[0] : v[d]; };
  ConvShape s{input.sizes()[0], input.sizes()[1], input.sizes()[2], input.sizes()[3], weight.sizes()[0],
              weight.sizes()[2], weight.sizes()[3], grad.sizes()[2], grad.sizes()[3], {pair(0, 0), pair(0, 1)},
              {pair(1, 0), pair(1, 1)}, {pair(2, 0), pair(2, 1)}, call.int_attr(3), need_db};
  if (grad.numel() == 0 || s.c == 0) {  // nothing reaches the input or weight gradients
    if (need_dx) outs[0].zero_();
    if (need_dw) outs[1].zero_();
    if (need_db) outs[2].copy_(grad.sum({0, 2, 3}));
    return;
  }
  const DType t = input.dtype();
  if (t == DType::float16) {  // compute in float32
    auto r = call_op(*call.op, {grad.to(kFloat32), input.to(kFloat32), weight.to(kFloat32)},
                     std::vector<Attr>(call.attrs.begin(), call.attrs.end()));
    for (int i = 0; i < 3; ++i)
      if (mask[i]) outs[i].copy_(r[i]);
    return;
  }
  // oneDNN in the layout the forward ran in (NCHW where it has no fast NHWC kernel). 1x1/stride-1
  // float32 weight gradients: threaded GEMMs here, in either layout (oneDNN's backward-weights is
  // slower there: NCHW GEMM convolution parallelizes poorly, NHWC jit_1x1 measured 2x slower on
  // DenseNet-121's shapes); so are their NHWC input gradients, dx (pixels x C) = dy (pixels x O) w
  // (O x C) (oneDNN's NHWC jit_1x1 backward-data measured 2-15% slower on DenseNet-121's
  // shapes, A/B interleaved). The rest runs through a oneDNN plan.
  Layout layout;
  std::shared_ptr<const BackwardPlan> plan;
  bool use_onednn = false, own_dw = false, plan_dw = false, own_dx = false, plan_dx = false;
  if ((t == DType::float32 || t == DType::bfloat16) && onednn_enabled() && (need_dx || need_dw)) {
    auto try_layout = [&](Layout l) {
      own_dw = t == DType::float32 && need_dw && plain_layout(s);
      plan_dw = need_dw && !own_dw;
      own_dx = t == DType::float32 && need_dx && plain_layout(s) && l.channels_last;
      plan_dx = need_dx && !own_dx;
      plan = plan_dx || plan_dw ? find_backward_plan(s, t, l, plan_dx, plan_dw) : nullptr;
      return plan != nullptr || !(plan_dx || plan_dw);
    };
    const Layout preferred = preferred_layout(input, weight);
    if (try_layout(preferred)) {
      layout = preferred;
      use_onednn = true;
    } else if (preferred.channels_last) {
      use_onednn = try_layout(Layout{});
    }
  }
  // Copies only for operands not dense in the plan's layout (the fallbacks run NCHW).
  const MemoryFormat activations = layout.activations();
  const Tensor dy = grad.contiguous(activations);
  const Tensor x = need_dw ? input.contiguous(activations) : Tensor();
  const Tensor w = need_dx ? weight.contiguous(layout.weights()) : Tensor();
  OutputBuffer dx(outs[0], activations), dw(outs[1], layout.weights()), db(outs[2], contiguous_format);
  if (use_onednn) {
    if (own_dx) {
      const int64_t pixels = s.n * s.h * s.w;
      gemm<float>(false, false, pixels, s.c, s.o, dy.data_ptr<float>(), s.o, w.data_ptr<float>(), s.c, 0.0f,
                  static_cast<float*>(dx.data()), s.c);
    }
    if (own_dw) {
      auto* dw_data = static_cast<float*>(dw.data());
      if (layout.channels_last)
        pointwise_weight_grad_channels_last(s, x.data_ptr<float>(), dy.data_ptr<float>(), dw_data);
      else
        pointwise_weight_grad(s, x.data_ptr<float>(), dy.data_ptr<float>(), dw_data);
    }
    // max_autotune: each of backward-data and backward-weights direct or Winograd, whichever
    // timed faster for this configuration.
    if (plan && t == DType::float32 && kernels::convolutions_autotuned()) {
      bool dx_by_winograd_nhwc = false, dw_by_winograd_nhwc = false;
      plan = autotuned_backward_plan(s, t, layout, plan_dx, plan_dw, std::move(plan),
                                     plan_dw ? x.impl().data() : nullptr, plan_dx ? w.impl().data() : nullptr,
                                     dy.impl().data(), &dx_by_winograd_nhwc, &dw_by_winograd_nhwc);
      if (dx_by_winograd_nhwc) {
        run_winograd_nhwc_backward_data(s, layout, dy.impl().data(), w.impl().data(), dx.data());
        plan_dx = false;
      }
      if (dw_by_winograd_nhwc) {
        run_winograd_nhwc_backward_weights(s, layout, x.impl().data(), dy.impl().data(), dw.data());
        plan_dw = false;
      }
    }
    const bool onednn_bias = need_db && plan && plan->bias;
    Tensor db32 = onednn_bias ? (t == DType::float32 && db.buf.is_contiguous() ? db.buf : empty({s.o}, kFloat32))
                              : Tensor();
    if (plan)
      run_backward_plan(*plan, plan_dw ? x.impl().data() : nullptr, plan_dx ? w.impl().data() : nullptr,
                        dy.impl().data(), plan_dx ? dx.data() : nullptr, plan_dw ? dw.data() : nullptr,
                        db32.defined() ? db32.data_ptr<float>() : nullptr);
    if (db32.defined() && !db32.same(db.buf)) db.buf.copy_(db32);
    if (need_db && !onednn_bias) {
      if (t != DType::float32) db.buf.copy_(dy.sum({0, 2, 3}, false, kFloat32));
      else if (layout.channels_last) bias_grad_channels_last<float>(s, dy.data_ptr<float>(), db.buf.data_ptr<float>());
      else bias_grad<float>(s, dy.data_ptr<float>(), db.buf.data_ptr<float>());
    }
  } else if (t == DType::float64 || t == DType::float32) {
    KILN_DISPATCH_FLOATING(t, "convolution_backward", [&] {
      if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
        if (need_dx || need_dw)
          conv_backward_im2col<scalar_t>(s, need_dw ? x.data_ptr<scalar_t>() : nullptr,
                                         need_dx ? w.data_ptr<scalar_t>() : nullptr, dy.data_ptr<scalar_t>(),
                                         need_dx ? static_cast<scalar_t*>(dx.data()) : nullptr,
                                         need_dw ? static_cast<scalar_t*>(dw.data()) : nullptr);
        if (need_db) bias_grad<scalar_t>(s, dy.data_ptr<scalar_t>(), static_cast<scalar_t*>(db.data()));
      }
    });
  } else {  // bfloat16 without oneDNN support: compute in float32
    auto r = call_op(*call.op, {grad.to(kFloat32), input.to(kFloat32), weight.to(kFloat32)},
                     std::vector<Attr>(call.attrs.begin(), call.attrs.end()));
    for (int i = 0; i < 3; ++i)
      if (mask[i]) outs[i].copy_(r[i]);
    return;
  }
  if (need_dx) dx.finish();
  if (need_dw) dw.finish();
  if (need_db) db.finish();
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("conv2d", DeviceType::cpu,
                  [](const OpCall& call, std::span<Tensor> outs) { conv2d_impl(call, outs, false); });
  register_kernel("conv2d_bn", DeviceType::cpu, conv2d_bn_kernel);
  register_kernel("conv2d_relu", DeviceType::cpu,
                  [](const OpCall& call, std::span<Tensor> outs) { conv2d_impl(call, outs, true); });
  register_kernel("convolution_backward", DeviceType::cpu, convolution_backward_kernel);
  return true;
}();

}  // namespace

std::string onednn_backward_weights_activation_layout(std::array<int64_t, 4> input, std::array<int64_t, 4> weight,
                                                      std::array<int64_t, 2> stride, std::array<int64_t, 2> padding,
                                                      std::array<int64_t, 2> dilation, int64_t groups,
                                                      bool channels_last) {
  auto out_size = [&](int d) {
    return (input[2 + d] + 2 * padding[d] - dilation[d] * (weight[2 + d] - 1) - 1) / stride[d] + 1;
  };
  const ConvShape s{input[0], input[1], input[2], input[3], weight[0], weight[2], weight[3], out_size(0), out_size(1),
                    {stride[0], stride[1]}, {padding[0], padding[1]}, {dilation[0], dilation[1]}, groups, false};
  auto plan = find_backward_plan(s, DType::float32, Layout{channels_last, false}, false, true);
  if (!plan || !plan->weights) return "";
  const memory::dims dims{s.n, s.c, s.h, s.w};
  if (plan->weights_src == memory::desc(dims, memory::data_type::f32, Tag::nhwc)) return "nhwc";
  if (plan->weights_src == memory::desc(dims, memory::data_type::f32, Tag::nchw)) return "nchw";
  return "blocked";
}

bool onednn_winograd_available() {
  static const bool available = [] {
    // A configuration every Winograd implementation of oneDNN takes.
    ConvShape s{.n = 1, .c = 16, .h = 8, .w = 8, .o = 16, .kh = 3, .kw = 3, .oh = 8, .ow = 8,
                .stride = {1, 1}, .pad = {1, 1}, .dilation = {1, 1}, .groups = 1, .bias = false};
    return find_plan(s, kFloat32, Layout{}, ConvAlgorithm::winograd) != nullptr;
  }();
  return available;
}

const char* name(ConvAlgorithm a) {
  switch (a) {
    case ConvAlgorithm::direct: return "direct";
    case ConvAlgorithm::winograd: return "winograd";
    case ConvAlgorithm::winograd_nhwc: return "winograd_nhwc";
  }
  return "?";
}

const char* name(ConvDirection d) {
  switch (d) {
    case ConvDirection::forward: return "forward";
    case ConvDirection::backward_data: return "backward_data";
    case ConvDirection::backward_weights: return "backward_weights";
  }
  return "?";
}

std::string ConvAutotuneDecision::str() const {
  std::string timings = fmt::format("direct {:.3f} ms", direct_ms);
  if (winograd_ms >= 0) timings += fmt::format(", winograd {:.3f} ms", winograd_ms);
  if (winograd_nhwc_ms >= 0) timings += fmt::format(", winograd_nhwc {:.3f} ms", winograd_nhwc_ms);
  return fmt::format("{} {}, {} threads: {} -> {}", config, name(direction), threads, timings, name(chosen));
}

std::vector<ConvAutotuneDecision> conv_autotune_decisions() {
  DecisionCache& cache = decision_cache();
  std::lock_guard lock(cache.mutex);
  std::vector<ConvAutotuneDecision> out;
  for (const auto& [key, entry] : cache.entries)
    if (entry->timed) out.push_back(entry->decision);
  return out;
}

void clear_conv_autotune_decisions() {
  DecisionCache& cache = decision_cache();
  std::lock_guard lock(cache.mutex);
  cache.entries.clear();
}

}  // namespace kiln::cpu
