// Tensor::index and Tensor::index_put_: NumPy/PyTorch index expressions.
//
// Integers, Slice, None and Ellipsis are applied first as views (select, slice, unsqueeze), so
// an expression of only those returns a view sharing storage. Index tensors (int64/int32, or
// bool/uint8 masks spanning one dim per mask dim) are collected per dim of that view and handed
// to the advanced-indexing ops (index / index_put), which copy. As in PyTorch, integers are basic
// indices: x.index({0, Slice(), idx}) puts idx's dims where the remaining ones are.
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln {

namespace detail {
// Defined in index.cpp.
Tensor& index_put_inplace(Tensor& self, const std::vector<Tensor>& indices, const Tensor& values, bool accumulate);
}  // namespace detail

namespace {

bool is_mask(const Tensor& t) { return t.dtype() == kBool || t.dtype() == kUInt8; }

// The view left by the basic indices, and the index tensors for it in PyTorch's slot form (a
// k-dim mask takes one slot but stands for k dims; see detail::expand_index_masks).
struct Sliced {
  Tensor view;
  std::vector<Tensor> tensor_indices;
  bool has_tensor = false;
  bool sliced = false;  // a basic index changed the view (otherwise it covers self as is)
};

Sliced apply_slicing(const Tensor& self, const std::vector<TensorIndex>& indices) {
  int64_t specified = 0;
  int ellipses = 0;
  for (const TensorIndex& ix : indices) {
    const auto& v = ix.value();
    if (std::holds_alternative<int64_t>(v) || std::holds_alternative<Slice>(v)) {
      ++specified;
    } else if (const Tensor* t = std::get_if<Tensor>(&v)) {
      KILN_CHECK(t->defined(), ValueError, "[kiln::index] an index tensor is undefined.");
      specified += is_mask(*t) ? t->dim() : 1;
    } else if (std::holds_alternative<EllipsisIndex>(v)) {
      ++ellipses;
    }
  }
  KILN_CHECK(ellipses <= 1, IndexError, "[kiln::index] an index can only have a single ellipsis ('...').");
  if (self.dim() == 0 && !indices.empty()) {
    const auto& v = indices[0].value();
    bool integer = std::holds_alternative<int64_t>(v);
    if (const Tensor* t = std::get_if<Tensor>(&v)) integer = t->dim() == 0 && is_integral(t->dtype());
    KILN_CHECK(!integer, IndexError,
               "[kiln::index] invalid index of a 0-dim tensor. Use `tensor.item<T>()` to convert a 0-dim "
               "tensor to a number.");
  }
  KILN_CHECK(specified <= self.dim(), IndexError,
             "[kiln::index] too many indices for tensor of dimension " + std::to_string(self.dim()) + ".");

  Sliced s;
  Tensor result = self;
  int64_t dim = 0;       // dim of `result` the next index applies to
  int64_t real_dim = 0;  // dim of `self` it came from (for messages)
  int64_t covered = 0;   // dims of `result` the slots in tensor_indices stand for
  auto record = [&](Tensor t, int64_t span) {
    while (covered < dim) {
      s.tensor_indices.emplace_back();
      ++covered;
    }
    s.tensor_indices.push_back(std::move(t));
    covered += span;
    s.has_tensor = true;
  };
  auto select_int = [&](int64_t i) {
    int64_t n = result.sizes()[dim];
    KILN_CHECK(i >= -n && i < n, IndexError,
               "[kiln::index] index " + std::to_string(i) + " is out of bounds for dimension " +
                   std::to_string(real_dim) + " with size " + std::to_string(n) + ".");
    result = result.select(dim, i);
    ++real_dim;
  };
  for (const TensorIndex& ix : indices) {
    const auto& v = ix.value();
    if (const int64_t* i = std::get_if<int64_t>(&v)) {
      select_int(*i);
    } else if (const Slice* sl = std::get_if<Slice>(&v)) {
      KILN_CHECK(sl->step > 0, ValueError,
                 "[kiln::index] step must be greater than zero, got " + std::to_string(sl->step) + ".");
      result = result.slice(dim, sl->start, sl->stop, sl->step);
      ++dim;
      ++real_dim;
    } else if (std::holds_alternative<NoneIndex>(v)) {
      result = result.unsqueeze(dim);
      ++dim;
    } else if (std::holds_alternative<EllipsisIndex>(v)) {
      dim += self.dim() - specified;
      real_dim += self.dim() - specified;
    } else {
      const Tensor& t = std::get<Tensor>(v);
      if (t.dim() == 0 && is_integral(t.dtype(), /*include_bool=*/true)) {
        if (!is_mask(t)) {
          select_int(t.item<int64_t>());
        } else {
          // A boolean adds a dim of size 1, indexed as 0: when true and as empty when false.
          result = result.unsqueeze(dim);
          bool on = t.item<bool>();
          record(on ? zeros({1}, TensorOptions(kInt64, self.device())) : empty({0}, TensorOptions(kInt64, self.device())), 1);
          ++dim;
        }
      } else {
        int64_t span = is_mask(t) ? t.dim() : 1;
        record(t, span);
        dim += span;
        real_dim += span;
      }
    }
  }
  s.sliced = !result.same(self);
  s.view = s.sliced ? result : view(self, self.sizes());
  return s;
}

// Strips leading size-1 dims of a value (PyTorch's slicePrefix1sSize), so x[0] = t of shape
// (1, 3) works for a row of 3.
Tensor strip_leading_ones(const Tensor& v) {
  int64_t k = 0;
  while (k < v.dim() && v.sizes()[k] == 1) ++k;
  if (k == 0) return v;
  return v.view(std::vector<int64_t>(v.sizes().begin() + k, v.sizes().end()));
}

}  // namespace

Tensor Tensor::index(std::initializer_list<TensorIndex> indices) const {
  return index(std::vector<TensorIndex>(indices));
}

Tensor Tensor::index(const std::vector<TensorIndex>& indices) const {
  Sliced s = apply_slicing(*this, indices);
  if (!s.has_tensor) return s.view;
  return kiln::index(s.view, s.tensor_indices);
}

// Writes go into self itself when no basic index narrowed it, so that autograd records them on
// self (an in-place op on a view does not reach its base's history).
Tensor& Tensor::index_put_(const std::vector<TensorIndex>& indices, const Tensor& value) {
  Sliced s = apply_slicing(*this, indices);
  Tensor& target = s.sliced ? s.view : *this;
  Tensor v = strip_leading_ones(value);
  if (!s.has_tensor) {
    target.copy_(v);
  } else {
    detail::index_put_inplace(target, s.tensor_indices, v, false);
  }
  return *this;
}

Tensor& Tensor::index_put_(const std::vector<TensorIndex>& indices, Scalar value) {
  Sliced s = apply_slicing(*this, indices);
  Tensor& target = s.sliced ? s.view : *this;
  if (!s.has_tensor) {
    target.fill_(value);
  } else {
    detail::index_put_inplace(target, s.tensor_indices, detail::wrap_scalar(value, dtype(), device()), false);
  }
  return *this;
}

}  // namespace kiln
