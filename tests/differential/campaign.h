// A campaign: generate programs from consecutive seeds, run them in bundles (child processes,
// `jobs` at a time), group the failures by signature, shrink a few programs of each signature,
// and report a table, the shrunk repros and JSON. The CI suite (tests/test_differential.cpp) runs a
// fixed slice; kiln_difftest and scripts/difftest run long ones.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "generator.h"
#include "runner.h"
#include "shrinker.h"

namespace kiln::differential {

struct CampaignOptions {
  uint64_t seed = 1;  // program i has seed `seed + i`
  int programs = 100;
  double max_seconds = 0;  // > 0: stop starting bundles after this long (shrinking comes after)
  int bundle_size = 8;     // programs merged into one compiled program (see runner.h)
  int jobs = 1;
  RunConfig run;
  GeneratorOptions generator;
  bool shrink = true;
  int shrinks_per_signature = 1;       // programs shrunk for each signature
  double shrink_budget_seconds = 600;  // for all shrinking together
  ShrinkOptions shrink_options;
  std::ostream* progress = nullptr;  // one line per program done and per shrink
};

// What failed: one program, or a merged bundle when the failure is an error or a crash of the
// merged run that no single member is known to cause.
struct Subject {
  Program program;
  std::vector<Program> members;  // a bundle's merged members; empty for one program
  // For one program: the members merged with it, shrunk together if it does not fail alone.
  std::vector<Program> bundle;
  std::string name() const;  // "seed 123" or "bundle of seeds 120-127"
};

// Failures of the same kind and category (and, for an error mismatch, the same compiled message
// with numbers masked) in the same set of modes.
struct FailureGroup {
  FailureKind kind = FailureKind::numeric_mismatch;
  std::string category;
  std::string message;             // masked compiled error message (error mismatches)
  std::vector<std::string> modes;  // where it happened
  std::vector<Subject> subjects;   // what failed this way
  std::vector<Finding> findings;   // per subject, in the first mode
  std::optional<ShrinkResult> shrunk;
  std::string repro;  // C++ of the shrunk program (else of the first subject)
  std::string signature() const;
};

struct CampaignReport {
  uint64_t seed = 0;
  int programs = 0;  // run (fewer than asked when max_seconds ran out)
  int bundles = 0;
  int eager_errors = 0;  // programs whose eager run raised (checked for matching errors only)
  int pure_replays = 0;  // bundles whose kiln_pure calls replayed (the replay path ran)
  double seconds = 0;
  // Subjects (programs, or bundles for failures of a merged run) with a finding of each kind
  // (kAllFailureKinds order), per mode.
  std::vector<std::pair<std::string, std::vector<int>>> per_mode;
  std::vector<FailureGroup> groups;
  std::string table() const;   // programs, then per mode: mismatches, errors, crashes, ...
  std::string repros() const;  // each group with its shrunk repro
  std::string json() const;
};

CampaignReport run_campaign(const CampaignOptions& options);

}  // namespace kiln::differential
