// The element update of the fused optimizers (kiln::optim's Adam, AdamW and SGD over many
// parameters in a few kernels), shared by the CPU kernel and the CUDA source NVRTC builds.
//
// Each step is written with the functors of the per-op form of the same optimizer (lerp_,
// mul_, addcmul_, sqrt, addcdiv_ in src/optim), in the same order, so that the fused and the
// per-op updates agree to rounding (exactly, where the two compilers contract the same
// multiply-adds). Values are opmath: float for float16/bfloat16 storage.
#pragma once

#include "kiln/math/functors.h"

namespace kiln::math {

// Adam and AdamW. scale and eps_term carry the bias corrections of this parameter's step:
// scale = bc1 / sqrt(bc2), eps_term = eps * bc1 (bc_i = 1 - beta_i^step), so that
//   param -= lr * exp_avg / (sqrt(v) * scale + eps_term)
// equals PyTorch's  param -= lr / bc1 * exp_avg / (sqrt(v) / sqrt(bc2) + eps).
template <class T>
struct AdamUpdate {
  T lr, one_minus_beta1, beta2, one_minus_beta2, weight_decay;
  T decay;  // AdamW: 1 - lr * weight_decay
  T scale, eps_term;
  bool maximize, decoupled, amsgrad;

  // The update of a parameter whose step counter reads `step` (after this step's increment): the
  // bias corrections in float64 from it, as the per-op form computes them.
  KILN_HD static AdamUpdate at_step(double lr, double beta1, double beta2, double eps, double weight_decay,
                                    double step, bool maximize, bool decoupled, bool amsgrad) {
    const double bc1 = 1.0 - std::pow(beta1, step);
    const double sqrt_bc2 = std::sqrt(1.0 - std::pow(beta2, step));
    return {T(lr),           T(1.0 - beta1),           T(beta2),          T(1.0 - beta2),
            T(weight_decay), T(1.0 - lr * weight_decay), T(bc1 / sqrt_bc2), T(bc1 * eps),
            maximize,        decoupled,                amsgrad};
  }

  // Element k of arrays stored as S (T is S's opmath type): loads, updates, stores back.
  // max_exp_avg_sq is read and written only with amsgrad (a caller that fixes the flags in a local
  // copy lets the compiler drop every branch and vectorize the loop).
  template <class S>
  KILN_HD KILN_MATH_INLINE void update(S* param, const S* grad, S* exp_avg, S* exp_avg_sq, S* max_exp_avg_sq,
                                       long long k) const {
    T p = static_cast<T>(param[k]), m = static_cast<T>(exp_avg[k]), v = static_cast<T>(exp_avg_sq[k]);
    T vmax = amsgrad ? static_cast<T>(max_exp_avg_sq[k]) : T(0);
    (*this)(p, static_cast<T>(grad[k]), m, v, vmax);
    param[k] = static_cast<S>(p);
    exp_avg[k] = static_cast<S>(m);
    exp_avg_sq[k] = static_cast<S>(v);
    if (amsgrad) max_exp_avg_sq[k] = static_cast<S>(vmax);
  }

  KILN_HD KILN_MATH_INLINE void operator()(T& param, T grad, T& exp_avg, T& exp_avg_sq, T& max_exp_avg_sq) const {
    T g = maximize ? -grad : grad;
    if (weight_decay != T(0)) {
      if (decoupled) param = Mul{}(param, decay);
      else g = AddScaled<T>{weight_decay}(g, param);
    }
    exp_avg = Lerp{}(exp_avg, g, one_minus_beta1);
    exp_avg_sq = Addcmul<T>{one_minus_beta2}(Mul{}(exp_avg_sq, beta2), g, g);
    T v = exp_avg_sq;
    if (amsgrad) {
      max_exp_avg_sq = Maximum{}(max_exp_avg_sq, exp_avg_sq);
      v = max_exp_avg_sq;
    }
    const T denom = Add{}(Mul{}(Sqrt{}(v), scale), eps_term);
    param = Addcdiv<T>{-lr}(param, exp_avg, denom);
  }
};

// SGD, as torch.optim.SGD's single-tensor form:
//   d = grad (negated if maximize) + weight_decay * param
//   with momentum: buf = d on the buffer's first step, else buf * momentum + (1 - dampening) * d;
//                  d = nesterov ? d + momentum * buf : buf
//   param -= lr * d
// `first` says this parameter's momentum buffer starts at this step (its old contents unread).
template <class T>
struct SgdUpdate {
  T lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov, maximize, first;

  // Element k of arrays stored as S (T is S's opmath type); momentum_buffer is null without momentum.
  template <class S>
  KILN_HD KILN_MATH_INLINE void update(S* param, const S* grad, S* momentum_buffer, long long k) const {
    update(param, grad, momentum_buffer, momentum_buffer != nullptr, k);
  }
  // The same with the momentum decided by the caller (a constant lets the compiler drop the branches).
  template <class S>
  KILN_HD KILN_MATH_INLINE void update(S* param, const S* grad, S* momentum_buffer, bool with_momentum,
                                       long long k) const {
    T p = static_cast<T>(param[k]);
    T buf = with_momentum && !first ? static_cast<T>(momentum_buffer[k]) : T(0);
    (*this)(p, static_cast<T>(grad[k]), buf, with_momentum);
    param[k] = static_cast<S>(p);
    if (with_momentum) momentum_buffer[k] = static_cast<S>(buf);
  }

  KILN_HD KILN_MATH_INLINE void operator()(T& param, T grad, T& buf, bool with_momentum) const {
    T d = maximize ? -grad : grad;
    if (weight_decay != T(0)) d = AddScaled<T>{weight_decay}(d, param);
    if (with_momentum) {
      buf = first ? d : AddScaled<T>{one_minus_dampening}(Mul{}(buf, momentum), d);
      d = nesterov ? AddScaled<T>{momentum}(d, buf) : buf;
    }
    param = AddScaled<T>{-lr}(param, d);
  }
};

}  // namespace kiln::math
