// Eager CUDA kernels of the random ops: uniform, normal, randint, bernoulli (tensor p and
// scalar p) and native_dropout. Element i (row-major) is a pure function of (seed, offset, i)
// through the Philox stream of kiln/math/philox.h, the header the CPU kernels
// (src/kernels/cpu/random_kernels.cpp) use, with their parameter roundings done on the host the
// same way and no contraction in the kernels (--fmad=false): the CUDA results equal the CPU's bit
// for bit for one generator state. The exception is float64 normals, whose log/cos/sin come from
// CUDA's math library (within an ulp or so of glibc's; docs/random.md).
//
// One thread computes one Philox block, i.e. the elements whose draws it holds: four elements
// for 32-bit draws, two for 64-bit draws (for normals, the two Box-Muller pairs or the one pair
// of the block).
#include <cmath>
#include <type_traits>

#include <fmt/format.h>

#include "kernels/cuda/cuda_runtime.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/jit.h"
#include "kernels/cuda/misc_kernels.h"
#include "core/tensor_factory.h"
#include "kiln/math/philox.h"
#include "kiln/op_table.h"
#include "kernels/random_ops.h"

namespace kiln::cuda::detail {

namespace {

using kiln::detail::make_empty;

template <class T>
using host_opmath = std::conditional_t<std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>, float, T>;

enum class RandomOp { uniform, normal, randint, bernoulli, bernoulli_scalar, dropout };

struct RandomSpec {
  RandomOp op;
  DType dtype;
  int bits;  // draw width: 32 or 64
};

const char* random_op_name(RandomOp op) {
  switch (op) {
    case RandomOp::uniform: return "uniform";
    case RandomOp::normal: return "normal";
    case RandomOp::randint: return "randint";
    case RandomOp::bernoulli: return "bernoulli";
    case RandomOp::bernoulli_scalar: return "bernoulli_scalar";
    case RandomOp::dropout: return "dropout";
  }
  return "";
}

int uniform_digits(DType t) { return t == kFloat16 ? 11 : t == kBFloat16 ? 8 : 24; }

std::string random_source(const RandomSpec& s) {
  const int per = s.bits == 64 ? 2 : 4;
  std::string prologue, element;
  switch (s.op) {
    case RandomOp::uniform:
      prologue = "  const acc_t from = kj::unpack<acc_t>(p.a), range = kj::unpack<acc_t>(p.b);\n";
      element = s.bits == 64 ? "out[i] = kiln::math::uniform_double(w) * range + from;"
                             : fmt::format("out[i] = static_cast<scalar_t>(kiln::math::uniform_float(w, {}) * range + from);",
                                           uniform_digits(s.dtype));
      break;
    case RandomOp::normal:
      prologue = "  const acc_t mean = kj::unpack<acc_t>(p.a), std_dev = kj::unpack<acc_t>(p.b);\n";
      element = "out[i] = static_cast<scalar_t>(z[j] * std_dev + mean);";
      break;
    case RandomOp::randint:
      prologue = "  const unsigned long long base = p.a, range = p.b;\n";
      element = fmt::format("out[i] = kj::from_int<scalar_t>(static_cast<long long>(base + kiln::math::bounded{}(w, range)));",
                            s.bits);
      break;
    case RandomOp::bernoulli:
      prologue = "  const scalar_t* prob = reinterpret_cast<const scalar_t*>(p.in);\n";
      element = "out[i] = kj::from_int<scalar_t>(kiln::math::bernoulli_trial(w, "
                "static_cast<double>(static_cast<acc_t>(prob[i]))) ? 1 : 0);";
      break;
    case RandomOp::bernoulli_scalar:
      prologue = "  const unsigned long long threshold = p.a;\n";
      element = "out[i] = kj::from_int<scalar_t>(static_cast<unsigned long long>(w) < threshold ? 1 : 0);";
      break;
    case RandomOp::dropout:
      prologue = "  const scalar_t* x = reinterpret_cast<const scalar_t*>(p.in);\n"
                 "  const unsigned long long threshold = p.a;\n"
                 "  const acc_t scale = kj::unpack<acc_t>(p.b);\n";
      element = "const bool keep = static_cast<unsigned long long>(w) < threshold;\n"
                "        const acc_t scaled = static_cast<acc_t>(x[i]) * scale;\n"
                "        p.mask[i] = keep;\n"
                "        out[i] = static_cast<scalar_t>(keep ? scaled : acc_t(0));";
      break;
  }
  std::string pairs;
  if (s.op == RandomOp::normal) {
    pairs = s.bits == 64
                ? "    const kiln::math::NormalPair<double> q = kiln::math::box_muller64(\n"
                  "        static_cast<unsigned long long>(blk.x[0]) | (static_cast<unsigned long long>(blk.x[1]) << 32),\n"
                  "        static_cast<unsigned long long>(blk.x[2]) | (static_cast<unsigned long long>(blk.x[3]) << 32));\n"
                  "    const double z[2] = {q.z0, q.z1};\n"
                : "    const kiln::math::NormalPair<float> q0 = kiln::math::box_muller32(blk.x[0], blk.x[1]);\n"
                  "    const kiln::math::NormalPair<float> q1 = kiln::math::box_muller32(blk.x[2], blk.x[3]);\n"
                  "    const float z[4] = {q0.z0, q0.z1, q1.z0, q1.z1};\n";
  }
  const char* draw = s.bits == 64 ? "const unsigned long long w = static_cast<unsigned long long>(blk.x[2 * j]) | "
                                    "(static_cast<unsigned long long>(blk.x[2 * j + 1]) << 32);"
                                  : "const unsigned w = blk.x[j];";
  return misc_preamble() + "#include \"kiln/math/philox.h\"\n" +
         fmt::format(R"(
typedef {t} scalar_t;
typedef kj::opmath<scalar_t> acc_t;
struct Params {{
  char* out;
  const char* in;
  bool* mask;
  unsigned long long seed, offset;
  long long n;
  unsigned long long a, b;
}};
extern "C" __global__ void __launch_bounds__({block}) kiln_random(Params p) {{
  scalar_t* out = reinterpret_cast<scalar_t*>(p.out);
{prologue}  const unsigned long long counters = (static_cast<unsigned long long>(p.n) + {per} - 1) / {per};
  for (unsigned long long c = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; c < counters;
       c += (unsigned long long)gridDim.x * blockDim.x) {{
    const kiln::math::PhiloxBlock blk = kiln::math::philox_block(p.seed, p.offset + c);
{pairs}    const long long i0 = static_cast<long long>(c * {per});
#pragma unroll
    for (int j = 0; j < {per}; ++j) {{
      const long long i = i0 + j;
      if (i < p.n) {{
        {draw}
        {element}
      }}
    }}
  }}
}}
)",
                     fmt::arg("t", cuda_type(s.dtype)), fmt::arg("block", kMiscBlock), fmt::arg("prologue", prologue),
                     fmt::arg("per", per), fmt::arg("pairs", pairs), fmt::arg("draw", draw), fmt::arg("element", element));
}

// Runs kiln_random into `out` (and `mask`), through contiguous buffers copied back when the
// outputs are strided views (element i is the logical row-major index).
void run_random(const RandomSpec& s, Tensor& out, const Tensor& in, Tensor* mask, uint64_t seed, uint64_t offset,
                unsigned long long a, unsigned long long b) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const char* op = random_op_name(s.op);
  Tensor buf = out.is_contiguous() ? out : make_empty(out.sizes().vec(), out.dtype(), out.device());
  Tensor mask_buf;
  if (mask) mask_buf = mask->is_contiguous() ? *mask : make_empty(mask->sizes().vec(), kBool, mask->device());
  const int device = out.device().index;
  const std::string key = fmt::format("{}|{}|{}", op, cuda_type(s.dtype), s.bits);
  JitFunction f = jit_function(device, key, "kiln_random", [&] { return random_source(s); });
  MiscParams p;
  p.add(buf.impl().data());
  p.add(in.defined() ? in.impl().data() : static_cast<void*>(nullptr));
  p.add(mask ? mask_buf.impl().data() : static_cast<void*>(nullptr));
  p.add(seed);
  p.add(offset);
  p.add(n);
  p.add(a);
  p.add(b);
  const int64_t per = s.bits == 64 ? 2 : 4;
  launch_misc(f, (n + per - 1) / per, device, p, op);
  if (!buf.same(out)) out.copy_(buf);
  if (mask && !mask_buf.same(*mask)) mask->copy_(mask_buf);
}

uint64_t u64_attr(const OpCall& c, size_t i) { return static_cast<uint64_t>(c.int_attr(i)); }

void uniform_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  const DType t = out.dtype();
  KILN_DISPATCH_FLOATING(t, "uniform_", [&] {
    using M = host_opmath<scalar_t>;
    const M from = static_cast<M>(static_cast<scalar_t>(c.double_attr(1)));
    const M range = static_cast<M>(static_cast<scalar_t>(c.double_attr(2))) - from;
    run_random({RandomOp::uniform, t, t == kFloat64 ? 64 : 32}, out, Tensor(), nullptr, u64_attr(c, 3), u64_attr(c, 4),
               misc_bits(from), misc_bits(range));
  });
}

void normal_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  const DType t = out.dtype();
  KILN_DISPATCH_FLOATING(t, "normal_", [&] {
    using M = host_opmath<scalar_t>;
    const M mean = static_cast<M>(c.double_attr(1)), std_dev = static_cast<M>(c.double_attr(2));
    run_random({RandomOp::normal, t, t == kFloat64 ? 64 : 32}, out, Tensor(), nullptr, u64_attr(c, 3), u64_attr(c, 4),
               misc_bits(mean), misc_bits(std_dev));
  });
}

void randint_kernel(const OpCall& c, std::span<Tensor> outs) {
  const uint64_t low = static_cast<uint64_t>(c.int_attr(1)), high = static_cast<uint64_t>(c.int_attr(2));
  const uint64_t range = high - low;
  run_random({RandomOp::randint, outs[0].dtype(), math::randint_draw_bits(range)}, outs[0], Tensor(), nullptr,
             u64_attr(c, 3), u64_attr(c, 4), low, range);
}

std::string check_probability_source(DType t) {
  return misc_preamble() + fmt::format(R"(
typedef {} scalar_t;
struct Params {{
  const scalar_t* prob;
  unsigned long long* bad;
  long long n;
}};
extern "C" __global__ void __launch_bounds__({}) kiln_check_probability(Params p) {{
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n; i += (long long)gridDim.x * blockDim.x) {{
    const double v = static_cast<double>(static_cast<kj::opmath<scalar_t>>(p.prob[i]));
    if (!(v >= 0.0 && v <= 1.0)) atomicMin(p.bad, static_cast<unsigned long long>(i));
  }}
}}
)",
                                                  cuda_type(t), kMiscBlock);
}

// Throws the CPU's ValueError for the first probability outside [0, 1] (nan included), before
// anything is written.
void check_probabilities(const Tensor& prob) {
  const int64_t n = prob.numel();
  if (n == 0) return;
  const int device = prob.device().index;
  Tensor bad = make_empty({1}, kInt64, prob.device());
  {
    DeviceGuard guard(device);
    check(cudaMemsetAsync(bad.impl().data(), 0xff, sizeof(int64_t), current_stream(device)), "bernoulli");
  }
  const DType t = prob.dtype();
  JitFunction f = jit_function(device, cuda_type(t), "kiln_check_probability", [&] { return check_probability_source(t); });
  MiscParams p;
  p.add(prob.impl().data());
  p.add(bad.impl().data());
  p.add(n);
  launch_misc(f, n, device, p, "bernoulli");
  const int64_t i = bad.to(kCPU).item<int64_t>();
  if (i < 0) return;
  const double v = host_element(prob, i).to(kFloat64).item<double>();
  throw ValueError("[kiln::bernoulli] bernoulli expects all p to be in [0, 1], but p[" + std::to_string(i) + "] = " +
                   std::to_string(v) + ". Clamp the probabilities first.");
}

void bernoulli_kernel(const OpCall& c, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  const DType t = out.dtype();
  KILN_CHECK(is_floating_point(t), DTypeError, "[kiln::bernoulli] not implemented for dtype " +
                                                   std::string(dtype_name(t)) + ". Convert the input with .to(...).");
  const Tensor& p_in = c.input(0);
  const Tensor prob = (p_in.dtype() == t ? p_in : p_in.to(t)).contiguous();
  check_probabilities(prob);
  run_random({RandomOp::bernoulli, t, 32}, out, prob, nullptr, u64_attr(c, 0), u64_attr(c, 1), 0, 0);
}

void bernoulli_scalar_kernel(const OpCall& c, std::span<Tensor> outs) {
  run_random({RandomOp::bernoulli_scalar, outs[0].dtype(), 32}, outs[0], Tensor(), nullptr, u64_attr(c, 1),
             u64_attr(c, 2), math::bernoulli_threshold(c.double_attr(0)), 0);
}

void native_dropout_kernel(const OpCall& c, std::span<Tensor> outs) {
  const Tensor& x = c.input(0);
  const bool train = !c.has_attr(1) || c.bool_attr(1);
  if (!train) {
    outs[0].copy_(x);
    outs[1].fill_(true);
    return;
  }
  const DType t = x.dtype();
  const double p = c.double_attr(0);
  KILN_DISPATCH_FLOATING(t, "dropout", [&] {
    using M = host_opmath<scalar_t>;
    const double keep = 1.0 - p;
    const M scale = static_cast<M>(keep == 0.0 ? 0.0 : 1.0 / keep);
    run_random({RandomOp::dropout, t, 32}, outs[0], x.contiguous(), &outs[1], u64_attr(c, 2), u64_attr(c, 3),
               math::bernoulli_threshold(keep), misc_bits(scale));
  });
}

[[maybe_unused]] const bool registered = [] {
#define KILN_RANDOM_KERNEL(name, fn) {name, fn},
  register_kernels(DeviceType::cuda, {KILN_RANDOM_KERNELS(KILN_RANDOM_KERNEL)});
#undef KILN_RANDOM_KERNEL
  return true;
}();

}  // namespace

std::vector<std::pair<std::string, std::string>> random_sources_for_test() {
  std::vector<std::pair<std::string, std::string>> out;
  for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    const int bits = t == kFloat64 ? 64 : 32;
    for (RandomOp op : {RandomOp::uniform, RandomOp::normal, RandomOp::bernoulli, RandomOp::dropout})
      out.emplace_back(std::string(random_op_name(op)) + "_" + cuda_type(t), random_source({op, t, bits}));
    out.emplace_back(std::string("check_probability_") + cuda_type(t), check_probability_source(t));
  }
  for (DType t : {kBool, DType::uint8, DType::int8, kInt32, kInt64, kFloat16, kBFloat16, kFloat32, kFloat64}) {
    for (int bits : {32, 64})
      out.emplace_back(std::string("randint_") + cuda_type(t), random_source({RandomOp::randint, t, bits}));
    out.emplace_back(std::string("bernoulli_scalar_") + cuda_type(t), random_source({RandomOp::bernoulli_scalar, t, 32}));
  }
  return out;
}

}  // namespace kiln::cuda::detail
