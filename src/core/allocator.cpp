// Storage allocation. CPU memory is 64-byte aligned (one cache line, one AVX-512 vector).
#include <cstdlib>
#include <new>
#include <string>

#include "kiln/detail/tensor_impl.h"
#include "kiln/error.h"

#ifdef KILN_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace kiln {

namespace cuda {
int device_count() {
#ifdef KILN_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
#else
  return 0;
#endif
}
bool is_available() { return device_count() > 0; }
}  // namespace cuda

namespace detail {

namespace {
constexpr int64_t kAlignment = 64;
void free_cpu(void* data, void*) { std::free(data); }
}  // namespace

std::shared_ptr<Storage> allocate_storage(int64_t nbytes, Device device) {
  KILN_CHECK(nbytes >= 0, ValueError, "[kiln::empty] cannot allocate a negative number of bytes.");
  auto storage = std::make_shared<Storage>();
  storage->nbytes = nbytes;
  storage->device = device;
  if (device.is_cpu()) {
    // Round up: aligned_alloc requires a multiple of the alignment; never allocate 0 bytes.
    int64_t padded = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
    if (padded == 0) padded = kAlignment;
    void* p = std::aligned_alloc(kAlignment, static_cast<size_t>(padded));
    if (!p) {
      throw Error("[kiln::empty] out of memory allocating " + std::to_string(nbytes) +
                  " bytes on the CPU. Reduce the tensor size or free other tensors.");
    }
    storage->data = p;
    storage->free_fn = free_cpu;
    return storage;
  }
  throw DeviceError("[kiln::empty] cannot allocate on " + device.str() +
                    ": this build of Kiln has no CUDA allocator yet. Use the CPU.");
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t s = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<int64_t>(sizes[i], 1);
  }
  return strides;
}

void TensorImpl::refresh_metadata() {
  numel = 1;
  for (int64_t s : sizes) numel *= s;
  // Contiguous means row-major; dims of size 1 may have any stride (as in PyTorch).
  is_contiguous = true;
  int64_t expected = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    if (sizes[i] == 1) continue;
    if (strides[i] != expected) {
      is_contiguous = numel == 0;
      if (!is_contiguous) break;
    }
    expected *= sizes[i];
  }
}

}  // namespace detail
}  // namespace kiln
