// Shared pieces of the dispatcher (op_table.cpp) that the compiler's capture also uses.
#pragma once

#include <span>
#include <vector>

#include "kiln/detail/tensor_impl.h"
#include "kiln/op_table.h"

namespace kiln::detail {

// Counts one write of t's memory, as an in-place op's does: for code that writes tensors without
// the dispatcher (fused optimizer kernels, collectives, pure replays). The dispatcher's own count
// also honours WritesAlreadyCounted.
inline void bump_version(const Tensor& t) { t.impl().storage->version.fetch_add(1, std::memory_order_relaxed); }

// The checks an in-place/out= call makes on its targets: the result must have their sizes, be
// castable to their dtype, and live on their device. Throws the eager error messages.
void check_out_targets(const OpDef& op, const std::vector<TensorMeta>& metas, std::span<Tensor> outputs);

// While alive, in-place calls through the dispatcher on this thread leave version counters alone.
// For running what a capture recorded: capture_op/capture_op_out already bumped the versions of
// everything the graph writes, as eager would have, and autograd saved tensors at those versions.
// Counting the writes again when the graph runs (the interpreter, the kiln backend's dispatched
// nodes), or when a result is copied into its lazy value's storage (bind), would make a backward
// report them "modified by an in-place operation".
class WritesAlreadyCounted {
 public:
  WritesAlreadyCounted();
  ~WritesAlreadyCounted();
  WritesAlreadyCounted(const WritesAlreadyCounted&) = delete;
  WritesAlreadyCounted& operator=(const WritesAlreadyCounted&) = delete;

 private:
  bool saved_;
};

}  // namespace kiln::detail
