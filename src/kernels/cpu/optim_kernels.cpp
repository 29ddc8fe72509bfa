// The fused Adam/AdamW and SGD updates on the CPU (kernels/fused_optim.h): every parameter's
// elements in one parallel loop over fixed-size chunks, so that small tensors share threads and
// each array is read and written once.
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
void for_each_chunk(const std::vector<Tensor>& params, Update&& update) {
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
  for_each_chunk(l.params, [&](size_t i, int64_t begin, int64_t end) {
    T* p = static_cast<T*>(l.params[i].impl().data());
    const T* g = static_cast<const T*>(l.grads[i].impl().data());
    T* m = static_cast<T*>(l.exp_avgs[i].impl().data());
    T* v = static_cast<T*>(l.exp_avg_sqs[i].impl().data());
    T* vmax = h.amsgrad ? static_cast<T*>(l.max_exp_avg_sqs[i].impl().data()) : nullptr;
    const math::AdamUpdate<O> f = updates[i];
    for (int64_t k = begin; k < end; ++k) f.update(p, g, m, v, vmax, k);
  });
}

template <class T>
void fused_sgd_typed(const SgdLists& l, const SgdHyper& h) {
  using O = cpu::opmath_t<T>;
  const bool momentum = !l.momentum_buffers.empty();
  for_each_chunk(l.params, [&](size_t i, int64_t begin, int64_t end) {
    T* p = static_cast<T*>(l.params[i].impl().data());
    const T* g = static_cast<const T*>(l.grads[i].impl().data());
    T* buf = momentum ? static_cast<T*>(l.momentum_buffers[i].impl().data()) : nullptr;
    const math::SgdUpdate<O> f{O(h.lr), O(h.momentum), O(1.0 - h.dampening), O(h.weight_decay),
                               h.nesterov, h.maximize, momentum && l.first[i] != 0};
    for (int64_t k = begin; k < end; ++k) f.update(p, g, buf, k);
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

}  // namespace kiln::detail
