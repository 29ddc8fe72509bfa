// A compiled graph's linear-layer GEMM with its weight packed once (the kiln backend's executor).
//
// `addmm(bias, x, w)` and `mm(x, w)`, where `w` is the transposed view of a graph input (a
// Linear weight, [N, K] row-major, read as [K, N]), run in eager through dnnl_sgemm, which
// repacks `w` into its blocked layout on every call and allocates the scratch for it. A compiled
// graph sees the same weight on every call, so here it is packed once, into the layout oneDNN's
// matmul primitive chose for this problem, and packed again only when the weight is not the one
// packed: another storage or data pointer, or a new version (every in-place write, an optimizer
// step included, bumps the storage's version counter). The bias is the primitive's own.
//
// Which nodes qualify is decided per concrete graph (plan_packed_gemm): float32 on the CPU, a
// row-major x and output, a 1-D bias, a weight the graph itself does not write. A call whose
// run-time scalars (addmm's alpha and beta) are not 1 runs the node through the dispatcher instead.
//
// Writes a version counter does not see: a compiled graph replayed without its body (pure) writes
// its inputs from generated kernels, so every run of a graph that writes its inputs also counts
// in a process-wide epoch (note_graph_input_writes) that packed copies are checked against. What
// no counter sees is a write through a raw data pointer (data_ptr, DLPack); KILN_PACKED_GEMM=0
// turns packing off for programs that change weights that way between calls.
#pragma once

#include <memory>
#include <mutex>
#include <span>

#include "kiln/compiler/graph.h"

namespace kiln::compiler::runtime {

struct PackedGemm;

// A PackedGemm for node `n` of `g` (the graph after the passes), or null where it does not apply.
// `written`: per value, whether the graph writes its memory (passes::internal::written_memory).
std::shared_ptr<PackedGemm> plan_packed_gemm(const Graph& g, const Node& n, const std::vector<char>& written);

// A compiled graph that writes its inputs ran (or is about to): packed copies are packed again.
void note_graph_input_writes();

// out = bias + x @ w (addmm) or x @ w (mm). `inputs` are the node's inputs and `attrs` its attrs
// with this call's scalars; `out` is the planned output (reduce_overhead's arena) or undefined (a
// new tensor is made). Returns false, touching nothing, when this call does not fit the plan, and
// on a node's first call (a size a dynamic graph meets once is not worth oneDNN's kernel
// generation and the packing).
bool run_packed_gemm(PackedGemm& p, std::span<const Tensor> inputs, std::span<const Attr> attrs, Tensor& out);

}  // namespace kiln::compiler::runtime
