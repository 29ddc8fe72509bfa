// Dynamic shapes at the frame level (DESIGN §2.6, spec §2.5): which argument sizes a new entry
// treats as dynamic — CompileOptions::dynamic, automatic dynamic, and the tensors' marks
// (mark_dynamic, maybe_mark_dynamic, mark_static). The graph side (dynamic graphs and their
// per-size instances) lives in frame.cpp's find_or_compile; the guards in guards.cpp.
#include <limits>

#include "compiler/capture/runtime.h"
#include "kiln/compiler.h"

namespace kiln::compiler {

namespace {

// A copy of t's marks with room for every dim (marks are replaced, never changed in place: a
// compile may be reading the old ones).
std::shared_ptr<DimMarks> marks_for_update(const Tensor& t, const char* api) {
  KILN_CHECK(t.defined(), ValueError, std::string("[kiln::compiler::") + api + "] the tensor is undefined.");
  KILN_CHECK(!is_compiling(), CompileError,
             std::string("[kiln::compiler::") + api + "] Attempt to trace forbidden callable " + api +
                 ": mark a tensor before the call of the compiled function that takes it, not inside it.");
  const kiln::detail::TensorImpl& impl = t.impl();
  auto m = impl.dim_marks ? std::make_shared<DimMarks>(*impl.dim_marks) : std::make_shared<DimMarks>();
  const size_t rank = static_cast<size_t>(t.dim());
  m->kind.resize(rank, DimMarks::none);
  m->min.resize(rank, 2);
  m->max.resize(rank, std::numeric_limits<int64_t>::max());
  return m;
}

int64_t checked_dim(const Tensor& t, int64_t dim, const char* api) {
  const int64_t rank = t.dim();
  KILN_CHECK(dim >= -rank && dim < rank && rank > 0, ValueError,
             std::string("[kiln::compiler::") + api + "] dim " + std::to_string(dim) +
                 " is out of range for a tensor of " + std::to_string(rank) + " dimensions.");
  return dim < 0 ? dim + rank : dim;
}

void mark(const Tensor& t, int64_t dim, DimMarks::Kind kind, DimRange range, const char* api) {
  auto m = marks_for_update(t, api);
  const int64_t d = checked_dim(t, dim, api);
  const int64_t lo = std::max<int64_t>(range.min.value_or(2), 2);
  const int64_t hi = range.max.value_or(std::numeric_limits<int64_t>::max());
  KILN_CHECK(lo <= hi, ValueError,
             std::string("[kiln::compiler::") + api + "] the range's min " + std::to_string(lo) +
                 " is above its max " + std::to_string(hi) + ".");
  const int64_t size = t.size(d);
  KILN_CHECK(size < 2 || (size >= lo && size <= hi), ValueError,
             std::string("[kiln::compiler::") + api + "] dim " + std::to_string(d) + " has size " +
                 std::to_string(size) + ", outside the range [" + std::to_string(lo) + ", " +
                 (range.max ? std::to_string(hi) : std::string("inf")) + "].");
  m->kind[d] = kind;
  m->min[d] = lo;
  m->max[d] = hi;
  t.impl().dim_marks = std::move(m);
}

}  // namespace

void mark_dynamic(const Tensor& t, int64_t dim, DimRange range) {
  mark(t, dim, DimMarks::dynamic, range, "mark_dynamic");
}

void maybe_mark_dynamic(const Tensor& t, int64_t dim) { mark(t, dim, DimMarks::maybe_dynamic, {}, "maybe_mark_dynamic"); }

void mark_static(const Tensor& t, std::optional<int64_t> dim) {
  auto m = marks_for_update(t, "mark_static");
  if (dim) {
    m->kind[checked_dim(t, *dim, "mark_static")] = DimMarks::static_;
  } else {
    std::fill(m->kind.begin(), m->kind.end(), DimMarks::static_);
  }
  t.impl().dim_marks = std::move(m);
}

}  // namespace kiln::compiler

namespace kiln::compiler::detail {

std::vector<std::vector<char>> dynamic_dims(FunctionState& st, const std::vector<Leaf>& leaves,
                                            const std::vector<std::string>& names) {
  std::vector<std::vector<char>> dims(leaves.size());
  if (st.options.dynamic == true) {
    for (size_t i = 0; i < leaves.size(); ++i)
      if (leaves[i].kind == Leaf::tensor) dims[i].assign(leaves[i].t.dim(), 1);
  } else if (!st.options.dynamic.has_value()) {
    // Automatic dynamic (Dynamo's frame_state): the first miss records every tensor argument's
    // sizes; a later miss marks each size that differs, for good.
    if (st.seen_sizes.size() != leaves.size()) {  // the first miss (or the argument list changed)
      st.seen_sizes.assign(leaves.size(), {});
      st.changed_dims.assign(leaves.size(), {});
      for (size_t i = 0; i < leaves.size(); ++i)
        if (leaves[i].kind == Leaf::tensor) st.seen_sizes[i] = leaves[i].t.sizes().vec();
    } else {
      for (size_t i = 0; i < leaves.size(); ++i) {
        if (leaves[i].kind != Leaf::tensor) continue;
        const IntArrayRef now = leaves[i].t.sizes();
        const std::vector<int64_t>& seen = st.seen_sizes[i];
        std::vector<char>& changed = st.changed_dims[i];
        if (seen.size() != now.size()) continue;  // another rank: a separate specialization
        changed.resize(seen.size(), 0);
        for (size_t d = 0; d < seen.size(); ++d) {
          if (changed[d] || seen[d] == now[d]) continue;
          changed[d] = 1;
          if (log_options().dynamic) {
            log_stream() << "[kiln.compile] automatic dynamic: " << leaf_name(names, static_cast<int>(i)) << ".size()[" << d
                         << "] changed (" << seen[d] << " -> " << now[d] << "); it is dynamic in the next compile of "
                         << st.where() << "\n";
          }
        }
        dims[i] = changed;
      }
    }
  }
  // Marks on the tensors of this call override the setting (mark_dynamic also under dynamic=false).
  for (size_t i = 0; i < leaves.size(); ++i) {
    if (leaves[i].kind != Leaf::tensor) continue;
    const DimMarks* m = leaves[i].t.impl().dim_marks.get();
    if (!m) continue;
    dims[i].resize(static_cast<size_t>(leaves[i].t.dim()), 0);
    for (size_t d = 0; d < dims[i].size() && d < m->kind.size(); ++d) {
      if (m->kind[d] == DimMarks::static_) dims[i][d] = 0;
      else if (m->kind[d] != DimMarks::none) dims[i][d] = 1;
    }
  }
  return dims;
}

void check_marks_honoured(const GuardSet& guards, const std::vector<Leaf>& leaves, const std::vector<std::string>& names) {
  for (size_t i = 0; i < leaves.size() && i < guards.leaves.size(); ++i) {
    if (leaves[i].kind != Leaf::tensor) continue;
    const DimMarks* m = leaves[i].t.impl().dim_marks.get();
    if (!m) continue;
    const LeafGuard& lg = guards.leaves[i];
    for (size_t d = 0; d < m->kind.size() && d < lg.sizes.size(); ++d) {
      if (m->kind[d] != DimMarks::dynamic || (!lg.dynamic.empty() && lg.dynamic[d])) continue;
      const std::string dim = leaf_name(names, static_cast<int>(i)) + ".size()[" + std::to_string(d) + "]";
      throw CompileError("[kiln::compile] Constraints violated (" + dim + ")! mark_dynamic(" + leaf_name(names, static_cast<int>(i)) +
                         ", " + std::to_string(d) + ") was called, but the compile specialized " + dim + " to " +
                         std::to_string(lg.sizes[d]) +
                         ": sizes 0 and 1 always specialize. Use maybe_mark_dynamic to allow the specialization.");
    }
  }
}

}  // namespace kiln::compiler::detail
