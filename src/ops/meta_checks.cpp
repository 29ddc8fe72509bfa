#include "ops/meta_checks.h"

#include <optional>

#include "core/shape.h"

namespace kiln::detail {

Device common_device(const OpCall& c) {
  std::optional<Device> device;
  for (const Tensor& t : c.inputs) {
    if (!t.defined() || (t.dim() == 0 && t.is_cpu())) continue;
    if (!device) {
      device = t.device();
    } else {
      KILN_CHECK(*device == t.device(), DeviceError,
                 "[kiln::" + c.name() + "] expected all tensors to be on the same device, but found " +
                     device->str() + " and " + t.device().str() + ". Move them to one device with .to(...).");
    }
  }
  return device.value_or(kCPU);
}

std::vector<int64_t> broadcast_inputs(const OpCall& c) {
  std::vector<int64_t> sizes;
  for (const Tensor& t : c.inputs)
    if (t.defined()) sizes = broadcast_sizes(sizes, t.sizes(), c.name());
  return sizes;
}

void check_same_device(const std::string& op, std::initializer_list<const Tensor*> tensors) {
  const Tensor* first = nullptr;
  for (const Tensor* t : tensors) {
    if (!t->defined()) continue;
    if (!first) {
      first = t;
      continue;
    }
    KILN_CHECK(t->device() == first->device(), DeviceError,
               "[kiln::" + op + "] expected all tensors to be on the same device, but found at least "
               "two devices, " + first->device().str() + " and " + t->device().str() +
                   ". Move them to one device with .to(...).");
  }
}

std::vector<int64_t> pointwise_strides(const OpCall& c, const std::vector<int64_t>& sizes) {
  if (sizes.size() != 4) return {};
  for (const Tensor& t : c.inputs) {
    if (!t.defined() || t.sizes() != IntArrayRef(sizes)) continue;
    // An expanded operand (a stride 0 over a dim of size > 1) has no layout of its own.
    bool expanded = false;
    for (size_t d = 0; d < sizes.size(); ++d) expanded |= t.strides()[d] == 0 && sizes[d] > 1;
    if (expanded) continue;
    return strides_following(t.sizes(), t.strides(), sizes);
  }
  return {};
}

}  // namespace kiln::detail
