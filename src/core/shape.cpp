#include "core/shape.h"

#include <algorithm>

#include "kiln/detail/tensor_impl.h"

namespace kiln {

std::string shape_str(IntArrayRef sizes) {
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(sizes[i]);
  }
  return s + ")";
}

namespace detail {

int64_t wrap_dim(int64_t dim, int64_t ndim, const std::string& op) {
  int64_t n = std::max<int64_t>(ndim, 1);
  if (dim < -n || dim >= n) {
    throw IndexError("[kiln::" + op + "] dimension out of range (expected to be in range of [" +
                     std::to_string(-n) + ", " + std::to_string(n - 1) + "], but got " +
                     std::to_string(dim) + ").");
  }
  return dim < 0 ? dim + n : dim;
}

std::vector<bool> dim_mask(IntArrayRef dims, int64_t ndim, const std::string& op) {
  std::vector<bool> mask(static_cast<size_t>(std::max<int64_t>(ndim, 0)), dims.empty());
  for (int64_t d : dims) {
    int64_t w = wrap_dim(d, ndim, op);
    if (ndim == 0) continue;
    KILN_CHECK(!mask[w], ValueError,
               "[kiln::" + op + "] dim " + std::to_string(w) + " appears multiple times in the list of dims.");
    mask[w] = true;
  }
  return mask;
}

std::vector<int64_t> broadcast_sizes(IntArrayRef a, IntArrayRef b, const std::string& op) {
  size_t n = std::max(a.size(), b.size());
  std::vector<int64_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (da != db && da != 1 && db != 1) {
      throw ShapeError("[kiln::" + op + "] the size of tensor a (" + std::to_string(da) +
                       ") must match the size of tensor b (" + std::to_string(db) +
                       ") at non-singleton dimension " + std::to_string(i) + ". Shapes " +
                       shape_str(a) + " and " + shape_str(b) +
                       " are not broadcastable; reshape or unsqueeze one of them.");
    }
    out[i] = da == 1 ? db : da;
  }
  return out;
}

std::vector<int64_t> broadcast_strides(IntArrayRef sizes, IntArrayRef strides, IntArrayRef target) {
  std::vector<int64_t> out(target.size(), 0);
  size_t off = target.size() - sizes.size();
  for (size_t i = 0; i < sizes.size(); ++i) out[off + i] = sizes[i] == 1 ? 0 : strides[i];
  return out;
}

int64_t checked_numel(IntArrayRef sizes, const std::string& op) {
  int64_t n = 1;
  for (int64_t s : sizes) {
    if (s == 0) return 0;
  }
  for (int64_t s : sizes) {
    if (__builtin_mul_overflow(n, s, &n)) {
      throw ValueError("[kiln::" + op + "] the shape " + shape_str(sizes) +
                       " has more elements than fit in int64.");
    }
  }
  return n;
}

void check_sizes_nonnegative(IntArrayRef sizes, const std::string& op) {
  for (int64_t s : sizes) {
    KILN_CHECK(s >= 0, ValueError,
               "[kiln::" + op + "] sizes must be non-negative, got " + shape_str(sizes) + ".");
  }
}

std::vector<int64_t> infer_size(IntArrayRef shape, int64_t numel, const std::string& op) {
  std::vector<int64_t> out = shape.vec();
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      KILN_CHECK(infer < 0, ShapeError, "[kiln::" + op + "] only one dimension can be inferred (-1).");
      infer = static_cast<int>(i);
    } else {
      KILN_CHECK(out[i] >= 0, ShapeError,
                 "[kiln::" + op + "] invalid shape dimension " + std::to_string(out[i]) + " in " +
                     shape_str(shape) + ".");
      known *= out[i];
    }
  }
  auto fail = [&] {
    return ShapeError("[kiln::" + op + "] shape " + shape_str(shape) +
                      " is invalid for input of size " + std::to_string(numel) + ".");
  };
  if (infer >= 0) {
    if (known == 0 || numel % known != 0) throw fail();
    out[infer] = numel / known;
  } else if (known != numel) {
    throw fail();
  }
  return out;
}

// Follows PyTorch's computeStride: groups of old dims that are contiguous among themselves can
// be split or merged freely.
std::optional<std::vector<int64_t>> compute_view_strides(IntArrayRef old_sizes, IntArrayRef old_strides,
                                          IntArrayRef new_sizes) {
  std::vector<int64_t> new_strides(new_sizes.size());
  if (old_sizes.empty()) {
    std::fill(new_strides.begin(), new_strides.end(), 1);
    return new_strides;
  }
  int64_t numel = 1;
  for (int64_t s : old_sizes) numel *= s;
  if (numel == 0) {
    if (old_sizes == new_sizes) return old_strides.vec();
    std::vector<int64_t> sizes = new_sizes.vec();
    return contiguous_strides(sizes);
  }
  int64_t view_d = static_cast<int64_t>(new_sizes.size()) - 1;
  int64_t chunk_base_stride = old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t tensor_d = static_cast<int64_t>(old_sizes.size()) - 1; tensor_d >= 0; tensor_d--) {
    tensor_numel *= old_sizes[tensor_d];
    if (tensor_d == 0 ||
        (old_sizes[tensor_d - 1] != 1 && old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_sizes[view_d] == 1)) {
        new_strides[view_d] = view_numel * chunk_base_stride;
        view_numel *= new_sizes[view_d];
        view_d--;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (tensor_d > 0) {
        chunk_base_stride = old_strides[tensor_d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return new_strides;
}

// ---- memory formats ----

std::vector<int64_t> channels_last_strides(IntArrayRef sizes) {
  KILN_CHECK(sizes.size() == 4, ShapeError,
             "[kiln::channels_last] channels_last needs a 4-D (N, C, H, W) tensor, got " +
                 std::to_string(sizes.size()) + " dims.");
  const int64_t c = std::max<int64_t>(sizes[1], 1), w = std::max<int64_t>(sizes[3], 1),
                h = std::max<int64_t>(sizes[2], 1);
  return {c * w * h, 1, c * w, c};
}

bool is_channels_last_contiguous(IntArrayRef sizes, IntArrayRef strides) {
  if (sizes.size() != 4) return false;
  for (int64_t s : sizes)
    if (s == 0) return true;
  int64_t expected = 1;
  for (int d : {1, 3, 2, 0}) {  // fastest first
    if (sizes[d] == 1) continue;
    if (strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

bool strides_like_channels_last(IntArrayRef sizes, IntArrayRef strides) {
  if (sizes.size() != 4) return false;
  for (int64_t s : sizes)
    if (s == 0) return false;
  // With one channel, or a 1x1 image, both formats order memory alike: call it contiguous.
  if (sizes[1] == 1 || (sizes[2] == 1 && sizes[3] == 1)) return false;
  // Channels vary fastest, then W, H, N: each dim's stride reaches past the dims inside it.
  int64_t span = 1;
  for (int d : {1, 3, 2, 0}) {
    if (sizes[d] == 1) continue;
    if (strides[d] < span) return false;
    span = strides[d] * sizes[d];
  }
  return true;
}

std::vector<int64_t> format_strides(IntArrayRef sizes, bool channels_last) {
  if (!channels_last || sizes.size() != 4) return {};
  return channels_last_strides(sizes);
}

std::vector<int64_t> strides_following(IntArrayRef like_sizes, IntArrayRef like_strides, IntArrayRef sizes) {
  return format_strides(sizes, sizes.size() == 4 && strides_like_channels_last(like_sizes, like_strides));
}

int64_t storage_span(IntArrayRef sizes, IntArrayRef strides) {
  int64_t span = 1;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return 0;
    span += (sizes[d] - 1) * strides[d];
  }
  return span;
}

int64_t checked_storage_span(IntArrayRef sizes, IntArrayRef strides, const std::string& op) {
  int64_t span = 1;
  bool empty = false, overflow = false;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (strides[d] < 0) {
      throw ValueError("[kiln::" + op + "] strides must be non-negative, got " + shape_str(strides) + ".");
    }
    if (sizes[d] == 0) empty = true;
    int64_t term = 0;
    overflow |= __builtin_mul_overflow(sizes[d] - 1, strides[d], &term) || __builtin_add_overflow(span, term, &span);
  }
  if (empty) return 0;
  if (overflow) {
    throw ValueError("[kiln::" + op + "] sizes " + shape_str(sizes) + " with strides " + shape_str(strides) +
                     " reach further than int64 can count.");
  }
  return span;
}

std::vector<int64_t> memory_order(IntArrayRef strides) {
  std::vector<int64_t> order(strides.size());
  for (size_t d = 0; d < order.size(); ++d) order[d] = static_cast<int64_t>(d);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
  return order;
}

bool dense_row_major(IntArrayRef sizes, IntArrayRef strides) {
  int64_t expected = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    if (sizes[d] == 1) continue;
    if (strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

bool dense_in(IntArrayRef sizes, IntArrayRef strides, const std::vector<int64_t>& order) {
  int64_t expected = 1;
  for (auto d = order.rbegin(); d != order.rend(); ++d) {
    if (sizes[*d] == 1) continue;
    if (strides[*d] != expected) return false;
    expected *= sizes[*d];
  }
  return true;
}

}  // namespace detail
}  // namespace kiln
