// Kiln's tensor operations. Every function here is one entry of the op table (src/ops/): its
// checks, output shape and dtype rules follow PyTorch's, and it runs eagerly or is captured
// inside compile(). Errors throw kiln::Error subclasses (see kiln/error.h).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kiln/tensor.h"

namespace kiln {

// ======================= factories =======================
Tensor empty(IntArrayRef sizes, TensorOptions options = {});
Tensor zeros(IntArrayRef sizes, TensorOptions options = {});
Tensor ones(IntArrayRef sizes, TensorOptions options = {});
Tensor full(IntArrayRef sizes, Scalar value, TensorOptions options = {});  // dtype from value if unset
Tensor arange(Scalar end, TensorOptions options = {});
Tensor arange(Scalar start, Scalar end, Scalar step = 1, TensorOptions options = {});
Tensor linspace(double start, double end, int64_t steps, TensorOptions options = {});
Tensor eye(int64_t n, std::optional<int64_t> m = {}, TensorOptions options = {});
Tensor empty_like(const Tensor& t, TensorOptions options = {});  // unset fields come from t
Tensor zeros_like(const Tensor& t, TensorOptions options = {});
Tensor ones_like(const Tensor& t, TensorOptions options = {});
Tensor full_like(const Tensor& t, Scalar value, TensorOptions options = {});
// A 0-dim tensor holding `value` (dtype from the scalar unless given).
Tensor scalar_tensor(Scalar value, TensorOptions options = {});
// Copies host data: tensor({1.f, 2.f}), tensor(std::vector<int64_t>{...}, {2, 3}).
template <class T> Tensor tensor(const std::vector<T>& data, IntArrayRef sizes, TensorOptions options = {});
template <class T> Tensor tensor(const std::vector<T>& data, TensorOptions options = {}) {
  return tensor<T>(data, {static_cast<int64_t>(data.size())}, options);
}
template <class T> Tensor tensor(std::initializer_list<T> data, TensorOptions options = {}) {
  return tensor<T>(std::vector<T>(data), options);
}
// Wraps existing memory without copying; `deleter` (may be null) runs when the last view dies.
Tensor from_blob(void* data, IntArrayRef sizes, IntArrayRef strides, DType dtype,
                 Device device = kCPU, void (*deleter)(void* data, void* ctx) = nullptr,
                 void* ctx = nullptr);

// ---- random: a counter-based Philox stream (see docs/random.md) ----
void manual_seed(uint64_t seed);
Tensor rand(IntArrayRef sizes, TensorOptions options = {});
Tensor randn(IntArrayRef sizes, TensorOptions options = {});
Tensor randint(int64_t low, int64_t high, IntArrayRef sizes, TensorOptions options = {});  // int64
Tensor randint(int64_t high, IntArrayRef sizes, TensorOptions options = {});
Tensor rand_like(const Tensor& t, TensorOptions options = {});
Tensor randn_like(const Tensor& t, TensorOptions options = {});
Tensor bernoulli(const Tensor& p);  // p in [0, 1], same shape as the result
Tensor bernoulli(const Tensor& t, double p);
Tensor dropout(const Tensor& input, double p = 0.5, bool training = true);
Tensor& uniform_(Tensor& t, double from = 0.0, double to = 1.0);
Tensor& normal_(Tensor& t, double mean = 0.0, double std = 1.0);

// ======================= pointwise: unary =======================
Tensor neg(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor log1p(const Tensor& x);
Tensor expm1(const Tensor& x);
Tensor sin(const Tensor& x);
Tensor cos(const Tensor& x);
Tensor tan(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
// approximate: "none" (exact, erf) or "tanh".
Tensor gelu(const Tensor& x, const std::string& approximate = "none");
Tensor silu(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor reciprocal(const Tensor& x);
Tensor sign(const Tensor& x);
Tensor floor(const Tensor& x);
Tensor ceil(const Tensor& x);
Tensor round(const Tensor& x);  // half to even, like torch.round
Tensor erf(const Tensor& x);
Tensor logical_not(const Tensor& x);  // bool result
Tensor isnan(const Tensor& x);        // bool result
Tensor isfinite(const Tensor& x);     // bool result
Tensor bitwise_not(const Tensor& x);  // integers and bool

// ======================= pointwise: binary =======================
// Broadcasting and type promotion follow PyTorch. Scalars act like Python numbers.
Tensor add(const Tensor& a, const Tensor& b, Scalar alpha = 1);
Tensor add(const Tensor& a, Scalar b, Scalar alpha = 1);
Tensor sub(const Tensor& a, const Tensor& b, Scalar alpha = 1);
Tensor sub(const Tensor& a, Scalar b, Scalar alpha = 1);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, Scalar b);
// rounding_mode: none (true division, float result), "trunc" or "floor".
Tensor div(const Tensor& a, const Tensor& b, std::optional<std::string> rounding_mode = {});
Tensor div(const Tensor& a, Scalar b, std::optional<std::string> rounding_mode = {});
Tensor floor_divide(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& base, const Tensor& exponent);
Tensor pow(const Tensor& base, Scalar exponent);
Tensor pow(Scalar base, const Tensor& exponent);
Tensor remainder(const Tensor& a, const Tensor& b);  // sign of the divisor, like Python's %
Tensor remainder(const Tensor& a, Scalar b);
Tensor maximum(const Tensor& a, const Tensor& b);  // propagates NaN
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor atan2(const Tensor& a, const Tensor& b);
// sqrt(a² + b²) elementwise, without overflow in the squares; integer inputs give float.
Tensor hypot(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, Scalar b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, Scalar b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, Scalar b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, Scalar b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, Scalar b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, Scalar b);
Tensor logical_and(const Tensor& a, const Tensor& b);
Tensor logical_or(const Tensor& a, const Tensor& b);
Tensor logical_xor(const Tensor& a, const Tensor& b);
Tensor bitwise_and(const Tensor& a, const Tensor& b);
Tensor bitwise_or(const Tensor& a, const Tensor& b);
Tensor bitwise_xor(const Tensor& a, const Tensor& b);
Tensor bitwise_left_shift(const Tensor& a, const Tensor& b);
Tensor bitwise_right_shift(const Tensor& a, const Tensor& b);

// ======================= pointwise: ternary =======================
Tensor where(const Tensor& condition, const Tensor& a, const Tensor& b);
Tensor where(const Tensor& condition, const Tensor& a, Scalar b);
Tensor where(const Tensor& condition, Scalar a, const Tensor& b);
Tensor clamp(const Tensor& x, std::optional<Scalar> min, std::optional<Scalar> max = {});
Tensor clamp(const Tensor& x, const Tensor& min, const Tensor& max);
Tensor lerp(const Tensor& start, const Tensor& end, Scalar weight);
Tensor lerp(const Tensor& start, const Tensor& end, const Tensor& weight);
Tensor addcmul(const Tensor& self, const Tensor& t1, const Tensor& t2, Scalar value = 1);
Tensor addcdiv(const Tensor& self, const Tensor& t1, const Tensor& t2, Scalar value = 1);
Tensor masked_fill(const Tensor& x, const Tensor& mask, Scalar value);
Tensor masked_fill(const Tensor& x, const Tensor& mask, const Tensor& value);  // 0-dim value

// ======================= reductions =======================
// `dims` empty means all dims. Negative dims count from the end; a repeated dim is a ValueError.
// A 0-dim tensor takes dim 0 or -1. As in PyTorch: integer and bool inputs sum/prod/cumsum to
// int64 (`dtype` converts the input first); mean/var/std/norm/softmax need floating inputs
// (DTypeError), logsumexp of integers gives the default float dtype; max/min/amax/amin propagate
// NaN and, with argmax/argmin, refuse an empty reduction (the first index wins ties, the first
// NaN wins); any/all give bool (uint8 for uint8 inputs); var/std divide by max(0, N - correction).
// float16/bfloat16 accumulate in float, float32 sums pairwise (accurate for millions of values).
Tensor sum(const Tensor& x, IntArrayRef dims = {}, bool keepdim = false, std::optional<DType> dtype = {});
Tensor mean(const Tensor& x, IntArrayRef dims = {}, bool keepdim = false);
Tensor prod(const Tensor& x, std::optional<int64_t> dim = {}, bool keepdim = false);
Tensor max(const Tensor& x);  // over all elements
Tensor min(const Tensor& x);
std::tuple<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim = false);  // values, indices
std::tuple<Tensor, Tensor> min(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor amax(const Tensor& x, IntArrayRef dims = {}, bool keepdim = false);
Tensor amin(const Tensor& x, IntArrayRef dims = {}, bool keepdim = false);
// Without dim: the flat (row-major) index over all elements.
Tensor argmax(const Tensor& x, std::optional<int64_t> dim = {}, bool keepdim = false);
Tensor argmin(const Tensor& x, std::optional<int64_t> dim = {}, bool keepdim = false);
Tensor var(const Tensor& x, IntArrayRef dims = {}, int64_t correction = 1, bool keepdim = false);
Tensor std(const Tensor& x, IntArrayRef dims = {}, int64_t correction = 1, bool keepdim = false);
std::tuple<Tensor, Tensor> var_mean(const Tensor& x, IntArrayRef dims = {}, int64_t correction = 1,
                                    bool keepdim = false);
// p: 2, 1, inf, -inf, 0 (the count of non-zeros) or any other order (sum |x|^p)^(1/p).
Tensor norm(const Tensor& x, Scalar p = 2, IntArrayRef dims = {}, bool keepdim = false);
Tensor logsumexp(const Tensor& x, IntArrayRef dims, bool keepdim = false);
Tensor any(const Tensor& x);
Tensor any(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor all(const Tensor& x);
Tensor all(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor cumsum(const Tensor& x, int64_t dim, std::optional<DType> dtype = {});
// Numerically stable (the max is subtracted); `dtype` converts the input first.
Tensor softmax(const Tensor& x, int64_t dim, std::optional<DType> dtype = {});
Tensor log_softmax(const Tensor& x, int64_t dim, std::optional<DType> dtype = {});

// ======================= linear algebra (BLAS) =======================
Tensor matmul(const Tensor& a, const Tensor& b);  // 1-D/2-D/batched with broadcast batch dims
Tensor mm(const Tensor& a, const Tensor& b);
Tensor bmm(const Tensor& a, const Tensor& b);
Tensor addmm(const Tensor& self, const Tensor& m1, const Tensor& m2, Scalar beta = 1, Scalar alpha = 1);
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());  // x @ weight.T + bias
Tensor outer(const Tensor& a, const Tensor& b);
Tensor dot(const Tensor& a, const Tensor& b);

// ======================= convolution and pooling (oneDNN) =======================
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias = Tensor(),
              IntArrayRef stride = {1, 1}, IntArrayRef padding = {0, 0},
              IntArrayRef dilation = {1, 1}, int64_t groups = 1);
namespace detail {
Tensor conv2d_padding_mode(const Tensor& input, const Tensor& weight, const Tensor& bias, IntArrayRef stride,
                           std::string_view padding, IntArrayRef dilation, int64_t groups);
}
// padding: "same" or "valid". A template so that a braced list of ints, conv2d(x, w, b, {1, 1},
// {0, 0}), always picks the overload above instead of being ambiguous with std::string.
template <class String, std::enable_if_t<std::is_convertible_v<const String&, std::string_view>, int> = 0>
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, IntArrayRef stride,
              const String& padding, IntArrayRef dilation = {1, 1}, int64_t groups = 1) {
  return detail::conv2d_padding_mode(input, weight, bias, stride, std::string_view(padding), dilation, groups);
}
Tensor max_pool2d(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride = {},
                  IntArrayRef padding = {0, 0}, IntArrayRef dilation = {1, 1}, bool ceil_mode = false);
std::tuple<Tensor, Tensor> max_pool2d_with_indices(const Tensor& input, IntArrayRef kernel_size,
                                                   IntArrayRef stride = {}, IntArrayRef padding = {0, 0},
                                                   IntArrayRef dilation = {1, 1}, bool ceil_mode = false);
Tensor avg_pool2d(const Tensor& input, IntArrayRef kernel_size, IntArrayRef stride = {},
                  IntArrayRef padding = {0, 0}, bool ceil_mode = false, bool count_include_pad = true,
                  std::optional<int64_t> divisor_override = {});
Tensor adaptive_avg_pool2d(const Tensor& input, IntArrayRef output_size);

// ======================= normalization =======================
// In training mode, updates running_mean/running_var in place (if defined) with `momentum`.
Tensor batch_norm(const Tensor& input, const Tensor& running_mean, const Tensor& running_var,
                  const Tensor& weight, const Tensor& bias, bool training, double momentum = 0.1,
                  double eps = 1e-5);
Tensor layer_norm(const Tensor& input, IntArrayRef normalized_shape, const Tensor& weight = Tensor(),
                  const Tensor& bias = Tensor(), double eps = 1e-5);
Tensor group_norm(const Tensor& input, int64_t num_groups, const Tensor& weight = Tensor(),
                  const Tensor& bias = Tensor(), double eps = 1e-5);

// ======================= shape and indexing =======================
Tensor cat(const TensorList& tensors, int64_t dim = 0);
Tensor stack(const TensorList& tensors, int64_t dim = 0);
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim = 0);
std::vector<Tensor> split(const Tensor& x, IntArrayRef split_sizes, int64_t dim = 0);
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim = 0);
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, Scalar value);
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
// Advanced indexing with one optional index tensor per leading dim (undefined = take all).
Tensor index(const Tensor& x, const std::vector<Tensor>& indices);
Tensor index_put(const Tensor& x, const std::vector<Tensor>& indices, const Tensor& values,
                 bool accumulate = false);
Tensor embedding(const Tensor& weight, const Tensor& indices, std::optional<int64_t> padding_idx = {});
Tensor one_hot(const Tensor& indices, int64_t num_classes = -1);  // int64 result
// pad: pairs (left, right) from the last dim backwards, like torch.nn.functional.pad.
// mode: "constant", "reflect", "replicate".
Tensor pad(const Tensor& x, IntArrayRef pad, const std::string& mode = "constant", double value = 0.0);

// ======================= losses =======================
enum class Reduction { none, mean, sum };
Tensor cross_entropy(const Tensor& input, const Tensor& target, const Tensor& weight = Tensor(),
                     int64_t ignore_index = -100, Reduction reduction = Reduction::mean,
                     double label_smoothing = 0.0);
Tensor nll_loss(const Tensor& input, const Tensor& target, const Tensor& weight = Tensor(),
                int64_t ignore_index = -100, Reduction reduction = Reduction::mean);
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::mean);
Tensor binary_cross_entropy_with_logits(const Tensor& input, const Tensor& target,
                                        const Tensor& weight = Tensor(), const Tensor& pos_weight = Tensor(),
                                        Reduction reduction = Reduction::mean);

// ======================= views as free functions =======================
Tensor view(const Tensor& x, IntArrayRef sizes);
Tensor reshape(const Tensor& x, IntArrayRef sizes);
Tensor permute(const Tensor& x, IntArrayRef dims);
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1);
Tensor t(const Tensor& x);
Tensor expand(const Tensor& x, IntArrayRef sizes);
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length);
Tensor select(const Tensor& x, int64_t dim, int64_t index);
Tensor squeeze(const Tensor& x);
Tensor squeeze(const Tensor& x, int64_t dim);
Tensor unsqueeze(const Tensor& x, int64_t dim);
Tensor flatten(const Tensor& x, int64_t start_dim = 0, int64_t end_dim = -1);
Tensor unflatten(const Tensor& x, int64_t dim, IntArrayRef sizes);
Tensor as_strided(const Tensor& x, IntArrayRef sizes, IntArrayRef strides,
                  std::optional<int64_t> storage_offset = {});
Tensor contiguous(const Tensor& x);
Tensor clone(const Tensor& x);
// Broadcast shape of several shapes (throws ShapeError when incompatible).
std::vector<int64_t> broadcast_shapes(const std::vector<std::vector<int64_t>>& shapes);
// The dtype PyTorch's result_type gives for these operands.
DType result_type(const TensorList& tensors);

// Approximate equality, like torch.allclose.
bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8, bool equal_nan = false);
bool equal(const Tensor& a, const Tensor& b);  // same shape and values

}  // namespace kiln
