// CPU kernels for cat, the padding ops and the mode pads' backward ops.
//
// cat writes each input into its slice of the output. When the output and an input are dense in
// the same dim order (both row-major, both channels-last, ...) and share a dtype, the slice is
// one block of bytes per outer row, the rows being the dims outside `dim` in memory order (for
// channels-last and dim 1: one C-slice per pixel). Those blocks are memcpy'd in parallel (split
// into pieces when there are few large ones, walked row by row when there are many small ones).
// Other inputs go through the strided, converting copy.
#include <algorithm>
#include <cstring>

#include "kernels/kernel_args.h"
#include "kernels/cpu/loops.h"
#include "core/shape.h"
#include "core/tensor_factory.h"
#include "kiln/op_table.h"
#include "kiln/ops.h"

namespace kiln::cpu {

namespace {

// Bytes a thread should copy at least before another thread is worth starting.
constexpr int64_t kCopyGrainBytes = 1 << 16;

struct CatSource {
  const char* src;
  int64_t dst_offset;  // bytes from the start of an output row
  int64_t row_bytes;   // bytes per outer row
};

struct CopyBlock {
  char* dst;
  const char* src;
  int64_t bytes;
};

void copy_blocks(const std::vector<CopyBlock>& blocks, int64_t total_bytes) {
  // Split big blocks so that every thread gets work even when there are only a few of them.
  int64_t piece = std::max<int64_t>(kCopyGrainBytes, total_bytes / (4 * std::max(1, omp_get_max_threads())));
  std::vector<CopyBlock> pieces;
  pieces.reserve(blocks.size());
  for (const CopyBlock& b : blocks) {
    for (int64_t off = 0; off < b.bytes; off += piece)
      pieces.push_back({b.dst + off, b.src + off, std::min(piece, b.bytes - off)});
  }
  int64_t n = static_cast<int64_t>(pieces.size());
  int64_t grain = std::max<int64_t>(1, n * kCopyGrainBytes / std::max<int64_t>(total_bytes, 1));
  parallel_for(n, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) std::memcpy(pieces[i].dst, pieces[i].src, static_cast<size_t>(pieces[i].bytes));
  });
}

void cat_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  // Rows: the dims outside `dim` in out's memory order; each row holds every input's slice.
  const std::optional<kiln::detail::CatRows> rows = kiln::detail::cat_layout(call, out);
  if (!rows) return;
  const int64_t dim = rows->dim, isz = out.element_size();
  const std::vector<int64_t>& order = rows->order;
  const bool out_dense = rows->out_dense;
  const int64_t outer = rows->outer, inner = rows->inner, out_row_bytes = rows->out_row_bytes;
  char* out_base = static_cast<char*>(out.impl().data());

  std::vector<CatSource> fast;
  std::vector<std::pair<Tensor, Tensor>> slow;  // (slice of out, input)
  int64_t offset = 0;
  for (const Tensor& t : call.inputs) {
    if (t.numel() == 0) continue;  // contributes no elements (legacy empty or size 0 along dim)
    int64_t len = t.sizes()[dim];
    if (out_dense && detail::dense_in(t.sizes(), t.strides(), order) && t.dtype() == out.dtype()) {
      fast.push_back({static_cast<const char*>(t.impl().data()), offset * inner * isz, len * inner * isz});
    } else {
      slow.emplace_back(out.narrow(dim, offset, len), t);
    }
    offset += len;
  }

  if (!fast.empty()) {
    int64_t total = 0;
    for (const CatSource& s : fast) total += s.row_bytes * outer;
    int64_t nblocks = outer * static_cast<int64_t>(fast.size());
    if (nblocks <= 4096) {
      std::vector<CopyBlock> blocks;
      blocks.reserve(nblocks);
      for (int64_t o = 0; o < outer; ++o)
        for (const CatSource& s : fast)
          blocks.push_back({out_base + o * out_row_bytes + s.dst_offset, s.src + o * s.row_bytes, s.row_bytes});
      copy_blocks(blocks, total);
    } else {
      int64_t grain = std::max<int64_t>(1, outer * kCopyGrainBytes / std::max<int64_t>(total, 1));
      parallel_for(outer, grain, [&](int64_t b, int64_t e) {
        for (int64_t o = b; o < e; ++o) {
          char* row = out_base + o * out_row_bytes;
          for (const CatSource& s : fast)
            std::memcpy(row + s.dst_offset, s.src + o * s.row_bytes, static_cast<size_t>(s.row_bytes));
        }
      });
    }
  }
  for (auto& [dst, src] : slow) dst.copy_(src);
}

// constant_pad_nd: fill with the value, then copy the (possibly cropped) input into its window.
void constant_pad_kernel(const OpCall& call, std::span<Tensor> outs) {
  Tensor& out = outs[0];
  const Tensor& x = call.input(0);
  IntArrayRef pad = call.ints_attr(0);
  out.fill_(call.scalar_attr(1));
  Tensor dst = out, src = x;
  int64_t npad = static_cast<int64_t>(pad.size()) / 2;
  for (int64_t i = 0; i < npad; ++i) {
    int64_t d = x.dim() - 1 - i;
    int64_t l = pad[2 * i], r = pad[2 * i + 1];
    int64_t len = x.sizes()[d] + std::min<int64_t>(l, 0) + std::min<int64_t>(r, 0);
    if (len <= 0) return;  // everything cropped away: the output is all padding
    src = src.narrow(d, std::max<int64_t>(-l, 0), len);
    dst = dst.narrow(d, std::max<int64_t>(l, 0), len);
  }
  if (src.numel() > 0) dst.copy_(src);
}

// Source index along one padded dim for every output position (PyTorch's formulas, which also
// handle negative padding).
std::vector<int64_t> pad_source_index(int64_t in, int64_t l, int64_t r, bool reflect) {
  int64_t out = in + l + r;
  int64_t i_start = std::max<int64_t>(0, -l), o_start = std::max<int64_t>(0, l);
  std::vector<int64_t> src(static_cast<size_t>(out));
  for (int64_t j = 0; j < out; ++j) {
    int64_t ip;
    if (reflect) {
      if (j < l) ip = 2 * l - j;
      else if (j < in + l) ip = j;
      else ip = 2 * (in + l - 1) - j;
    } else {
      ip = j < l ? l : (j < in + l ? j : in + l - 1);
    }
    ip = ip - o_start + i_start;
    KILN_CHECK(ip >= 0 && ip < in, IndexError,
               "[kiln::pad] internal error: padding source index " + std::to_string(ip) +
                   " out of range for size " + std::to_string(in) + ".");
    src[j] = ip;
  }
  return src;
}

template <class T>
void mode_pad_typed(const Tensor& x, Tensor& out, const std::vector<std::vector<int64_t>>& maps) {
  // Output dims: batch dims (walked by a counter) then the k padded dims; the last one is inner.
  const int64_t ndim = out.dim();
  const int64_t k = static_cast<int64_t>(maps.size());
  const int64_t nb = ndim - k;
  // Source offsets per padded dim, already multiplied by the input stride.
  std::vector<std::vector<int64_t>> offs(k);
  for (int64_t i = 0; i < k; ++i) {
    int64_t d = nb + i;
    offs[i].resize(maps[i].size());
    for (size_t j = 0; j < maps[i].size(); ++j) offs[i][j] = maps[i][j] * x.strides()[d];
  }
  const int64_t inner = out.sizes()[ndim - 1];
  const int64_t rows = out.numel() / std::max<int64_t>(inner, 1);
  const T* src = static_cast<const T*>(x.impl().data());
  T* dst = static_cast<T*>(out.impl().data());
  const std::vector<int64_t>& last = offs[k - 1];
  parallel_for(rows, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(inner, 1)), [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      int64_t rem = row, off = 0;
      for (int64_t d = ndim - 2; d >= 0; --d) {
        int64_t c = rem % out.sizes()[d];
        rem /= out.sizes()[d];
        off += d >= nb ? offs[d - nb][c] : c * x.strides()[d];
      }
      T* o = dst + row * inner;
      const T* s = src + off;
      for (int64_t j = 0; j < inner; ++j) o[j] = s[last[j]];
    }
  });
}

void mode_pad_kernel(const OpCall& call, std::span<Tensor> outs, bool reflect) {
  Tensor& result = outs[0];
  const Tensor& x = call.input(0);
  IntArrayRef pad = call.ints_attr(0);
  if (result.numel() == 0) return;
  int64_t k = static_cast<int64_t>(pad.size()) / 2;
  std::vector<std::vector<int64_t>> maps(k);  // in dim order (outermost padded dim first)
  for (int64_t i = 0; i < k; ++i) {
    int64_t d = x.dim() - 1 - i;
    maps[k - 1 - i] = pad_source_index(x.sizes()[d], pad[2 * i], pad[2 * i + 1], reflect);
  }
  Tensor out = result.is_contiguous() ? result : detail::make_empty(result.sizes().vec(), result.dtype(), result.device());
  KILN_DISPATCH_ALL(x.dtype(), call.name().c_str(), [&] { mode_pad_typed<scalar_t>(x, out, maps); });
  if (!out.same(result)) result.copy_(out);
}

// {reflection,replication}_pad{k}d_backward. Each output position of the forward copied one
// input position (per padded dim: map[j]), so each input row of the gradient gathers the
// grad_output rows that map to it (an inverse map per outer padded dim) and, along the last dim,
// adds grad_output[j] into acc[map[j]]. Threads own input rows: no races, no atomics; every
// grad_output element is read once; sums run in a fixed order, in opmath precision.
template <class T>
void mode_pad_backward_typed(const Tensor& go, Tensor& gi, const std::vector<std::vector<int64_t>>& maps) {
  using acc_t = opmath_t<T>;
  const int64_t ndim = gi.dim();
  const int64_t k = static_cast<int64_t>(maps.size());
  const int64_t nb = ndim - k;
  // Inverse maps (CSR) of the padded dims: input index i -> the output indices copied from it.
  std::vector<std::vector<int64_t>> inv_start(k), inv(k);
  for (int64_t p = 0; p < k; ++p) {
    const int64_t in = gi.sizes()[nb + p];
    inv_start[p].assign(static_cast<size_t>(in + 1), 0);
    for (int64_t src : maps[p]) ++inv_start[p][src + 1];
    for (int64_t i = 0; i < in; ++i) inv_start[p][i + 1] += inv_start[p][i];
    inv[p].resize(maps[p].size());
    std::vector<int64_t> fill(inv_start[p].begin(), inv_start[p].end() - 1);
    for (int64_t j = 0; j < static_cast<int64_t>(maps[p].size()); ++j) inv[p][fill[maps[p][j]]++] = j;
  }
  const int64_t w_in = gi.sizes()[ndim - 1];
  const int64_t w_out = go.sizes()[ndim - 1];
  const int64_t go_last = go.strides()[ndim - 1];
  const std::vector<int64_t>& last_map = maps[k - 1];
  const int64_t rows = gi.numel() / std::max<int64_t>(w_in, 1);
  const T* src = static_cast<const T*>(go.impl().data());
  T* dst = static_cast<T*>(gi.impl().data());
  const int64_t per_row = std::max<int64_t>(1, go.numel() / std::max<int64_t>(rows, 1));
  parallel_for(rows, std::max<int64_t>(1, kGrainSize / per_row), [&](int64_t b, int64_t e) {
    std::vector<acc_t> acc(static_cast<size_t>(w_in));
    std::vector<int64_t> coord(static_cast<size_t>(ndim - 1));
    std::vector<int64_t> bases, next;
    for (int64_t row = b; row < e; ++row) {
      int64_t rem = row;
      for (int64_t d = ndim - 2; d >= 0; --d) {
        coord[d] = rem % gi.sizes()[d];
        rem /= gi.sizes()[d];
      }
      // grad_output offsets of the rows that map to this input row.
      int64_t base = 0;
      for (int64_t d = 0; d < nb; ++d) base += coord[d] * go.strides()[d];
      bases.assign(1, base);
      for (int64_t p = 0; p + 1 < k; ++p) {
        const int64_t d = nb + p, i = coord[d];
        next.clear();
        for (int64_t bo : bases)
          for (int64_t q = inv_start[p][i]; q < inv_start[p][i + 1]; ++q) next.push_back(bo + inv[p][q] * go.strides()[d]);
        bases.swap(next);
      }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      for (int64_t bo : bases) {
        const T* s = src + bo;
        for (int64_t j = 0; j < w_out; ++j) acc[last_map[j]] += static_cast<acc_t>(s[j * go_last]);
      }
      T* o = dst + row * w_in;
      for (int64_t i = 0; i < w_in; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

void mode_pad_backward_kernel(const OpCall& call, std::span<Tensor> outs, bool reflect) {
  Tensor& result = outs[0];
  const Tensor& go = call.input(0);
  IntArrayRef in_sizes = call.ints_attr(0), pad = call.ints_attr(1);
  if (result.numel() == 0) return;
  const int64_t k = static_cast<int64_t>(pad.size()) / 2;
  const int64_t nd = static_cast<int64_t>(in_sizes.size());
  std::vector<std::vector<int64_t>> maps(k);  // in dim order (outermost padded dim first)
  for (int64_t i = 0; i < k; ++i) {
    int64_t d = nd - 1 - i;
    maps[k - 1 - i] = pad_source_index(in_sizes[d], pad[2 * i], pad[2 * i + 1], reflect);
  }
  Tensor gi = result.is_contiguous() ? result : detail::make_empty(result.sizes().vec(), result.dtype(), result.device());
  KILN_DISPATCH_FLOATING(go.dtype(), call.name().c_str(), [&] { mode_pad_backward_typed<scalar_t>(go, gi, maps); });
  if (!gi.same(result)) result.copy_(gi);
}

[[maybe_unused]] const bool registered = [] {
  register_kernel("cat", DeviceType::cpu, cat_kernel);
  register_kernel("constant_pad_nd", DeviceType::cpu, constant_pad_kernel);
  for (const char* name : {"reflection_pad1d", "reflection_pad2d", "reflection_pad3d"})
    register_kernel(name, DeviceType::cpu, [](const OpCall& c, std::span<Tensor> o) { mode_pad_kernel(c, o, true); });
  for (const char* name : {"replication_pad1d", "replication_pad2d", "replication_pad3d"})
    register_kernel(name, DeviceType::cpu, [](const OpCall& c, std::span<Tensor> o) { mode_pad_kernel(c, o, false); });
  for (const char* name : {"reflection_pad1d_backward", "reflection_pad2d_backward", "reflection_pad3d_backward"})
    register_kernel(name, DeviceType::cpu,
                    [](const OpCall& c, std::span<Tensor> o) { mode_pad_backward_kernel(c, o, true); });
  for (const char* name : {"replication_pad1d_backward", "replication_pad2d_backward", "replication_pad3d_backward"})
    register_kernel(name, DeviceType::cpu,
                    [](const OpCall& c, std::span<Tensor> o) { mode_pad_backward_kernel(c, o, false); });
  return true;
}();

}  // namespace

}  // namespace kiln::cpu
