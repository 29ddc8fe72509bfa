// Escape hatches at the op level: disallow_in_graph and custom ops (DESIGN §2.3, spec §3.4).
#include <mutex>
#include <set>

#include "compiler/capture/runtime.h"

namespace kiln::compiler {

namespace {
std::mutex g_mutex;
std::set<const OpDef*> g_disallowed;  // guarded by g_mutex
std::atomic<int> g_disallowed_count{0};

const OpDef& find_op(std::string_view name, const char* caller) {
  const OpDef* op = OpTable::instance().find(name);
  KILN_CHECK(op != nullptr, ValueError,
             std::string("[kiln::compiler::") + caller + "] '" + std::string(name) +
                 "' is not an op in the op table. disallow_in_graph is expected to be used on an already "
                 "allowed callable (an op that compiled code puts in its graphs); `kiln ops` lists them.");
  return *op;
}
}  // namespace

void disallow_in_graph(std::string_view op_name) {
  const OpDef& op = find_op(op_name, "disallow_in_graph");
  std::lock_guard lock(g_mutex);
  if (g_disallowed.insert(&op).second) g_disallowed_count.fetch_add(1, std::memory_order_release);
}

void allow_in_graph(std::string_view op_name) {
  const OpDef& op = find_op(op_name, "allow_in_graph");
  std::lock_guard lock(g_mutex);
  if (g_disallowed.erase(&op)) g_disallowed_count.fetch_sub(1, std::memory_order_release);
}

bool is_disallowed_in_graph(const OpDef& op) {
  if (g_disallowed_count.load(std::memory_order_acquire) == 0) return false;  // the common case
  std::lock_guard lock(g_mutex);
  return g_disallowed.count(&op) != 0;
}

CustomOp custom_op(CustomOpDef def) {
  KILN_CHECK(!def.name.empty(), ValueError, "[kiln::compiler::custom_op] the op needs a name.");
  KILN_CHECK(static_cast<bool>(def.meta), ValueError,
             "[kiln::compiler::custom_op] op '" + def.name + "' needs a meta function (output sizes and dtypes).");
  KILN_CHECK(static_cast<bool>(def.cpu_kernel) || static_cast<bool>(def.cuda_kernel), ValueError,
             "[kiln::compiler::custom_op] op '" + def.name + "' needs at least one kernel.");
  KILN_CHECK(OpTable::instance().find(def.name) == nullptr, ValueError,
             "[kiln::compiler::custom_op] an op named '" + def.name + "' already exists. Pick another name.");
  OpDef op;
  op.name = def.name;
  op.schema = def.schema.empty() ? def.name + "(...) -> Tensor" : def.schema;
  op.kind = OpKind::compute;
  op.meta = std::move(def.meta);
  if (def.cpu_kernel) op.kernels[static_cast<int>(DeviceType::cpu)] = std::move(def.cpu_kernel);
  if (def.cuda_kernel) op.kernels[static_cast<int>(DeviceType::cuda)] = std::move(def.cuda_kernel);
  op.derivative = std::move(def.derivative);
  op.lowering = lowering::Extern{};  // opaque to the compiler: called as is, never traced into
  return CustomOp(&register_op(std::move(op)));
}

std::vector<Tensor> CustomOp::operator()(std::vector<Tensor> inputs, std::vector<Attr> attrs) const {
  return call_op(*op_, std::move(inputs), std::move(attrs));
}

Tensor CustomOp::call1(std::vector<Tensor> inputs, std::vector<Attr> attrs) const {
  return call_op1(*op_, std::move(inputs), std::move(attrs));
}

}  // namespace kiln::compiler
