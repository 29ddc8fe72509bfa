// The CUDA caching allocator (see caching_allocator.h) and its statistics (kiln/cuda.h).
#include "kernels/cuda/caching_allocator.h"

#include <algorithm>
#include <mutex>
#include <set>
#include <tuple>
#include <vector>

#include "kernels/cuda/cuda_runtime.h"

namespace kiln::cuda::detail {

namespace {

constexpr size_t kRound = 512;
constexpr size_t kSmallRequest = size_t{1} << 20;    // ≤ 1 MiB: the small pool
constexpr size_t kSmallSegment = size_t{2} << 20;    // 2 MiB
constexpr size_t kMediumRequest = size_t{10} << 20;  // < 10 MiB: a 20 MiB segment
constexpr size_t kMediumSegment = size_t{20} << 20;
constexpr size_t kLargeRound = size_t{2} << 20;      // larger segments: a multiple of 2 MiB

class DeviceAllocator;

struct Block {
  DeviceAllocator* owner = nullptr;
  int device = 0;
  cudaStream_t stream = nullptr;
  size_t size = 0;
  char* ptr = nullptr;
  bool allocated = false;
  bool small = false;
  Block* prev = nullptr;  // neighbours within one segment
  Block* next = nullptr;
  bool counted = true;  // in MemoryStats::allocated (see stop_counting)
};

struct BlockLess {
  bool operator()(const Block* a, const Block* b) const {
    return std::tie(a->stream, a->size, a->ptr) < std::tie(b->stream, b->size, b->ptr);
  }
};
using Pool = std::set<Block*, BlockLess>;

// Counters of one device, shared by its allocator and its private pools.
struct DeviceStats {
  std::mutex mutex;
  MemoryStats s;
  void add(int64_t MemoryStats::*field, int64_t delta, int64_t MemoryStats::*peak = nullptr) {
    std::lock_guard lock(mutex);
    s.*field += delta;
    if (peak) s.*peak = std::max(s.*peak, s.*field);
  }
};

class DeviceAllocator {
 public:
  DeviceAllocator(int device, DeviceStats* stats) : device_(device), stats_(stats) {}
  ~DeviceAllocator() { release_cached(); }

  Block* allocate(size_t request, cudaStream_t stream) {
    size_t size = std::max(kRound, (request + kRound - 1) / kRound * kRound);
    bool small = size <= kSmallRequest;
    std::lock_guard lock(mutex_);
    Pool& pool = small ? small_ : large_;
    Block key;
    key.stream = stream;
    key.size = size;
    Block* block = nullptr;
    if (auto it = pool.lower_bound(&key); it != pool.end() && (*it)->stream == stream) {
      block = *it;
      pool.erase(it);
    } else {
      block = new_segment(segment_size(size), stream, small);
    }
    // Split off the tail when what remains is worth keeping.
    size_t rest = block->size - size;
    if (rest >= (small ? kRound : kSmallRequest + 1)) {
      auto* tail = new Block{this, device_, stream, rest, block->ptr + size, false, small, block, block->next};
      if (block->next) block->next->prev = tail;
      block->next = tail;
      block->size = size;
      pool.insert(tail);
    }
    block->allocated = true;
    block->counted = true;
    live_blocks_ += 1;
    stats_->add(&MemoryStats::allocated, static_cast<int64_t>(block->size), &MemoryStats::peak_allocated);
    stats_->add(&MemoryStats::allocations, 1);
    return block;
  }

  // Returns whether this was a dropped private pool's last block (the caller then deletes it).
  bool free(Block* block) {
    std::lock_guard lock(mutex_);
    if (block->counted) stats_->add(&MemoryStats::allocated, -static_cast<int64_t>(block->size));
    block->allocated = false;
    live_blocks_ -= 1;
    Pool& pool = block->small ? small_ : large_;
    if (Block* p = block->prev; p && !p->allocated) {  // merge into the free block before
      pool.erase(p);
      p->size += block->size;
      p->next = block->next;
      if (p->next) p->next->prev = p;
      delete block;
      block = p;
    }
    if (Block* n = block->next; n && !n->allocated) {  // absorb the free block after
      pool.erase(n);
      block->size += n->size;
      block->next = n->next;
      if (block->next) block->next->prev = block;
      delete n;
    }
    pool.insert(block);
    return dropped_ && live_blocks_ == 0;
  }

  void stop_counting(Block* block) {
    std::lock_guard lock(mutex_);
    if (!block->allocated || !block->counted) return;
    stats_->add(&MemoryStats::allocated, -static_cast<int64_t>(block->size));
    block->counted = false;
  }

  // A private pool no longer used for new allocations: deleted once its last block is freed.
  bool drop() {
    std::lock_guard lock(mutex_);
    dropped_ = true;
    return live_blocks_ == 0;
  }

  void release_cached() {
    std::lock_guard lock(mutex_);
    release_cached_locked();
  }


 private:
  static size_t segment_size(size_t size) {
    if (size <= kSmallRequest) return kSmallSegment;
    if (size < kMediumRequest) return kMediumSegment;
    return (size + kLargeRound - 1) / kLargeRound * kLargeRound;
  }

  Block* new_segment(size_t bytes, cudaStream_t stream, bool small) {
    DeviceGuard guard(device_);
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      stats_->add(&MemoryStats::oom_retries, 1);
      release_cached_locked();
      err = cudaMalloc(&p, bytes);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw DeviceError("[kiln::empty] CUDA out of memory allocating " + std::to_string(bytes) +
                        " bytes on cuda:" + std::to_string(device_) + " (" + cudaGetErrorString(err) +
                        "). Free tensors, call kiln::cuda::empty_cache(), or use smaller batches.");
    }
    stats_->add(&MemoryStats::reserved, static_cast<int64_t>(bytes), &MemoryStats::peak_reserved);
    stats_->add(&MemoryStats::device_mallocs, 1);
    return new Block{this, device_, stream, bytes, static_cast<char*>(p), false, small, nullptr, nullptr};
  }

  // Frees every cached segment no tensor uses (cudaFree waits for the device's queued work).
  void release_cached_locked() {
    for (Pool* pool : {&small_, &large_}) {
      for (auto it = pool->begin(); it != pool->end();) {
        Block* b = *it;
        if (b->prev || b->next) {
          ++it;
          continue;
        }
        DeviceGuard guard(device_);
        cudaFree(b->ptr);
        stats_->add(&MemoryStats::reserved, -static_cast<int64_t>(b->size));
        it = pool->erase(it);
        delete b;
      }
    }
  }

  int device_;
  DeviceStats* stats_;
  std::mutex mutex_;
  Pool small_, large_;
  int64_t live_blocks_ = 0;
  bool dropped_ = false;
};

struct DeviceState {
  DeviceStats stats;
  DeviceAllocator allocator;
  explicit DeviceState(int device) : allocator(device, &stats) {}
};

DeviceState& state(int device) {
  static std::mutex mutex;
  static auto* all = new std::vector<DeviceState*>();  // leaked: tensors may die at exit
  std::lock_guard lock(mutex);
  if (all->size() <= static_cast<size_t>(device)) all->resize(device + 1, nullptr);
  if (!(*all)[device]) (*all)[device] = new DeviceState(device);
  return *(*all)[device];
}
DeviceAllocator& allocator(int device) { return state(device).allocator; }

thread_local PrivatePool* t_private_pool = nullptr;

}  // namespace

class PrivatePool {
 public:
  explicit PrivatePool(int device) : device(device), allocator(new DeviceAllocator(device, &state(device).stats)) {}
  ~PrivatePool() {
    if (allocator->drop()) delete allocator;  // else the last free_block deletes it
  }
  PrivatePool(const PrivatePool&) = delete;
  PrivatePool& operator=(const PrivatePool&) = delete;
  const int device;
  DeviceAllocator* const allocator;
};

std::shared_ptr<PrivatePool> create_private_pool(int device) {
  check_device(device, "cuda::graph");
  return std::make_shared<PrivatePool>(device);
}

PrivatePoolGuard::PrivatePoolGuard(std::shared_ptr<PrivatePool> pool)
    : pool_(std::move(pool)), previous_(t_private_pool) {
  t_private_pool = pool_.get();
}
PrivatePoolGuard::~PrivatePoolGuard() { t_private_pool = previous_; }

void* allocate(int64_t nbytes, int device, void** context) {
  check_device(device, "empty");
  *context = nullptr;
  if (nbytes == 0) return nullptr;
  DeviceAllocator& a = t_private_pool && t_private_pool->device == device ? *t_private_pool->allocator : allocator(device);
  Block* b = a.allocate(static_cast<size_t>(nbytes), current_stream(device));
  *context = b;
  return b->ptr;
}

bool allocated_in(const PrivatePool& pool, void* context) {
  return context && static_cast<Block*>(context)->owner == pool.allocator;
}

void stop_counting(void* context) {
  if (!context) return;
  auto* b = static_cast<Block*>(context);
  b->owner->stop_counting(b);
}

void free_block(void*, void* context) {
  if (!context) return;
  auto* b = static_cast<Block*>(context);
  DeviceAllocator* owner = b->owner;
  if (owner->free(b)) delete owner;  // a dropped private pool's last block
}

}  // namespace kiln::cuda::detail

namespace kiln::cuda {

MemoryStats memory_stats(int device) {
  device = detail::resolve_device(device, "cuda::memory_stats");
  auto& st = detail::state(device).stats;
  std::lock_guard lock(st.mutex);
  return st.s;
}
int64_t memory_allocated(int device) { return memory_stats(device).allocated; }
int64_t memory_reserved(int device) { return memory_stats(device).reserved; }
int64_t max_memory_allocated(int device) { return memory_stats(device).peak_allocated; }

void reset_peak_memory_stats(int device) {
  device = detail::resolve_device(device, "cuda::reset_peak_memory_stats");
  auto& st = detail::state(device).stats;
  std::lock_guard lock(st.mutex);
  st.s.peak_allocated = st.s.allocated;
  st.s.peak_reserved = st.s.reserved;
}

void empty_cache() {
  for (int d = 0; d < device_count(); ++d) detail::allocator(d).release_cached();
}

}  // namespace kiln::cuda
