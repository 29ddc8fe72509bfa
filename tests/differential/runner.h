// Runs a program eagerly in float32 (the baseline), eagerly in float64 (the reference), and
// compiled in every mode, each compiled mode called more than once with fresh inputs, and
// compares outputs, gradients and inputs written in place. Work runs in child processes (fork),
// so that a crash or a hang is a finding, not the end of the run.
//
// Programs run in bundles: the members of a bundle are merged into one program (merge()), so
// each mode compiles one graph for all of them (a system-compiler run costs about as much as a
// dozen eager programs). A member whose eager run raises runs alone, so that its error is
// matched by itself. Mismatched values name the member they belong to.
//
// Tolerances. A compiled float value c is checked against the eager float32 value e, with the
// float64 reference r (the same program on float64 data) telling how well-conditioned e is:
//
//   |c - e| <= atol * scale + rtol * |e| + 4 * |e - r|,  scale = max(1, max |e| over the tensor)
//
//   float32: rtol 1e-4, atol 1e-5   (programs of up to 15 ops reassociate sums, GEMMs and
//                                    convolutions; a few ulps per op, compounded)
//   float64: rtol 1e-9, atol 1e-10  (only in programs that compute nothing in float32: a
//                                    float32 result converted to float64 keeps float32's error)
//   int64, bool: exact
//
// The 4 * |e - r| term lets a compiled result differ from eager as much as eager itself differs
// from exact arithmetic (cancellation, a value near a relu kink), so ill-conditioned programs do
// not raise false alarms, while a wrong kernel, a stale saved value or a lost write (errors of
// order one) stands out. Integral and bool elements where eager disagrees with the reference (a
// comparison that rounding decides) are skipped, as are elements where eager overflowed.
#pragma once

#include <array>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kiln/compiler.h"
#include "program.h"

namespace kiln::differential {

enum class ModeId : uint8_t { eager_backend, aot_eager, kiln, kiln_reduce_overhead, kiln_pure };
inline constexpr std::array kAllModes = {ModeId::eager_backend, ModeId::aot_eager, ModeId::kiln,
                                         ModeId::kiln_reduce_overhead, ModeId::kiln_pure};

std::string_view mode_name(ModeId mode);  // "eager_backend", "aot_eager", "kiln", ...
std::optional<ModeId> parse_mode(std::string_view name);
CompileOptions compile_options(ModeId mode);
std::string compile_options_cpp(ModeId mode);  // `{.backend = "kiln", .pure = true}`
// Calls per compiled mode: the first compiles, the second hits the cache; a pure function
// replays from its third call (docs/compiler.md), so it gets three.
int calls_per_mode(ModeId mode);
// kiln_pure compiles a training step: the program, its loss and the backward in one call (the
// loss weights are arguments), since a call that leaves autograd history for a backward after it
// never replays. The other modes run the backward after the call, through the compiled backward.
bool backward_inside(ModeId mode);

enum class FailureKind : uint8_t { crash, timeout, error_mismatch, numeric_mismatch, not_compiled };
inline constexpr std::array kAllFailureKinds = {
    FailureKind::crash, FailureKind::timeout, FailureKind::error_mismatch,
    FailureKind::numeric_mismatch, FailureKind::not_compiled};
std::string_view failure_kind_name(FailureKind kind);

struct Finding {
  std::string mode;  // a mode_name(), or "eager" for a crash of the eager runs
  FailureKind kind = FailureKind::numeric_mismatch;
  // What failed, stable across programs with the same bug: "gradient of input", "backward:
  // eager none, compiled kiln::Error", "SIGSEGV". The shrinker keeps mode, kind, category and
  // message_key().
  std::string category;
  std::string detail;  // values, messages, the call that failed
  // The bundle member it belongs to, or -1 for a failure of the merged run as a whole (an error,
  // a crash) that may come from any merged member.
  int member = -1;
  // An error mismatch's compiled message without what varies between programs (numbers, tensor
  // descriptions, autograd node names); empty for other kinds.
  std::string message_key() const;
  bool same_failure(const Finding& other) const {
    return mode == other.mode && kind == other.kind && category == other.category &&
           message_key() == other.message_key();
  }
};

struct RunConfig {
  std::vector<ModeId> modes{kAllModes.begin(), kAllModes.end()};
  double timeout_seconds = 120;  // per child (one bundle, or the modes left after a crash)
  bool fork = true;              // false: run in this process (debugging; a crash is fatal)
};

using Bundle = std::vector<Program>;

struct BundleReport {
  std::vector<Finding> findings;
  // Per member: what its eager run raised ("kiln::ShapeError in the forward: ..."), or "". Such a
  // member ran alone and is checked for a matching error only.
  std::vector<std::string> eager_errors;
  std::vector<int> merged;  // the members that ran merged into one program
  int pure_replays = 0;     // kiln_pure calls that replayed (skipped the body)
  double seconds = 0;
  bool failed() const { return !findings.empty(); }
};

// Runs one bundle's checks in this process (what a child runs).
BundleReport check_bundle(const Bundle& bundle, const RunConfig& config);

// Runs each bundle in a child process, `jobs` at a time. A child that crashes or times out is
// reported as such, and the modes after the one that died run in a new child. `on_done`
// (optional) is called once per bundle, when all of its modes have run.
using BundleDone = std::function<void(size_t index, const BundleReport& report)>;
std::vector<BundleReport> run_bundles(const std::vector<Bundle>& bundles, const RunConfig& config,
                                      int jobs, const BundleDone& on_done = {});

}  // namespace kiln::differential
