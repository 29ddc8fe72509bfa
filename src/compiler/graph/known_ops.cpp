// The op-table entries passes recognise (see known_ops.h).
#include "compiler/graph/known_ops.h"

#include "compiler/graph/passes.h"

namespace kiln::compiler {

const KnownOps& known_ops() {
  using passes::internal::registered_op;
  static const KnownOps ops{
      .addmm = registered_op("addmm"),
      .as_strided = registered_op("as_strided"),
      .avg_pool2d = registered_op("avg_pool2d"),
      .cat = registered_op("cat"),
      .conv2d = registered_op("conv2d"),
      .conv2d_bn = registered_op("conv2d_bn"),
      .conv2d_relu = registered_op("conv2d_relu"),
      .convolution_backward = registered_op("convolution_backward"),
      .copy = registered_op("copy"),
      .le = registered_op("le"),
      .mm = registered_op("mm"),
      .native_batch_norm = registered_op("native_batch_norm"),
      .native_batch_norm_backward = registered_op("native_batch_norm_backward"),
      .relu = registered_op("relu"),
      .where = registered_op("where"),
  };
  return ops;
}

}  // namespace kiln::compiler
