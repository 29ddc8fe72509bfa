// Epilogue fusion into GEMMs (DESIGN §2.5): addmm → relu becomes one addmm_relu node, whose kernel
// applies the relu in place while the GEMM's result is hot in cache, instead of a second pass
// over it in a generated kernel. The rewrite applies only where the relu is the only reader of
// the addmm's result; training graphs qualify, since relu's backward reads the relu's result.
#include "compiler/graph/known_ops.h"
#include "compiler/graph/passes.h"

namespace kiln::compiler::passes {

void fuse_gemm_epilogue(Graph& g) {
  const OpDef* addmm_relu = OpTable::instance().find("addmm_relu");
  KILN_CHECK(addmm_relu != nullptr, CompileError,
             "[kiln::compile] op 'addmm_relu' is not registered. This is a Kiln bug.");
  const std::vector<int> uses = g.use_counts();
  const std::vector<char> written = internal::written_memory(g);
  std::vector<int> reader(g.values.size(), -1);  // the node reading a value, for values of one use
  for (size_t i = 0; i < g.nodes.size(); ++i)
    for (int v : g.nodes[i].inputs)
      if (v >= 0 && uses[v] == 1) reader[v] = static_cast<int>(i);

  internal::NodeNamer namer(g);
  std::vector<char> erase(g.nodes.size(), 0);
  for (Node& gemm : g.nodes) {
    if (gemm.op != &known_ops().addmm || gemm.inplace || gemm.outputs.size() != 1) continue;
    const int y = gemm.outputs[0];
    // One use and that a relu's: not a graph output, no view of it; nothing writes its memory.
    const int r = reader[y];
    if (r < 0 || written[y]) continue;
    const Node& relu = g.nodes[r];
    if (relu.op != &known_ops().relu || relu.inplace || relu.outputs.size() != 1) continue;
    if (!addmm_relu->has_kernel(g.values[y].device.type)) continue;
    // The fused node takes the addmm's place, with its inputs and attrs in the same order, so that
    // its scalar slots (beta, alpha: node index and attr index) stay valid; the relu goes. Running
    // at the addmm's place reads the operands when the addmm did, and nothing between the two
    // nodes can read the relu's value.
    gemm.op = addmm_relu;
    gemm.outputs = {relu.outputs[0]};
    gemm.name = namer("addmm_relu");
    erase[r] = 1;
  }
  size_t index = 0;
  g.erase_nodes_if([&](const Node&) { return erase[index++] != 0; });
}

}  // namespace kiln::compiler::passes
