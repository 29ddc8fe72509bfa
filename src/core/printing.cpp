// Tensor printing in PyTorch's format: the output of torch._tensor_str with its default options
// (precision 4, threshold 1000, edgeitems 3, linewidth 80), with "kiln." where PyTorch writes
// "torch." in dtype suffixes. Tests compare against strings PyTorch prints for the same values.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <string>
#include <vector>

#include "core/layer_hooks.h"
#include "kiln/ops.h"
#include "kiln/tensor.h"

namespace kiln {

namespace {

constexpr int kPrecision = 4;
constexpr int64_t kThreshold = 1000;  // more elements than this: summarize with "..."
constexpr int64_t kEdgeItems = 3;     // elements kept at each end of a summarized dim
constexpr int64_t kLineWidth = 80;

// One element as the formatter sees it: floating values as double, integers as int64, bools.
struct Element {
  double f = 0;
  int64_t i = 0;
};

enum class ElementKind { floating, integer, boolean };

ElementKind kind_of(DType t) {
  if (is_floating_point(t)) return ElementKind::floating;
  return t == DType::bool_ ? ElementKind::boolean : ElementKind::integer;
}

Element read_element(const char* base, DType t, int64_t offset) {
  return KILN_DISPATCH_ALL(t, "print", [&]() -> Element {
    scalar_t v = reinterpret_cast<const scalar_t*>(base)[offset];
    Element e;
    if constexpr (std::is_same_v<scalar_t, Half> || std::is_same_v<scalar_t, BFloat16>) {
      e.f = static_cast<float>(v);
    } else if constexpr (std::is_floating_point_v<scalar_t>) {
      e.f = static_cast<double>(v);
    } else {
      e.i = static_cast<int64_t>(v);
    }
    return e;
  });
}

// Python's "{:.<precision><conversion>}".format(v) for conversion 'f' or 'e' (nan prints "nan"
// whatever its sign bit, unlike C's printf).
std::string format_double(double v, char conversion, int precision) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[512];
  std::snprintf(buf, sizeof buf, conversion == 'e' ? "%.*e" : "%.*f", precision, v);
  return buf;
}

// PyTorch's _Formatter: picks integer, fixed or scientific notation and the column width from
// the elements that will be printed.
class Formatter {
 public:
  Formatter(ElementKind kind, const std::vector<Element>& values) : kind_(kind) {
    if (kind_ == ElementKind::integer) {
      for (const Element& v : values) max_width_ = std::max(max_width_, std::to_string(v.i).size());
      return;
    }
    if (kind_ == ElementKind::boolean) {
      for (const Element& v : values) max_width_ = std::max<size_t>(max_width_, v.i ? 4 : 5);
      return;
    }
    std::vector<double> finite;  // nonzero finite values
    for (const Element& v : values)
      if (std::isfinite(v.f) && v.f != 0) finite.push_back(v.f);
    if (finite.empty()) return;
    double min_abs = std::abs(finite[0]), max_abs = min_abs;
    for (double v : finite) {
      min_abs = std::min(min_abs, std::abs(v));
      max_abs = std::max(max_abs, std::abs(v));
      if (v != std::ceil(v)) int_mode_ = false;
    }
    if (int_mode_) {
      // Integer-valued floats print as "1." (the dot says the dtype is floating).
      if (max_abs / min_abs > 1000.0 || max_abs > 1.0e8) {
        sci_mode_ = true;
        widen(finite, 'e', kPrecision, 0);
      } else {
        widen(finite, 'f', 0, 1);
      }
    } else if (max_abs / min_abs > 1000.0 || max_abs > 1.0e8 || min_abs < 1.0e-4) {
      sci_mode_ = true;
      widen(finite, 'e', kPrecision, 0);
    } else {
      widen(finite, 'f', kPrecision, 0);
    }
  }

  size_t width() const { return max_width_; }

  std::string format(const Element& v) const {
    std::string s;
    switch (kind_) {
      case ElementKind::integer: s = std::to_string(v.i); break;
      case ElementKind::boolean: s = v.i ? "True" : "False"; break;
      case ElementKind::floating:
        if (sci_mode_) {
          s = format_double(v.f, 'e', kPrecision);
        } else if (int_mode_) {
          s = format_double(v.f, 'f', 0);
          if (std::isfinite(v.f)) s += ".";
        } else {
          s = format_double(v.f, 'f', kPrecision);
        }
        break;
    }
    if (s.size() < max_width_) s.insert(0, max_width_ - s.size(), ' ');
    return s;
  }

 private:
  void widen(const std::vector<double>& values, char conversion, int precision, size_t extra) {
    for (double v : values) max_width_ = std::max(max_width_, format_double(v, conversion, precision).size() + extra);
  }

  ElementKind kind_;
  bool int_mode_ = true;
  bool sci_mode_ = false;
  size_t max_width_ = 1;
};

std::string repeat(char c, int64_t n) { return std::string(static_cast<size_t>(std::max<int64_t>(n, 0)), c); }

// Walks a CPU tensor the way _tensor_str_with_formatter does: nested brackets, summarized dims
// (size > 2 * edgeitems when numel > threshold) show their first and last edgeitems around "...".
class TensorPrinter {
 public:
  explicit TensorPrinter(const Tensor& t)
      : t_(t),
        base_(static_cast<const char*>(t.impl().data())),
        kind_(kind_of(t.dtype())),
        summarize_(t.numel() > kThreshold) {}

  std::string str(int64_t indent) {
    std::vector<Element> shown;
    collect(0, 0, shown);
    Formatter formatter(kind_, shown);
    formatter_ = &formatter;
    std::string s = tensor_str(0, 0, indent);
    formatter_ = nullptr;
    return s;
  }

 private:
  bool elided(int64_t d) const { return summarize_ && t_.sizes()[d] > 2 * kEdgeItems; }

  // The indices of dim d that are printed.
  std::vector<int64_t> shown_indices(int64_t d) const {
    const int64_t n = t_.sizes()[d];
    std::vector<int64_t> idx;
    if (elided(d)) {
      for (int64_t i = 0; i < kEdgeItems; ++i) idx.push_back(i);
      for (int64_t i = n - kEdgeItems; i < n; ++i) idx.push_back(i);
    } else {
      for (int64_t i = 0; i < n; ++i) idx.push_back(i);
    }
    return idx;
  }

  Element at(int64_t offset) const { return read_element(base_, t_.dtype(), offset); }

  // The elements that will be printed (what get_summarized_data keeps).
  void collect(int64_t d, int64_t offset, std::vector<Element>& out) const {
    if (d == t_.dim()) {
      out.push_back(at(offset));
      return;
    }
    for (int64_t i : shown_indices(d)) collect(d + 1, offset + i * t_.strides()[d], out);
  }

  std::string tensor_str(int64_t d, int64_t offset, int64_t indent) const {
    const int64_t rank = t_.dim() - d;
    if (rank == 0) return formatter_->format(at(offset));
    if (rank == 1) return vector_str(d, offset, indent);
    std::vector<std::string> slices;
    std::vector<int64_t> idx = shown_indices(d);
    for (size_t k = 0; k < idx.size(); ++k) {
      if (elided(d) && k == static_cast<size_t>(kEdgeItems)) slices.push_back("...");
      slices.push_back(tensor_str(d + 1, offset + idx[k] * t_.strides()[d], indent + 1));
    }
    const std::string sep = "," + repeat('\n', rank - 1) + repeat(' ', indent + 1);
    std::string s = "[";
    for (size_t k = 0; k < slices.size(); ++k) s += (k ? sep : "") + slices[k];
    return s + "]";
  }

  std::string vector_str(int64_t d, int64_t offset, int64_t indent) const {
    const int64_t element_length = static_cast<int64_t>(formatter_->width()) + 2;
    const int64_t per_line = std::max<int64_t>(
        1, static_cast<int64_t>(std::floor(static_cast<double>(kLineWidth - indent) / element_length)));
    std::vector<std::string> data;
    std::vector<int64_t> idx = shown_indices(d);
    for (size_t k = 0; k < idx.size(); ++k) {
      if (elided(d) && k == static_cast<size_t>(kEdgeItems)) data.push_back(" ...");
      data.push_back(formatter_->format(at(offset + idx[k] * t_.strides()[d])));
    }
    std::string s = "[";
    for (size_t k = 0; k < data.size(); ++k) {
      if (k > 0) s += k % per_line == 0 ? ",\n" + repeat(' ', indent + 1) : ", ";
      s += data[k];
    }
    return s + "]";
  }

  const Tensor& t_;
  const char* base_;
  ElementKind kind_;
  bool summarize_;
  const Formatter* formatter_ = nullptr;
};

// _add_suffixes: ", suffix" on the last line while it fits in linewidth, else on a new line.
std::string add_suffixes(std::string s, const std::vector<std::string>& suffixes, int64_t indent) {
  size_t nl = s.rfind('\n');
  int64_t last_line_len = static_cast<int64_t>(nl == std::string::npos ? s.size() + 2 : s.size() - nl + 1);
  for (const std::string& suffix : suffixes) {
    const int64_t len = static_cast<int64_t>(suffix.size());
    if (last_line_len + len + 2 > kLineWidth) {
      s += ",\n" + repeat(' ', indent) + suffix;
      last_line_len = indent + len;
    } else {
      s += ", " + suffix;
      last_line_len += len + 2;
    }
  }
  return s + ")";
}

}  // namespace

std::string Tensor::str() const {
  detail::host_read_hook("printing a tensor");
  detail::CaptureSuspended eager;  // the formatting ops are not part of the user's graph
  if (!defined()) return "Tensor(undefined)";
  const std::string prefix = "tensor(";
  const int64_t indent = static_cast<int64_t>(prefix.size());
  std::vector<std::string> suffixes;
  if (!is_cpu()) suffixes.push_back("device='" + device().str() + "'");
  const std::string dtype_suffix = "dtype=kiln." + std::string(dtype_name(dtype()));
  std::string body;
  if (numel() == 0) {
    // Empty tensors show their shape unless it is (0,), and any dtype but the default float one.
    if (dim() != 1) suffixes.push_back("size=" + shape_str(sizes()));
    if (dtype() != default_dtype()) suffixes.push_back(dtype_suffix);
    body = "[]";
  } else {
    if (dtype() != default_dtype() && dtype() != DType::int64 && dtype() != DType::bool_)
      suffixes.push_back(dtype_suffix);
    Tensor host = is_cpu() ? *this : detach().cpu();  // detach: the copy records no autograd node
    body = TensorPrinter(host).str(indent);
  }
  // A tensor made by a recorded op shows its backward node; a leaf shows requires_grad.
  const std::string grad_fn = grad_fn_name();
  if (!grad_fn.empty()) suffixes.push_back("grad_fn=<" + grad_fn + ">");
  else if (requires_grad()) suffixes.push_back("requires_grad=True");
  return add_suffixes(prefix + body, suffixes, indent);
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

}  // namespace kiln
