// The fused Adam/AdamW update on the CPU (kernels/fused_optim.h): every parameter's elements in
// one parallel loop over fixed-size chunks, so that small tensors share threads and each array
// is read and written once.
#include <cstdint>
#include <vector>

#include "kernels/cpu/loops.h"
#include "kernels/fused_optim.h"
#include "kiln/math/optim.h"

namespace kiln::detail {

namespace {

constexpr int64_t kChunk = 16384;

template <class T>
void fused_adam_typed(const AdamLists& l, const AdamHyper& h) {
  using O = cpu::opmath_t<T>;
  const size_t n = l.params.size();
  std::vector<math::AdamUpdate<O>> updates(n);
  struct Chunk {
    size_t tensor;
    int64_t begin, end;
  };
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < n; ++i) {
    float& step = *static_cast<float*>(l.steps[i].impl().data());
    step += 1.0f;
    updates[i] = math::AdamUpdate<O>::at_step(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, step, h.maximize,
                                              h.decoupled, h.amsgrad);
    const int64_t numel = l.params[i].numel();
    for (int64_t b = 0; b < numel; b += kChunk) chunks.push_back({i, b, std::min(numel, b + kChunk)});
  }
  auto run = [&](const Chunk& c) {
    T* p = static_cast<T*>(l.params[c.tensor].impl().data());
    const T* g = static_cast<const T*>(l.grads[c.tensor].impl().data());
    T* m = static_cast<T*>(l.exp_avgs[c.tensor].impl().data());
    T* v = static_cast<T*>(l.exp_avg_sqs[c.tensor].impl().data());
    T* vmax = h.amsgrad ? static_cast<T*>(l.max_exp_avg_sqs[c.tensor].impl().data()) : nullptr;
    const math::AdamUpdate<O> f = updates[c.tensor];
    for (int64_t k = c.begin; k < c.end; ++k) f.update(p, g, m, v, vmax, k);
  };
  // One chunk is about kChunk elements of work: a grain of a few chunks per thread.
  cpu::parallel_for(static_cast<int64_t>(chunks.size()), std::max<int64_t>(1, cpu::kGrainSize / kChunk),
                    [&](int64_t b, int64_t e) {
                      for (int64_t c = b; c < e; ++c) run(chunks[static_cast<size_t>(c)]);
                    });
}

}  // namespace

void fused_adam_cpu(const AdamLists& l, const AdamHyper& h) {
  if (l.params.empty()) return;
  switch (l.params[0].dtype()) {
    case DType::float32: return fused_adam_typed<float>(l, h);
    case DType::float64: return fused_adam_typed<double>(l, h);
    case DType::float16: return fused_adam_typed<Half>(l, h);
    case DType::bfloat16: return fused_adam_typed<BFloat16>(l, h);
    default:
      throw Error("[kiln::optim] the fused Adam update takes floating parameters. This is a Kiln bug.");
  }
}

}  // namespace kiln::detail
