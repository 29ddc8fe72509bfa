// A captured graph as text: the stable, versioned form that exported programs and repro packages
// are built on (docs/export.md, "Graph format").
//
//   serialize_graph(g)            JSON text of g, plus the constant tensors it refers to by name
//   deserialize_graph(text, cs)   the graph back, validated before it is returned
//
// The text names every op by its op-table name with a version of its schema (a hash of the schema
// string), types every attr, and records each value's sizes, strides, offset, dtype, device and
// alias group. Constant tensors are not inlined: the text holds their names, and the caller stores
// the tensors beside it (an exported package keeps them in its weights section).
//
// Loading trusts nothing in the text. Before a graph is returned, deserialize_graph checks the
// format and its version, that every op exists here with the same schema version, each node's
// arity and attr kinds against the schema, every id, and every size and stride. Then
// Graph::validate() re-runs each op's meta on the recorded shapes. Any failure throws
// GraphFormatError, which names the node or field.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kiln/compiler/graph.h"
#include "kiln/error.h"

namespace kiln::compiler {

// A graph text that this Kiln refuses: malformed, from a newer format, or naming an op, a schema
// version or a shape that this Kiln's op table does not accept.
class GraphFormatError : public Error {
  using Error::Error;
};

// The newest graph format version this Kiln writes and reads.
inline constexpr int kGraphFormatVersion = 1;

struct SerializedGraph {
  std::string text;  // JSON
  // The graph's constants by the names the text uses for them ("constant_0", ...).
  std::vector<std::pair<std::string, Tensor>> constants;
};

// The graph as JSON. Throws GraphFormatError for a node without an op.
SerializedGraph serialize_graph(const Graph& graph);

// The graph that `text` describes, with its constants taken from `constants` by name. Throws
// GraphFormatError naming the first problem; never returns a graph that validate() rejects.
Graph deserialize_graph(std::string_view text, const std::map<std::string, Tensor>& constants = {});

// The version of an op's schema that the format records: the first 16 hex digits of the SHA-256
// of its schema string.
std::string schema_version(const OpDef& op);

}  // namespace kiln::compiler
