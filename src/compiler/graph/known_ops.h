// The ops that passes and the scheduler recognise by identity (a convolution followed by batch
// norm, a cat to split into slices, ...): their op-table entries, looked up once. Passes compare
// entries (`n.op == &ops.relu`), never names; everything else they need to know about an op
// comes from its entry (OpDef::lowering, is_fusible, mutated_inputs).
#pragma once

#include "kiln/op_table.h"

namespace kiln::compiler {

// conv2d_bn and conv2d_relu are fuse_conv_bn's fused ops.
struct KnownOps {
  const OpDef &addmm, &as_strided, &avg_pool2d, &cat, &conv2d, &conv2d_bn, &conv2d_relu;
  const OpDef &convolution_backward, &copy, &le, &mm, &native_batch_norm, &native_batch_norm_backward;
  const OpDef &relu, &where;
};

// The entries; throws CompileError naming an op the table lacks.
const KnownOps& known_ops();

}  // namespace kiln::compiler
