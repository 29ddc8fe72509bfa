// models::mlp: a Sequential of Linear layers with an activation between them.
#include <string>

#include "kiln/models.h"

namespace kiln::models {

namespace {

nn::ModulePtr make_activation(const std::string& activation) {
  if (activation == "relu") return std::make_shared<nn::ReLU>();
  if (activation == "gelu") return std::make_shared<nn::GELU>();
  if (activation == "tanh") return std::make_shared<nn::Tanh>();
  if (activation == "sigmoid") return std::make_shared<nn::Sigmoid>();
  if (activation == "silu") return std::make_shared<nn::SiLU>();
  throw ValueError("[kiln::models::mlp] unknown activation \"" + activation +
                   "\". Use \"relu\", \"gelu\", \"tanh\", \"sigmoid\" or \"silu\".");
}

}  // namespace

std::shared_ptr<nn::Sequential> mlp(const std::vector<int64_t>& sizes,
                                    const std::string& activation, bool bias) {
  KILN_CHECK(sizes.size() >= 2, ValueError,
             "[kiln::models::mlp] sizes must list at least the input and output sizes, but got " +
                 std::to_string(sizes.size()) + " size(s).");
  for (int64_t s : sizes)
    KILN_CHECK(s > 0, ValueError,
               "[kiln::models::mlp] every size must be positive, but got " + std::to_string(s) +
                   ".");
  make_activation(activation);  // validate before building anything
  auto net = std::make_shared<nn::Sequential>();
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    net->push_back(std::make_shared<nn::Linear>(sizes[i], sizes[i + 1], bias));
    if (i + 2 < sizes.size()) net->push_back(make_activation(activation));
  }
  return net;
}

}  // namespace kiln::models
