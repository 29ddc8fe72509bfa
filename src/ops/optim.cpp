// The fused optimizer updates (kernels/fused_optim.h): _fused_adam_ (Adam and AdamW) and _fused_sgd_
// update every parameter of one device and dtype in one call. They have no outputs; they write
// their tensor list in place (all of it but the gradients), so compile() keeps the node as it is
// and runs it through the dispatcher, where the fused kernel of the device takes it.
#include <string>

#include "core/shape.h"
#include "kernels/fused_optim.h"
#include "kiln/op_table.h"

namespace kiln::detail {

namespace {

// Checks `lists` lists of n tensors each, named by `names`: list 0 holds the parameters, dense
// tensors of one floating dtype on one CPU or CUDA device; the lists before `counters` (or all,
// when counters < 0) hold tensors like their parameter (sizes, dtype, device, dense); list
// `counters` 0-dim float32 tensors on the parameters' device.
void check_lists(const OpDef& def, std::span<const Tensor> tensors, size_t lists,
                 std::initializer_list<const char*> names, int counters) {
  const std::string& op = def.name;
  if (tensors.size() % lists != 0) {
    std::string named;
    for (const char* n : names) named += (named.empty() ? "" : ", ") + std::string(n);
    throw ValueError("[kiln::" + op + "] expected " + std::to_string(lists) + " lists of equal length (" + named +
                     "), got " + std::to_string(tensors.size()) + " tensors.");
  }
  const size_t n = tensors.size() / lists;
  if (n == 0) return;
  const Tensor& first = tensors[0];
  for (size_t k = 0; k < lists; ++k) {
    for (size_t i = 0; i < n; ++i) {
      const Tensor& t = tensors[k * n + i];
      // Built only for a message: the checks run on every call of a step.
      auto which = [&] {
        return "[kiln::" + op + "] " + *(names.begin() + static_cast<std::ptrdiff_t>(k)) + "[" + std::to_string(i) + "] ";
      };
      KILN_CHECK(t.defined(), ValueError, which() + "is undefined.");
      KILN_CHECK(t.device() == first.device(), DeviceError,
                 which() + "is on " + t.device().str() + " but the first parameter is on " + first.device().str() +
                     ". A fused update takes the tensors of one device.");
      if (static_cast<int>(k) == counters) {
        KILN_CHECK(t.dim() == 0 && t.dtype() == kFloat32, ValueError,
                   which() + "must be a 0-dim float32 step counter, got " + std::string(dtype_name(t.dtype())) +
                       shape_str(t.sizes()) + ".");
        continue;
      }
      const Tensor& param = tensors[i];
      KILN_CHECK(t.is_contiguous(), ValueError, which() + "must be contiguous. Take the per-op update for strided tensors.");
      if (k == 0) {
        KILN_CHECK(fused_update_dtype(t.dtype()) && t.dtype() == first.dtype(), DTypeError,
                   which() + "has dtype " + std::string(dtype_name(t.dtype())) +
                       "; a fused update takes parameters of one floating dtype (float32, float64, float16 or "
                       "bfloat16), here " +
                       std::string(dtype_name(first.dtype())) + ".");
        KILN_CHECK(def.has_kernel(t.device().type), DeviceError,
                   which() + "is on " + t.device().str() + ", which has no fused kernel.");
        continue;
      }
      KILN_CHECK(t.sizes() == param.sizes() && t.dtype() == param.dtype(), ValueError,
                 which() + "is " + std::string(dtype_name(t.dtype())) + shape_str(t.sizes()) + " but its parameter is " +
                     std::string(dtype_name(param.dtype())) + shape_str(param.sizes()) + ".");
    }
  }
}

// Every input but list 1 (the gradients) of a list of `lists` lists.
std::vector<int> all_but_gradients(size_t num_inputs, size_t lists) {
  const size_t n = lists > 0 ? num_inputs / lists : 0;
  std::vector<int> out;
  out.reserve(num_inputs - n);
  for (size_t i = 0; i < num_inputs; ++i)
    if (i < n || i >= 2 * n) out.push_back(static_cast<int>(i));
  return out;
}

const OpDef& kFusedAdam = register_op({
    .name = "_fused_adam_",
    .schema = "_fused_adam_(Tensor(a!)[] tensors, float lr, float beta1, float beta2, float eps, float weight_decay, "
              "bool amsgrad, bool maximize, bool decoupled) -> ()",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const bool amsgrad = c.bool_attr(5);
      if (amsgrad)
        check_lists(*c.op, c.inputs, 6, {"params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps"}, 5);
      else
        check_lists(*c.op, c.inputs, 5, {"params", "grads", "exp_avgs", "exp_avg_sqs", "steps"}, 4);
      return {};
    },
    .lowering = lowering::Extern{},
    .mutated_inputs_of = [](size_t num_inputs, const AttrAccess& a) {
      return all_but_gradients(num_inputs, AdamLists::count(a.bool_attr(5)));
    },
});

const OpDef& kFusedSgd = register_op({
    .name = "_fused_sgd_",
    .schema = "_fused_sgd_(Tensor(a!)[] tensors, float lr, float momentum, float dampening, float weight_decay, "
              "bool nesterov, bool maximize, int[] first) -> ()",
    .meta = [](const OpCall& c) -> std::vector<TensorMeta> {
      const IntArrayRef first = c.ints_attr(6);
      if (first.empty()) {
        check_lists(*c.op, c.inputs, 2, {"params", "grads"}, -1);
      } else {
        check_lists(*c.op, c.inputs, 3, {"params", "grads", "momentum_buffers"}, -1);
        KILN_CHECK(first.size() * 3 == c.inputs.size(), ValueError,
                   "[kiln::_fused_sgd_] first holds " + std::to_string(first.size()) +
                       " flags but the list has " + std::to_string(c.inputs.size() / 3) +
                       " parameters with momentum buffers. Pass one flag per parameter.");
      }
      return {};
    },
    .lowering = lowering::Extern{},
    .mutated_inputs_of = [](size_t num_inputs, const AttrAccess& a) {
      return all_but_gradients(num_inputs, a.ints_attr(6).empty() ? 2 : 3);
    },
});

}  // namespace

bool fused_update_dtype(DType t) { return t == kFloat32 || t == kFloat64 || t == kFloat16 || t == kBFloat16; }

bool fused_update_takes(const OpDef& op, const Tensor& param) {
  return fused_update_dtype(param.dtype()) && param.is_contiguous() && op.has_kernel(param.device().type);
}

AdamHyper AdamHyper::of(const AttrAccess& a) {
  return {a.double_attr(0), a.double_attr(1), a.double_attr(2), a.double_attr(3),
          a.double_attr(4), a.bool_attr(5),   a.bool_attr(6),   a.bool_attr(7)};
}

std::vector<Attr> AdamHyper::attrs() const {
  return {lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled};
}

AdamLists AdamLists::of(std::span<const Tensor> t, bool amsgrad) {
  const size_t n = t.size() / count(amsgrad);
  AdamLists l;
  l.params = t.subspan(0, n);
  l.grads = t.subspan(n, n);
  l.exp_avgs = t.subspan(2 * n, n);
  l.exp_avg_sqs = t.subspan(3 * n, n);
  if (amsgrad) l.max_exp_avg_sqs = t.subspan(4 * n, n);
  l.steps = t.subspan((amsgrad ? 5 : 4) * n, n);
  return l;
}

SgdHyper SgdHyper::of(const AttrAccess& a) {
  return {a.double_attr(0), a.double_attr(1), a.double_attr(2), a.double_attr(3), a.bool_attr(4), a.bool_attr(5)};
}

std::vector<Attr> SgdHyper::attrs(std::vector<int64_t> first) const {
  return {lr, momentum, dampening, weight_decay, nesterov, maximize, std::move(first)};
}

SgdLists SgdLists::of(std::span<const Tensor> t, IntArrayRef first) {
  const size_t n = t.size() / (first.empty() ? 2 : 3);
  SgdLists l;
  l.params = t.subspan(0, n);
  l.grads = t.subspan(n, n);
  if (!first.empty()) l.momentum_buffers = t.subspan(2 * n, n);
  l.first = first;
  return l;
}

const OpDef& fused_adam_op() { return kFusedAdam; }
const OpDef& fused_sgd_op() { return kFusedSgd; }

void register_fused_optimizer_kernels(DeviceType device, FusedAdamKernel adam, FusedSgdKernel sgd) {
  register_kernel("_fused_adam_", device, [adam](const OpCall& c, std::span<Tensor>) {
    const AdamHyper h = AdamHyper::of(c);
    adam(AdamLists::of(c.inputs, h.amsgrad), h);
  });
  register_kernel("_fused_sgd_", device, [sgd](const OpCall& c, std::span<Tensor>) {
    sgd(SgdLists::of(c.inputs, c.ints_attr(6)), SgdHyper::of(c));
  });
}

}  // namespace kiln::detail
