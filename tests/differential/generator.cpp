#include "generator.h"

#include <algorithm>
#include <functional>
#include <numeric>

#include "ops.h"

namespace kiln::differential {

namespace {

// splitmix64: the same programs from the same seed on every platform (std:: distributions are
// implementation-defined).
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int64_t uniform(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1));
  }
  bool chance(double p) { return static_cast<double>(next() >> 11) * 0x1.0p-53 < p; }
  template <class T>
  const T& pick(const std::vector<T>& v) {
    return v[static_cast<size_t>(uniform(0, static_cast<int64_t>(v.size()) - 1))];
  }
  // An index drawn in proportion to `weights`.
  size_t weighted(const std::vector<int>& weights) {
    int total = std::accumulate(weights.begin(), weights.end(), 0);
    int64_t r = uniform(0, total - 1);
    for (size_t i = 0; i < weights.size(); ++i) {
      if (r < weights[i]) return i;
      r -= weights[i];
    }
    return weights.size() - 1;
  }
  std::vector<int64_t> permutation(int64_t n) {
    std::vector<int64_t> p(n);
    std::iota(p.begin(), p.end(), 0);
    for (int64_t i = n - 1; i > 0; --i) std::swap(p[i], p[uniform(0, i)]);
    return p;
  }

 private:
  uint64_t state_;
};

enum class Flavor { pointwise, dense, image };

enum class Family {
  unary,
  binary,
  scalar,
  selection,
  reduction,
  view,
  cat,
  gemm,
  conv,
  norm,
  in_place
};
constexpr int kNumFamilies = 11;

// How often each family is drawn, per flavor (pointwise, dense, image).
const int kFamilyWeights[3][kNumFamilies] = {
    // unary binary scalar selection reduction view cat gemm conv norm in_place
    {16, 18, 12, 8, 10, 12, 3, 3, 0, 0, 14},
    {12, 12, 8, 6, 10, 10, 3, 14, 0, 7, 14},
    {12, 12, 8, 5, 8, 10, 3, 3, 14, 9, 12},
};

const std::vector<HostScalar> kFloatScalars = {{2.5}, {-1.0},    {0.5},     {100.0},   {-0.75},
                                               {1.5}, {3, true}, {2, true}, {-2, true}};
const std::vector<HostScalar> kIntegralScalars = {{2, true}, {3, true}, {-1, true}, {1, true}};
const std::vector<HostScalar> kAlphas = {{2.5}, {-1.0}, {0.5}, {2, true}};

bool is_numeric(const ValueType& v) {
  return v.dtype != kBool;
}
bool is_floating(const ValueType& v) {
  return is_float(v.dtype);
}
bool broadcasts_with(const ValueType& a, const ValueType& b) {
  std::vector<int64_t> out;
  return broadcast_sizes(a.sizes, b.sizes, out);
}
bool broadcasts_to(const ValueType& from, const ValueType& to) {
  std::vector<int64_t> out;
  return broadcast_sizes(to.sizes, from.sizes, out) && out == to.sizes;
}

class Generator {
 public:
  Generator(uint64_t seed, const GeneratorOptions& options) : random_(seed), options_(options) {
    program_.seed = seed;
  }

  Program run() {
    flavor_ = static_cast<Flavor>(random_.weighted({50, 25, 25}));
    add_data_inputs();
    program_.outputs = {{0, 0}};  // a placeholder, so that infer() accepts partial programs
    refresh();
    const int64_t target = random_.uniform(options_.min_ops, options_.max_ops);
    for (int attempt = 0;
         static_cast<int64_t>(program_.ops.size()) < target && attempt < 40 * target; ++attempt) {
      Program saved = program_;
      // A builder may add a helper op first (a comparison for `where`, a clone to write into).
      if (!add_op() || static_cast<int>(program_.ops.size()) > options_.max_ops || !refresh()) {
        program_ = std::move(saved);
        refresh();
      }
    }
    choose_outputs();
    return program_;
  }

 private:
  // ---------------- inputs ----------------

  void add_data_inputs() {
    std::vector<int64_t> base;
    switch (flavor_) {
      case Flavor::pointwise: {
        int64_t rank = static_cast<int64_t>(random_.weighted({0, 2, 4, 3, 1}));
        for (int64_t d = 0; d < rank; ++d)
          base.push_back(random_.chance(0.2) ? 1 : random_.uniform(2, 5));
        break;
      }
      case Flavor::dense:
        base = {random_.uniform(2, 4), random_.uniform(2, 5)};
        if (random_.chance(0.3)) base.insert(base.begin() + 1, random_.uniform(2, 3));
        break;
      case Flavor::image:
        base = {random_.uniform(1, 2), random_.uniform(1, 3), random_.uniform(3, 5),
                random_.uniform(3, 5)};
        break;
    }
    const int64_t count = random_.uniform(1, 4);
    for (int64_t i = 0; i < count; ++i) {
      InputSpec in;
      in.data_seed = data_seed(static_cast<int>(i));
      in.sizes = i == 0 ? base : broadcast_partner(base);
      in.dtype = data_dtype(i == 0);
      in.requires_grad = is_float(in.dtype) && random_.chance(0.45);
      choose_layout(in, 0.45);
      program_.inputs.push_back(in);
    }
  }

  // A trailing part of `base` with some dims set to 1, or a 0-dim shape.
  std::vector<int64_t> broadcast_partner(const std::vector<int64_t>& base) {
    if (random_.chance(0.1)) return {};
    int64_t keep =
        random_.uniform(flavor_ == Flavor::pointwise ? 0 : 1, static_cast<int64_t>(base.size()));
    std::vector<int64_t> s(base.end() - keep, base.end());
    for (int64_t& d : s)
      if (random_.chance(0.3)) d = 1;
    return s;
  }

  DType data_dtype(bool first) {
    if (first) return random_.chance(0.9) ? kFloat32 : kFloat64;
    if (flavor_ != Flavor::pointwise)
      return random_.pick(std::vector<DType>{kFloat32, kFloat32, kFloat32, kFloat64, kInt64});
    const std::vector<int> weights = {70, 8, 12, 10};
    return std::vector<DType>{kFloat32, kFloat64, kInt64, kBool}[random_.weighted(weights)];
  }

  void choose_layout(InputSpec& in, double non_contiguous) {
    const int64_t rank = static_cast<int64_t>(in.sizes.size());
    if (rank == 0 || !random_.chance(non_contiguous)) return;
    int kind = static_cast<int>(random_.uniform(rank >= 2 ? 0 : 1, 2));
    if (kind == 0) {
      in.layout = Layout::permuted;
      do in.layout_dims = random_.permutation(rank);
      while (std::is_sorted(in.layout_dims.begin(), in.layout_dims.end()));
    } else if (kind == 1) {
      in.layout = Layout::strided;
      in.layout_dims = {random_.uniform(0, rank - 1)};
    } else {
      // An expanded input broadcasts a size-1 base along a dim of size > 1.
      std::vector<int64_t> wide;
      for (int64_t d = 0; d < rank; ++d)
        if (in.sizes[d] > 1) wide.push_back(d);
      if (wide.empty()) return;
      in.layout = Layout::expanded;
      in.layout_dims = {random_.pick(wide)};
    }
  }

  // Adds an input after the existing ones (weights, biases, running statistics); ids of values
  // after the inputs move up by one, including those in `held`.
  int add_input(InputSpec spec, std::initializer_list<int*> held = {}) {
    const int id = static_cast<int>(program_.inputs.size());
    auto shift = [id](int& v) {
      if (v >= id) ++v;
    };
    for (Op& op : program_.ops)
      for (int& a : op.args) shift(a);
    for (int* h : held) shift(*h);
    spec.data_seed = data_seed(id);
    program_.inputs.push_back(std::move(spec));
    refresh();
    return id;
  }

  int add_parameter(std::vector<int64_t> sizes, DType dtype,
                    std::initializer_list<int*> held = {}) {
    InputSpec in;
    in.sizes = std::move(sizes);
    in.dtype = dtype;
    in.requires_grad = random_.chance(0.7);
    choose_layout(in, 0.2);
    return add_input(std::move(in), held);
  }

  // ---------------- values ----------------

  bool refresh() {
    Inference inf = infer(program_);
    if (!inf.ok()) return false;
    for (const ValueType& v : inf.values)
      if (v.numel() > 1024) return false;  // keep tensors tiny
    values_ = std::move(inf.values);
    return true;
  }

  // A value satisfying `ok`, most often the newest one; -1 when none does.
  int pick(const std::function<bool(const ValueType&)>& ok) {
    std::vector<int> candidates;
    for (size_t i = 0; i < values_.size(); ++i)
      if (ok(values_[i])) candidates.push_back(static_cast<int>(i));
    if (candidates.empty()) return -1;
    if (random_.chance(0.45)) return candidates.back();
    return random_.pick(candidates);
  }

  int newest() const { return static_cast<int>(values_.size()) - 1; }

  Op& append(OpKind kind, std::vector<int> args, std::vector<int64_t> ints = {},
             std::vector<HostScalar> scalars = {}) {
    program_.ops.push_back(Op{kind, std::move(args), std::move(ints), std::move(scalars)});
    return program_.ops.back();
  }

  // Appends an op and refreshes the types so that the next op can read its result.
  bool append_and_refresh(OpKind kind, std::vector<int> args, std::vector<int64_t> ints = {},
                          std::vector<HostScalar> scalars = {}) {
    append(kind, std::move(args), std::move(ints), std::move(scalars));
    return refresh();
  }

  HostScalar scalar_for(DType t) {
    return random_.pick(is_float(t) ? kFloatScalars : kIntegralScalars);
  }

  // A bool value that broadcasts with `with`, made by a comparison when none exists.
  int bool_value(int with) {
    int mask = pick(
        [&](const ValueType& v) { return v.dtype == kBool && broadcasts_with(v, values_[with]); });
    if (mask >= 0 && random_.chance(0.6)) return mask;
    int x = pick(
        [&](const ValueType& v) { return is_numeric(v) && broadcasts_with(v, values_[with]); });
    if (x < 0) return -1;
    OpKind kind = random_.chance(0.5) ? OpKind::gt_scalar : OpKind::lt_scalar;
    if (!append_and_refresh(kind, {x}, {},
                            {HostScalar{random_.pick(std::vector<double>{0.0, 0.5, -0.5})}}))
      return -1;
    return newest();
  }

  // ---------------- ops ----------------

  bool add_op() {
    std::vector<int> weights(kFamilyWeights[static_cast<int>(flavor_)],
                             kFamilyWeights[static_cast<int>(flavor_)] + kNumFamilies);
    switch (static_cast<Family>(random_.weighted(weights))) {
      case Family::unary:
        return add_unary();
      case Family::binary:
        return add_binary();
      case Family::scalar:
        return add_scalar();
      case Family::selection:
        return add_selection();
      case Family::reduction:
        return add_reduction();
      case Family::view:
        return add_view();
      case Family::cat:
        return add_cat();
      case Family::gemm:
        return add_gemm();
      case Family::conv:
        return add_conv();
      case Family::norm:
        return add_batch_norm();
      case Family::in_place:
        return add_in_place();
    }
    return false;
  }

  bool add_unary() {
    static const std::vector<OpKind> kinds = {
        OpKind::neg,  OpKind::abs,  OpKind::exp,     OpKind::log,        OpKind::sin,
        OpKind::cos,  OpKind::tanh, OpKind::sigmoid, OpKind::relu,       OpKind::gelu,
        OpKind::silu, OpKind::sqrt, OpKind::rsqrt,   OpKind::reciprocal, OpKind::erf};
    OpKind kind = random_.pick(kinds);
    bool integral_ok = kind == OpKind::neg || kind == OpKind::abs || kind == OpKind::relu;
    int x = pick([&](const ValueType& v) { return integral_ok ? is_numeric(v) : is_floating(v); });
    if (x < 0) return false;
    std::vector<int64_t> ints;
    if (kind == OpKind::gelu) ints = {random_.chance(0.3) ? 1 : 0};
    append(kind, {x}, ints);
    return true;
  }

  bool add_binary() {
    static const std::vector<OpKind> arithmetic = {OpKind::add, OpKind::sub,     OpKind::mul,
                                                   OpKind::div, OpKind::maximum, OpKind::minimum,
                                                   OpKind::pow};
    static const std::vector<OpKind> comparisons = {
        OpKind::eq, OpKind::ne, OpKind::lt,          OpKind::le,
        OpKind::gt, OpKind::ge, OpKind::logical_and, OpKind::logical_or};
    OpKind kind = random_.chance(0.8) ? random_.pick(arithmetic) : random_.pick(comparisons);
    int a = pick(is_numeric);
    if (a < 0) return false;
    int b = random_.chance(0.15) ? a : pick([&](const ValueType& v) {
      return is_numeric(v) && broadcasts_with(v, values_[a]);
    });
    if (b < 0) return false;
    if (random_.chance(0.5)) std::swap(a, b);
    std::vector<HostScalar> scalars;
    if ((kind == OpKind::add || kind == OpKind::sub) && random_.chance(0.3))
      scalars = {random_.pick(kAlphas)};
    append(kind, {a, b}, {}, scalars);
    return true;
  }

  bool add_scalar() {
    static const std::vector<OpKind> kinds = {
        OpKind::add_scalar, OpKind::sub_scalar, OpKind::rsub_scalar, OpKind::mul_scalar,
        OpKind::div_scalar, OpKind::pow_scalar, OpKind::pow_scalar,  OpKind::gt_scalar,
        OpKind::lt_scalar,  OpKind::clamp,      OpKind::clamp};
    OpKind kind = random_.pick(kinds);
    int x = pick(is_numeric);
    if (x < 0) return false;
    const ValueType& v = values_[x];
    if (kind == OpKind::clamp) {
      int64_t which = random_.uniform(1, 3);
      HostScalar lo = is_floating(v)
                          ? HostScalar{random_.pick(std::vector<double>{-1.0, -0.5, 0.0, 0.25})}
                          : HostScalar{-1, true};
      HostScalar hi = is_floating(v) ? HostScalar{random_.pick(std::vector<double>{0.5, 1.0, 1.5})}
                                     : HostScalar{1, true};
      append(kind, {x}, {which & 1, (which >> 1) & 1}, {lo, hi});
      return true;
    }
    HostScalar s = scalar_for(v.dtype);
    if (kind == OpKind::pow_scalar) {
      s = is_floating(v) ? random_.pick(std::vector<HostScalar>{
                               {2, true}, {3, true}, {0.5}, {-1.0}, {1.5}, {2.0}, {-2, true}})
                         : random_.pick(std::vector<HostScalar>{{2, true}, {3, true}});
    }
    if (kind == OpKind::div_scalar && s.value == 0) s = {2.5};
    append(kind, {x}, {}, {s});
    return true;
  }

  bool add_selection() {
    switch (random_.uniform(0, 4)) {
      case 0: {  // clamp with tensor bounds
        int x = pick(is_numeric);
        if (x < 0) return false;
        auto near = [&](const ValueType& v) {
          return is_numeric(v) && broadcasts_with(v, values_[x]);
        };
        int lo = pick(near), hi = pick(near);
        if (lo < 0 || hi < 0) return false;
        append(OpKind::clamp_tensor, {x, lo, hi});
        return true;
      }
      case 1:
      case 2: {  // where(condition, a, b | number)
        int a = pick(is_numeric);
        if (a < 0) return false;
        int condition = bool_value(a);
        if (condition < 0) return false;
        if (random_.chance(0.35)) {
          append(OpKind::where_scalar, {condition, a}, {}, {scalar_for(values_[a].dtype)});
          return true;
        }
        int b = pick(
            [&](const ValueType& v) { return is_numeric(v) && broadcasts_with(v, values_[a]); });
        if (b < 0) return false;
        append(OpKind::where, {condition, a, b});
        return true;
      }
      case 3: {  // lerp
        int a = pick(is_floating);
        if (a < 0) return false;
        int b = pick([&](const ValueType& v) {
          return v.dtype == values_[a].dtype && broadcasts_with(v, values_[a]);
        });
        if (b < 0) return false;
        append(OpKind::lerp, {a, b}, {},
               {HostScalar{random_.pick(std::vector<double>{0.25, 0.5, -0.5, 1.5})}});
        return true;
      }
      default: {  // masked_fill
        int x = pick(is_numeric);
        if (x < 0) return false;
        int mask = pick(
            [&](const ValueType& v) { return v.dtype == kBool && broadcasts_to(v, values_[x]); });
        if (mask < 0) {
          if (!append_and_refresh(random_.chance(0.5) ? OpKind::gt_scalar : OpKind::lt_scalar, {x},
                                  {}, {HostScalar{0.0}}))
            return false;
          mask = newest();
        }
        append(OpKind::masked_fill, {x, mask}, {}, {scalar_for(values_[x].dtype)});
        return true;
      }
    }
  }

  std::vector<int64_t> random_dims(int64_t rank, bool allow_all) {
    if (rank == 0)
      return allow_all && random_.chance(0.5) ? std::vector<int64_t>{} : std::vector<int64_t>{0};
    std::vector<int64_t> dims;
    if (allow_all && random_.chance(0.25)) return dims;
    std::vector<int64_t> order = random_.permutation(rank);
    int64_t k = random_.uniform(1, rank);
    for (int64_t i = 0; i < k; ++i)
      dims.push_back(random_.chance(0.2) ? order[i] - rank : order[i]);
    return dims;
  }

  bool add_reduction() {
    static const std::vector<OpKind> kinds = {
        OpKind::sum,     OpKind::sum,       OpKind::mean,       OpKind::amax,
        OpKind::amin,    OpKind::logsumexp, OpKind::var,        OpKind::var_mean,
        OpKind::softmax, OpKind::softmax,   OpKind::log_softmax};
    OpKind kind = random_.pick(kinds);
    bool integral_ok = kind == OpKind::sum || kind == OpKind::amax || kind == OpKind::amin;
    int x = pick([&](const ValueType& v) {
      return integral_ok ? (kind == OpKind::sum || is_numeric(v)) : is_floating(v);
    });
    if (x < 0) return false;
    const ValueType& v = values_[x];
    if (kind == OpKind::softmax || kind == OpKind::log_softmax) {
      int64_t rank = std::max<int64_t>(v.dim(), 1);
      append(kind, {x}, {random_.uniform(-rank, rank - 1)});
      return true;
    }
    int64_t keepdim = random_.chance(0.4) ? 1 : 0;
    std::vector<int64_t> dims = random_dims(v.dim(), kind != OpKind::logsumexp);
    std::vector<int64_t> ints = {keepdim};
    if (kind == OpKind::var || kind == OpKind::var_mean) {
      int64_t count = 1;
      for (int64_t d : dims) count *= v.dim() ? v.sizes[(d + v.dim()) % v.dim()] : 1;
      if (dims.empty()) count = v.numel();
      ints.push_back(count > 1 && random_.chance(0.6) ? 1 : 0);
    }
    ints.insert(ints.end(), dims.begin(), dims.end());
    append(kind, {x}, ints);
    return true;
  }

  std::vector<int64_t> reshape_target(const std::vector<int64_t>& s) {
    std::vector<int64_t> t = s;
    int64_t rank = static_cast<int64_t>(s.size());
    switch (random_.uniform(0, 3)) {
      case 0:  // flatten
        t = {std::accumulate(s.begin(), s.end(), int64_t{1}, std::multiplies<>())};
        break;
      case 1:  // merge two neighbours
        if (rank >= 2) {
          int64_t d = random_.uniform(0, rank - 2);
          t[d] *= t[d + 1];
          t.erase(t.begin() + d + 1);
        }
        break;
      case 2:  // split a dim
        for (int64_t d = 0; d < rank; ++d) {
          for (int64_t f : {2, 3}) {
            if (t[d] % f == 0 && t[d] > f) {
              t[d] /= f;
              t.insert(t.begin() + d + 1, f);
              d = rank;
              break;
            }
          }
        }
        break;
      default:  // a new dim of size 1
        t.insert(t.begin() + random_.uniform(0, rank), 1);
        break;
    }
    if (!t.empty() && random_.chance(0.3))
      t[random_.uniform(0, static_cast<int64_t>(t.size()) - 1)] = -1;
    return t;
  }

  bool add_view() {
    static const std::vector<OpKind> kinds = {
        OpKind::transpose, OpKind::permute,    OpKind::reshape, OpKind::reshape,   OpKind::view,
        OpKind::slice,     OpKind::slice,      OpKind::select,  OpKind::unsqueeze, OpKind::squeeze,
        OpKind::expand,    OpKind::contiguous, OpKind::clone,   OpKind::to_dtype};
    OpKind kind = random_.pick(kinds);
    int x = pick([](const ValueType&) { return true; });
    const ValueType& v = values_[x];
    const int64_t rank = v.dim();
    switch (kind) {
      case OpKind::transpose: {
        if (rank < 2) return false;
        std::vector<int64_t> p = random_.permutation(rank);
        append(kind, {x}, {p[0], random_.chance(0.3) ? p[1] - rank : p[1]});
        return true;
      }
      case OpKind::permute: {
        if (rank < 2) return false;
        append(kind, {x}, random_.permutation(rank));
        return true;
      }
      case OpKind::reshape:
      case OpKind::view:
        append(kind, {x}, reshape_target(v.sizes));
        return true;
      case OpKind::slice: {
        std::vector<int64_t> wide;
        for (int64_t d = 0; d < rank; ++d)
          if (v.sizes[d] >= 2) wide.push_back(d);
        if (wide.empty()) return false;
        int64_t d = random_.pick(wide), size = v.sizes[d];
        int64_t start = random_.uniform(0, size - 2), stop = random_.uniform(start + 1, size);
        append(kind, {x}, {d, start, stop, random_.chance(0.4) ? 2 : 1});
        return true;
      }
      case OpKind::select: {
        if (rank == 0) return false;
        int64_t d = random_.uniform(0, rank - 1), size = v.sizes[d];
        append(kind, {x}, {d, random_.uniform(-size, size - 1)});
        return true;
      }
      case OpKind::unsqueeze:
        append(kind, {x}, {random_.uniform(-(rank + 1), rank)});
        return true;
      case OpKind::squeeze: {
        if (rank == 0) return false;
        std::vector<int64_t> ones;
        for (int64_t d = 0; d < rank; ++d)
          if (v.sizes[d] == 1) ones.push_back(d);
        append(kind, {x},
               {ones.empty() || random_.chance(0.2) ? random_.uniform(0, rank - 1)
                                                    : random_.pick(ones)});
        return true;
      }
      case OpKind::expand: {
        std::vector<int64_t> sizes = v.sizes;
        bool grew = false;
        for (int64_t& s : sizes) {
          if (s == 1 && random_.chance(0.6)) {
            s = random_.uniform(2, 3);
            grew = true;
          } else if (random_.chance(0.3)) {
            s = -1;
          }
        }
        if (!grew || random_.chance(0.3)) sizes.insert(sizes.begin(), 2);
        append(kind, {x}, sizes);
        return true;
      }
      case OpKind::to_dtype: {
        DType to = v.dtype == kFloat32 ? kFloat64 : kFloat32;
        append(kind, {x}, {static_cast<int64_t>(to)});
        return true;
      }
      default:
        append(kind, {x});
        return true;
    }
  }

  bool add_cat() {
    int x = pick([](const ValueType& v) { return v.dim() >= 1; });
    if (x < 0) return false;
    const int64_t rank = values_[x].dim();
    int64_t d = random_.uniform(0, rank - 1);
    auto fits = [&](const ValueType& v) {
      if (v.dim() != rank) return false;
      for (int64_t i = 0; i < rank; ++i)
        if (i != d && v.sizes[i] != values_[x].sizes[i]) return false;
      return true;
    };
    std::vector<int> parts = {x, pick(fits)};
    if (random_.chance(0.3)) parts.push_back(pick(fits));
    if (random_.chance(0.5)) std::swap(parts[0], parts[1]);
    append(OpKind::cat, parts, {random_.chance(0.3) ? d - rank : d});
    return true;
  }

  bool add_gemm() {
    int x = pick([](const ValueType& v) { return is_float(v.dtype) && v.dim() >= 1; });
    if (x < 0) return false;
    const ValueType v = values_[x];
    const int64_t k = v.sizes.back();
    if (random_.chance(0.55)) {
      int w = add_parameter({random_.uniform(1, 5), k}, v.dtype, {&x});
      int bias =
          random_.chance(0.6) ? add_parameter({program_.inputs[w].sizes[0]}, v.dtype, {&x}) : -1;
      append(OpKind::linear, {x, w, bias});
      return true;
    }
    // matmul with an existing value of a matching shape, or a new matrix on either side.
    int other = pick([&](const ValueType& o) {
      return o.dtype == v.dtype && o.dim() >= 1 && o.sizes[o.dim() >= 2 ? o.dim() - 2 : 0] == k;
    });
    if (other >= 0 && random_.chance(0.4)) {
      append(OpKind::matmul, {x, other});
      return true;
    }
    if (v.dim() >= 2 && random_.chance(0.3)) {
      int w = add_parameter({random_.uniform(1, 4), v.sizes[v.dim() - 2]}, v.dtype, {&x});
      append(OpKind::matmul, {w, x});
      return true;
    }
    std::vector<int64_t> sizes = random_.chance(0.25)
                                     ? std::vector<int64_t>{k}
                                     : std::vector<int64_t>{k, random_.uniform(1, 4)};
    int w = add_parameter(sizes, v.dtype, {&x});
    append(OpKind::matmul, {x, w});
    return true;
  }

  bool add_conv() {
    int x = pick([](const ValueType& v) { return is_float(v.dtype) && v.dim() == 4; });
    if (x < 0) return false;
    const ValueType v = values_[x];
    const int64_t channels = v.sizes[1];
    const int64_t groups = channels > 1 && random_.chance(0.2) ? channels : 1;
    const int64_t out = groups == 1 ? random_.uniform(1, 4) : channels * random_.uniform(1, 2);
    const int64_t padding = random_.uniform(0, 1), stride = random_.chance(0.2) ? 2 : 1;
    const int64_t kernel =
        std::min<int64_t>(random_.uniform(1, 3), std::min(v.sizes[2], v.sizes[3]) + 2 * padding);
    int w = add_parameter({out, channels / groups, kernel, kernel}, v.dtype, {&x});
    int bias = random_.chance(0.5) ? add_parameter({out}, v.dtype, {&x, &w}) : -1;
    append(OpKind::conv2d, {x, w, bias}, {stride, padding, groups});
    return true;
  }

  bool add_batch_norm() {
    bool training = random_.chance(0.7);
    int x = pick([&](const ValueType& v) {
      return is_float(v.dtype) && v.dim() >= 2 && v.dim() <= 4 &&
             (!training || v.numel() / v.sizes[1] >= 2);
    });
    if (x < 0) return false;
    const ValueType v = values_[x];
    const int64_t channels = v.sizes[1];
    InputSpec mean{.sizes = {channels}, .dtype = v.dtype};
    InputSpec variance{.sizes = {channels}, .dtype = v.dtype, .domain = Domain::positive};
    int running_mean = add_input(mean, {&x});
    int running_var = add_input(variance, {&x, &running_mean});
    int weight = random_.chance(0.6)
                     ? add_parameter({channels}, v.dtype, {&x, &running_mean, &running_var})
                     : -1;
    int bias = random_.chance(0.6)
                   ? add_parameter({channels}, v.dtype, {&x, &running_mean, &running_var, &weight})
                   : -1;
    append(OpKind::batch_norm, {x, running_mean, running_var, weight, bias}, {training ? 1 : 0},
           {HostScalar{random_.chance(0.5) ? 0.1 : 0.3}, HostScalar{1e-5}});
    return true;
  }

  // The target of an in-place write: a fresh clone, an intermediate, a view of one, or an input.
  int in_place_target() {
    auto writable = [](const ValueType& v) {
      return !v.overlapping && !v.grad_leaf && !v.view_of_grad;
    };
    const int num_inputs = static_cast<int>(program_.inputs.size());
    switch (random_.weighted({35, 25, 20, 20})) {
      case 0: {
        int x = pick([](const ValueType&) { return true; });
        if (!append_and_refresh(OpKind::clone, {x})) return -1;
        return newest();
      }
      case 1:
        return pick([&](const ValueType& v) { return writable(v) && v.storage >= num_inputs; });
      case 2: {
        int x = pick([&](const ValueType& v) {
          return writable(v) && !v.requires_grad && v.storage >= num_inputs && v.dim() >= 1;
        });
        if (x < 0) return -1;
        const ValueType& v = values_[x];
        int64_t d = random_.uniform(0, v.dim() - 1);
        bool ok =
            v.sizes[d] >= 2 && random_.chance(0.6)
                ? append_and_refresh(OpKind::slice, {x},
                                     {d, random_.uniform(0, v.sizes[d] - 2), v.sizes[d], 1})
                : append_and_refresh(OpKind::select, {x}, {d, random_.uniform(0, v.sizes[d] - 1)});
        return ok ? newest() : -1;
      }
      default:
        return pick([&](const ValueType& v) { return writable(v) && v.storage < num_inputs; });
    }
  }

  bool add_in_place() {
    int target = in_place_target();
    if (target < 0) return false;
    const ValueType t = values_[target];
    auto operand = [&](bool same_dtype) {
      return pick([&](const ValueType& v) {
        return is_numeric(v) && (!same_dtype || v.dtype == t.dtype) && broadcasts_to(v, t) &&
               v.storage != t.storage;
      });
    };
    static const std::vector<OpKind> with_tensor = {
        OpKind::add_,  OpKind::sub_,     OpKind::mul_,  OpKind::div_,
        OpKind::copy_, OpKind::maximum_, OpKind::lerp_, OpKind::masked_fill_};
    static const std::vector<OpKind> with_number = {
        OpKind::add_scalar_, OpKind::sub_scalar_, OpKind::mul_scalar_, OpKind::mul_scalar_,
        OpKind::div_scalar_, OpKind::fill_,       OpKind::pow_,        OpKind::clamp_};
    static const std::vector<OpKind> unary = {OpKind::neg_,  OpKind::relu_, OpKind::sigmoid_,
                                              OpKind::tanh_, OpKind::exp_,  OpKind::zero_};
    switch (random_.weighted({40, 40, 20})) {
      case 0: {
        OpKind kind = random_.pick(with_tensor);
        if (kind == OpKind::masked_fill_) {
          int mask =
              pick([&](const ValueType& v) { return v.dtype == kBool && broadcasts_to(v, t); });
          if (mask < 0) return false;
          append(kind, {target, mask}, {}, {scalar_for(t.dtype)});
          return true;
        }
        int other = operand(kind == OpKind::lerp_);
        if (other < 0) return false;
        std::vector<HostScalar> scalars;
        if ((kind == OpKind::add_ || kind == OpKind::sub_) && random_.chance(0.3))
          scalars = {random_.pick(kAlphas)};
        if (kind == OpKind::lerp_)
          scalars = {HostScalar{random_.pick(std::vector<double>{0.25, 0.5, 1.5})}};
        append(kind, {target, other}, {}, scalars);
        return true;
      }
      case 1: {
        OpKind kind = random_.pick(with_number);
        if (kind == OpKind::clamp_) {
          append(kind, {target}, {1, 1},
                 is_float(t.dtype) ? std::vector<HostScalar>{{-0.5}, {1.0}}
                                   : std::vector<HostScalar>{{-1, true}, {1, true}});
          return true;
        }
        HostScalar s = scalar_for(t.dtype);
        if (kind == OpKind::pow_) s = random_.pick(std::vector<HostScalar>{{2, true}, {3, true}});
        if (kind == OpKind::div_scalar_ && s.value == 0) s = {2.5};
        append(kind, {target}, {}, {s});
        return true;
      }
      default:
        append(random_.pick(unary), {target});
        return true;
    }
  }

  // ---------------- outputs ----------------

  // The values no later op reads (so that most ops feed something compared), newest first, at
  // most four; sometimes an intermediate too, which the compiled graph must then materialize.
  void choose_outputs() {
    const int first_result = static_cast<int>(program_.inputs.size());
    const int count = static_cast<int>(values_.size());
    std::vector<bool> read(count, false), written_in_place(count, false);
    int id = first_result;
    for (const Op& op : program_.ops) {
      // An in-place op writes its target rather than reading it; its result is the target.
      for (size_t i = is_in_place(op.kind) ? 1 : 0; i < op.args.size(); ++i)
        if (op.args[i] >= 0) read[op.args[i]] = true;
      if (is_in_place(op.kind)) written_in_place[id] = true;
      id += result_count(op.kind);
    }
    std::vector<int> outputs = {count - 1};
    for (int v = count - 2; v >= first_result && outputs.size() < 4; --v)
      if (!read[v] && !written_in_place[v] && random_.chance(0.8)) outputs.push_back(v);
    if (count - 1 > first_result && random_.chance(0.2)) {
      int v = static_cast<int>(random_.uniform(first_result, count - 2));
      if (std::find(outputs.begin(), outputs.end(), v) == outputs.end()) outputs.push_back(v);
    }
    program_.outputs.clear();
    for (size_t k = 0; k < outputs.size(); ++k)
      program_.outputs.push_back({outputs[k], program_.seed * 64 + 32 + k});
  }

  // Seeds of an input's data and of an output's loss weights: readable, and distinct across
  // programs, so that merged programs keep their members' data.
  uint64_t data_seed(int input) const { return program_.seed * 64 + static_cast<uint64_t>(input); }

  Random random_;
  GeneratorOptions options_;
  Flavor flavor_ = Flavor::pointwise;
  Program program_;
  std::vector<ValueType> values_;
};

}  // namespace

Program generate_program(uint64_t seed, const GeneratorOptions& options) {
  return Generator(seed, options).run();
}

}  // namespace kiln::differential
