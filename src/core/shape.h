// Shape helpers shared by meta functions: dim wrapping, broadcasting, size checks.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kiln/array_ref.h"
#include "kiln/error.h"

namespace kiln::detail {

// Wraps a possibly negative dim into [0, ndim). A 0-dim tensor accepts dims -1 and 0.
int64_t wrap_dim(int64_t dim, int64_t ndim, const std::string& op);
// Wraps and checks a list of dims, rejecting repeats. Empty means all dims.
std::vector<bool> dim_mask(IntArrayRef dims, int64_t ndim, const std::string& op);

// The broadcast shape of a and b.
std::vector<int64_t> broadcast_sizes(IntArrayRef a, IntArrayRef b, const std::string& op);
// Strides of a tensor of (sizes, strides) viewed as broadcast to `target` (0 for broadcast dims).
std::vector<int64_t> broadcast_strides(IntArrayRef sizes, IntArrayRef strides, IntArrayRef target);

// Product of sizes; throws when it overflows int64.
int64_t checked_numel(IntArrayRef sizes, const std::string& op);
// Rejects negative sizes.
void check_sizes_nonnegative(IntArrayRef sizes, const std::string& op);

// Resolves a single -1 in a view/reshape target shape against numel.
std::vector<int64_t> infer_size(IntArrayRef shape, int64_t numel, const std::string& op);

// Strides for viewing (sizes, strides) as new_sizes without copying, or nullopt if impossible.
std::optional<std::vector<int64_t>> compute_view_strides(IntArrayRef old_sizes, IntArrayRef old_strides,
                                          IntArrayRef new_sizes);

// Elements that a layout of `sizes` and non-negative `strides` spans, from its first element to
// one past its last (what its storage must hold after the offset); 0 when it has no elements.
int64_t storage_span(IntArrayRef sizes, IntArrayRef strides);
// storage_span for layouts from outside (as_strided, empty_strided, DLPack): throws ValueError
// naming `op` when a stride is negative or the span does not fit in int64.
int64_t checked_storage_span(IntArrayRef sizes, IntArrayRef strides, const std::string& op);

// Whether (sizes, strides) is dense row-major: each stride the product of the sizes inside it
// (dims of size 1 may have any stride). TensorImpl::is_contiguous is this, or no elements.
bool dense_row_major(IntArrayRef sizes, IntArrayRef strides);

// ---- memory formats (4-D only) ----
// Strides of a dense channels-last (NHWC) tensor of `sizes`.
std::vector<int64_t> channels_last_strides(IntArrayRef sizes);
// Whether (sizes, strides) are exactly channels-last (dims of size 1 may have any stride).
bool is_channels_last_contiguous(IntArrayRef sizes, IntArrayRef strides);
// Whether the strides order the dims as channels-last does (C, W, H, N from fastest), whether
// dense or not. Ambiguous layouts (a C of 1, all of H and W 1, ...) count as contiguous, as in
// PyTorch.
bool strides_like_channels_last(IntArrayRef sizes, IntArrayRef strides);
// The strides an output of `sizes` gets in `format`: empty (contiguous) unless channels_last
// on a 4-D shape.
std::vector<int64_t> format_strides(IntArrayRef sizes, bool channels_last);
// The layout of a new 4-D result of `sizes` that follows `like` (conv, batch norm, pooling):
// channels-last strides when `like` is 4-D and suggests channels_last, else empty (contiguous).
std::vector<int64_t> strides_following(IntArrayRef like_sizes, IntArrayRef like_strides, IntArrayRef sizes);
// The dims from the largest stride to the smallest (ties keep dim order): the memory order.
std::vector<int64_t> memory_order(IntArrayRef strides);
// Whether sizes/strides fill one block laid out in `order` (outermost first); size-1 dims may
// have any stride.
bool dense_in(IntArrayRef sizes, IntArrayRef strides, const std::vector<int64_t>& order);

}  // namespace kiln::detail
