// The storage and metadata behind a Tensor handle. Internal: the public API is kiln::Tensor.
//
// Thread safety: a Storage's version counter is atomic; everything else follows the usual rule
// for C++ values (concurrent reads are fine, a write needs exclusive access).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "kiln/device.h"
#include "kiln/dtype.h"

namespace kiln {

namespace autograd {
struct AutogradMeta;
struct Node;
}  // namespace autograd
namespace compiler {
struct LazyValue;
struct DimMarks;
}  // namespace compiler

namespace detail {

struct TensorImpl;
// A lazy value's data was asked for: runs its pending graph (compiler/capture/context.cpp).
void materialize_lazy(const TensorImpl& impl);

// A block of device memory, shared by every view of it.
struct Storage {
  using FreeFn = void (*)(void* data, void* context);

  void* data = nullptr;
  int64_t nbytes = 0;
  Device device;
  FreeFn free_fn = nullptr;  // null: memory not owned (from_blob without a deleter)
  void* free_context = nullptr;
  // Bumped by every in-place write through any view; autograd uses it to detect that a value
  // saved for backward was overwritten. Shared by all views, as in PyTorch.
  std::atomic<uint64_t> version{0};

  Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage() {
    if (free_fn) free_fn(data, free_context);
  }
};

// Allocates `nbytes` on `device` (64-byte aligned on the CPU). Throws on failure. CPU blocks of
// 64 KiB and more come from a cache of freed blocks (see allocator.cpp; disable with
// KILN_CPU_CACHING_ALLOCATOR=0).
std::shared_ptr<Storage> allocate_storage(int64_t nbytes, Device device);
// Frees the cached CPU blocks / reports their total size.
void empty_cpu_cache();
int64_t cpu_cached_bytes();
// CPU allocate_storage calls since the process started (cached blocks included): tests use the
// difference around a call to prove it allocates nothing more than expected.
int64_t cpu_allocation_count();

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  int64_t storage_offset = 0;  // in elements
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;  // in elements
  int64_t numel = 1;
  DType dtype = DType::float32;
  Device device;
  bool is_contiguous = true;
  // A 0-dim tensor made from a host scalar: it takes part in type promotion like a Python
  // number does (it cannot raise the category's width; see type promotion).
  bool is_wrapped_number = false;
  bool requires_grad = false;

  std::shared_ptr<autograd::AutogradMeta> autograd;  // grad, grad_fn, hooks (autograd issue)
  std::shared_ptr<compiler::LazyValue> lazy;         // set while the value is being captured
  // compiler::mark_dynamic / maybe_mark_dynamic / mark_static: read when a call of a compiled
  // function with this tensor as an argument compiles (replaced, never changed in place).
  std::shared_ptr<const compiler::DimMarks> dim_marks;

  // Recomputes numel and is_contiguous after sizes/strides change.
  void refresh_metadata();
  // The address of element 0. A lazy value (captured, not yet computed) runs its graph first.
  void* data() const {
    if (lazy) [[unlikely]] materialize_lazy(*this);
    return static_cast<char*>(storage->data) + storage_offset * itemsize(dtype);
  }
};

// Contiguous (row-major) strides for `sizes`.
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes);

}  // namespace detail
}  // namespace kiln
