// Checks shared by the meta functions of several op families.
#pragma once

#include <initializer_list>
#include <string>
#include <vector>

#include "kiln/op_table.h"

namespace kiln::detail {

// The device the op's tensor inputs share; 0-dim CPU tensors (wrapped scalars) may join any
// device. Throws DeviceError naming the two devices otherwise.
Device common_device(const OpCall& c);
// The broadcast shape of the op's defined tensor inputs.
std::vector<int64_t> broadcast_inputs(const OpCall& c);
// The strides of a pointwise result of `sizes` (empty: contiguous): the layout of the first
// defined input that has the result's shape and is not expanded — channels-last stays
// channels-last (PyTorch's memory-format propagation, simplified to that one operand).
std::vector<int64_t> pointwise_strides(const OpCall& c, const std::vector<int64_t>& sizes);
// Throws DeviceError unless all defined tensors are on one device.
void check_same_device(const std::string& op, std::initializer_list<const Tensor*> tensors);

}  // namespace kiln::detail
