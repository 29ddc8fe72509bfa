// copy: strided copy with dtype conversion, the kernel behind copy_, to(), clone, contiguous.
#include <cstring>

#include "kernels/cpu/loops.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cpu {

namespace {

template <class To, class From>
inline To convert(From v) {
  if constexpr (std::is_same_v<To, bool>) {
    return static_cast<opmath_t<From>>(v) != opmath_t<From>(0);
  } else if constexpr (std::is_same_v<From, Half> || std::is_same_v<From, BFloat16>) {
    return static_cast<To>(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, Half> || std::is_same_v<To, BFloat16>) {
    return To(static_cast<float>(v));
  } else {
    return static_cast<To>(v);
  }
}

template <class To, class From>
void copy_typed(const StridedLoop<2>& loop) {
  parallel_for(loop.numel, kGrainSize, [&](int64_t b, int64_t e) {
    loop.run(b, e, [](const std::array<char*, 2>& p, const std::array<int64_t, 2>& st, int64_t n) {
      To* __restrict o = reinterpret_cast<To*>(p[0]);
      const From* __restrict s = reinterpret_cast<const From*>(p[1]);
      if constexpr (std::is_same_v<To, From>) {
        if (st[0] == 1 && st[1] == 1) {
          std::memcpy(o, s, static_cast<size_t>(n) * sizeof(To));
          return;
        }
      }
      if (st[0] == 1 && st[1] == 1) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = convert<To>(s[i]);
      } else {
        for (int64_t i = 0; i < n; ++i) o[i * st[0]] = convert<To>(s[i * st[1]]);
      }
    });
  });
}

void copy_kernel(const OpCall& call, std::span<Tensor> outs) {
  const Tensor& src = call.input(0);
  Tensor& dst = outs[0];
  if (!src.is_cpu()) {
    // A download: copy dispatches on the output's device, and only the GPU's kernel can read
    // GPU memory.
    const Kernel& from_device = call.op->kernels[static_cast<int>(src.device().type)];
    KILN_CHECK(static_cast<bool>(from_device), DeviceError,
               "[kiln::copy] has no kernel for " + src.device().str() + ". This build of Kiln has no CUDA support.");
    return from_device(call, outs);
  }
  StridedLoop<2> loop(dst.sizes(), {&dst, &src});
  KILN_DISPATCH_ALL(dst.dtype(), "copy", [&] {
    using To = scalar_t;
    KILN_DISPATCH_ALL(src.dtype(), "copy", [&] { copy_typed<To, scalar_t>(loop); });
  });
}

void fill_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor& dst = outs[0];
  const Tensor& value = call.input(0);  // 0-dim, already of dst's dtype
  StridedLoop<1> loop(dst.sizes(), {&dst});
  KILN_DISPATCH_ALL(dst.dtype(), "fill", [&] {
    scalar_t v = *static_cast<const scalar_t*>(value.impl().data());
    parallel_for(loop.numel, kGrainSize, [&](int64_t b, int64_t e) {
      loop.run(b, e, [v](const std::array<char*, 1>& p, const std::array<int64_t, 1>& st, int64_t n) {
        scalar_t* o = reinterpret_cast<scalar_t*>(p[0]);
        for (int64_t i = 0; i < n; ++i) o[i * st[0]] = v;
      });
    });
  });
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("copy", DeviceType::cpu, copy_kernel);
  register_kernel("fill", DeviceType::cpu, fill_kernel);
  return true;
}();

}  // namespace

Tensor as_dtype(const Tensor& t, DType d) { return t.dtype() == d ? t : t.to(d); }

}  // namespace kiln::cpu
