// Sample calls of the op table's ops, built from their schemas, for the tests that walk the table
// (test_kiln_backend on the CPU, test_cuda_codegen on the GPU): every op with a fused lowering is
// called through compile() and compared with eager without a hand-kept list of ops.
#pragma once

#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <variant>
#include <vector>

#include "kiln/kiln.h"
#include "kiln/op_table.h"

namespace kiln::testing {

struct SampleCall {
  std::vector<Tensor> inputs;
  std::vector<Attr> attrs;
};

// Whether the kiln backend generates code for the op (a pointwise or reduction lowering).
inline bool has_fused_lowering(const OpDef& op) {
  return std::holds_alternative<lowering::Pointwise>(op.lowering) ||
         std::holds_alternative<lowering::Reduction>(op.lowering);
}

// Arguments for `op` from its schema: tensors of sizes {4, 16} and `dtype` on `device` (floats
// from `floats(sizes, dtype, index of the tensor)`, integers in [-5, 5], bool for a condition or a
// mask, a 0-dim fill value), attrs that exercise the lowering (alpha and value 0.75 (2 for
// integers), a reduction over dim 1, a str's default, None for optional strs and dtypes).
// nullopt for a parameter type it does not know.
inline std::optional<SampleCall> sample_call(const OpDef& op, DType dtype, Device device,
                                             const std::function<Tensor(IntArrayRef, DType, size_t)>& floats) {
  SampleCall call;
  const std::string& schema = op.schema;
  const size_t open = schema.find('('), close = schema.rfind(") ->");  // "Tensor(a)" has a ')'
  std::stringstream params(schema.substr(open + 1, close - open - 1));
  const std::vector<int64_t> sizes{4, 16};
  for (std::string p; std::getline(params, p, ',');) {
    p.erase(0, p.find_first_not_of(' '));
    if (p == "*") continue;
    const std::string type = p.substr(0, p.find(' '));
    const std::string rest = p.substr(p.find(' ') + 1);
    const std::string name = rest.substr(0, rest.find('='));
    const std::string default_value = rest.find('=') == std::string::npos ? "" : rest.substr(rest.find('=') + 1);
    if (type.starts_with("Tensor")) {
      Tensor t;
      if (name == "condition" || name == "mask" || dtype == kBool) t = randint(0, 2, sizes).to(kBool);
      else if (name == "value") t = full({}, 0.75).to(dtype);  // masked_fill's 0-dim fill
      else if (!is_floating_point(dtype)) t = randint(-5, 6, sizes).to(dtype);
      else t = floats(sizes, dtype, call.inputs.size());
      call.inputs.push_back(name == "value" ? t : t.to(device));
    } else if (type == "Scalar") {
      call.attrs.emplace_back(is_floating_point(dtype) ? Scalar(0.75) : Scalar(2));
    } else if (type == "str?" || type == "ScalarType?") {
      call.attrs.emplace_back();  // None
    } else if (type == "str") {
      call.attrs.emplace_back(default_value.substr(1, default_value.size() - 2));  // 'none' -> none
    } else if (type.starts_with("int[")) {
      call.attrs.emplace_back(std::vector<int64_t>{1});
    } else if (type == "bool") {
      call.attrs.emplace_back(false);
    } else if (type == "ScalarType") {
      call.attrs.emplace_back(dtype);
    } else if (type == "Device") {
      call.attrs.emplace_back(device);
    } else {
      return std::nullopt;
    }
  }
  return call;
}

// The calls of `ops` that eager accepts in `dtype` on `device`, with eager's results.
struct SampleBatch {
  std::vector<std::pair<const OpDef*, SampleCall>> calls;
  std::vector<Tensor> inputs;   // every call's inputs, in order
  std::vector<Tensor> eager;    // every call's outputs, in order
  std::vector<const OpDef*> producer;  // per output
  std::vector<std::string> unknown;    // schemas sample_call could not fill

  // All the calls as one function of `inputs` (what the tests compile).
  std::vector<Tensor> run(const std::vector<Tensor>& in) const {
    std::vector<Tensor> out;
    size_t next = 0;
    for (const auto& [op, call] : calls) {
      std::vector<Tensor> args(in.begin() + next, in.begin() + next + call.inputs.size());
      next += call.inputs.size();
      for (Tensor& y : call_op(*op, args, call.attrs)) out.push_back(y);
    }
    return out;
  }
};

inline SampleBatch sample_batch(const std::vector<const OpDef*>& ops, DType dtype, Device device,
                                const std::function<Tensor(IntArrayRef, DType, size_t)>& floats) {
  SampleBatch b;
  for (const OpDef* op : ops) {
    std::optional<SampleCall> call = sample_call(*op, dtype, device, floats);
    if (!call) {
      b.unknown.push_back(op->schema);
      continue;
    }
    std::vector<Tensor> eager;
    try {
      eager = call_op(*op, call->inputs, call->attrs);
    } catch (const Error&) {
      continue;  // a dtype (or device) the op rejects
    }
    for (const Tensor& x : call->inputs) b.inputs.push_back(x);
    for (const Tensor& y : eager) {
      b.eager.push_back(y);
      b.producer.push_back(op);
    }
    b.calls.emplace_back(op, std::move(*call));
  }
  return b;
}

}  // namespace kiln::testing
