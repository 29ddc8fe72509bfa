// The fused optimizer kernels (Adam/AdamW and SGD): one update of many parameters of one device and dtype in a few
// passes (CPU: one parallel loop over chunks of every tensor; CUDA: one launch for the step
// counters and one per few dozen tensors), instead of a dozen eager ops per parameter. The
// element math is kiln/math/optim.h; src/optim decides which parameters qualify (dense tensors,
// float32 step counters, no capture under way) and bumps the version counters afterwards.
#pragma once

#include <string>
#include <vector>

#include "kiln/tensor.h"

namespace kiln::detail {

struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize, decoupled;
};

// Parallel lists: entry i of each belongs to parameter i. All tensors dense (contiguous), of
// one device; params, grads and the moments of one floating dtype; steps 0-dim float32 counters,
// incremented here first. max_exp_avg_sqs is empty unless amsgrad.
struct AdamLists {
  std::vector<Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
};

struct SgdHyper {
  double lr, momentum, dampening, weight_decay;
  bool nesterov, maximize;
};

// Parallel lists, as AdamLists. momentum_buffers is empty without momentum; first[i] is 1 where
// parameter i's buffer starts at this step (fresh memory, written before it is read).
struct SgdLists {
  std::vector<Tensor> params, grads, momentum_buffers;
  std::vector<unsigned char> first;
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

}  // namespace kiln::detail
