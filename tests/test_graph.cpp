// The captured-graph IR: building, printing, validation, the interpreter and the DCE/CSE passes.
#include <gtest/gtest.h>

#include <sstream>

#include "compiler/graph/passes.h"
#include "graph_builders.h"
#include "kiln/compiler/graph.h"
#include "kiln/detail/tensor_impl.h"
#include "kiln/error.h"
#include "kiln/kiln.h"

namespace {

using kiln::Attr;
using kiln::OpDef;
using kiln::Scalar;
using kiln::Tensor;
using kiln::compiler::Arguments;
using kiln::compiler::Graph;
using kiln::compiler::Node;
using kiln::compiler::ValueInfo;
namespace passes = kiln::compiler::passes;

using kiln::testing::op;

ValueInfo value(std::vector<int64_t> sizes, std::string name = "",
                kiln::DType dtype = kiln::kFloat32) {
  return kiln::testing::contiguous_value(std::move(sizes), dtype, kiln::kCPU, std::move(name));
}

// Appends a single-output node whose result has `sizes`; returns the result's id.
int call(Graph& g, std::string_view name, std::vector<int> inputs, std::vector<Attr> attrs = {},
         std::vector<int64_t> sizes = {3, 3}) {
  return kiln::testing::add_call(g, name, std::move(inputs), std::move(attrs), {value(std::move(sizes))})[0];
}

// x, y: f32[3, 3]; returns sin(x) + cos(y).
Graph sin_cos_add() {
  Graph g;
  int x = g.add_input(value({3, 3}, "x"));
  int y = g.add_input(value({3, 3}, "y"));
  int s = call(g, "sin", {x});
  int c = call(g, "cos", {y});
  g.outputs = {call(g, "add", {s, c}, {Scalar(1)})};
  return g;
}

std::vector<Tensor> run(const Graph& g, std::vector<Tensor> tensors,
                        std::vector<Attr> scalars = {}) {
  auto fn = kiln::compiler::interpreter(g);
  return fn(Arguments{tensors, scalars});
}

// ---- building ----

TEST(GraphBuild, NodeNamesFollowFx) {
  Graph g;
  int x = g.add_input(value({3, 3}, "x"));
  int c = g.add_input(value({3, 3}, "cos"));
  call(g, "sin", {x});
  call(g, "sin", {x});
  call(g, "sin", {x});
  call(g, "cos", {c});
  call(g, "bernoulli.p", {x}, {0.5, int64_t{0}, int64_t{0}});
  EXPECT_EQ(g.nodes[0].name, "sin");
  EXPECT_EQ(g.nodes[1].name, "sin_1");
  EXPECT_EQ(g.nodes[2].name, "sin_2");
  EXPECT_EQ(g.nodes[3].name, "cos_1");  // "cos" is a placeholder
  EXPECT_EQ(g.nodes[4].name, "bernoulli_p");
  EXPECT_EQ(g.op_names(), (std::vector<std::string>{"sin", "sin", "sin", "cos", "bernoulli.p"}));
  EXPECT_EQ(g.size(), 5u);
}

TEST(GraphBuild, ReplaceAllUsesAndUseCounts) {
  Graph g = sin_cos_add();
  EXPECT_EQ(g.use_counts(), (std::vector<int>{1, 1, 1, 1, 1}));
  g.replace_all_uses(3, 2);  // add(sin, sin)
  EXPECT_EQ(g.nodes[2].inputs, (std::vector<int>{2, 2}));
  EXPECT_EQ(g.use_counts(), (std::vector<int>{1, 1, 2, 0, 1}));
  g.replace_all_uses(4, 0);
  EXPECT_EQ(g.outputs, (std::vector<int>{0}));
}

TEST(GraphBuild, EraseNodesIfRemapsScalarSlots) {
  Graph g;
  int x = g.add_input(value({3, 3}, "x"));
  int a = call(g, "add", {x, x}, {Scalar(1)});
  call(g, "sin", {a});
  int b = call(g, "add", {a, x}, {Scalar(2)});
  g.outputs = {b};
  g.scalars = {{0, 0}, {2, 0}};
  g.erase_nodes_if([](const Node& n) { return n.target() == "sin"; });
  ASSERT_EQ(g.size(), 2u);
  ASSERT_EQ(g.scalars.size(), 2u);
  EXPECT_EQ(g.scalars[0].node, 0);
  EXPECT_EQ(g.scalars[1].node, 1);  // the second add moved up past the erased sin
  g.erase_nodes_if([](const Node& n) { return n.name == "add"; });
  // Slots keep their positions (the runtime passes scalars by index); the erased node's is unused.
  ASSERT_EQ(g.scalars.size(), 2u);
  EXPECT_EQ(g.scalars[0].node, -1);
  EXPECT_EQ(g.scalars[0].attr, -1);
  EXPECT_EQ(g.scalars[1].node, 0);
  EXPECT_EQ(g.nodes[0].name, "add_1");
}

// ---- printing ----

TEST(GraphPrint, TabularMatchesFxLayout) {
  const char* expected =
      "opcode         name    target  args        kwargs\n"
      "-------------  ------  ------  ----------  ------------\n"
      "placeholder    x       x       ()          {}\n"
      "placeholder    y       y       ()          {}\n"
      "call_function  sin     sin     (x,)        {}\n"
      "call_function  cos     cos     (y,)        {}\n"
      "call_function  add     add     (sin, cos)  {'alpha': 1}\n"
      "output         output  output  ((add,),)   {}\n";
  Graph g = sin_cos_add();
  EXPECT_EQ(g.tabular(), expected);
  std::ostringstream os;
  g.print_tabular(os);
  EXPECT_EQ(os.str(), expected);
}

TEST(GraphPrint, AttrsUseSchemaNamesAndPythonSyntax) {
  Graph g;
  int x = g.add_input(value({2, 3}, "x"));
  call(g, "sum", {x}, {std::vector<int64_t>{0, 1}, false, Attr{}}, {});
  Node& ln = g.add_node(op("native_layer_norm"), {x, -1, -1}, {std::vector<int64_t>{3}, 1e-05});
  ln.outputs = {g.add_value(value({2, 3})), g.add_value(value({2, 1})), g.add_value(value({2, 1}))};
  int normed = ln.outputs[0];
  call(g, "gelu", {x}, {std::string("tanh")}, {2, 3});
  call(g, "mul", {normed, x}, {}, {2, 3});
  std::string t = g.tabular();
  EXPECT_NE(t.find("{'dim': [0, 1], 'keepdim': False, 'dtype': None}"), std::string::npos) << t;
  EXPECT_NE(t.find("(x, None, None)"), std::string::npos) << t;
  EXPECT_NE(t.find("{'normalized_shape': [3], 'eps': 1e-05}"), std::string::npos) << t;
  EXPECT_NE(t.find("{'approximate': 'tanh'}"), std::string::npos) << t;
  EXPECT_NE(t.find("(native_layer_norm[0], x)"), std::string::npos) << t;
  std::string s = g.str();
  EXPECT_NE(s.find("%native_layer_norm = native_layer_norm(%x, None, None, normalized_shape=[3], "
                   "eps=1e-05)  "
                   "# (f32[2, 3], f32[2, 1], f32[2, 1])"),
            std::string::npos)
      << s;
  EXPECT_NE(s.find("%mul = mul(%native_layer_norm[0], %x)  # f32[2, 3]"), std::string::npos) << s;
}

TEST(GraphPrint, FloatsPrintLikePython) {
  Graph g;
  int x = g.add_input(value({3}, "x"));
  for (double d : {1.0, 0.5, 1e-05, 1e16, 123.25, -2.0, 0.0001, 1e15})
    call(g, "add", {x, x}, {Scalar(d)}, {3});
  std::string t = g.tabular();
  for (const char* s :
       {"'alpha': 1.0}", "'alpha': 0.5}", "'alpha': 1e-05}", "'alpha': 1e+16}", "'alpha': 123.25}",
        "'alpha': -2.0}", "'alpha': 0.0001}", "'alpha': 1000000000000000.0}"})
    EXPECT_NE(t.find(s), std::string::npos) << s << "\n" << t;
}

TEST(GraphPrint, StrHasOneLinePerNode) {
  Graph g = sin_cos_add();
  int x = g.inputs[0], y = g.inputs[1];
  g.add_node(op("add"), {x, y}, {Scalar(2)}).inplace = true;
  g.nodes.back().outputs = {x};
  g.scalars = {{3, 0}};
  std::string s = g.str();
  EXPECT_NE(s.find("%x = placeholder()  # f32[3, 3]\n"), std::string::npos) << s;
  EXPECT_NE(s.find("%s0 = scalar()  # add_1.alpha = 2\n"), std::string::npos) << s;
  EXPECT_NE(s.find("%sin = sin(%x)  # f32[3, 3]\n"), std::string::npos) << s;
  EXPECT_NE(s.find("%add = add(%sin, %cos, alpha=1)  # f32[3, 3]\n"), std::string::npos) << s;
  EXPECT_NE(s.find("add(%x, %y, alpha=%s0, out=%x)  # add_1 (in place): f32[3, 3]\n"),
            std::string::npos)
      << s;
  EXPECT_NE(s.find("return (%add,)\n"), std::string::npos) << s;
  std::ostringstream os;
  os << g;
  EXPECT_EQ(os.str(), s);
  std::string t = g.tabular();
  EXPECT_NE(t.find("call_inplace   add_1   add     (x, y)      {'alpha': s0, 'out': x}"),
            std::string::npos)
      << t;
}

TEST(GraphPrint, DotIsADigraphWithProducerEdges) {
  Graph g = sin_cos_add();
  std::string d = g.dot();
  EXPECT_EQ(d.rfind("digraph", 0), 0u) << d;
  EXPECT_NE(d.find("in0 -> n0;"), std::string::npos) << d;
  EXPECT_NE(d.find("n0 -> n2;"), std::string::npos) << d;
  EXPECT_NE(d.find("n1 -> n2;"), std::string::npos) << d;
  EXPECT_NE(d.find("n2 -> output;"), std::string::npos) << d;
  EXPECT_EQ(d.back(), '\n');
}

// ---- validation ----

TEST(GraphValidate, AcceptsACorrectGraph) {
  Graph g = sin_cos_add();
  EXPECT_NO_THROW(g.validate());
}

TEST(GraphValidate, NamesTheNodeWithAWrongRecordedShape) {
  Graph g;
  int x = g.add_input(value({3}, "x"));
  int m = call(g, "mul", {x, x}, {}, {3});
  g.outputs = {call(g, "mul", {m, x}, {}, {4})};
  try {
    g.validate();
    FAIL() << "validate() accepted a wrong shape";
  } catch (const kiln::CompileError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("[kiln::compile] graph validation: node 'mul_1' (mul)"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("recorded f32[4] but meta gives f32[3]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("This is a capture bug; please report it."), std::string::npos) << msg;
  }
}

TEST(GraphValidate, RejectsUseBeforeDefinitionAndBadIds) {
  Graph g = sin_cos_add();
  std::swap(g.nodes[0], g.nodes[2]);  // add reads sin before it runs
  EXPECT_THROW(g.validate(), kiln::CompileError);
  Graph h = sin_cos_add();
  h.nodes[0].inputs = {42};
  EXPECT_THROW(h.validate(), kiln::CompileError);
  Graph k = sin_cos_add();
  k.nodes[0].outputs.push_back(k.add_value(value({3, 3})));  // sin has one output
  EXPECT_THROW(k.validate(), kiln::CompileError);
}

TEST(GraphValidate, ReportsMetaErrorsAsCompileErrors) {
  Graph g;
  int x = g.add_input(value({3}, "x"));
  int y = g.add_input(value({4}, "y"));
  g.outputs = {call(g, "add", {x, y}, {Scalar(1)}, {3})};
  EXPECT_THROW(g.validate(), kiln::CompileError);
}

// ---- interpreter ----

TEST(GraphInterpreter, MatchesEager) {
  Tensor x = kiln::randn({3, 3}), y = kiln::randn({3, 3});
  auto out = run(sin_cos_add(), {x, y});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(kiln::allclose(out[0], kiln::sin(x) + kiln::cos(y)));
}

TEST(GraphInterpreter, RunsWithoutRecordingAutograd) {
  Tensor x = kiln::randn({3, 3}).requires_grad_(), y = kiln::randn({3, 3});
  auto out = run(sin_cos_add(), {x, y});
  EXPECT_FALSE(out[0].requires_grad());
}

TEST(GraphInterpreter, InplaceNodeWritesItsTarget) {
  Graph g;
  int x = g.add_input(value({3, 3}, "x"));
  int y = g.add_input(value({3, 3}, "y"));
  Node& n = g.add_node(op("add"), {x, y}, {Scalar(1)});
  n.inplace = true;
  n.outputs = {x};
  g.outputs = {x};
  Tensor a = kiln::randn({3, 3}), b = kiln::randn({3, 3});
  Tensor expected = a + b;
  auto out = run(g, {a, b});
  EXPECT_TRUE(kiln::allclose(a, expected));
  EXPECT_TRUE(out[0].same(a));
}

TEST(GraphInterpreter, ScalarSlotsReplaceAttrs) {
  Graph g;
  int x = g.add_input(value({3}, "x"));
  int y = g.add_input(value({3}, "y"));
  g.outputs = {call(g, "add", {x, y}, {Scalar(1)}, {3})};
  g.scalars = {{0, 0}};
  auto fn = kiln::compiler::interpreter(g);
  Tensor a = kiln::randn({3}), b = kiln::randn({3});
  std::vector<Tensor> tensors{a, b};
  std::vector<Attr> scalars{Scalar(2.5)};
  EXPECT_TRUE(kiln::allclose(fn(Arguments{tensors, scalars})[0], a + b * 2.5));
  scalars = {-1.0};  // a double for a Scalar attr is converted
  EXPECT_TRUE(kiln::allclose(fn(Arguments{tensors, scalars})[0], a - b));
  scalars = {std::string("no")};
  try {
    fn(Arguments{tensors, scalars});
    FAIL() << "a string scalar was accepted";
  } catch (const kiln::CompileError& e) {
    EXPECT_NE(std::string(e.what()).find("scalar 0 (add.alpha)"), std::string::npos) << e.what();
  }
}

TEST(GraphInterpreter, MultiOutputNodesAndRepeatedCalls) {
  Graph g;
  int x = g.add_input(value({3, 4}, "x"));
  Node& n = g.add_node(op("max.dim"), {x}, {int64_t{1}, false});
  n.outputs = {g.add_value(value({3})), g.add_value(value({3}, "", kiln::kInt64))};
  g.outputs = {g.nodes[0].outputs[1], g.nodes[0].outputs[0]};
  EXPECT_NO_THROW(g.validate());
  auto fn = kiln::compiler::interpreter(g);
  for (int i = 0; i < 3; ++i) {
    Tensor a = kiln::randn({3, 4});
    std::vector<Tensor> tensors{a};
    auto out = fn(Arguments{tensors, {}});
    auto [values, indices] = kiln::max(a, 1);
    EXPECT_TRUE(kiln::equal(out[0], indices));
    EXPECT_TRUE(kiln::equal(out[1], values));
  }
}

TEST(GraphInterpreter, WrongArgumentCountThrows) {
  auto fn = kiln::compiler::interpreter(sin_cos_add());
  std::vector<Tensor> one{kiln::randn({3, 3})};
  EXPECT_THROW(fn(Arguments{one, {}}), kiln::CompileError);
  std::vector<Tensor> two{kiln::randn({3, 3}), kiln::randn({3, 3})};
  std::vector<Attr> extra{Scalar(1)};
  EXPECT_THROW(fn(Arguments{two, extra}), kiln::CompileError);
}

// ---- passes ----

TEST(GraphPasses, DceRemovesUnusedNodesButKeepsInplaceOnes) {
  Graph g;
  int x = g.add_input(value({3, 3}, "x"));
  int y = g.add_input(value({3, 3}, "y"));
  int s = call(g, "sin", {x});
  call(g, "cos", {s});  // unused, and makes sin unused
  Node& n = g.add_node(op("add"), {y, x}, {Scalar(1)});
  n.inplace = true;
  n.outputs = {y};
  g.outputs = {call(g, "exp", {x})};
  passes::eliminate_dead_code(g);
  EXPECT_EQ(g.op_names(), (std::vector<std::string>{"add", "exp"}));
  EXPECT_TRUE(g.nodes[0].inplace);
  EXPECT_NO_THROW(g.validate());
}

TEST(GraphPasses, CseMergesIdenticalNodes) {
  Graph g;
  int x = g.add_input(value({3, 3}, "x"));
  int a = call(g, "sin", {x});
  int b = call(g, "sin", {x});
  int ea = call(g, "exp", {a});
  int eb = call(g, "exp", {b});  // identical once b is a
  g.outputs = {call(g, "add", {ea, eb}, {Scalar(1)})};
  passes::eliminate_common_subexpressions(g);
  EXPECT_EQ(g.op_names(), (std::vector<std::string>{"sin", "exp", "add"}));
  EXPECT_EQ(g.nodes[2].inputs, (std::vector<int>{ea, ea}));
  EXPECT_NO_THROW(g.validate());
  Tensor t = kiln::randn({3, 3});
  EXPECT_TRUE(kiln::allclose(run(g, {t})[0], kiln::exp(kiln::sin(t)) * 2));
}

TEST(GraphPasses, CseDoesNotMergeAcrossWritesOrRandomOps) {
  Graph g;
  int x = g.add_input(value({3, 3}, "x"));
  int a = call(g, "sin", {x});
  Node& w = g.add_node(op("add"), {x, x}, {Scalar(1)});  // x += x between the two sins
  w.inplace = true;
  w.outputs = {x};
  int b = call(g, "sin", {x});
  int c = call(g, "cos", {x});
  int d = call(g, "cos", {x});
  Node& w2 = g.add_node(op("mul"), {d, x}, {});  // d is written: not interchangeable with c
  w2.inplace = true;
  w2.outputs = {d};
  std::vector<Attr> rand_attrs{
      std::vector<int64_t>{3, 3}, 0.0, 1.0, int64_t{7}, int64_t{0}, kiln::kFloat32, kiln::kCPU};
  int r1 = call(g, "uniform", {}, rand_attrs);
  int r2 = call(g, "uniform", {}, rand_attrs);
  g.outputs = {a, b, c, d, r1, r2};
  EXPECT_NO_THROW(g.validate());
  size_t before = g.size();
  passes::eliminate_common_subexpressions(g);
  EXPECT_EQ(g.size(), before);
}

TEST(GraphPasses, CseSkipsNodesWithScalarSlots) {
  Graph g;
  int x = g.add_input(value({3}, "x"));
  int a = call(g, "add", {x, x}, {Scalar(1)}, {3});
  int b = call(g, "add", {x, x}, {Scalar(1)}, {3});
  g.outputs = {a, b};
  g.scalars = {{1, 0}};
  passes::eliminate_common_subexpressions(g);
  EXPECT_EQ(g.size(), 2u);
}

}  // namespace
