// Eager CUDA kernels of the range factories (arange, linspace, eye) and of cat and
// constant_pad_nd. The CPU kernels (src/kernels/cpu/range_kernels.cpp, shape_kernels.cpp) are
// the reference: the range kernels do the same arithmetic in the same types (no contraction), so
// their values equal the CPU's bit for bit.
//
// cat copies each input into its slice of the output: when the output and an input are dense in
// the same dim order and share a dtype, the slice is one block of bytes per outer row, and one
// launch of kiln_cat moves the rows of up to kCatInputs such inputs (a DenseNet layer's
// concatenation of a dozen feature maps is one launch, not a dozen cudaMemcpy2DAsync calls, each
// of which costs more host time than a launch); other inputs go through the strided, converting
// device copy (out.narrow(dim, offset, len).copy_(input)). The output's layout (channels-last or
// not) is the meta's.
#include <algorithm>

#include <fmt/format.h>

#include "kernels/kernel_args.h"
#include "kernels/cuda/cuda_runtime.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/jit.h"
#include "kernels/cuda/misc_kernels.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cuda::detail {

namespace {

using kiln::detail::make_empty;

template <class T>
constexpr bool is_reduced_float = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

template <class T>
using host_opmath = std::conditional_t<is_reduced_float<T>, float, T>;

// Rounds an opmath value to T and back, as the CPU's linspace does.
template <class T>
host_opmath<T> round_to(host_opmath<T> v) {
  if constexpr (is_reduced_float<T>) return static_cast<float>(T(v));
  else return v;
}

enum class Range { arange_int, arange_float, linspace_int, linspace_float, eye };

const char* range_name(Range r) {
  switch (r) {
    case Range::arange_int: return "arange_int";
    case Range::arange_float: return "arange_float";
    case Range::linspace_int: return "linspace_int";
    case Range::linspace_float: return "linspace_float";
    case Range::eye: return "eye";
  }
  return "";
}

std::string range_source(Range r, DType t) {
  std::string body;
  switch (r) {
    case Range::arange_int:
      body = "out[i] = static_cast<scalar_t>(p.a + p.b * static_cast<unsigned long long>(i));";
      break;
    case Range::arange_float:
      // The CPU's accumulate type: float for float16/bfloat16, double otherwise.
      body = fmt::format(
          "typedef {0} ar_t;\n"
          "    out[i] = static_cast<scalar_t>(kj::unpack<ar_t>(p.a) + kj::unpack<ar_t>(p.b) * static_cast<ar_t>(i));",
          t == kFloat16 || t == kBFloat16 ? "float" : "double");
      break;
    case Range::linspace_int:
      body = "const double start = kj::unpack<double>(p.a), end = kj::unpack<double>(p.b), step = kj::unpack<double>(p.c);\n"
             "    const double v = p.steps == 1 ? start\n"
             "                   : i < p.halfway ? start + step * static_cast<double>(i)\n"
             "                                   : end - step * static_cast<double>(p.steps - i - 1);\n"
             "    out[i] = static_cast<scalar_t>(static_cast<long long>(v));";
      break;
    case Range::linspace_float:
      body = "const acc_t start = kj::unpack<acc_t>(p.a), end = kj::unpack<acc_t>(p.b), step = kj::unpack<acc_t>(p.c);\n"
             "    const acc_t v =\n"
             "        p.steps == 1 ? start\n"
             "        : i < p.halfway ? start + kj::round_to<scalar_t>(step * kj::round_to<scalar_t>(static_cast<acc_t>(i)))\n"
             "                        : end - kj::round_to<scalar_t>(step * kj::round_to<scalar_t>(static_cast<acc_t>(p.steps - i - 1)));\n"
             "    out[i] = static_cast<scalar_t>(v);";
      break;
    case Range::eye:
      body = "const long long row = i / p.cols;\n"
             "    out[i] = kj::from_int<scalar_t>(i - row * p.cols == row ? 1 : 0);";
      break;
  }
  return misc_preamble() + fmt::format(R"(
typedef {t} scalar_t;
typedef kj::opmath<scalar_t> acc_t;
struct Params {{
  scalar_t* out;
  long long n, cols, steps, halfway;
  unsigned long long a, b, c;
}};
extern "C" __global__ void __launch_bounds__({block}) kiln_range(Params p) {{
  scalar_t* out = p.out;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n; i += (long long)gridDim.x * blockDim.x) {{
    {body}
  }}
}}
)",
                                                  fmt::arg("t", cuda_type(t)), fmt::arg("block", kMiscBlock),
                                                  fmt::arg("body", body));
}

struct RangeArgs {
  int64_t cols = 0, steps = 0, halfway = 0;
  unsigned long long a = 0, b = 0, c = 0;
};

// Fills `out` (through a contiguous buffer when it is a strided view) with kiln_range.
void run_range(Range r, Tensor& out, const RangeArgs& args) {
  const int64_t n = out.numel();
  if (n == 0) return;
  Tensor buf = out.is_contiguous() ? out : make_empty(out.sizes().vec(), out.dtype(), out.device());
  const DType t = out.dtype();
  const int device = out.device().index;
  JitFunction f = jit_function(device, fmt::format("{}|{}", range_name(r), cuda_type(t)), "kiln_range",
                               [&] { return range_source(r, t); });
  MiscParams p;
  p.add(buf.impl().data());
  p.add(n);
  p.add(args.cols);
  p.add(args.steps);
  p.add(args.halfway);
  p.add(args.a);
  p.add(args.b);
  p.add(args.c);
  launch_misc(f, n, device, p, range_name(r));
  if (!buf.same(out)) out.copy_(buf);
}

void arange_kernel(const OpCall& c, std::span<Tensor> outs) {
  KILN_DISPATCH_NUMERIC(outs[0].dtype(), "arange", [&] {
    RangeArgs args;
    if constexpr (std::is_integral_v<scalar_t>) {
      args.a = static_cast<uint64_t>(c.scalar_attr(0).to_int());
      args.b = static_cast<uint64_t>(c.scalar_attr(2).to_int());
      run_range(Range::arange_int, outs[0], args);
    } else {
      using Acc = std::conditional_t<is_reduced_float<scalar_t>, float, double>;
      args.a = misc_bits(static_cast<Acc>(c.scalar_attr(0).to_double()));
      args.b = misc_bits(static_cast<Acc>(c.scalar_attr(2).to_double()));
      run_range(Range::arange_float, outs[0], args);
    }
  });
}

void linspace_kernel(const OpCall& c, std::span<Tensor> outs) {
  const double start_d = c.scalar_attr(0).to_double(), end_d = c.scalar_attr(1).to_double();
  KILN_DISPATCH_NUMERIC(outs[0].dtype(), "linspace", [&] {
    const int64_t steps = outs[0].numel();
    RangeArgs args;
    args.steps = steps;
    args.halfway = steps / 2;
    if constexpr (std::is_integral_v<scalar_t>) {
      const scalar_t start = static_cast<scalar_t>(static_cast<int64_t>(start_d));
      const scalar_t end = static_cast<scalar_t>(static_cast<int64_t>(end_d));
      const double step =
          steps > 1 ? (static_cast<double>(end) - static_cast<double>(start)) / static_cast<double>(steps - 1) : 0.0;
      args.a = misc_bits(static_cast<double>(start));
      args.b = misc_bits(static_cast<double>(end));
      args.c = misc_bits(step);
      run_range(Range::linspace_int, outs[0], args);
    } else {
      using M = host_opmath<scalar_t>;
      const M start = static_cast<M>(static_cast<scalar_t>(start_d));
      const M end = static_cast<M>(static_cast<scalar_t>(end_d));
      // Each operation rounds to T, like PyTorch's scalar_t arithmetic.
      const M step = steps > 1 ? round_to<scalar_t>(round_to<scalar_t>(end - start) /
                                                    round_to<scalar_t>(static_cast<M>(steps - 1)))
                               : M(0);
      args.a = misc_bits(start);
      args.b = misc_bits(end);
      args.c = misc_bits(step);
      run_range(Range::linspace_float, outs[0], args);
    }
  });
}

void eye_kernel(const OpCall&, std::span<Tensor> outs) {
  RangeArgs args;
  args.cols = outs[0].sizes()[1];
  run_range(Range::eye, outs[0], args);
}

// ---------------- cat / constant_pad_nd ----------------

constexpr int kCatInputs = 120;  // per launch: the parameter block stays under 4 KB

struct CatParams {
  char* dst;
  long long out_row_units, outer;
  const char* src[kCatInputs];
  long long row_units[kCatInputs];  // units per outer row of input i
  long long dst_offset[kCatInputs];  // units from a row's start to input i's slice
};
static_assert(sizeof(CatParams) <= 4096, "a kernel's parameters must fit 4 KB");

// Moves `Unit`s (16 bytes when every address and row length allows, else the element size):
// blockIdx.y picks the input, the x blocks stride over its outer * row_units units.
std::string cat_source(int unit) {
  const char* type = unit == 16 ? "uint4" : unit == 8 ? "unsigned long long" : unit == 4 ? "unsigned" : unit == 2 ? "unsigned short" : "unsigned char";
  return fmt::format(R"(typedef {0} Unit;
struct Params {{ char* dst; long long out_row_units, outer; const char* src[{1}]; long long row_units[{1}]; long long dst_offset[{1}]; }};
extern "C" __global__ void __launch_bounds__(256) kiln_cat(Params p) {{
  const int i = blockIdx.y;
  const long long row = p.row_units[i], total = row * p.outer;
  const Unit* src = reinterpret_cast<const Unit*>(p.src[i]);
  Unit* dst = reinterpret_cast<Unit*>(p.dst) + p.dst_offset[i];
  for (long long u = blockIdx.x * 256ll + threadIdx.x; u < total; u += gridDim.x * 256ll) {{
    const long long r = u / row;
    dst[r * p.out_row_units + (u - r * row)] = src[u];
  }}
}}
)",
                     type, kCatInputs);
}

// An input whose rows move as blocks of bytes: row_bytes from src to offset_bytes into each
// output row.
struct CatRowInput {
  const char* src;
  int64_t row_bytes, offset_bytes;
};

// One launch per kCatInputs inputs, each copying its rows into every one of `outer` rows of
// out_row_bytes at out_base.
void launch_cat(int device, char* out_base, int64_t out_row_bytes, int64_t outer, const std::vector<CatRowInput>& inputs) {
  if (inputs.empty()) return;
  int unit = 16;
  auto fits = [&](int64_t v) { return v % unit == 0; };
  auto aligned = [&](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(unit) == 0; };
  auto all_fit = [&] {
    if (!aligned(out_base) || !fits(out_row_bytes)) return false;
    for (const CatRowInput& in : inputs)
      if (!aligned(in.src) || !fits(in.row_bytes) || !fits(in.offset_bytes)) return false;
    return true;
  };
  while (unit > 1 && !all_fit()) unit /= 2;
  JitFunction f = jit_function(device, "cat|" + std::to_string(unit), "kiln_cat", [&] { return cat_source(unit); });
  DeviceGuard guard(device);
  const int64_t max_blocks = int64_t{properties(device).multiProcessorCount} * 8;
  for (size_t first = 0; first < inputs.size(); first += kCatInputs) {
    CatParams p{};
    p.dst = out_base;
    p.out_row_units = out_row_bytes / unit;
    p.outer = outer;
    const size_t n = std::min<size_t>(kCatInputs, inputs.size() - first);
    int64_t most = 0;
    for (size_t k = 0; k < n; ++k) {
      const CatRowInput& in = inputs[first + k];
      p.src[k] = in.src;
      p.row_units[k] = in.row_bytes / unit;
      p.dst_offset[k] = in.offset_bytes / unit;
      most = std::max<int64_t>(most, p.row_units[k] * outer);
    }
    const int64_t blocks = std::clamp<int64_t>((most + 255) / 256, 1, std::max<int64_t>(1, max_blocks / static_cast<int64_t>(n)));
    void* args[] = {&p};
    launch_grid(f, static_cast<unsigned>(blocks), static_cast<unsigned>(n), 256, 0, current_stream(device), args);
  }
}

void cat_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  // Rows: the dims outside `dim` in out's memory order; each row holds every input's slice.
  const std::optional<kiln::detail::CatRows> rows = kiln::detail::cat_layout(call, out);
  if (!rows) return;
  const int64_t dim = rows->dim, isz = out.element_size();
  const std::vector<int64_t>& order = rows->order;
  const bool out_dense = rows->out_dense;
  const int64_t outer = rows->outer, inner = rows->inner, out_row_bytes = rows->out_row_bytes;
  char* out_base = static_cast<char*>(out.impl().data());
  const int device = out.device().index;

  std::vector<CatRowInput> row_inputs;
  int64_t offset = 0;
  for (const Tensor& t : call.inputs) {
    if (t.numel() == 0) continue;  // contributes no elements (legacy empty or size 0 along dim)
    const int64_t len = t.sizes()[dim];
    const bool rows = out_dense && t.dtype() == out.dtype() && t.device() == out.device() &&
                      kiln::detail::dense_in(t.sizes(), t.strides(), order);
    if (rows) {
      row_inputs.push_back({static_cast<const char*>(t.impl().data()), len * inner * isz, offset * inner * isz});
    } else {
      out.narrow(dim, offset, len).copy_(t);
    }
    offset += len;
  }
  launch_cat(device, out_base, out_row_bytes, outer, row_inputs);
}

// constant_pad_nd: fill with the value, then copy the (possibly cropped) input into its window.
void constant_pad_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  const Tensor& x = call.input(0);
  IntArrayRef pad = call.ints_attr(0);
  if (out.numel() == 0) return;
  out.fill_(call.scalar_attr(1));
  Tensor dst = out, src = x;
  const int64_t npad = static_cast<int64_t>(pad.size()) / 2;
  for (int64_t i = 0; i < npad; ++i) {
    const int64_t d = x.dim() - 1 - i;
    const int64_t l = pad[2 * i], r = pad[2 * i + 1];
    const int64_t len = x.sizes()[d] + std::min<int64_t>(l, 0) + std::min<int64_t>(r, 0);
    if (len <= 0) return;  // everything cropped away: the output is all padding
    src = src.narrow(d, std::max<int64_t>(-l, 0), len);
    dst = dst.narrow(d, std::max<int64_t>(l, 0), len);
  }
  if (src.numel() > 0) dst.copy_(src);
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("arange", DeviceType::cuda, arange_kernel);
  register_kernel("linspace", DeviceType::cuda, linspace_kernel);
  register_kernel("eye", DeviceType::cuda, eye_kernel);
  register_kernel("cat", DeviceType::cuda, cat_kernel);
  register_kernel("constant_pad_nd", DeviceType::cuda, constant_pad_kernel);
  return true;
}();

}  // namespace

std::vector<std::pair<std::string, std::string>> shape_sources_for_test() {
  std::vector<std::pair<std::string, std::string>> out;
  for (DType t : {DType::uint8, DType::int8, kInt32, kInt64}) {
    out.emplace_back(std::string("arange_") + cuda_type(t), range_source(Range::arange_int, t));
    out.emplace_back(std::string("linspace_") + cuda_type(t), range_source(Range::linspace_int, t));
  }
  for (DType t : {kFloat16, kBFloat16, kFloat32, kFloat64}) {
    out.emplace_back(std::string("arange_") + cuda_type(t), range_source(Range::arange_float, t));
    out.emplace_back(std::string("linspace_") + cuda_type(t), range_source(Range::linspace_float, t));
  }
  for (DType t : {kBool, DType::uint8, DType::int8, kInt32, kInt64, kFloat16, kBFloat16, kFloat32, kFloat64})
    out.emplace_back(std::string("eye_") + cuda_type(t), range_source(Range::eye, t));
  for (int unit : {1, 2, 4, 8, 16}) out.emplace_back("cat_" + std::to_string(unit), cat_source(unit));
  return out;
}

}  // namespace kiln::cuda::detail
