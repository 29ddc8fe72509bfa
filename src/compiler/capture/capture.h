// Capture internals: the per-thread capture context, lazy values and segments (DESIGN §2.3).
//
// While a thread runs the body of a compiled function, call_op/call_op_out hand every op to
// capture_op/capture_op_out instead of running kernels. Results are lazy: a TensorImpl with full
// metadata, `lazy` pointing at its value in the pending segment, and a *pending* Storage (data
// still null) that all views of it share. A flush compiles or looks up the segment's graph, runs
// it, and moves each live result's buffer into its pending Storage — every handle and view the
// program holds becomes real at once.
#pragma once

#include <memory>
#include <mutex>
#include <source_location>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "compiler/capture/call_site.h"
#include "kiln/compiler.h"

namespace kiln::compiler {

namespace detail {
struct Segment;
struct CaptureContext;
}  // namespace detail

// How to compute a value that a forward graph did not save (the min-cut partition, see
// context.cpp "recomputed saved values"): one pointwise op over tensors that are real, or
// recomputed themselves. A backward that captures reads it as that op (fused into the backward's
// kernels); anything else that touches the data computes it eagerly once.
struct Recipe {
  const OpDef* op = nullptr;
  std::vector<Attr> attrs;
  std::vector<Tensor> inputs;  // undefined for None
  std::vector<uint64_t> versions;  // of the inputs, when the forward ran
  ValueInfo info;              // the value as the forward graph recorded it
  std::mutex mutex;            // one eager computation at a time
};

// What TensorImpl::lazy points to while a value is pending. After its segment ran, a value that
// only autograd saved and that is cheap to recompute keeps a `recipe` instead of data (and no
// segment: the forward's graph is not kept alive for it).
struct LazyValue {
  std::shared_ptr<detail::Segment> segment;
  int value = -1;
  std::shared_ptr<Recipe> recipe;
};

namespace detail {

// The active capture of this thread, or nullptr (also while suspended).
CaptureContext* active_capture();

// Sets this thread's capture; returns the previous one.
CaptureContext* exchange_capture(CaptureContext* ctx);

// Suspends capture on this thread while alive (graph execution, eager fallbacks, disable()).
class SuspendCapture {
 public:
  SuspendCapture();
  ~SuspendCapture();
  SuspendCapture(const SuspendCapture&) = delete;
  SuspendCapture& operator=(const SuspendCapture&) = delete;

 private:
  CaptureContext* saved_;
};

// Dispatcher hooks (src/core/op_table.cpp calls these when active_capture() is set).
std::vector<Tensor> capture_op(CaptureContext& cap, const OpDef& op, std::vector<Tensor>& inputs,
                               std::vector<Attr>& attrs);
void capture_op_out(CaptureContext& cap, const OpDef& op, std::vector<Tensor>& inputs,
                    std::vector<Attr>& attrs, std::span<Tensor> outputs);

// A host read of tensor data while capturing: flushes the pending segment (a graph break).
// `what` names the read ("Tensor::item()").
void host_read(std::string_view what);
// A graph break that library code asks for, reported with `reason` verbatim and the user's call
// site (DistributedDataParallel's bucket boundaries). A library's own source_location would
// name its build tree, which an installed Kiln must not.
void library_graph_break(std::string_view reason);

// Makes a lazy tensor real (data() on a pending value): flushes its segment if this thread owns
// it, else throws.
void materialize(const kiln::detail::TensorImpl& impl);

// Traces `fn` on lazy inputs with the given metadata into a graph (inputs = the placeholders in
// order, outputs = what fn returns). For decompositions written as ordinary Kiln code. Runs without
// autograd; a host read or a tensor from outside throws CompileError.
Graph trace_graph(const std::vector<ValueInfo>& inputs,
                  const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn);

}  // namespace detail
}  // namespace kiln::compiler
