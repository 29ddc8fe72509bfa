// CPU kernels for the indexing ops: index_select, gather, scatter (src / value), scatter_add,
// index, index_put, embedding, one_hot.
//
// Every kernel first copies its index tensors into contiguous int64 buffers and checks every
// value (serially or with a flag from the parallel pass), so an IndexError is thrown before
// anything is written and never from inside an OpenMP region. Element moves that do not need
// arithmetic copy raw bits by item size; scatter_add and accumulating index_put compute in
// opmath precision.
#include <algorithm>
#include <atomic>
#include <cstring>

#include "kernels/cpu/loops.h"
#include "ops/index_plan.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cpu {

// Defined in index_backward_kernels.cpp.
void accumulate_rows(Tensor& out, const Tensor& values, int64_t dim, const Tensor& idx, bool zero_init,
                     int64_t skip, bool scale_by_freq);

namespace {

constexpr int64_t kCopyGrainBytes = 1 << 16;

// ---------------- index validation ----------------

// A contiguous int64 copy of `index` (or `index` itself when it already is one) whose values are
// all in [0, size) — negatives in [-size, 0) are wrapped first when `wrap` is set. Throws
// IndexError naming the first bad value.
Tensor checked_index(const Tensor& index, int64_t size, int64_t dim, bool wrap, const std::string& op) {
  Tensor idx = as_dtype(index, kInt64).contiguous();
  const int64_t n = idx.numel();
  const int64_t* p = n ? static_cast<const int64_t*>(idx.impl().data()) : nullptr;
  const int64_t lo = wrap ? -size : 0;
  std::atomic<bool> bad{false}, negative{false};
  parallel_for(n, kGrainSize, [&](int64_t b, int64_t e) {
    bool any_bad = false, any_neg = false;
    for (int64_t i = b; i < e; ++i) {
      any_bad |= p[i] < lo || p[i] >= size;
      any_neg |= p[i] < 0;
    }
    if (any_bad) bad.store(true, std::memory_order_relaxed);
    if (any_neg) negative.store(true, std::memory_order_relaxed);
  });
  if (bad.load()) {
    for (int64_t i = 0; i < n; ++i) {
      KILN_CHECK(p[i] >= lo && p[i] < size, IndexError,
                 "[kiln::" + op + "] index " + std::to_string(p[i]) + " is out of bounds for dimension " +
                     std::to_string(dim) + " with size " + std::to_string(size) + ".");
    }
  }
  if (wrap && negative.load()) {
    Tensor w = detail::make_empty({n}, kInt64, kCPU);
    int64_t* q = static_cast<int64_t*>(w.impl().data());
    parallel_for(n, kGrainSize, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) q[i] = p[i] < 0 ? p[i] + size : p[i];
    });
    return w.view(idx.sizes());
  }
  return idx;
}

using kiln::detail::IndexPlan;

// plan_index's check on the CPU: bounds-checked int64 indices, negatives wrapped.
auto cpu_index_check(const std::string& op) {
  return [op](const Tensor& index, int64_t size, int64_t dim) { return checked_index(index, size, dim, true, op); };
}

// ---------------- a counter over a shape, keeping one element offset per operand ----------------

class OffsetCounter {
 public:
  // strides[k][d]: element stride of operand k along dim d of `sizes`.
  OffsetCounter(std::vector<int64_t> sizes, std::vector<std::vector<int64_t>> strides)
      : sizes_(std::move(sizes)), strides_(std::move(strides)), idx_(sizes_.size(), 0), off_(strides_.size(), 0) {}

  int64_t count() const {
    int64_t n = 1;
    for (int64_t s : sizes_) n *= s;
    return n;
  }
  void seek(int64_t linear) {
    std::fill(off_.begin(), off_.end(), 0);
    for (int64_t d = static_cast<int64_t>(sizes_.size()) - 1; d >= 0; --d) {
      idx_[d] = linear % sizes_[d];
      linear /= sizes_[d];
      for (size_t k = 0; k < off_.size(); ++k) off_[k] += idx_[d] * strides_[k][d];
    }
  }
  void next() {
    for (int64_t d = static_cast<int64_t>(sizes_.size()) - 1; d >= 0; --d) {
      for (size_t k = 0; k < off_.size(); ++k) off_[k] += strides_[k][d];
      if (++idx_[d] < sizes_[d]) return;
      for (size_t k = 0; k < off_.size(); ++k) off_[k] -= sizes_[d] * strides_[k][d];
      idx_[d] = 0;
    }
  }
  int64_t offset(size_t k) const { return off_[k]; }

 private:
  std::vector<int64_t> sizes_;
  std::vector<std::vector<int64_t>> strides_;
  std::vector<int64_t> idx_;
  std::vector<int64_t> off_;
};

// Raw element type of a given size, for moves that need no arithmetic.
template <class F>
void dispatch_itemsize(int64_t isz, F&& f) {
  switch (isz) {
    case 1: return f(uint8_t{});
    case 2: return f(uint16_t{});
    case 4: return f(uint32_t{});
    case 8: return f(uint64_t{});
    default: throw Error("[kiln::index] unsupported element size " + std::to_string(isz) + ".");
  }
}

// ---------------- index_select (rows of a contiguous source) ----------------

// out (contiguous, shape x.sizes with [dim] = n) = x.index_select(dim, idx); x contiguous,
// idx checked.
void select_rows(const Tensor& x, int64_t dim, const int64_t* idx, int64_t n, Tensor& out) {
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= x.sizes()[d];
  for (int64_t d = dim + 1; d < x.dim(); ++d) inner *= x.sizes()[d];
  const int64_t size = x.sizes()[dim];
  const int64_t isz = x.element_size();
  const char* src = static_cast<const char*>(x.impl().data());
  char* dst = static_cast<char*>(out.impl().data());
  const int64_t rows = outer * n;
  if (inner == 1) {
    dispatch_itemsize(isz, [&](auto tag) {
      using T = decltype(tag);
      const T* s = reinterpret_cast<const T*>(src);
      T* d = reinterpret_cast<T*>(dst);
      parallel_for(rows, kGrainSize, [&](int64_t b, int64_t e) {
        int64_t o = b / n, j = b % n;
        for (int64_t r = b; r < e;) {
          const T* so = s + o * size;
          int64_t stop = std::min(e, r + (n - j));
          for (; r < stop; ++r, ++j) d[r] = so[idx[j]];
          j = 0;
          ++o;
        }
      });
    });
    return;
  }
  const int64_t row_bytes = inner * isz;
  parallel_for(rows, std::max<int64_t>(1, kCopyGrainBytes / row_bytes), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      int64_t o = r / n, j = r % n;
      std::memcpy(dst + r * row_bytes, src + (o * size + idx[j]) * row_bytes, static_cast<size_t>(row_bytes));
    }
  });
}

// ---------------- gather / scatter core ----------------

enum class Mode { gather, scatter, scatter_add };

// For every position p of the iteration shape (the index's):
//   gather:       other[p] = indexed[p with p[dim] := index[p]]
//   scatter(_add): indexed[p with p[dim] := index[p]] (+)= other[p]
// Scatter walks whole lines along `dim` per thread, so no two threads write one element.
struct ScatterGather {
  std::vector<int64_t> sizes;
  int64_t dim = 0;
  char* indexed = nullptr;
  std::vector<int64_t> indexed_strides;  // the entry for `dim` is replaced by index * dim_stride
  int64_t dim_stride = 0;
  const int64_t* index = nullptr;
  std::vector<int64_t> index_strides;
  char* other = nullptr;
  std::vector<int64_t> other_strides;
};

template <class T, Mode M>
void scatter_gather_run(const ScatterGather& a) {
  const int64_t nd = static_cast<int64_t>(a.sizes.size());
  const int64_t inner_dim = M == Mode::gather ? nd - 1 : a.dim;
  std::vector<int64_t> osizes;
  std::vector<std::vector<int64_t>> ostrides(3);
  for (int64_t d = 0; d < nd; ++d) {
    if (d == inner_dim) continue;
    osizes.push_back(a.sizes[d]);
    ostrides[0].push_back(d == a.dim ? 0 : a.indexed_strides[d]);
    ostrides[1].push_back(a.index_strides[d]);
    ostrides[2].push_back(a.other_strides[d]);
  }
  const int64_t n_inner = a.sizes[inner_dim];
  const int64_t s_indexed = inner_dim == a.dim ? 0 : a.indexed_strides[inner_dim];
  const int64_t s_index = a.index_strides[inner_dim];
  const int64_t s_other = a.other_strides[inner_dim];
  const int64_t dstride = a.dim_stride;
  const OffsetCounter outer(osizes, ostrides);
  const int64_t total = outer.count();
  if (total == 0 || n_inner == 0) return;
  parallel_for(total, std::max<int64_t>(1, kGrainSize / n_inner), [&](int64_t b, int64_t e) {
    OffsetCounter c = outer;
    c.seek(b);
    for (int64_t p = b; p < e; ++p, c.next()) {
      T* pi = reinterpret_cast<T*>(a.indexed) + c.offset(0);
      const int64_t* px = a.index + c.offset(1);
      T* po = reinterpret_cast<T*>(a.other) + c.offset(2);
      for (int64_t k = 0; k < n_inner; ++k) {
        T* target = pi + k * s_indexed + px[k * s_index] * dstride;
        T* o = po + k * s_other;
        if constexpr (M == Mode::gather) {
          *o = *target;
        } else if constexpr (M == Mode::scatter) {
          *target = *o;
        } else {
          *target = static_cast<T>(static_cast<opmath_t<T>>(*target) + static_cast<opmath_t<T>>(*o));
        }
      }
    }
  });
}

// Views a 0-dim tensor as shape (1,) so the loops see at least one dim (PyTorch's
// ensure_nonempty_dim).
Tensor at_least_1d(const Tensor& t) { return t.dim() == 0 ? t.view({1}) : t; }

std::vector<int64_t> strides_of(const Tensor& t) { return t.strides().vec(); }

// ---------------- kernels ----------------

void index_select_kernel(const OpCall& call, std::span<Tensor> outs) {
  const Tensor& x = call.input(0);
  Tensor& result = outs[0];
  const int64_t dim = detail::wrap_dim(call.int_attr(0), x.dim(), "index_select");
  const int64_t size = x.dim() == 0 ? 1 : x.sizes()[dim];
  Tensor idx = checked_index(call.input(1).reshape({-1}), size, dim, false, "index_select");
  if (result.numel() == 0) return;
  if (x.dim() == 0) {
    result.copy_(x);
    return;
  }
  Tensor out = result.is_contiguous() ? result : detail::make_empty(result.sizes().vec(), result.dtype(), kCPU);
  const int64_t* ip = static_cast<const int64_t*>(idx.impl().data());
  if (x.is_contiguous()) {
    select_rows(x, dim, ip, idx.numel(), out);
  } else {
    ScatterGather a;
    a.sizes = out.sizes().vec();
    a.dim = dim;
    a.indexed = static_cast<char*>(x.impl().data());
    a.indexed_strides = strides_of(x);
    a.dim_stride = x.strides()[dim];
    a.index = ip;
    a.index_strides.assign(a.sizes.size(), 0);
    a.index_strides[dim] = 1;
    a.other = static_cast<char*>(out.impl().data());
    a.other_strides = strides_of(out);
    dispatch_itemsize(x.element_size(), [&](auto tag) { scatter_gather_run<decltype(tag), Mode::gather>(a); });
  }
  if (!out.same(result)) result.copy_(out);
}

void gather_kernel(const OpCall& call, std::span<Tensor> outs) {
  const Tensor x = at_least_1d(call.input(0));
  Tensor& result = outs[0];
  const int64_t dim = detail::wrap_dim(call.int_attr(0), call.input(0).dim(), "gather");
  const Tensor& index = call.input(1);
  Tensor idx = at_least_1d(checked_index(index, x.sizes()[dim], dim, false, "gather"));
  if (result.numel() == 0) return;
  Tensor out = at_least_1d(result);
  ScatterGather a;
  a.sizes = idx.sizes().vec();
  a.dim = dim;
  a.indexed = static_cast<char*>(x.impl().data());
  a.indexed_strides = strides_of(x);
  a.dim_stride = x.strides()[dim];
  a.index = static_cast<const int64_t*>(idx.impl().data());
  a.index_strides = strides_of(idx);
  a.other = static_cast<char*>(out.impl().data());
  a.other_strides = strides_of(out);
  dispatch_itemsize(x.element_size(), [&](auto tag) { scatter_gather_run<decltype(tag), Mode::gather>(a); });
}

// scatter / scatter.value / scatter_add: out = self, then out[... index ...] (+)= src.
void scatter_kernel(const OpCall& call, std::span<Tensor> outs, Mode mode, bool value_form) {
  const Tensor& self = call.input(0);
  Tensor& result = outs[0];
  const int64_t dim = detail::wrap_dim(call.int_attr(0), self.dim(), call.name());
  const std::string op = mode == Mode::scatter_add ? "scatter_add" : "scatter";
  Tensor idx = at_least_1d(checked_index(call.input(1), self.dim() == 0 ? 1 : self.sizes()[dim], dim, false, op));
  if (!(result.same(self))) result.copy_(self);
  if (idx.numel() == 0) return;
  Tensor out = at_least_1d(result);
  Tensor src = value_form ? detail::wrap_scalar(call.scalar_attr(1), self.dtype()) : at_least_1d(call.input(2));
  ScatterGather a;
  a.sizes = idx.sizes().vec();
  a.dim = dim;
  a.indexed = static_cast<char*>(out.impl().data());
  a.indexed_strides = strides_of(out);
  a.dim_stride = out.strides()[dim];
  a.index = static_cast<const int64_t*>(idx.impl().data());
  a.index_strides = strides_of(idx);
  a.other = static_cast<char*>(src.impl().data());
  a.other_strides = value_form ? std::vector<int64_t>(a.sizes.size(), 0) : strides_of(src);
  if (mode == Mode::scatter_add) {
    KILN_DISPATCH_ALL(self.dtype(), "scatter_add", [&] { scatter_gather_run<scalar_t, Mode::scatter_add>(a); });
  } else {
    dispatch_itemsize(self.element_size(), [&](auto tag) { scatter_gather_run<decltype(tag), Mode::scatter>(a); });
  }
}

// ---------------- index / index_put ----------------

// The result's layout comes from detail::plan_index (ops/index_plan.h, shared with CUDA).

// The strides of `t` (self or the output) over the result shape: 0 along the broadcast dims.
std::vector<int64_t> restride(const Tensor& t, const IndexPlan& plan) {
  std::vector<int64_t> st;
  for (int64_t d : plan.self_dim_of) st.push_back(d >= 0 ? t.strides()[d] : 0);
  return st;
}

// Walks the result shape: f(offset into the indexed tensor incl. index terms, other offset).
// `indexed` is self (index) or the output (index_put); `other` is the result (index) or the
// broadcast values (index_put).
template <class F>
void walk_index(const IndexPlan& plan, const Tensor& indexed, const std::vector<int64_t>& other_strides,
                bool parallel, F&& f) {
  const int64_t nr = static_cast<int64_t>(plan.result_sizes.size());
  const size_t nk = plan.idx.size();
  std::vector<int64_t> sizes = plan.result_sizes;
  std::vector<std::vector<int64_t>> strides{restride(indexed, plan), other_strides};
  for (const auto& s : plan.idx_strides) strides.push_back(s);
  // Inner loop over the last dim, outer counter over the rest.
  int64_t inner = nr > 0 ? sizes.back() : 1;
  std::vector<int64_t> inner_strides(strides.size(), 0);
  if (nr > 0) {
    for (size_t k = 0; k < strides.size(); ++k) {
      inner_strides[k] = strides[k].back();
      strides[k].pop_back();
    }
    sizes.pop_back();
  }
  std::vector<const int64_t*> ptrs(nk);
  std::vector<int64_t> dim_strides(nk);
  for (size_t k = 0; k < nk; ++k) {
    ptrs[k] = static_cast<const int64_t*>(plan.idx[k].impl().data());
    dim_strides[k] = indexed.strides()[plan.dims[k]];
  }
  const OffsetCounter outer(sizes, strides);
  const int64_t total = outer.count();
  if (total == 0 || inner == 0) return;
  auto body = [&](int64_t b, int64_t e) {
    OffsetCounter c = outer;
    c.seek(b);
    for (int64_t p = b; p < e; ++p, c.next()) {
      for (int64_t j = 0; j < inner; ++j) {
        int64_t off = c.offset(0) + j * inner_strides[0];
        for (size_t k = 0; k < nk; ++k) off += ptrs[k][c.offset(2 + k) + j * inner_strides[2 + k]] * dim_strides[k];
        f(off, c.offset(1) + j * inner_strides[1]);
      }
    }
  };
  if (parallel) parallel_for(total, std::max<int64_t>(1, kGrainSize / inner), body);
  else body(0, total);
}

void index_kernel(const OpCall& call, std::span<Tensor> outs) {
  const Tensor& self = call.input(0);
  Tensor& result = outs[0];
  detail::IndexPlan plan = detail::plan_index(self, call.inputs.subspan(1), "index", cpu_index_check("index"));
  if (result.numel() == 0) return;
  // One index tensor (with adjacent placement, trivially): rows of a contiguous self.
  if (plan.idx.size() == 1 && self.is_contiguous() && result.is_contiguous()) {
    Tensor rows = result.view([&] {
      std::vector<int64_t> s = self.sizes().vec();
      s[plan.dims[0]] = plan.idx[0].numel();
      return s;
    }());
    select_rows(self, plan.dims[0], static_cast<const int64_t*>(plan.idx[0].impl().data()), plan.idx[0].numel(),
                rows);
    return;
  }
  const char* src = static_cast<const char*>(self.impl().data());
  char* dst = static_cast<char*>(result.impl().data());
  dispatch_itemsize(self.element_size(), [&](auto tag) {
    using T = decltype(tag);
    const T* s = reinterpret_cast<const T*>(src);
    T* d = reinterpret_cast<T*>(dst);
    walk_index(plan, self, result.strides().vec(), true, [&](int64_t so, int64_t ro) { d[ro] = s[so]; });
  });
}

// out[..., idx[j], ...] (+)= values[..., j, ...] for one index tensor at `dim` of a contiguous
// out and full-shaped contiguous values (the embedding-backward pattern). Work is split over
// outer rows and column ranges, so each element is written by one thread, in index order:
// deterministic, and repeated indices accumulate exactly.
void put_rows(Tensor& out, int64_t dim, const Tensor& idx, const Tensor& values, bool accumulate) {
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= out.sizes()[d];
  for (int64_t d = dim + 1; d < out.dim(); ++d) inner *= out.sizes()[d];
  const int64_t size = out.sizes()[dim], n = idx.numel();
  const int64_t* ip = static_cast<const int64_t*>(idx.impl().data());
  if (outer == 0 || inner == 0 || n == 0) return;
  const int64_t pieces = std::clamp<int64_t>(inner / 1024, 1, 4 * std::max(1, omp_get_max_threads()));
  const int64_t piece = (inner + pieces - 1) / pieces;
  const int64_t items = outer * pieces;
  const int64_t grain = std::max<int64_t>(1, items * kGrainSize / std::max<int64_t>(outer * n * inner, 1));
  auto run = [&](auto* o, const auto* v, auto&& op) {
    parallel_for(items, grain, [&](int64_t b, int64_t e) {
      for (int64_t it = b; it < e; ++it) {
        int64_t row = it / pieces, lo = (it % pieces) * piece, hi = std::min(inner, lo + piece);
        for (int64_t j = 0; j < n; ++j) {
          auto* dst = o + (row * size + ip[j]) * inner;
          const auto* src = v + (row * n + j) * inner;
#pragma omp simd
          for (int64_t c = lo; c < hi; ++c) op(dst[c], src[c]);
        }
      }
    });
  };
  if (accumulate && is_floating_point(out.dtype())) {
    // Bucketed by target row: parallel over rows however few outer rows there are (the
    // embedding / index backward pattern, outer == 1).
    accumulate_rows(out, values, dim, idx, /*zero_init=*/false, /*skip=*/-1, /*scale_by_freq=*/false);
    return;
  }
  if (accumulate) {
    KILN_DISPATCH_ALL(out.dtype(), "index_put", [&] {
      using T = scalar_t;
      run(static_cast<T*>(out.impl().data()), static_cast<const T*>(values.impl().data()), [](T& a, T b) {
        a = static_cast<T>(static_cast<opmath_t<T>>(a) + static_cast<opmath_t<T>>(b));
      });
    });
  } else {
    dispatch_itemsize(out.element_size(), [&](auto tag) {
      using T = decltype(tag);
      run(static_cast<T*>(out.impl().data()), static_cast<const T*>(values.impl().data()), [](T& a, T b) { a = b; });
    });
  }
}

void index_put_kernel(const OpCall& call, std::span<Tensor> outs) {
  const Tensor& self = call.input(0);
  const Tensor& values = call.input(1);  // inputs: self, values, indices...
  const bool accumulate = call.bool_attr(0);
  Tensor& out = outs[0];
  detail::IndexPlan plan = detail::plan_index(self, call.inputs.subspan(2), "index_put", cpu_index_check("index_put"));
  if (!out.same(self)) out.copy_(self);
  const char* vbase = static_cast<const char*>(values.impl().data());
  char* obase = static_cast<char*>(out.impl().data());
  if (plan.idx.size() == 1 && out.is_contiguous() && values.is_contiguous() &&
      values.sizes() == IntArrayRef(plan.result_sizes)) {
    put_rows(out, plan.dims[0], plan.idx[0], values, accumulate);
    return;
  }
  const std::vector<int64_t> vstrides = detail::broadcast_strides(values.sizes(), values.strides(), plan.result_sizes);
  if (!accumulate) {
    // Repeated indices: one of the values wins (unspecified which, as in PyTorch).
    dispatch_itemsize(self.element_size(), [&](auto tag) {
      using T = decltype(tag);
      const T* v = reinterpret_cast<const T*>(vbase);
      T* o = reinterpret_cast<T*>(obase);
      walk_index(plan, out, vstrides, true, [&](int64_t oo, int64_t vo) { o[oo] = v[vo]; });
    });
    return;
  }
  // Accumulate: serial, so repeated indices add up exactly once each (like PyTorch's CPU kernel).
  KILN_DISPATCH_ALL(self.dtype(), "index_put", [&] {
    using T = scalar_t;
    const T* v = reinterpret_cast<const T*>(vbase);
    T* o = reinterpret_cast<T*>(obase);
    walk_index(plan, out, vstrides, false, [&](int64_t oo, int64_t vo) {
      o[oo] = static_cast<T>(static_cast<opmath_t<T>>(o[oo]) + static_cast<opmath_t<T>>(v[vo]));
    });
  });
}

// ---------------- embedding / one_hot ----------------

void embedding_kernel(const OpCall& call, std::span<Tensor> outs) {
  const Tensor& weight = call.input(0);
  Tensor& result = outs[0];
  const int64_t rows = weight.sizes()[0];
  Tensor idx = checked_index(call.input(1).reshape({-1}), rows, 0, false, "embedding");
  if (result.numel() == 0) return;
  Tensor out = result.is_contiguous() ? result : detail::make_empty(result.sizes().vec(), result.dtype(), kCPU);
  Tensor flat = out.view({idx.numel(), weight.sizes()[1]});
  Tensor w = weight.contiguous();
  select_rows(w, 0, static_cast<const int64_t*>(idx.impl().data()), idx.numel(), flat);
  if (!out.same(result)) result.copy_(out);
}

void one_hot_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor idx = call.input(0).contiguous();
  Tensor& result = outs[0];
  const int64_t classes = call.int_attr(0);
  const int64_t n = idx.numel();
  const int64_t* p = n ? static_cast<const int64_t*>(idx.impl().data()) : nullptr;
  for (int64_t i = 0; i < n; ++i) {
    KILN_CHECK(p[i] >= 0, IndexError, "[kiln::one_hot] Class values must be non-negative (got " + std::to_string(p[i]) + ").");
    KILN_CHECK(p[i] < classes, IndexError,
               "[kiln::one_hot] Class values must be smaller than num_classes (got " + std::to_string(p[i]) +
                   " for " + std::to_string(classes) + " classes).");
  }
  Tensor out = result.is_contiguous() ? result : detail::make_empty(result.sizes().vec(), kInt64, kCPU);
  if (out.numel() > 0) {
    int64_t* o = static_cast<int64_t*>(out.impl().data());
    parallel_for(n, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(classes, 1)), [&](int64_t b, int64_t e) {
      std::memset(o + b * classes, 0, static_cast<size_t>((e - b) * classes) * sizeof(int64_t));
      for (int64_t i = b; i < e; ++i) o[i * classes + p[i]] = 1;
    });
  }
  if (!out.same(result)) result.copy_(out);
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("index_select", DeviceType::cpu, index_select_kernel);
  register_kernel("gather", DeviceType::cpu, gather_kernel);
  register_kernel("scatter", DeviceType::cpu,
                  [](const OpCall& c, std::span<Tensor> o) { scatter_kernel(c, o, Mode::scatter, false); });
  register_kernel("scatter.value", DeviceType::cpu,
                  [](const OpCall& c, std::span<Tensor> o) { scatter_kernel(c, o, Mode::scatter, true); });
  register_kernel("scatter_add", DeviceType::cpu,
                  [](const OpCall& c, std::span<Tensor> o) { scatter_kernel(c, o, Mode::scatter_add, false); });
  register_kernel("index", DeviceType::cpu, index_kernel);
  register_kernel("index_put", DeviceType::cpu, index_put_kernel);
  register_kernel("embedding", DeviceType::cpu, embedding_kernel);
  register_kernel("one_hot", DeviceType::cpu, one_hot_kernel);
  return true;
}();

}  // namespace

// The nonzero positions of a CPU bool/uint8 mask, in row-major order: one int64 tensor per mask
// dim, or (linear) one tensor of flat positions. Two parallel passes: count per chunk, then fill
// from each chunk's prefix offset.
std::vector<Tensor> nonzero_indices(const Tensor& mask, bool linear) {
  Tensor m = mask.contiguous();
  const int64_t n = m.numel();
  const int64_t k = linear ? 1 : m.dim();
  const unsigned char* p = n ? static_cast<const unsigned char*>(m.impl().data()) : nullptr;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), n / kGrainSize));
  std::vector<int64_t> offsets(chunks + 1, 0);
  parallel_for(chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      int64_t count = 0;
      for (int64_t i = n * c / chunks, end = n * (c + 1) / chunks; i < end; ++i) count += p[i] != 0;
      offsets[c + 1] = count;
    }
  });
  for (int64_t c = 0; c < chunks; ++c) offsets[c + 1] += offsets[c];
  const int64_t nnz = offsets[chunks];
  std::vector<Tensor> out;
  std::vector<int64_t*> dst;
  for (int64_t j = 0; j < k; ++j) {
    out.push_back(detail::make_empty({nnz}, kInt64, kCPU));
    dst.push_back(static_cast<int64_t*>(out.back().impl().data()));
  }
  const std::vector<int64_t> sizes = m.sizes().vec();
  parallel_for(chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      int64_t begin = n * c / chunks, end = n * (c + 1) / chunks, w = offsets[c];
      if (linear) {
        // Branch-free compaction through a small buffer (masks are often unpredictable).
        int64_t buf[257];
        for (int64_t i = begin; i < end; i += 256) {
          int64_t count = 0, stop = std::min(end, i + 256);
          for (int64_t q = i; q < stop; ++q) {
            buf[count] = q;
            count += p[q] != 0;
          }
          std::memcpy(dst[0] + w, buf, static_cast<size_t>(count) * sizeof(int64_t));
          w += count;
        }
        continue;
      }
      std::vector<int64_t> coord(k);
      for (int64_t j = k - 1, rem = begin; j >= 0; --j) {
        coord[j] = rem % sizes[j];
        rem /= sizes[j];
      }
      for (int64_t i = begin; i < end; ++i) {
        if (p[i]) {
          for (int64_t j = 0; j < k; ++j) dst[j][w] = coord[j];
          ++w;
        }
        for (int64_t j = k - 1; j >= 0; --j) {
          if (++coord[j] < sizes[j]) break;
          coord[j] = 0;
        }
      }
    }
  });
  return out;
}

}  // namespace kiln::cpu
