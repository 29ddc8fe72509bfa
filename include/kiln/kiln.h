// The whole public API of Kiln.
#pragma once

#include "kiln/autograd.h"
#include "kiln/compiler.h"
#include "kiln/cuda.h"
#include "kiln/device.h"
#include "kiln/dtype.h"
#include "kiln/error.h"
#include "kiln/export.h"
#include "kiln/io.h"
#include "kiln/models.h"
#include "kiln/nn.h"
#include "kiln/ops.h"
#include "kiln/optim.h"
#include "kiln/scalar.h"
#include "kiln/tensor.h"
#include "kiln/op_table.h"
#include "kiln/threading.h"
