// Transformations of the loop IR shared by both code generators (see loop_ir.h).
#include "compiler/lower/loop_ir.h"

namespace kiln::compiler::lower {

std::vector<Kernel> split_at_cat_segments(const Kernel& k) {
  const Expr* cat = nullptr;
  for (const Expr& e : k.exprs)
    if (e.kind == Expr::cat) cat = &e;
  if (!cat) return {k};
  const size_t d = static_cast<size_t>(cat->cat_dim);
  // Shifts an access to the segment's start along the cat dim (host values have no strides).
  auto shift = [d](int64_t& offset, const std::vector<int64_t>& strides, int64_t start) {
    if (d < strides.size()) offset += start * strides[d];
  };
  std::vector<Kernel> pieces;
  for (size_t s = 0; s < cat->segments.size(); ++s) {
    const int64_t start = cat->segments[s].start, len = cat->segments[s].end - start;
    if (len == 0) continue;
    Kernel piece = k;
    piece.sizes[d] = len;
    for (Expr& e : piece.exprs) {
      if (e.kind == Expr::load) shift(e.offset, e.strides, start);
      if (e.kind == Expr::cat) {
        Expr::Segment seg = e.segments[s];
        e.kind = Expr::load;
        e.buffer = seg.buffer;
        e.strides = seg.strides;
        e.offset = 0;
        e.segments.clear();
      }
    }
    for (Store& st : piece.stores) shift(st.offset, st.strides, start);
    if (piece.kind == Kernel::reduction) shift(piece.result.offset, piece.result.strides, start);
    pieces.push_back(std::move(piece));
  }
  return pieces;
}

std::vector<bool> loop_variant_exprs(const Kernel& k, const std::function<bool(size_t expr)>& is_source) {
  std::vector<bool> varies(k.exprs.size(), false);
  for (size_t e = 0; e < k.exprs.size(); ++e) {
    varies[e] = is_source(e);
    for (int a : k.exprs[e].args) varies[e] = varies[e] || varies[a];
  }
  return varies;
}

std::vector<std::string> loop_variables(size_t rank) {
  std::vector<std::string> vars;
  for (size_t d = 0; d < rank; ++d) vars.push_back(std::string("i").append(std::to_string(d)));
  return vars;
}

}  // namespace kiln::compiler::lower
