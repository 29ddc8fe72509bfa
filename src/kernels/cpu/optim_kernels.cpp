// The fused Adam/AdamW and SGD updates on the CPU (kernels/fused_optim.h), the kernels of
// _fused_adam_ and _fused_sgd_: every parameter's elements in one parallel loop over fixed-size
// chunks, so that small tensors share threads and each array is read and written once.
#include <cstdint>
#include <vector>

#include "kernels/cpu/loops.h"
#include "kernels/fused_optim.h"
#include "kiln/math/optim.h"

namespace kiln::detail {

namespace {

constexpr int64_t kChunk = 16384;

// Runs update(i, begin, end) over every parameter i's elements in chunks of kChunk, the chunks
// of all parameters split across threads together.
template <class Update>
void for_each_chunk(std::span<const Tensor> params, Update&& update) {
  struct Chunk {
    size_t tensor;
    int64_t begin, end;
  };
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t numel = params[i].numel();
    for (int64_t b = 0; b < numel; b += kChunk) chunks.push_back({i, b, std::min(numel, b + kChunk)});
  }
  // One chunk is about kChunk elements of work: a grain of a few chunks per thread.
  cpu::parallel_for(static_cast<int64_t>(chunks.size()), std::max<int64_t>(1, cpu::kGrainSize / kChunk),
                    [&](int64_t b, int64_t e) {
                      for (int64_t c = b; c < e; ++c) {
                        const Chunk& chunk = chunks[static_cast<size_t>(c)];
                        update(chunk.tensor, chunk.begin, chunk.end);
                      }
                    });
}

// The element loops take the update's flags as template arguments, fixed in a local copy of the
// update, so that the compiler drops the branches of kiln/math/optim.h and vectorizes: with them
// as run-time values the loop stayed scalar, bound by its square roots and divisions instead of
// memory (DenseNet-121's Adam step on one core: 25.7 ms before, kiln_bench_ops Optim_*).
enum class Decay { none, l2, decoupled };

template <bool kAmsgrad, bool kMaximize, Decay kDecay, class T, class O>
void adam_elements(math::AdamUpdate<O> f, T* p, const T* g, T* m, T* v, T* vmax, int64_t begin, int64_t end) {
  f.amsgrad = kAmsgrad;
  f.maximize = kMaximize;
  f.decoupled = kDecay == Decay::decoupled;
  if constexpr (kDecay == Decay::none) f.weight_decay = O(0);
#pragma omp simd
  for (int64_t k = begin; k < end; ++k) f.update(p, g, m, v, vmax, k);
}

template <class T, class O>
using AdamLoop = void (*)(math::AdamUpdate<O>, T*, const T*, T*, T*, T*, int64_t, int64_t);

template <class T, class O>
AdamLoop<T, O> adam_loop(const AdamHyper& h) {
  auto pick = [&]<bool kAmsgrad, bool kMaximize>() -> AdamLoop<T, O> {
    if (h.weight_decay == 0.0) return adam_elements<kAmsgrad, kMaximize, Decay::none, T, O>;
    if (h.decoupled) return adam_elements<kAmsgrad, kMaximize, Decay::decoupled, T, O>;
    return adam_elements<kAmsgrad, kMaximize, Decay::l2, T, O>;
  };
  if (h.amsgrad) return h.maximize ? pick.template operator()<true, true>() : pick.template operator()<true, false>();
  return h.maximize ? pick.template operator()<false, true>() : pick.template operator()<false, false>();
}

template <class T>
void fused_adam_typed(const AdamLists& l, const AdamHyper& h) {
  using O = cpu::opmath_t<T>;
  std::vector<math::AdamUpdate<O>> updates(l.params.size());
  for (size_t i = 0; i < l.params.size(); ++i) {
    float& step = *static_cast<float*>(l.steps[i].impl().data());
    step += 1.0f;
    updates[i] = math::AdamUpdate<O>::at_step(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, step, h.maximize,
                                              h.decoupled, h.amsgrad);
  }
  const AdamLoop<T, O> loop = adam_loop<T, O>(h);
  for_each_chunk(l.params, [&](size_t i, int64_t begin, int64_t end) {
    loop(updates[i], static_cast<T*>(l.params[i].impl().data()), static_cast<const T*>(l.grads[i].impl().data()),
         static_cast<T*>(l.exp_avgs[i].impl().data()), static_cast<T*>(l.exp_avg_sqs[i].impl().data()),
         h.amsgrad ? static_cast<T*>(l.max_exp_avg_sqs[i].impl().data()) : nullptr, begin, end);
  });
}

template <bool kMomentum, bool kFirst, bool kNesterov, bool kMaximize, bool kDecay, class T, class O>
void sgd_elements(math::SgdUpdate<O> f, T* p, const T* g, T* buf, int64_t begin, int64_t end) {
  f.first = kFirst;
  f.nesterov = kNesterov;
  f.maximize = kMaximize;
  if constexpr (!kDecay) f.weight_decay = O(0);
#pragma omp simd
  for (int64_t k = begin; k < end; ++k) f.update(p, g, buf, kMomentum, k);
}

template <class T, class O>
using SgdLoop = void (*)(math::SgdUpdate<O>, T*, const T*, T*, int64_t, int64_t);

// The loop for one parameter: its flags, and whether its momentum buffer starts at this step.
template <class T, class O>
SgdLoop<T, O> sgd_loop(const SgdHyper& h, bool momentum, bool first) {
  auto with = [&]<bool kMomentum, bool kFirst>() -> SgdLoop<T, O> {
    auto decay = [&]<bool kNesterov, bool kMaximize>() -> SgdLoop<T, O> {
      if (h.weight_decay == 0.0) return sgd_elements<kMomentum, kFirst, kNesterov, kMaximize, false, T, O>;
      return sgd_elements<kMomentum, kFirst, kNesterov, kMaximize, true, T, O>;
    };
    if (h.nesterov) return h.maximize ? decay.template operator()<true, true>() : decay.template operator()<true, false>();
    return h.maximize ? decay.template operator()<false, true>() : decay.template operator()<false, false>();
  };
  if (!momentum) return with.template operator()<false, false>();
  return first ? with.template operator()<true, true>() : with.template operator()<true, false>();
}

template <class T>
void fused_sgd_typed(const SgdLists& l, const SgdHyper& h) {
  using O = cpu::opmath_t<T>;
  const bool momentum = !l.momentum_buffers.empty();
  const SgdLoop<T, O> later = sgd_loop<T, O>(h, momentum, false), first = sgd_loop<T, O>(h, momentum, true);
  for_each_chunk(l.params, [&](size_t i, int64_t begin, int64_t end) {
    const bool starts = momentum && l.first[i] != 0;
    const math::SgdUpdate<O> f{O(h.lr), O(h.momentum), O(1.0 - h.dampening), O(h.weight_decay),
                               h.nesterov, h.maximize, starts};
    (starts ? first : later)(f, static_cast<T*>(l.params[i].impl().data()), static_cast<const T*>(l.grads[i].impl().data()),
                             momentum ? static_cast<T*>(l.momentum_buffers[i].impl().data()) : nullptr, begin, end);
  });
}

}  // namespace

void fused_adam_cpu(const AdamLists& l, const AdamHyper& h) {
  if (l.params.empty()) return;
  KILN_DISPATCH_FLOATING(l.params[0].dtype(), "optim (fused Adam)", [&] { fused_adam_typed<scalar_t>(l, h); });
}

void fused_sgd_cpu(const SgdLists& l, const SgdHyper& h) {
  if (l.params.empty()) return;
  KILN_DISPATCH_FLOATING(l.params[0].dtype(), "optim (fused SGD)", [&] { fused_sgd_typed<scalar_t>(l, h); });
}

namespace {

[[maybe_unused]] const bool registered = [] {
  register_fused_optimizer_kernels(DeviceType::cpu, fused_adam_cpu, fused_sgd_cpu);
  return true;
}();

}  // namespace

}  // namespace kiln::detail
