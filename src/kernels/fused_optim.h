// The fused optimizer updates (Adam/AdamW and SGD): one update of many parameters of one device and
// dtype in a few passes (CPU: one parallel loop over chunks of every tensor; CUDA: one launch for the
// step counters and one per few dozen tensors), instead of a dozen ops per parameter. They are ops of
// the table, `_fused_adam_` and `_fused_sgd_` (src/ops/optim.cpp: schema and checks), so that an eager
// step dispatches them and compile() captures one node per parameter group; their kernels register
// from kernels/<device>/optim_kernels.cpp. The element math is kiln/math/optim.h; src/optim decides
// which parameters qualify (dense tensors, float32 step counters).
#pragma once

#include <span>
#include <string>
#include <vector>

#include "kiln/op_table.h"
#include "kiln/tensor.h"

namespace kiln::detail {

// _fused_adam_'s attrs, in schema order.
struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize, decoupled;
  static AdamHyper of(const AttrAccess& attrs);
  std::vector<Attr> attrs() const;
};

// _fused_adam_'s tensor list: n parameters, then their gradients, first moments, second moments,
// (amsgrad only) running maxima of the second moments, and 0-dim float32 step counters, n of each,
// entry i of each list belonging to parameter i. The update increments the counters first; it
// writes every list but the gradients.
struct AdamLists {
  std::span<const Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
  static size_t count(bool amsgrad) { return amsgrad ? 6 : 5; }  // lists in the tensor list
  // The lists of `tensors`, whose length the op's meta checked to be a multiple of count(amsgrad).
  static AdamLists of(std::span<const Tensor> tensors, bool amsgrad);
};

// _fused_sgd_'s attrs, in schema order but the last (the first-step flags, SgdLists::first).
struct SgdHyper {
  double lr, momentum, dampening, weight_decay;
  bool nesterov, maximize;
  static SgdHyper of(const AttrAccess& attrs);
  std::vector<Attr> attrs(std::vector<int64_t> first) const;
};

// _fused_sgd_'s tensor list: n parameters, their gradients and, with momentum, their momentum
// buffers. first (the op's last attr: one 0/1 per parameter with momentum buffers, empty without)
// is 1 where a buffer starts at this step (fresh memory, written before it is read). The update
// writes the parameters and buffers.
struct SgdLists {
  std::span<const Tensor> params, grads, momentum_buffers;
  IntArrayRef first;
  static SgdLists of(std::span<const Tensor> tensors, IntArrayRef first);
};

void fused_adam_cpu(const AdamLists& lists, const AdamHyper& h);
void fused_sgd_cpu(const SgdLists& lists, const SgdHyper& h);
#ifdef KILN_WITH_CUDA
void fused_adam_cuda(const AdamLists& lists, const AdamHyper& h);
void fused_sgd_cuda(const SgdLists& lists, const SgdHyper& h);
// The CUDA sources fused_adam_cuda and fused_sgd_cuda build for parameters of dtype `t`: tests
// compile them with NVRTC on machines without a GPU.
std::string fused_adam_source(DType t);
std::string fused_sgd_source(DType t);
#endif

// The ops: one update of every parameter in `tensors` (laid out as AdamLists / SgdLists say),
// through the dispatcher, so that compile() captures it as one node.
const OpDef& fused_adam_op();
const OpDef& fused_sgd_op();

// The parameters a fused op takes (its meta checks the same): dense tensors of float32, float64,
// float16 or bfloat16 on a device the op has a kernel for.
bool fused_update_dtype(DType t);
bool fused_update_takes(const OpDef& op, const Tensor& param);

// Registers a device's fused kernels as the ops' kernels there, reading each call's lists and attrs.
using FusedAdamKernel = void (*)(const AdamLists&, const AdamHyper&);
using FusedSgdKernel = void (*)(const SgdLists&, const SgdHyper&);
void register_fused_optimizer_kernels(DeviceType device, FusedAdamKernel adam, FusedSgdKernel sgd);

}  // namespace kiln::detail
