// Every layer and container of kiln::nn (torch.nn's modules). Semantics: docs/nn.md.
#pragma once

#include "kiln/nn/attention.h"
#include "kiln/nn/container.h"
#include "kiln/nn/conv.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/module.h"
#include "kiln/nn/normalization.h"
