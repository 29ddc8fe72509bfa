// The CUDA caching allocator: device memory for tensors, reused without cudaMalloc/cudaFree.
//
// Like PyTorch's: requests are rounded up to 512 bytes; small ones (≤ 1 MiB) are carved from
// 2 MiB segments, large ones from segments of at least their size (20 MiB for requests under
// 10 MiB). A freed block goes back to its pool, merged with free neighbours of its segment, and
// is reused by a later request of the same stream: work queued on one stream runs in order, so
// a block freed while kernels that read it are still queued is only overwritten after them.
// A block used on another stream than the one it was allocated on must be kept alive until
// that stream's work is done (the caller synchronizes). When cudaMalloc fails the allocator
// returns every free whole segment to the driver and retries once before throwing.
#pragma once

#include <cstdint>
#include <memory>

namespace kiln::cuda::detail {

// Device memory for `nbytes` on `device`, usable on the current stream. Sets *context to what
// free_block needs. Returns nullptr for 0 bytes. Throws DeviceError when out of memory.
void* allocate(int64_t nbytes, int device, void** context);
// Storage::FreeFn: returns the block to its pool.
void free_block(void* data, void* context);
// The block of `context` (allocate's) stops counting in MemoryStats::allocated, for good: memory a
// CUDA graph owns for its lifetime (its outputs' buffers) counts as reserved only, as PyTorch
// counts its CUDA graph pools. Freeing it later subtracts nothing.
void stop_counting(void* context);

// A private pool for CUDA graph capture. While a PrivatePoolGuard is active on a thread, that
// thread's allocations on the pool's device come from the pool, and blocks allocated there go back
// to it when freed, whenever that happens. A captured graph replays with the addresses it was
// captured with, so its intermediates must not be handed to anyone else between replays: the pool
// keeps them. The pool's memory counts in the device's statistics and returns to the driver once
// the pool is dropped and its last block freed.
class PrivatePool;
std::shared_ptr<PrivatePool> create_private_pool(int device);

// Whether the block of `context` (allocate's) comes from `pool`.
bool allocated_in(const PrivatePool& pool, void* context);

class PrivatePoolGuard {
 public:
  explicit PrivatePoolGuard(std::shared_ptr<PrivatePool> pool);
  ~PrivatePoolGuard();
  PrivatePoolGuard(const PrivatePoolGuard&) = delete;
  PrivatePoolGuard& operator=(const PrivatePoolGuard&) = delete;

 private:
  std::shared_ptr<PrivatePool> pool_;
  PrivatePool* previous_ = nullptr;
};

}  // namespace kiln::cuda::detail
