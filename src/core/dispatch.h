// Shared pieces of the dispatcher (op_table.cpp) that the compiler's capture also uses.
#pragma once

#include <span>
#include <vector>

#include "kiln/op_table.h"

namespace kiln::detail {

// The checks an in-place/out= call makes on its targets: the result must have their sizes, be
// castable to their dtype, and live on their device. Throws the eager error messages.
void check_out_targets(const OpDef& op, const std::vector<TensorMeta>& metas, std::span<Tensor> outputs);

}  // namespace kiln::detail
