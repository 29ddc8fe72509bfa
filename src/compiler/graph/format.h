// Text forms shared by the graph printer, validate() and the passes (defined in printer.cpp).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/schema.h"
#include "kiln/compiler/graph.h"

namespace kiln::compiler::detail {

// PyTorch's short dtype names: "f32", "bf16", "i64", "b8".
std::string_view short_dtype_name(DType t);
// "f32[3, 3]".
std::string type_str(DType t, const std::vector<int64_t>& sizes);
std::string type_str(const ValueInfo& v);

// Schema parameters (core/schema.h), shared with the dispatcher's arity check.
using kiln::detail::parse_schema_params;
using kiln::detail::SchemaParam;
// Names of the op's attrs (its non-Tensor parameters, in schema order).
std::vector<std::string> attr_names(const OpDef& op);

// A scalar slot's run-time value `given` in the kind of the node's attr `example` (a Scalar slot
// takes a Scalar, a double slot a double, ...); nullopt when `given` is not a number (defined in
// interpreter.cpp).
std::optional<Attr> scalar_in_kind_of(const Attr& example, const Attr& given);

// One row of Graph::print_tabular (placeholders, scalar slots, constants, nodes, the output), with
// what the compile trace adds: the value's type ("f32[3, 3]"), the names of the values a row reads
// and defines, and for a node row its index in g.nodes (else -1).
struct TabularRow {
  std::string opcode, name, target, args, kwargs, type;
  std::vector<std::string> inputs, outputs;
  int node = -1;
};
std::vector<TabularRow> tabular_rows(const Graph& g);

// Node names: "index.Tensor" -> "index_Tensor", "mylib::dct" -> "mylib__dct" (identifiers).
std::string identifier_from(std::string_view op_name);
// The suffix `name` takes after `base`: 0 for `base` itself, k for "base_k", -1 otherwise.
int64_t suffix_after(std::string_view name, std::string_view base);

}  // namespace kiln::compiler::detail
