// nn::Module: registration and PyTorch's dotted names, traversal, train/eval, in-place to(),
// state_dict / load_state_dict (keys, errors, non-strict), structure_version, printing.
#include <sstream>

#include "reference.h"

using namespace kiln;
using kiln::testing::matches;
using kiln::testing::values;

namespace {

using Names = std::vector<std::string>;

Names keys_of(const NamedTensors& named) {
  Names out;
  for (const auto& [k, v] : named) out.push_back(k);
  return out;
}

Names keys_of(const nn::NamedModules& named) {
  Names out;
  for (const auto& [k, v] : named) out.push_back(k);
  return out;
}

// A DenseNet-like nesting: features.denseblock1.denselayer1.{norm1,conv1}, then a classifier.
struct DenseLayer : nn::Module {
  DenseLayer() {
    norm1 = register_module("norm1", std::make_shared<nn::BatchNorm2d>(2));
    relu1 = register_module("relu1", std::make_shared<nn::ReLU>(true));
    conv1 = register_module(
        "conv1", std::make_shared<nn::Conv2d>(nn::Conv2dOptions{
                     .in_channels = 2, .out_channels = 3, .kernel_size = 1, .bias = false}));
  }
  Tensor forward(const Tensor& x) override {
    return conv1->forward(relu1->forward(norm1->forward(x)));
  }
  std::shared_ptr<nn::BatchNorm2d> norm1;
  std::shared_ptr<nn::ReLU> relu1;
  std::shared_ptr<nn::Conv2d> conv1;
};

struct Net : nn::Module {
  Net() {
    auto block = std::make_shared<nn::Sequential>();
    block->register_module("denselayer1", std::make_shared<DenseLayer>());
    features = register_module(
        "features", std::make_shared<nn::Sequential>(nn::NamedModules{{"denseblock1", block}}));
    classifier = register_module("classifier", std::make_shared<nn::Linear>(3, 2));
  }
  Tensor forward(const Tensor& x) override {
    return classifier->forward(features->forward(x).mean({2, 3}));
  }
  std::shared_ptr<nn::Sequential> features;
  std::shared_ptr<nn::Linear> classifier;
};

struct NoForward : nn::Module {};

}  // namespace

TEST(NnModule, ParameterNamesAreDottedLikePyTorch) {
  auto net = std::make_shared<Net>();
  EXPECT_EQ(keys_of(net->named_parameters()),
            (Names{"features.denseblock1.denselayer1.norm1.weight",
                   "features.denseblock1.denselayer1.norm1.bias",
                   "features.denseblock1.denselayer1.conv1.weight", "classifier.weight",
                   "classifier.bias"}));
  EXPECT_EQ(keys_of(net->named_buffers()),
            (Names{"features.denseblock1.denselayer1.norm1.running_mean",
                   "features.denseblock1.denselayer1.norm1.running_var",
                   "features.denseblock1.denselayer1.norm1.num_batches_tracked"}));
  EXPECT_EQ(
      keys_of(net->named_modules()),
      (Names{"", "features", "features.denseblock1", "features.denseblock1.denselayer1",
             "features.denseblock1.denselayer1.norm1", "features.denseblock1.denselayer1.relu1",
             "features.denseblock1.denselayer1.conv1", "classifier"}));
  EXPECT_EQ(keys_of(net->named_children()), (Names{"features", "classifier"}));
  EXPECT_EQ(keys_of(net->classifier->named_parameters()), (Names{"weight", "bias"}));
  EXPECT_EQ(keys_of(net->named_parameters(/*recurse=*/false)), Names{});
  EXPECT_EQ(net->parameters().size(), 5u);
  EXPECT_EQ(net->buffers().size(), 3u);
  EXPECT_EQ(net->modules().size(), 8u);
}

TEST(NnModule, RegisteredHandlesAreTheLayerMembers) {
  auto net = std::make_shared<Net>();
  EXPECT_TRUE(net->get_parameter("classifier.weight").same(net->classifier->weight));
  EXPECT_TRUE(net->get_buffer("features.denseblock1.denselayer1.norm1.running_var")
                  .same(net->get_submodule("features.denseblock1.denselayer1.norm1")
                            ->as<nn::BatchNorm2d>()
                            ->running_var));
  EXPECT_TRUE(net->parameters()[3].same(net->classifier->weight));
  EXPECT_THROW(net->get_submodule("features.nope"), IndexError);
  EXPECT_THROW(net->get_parameter("classifier.gamma"), IndexError);
  EXPECT_EQ(net->get_submodule("")->name(), "Net");
}

TEST(NnModule, ParametersRequireGradAndBuffersDoNot) {
  nn::BatchNorm1d bn(4);
  EXPECT_TRUE(bn.weight.requires_grad());
  EXPECT_TRUE(bn.bias.requires_grad());
  EXPECT_FALSE(bn.running_mean.requires_grad());
  EXPECT_EQ(bn.num_batches_tracked.dtype(), kInt64);
  EXPECT_EQ(bn.num_batches_tracked.dim(), 0);
  nn::Module m;
  Tensor frozen = m.register_parameter("frozen", zeros({2}), /*requires_grad=*/false);
  EXPECT_FALSE(frozen.requires_grad());
  m.requires_grad_(true);
  EXPECT_TRUE(frozen.requires_grad());
  m.requires_grad_(false);
  EXPECT_FALSE(frozen.requires_grad());
}

TEST(NnModule, AbsentOptionalParameterIsSkippedEverywhere) {
  nn::Linear fc(3, 4, /*bias=*/false);
  EXPECT_FALSE(fc.bias.defined());
  EXPECT_EQ(keys_of(fc.named_parameters()), Names{"weight"});
  EXPECT_EQ(keys_of(fc.state_dict()), Names{"weight"});
  nn::BatchNorm2d bn(
      nn::BatchNormOptions{.num_features = 3, .affine = false, .track_running_stats = false});
  EXPECT_TRUE(bn.named_parameters().empty());
  EXPECT_TRUE(bn.state_dict().empty());
}

TEST(NnModule, RegistrationRejectsBadNamesAndKindClashes) {
  nn::Module m;
  EXPECT_THROW(m.register_parameter("", zeros({1})), ValueError);
  EXPECT_THROW(m.register_parameter("a.b", zeros({1})), ValueError);
  EXPECT_THROW(m.register_buffer("x.y", zeros({1})), ValueError);
  EXPECT_THROW(m.register_module("", std::make_shared<nn::ReLU>()), ValueError);
  m.register_parameter("w", zeros({1}));
  EXPECT_THROW(m.register_buffer("w", zeros({1})), ValueError);
  EXPECT_THROW(m.register_module("w", std::make_shared<nn::ReLU>()), ValueError);
  EXPECT_THROW(m.register_parameter("ints", zeros({1}, kInt64)), DTypeError);
}

TEST(NnModule, ReRegisteringReplacesInPlaceKeepingOrder) {
  nn::Module m;
  m.register_parameter("a", zeros({1}));
  m.register_parameter("b", zeros({1}));
  m.register_parameter("a", ones({2}));
  EXPECT_EQ(keys_of(m.named_parameters()), (Names{"a", "b"}));
  EXPECT_TRUE(matches(m.get_parameter("a"), {2}, {1, 1}));
}

TEST(NnModule, SharedParametersAndModulesAreListedOnce) {
  auto shared = std::make_shared<nn::Linear>(2, 2);
  nn::Sequential seq(shared, std::make_shared<nn::ReLU>(), shared);
  EXPECT_EQ(seq.size(), 3u);
  EXPECT_EQ(keys_of(seq.named_parameters()), (Names{"0.weight", "0.bias"}));
  EXPECT_EQ(keys_of(seq.named_modules()), (Names{"", "0", "1"}));
  // state_dict lists a shared tensor under every name, as PyTorch does.
  EXPECT_EQ(keys_of(seq.state_dict()), (Names{"0.weight", "0.bias", "2.weight", "2.bias"}));
}

TEST(NnModule, TrainAndEvalPropagateToEveryDescendant) {
  auto net = std::make_shared<Net>();
  for (const auto& m : net->modules()) EXPECT_TRUE(m->is_training());
  net->eval();
  for (const auto& m : net->modules()) EXPECT_FALSE(m->is_training());
  net->features->train();
  EXPECT_FALSE(net->is_training());
  EXPECT_TRUE(net->get_submodule("features.denseblock1.denselayer1.norm1")->is_training());
  EXPECT_FALSE(net->classifier->is_training());
}

TEST(NnModule, ToDtypeConvertsInPlaceAndKeepsMemberHandles) {
  auto net = std::make_shared<Net>();
  Tensor weight_handle = net->classifier->weight;
  const std::vector<double> before = values(weight_handle);
  net->classifier->weight.set_grad(full({2, 3}, 0.5f));
  const uint64_t version = net->structure_version();
  net->to(kFloat64);
  EXPECT_GT(net->structure_version(), version);
  EXPECT_EQ(weight_handle.dtype(), kFloat64);
  EXPECT_EQ(net->classifier->weight.dtype(), kFloat64);
  EXPECT_TRUE(weight_handle.requires_grad());
  EXPECT_EQ(values(weight_handle), before);  // float32 -> float64 is exact
  EXPECT_EQ(weight_handle.grad().dtype(), kFloat64);
  EXPECT_TRUE(matches(weight_handle.grad(), {2, 3}, std::vector<double>(6, 0.5)));
  auto* bn = net->get_submodule("features.denseblock1.denselayer1.norm1")->as<nn::BatchNorm2d>();
  EXPECT_EQ(bn->running_mean.dtype(), kFloat64);
  EXPECT_EQ(bn->num_batches_tracked.dtype(), kInt64);  // integer buffers keep their dtype
  for (const auto& [name, p] : net->named_parameters()) EXPECT_EQ(p.dtype(), kFloat64) << name;
  // The converted model runs in float64.
  Tensor y = net->forward(ones({1, 2, 2, 2}, kFloat64));
  EXPECT_EQ(y.dtype(), kFloat64);
  EXPECT_THROW(net->to(kInt64), DTypeError);
  const uint64_t v2 = net->structure_version();
  net->to(kFloat64);  // nothing to convert
  EXPECT_EQ(net->structure_version(), v2);
}

TEST(NnModule, StateDictKeysValuesAndAliasing) {
  auto net = std::make_shared<Net>();
  NamedTensors sd = net->state_dict();
  EXPECT_EQ(keys_of(sd), (Names{"features.denseblock1.denselayer1.norm1.weight",
                                "features.denseblock1.denselayer1.norm1.bias",
                                "features.denseblock1.denselayer1.norm1.running_mean",
                                "features.denseblock1.denselayer1.norm1.running_var",
                                "features.denseblock1.denselayer1.norm1.num_batches_tracked",
                                "features.denseblock1.denselayer1.conv1.weight",
                                "classifier.weight", "classifier.bias"}));
  for (const auto& [k, t] : sd) EXPECT_FALSE(t.requires_grad()) << k;
  EXPECT_TRUE(sd[6].second.is_alias_of(net->classifier->weight));
  EXPECT_EQ(sd[4].second.dtype(), kInt64);
  EXPECT_EQ(sd[4].second.dim(), 0);
}

TEST(NnModule, NonPersistentBuffersStayOutOfStateDict) {
  nn::Module m;
  m.register_buffer("kept", zeros({1}));
  m.register_buffer("scratch", zeros({1}), /*persistent=*/false);
  EXPECT_EQ(keys_of(m.named_buffers()), (Names{"kept", "scratch"}));
  EXPECT_EQ(keys_of(m.state_dict()), Names{"kept"});
}

TEST(NnModule, LoadStateDictCopiesValuesIntoExistingTensors) {
  auto src = std::make_shared<Net>();
  auto dst = std::make_shared<Net>();
  {
    NoGradGuard g;
    src->classifier->weight.copy_(tensor<float>({1, 2, 3, 4, 5, 6}).view({2, 3}));
  }
  auto* bn = src->get_submodule("features.denseblock1.denselayer1.norm1")->as<nn::BatchNorm2d>();
  bn->num_batches_tracked.fill_(7);
  Tensor handle = dst->classifier->weight;
  nn::IncompatibleKeys r = dst->load_state_dict(src->state_dict());
  EXPECT_TRUE(r.empty());
  EXPECT_TRUE(handle.same(dst->classifier->weight));
  EXPECT_TRUE(matches(handle, {2, 3}, {1, 2, 3, 4, 5, 6}));
  EXPECT_TRUE(handle.requires_grad());
  EXPECT_EQ(
      dst->get_buffer("features.denseblock1.denselayer1.norm1.num_batches_tracked").item<int64_t>(),
      7);
  EXPECT_FALSE(handle.is_alias_of(src->classifier->weight));
}

TEST(NnModule, LoadStateDictConvertsDtype) {
  nn::Linear fc(2, 1);
  NamedTensors sd{{"weight", tensor<double>({0.25, -0.5}).view({1, 2})},
                  {"bias", tensor<double>({2.0})}};
  fc.load_state_dict(sd);
  EXPECT_EQ(fc.weight.dtype(), kFloat32);
  EXPECT_TRUE(matches(fc.weight, {1, 2}, {0.25, -0.5}));
  EXPECT_TRUE(matches(fc.bias, {1}, {2.0}));
}

TEST(NnModule, LoadStateDictNamesMissingAndUnexpectedKeys) {
  auto fc = std::make_shared<nn::Linear>(3, 4);
  NamedTensors sd{{"weight", zeros({4, 3})}, {"extra", zeros({1})}, {"bias.x", zeros({1})}};
  try {
    fc->load_state_dict(sd);
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("[kiln::load_state_dict] Error(s) in loading state_dict for Linear:"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("Missing key(s) in state_dict: \"bias\"."), std::string::npos) << msg;
    EXPECT_NE(msg.find("Unexpected key(s) in state_dict: \"extra\", \"bias.x\"."),
              std::string::npos)
        << msg;
  }
  // Nothing was loaded: the checks come before any copy.
  EXPECT_GT(fc->weight.abs().sum().item<float>(), 0.0f);
}

TEST(NnModule, LoadStateDictSizeMismatchUsesPyTorchWording) {
  struct Model : nn::Module {
    Model() { fc = register_module("fc", std::make_shared<nn::Linear>(3, 5)); }
    std::shared_ptr<nn::Linear> fc;
  };
  auto m = std::make_shared<Model>();
  NamedTensors sd{{"fc.weight", zeros({4, 3})}, {"fc.bias", zeros({5})}};
  for (bool strict : {true, false}) {
    try {
      m->load_state_dict(sd, strict);
      FAIL() << "expected ShapeError";
    } catch (const ShapeError& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "size mismatch for fc.weight: copying a param with shape (4, 3) from "
                    "checkpoint, the shape in current model is (5, 3)."),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_GT(m->fc->bias.abs().sum().item<float>(), 0.0f);  // fc.bias was not loaded either
}

TEST(NnModule, NonStrictLoadReturnsIncompatibleKeysAndLoadsTheRest) {
  auto fc = std::make_shared<nn::Linear>(2, 2);
  NamedTensors sd{{"weight", full({2, 2}, 3.0f)}, {"unused", zeros({1})}};
  nn::IncompatibleKeys r = fc->load_state_dict(sd, /*strict=*/false);
  EXPECT_EQ(r.missing_keys, Names{"bias"});
  EXPECT_EQ(r.unexpected_keys, Names{"unused"});
  EXPECT_TRUE(matches(fc->weight, {2, 2}, {3, 3, 3, 3}));
}

TEST(NnModule, LoadStateDictRejectsDuplicateKeys) {
  nn::Linear fc(1, 1);
  NamedTensors sd{{"weight", zeros({1, 1})}, {"weight", zeros({1, 1})}, {"bias", zeros({1})}};
  EXPECT_THROW(fc.load_state_dict(sd), ValueError);
}

TEST(NnModule, StructureVersionTracksRegistrationTrainingAndReplacement) {
  auto net = std::make_shared<Net>();
  uint64_t v = net->structure_version();
  EXPECT_EQ(net->structure_version(), v);
  net->forward(ones({1, 2, 2, 2}));  // running a forward is not a structural change
  EXPECT_EQ(net->structure_version(), v);

  net->eval();
  EXPECT_GT(net->structure_version(), v);
  v = net->structure_version();
  net->eval();  // no flag changes
  EXPECT_EQ(net->structure_version(), v);

  // A change deep inside the tree.
  net->get_submodule("features.denseblock1.denselayer1")->register_buffer("extra", zeros({1}));
  EXPECT_GT(net->structure_version(), v);
  v = net->structure_version();

  net->classifier->register_parameter("bias", Tensor());
  EXPECT_GT(net->structure_version(), v);
  v = net->structure_version();

  net->register_module("classifier", std::make_shared<nn::Linear>(3, 2));
  EXPECT_GT(net->structure_version(), v);
  v = net->structure_version();

  net->load_state_dict(net->state_dict());  // values only
  EXPECT_EQ(net->structure_version(), v);
}

TEST(NnModule, ApplyVisitsChildrenBeforeParent) {
  auto net = std::make_shared<Net>();
  Names order;
  net->apply([&](nn::Module& m) { order.push_back(m.name()); });
  EXPECT_EQ(order, (Names{"BatchNorm2d", "ReLU", "Conv2d", "DenseLayer", "Sequential", "Sequential",
                          "Linear", "Net"}));
  int linears = 0;
  net->apply([&](nn::Module& m) {
    if (auto* fc = m.as<nn::Linear>()) {
      nn::init::zeros_(fc->weight);
      ++linears;
    }
  });
  EXPECT_EQ(linears, 1);
  EXPECT_TRUE(matches(net->classifier->weight, {2, 3}, std::vector<double>(6, 0.0)));
}

TEST(NnModule, ZeroGradClearsOrZeroesGradients) {
  nn::Linear fc(2, 1);
  fc.weight.set_grad(ones({1, 2}));
  fc.bias.set_grad(ones({1}));
  fc.zero_grad(/*set_to_none=*/false);
  EXPECT_TRUE(matches(fc.weight.grad(), {1, 2}, {0, 0}));
  fc.zero_grad();
  EXPECT_FALSE(fc.weight.grad().defined());
  EXPECT_FALSE(fc.bias.grad().defined());
}

TEST(NnModule, MissingForwardThrowsNamingTheModule) {
  auto m = std::make_shared<NoForward>();
  try {
    (*m)(ones({1}));
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "Module [NoForward] is missing the required \"forward\" function"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(nn::ModuleList().forward(ones({1})), Error);
}

TEST(NnModule, NameIsTheUnqualifiedTypeName) {
  EXPECT_EQ(nn::Linear(1, 1).name(), "Linear");
  EXPECT_EQ(Net().name(), "Net");
  EXPECT_EQ(nn::MultiheadAttention(4, 2).out_proj->name(), "NonDynamicallyQuantizableLinear");
}

TEST(NnModule, ContainersIndexAndIterate) {
  nn::Sequential seq(std::make_shared<nn::Linear>(2, 3), std::make_shared<nn::ReLU>());
  seq.push_back(std::make_shared<nn::Linear>(3, 1));
  EXPECT_EQ(seq.size(), 3u);
  EXPECT_EQ(seq[-1]->name(), "Linear");
  EXPECT_EQ(seq.at<nn::ReLU>(1)->name(), "ReLU");
  EXPECT_THROW(seq.at<nn::Linear>(1), ValueError);
  EXPECT_THROW(seq[3], IndexError);
  EXPECT_THROW(seq[-4], IndexError);
  Names names;
  for (const auto& m : seq) names.push_back(m->name());
  EXPECT_EQ(names, (Names{"Linear", "ReLU", "Linear"}));
  EXPECT_EQ(keys_of(seq.named_children()), (Names{"0", "1", "2"}));

  nn::ModuleList list({std::make_shared<nn::Tanh>(), std::make_shared<nn::Sigmoid>()});
  list.push_back(std::make_shared<nn::SiLU>());
  EXPECT_EQ(list.size(), 3u);
  EXPECT_EQ(list[2]->name(), "SiLU");

  nn::ModuleDict dict({{"encoder", std::make_shared<nn::Linear>(2, 2)}});
  dict.insert("act", std::make_shared<nn::GELU>());
  EXPECT_TRUE(dict.contains("act"));
  EXPECT_FALSE(dict.contains("decoder"));
  EXPECT_EQ(dict.keys(), (Names{"encoder", "act"}));
  EXPECT_EQ(keys_of(dict.named_parameters()), (Names{"encoder.weight", "encoder.bias"}));
  EXPECT_THROW(dict["decoder"], IndexError);
  EXPECT_EQ(dict.at<nn::GELU>("act")->approximate, "none");
}

TEST(NnModule, ModulesOnTheStackWork) {
  nn::Sequential seq;
  seq.push_back(std::make_shared<nn::Identity>());
  EXPECT_EQ(keys_of(seq.named_modules()), (Names{"", "0"}));
  EXPECT_EQ(seq.get_submodule("")->name(), "Sequential");
}

// ---------------- printing ----------------

TEST(NnModulePrinting, SequentialMatchesPyTorchRepr) {
  auto model = std::make_shared<nn::Sequential>(
      std::make_shared<nn::Conv2d>(nn::Conv2dOptions{
          .in_channels = 3, .out_channels = 8, .kernel_size = 3, .padding = 1, .bias = false}),
      std::make_shared<nn::BatchNorm2d>(8), std::make_shared<nn::ReLU>(true),
      std::make_shared<nn::MaxPool2d>(2), std::make_shared<nn::AdaptiveAvgPool2d>(nn::Size2(1, 1)),
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(8, 4),
      std::make_shared<nn::Dropout>(0.1));
  // >>> print(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
  // ...   nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(),
  // ...   nn.Linear(8, 4), nn.Dropout(0.1)))
  const std::string expected =
      "Sequential(\n"
      "  (0): Conv2d(3, 8, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), bias=False)\n"
      "  (1): BatchNorm2d(8, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)\n"
      "  (2): ReLU(inplace=True)\n"
      "  (3): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)\n"
      "  (4): AdaptiveAvgPool2d(output_size=(1, 1))\n"
      "  (5): Flatten(start_dim=1, end_dim=-1)\n"
      "  (6): Linear(in_features=8, out_features=4, bias=True)\n"
      "  (7): Dropout(p=0.1, inplace=False)\n"
      ")";
  EXPECT_EQ(model->str(), expected);
  std::ostringstream os;
  os << *model;
  EXPECT_EQ(os.str(), expected);
}

TEST(NnModulePrinting, NestedModulesIndentLikePyTorch) {
  struct Tiny : nn::Module {
    Tiny() {
      register_module("features",
                      std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(3, 4),
                                                       std::make_shared<nn::GELU>("tanh")));
      register_module("norm", std::make_shared<nn::LayerNorm>(4));
      register_module("fc", std::make_shared<nn::Linear>(4, 2, false));
    }
  };
  EXPECT_EQ(Tiny().str(),
            "Tiny(\n"
            "  (features): Sequential(\n"
            "    (0): Linear(in_features=3, out_features=4, bias=True)\n"
            "    (1): GELU(approximate='tanh')\n"
            "  )\n"
            "  (norm): LayerNorm((4,), eps=1e-05, elementwise_affine=True)\n"
            "  (fc): Linear(in_features=4, out_features=2, bias=False)\n"
            ")");
}

TEST(NnModulePrinting, LeafLayersMatchPyTorchRepr) {
  EXPECT_EQ(nn::Conv2d(nn::Conv2dOptions{.in_channels = 4,
                                         .out_channels = 4,
                                         .kernel_size = 3,
                                         .padding = "same",
                                         .groups = 2})
                .str(),
            "Conv2d(4, 4, kernel_size=(3, 3), stride=(1, 1), padding=same, groups=2)");
  EXPECT_EQ(
      nn::Conv2d(2, 4, nn::Size2(3, 1), 2, nn::Conv2dPadding(1, 0), 2, 1, true, "reflect").str(),
      "Conv2d(2, 4, kernel_size=(3, 1), stride=(2, 2), padding=(1, 0), dilation=(2, 2), "
      "padding_mode=reflect)");
  EXPECT_EQ(nn::BatchNorm1d(
                nn::BatchNormOptions{
                    .num_features = 4, .eps = 1e-3, .momentum = std::nullopt, .affine = false})
                .str(),
            "BatchNorm1d(4, eps=0.001, momentum=None, affine=False, track_running_stats=True)");
  EXPECT_EQ(nn::GroupNorm(2, 4).str(), "GroupNorm(2, 4, eps=1e-05, affine=True)");
  EXPECT_EQ(nn::LayerNorm(std::vector<int64_t>{2, 3}, 1e-6, false).str(),
            "LayerNorm((2, 3), eps=1e-06, elementwise_affine=False)");
  EXPECT_EQ(nn::Embedding(10, 3, 0).str(), "Embedding(10, 3, padding_idx=0)");
  EXPECT_EQ(nn::Embedding(10, 3).str(), "Embedding(10, 3)");
  EXPECT_EQ(nn::AvgPool2d(2).str(), "AvgPool2d(kernel_size=2, stride=2, padding=0)");
  EXPECT_EQ(nn::MaxPool2d(nn::MaxPool2dOptions{
                              .kernel_size = {3, 2}, .stride = 1, .padding = 1, .ceil_mode = true})
                .str(),
            "MaxPool2d(kernel_size=(3, 2), stride=1, padding=1, dilation=1, ceil_mode=True)");
  EXPECT_EQ(nn::AdaptiveAvgPool2d(7).str(), "AdaptiveAvgPool2d(output_size=7)");
  EXPECT_EQ(nn::ReLU().str(), "ReLU()");
  EXPECT_EQ(nn::SiLU().str(), "SiLU()");
  EXPECT_EQ(nn::Tanh().str(), "Tanh()");
  EXPECT_EQ(nn::Sigmoid().str(), "Sigmoid()");
  EXPECT_EQ(nn::Identity().str(), "Identity()");
  EXPECT_EQ(nn::Softmax(-1).str(), "Softmax(dim=-1)");
  EXPECT_EQ(nn::GELU().str(), "GELU(approximate='none')");
  EXPECT_EQ(nn::Dropout().str(), "Dropout(p=0.5, inplace=False)");
  EXPECT_EQ(
      nn::MultiheadAttention(8, 2).str(),
      "MultiheadAttention(\n"
      "  (out_proj): NonDynamicallyQuantizableLinear(in_features=8, out_features=8, bias=True)\n"
      ")");
}

TEST(NnModulePrinting, ModuleListFoldsRepeatedChildren) {
  nn::ModuleList list;
  for (int i = 0; i < 3; ++i) list.push_back(std::make_shared<nn::Linear>(2, 2));
  list.push_back(std::make_shared<nn::ReLU>());
  list.push_back(std::make_shared<nn::Linear>(2, 2));
  EXPECT_EQ(list.str(),
            "ModuleList(\n"
            "  (0-2): 3 x Linear(in_features=2, out_features=2, bias=True)\n"
            "  (3): ReLU()\n"
            "  (4): Linear(in_features=2, out_features=2, bias=True)\n"
            ")");
  EXPECT_EQ(nn::ModuleList().str(), "ModuleList()");
  nn::ModuleDict dict({{"a", std::make_shared<nn::Tanh>()}});
  EXPECT_EQ(dict.str(), "ModuleDict(\n  (a): Tanh()\n)");
}

TEST(NnModulePrinting, PythonFloatRepr) {
  using nn::python_float_repr;
  EXPECT_EQ(python_float_repr(1e-5), "1e-05");
  EXPECT_EQ(python_float_repr(0.1), "0.1");
  EXPECT_EQ(python_float_repr(1.0), "1.0");
  EXPECT_EQ(python_float_repr(0.0001), "0.0001");
  EXPECT_EQ(python_float_repr(1.5e-7), "1.5e-07");
  EXPECT_EQ(python_float_repr(123456.789), "123456.789");
  EXPECT_EQ(python_float_repr(1e16), "1e+16");
  EXPECT_EQ(python_float_repr(1e15), "1000000000000000.0");
  EXPECT_EQ(python_float_repr(-2.5), "-2.5");
  EXPECT_EQ(python_float_repr(0.0), "0.0");
  EXPECT_EQ(nn::python_bool_repr(true), std::string("True"));
}

// The example at the top of docs/nn.md.
TEST(NnModule, DocsExampleRunsAndNamesMatch) {
  struct DocNet : nn::Module {
    DocNet() {
      features = register_module(
          "features",
          std::make_shared<nn::Sequential>(
              std::make_shared<nn::Conv2d>(nn::Conv2dOptions{.in_channels = 3,
                                                             .out_channels = 16,
                                                             .kernel_size = 3,
                                                             .padding = 1,
                                                             .bias = false}),
              std::make_shared<nn::BatchNorm2d>(16), std::make_shared<nn::ReLU>(true),
              std::make_shared<nn::AdaptiveAvgPool2d>(1), std::make_shared<nn::Flatten>()));
      fc = register_module("fc", std::make_shared<nn::Linear>(16, 10));
    }
    Tensor forward(const Tensor& x) override { return fc->forward(features->forward(x)); }
    std::shared_ptr<nn::Sequential> features;
    std::shared_ptr<nn::Linear> fc;
  };
  auto model = std::make_shared<DocNet>();
  Tensor logits = model->forward(randn({4, 3, 8, 8}));
  EXPECT_EQ(logits.sizes().vec(), (std::vector<int64_t>{4, 10}));
  Tensor loss = nn::functional::cross_entropy(logits, randint(10, {4}));
  EXPECT_EQ(loss.dim(), 0);
  EXPECT_EQ(keys_of(model->named_parameters()), (Names{"features.0.weight", "features.1.weight",
                                                       "features.1.bias", "fc.weight", "fc.bias"}));
}
