// Storage allocation. CPU memory is 64-byte aligned (one cache line, one AVX-512 vector).
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <new>
#include <string>

#include "core/shape.h"
#include "kiln/detail/tensor_impl.h"
#include "kiln/tensor.h"
#include "kiln/error.h"

#ifdef KILN_WITH_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/caching_allocator.h"
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
// Blocks of at least this size are cached: below it malloc is already fast, above it a fresh
// block costs page faults on every first touch (glibc serves large blocks with mmap).
constexpr int64_t kCacheMinBytes = 64 * 1024;

// Rounds a request up to one of 8 classes per power of two (at most 12.5% waste), so that
// blocks of similar sizes are reused.
int64_t size_class(int64_t nbytes) {
  int64_t n = std::max<int64_t>(nbytes, kAlignment);
  int shift = 63 - __builtin_clzll(static_cast<unsigned long long>(n));
  int64_t step = std::max<int64_t>(int64_t{1} << std::max(shift - 3, 0), kAlignment);
  return (n + step - 1) / step * step;
}

// A process-wide cache of freed CPU blocks keyed by size class, like PyTorch's CUDA caching
// allocator but simpler: no splitting, a cap on the cached total, and a kill switch
// (KILN_CPU_CACHING_ALLOCATOR=0) for bisecting memory problems.
class CpuBlockCache {
 public:
  static CpuBlockCache& instance() {
    static CpuBlockCache* cache = new CpuBlockCache();  // leaked: blocks may be freed at exit
    return *cache;
  }

  void* allocate(int64_t cls) {
    if (enabled_) {
      std::lock_guard lock(mutex_);
      auto it = free_.find(cls);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cached_bytes_ -= cls;
        return p;
      }
    }
    return std::aligned_alloc(kAlignment, static_cast<size_t>(cls));
  }

  void release(void* p, int64_t cls) {
    if (enabled_) {
      std::lock_guard lock(mutex_);
      if (cached_bytes_ + cls <= limit_bytes_) {
        free_[cls].push_back(p);
        cached_bytes_ += cls;
        return;
      }
    }
    std::free(p);
  }

  void empty() {
    std::lock_guard lock(mutex_);
    for (auto& [cls, blocks] : free_)
      for (void* p : blocks) std::free(p);
    free_.clear();
    cached_bytes_ = 0;
  }

  int64_t cached_bytes() {
    std::lock_guard lock(mutex_);
    return cached_bytes_;
  }

 private:
  CpuBlockCache() {
    const char* env = std::getenv("KILN_CPU_CACHING_ALLOCATOR");
    enabled_ = !(env && std::string(env) == "0");
  }
  std::mutex mutex_;
  std::unordered_map<int64_t, std::vector<void*>> free_;
  int64_t cached_bytes_ = 0;
  int64_t limit_bytes_ = int64_t{4} << 30;
  bool enabled_ = true;
};

void free_cpu(void* data, void*) { std::free(data); }
void free_cpu_cached(void* data, void* ctx) {
  CpuBlockCache::instance().release(data, static_cast<int64_t>(reinterpret_cast<intptr_t>(ctx)));
}
}  // namespace

namespace {
std::atomic<int64_t> g_cpu_allocations{0};
}  // namespace

int64_t cpu_allocation_count() { return g_cpu_allocations.load(std::memory_order_relaxed); }

void empty_cpu_cache() { CpuBlockCache::instance().empty(); }
int64_t cpu_cached_bytes() { return CpuBlockCache::instance().cached_bytes(); }

std::shared_ptr<Storage> allocate_storage(int64_t nbytes, Device device) {
  KILN_CHECK(nbytes >= 0, ValueError, "[kiln::empty] cannot allocate a negative number of bytes.");
  auto storage = std::make_shared<Storage>();
  storage->nbytes = nbytes;
  storage->device = device;
  if (device.is_cpu()) {
    g_cpu_allocations.fetch_add(1, std::memory_order_relaxed);
    void* p = nullptr;
    if (nbytes >= kCacheMinBytes) {
      int64_t cls = size_class(nbytes);
      p = CpuBlockCache::instance().allocate(cls);
      storage->free_fn = free_cpu_cached;
      storage->free_context = reinterpret_cast<void*>(static_cast<intptr_t>(cls));
    } else {
      // aligned_alloc requires a multiple of the alignment; never allocate 0 bytes.
      int64_t padded = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
      if (padded == 0) padded = kAlignment;
      p = std::aligned_alloc(kAlignment, static_cast<size_t>(padded));
      storage->free_fn = free_cpu;
    }
    if (!p) {
      storage->free_fn = nullptr;
      throw Error("[kiln::empty] out of memory allocating " + std::to_string(nbytes) +
                  " bytes on the CPU. Reduce the tensor size or free other tensors.");
    }
    storage->data = p;
    return storage;
  }
#ifdef KILN_WITH_CUDA
  void* context = nullptr;
  storage->data = cuda::detail::allocate(nbytes, device.index, &context);
  if (context) {
    storage->free_fn = cuda::detail::free_block;
    storage->free_context = context;
  }
  return storage;
#else
  throw DeviceError("[kiln::empty] cannot allocate on " + device.str() +
                    ": this build of Kiln has no CUDA support. Rebuild with the CUDA toolkit installed, or use the CPU.");
#endif
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
  KILN_CHECK(static_cast<int64_t>(sizes.size()) <= kMaxDims, ShapeError,
             "[kiln::Tensor] a tensor has at most " + std::to_string(kMaxDims) + " dimensions (kiln::kMaxDims); this one would have " +
                 std::to_string(sizes.size()) + ".");
  numel = 1;
  for (int64_t s : sizes) numel *= s;
  // Contiguous means row-major; dims of size 1 may have any stride (as in PyTorch), and a tensor
  // without elements is contiguous whatever its strides.
  is_contiguous = numel == 0 || dense_row_major(sizes, strides);
}

}  // namespace detail
}  // namespace kiln
