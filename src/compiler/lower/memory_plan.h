// The static memory plan of the kiln backend's reduce_overhead mode (issue 5): every intermediate
// value of a program gets a fixed offset in one arena, allocated once per compiled graph, so that a
// call allocates nothing but its graph outputs.
//
// Planned values are the ones a kernel step stores into fresh memory (Step::allocate) and the
// outputs of dispatched compute nodes, which then run with call_op_out into arena tensors. A
// value is left out when its memory must outlive the call or is not the program's to reuse: its
// alias class (values sharing a storage group, or linked by view nodes) holds a graph input, a
// graph output or a constant, or lives off the CPU. A planned value is live from the step that
// writes it to the last step that touches any member of its alias class (views read later keep
// it alive); values live at the same step never overlap in the arena.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "compiler/lower/loop_ir.h"

namespace kiln::compiler::lower {

struct MemoryPlan {
  struct Entry {
    int value = -1;
    int64_t offset = 0;  // bytes from the arena's start, a multiple of kAlignment
    int64_t nbytes = 0;  // what the value's sizes and strides span
    int first = 0;       // step that writes it
    int last = 0;        // last step that touches it or an alias of it (inclusive)
  };
  static constexpr int64_t kAlignment = 64;
  std::vector<Entry> entries;        // in order of `first`
  int64_t arena_bytes = 0;
  std::vector<int> entry_of;         // per graph value: index into entries, or -1
  std::vector<bool> out_node;        // per graph node: runs with call_op_out into the arena
  int64_t unplanned_bytes = 0;       // what the planned values would take allocated one by one

  bool empty() const { return entries.empty(); }
};

// Plans `p`'s intermediate values into one arena (greedy best fit, largest values first).
MemoryPlan plan_memory(const Program& p);

// The plan as text for KILN_COMPILE_DEBUG's loop_ir.txt: arena size and each value's offset.
std::string describe(const MemoryPlan& plan, const Program& p);

// Whether two entries live at a common step share bytes; "" when none do, else a description of
// the first clash (tests and a debug check).
std::string find_overlap(const MemoryPlan& plan);

}  // namespace kiln::compiler::lower
