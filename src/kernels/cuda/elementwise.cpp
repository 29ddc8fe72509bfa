// The elementwise kernel generator and launcher (see elementwise.h).
#include "kernels/cuda/elementwise.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "kernels/cuda/cuda_runtime.h"
#include "kernels/cuda/jit.h"
#include "core/iteration_space.h"
#include "core/shape.h"

namespace kiln::cuda::detail {

namespace {

constexpr int kMaxOperands = 8;
constexpr int kMaxDims = 16;
constexpr int kBlock = 256;

// Conversions exactly as the CPU copy kernel's (bool is v != 0; 16-bit floats go through float).
constexpr const char* kPreamble = R"(#include "kiln/math/functors.h"
namespace kj {
using kiln::Half;
using kiln::BFloat16;
template <class T> struct opmath_s { using type = T; };
template <> struct opmath_s<Half> { using type = float; };
template <> struct opmath_s<BFloat16> { using type = float; };
template <class T> using opmath = typename opmath_s<T>::type;
template <class To, class From> __forceinline__ To convert(From v) {
  if constexpr (std::is_same_v<To, bool>) return static_cast<opmath<From>>(v) != opmath<From>(0);
  else if constexpr (std::is_same_v<From, Half> || std::is_same_v<From, BFloat16>) return convert<To>(static_cast<float>(v));
  else if constexpr (std::is_same_v<To, Half> || std::is_same_v<To, BFloat16>) return To(static_cast<float>(v));
  // Floating to narrower integers through int64, as x86 (the CPU kernels) truncates: -5.0 -> uint8 251,
  // where the GPU's direct conversion would saturate to 0.
  else if constexpr (std::is_floating_point_v<From> && std::is_integral_v<To> && sizeof(To) < 8)
    return static_cast<To>(static_cast<long long>(v));
  else return static_cast<To>(v);
}
template <class T> __forceinline__ T load(const char* p) { return *reinterpret_cast<const T*>(p); }
template <class T> __forceinline__ T unpack(unsigned long long bits) { T v; memcpy(&v, &bits, sizeof(T)); return v; }
}
)";

// Operands after dim coalescing: sizes innermost last, byte strides per dim per operand.
struct Layout {
  std::vector<int64_t> sizes;
  std::vector<std::array<int64_t, kMaxOperands>> strides;
  int64_t numel = 1;
};

// The CPU StridedLoop's coalescing (core/iteration_space.h, operand 0 decides the order) in byte
// strides, for any operand count.
Layout coalesce(IntArrayRef shape, const std::vector<const Tensor*>& ops) {
  std::vector<std::vector<int64_t>> bs(ops.size());
  for (size_t k = 0; k < ops.size(); ++k) {
    bs[k] = kiln::detail::broadcast_strides(ops[k]->sizes(), ops[k]->strides(), shape);
    for (auto& s : bs[k]) s *= ops[k]->element_size();
  }
  kiln::detail::IterationSpace space =
      kiln::detail::coalesce_dims(shape, bs, kiln::detail::DimOrder::operands_in_turn);
  Layout l;
  l.numel = space.numel;
  l.sizes = std::move(space.sizes);
  l.strides.resize(l.sizes.size());
  for (size_t d = 0; d < l.sizes.size(); ++d)
    for (size_t k = 0; k < ops.size(); ++k) l.strides[d][k] = space.strides[k][d];
  return l;
}

// Whether every offset of the launch fits 32-bit index math.
bool fits_int32(const Layout& l, size_t nops) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (l.numel > kMax / 2) return false;
  for (size_t k = 0; k < nops; ++k) {
    int64_t extent = 0;
    for (size_t d = 0; d < l.sizes.size(); ++d) extent += (l.sizes[d] - 1) * std::abs(l.strides[d][k]);
    if (extent > kMax / 2) return false;
  }
  return true;
}

struct Signature {
  std::string expr;
  DType out;
  std::vector<DType> storage;  // per input; ignored for host scalars
  std::vector<DType> types;    // per input
  std::vector<bool> host;      // per input: a kernel argument
  std::vector<DType> scalars;  // c<k>'s dtypes
  int ndim = 0;                // 0: flat
  bool i32 = true;
};

std::string generate(const Signature& s) {
  const size_t nin = s.types.size();
  const size_t nops = nin + 1;
  const char* idx = s.i32 ? "int" : "long long";
  std::string src = kPreamble;
  src += fmt::format("struct Params {{\n  char* ptr[{}];\n  {} numel;\n", nops, idx);
  if (s.ndim == 0) src += fmt::format("  {} stride[{}];\n", idx, nops);
  else src += fmt::format("  {0} sizes[{1}];\n  {0} strides[{1}][{2}];\n", idx, s.ndim, nops);
  src += fmt::format("  unsigned long long host[{}];\n  unsigned long long scalar[{}];\n}};\n", std::max<size_t>(nin, 1),
                     std::max<size_t>(s.scalars.size(), 1));
  src += fmt::format("extern \"C\" __global__ void __launch_bounds__({}) kiln_elementwise(Params p) {{\n", kBlock);
  for (size_t k = 0; k < s.scalars.size(); ++k)
    src += fmt::format("  const {0} c{1} = kj::unpack<{0}>(p.scalar[{1}]);\n", cuda_type(s.scalars[k]), k);
  // Host scalars are converted once, outside the loop.
  for (size_t i = 0; i < nin; ++i) {
    if (s.host[i])
      src += fmt::format("  const kj::opmath<{0}> a{1} = static_cast<kj::opmath<{0}>>(kj::unpack<{0}>(p.host[{1}]));\n",
                         cuda_type(s.types[i]), i);
  }
  src += fmt::format("  for ({0} i = blockIdx.x * ({0})blockDim.x + threadIdx.x; i < p.numel; i += ({0})gridDim.x * blockDim.x) {{\n",
                     idx);
  std::vector<std::string> off(nops);
  if (s.ndim == 0) {
    for (size_t k = 0; k < nops; ++k) off[k] = fmt::format("i * p.stride[{}]", k);
  } else {
    src += fmt::format("    {} rem = i", idx);
    for (size_t k = 0; k < nops; ++k) src += fmt::format(", o{} = 0", k);
    src += ";\n";
    for (int d = s.ndim - 1; d >= 0; --d) {
      src += fmt::format("    {{ {0} q = rem / p.sizes[{1}], r = rem - q * p.sizes[{1}]; rem = q;", idx, d);
      for (size_t k = 0; k < nops; ++k) src += fmt::format(" o{0} += r * p.strides[{1}][{0}];", k, d);
      src += " }\n";
    }
    for (size_t k = 0; k < nops; ++k) off[k] = fmt::format("o{}", k);
  }
  for (size_t i = 0; i < nin; ++i) {
    if (s.host[i]) continue;
    src += fmt::format(
        "    const kj::opmath<{0}> a{1} = static_cast<kj::opmath<{0}>>(kj::convert<{0}>(kj::load<{2}>(p.ptr[{3}] + {4})));\n",
        cuda_type(s.types[i]), i, cuda_type(s.storage[i]), i + 1, off[i + 1]);
  }
  src += fmt::format("    *reinterpret_cast<{0}*>(p.ptr[0] + {1}) = static_cast<{0}>({2});\n  }}\n}}\n", cuda_type(s.out),
                     off[0], s.expr);
  return src;
}

std::string signature_key(const Signature& s) {
  std::string key = s.expr;
  key += '|';
  key += static_cast<char>('a' + static_cast<int>(s.out));
  for (size_t i = 0; i < s.types.size(); ++i) {
    key += static_cast<char>('a' + static_cast<int>(s.storage[i]));
    key += static_cast<char>('a' + static_cast<int>(s.types[i]));
    key += s.host[i] ? 'h' : 'd';
  }
  key += '|';
  for (DType t : s.scalars) key += static_cast<char>('a' + static_cast<int>(t));
  key += '|' + std::to_string(s.ndim) + (s.i32 ? "i" : "l");
  return key;
}

// The parameter block, laid out as generate() declares it.
class ParamBlock {
 public:
  template <class T>
  void add(T v) {
    size_t align = alignof(T);
    bytes_.resize((bytes_.size() + align - 1) / align * align);
    size_t at = bytes_.size();
    bytes_.resize(at + sizeof(T));
    std::memcpy(bytes_.data() + at, &v, sizeof(T));
  }
  void* data() {
    bytes_.resize((bytes_.size() + 7) / 8 * 8);
    return bytes_.data();
  }

 private:
  std::vector<unsigned char> bytes_;
};

// The raw bits of a 0-dim CPU tensor converted to `t`.
unsigned long long host_bits(const Tensor& x, DType t) {
  Tensor v = x.dtype() == t ? x : x.to(t);
  unsigned long long bits = 0;
  std::memcpy(&bits, v.impl().data(), static_cast<size_t>(itemsize(t)));
  return bits;
}

}  // namespace

const char* device_preamble() { return kPreamble; }

DType opmath_dtype(DType t) { return t == DType::float16 || t == DType::bfloat16 ? DType::float32 : t; }

std::string Scalars::add(const Scalar& value, DType dtype) {
  DType t = opmath_dtype(dtype);
  unsigned long long b = 0;
  auto put = [&](auto v) { std::memcpy(&b, &v, sizeof v); };
  switch (t) {
    case DType::bool_: put(value.to<bool>()); break;
    case DType::uint8: put(value.to<uint8_t>()); break;
    case DType::int8: put(value.to<int8_t>()); break;
    case DType::int32: put(value.to<int32_t>()); break;
    case DType::int64: put(value.to<int64_t>()); break;
    case DType::float64: put(value.to<double>()); break;
    default: put(value.to<float>()); break;
  }
  types.push_back(t);
  bits.push_back(b);
  return fmt::format("c{}", types.size() - 1);
}

const char* cuda_type(DType t) {
  switch (t) {
    case DType::bool_: return "bool";
    case DType::uint8: return "uint8_t";
    case DType::int8: return "int8_t";
    case DType::int32: return "int32_t";
    case DType::int64: return "int64_t";
    case DType::float16: return "kiln::Half";
    case DType::bfloat16: return "kiln::BFloat16";
    case DType::float32: return "float";
    case DType::float64: return "double";
  }
  return "void";
}

void launch_elementwise(const std::string& op, const std::string& expr, Tensor& out, std::span<const Tensor> inputs,
                        std::span<const DType> types, const Scalars& scalars) {
  if (out.numel() == 0) return;
  KILN_CHECK(inputs.size() + 1 <= kMaxOperands && types.size() == inputs.size(), Error,
             "[kiln::" + op + "] too many operands for the CUDA elementwise kernel. This is a Kiln bug.");
  const int device = out.device().index;
  Signature sig;
  sig.expr = expr;
  sig.out = out.dtype();
  sig.scalars = scalars.types;
  std::vector<const Tensor*> ops = {&out};
  std::vector<unsigned long long> host(std::max<size_t>(inputs.size(), 1), 0);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& x = inputs[i];
    bool is_host = x.device().is_cpu();
    KILN_CHECK(!is_host || x.dim() == 0, DeviceError,
               "[kiln::" + op + "] expected all tensors on " + out.device().str() + ", but found one on the CPU.");
    KILN_CHECK(is_host || x.device() == out.device(), DeviceError,
               "[kiln::" + op + "] expected all tensors on " + out.device().str() + ", but found one on " +
                   x.device().str() + ".");
    sig.storage.push_back(x.dtype());
    sig.types.push_back(types[i]);
    sig.host.push_back(is_host);
    if (is_host) host[i] = host_bits(x, types[i]);
    else ops.push_back(&x);
  }
  Layout l = coalesce(out.sizes(), ops);
  KILN_CHECK(l.sizes.size() <= kMaxDims, ShapeError,
             "[kiln::" + op + "] CUDA kernels take tensors of at most " + std::to_string(kMaxDims) +
                 " non-mergeable dims. Make the operands contiguous first.");
  sig.i32 = fits_int32(l, ops.size());
  bool flat = l.sizes.size() <= 1;
  sig.ndim = flat ? 0 : static_cast<int>(l.sizes.size());
  std::string key = signature_key(sig);
  JitFunction f = jit_function(device, key, "kiln_elementwise", [&] { return generate(sig); });

  // Pointer slots follow the kernel's numbering: slot 0 the output, slot i + 1 input i.
  const int nops = static_cast<int>(inputs.size()) + 1;
  std::vector<char*> ptr(nops, nullptr);
  std::vector<int> slot_of_op;  // ops index -> slot
  ptr[0] = static_cast<char*>(out.impl().data());
  slot_of_op.push_back(0);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (sig.host[i]) continue;
    ptr[i + 1] = static_cast<char*>(inputs[i].impl().data());
    slot_of_op.push_back(static_cast<int>(i) + 1);
  }
  ParamBlock p;
  for (char* q : ptr) p.add(q);
  auto add_index = [&](int64_t v) {
    if (sig.i32) p.add(static_cast<int32_t>(v));
    else p.add(static_cast<int64_t>(v));
  };
  add_index(l.numel);
  auto stride_of = [&](size_t d, int slot) {
    for (size_t k = 0; k < slot_of_op.size(); ++k)
      if (slot_of_op[k] == slot) return l.strides[d][k];
    return int64_t{0};
  };
  if (flat) {
    for (int s = 0; s < nops; ++s) add_index(l.sizes.empty() ? 0 : stride_of(0, s));
  } else {
    for (int64_t size : l.sizes) add_index(size);
    for (size_t d = 0; d < l.sizes.size(); ++d)
      for (int s = 0; s < nops; ++s) add_index(stride_of(d, s));
  }
  for (unsigned long long h : host) p.add(h);
  if (scalars.bits.empty()) p.add(0ull);
  for (unsigned long long v : scalars.bits) p.add(v);

  DeviceGuard guard(device);
  const cudaDeviceProp& props = properties(device);
  int64_t blocks = std::min<int64_t>((l.numel + kBlock - 1) / kBlock, int64_t{props.multiProcessorCount} * 16);
  void* args[] = {p.data()};
  launch(f, static_cast<unsigned>(blocks), kBlock, 0, current_stream(device), args);
}

std::vector<std::string> elementwise_sources_for_test(const std::string& expr, DType out,
                                                      std::span<const DType> input_storage,
                                                      std::span<const DType> types, std::span<const DType> scalar_types) {
  std::vector<std::string> sources;
  for (int ndim : {0, 3}) {
    Signature s;
    s.expr = expr;
    s.out = out;
    s.storage.assign(input_storage.begin(), input_storage.end());
    s.types.assign(types.begin(), types.end());
    s.host.assign(types.size(), false);
    if (!s.host.empty() && ndim == 3) s.host.back() = true;  // one wrapped-number operand
    s.scalars.assign(scalar_types.begin(), scalar_types.end());
    s.ndim = ndim;
    sources.push_back(generate(s));
  }
  return sources;
}

}  // namespace kiln::cuda::detail
