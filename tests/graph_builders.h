// Building compiler graphs by hand, for the suites that test passes, the graph API and the code
// generators on graphs they write out node by node (test_passes, test_graph, test_cuda_codegen).
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/shape.h"
#include "kiln/compiler/graph.h"
#include "kiln/op_table.h"

namespace kiln::testing {

// The op-table entry named `name`; throws for a name the table lacks (a typo in a test).
inline const OpDef& op(std::string_view name) {
  const OpDef* def = OpTable::instance().find(name);
  if (!def) throw std::runtime_error("no op " + std::string(name));
  return *def;
}

// A row-major value of `sizes`.
inline compiler::ValueInfo contiguous_value(std::vector<int64_t> sizes, DType dtype = kFloat32,
                                            Device device = kCPU, std::string name = "") {
  compiler::ValueInfo v;
  v.strides = kiln::detail::contiguous_strides(sizes);
  v.sizes = std::move(sizes);
  v.dtype = dtype;
  v.device = device;
  v.name = std::move(name);
  return v;
}

// Appends a node of op `name` with outputs `outs`; returns the outputs' ids.
inline std::vector<int> add_call(compiler::Graph& g, std::string_view name, std::vector<int> inputs,
                                 std::vector<Attr> attrs, std::vector<compiler::ValueInfo> outs) {
  compiler::Node& n = g.add_node(op(name), std::move(inputs), std::move(attrs));
  std::vector<int> ids;
  for (compiler::ValueInfo& v : outs) ids.push_back(g.add_value(std::move(v)));
  g.nodes.back().outputs = ids;
  (void)n;
  return ids;
}

}  // namespace kiln::testing
