// Shrinks a failing program while it keeps failing the same way (same mode, kind and category,
// see Finding::same_failure): drops dead ops and extra outputs, removes ops (halves, quarters,
// ... then one at a time, their uses redirected to an argument), routes uses around an op,
// drops inputs, and simplifies inputs (no grad, contiguous, float32, size-1 dims). Every
// candidate is checked with infer() before it is run, each in its own child process and only in
// the failing mode. The program is first run as it is, to confirm that it fails by itself (a
// member of a bundle may fail only beside the others).
#pragma once

#include <string>

#include "program.h"
#include "runner.h"

namespace kiln::differential {

struct ShrinkOptions {
  int jobs = 1;              // candidates run at once
  int max_runs = 200;        // candidate programs run, at most
  double max_seconds = 180;  // wall time, at most
  double timeout_seconds = 60;
};

struct ShrinkResult {
  bool reproduced = false;  // the program failed the same way when run by itself
  Program program;          // the smallest program found that fails the same way
  Finding finding;          // its finding
  int runs = 0;             // programs run
  double seconds = 0;
};

// `first_candidates` are tried before the generic passes (a merged bundle's members, one each).
ShrinkResult shrink(const Program& failing, const Finding& finding, const ShrinkOptions& options,
                    const std::vector<Program>& first_candidates = {});

// A standalone C++ program that shows the failure: the program, its inputs, and a main() that
// runs it eagerly and compiled in the finding's mode and prints what differs.
std::string repro_cpp(const Program& program, const Finding& finding);

}  // namespace kiln::differential
