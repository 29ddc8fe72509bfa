// copy and fill on CUDA: host <-> device transfers, device copies with dtype conversion, fills.
//
// copy is dispatched on its output's device, so this kernel serves every copy that reads or
// writes GPU memory (the CPU copy kernel forwards a copy whose source is on a GPU here).
// Transfers move dense bytes with cudaMemcpyAsync; whatever needs a layout or dtype change is
// done on the side that has the kernel for it (the GPU for uploads and device copies, the CPU
// for downloads), through a dense staging tensor.
#include <cstring>

#include "kernels/cuda/cuda_runtime.h"
#include "kernels/cuda/elementwise.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cuda::detail {

namespace {

// Whether `t`'s elements fill [data, data + numel * itemsize) exactly once, in some order.
bool is_dense(const Tensor& t) {
  return t.is_contiguous() || kiln::detail::dense_in(t.sizes(), t.strides(), kiln::detail::memory_order(t.strides()));
}

// Same dtype, dense, and the same strides wherever sizes exceed 1: a byte copy is element-exact.
bool byte_copyable(const Tensor& dst, const Tensor& src) {
  if (dst.dtype() != src.dtype() || dst.sizes() != src.sizes() || !is_dense(dst) || !is_dense(src)) return false;
  for (int64_t d = 0; d < dst.dim(); ++d)
    if (dst.sizes()[d] != 1 && dst.strides()[d] != src.strides()[d]) return false;
  return true;
}

// The lowest address of a dense tensor's elements (strides are non-negative here).
const char* dense_begin(const Tensor& t) { return static_cast<const char*>(t.impl().data()); }

void memcpy_async(void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind, int device) {
  if (bytes == 0) return;
  DeviceGuard guard(device);
  check(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), kind, current_stream(device)), "copy");
}

// GPU -> GPU (one device), any layout and dtype.
void device_copy(Tensor& dst, const Tensor& src) {
  if (byte_copyable(dst, src)) {
    memcpy_async(dst.impl().data(), dense_begin(src), dst.numel() * dst.element_size(), cudaMemcpyDeviceToDevice,
                 dst.device().index);
    return;
  }
  Tensor in[1] = {src};
  DType types[1] = {dst.dtype()};
  launch_elementwise("copy", "a0", dst, in, types);
}

void upload(Tensor& dst, const Tensor& src) {
  if (capturing(dst.device().index)) {
    // While a CUDA graph records, a copy from host memory is replayed from that address later,
    // long after the source (often a staging tensor) is gone. One value (a host scalar, such as
    // a fused relu backward's threshold) becomes a fill whose kernel arguments carry it; anything
    // larger cannot be recorded (the graph then runs normally).
    KILN_CHECK(src.numel() == 1, Error,
               "[kiln::copy] a host-to-device copy of " + std::to_string(src.numel()) +
                   " elements cannot be recorded into a CUDA graph: the replay would read the host memory again.");
    Tensor in[1] = {src.reshape({}).to(dst.dtype())};
    DType types[1] = {dst.dtype()};
    launch_elementwise("fill", "a0", dst, in, types);
    return;
  }
  if (byte_copyable(dst, src)) {
    memcpy_async(dst.impl().data(), dense_begin(src), dst.numel() * dst.element_size(), cudaMemcpyHostToDevice,
                 dst.device().index);
    // Pageable host memory: the copy has been staged before cudaMemcpyAsync returns, so `src`
    // may change or die afterwards.
    return;
  }
  // Convert and lay out on the CPU as dst wants when dst is dense; otherwise upload src's values
  // densely and scatter them on the GPU.
  if (is_dense(dst)) {
    Tensor staged = kiln::detail::make_empty_strided(dst.sizes().vec(), dst.strides().vec(), dst.dtype(), kCPU);
    staged.copy_(src);
    upload(dst, staged);
    return;
  }
  Tensor dense = src.contiguous();
  Tensor on_device = kiln::detail::make_empty(dense.sizes().vec(), dense.dtype(), dst.device());
  upload(on_device, dense);
  device_copy(dst, on_device);
}

void download(Tensor& dst, const Tensor& src) {
  if (byte_copyable(dst, src)) {
    int device = src.device().index;
    memcpy_async(dst.impl().data(), dense_begin(src), dst.numel() * dst.element_size(), cudaMemcpyDeviceToHost, device);
    DeviceGuard guard(device);
    check(cudaStreamSynchronize(current_stream(device)), "copy");
    return;
  }
  // Make a dense copy on the GPU (converting there when src is dense already), bring it over,
  // then let the CPU kernel place it.
  Tensor dense = src;
  if (!is_dense(src)) {
    dense = kiln::detail::make_empty(src.sizes().vec(), src.dtype(), src.device());
    device_copy(dense, src);
  }
  Tensor host = kiln::detail::make_empty_strided(dense.sizes().vec(), dense.strides().vec(), dense.dtype(), kCPU);
  download(host, dense);
  dst.copy_(host);
}

void copy_kernel(const OpCall& call, std::span<Tensor> outs) {
  const Tensor& src = call.input(0);
  Tensor& dst = outs[0];
  if (dst.numel() == 0) return;
  if (dst.is_cuda() && src.is_cuda()) {
    if (dst.device() == src.device()) return device_copy(dst, src);
    // Between GPUs: through a dense buffer on the destination.
    Tensor dense = src.contiguous();
    Tensor staged = kiln::detail::make_empty(dense.sizes().vec(), dense.dtype(), dst.device());
    {
      DeviceGuard guard(src.device().index);
      check(cudaStreamSynchronize(current_stream(src.device().index)), "copy");
    }
    DeviceGuard guard(dst.device().index);
    check(cudaMemcpyPeerAsync(staged.impl().data(), dst.device().index, dense.impl().data(), src.device().index,
                              static_cast<size_t>(dense.numel() * dense.element_size()), current_stream(dst.device().index)),
          "copy");
    return device_copy(dst, staged);
  }
  if (dst.is_cuda()) return upload(dst, src);
  download(dst, src);
}

void fill_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor& dst = outs[0];
  if (dst.numel() == 0) return;
  const Tensor& value = call.input(0);  // 0-dim
  Tensor v = value.is_cuda() ? value.to(kCPU) : value;
  // Zero bits fill a dense tensor with one memset.
  Tensor bits = v.dtype() == dst.dtype() ? v : v.to(dst.dtype());
  bool zero = true;
  const auto* b = static_cast<const unsigned char*>(bits.impl().data());
  for (int64_t i = 0; i < bits.element_size(); ++i) zero &= b[i] == 0;
  if (zero && is_dense(dst)) {
    DeviceGuard guard(dst.device().index);
    check(cudaMemsetAsync(dst.impl().data(), 0, static_cast<size_t>(dst.numel() * dst.element_size()),
                          current_stream(dst.device().index)),
          "fill");
    return;
  }
  Tensor in[1] = {bits};
  DType types[1] = {dst.dtype()};
  launch_elementwise("fill", "a0", dst, in, types);
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("copy", DeviceType::cuda, copy_kernel);
  register_kernel("fill", DeviceType::cuda, fill_kernel);
  return true;
}();

}  // namespace

}  // namespace kiln::cuda::detail
