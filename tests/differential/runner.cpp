#include "runner.h"

#include <cxxabi.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <memory>
#include <regex>
#include <sstream>
#include <typeinfo>

#include "interpreter.h"
#include "kiln/threading.h"

namespace kiln::differential {

std::string_view mode_name(ModeId mode) {
  switch (mode) {
    case ModeId::eager_backend:
      return "eager_backend";
    case ModeId::aot_eager:
      return "aot_eager";
    case ModeId::kiln:
      return "kiln";
    case ModeId::kiln_reduce_overhead:
      return "kiln_reduce_overhead";
    case ModeId::kiln_pure:
      return "kiln_pure";
  }
  return "?";
}

std::optional<ModeId> parse_mode(std::string_view name) {
  for (ModeId m : kAllModes)
    if (mode_name(m) == name) return m;
  return std::nullopt;
}

CompileOptions compile_options(ModeId mode) {
  CompileOptions o;
  switch (mode) {
    case ModeId::eager_backend:
      o.backend = std::string("eager");
      break;
    case ModeId::aot_eager:
      o.backend = std::string("aot_eager");
      break;
    case ModeId::kiln:
      o.backend = std::string("kiln");
      break;
    case ModeId::kiln_reduce_overhead:
      o.backend = std::string("kiln");
      o.mode = Mode::reduce_overhead;
      break;
    case ModeId::kiln_pure:
      o.backend = std::string("kiln");
      o.pure = true;
      break;
  }
  return o;
}

std::string compile_options_cpp(ModeId mode) {
  switch (mode) {
    case ModeId::eager_backend:
      return "{.backend = \"eager\"}";
    case ModeId::aot_eager:
      return "{.backend = \"aot_eager\"}";
    case ModeId::kiln:
      return "{.backend = \"kiln\"}";
    case ModeId::kiln_reduce_overhead:
      return "{.backend = \"kiln\", .mode = Mode::reduce_overhead}";
    case ModeId::kiln_pure:
      return "{.backend = \"kiln\", .pure = true}";
  }
  return "{}";
}

int calls_per_mode(ModeId mode) {
  return mode == ModeId::kiln_pure ? 3 : 2;
}
bool backward_inside(ModeId mode) {
  return mode == ModeId::kiln_pure;
}

std::string_view failure_kind_name(FailureKind kind) {
  switch (kind) {
    case FailureKind::crash:
      return "crash";
    case FailureKind::timeout:
      return "timeout";
    case FailureKind::error_mismatch:
      return "error_mismatch";
    case FailureKind::numeric_mismatch:
      return "numeric_mismatch";
    case FailureKind::not_compiled:
      return "not_compiled";
  }
  return "?";
}

// One bug's messages look alike without numbers, bracketed tensor descriptions and node names,
// while different errors (an input vs an output of the node) stay apart.
std::string Finding::message_key() const {
  if (kind != FailureKind::error_mismatch) return "";
  const std::string marker = "compiled raised ";
  size_t at = detail.find(marker);
  if (at == std::string::npos) return "";
  std::string line = detail.substr(at + marker.size());
  line = line.substr(0, line.find('\n'));
  line = std::regex_replace(line, std::regex(R"(\[(float|int|bool)[^\]]*\])"), "[tensor]");
  line = std::regex_replace(line, std::regex(R"(\w+Backward\d*)"), "<node>");
  line = std::regex_replace(line, std::regex(R"(\d+)"), "#");
  return line.substr(0, 200);
}

namespace {

// ================================ one run ================================

std::string type_name(const std::exception& e) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> name(
      abi::__cxa_demangle(typeid(e).name(), nullptr, nullptr, &status), std::free);
  return status == 0 && name ? name.get() : typeid(e).name();
}

struct RaisedError {
  std::string type;  // "kiln::ShapeError"; empty when nothing was raised
  std::string message;
};

struct Outcome {
  Ts outputs;
  Ts gradients;     // per input; undefined where the input does not require grad
  Ts inputs_after;  // every input after the run (in-place writes show here)
  RaisedError forward_error, backward_error;
  bool has_loss = false;
  int64_t forward_graph_runs = 0, forward_eager_frames = 0, backward_graph_runs = 0, replays = 0;
};

// Runs `body` on fresh inputs, then (unless the body ran it) the backward of the weighted loss,
// and collects what the harness compares.
template <class F>
Outcome run_once(const Program& program, F&& body, bool float64_reference,
                 bool body_runs_backward = false) {
  Outcome o;
  Ts inputs = make_inputs(program, float64_reference);
  compiler::Counters before = compiler::counters();
  try {
    o.outputs = body(inputs);
  } catch (const std::exception& e) {
    o.forward_error = {type_name(e), e.what()};
    return o;
  }
  compiler::Counters after_forward = compiler::counters();
  o.forward_graph_runs = after_forward.graph_runs - before.graph_runs;
  o.forward_eager_frames = after_forward.eager_frames - before.eager_frames;
  o.replays = after_forward.replays - before.replays;
  if (!body_runs_backward) {
    try {
      Tensor loss = weighted_loss(program, o.outputs);
      o.has_loss = loss.defined();
      if (o.has_loss) loss.backward();
    } catch (const std::exception& e) {
      o.backward_error = {type_name(e), e.what()};
    }
  }
  o.backward_graph_runs = compiler::counters().graph_runs - after_forward.graph_runs;
  for (const Tensor& in : inputs) {
    o.gradients.push_back(in.requires_grad() ? in.grad() : Tensor());
    o.inputs_after.push_back(in.detach());
  }
  return o;
}

// ================================ comparison ================================

struct Tolerance {
  double rtol, atol;
};
Tolerance tolerance(bool float64_only) {
  return float64_only ? Tolerance{1e-9, 1e-10} : Tolerance{1e-4, 1e-5};
}

// Whether every floating value of the program is float64 (else float32 rounding reaches its
// float64 results too).
bool float64_only(const Program& program) {
  Inference inf = infer(program);
  return inf.ok() && std::all_of(inf.values.begin(), inf.values.end(), [](const ValueType& v) {
           return !is_float(v.dtype) || v.dtype == kFloat64;
         });
}

std::string index_text(int64_t flat, IntArrayRef sizes) {
  std::vector<int64_t> index(sizes.size());
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    index[d] = flat % sizes[d];
    flat /= sizes[d];
  }
  std::string s = "[";
  for (size_t i = 0; i < index.size(); ++i) s += (i ? ", " : "") + std::to_string(index[i]);
  return s + "]";
}

std::string number(double v) {
  std::ostringstream os;
  os.precision(9);
  os << v;
  return os.str();
}

bool all_zero(const Tensor& t) {
  for (double v : t.detach().to_vector<double>())
    if (v != 0) return false;
  return true;
}

// Why `actual` (compiled) differs from `expected` (eager float32) beyond the tolerance that
// `reference` (float64) allows, or "" when it does not. An undefined gradient counts as zeros.
std::string compare_values(const Tensor& actual, const Tensor& expected, const Tensor& reference,
                           Tolerance tol) {
  if (!actual.defined() || !expected.defined()) {
    if (actual.defined() == expected.defined()) return "";
    const Tensor& d = actual.defined() ? actual : expected;
    if (all_zero(d)) return "";
    return actual.defined() ? "compiled gives a tensor where eager gives none"
                            : "compiled gives none where eager gives a tensor";
  }
  if (actual.sizes() != expected.sizes())
    return "shape " + shape_str(actual.sizes()) + ", eager " + shape_str(expected.sizes());
  if (actual.dtype() != expected.dtype())
    return "dtype " + std::string(dtype_name(actual.dtype())) + ", eager " +
           std::string(dtype_name(expected.dtype()));
  std::vector<double> c = actual.detach().to_vector<double>(),
                      e = expected.detach().to_vector<double>(), r;
  if (reference.defined() && reference.numel() == expected.numel())
    r = reference.detach().to_vector<double>();
  const bool floating = expected.is_floating_point();
  double scale = 1;
  for (double v : e)
    if (std::isfinite(v)) scale = std::max(scale, std::abs(v));
  int64_t bad = 0, worst = -1;
  double worst_excess = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    double ci = c[i], ei = e[i], ri = r.empty() ? std::nan("") : r[i];
    double excess = 0;
    if (!floating) {
      // A comparison that rounding decides differently in float64 is not a compiler's fault.
      if (ci == ei || (!r.empty() && ri != ei)) continue;
      excess = 1;
    } else if (!std::isfinite(ei)) {
      bool same = std::isnan(ei) ? std::isnan(ci) : ci == ei;
      if (same || (!r.empty() && std::isfinite(ri))) continue;  // eager itself overflowed
      excess = INFINITY;
    } else if (!std::isfinite(ci)) {
      excess = INFINITY;
    } else {
      double allowance = std::isfinite(ri) ? 4 * std::abs(ei - ri) : 0;
      double diff = std::abs(ci - ei),
             limit = tol.atol * scale + tol.rtol * std::abs(ei) + allowance;
      if (diff <= limit) continue;
      excess = diff - limit;
    }
    ++bad;
    if (worst < 0 || excess > worst_excess) {
      worst = static_cast<int64_t>(i);
      worst_excess = excess;
    }
  }
  if (!bad) return "";
  std::string s = std::to_string(bad) + " of " + std::to_string(c.size()) + " elements of " +
                  std::string(dtype_name(expected.dtype())) + shape_str(expected.sizes()) +
                  " differ; worst at " + index_text(worst, expected.sizes()) + ": compiled " +
                  number(c[worst]) + ", eager " + number(e[worst]);
  if (!r.empty()) s += ", float64 " + number(r[worst]);
  return s;
}

// ================================ reporting ================================

// Streams what a child learns to its parent, one line per event, so that the findings before a
// crash, and the mode and member that crashed, survive it.
class Reporter {
 public:
  explicit Reporter(int fd) : fd_(fd) {}
  void merged(const std::vector<int>& members) {
    std::string list;
    for (size_t i = 0; i < members.size(); ++i) list += (i ? "," : "") + std::to_string(members[i]);
    write_line("merged\t" + list);
  }
  void begin_mode(std::string_view mode, int member) {
    write_line("mode\t" + escape(mode) + "\t" + std::to_string(member));
  }
  void finding(const Finding& f) {
    write_line("finding\t" + escape(f.mode) + "\t" + escape(failure_kind_name(f.kind)) + "\t" +
               escape(f.category) + "\t" + escape(f.detail) + "\t" + std::to_string(f.member));
  }
  void eager_error(int member, const std::string& text) {
    write_line("eager_error\t" + std::to_string(member) + "\t" + escape(text));
  }
  void replayed() { write_line("replayed"); }
  void done() { write_line("done"); }

  static std::string escape(std::string_view s) {
    std::string out;
    for (char ch : s.substr(0, 4000)) {
      if (ch == '\\') {
        out += "\\\\";
      } else if (ch == '\n') {
        out += "\\n";
      } else if (ch == '\t') {
        out += "\\t";
      } else {
        out += ch;
      }
    }
    return out;
  }
  static std::string unescape(std::string_view s) {
    std::string out;
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i] != '\\' || i + 1 == s.size()) {
        out += s[i];
        continue;
      }
      char next = s[++i];
      out += next == 'n' ? '\n' : next == 't' ? '\t' : next;
    }
    return out;
  }

 private:
  void write_line(std::string line) {
    if (fd_ < 0) return;
    line += '\n';
    for (size_t done = 0; done < line.size();) {
      ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
      if (n <= 0) return;
      done += static_cast<size_t>(n);
    }
  }
  int fd_;
};

// ================================ checks ================================

std::string error_text(const RaisedError& e) {
  return e.type.empty() ? "nothing" : e.type + ": " + e.message;
}

// True when the program has an op that must become a graph node (views of inputs alone may
// leave nothing to run).
bool expects_graph(const Program& program) {
  for (const Op& op : program.ops)
    if (!is_view(op.kind)) return true;
  return false;
}

// What runs as one compiled function: the merged members of a bundle, or one member alone.
struct Unit {
  Program program;
  std::vector<int> members;                       // bundle members in it
  std::vector<size_t> first_input, first_output;  // per member, in the unit's lists
  Outcome eager, reference;
  bool float64_only = false;

  // The bundle member that input (or output) i belongs to; -1 past the end.
  int member_of(const std::vector<size_t>& firsts, size_t i) const {
    for (size_t m = firsts.size(); m-- > 0;)
      if (i >= firsts[m]) return members[m];
    return -1;
  }
  int whole() const { return members.size() == 1 ? members[0] : -1; }
};

// Sets the default dtype while alive (the float64 reference wraps numbers as float64, as
// int-to-float promotion does).
class DefaultDTypeGuard {
 public:
  explicit DefaultDTypeGuard(DType t) : saved_(default_dtype()) { set_default_dtype(t); }
  ~DefaultDTypeGuard() { set_default_dtype(saved_); }

 private:
  DType saved_;
};

Outcome run_eager(const Program& program, bool float64_reference) {
  if (!float64_reference)
    return run_once(
        program, [&](const Ts& in) { return run_program(program, in); }, false);
  DefaultDTypeGuard float64(kFloat64);
  return run_once(
      program, [&](const Ts& in) { return run_program(program, in, {.float64_reference = true}); },
      true);
}

class ModeChecker {
 public:
  ModeChecker(const Unit& unit, ModeId mode, Reporter& reporter, BundleReport& report)
      : unit_(unit), mode_(mode), reporter_(reporter), report_(report) {}

  void run() {
    compiler::reset();
    if (!backward_inside(mode_)) {
      auto compiled = kiln::compile(
          [program = unit_.program](const Ts& in) { return run_program(program, in); },
          compile_options(mode_));
      for (call_ = 1; call_ <= calls_per_mode(mode_); ++call_)
        check_call(run_once(unit_.program, compiled, false));
      return;
    }
    // A training step: the weights are those the eager run's loss used.
    const Ts weights = loss_weights(unit_.program, unit_.eager.outputs);
    auto step = kiln::compile(
        [program = unit_.program](const Ts& in, const Ts& weights) {
          Ts out = run_program(program, in);
          if (Tensor loss = weighted_sum(out, weights); loss.defined()) loss.backward();
          return out;
        },
        compile_options(mode_));
    for (call_ = 1; call_ <= calls_per_mode(mode_); ++call_) {
      Outcome c = run_once(
          unit_.program, [&](const Ts& in) { return step(in, weights); }, false, true);
      report_.pure_replays += c.replays > 0;
      if (c.replays > 0) reporter_.replayed();
      check_call(c);
    }
  }

 private:
  void check_call(const Outcome& c) {
    Outcome eager = unit_.eager;
    if (backward_inside(mode_) && eager.forward_error.type.empty()) {
      // The step's call raises what eager's backward raised.
      eager.forward_error = eager.backward_error;
      eager.backward_error = {};
    }
    if (c.forward_error.type != eager.forward_error.type) {
      add(FailureKind::error_mismatch, unit_.whole(),
          "forward: eager " + or_none(eager.forward_error.type) + ", compiled " +
              or_none(c.forward_error.type),
          "eager raised " + error_text(eager.forward_error) + "\ncompiled raised " +
              error_text(c.forward_error));
      return;
    }
    if (!c.forward_error.type.empty()) return;  // both raised the same error
    if (expects_graph(unit_.program) && (c.forward_graph_runs < 1 || c.forward_eager_frames > 0))
      add(FailureKind::not_compiled, unit_.whole(), "forward",
          "graph_runs +" + std::to_string(c.forward_graph_runs) + ", eager_frames +" +
              std::to_string(c.forward_eager_frames) + " in the compiled call");
    compare_list("output", c.outputs, eager.outputs, unit_.reference.outputs, unit_.first_output);
    for (size_t i = 0; i < c.outputs.size() && i < eager.outputs.size(); ++i)
      if (c.outputs[i].defined() && eager.outputs[i].defined() &&
          c.outputs[i].requires_grad() != eager.outputs[i].requires_grad())
        add(FailureKind::numeric_mismatch, unit_.member_of(unit_.first_output, i),
            "output requires_grad",
            "output " + std::to_string(i) + ": compiled requires_grad " +
                std::to_string(c.outputs[i].requires_grad()) + ", eager " +
                std::to_string(eager.outputs[i].requires_grad()));
    compare_list("input after the run", c.inputs_after, eager.inputs_after,
                 unit_.reference.inputs_after, unit_.first_input);
    if (c.backward_error.type != eager.backward_error.type) {
      add(FailureKind::error_mismatch, unit_.whole(),
          "backward: eager " + or_none(eager.backward_error.type) + ", compiled " +
              or_none(c.backward_error.type),
          "eager raised " + error_text(eager.backward_error) + "\ncompiled raised " +
              error_text(c.backward_error));
      return;
    }
    if (!c.backward_error.type.empty()) return;
    compare_list("gradient of input", c.gradients, eager.gradients, unit_.reference.gradients,
                 unit_.first_input);
    if (c.has_loss && c.forward_graph_runs > 0 && c.backward_graph_runs < 1)
      add(FailureKind::not_compiled, unit_.whole(), "backward",
          "the backward through the compiled graph ran no graph");
  }

  void compare_list(const std::string& what, const Ts& actual, const Ts& expected,
                    const Ts& reference, const std::vector<size_t>& firsts) {
    if (actual.size() != expected.size()) {
      add(FailureKind::numeric_mismatch, unit_.whole(), what,
          std::to_string(actual.size()) + " values, eager " + std::to_string(expected.size()));
      return;
    }
    for (size_t i = 0; i < actual.size(); ++i) {
      std::string why =
          compare_values(actual[i], expected[i], i < reference.size() ? reference[i] : Tensor(),
                         tolerance(unit_.float64_only));
      if (why.empty()) continue;
      int member = unit_.member_of(firsts, i);
      size_t local = i - firsts[std::find(unit_.members.begin(), unit_.members.end(), member) -
                                unit_.members.begin()];
      add(FailureKind::numeric_mismatch, member, what,
          what + " " + std::to_string(local) + ": " + why);
    }
  }

  static std::string or_none(const std::string& type) { return type.empty() ? "none" : type; }

  // Records the first finding of each kind and category for a member in this mode.
  void add(FailureKind kind, int member, std::string category, std::string detail) {
    Finding f{std::string(mode_name(mode_)), kind, std::move(category),
              "call " + std::to_string(call_) + ": " + detail, member};
    for (const Finding& seen : report_.findings)
      if (seen.same_failure(f) && seen.member == f.member) return;
    reporter_.finding(f);
    report_.findings.push_back(std::move(f));
  }

  const Unit& unit_;
  ModeId mode_;
  Reporter& reporter_;
  BundleReport& report_;
  int call_ = 0;
};

std::string eager_error_of(const Outcome& o) {
  if (!o.forward_error.type.empty())
    return o.forward_error.type + " in the forward: " + o.forward_error.message;
  if (!o.backward_error.type.empty())
    return o.backward_error.type + " in the backward: " + o.backward_error.message;
  return "";
}

BundleReport check_with(const Bundle& bundle, const RunConfig& config, Reporter& reporter) {
  auto start = std::chrono::steady_clock::now();
  BundleReport report;
  // Members whose eager run raises run alone; the others run merged.
  std::vector<Unit> units;
  std::vector<Program> merged_members;
  for (size_t m = 0; m < bundle.size(); ++m) {
    std::string error = eager_error_of(run_eager(bundle[m], false));
    report.eager_errors.push_back(error);
    if (!error.empty()) {
      reporter.eager_error(static_cast<int>(m), error);
      Unit solo;
      solo.program = bundle[m];
      solo.members = {static_cast<int>(m)};
      solo.first_input = {0};
      solo.first_output = {0};
      units.push_back(std::move(solo));
    } else {
      report.merged.push_back(static_cast<int>(m));
      merged_members.push_back(bundle[m]);
    }
  }
  reporter.merged(report.merged);
  if (!merged_members.empty()) {
    MergedProgram merged = merge(merged_members);
    Unit u;
    u.program = std::move(merged.program);
    u.members = report.merged;
    u.first_input = merged.first_input;
    u.first_output = merged.first_output;
    units.insert(units.begin(), std::move(u));
  }
  for (Unit& u : units) {
    u.eager = run_eager(u.program, false);
    u.reference = run_eager(u.program, true);
    u.float64_only = float64_only(u.program);
  }
  for (ModeId mode : config.modes) {
    for (const Unit& u : units) {
      reporter.begin_mode(mode_name(mode), u.whole());
      ModeChecker(u, mode, reporter, report).run();
    }
  }
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

// ================================ child processes ================================

struct Task {
  size_t bundle;
  std::vector<ModeId> modes;
};

struct Child {
  pid_t pid = -1;
  Task task;
  int report_fd = -1, log_fd = -1;
  std::string report_text, log_tail;
  std::chrono::steady_clock::time_point start, deadline;
  bool report_open = true, log_open = true, timed_out = false;
};

[[noreturn]] void child_main(const Bundle& bundle, const std::vector<ModeId>& modes,
                             const RunConfig& config, int report_fd, int log_fd) {
  ::setpgid(0, 0);  // the parent kills the whole group (compilers included) on a timeout
  ::dup2(log_fd, STDOUT_FILENO);
  ::dup2(log_fd, STDERR_FILENO);
  set_num_threads(1);  // several children share the cores; the tensors are tiny
  Reporter reporter(report_fd);
  RunConfig child_config = config;
  child_config.modes = modes;
  try {
    check_with(bundle, child_config, reporter);
  } catch (const std::exception& e) {
    // Only the harness's own code throws here (runs catch what Kiln raises): report it as a
    // crash of the mode in progress, with the message in the child's output.
    std::string what = std::string("[kiln_differential] ") + e.what() + "\n";
    [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, what.data(), what.size());
    ::_exit(3);
  }
  reporter.done();
  ::_exit(0);
}

// Reads what is available, keeping at most `keep` trailing bytes; false at end of file.
bool drain(int fd, std::string& into, size_t keep = std::string::npos) {
  char buffer[8192];
  while (true) {
    ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n > 0) {
      into.append(buffer, static_cast<size_t>(n));
      if (into.size() > keep) into.erase(0, into.size() - keep);
      continue;
    }
    if (n == 0) return false;
    return errno == EAGAIN || errno == EINTR;
  }
}

std::string exit_text(int status) {
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    const char* abbrev = sigabbrev_np(sig);
    return abbrev ? "SIG" + std::string(abbrev) : "signal " + std::to_string(sig);
  }
  return "exit status " + std::to_string(WEXITSTATUS(status));
}

std::vector<std::string> split_fields(const std::string& line) {
  std::vector<std::string> fields;
  for (size_t from = 0;;) {
    size_t tab = line.find('\t', from);
    fields.push_back(Reporter::unescape(
        line.substr(from, tab == std::string::npos ? std::string::npos : tab - from)));
    if (tab == std::string::npos) return fields;
    from = tab + 1;
  }
}

}  // namespace

BundleReport check_bundle(const Bundle& bundle, const RunConfig& config) {
  Reporter silent(-1);
  return check_with(bundle, config, silent);
}

std::vector<BundleReport> run_bundles(const std::vector<Bundle>& bundles, const RunConfig& config,
                                      int jobs, const BundleDone& on_done) {
  std::vector<BundleReport> reports(bundles.size());
  if (!config.fork) {
    for (size_t i = 0; i < bundles.size(); ++i) {
      reports[i] = check_bundle(bundles[i], config);
      if (on_done) on_done(i, reports[i]);
    }
    return reports;
  }
  std::deque<Task> queue;
  for (size_t i = 0; i < bundles.size(); ++i) queue.push_back({i, config.modes});
  std::vector<Child> running;
  jobs = std::max(1, jobs);

  auto start_child = [&](Task task) {
    int report_pipe[2], log_pipe[2];
    if (::pipe2(report_pipe, O_CLOEXEC) != 0 || ::pipe2(log_pipe, O_CLOEXEC) != 0)
      throw std::runtime_error("[kiln_differential] pipe2 failed: " +
                               std::string(std::strerror(errno)));
    pid_t pid = ::fork();
    if (pid < 0)
      throw std::runtime_error("[kiln_differential] fork failed: " +
                               std::string(std::strerror(errno)));
    if (pid == 0) child_main(bundles[task.bundle], task.modes, config, report_pipe[1], log_pipe[1]);
    ::setpgid(pid, pid);
    ::close(report_pipe[1]);
    ::close(log_pipe[1]);
    Child c;
    c.pid = pid;
    c.task = std::move(task);
    c.report_fd = report_pipe[0];
    c.log_fd = log_pipe[0];
    ::fcntl(c.report_fd, F_SETFL, O_NONBLOCK);
    ::fcntl(c.log_fd, F_SETFL, O_NONBLOCK);
    c.start = std::chrono::steady_clock::now();
    c.deadline =
        c.start + std::chrono::milliseconds(static_cast<int64_t>(config.timeout_seconds * 1000));
    running.push_back(std::move(c));
  };

  // Folds a finished child's report into its bundle's; a child that died is a finding of the
  // mode (and member) in progress, and the modes after it go back to the queue.
  auto finish_child = [&](Child& c, int status) {
    BundleReport& report = reports[c.task.bundle];
    report.eager_errors.resize(bundles[c.task.bundle].size());
    std::string last_mode = "eager";
    int last_member = -1;
    bool done = false;
    std::istringstream lines(c.report_text);
    for (std::string line; std::getline(lines, line);) {
      std::vector<std::string> f = split_fields(line);
      if (f[0] == "mode" && f.size() == 3) {
        last_mode = f[1];
        last_member = std::stoi(f[2]);
      } else if (f[0] == "finding" && f.size() == 6) {
        Finding finding{f[1], FailureKind::numeric_mismatch, f[3], f[4], std::stoi(f[5])};
        for (FailureKind k : kAllFailureKinds)
          if (failure_kind_name(k) == f[2]) finding.kind = k;
        report.findings.push_back(std::move(finding));
      } else if (f[0] == "eager_error" && f.size() == 3) {
        report.eager_errors.at(std::stoul(f[1])) = f[2];
      } else if (f[0] == "merged" && f.size() == 2) {
        report.merged.clear();
        std::stringstream list(f[1]);
        for (std::string m; std::getline(list, m, ',');) report.merged.push_back(std::stoi(m));
      } else if (f[0] == "replayed") {
        ++report.pure_replays;
      } else if (f[0] == "done") {
        done = true;
      }
    }
    report.seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - c.start).count();
    if (done) {
      if (on_done) on_done(c.task.bundle, report);
      return;
    }
    if (bundles[c.task.bundle].size() == 1) last_member = 0;
    Finding f;
    f.mode = last_mode;
    f.member = last_member;
    f.kind = c.timed_out ? FailureKind::timeout : FailureKind::crash;
    f.category = c.timed_out ? "" : exit_text(status);
    f.detail = c.timed_out ? "no result after " + number(config.timeout_seconds) + " s"
                           : "the process died (" + exit_text(status) + ")";
    if (!c.log_tail.empty()) f.detail += "; its last output:\n" + c.log_tail;
    report.findings.push_back(std::move(f));
    auto it = std::find_if(c.task.modes.begin(), c.task.modes.end(),
                           [&](ModeId m) { return mode_name(m) == last_mode; });
    if (it != c.task.modes.end() && it + 1 != c.task.modes.end()) {
      queue.push_front({c.task.bundle, std::vector<ModeId>(it + 1, c.task.modes.end())});
    } else if (on_done) {
      on_done(c.task.bundle, report);
    }
  };

  while (!queue.empty() || !running.empty()) {
    while (static_cast<int>(running.size()) < jobs && !queue.empty()) {
      start_child(std::move(queue.front()));
      queue.pop_front();
    }
    std::vector<pollfd> fds;
    for (const Child& c : running) {
      if (c.report_open) fds.push_back({c.report_fd, POLLIN, 0});
      if (c.log_open) fds.push_back({c.log_fd, POLLIN, 0});
    }
    ::poll(fds.data(), fds.size(), 100);
    auto now = std::chrono::steady_clock::now();
    for (size_t i = 0; i < running.size();) {
      Child& c = running[i];
      if (c.report_open) c.report_open = drain(c.report_fd, c.report_text);
      if (c.log_open) c.log_open = drain(c.log_fd, c.log_tail, 1500);
      int status = 0;
      bool exited = false;
      if (!c.report_open) {
        // The child closed its report: it exited (a compiler it started may still hold the log).
        exited = ::waitpid(c.pid, &status, 0) == c.pid;
      } else if (now > c.deadline) {
        c.timed_out = true;
        ::kill(-c.pid, SIGKILL);
        ::kill(c.pid, SIGKILL);
        exited = ::waitpid(c.pid, &status, 0) == c.pid;
        drain(c.report_fd, c.report_text);
      }
      if (!exited) {
        ++i;
        continue;
      }
      if (c.log_open) drain(c.log_fd, c.log_tail, 1500);
      ::close(c.report_fd);
      ::close(c.log_fd);
      finish_child(c, status);
      running.erase(running.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  return reports;
}

}  // namespace kiln::differential
