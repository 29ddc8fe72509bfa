// The decompositions of composite ops, each named by its op's entry (`.lowering = ...`); see
// decompositions.cpp for the formulas and the inputs each one covers.
#pragma once

#include "kiln/lowering.h"

namespace kiln::detail {

lowering::Decomposition batch_norm_decomposition();  // evaluation only
lowering::Decomposition layer_norm_decomposition();
lowering::Decomposition group_norm_decomposition();
lowering::Decomposition softmax_decomposition(bool log);
lowering::Decomposition logsumexp_decomposition();
lowering::Decomposition adaptive_avg_pool2d_decomposition();

}  // namespace kiln::detail
