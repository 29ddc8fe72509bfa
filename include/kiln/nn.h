// kiln::nn — torch.nn in C++: Module, the layers, nn::functional and nn::init.
//   auto model = std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(784, 128),
//                                                 std::make_shared<nn::ReLU>(),
//                                                 std::make_shared<nn::Linear>(128, 10));
//   Tensor loss = nn::functional::cross_entropy(model->forward(x), y);
// Semantics and examples: docs/nn.md.
#pragma once

#include "kiln/nn/functional.h"
#include "kiln/nn/init.h"
#include "kiln/nn/module.h"
#include "kiln/nn/modules.h"
