// conv2d_bn's folded parameters and their cache (see fold_batch_norm.h).
#include "kernels/fold_batch_norm.h"

#include <array>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "kiln/detail/tensor_impl.h"
#include "kiln/ops.h"

namespace kiln::detail {

namespace {

constexpr int kParams = 6;  // weight, bias, bn_weight, bn_bias, running_mean, running_var

struct FoldKey {
  std::array<const void*, kParams> storage{};
  std::array<uint64_t, kParams> version{};
  std::array<int64_t, kParams> offset{};
  double eps = 0;
  bool operator==(const FoldKey&) const = default;
};

struct FoldKeyHash {
  size_t operator()(const FoldKey& k) const {
    size_t h = std::hash<double>{}(k.eps);
    for (int i = 0; i < kParams; ++i)
      h = (h * 1000003u) ^ std::hash<const void*>{}(k.storage[i]) ^ (k.version[i] * 0x9e3779b97f4a7c15ull) ^
          static_cast<size_t>(k.offset[i]);
    return h;
  }
};

struct Folded {
  std::array<std::weak_ptr<Storage>, kParams> sources;  // a freed source's address may be reused
  Tensor weight, bias;
};

// Stale versions of trained parameters pile up otherwise.
constexpr size_t kMaxEntries = 4096;

}  // namespace

std::pair<Tensor, Tensor> fold_batch_norm(const OpCall& call, bool use_cache) {
  // Inputs 1..6: weight, bias, bn_weight, bn_bias, running_mean, running_var.
  std::array<const Tensor*, kParams> params;
  for (int i = 0; i < kParams; ++i) params[i] = &call.input(i + 1);
  const Tensor &w = *params[0], &bias = *params[1], &bn_weight = *params[2], &bn_bias = *params[3];
  const Tensor &mean = *params[4], &var = *params[5];
  const double eps = call.double_attr(4);
  FoldKey key;
  key.eps = eps;
  for (int i = 0; i < kParams; ++i) {
    if (!params[i]->defined()) continue;
    key.storage[i] = params[i]->impl().storage.get();
    key.version[i] = params[i]->version();
    key.offset[i] = params[i]->storage_offset();
  }
  static std::mutex mutex;
  static auto* cache = new std::unordered_map<FoldKey, Folded, FoldKeyHash>;  // never destroyed: used at exit
  if (use_cache) {
    std::lock_guard lock(mutex);
    if (auto it = cache->find(key); it != cache->end()) {
      bool alive = true;
      for (int i = 0; i < kParams; ++i)
        if (params[i]->defined()) alive = alive && it->second.sources[i].lock() == params[i]->impl().storage;
      if (alive) return {it->second.weight, it->second.bias};
      cache->erase(it);
    }
  }
  Tensor scale = rsqrt(var.to(w.dtype()) + eps);
  if (bn_weight.defined()) scale = scale * bn_weight.to(w.dtype());
  // The folded weight keeps the weight's layout: it decides the convolution's layout, as the
  // weight does in the meta.
  Tensor folded_w = (w * scale.view({w.sizes()[0], 1, 1, 1})).contiguous(w.suggest_memory_format());
  Tensor folded_b = (bias.defined() ? bias.to(w.dtype()) - mean.to(w.dtype()) : -mean.to(w.dtype())) * scale;
  if (bn_bias.defined()) folded_b = folded_b + bn_bias.to(w.dtype());
  if (!use_cache) return {folded_w, folded_b};
  Folded entry;
  for (int i = 0; i < kParams; ++i)
    if (params[i]->defined()) entry.sources[i] = params[i]->impl().storage;
  entry.weight = folded_w;
  entry.bias = folded_b;
  std::lock_guard lock(mutex);
  if (cache->size() >= kMaxEntries) cache->clear();
  (*cache)[key] = std::move(entry);
  return {folded_w, folded_b};
}

}  // namespace kiln::detail
