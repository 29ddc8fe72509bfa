// The arguments of ops whose CPU and CUDA kernels unpack them alike (kernels of both devices
// include this; see kernels/cpu and kernels/cuda).
#pragma once

#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "core/shape.h"
#include "kiln/op_table.h"

namespace kiln::detail {

// nll_loss_forward(self, target, weight?, reduction, ignore_index), its tensors contiguous.
struct NllLossArgs {
  Tensor x, target, weight;
  int64_t reduction, ignore_index;
  explicit NllLossArgs(const OpCall& call)
      : x(call.input(0).contiguous()),
        target(call.input(1).contiguous()),
        weight(call.input(2).defined() ? call.input(2).contiguous() : Tensor()),
        reduction(call.int_attr(0)),
        ignore_index(call.int_attr(1)) {}
};

// What argmax/argmin (attrs: dim?, keepdim) and max.dim/min.dim (dim, keepdim) reduce: the input
// (flattened when no dim is given: the index counts over all elements) and the reduced-dim mask.
inline std::pair<Tensor, std::vector<bool>> arg_reduction_input(const OpCall& c) {
  const Tensor& x = c.input(0);
  if (!c.has_attr(0)) return {x.contiguous().view({x.numel()}), {true}};
  std::vector<bool> mask(x.dim(), false);
  if (x.dim() > 0) mask[wrap_dim(c.int_attr(0), x.dim(), c.name())] = true;
  return {x, std::move(mask)};
}

// cat's reference input, whose dims the others match: the first that is not a legacy empty 1-D
// tensor (which cat skips, as PyTorch does); nullptr when every input is one.
inline const Tensor* cat_reference(std::span<const Tensor> inputs) {
  for (const Tensor& t : inputs)
    if (!(t.dim() == 1 && t.sizes()[0] == 0)) return &t;
  return nullptr;
}

// How cat's kernels walk `out`: rows are the dims outside `dim` in out's memory order, and each
// row holds every input's slice along `dim` (`inner` elements per unit of `dim`).
struct CatRows {
  int64_t dim = 0;
  std::vector<int64_t> order;  // out's dims, outermost in memory first
  bool out_dense = false;      // out covers its memory without gaps in that order
  int64_t outer = 1, inner = 1;
  int64_t out_row_bytes = 0;
};
inline CatRows cat_rows(const Tensor& out, int64_t dim) {
  CatRows r;
  r.dim = dim;
  r.order = memory_order(out.strides());
  r.out_dense = dense_in(out.sizes(), out.strides(), r.order);
  bool outside = true;
  for (int64_t d : r.order) {
    if (d == dim) outside = false;
    else if (outside) r.outer *= out.sizes()[d];
    else r.inner *= out.sizes()[d];
  }
  r.out_row_bytes = out.sizes()[dim] * r.inner * static_cast<int64_t>(out.element_size());
  return r;
}

// cat(tensors, dim) into `out`: its rows, or nullopt when there is nothing to copy (an empty
// result, or only legacy empty inputs).
inline std::optional<CatRows> cat_layout(const OpCall& call, const Tensor& out) {
  const Tensor* ref = cat_reference(call.inputs);
  if (out.numel() == 0 || !ref) return std::nullopt;
  return cat_rows(out, wrap_dim(call.int_attr(0), ref->dim(), "cat"));
}

}  // namespace kiln::detail
