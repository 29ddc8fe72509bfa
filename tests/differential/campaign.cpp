#include "campaign.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <iomanip>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>
#include <tuple>

namespace kiln::differential {

namespace {

std::string seconds_text(double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", s);
  return text;
}

}  // namespace

std::string Subject::name() const {
  if (members.empty()) return "seed " + std::to_string(program.seed);
  return "bundle of seeds " + std::to_string(members.front().seed) + "-" +
         std::to_string(members.back().seed);
}

std::string FailureGroup::signature() const {
  std::string s = std::string(failure_kind_name(kind));
  if (!category.empty()) s += " (" + category + ")";
  s += " in ";
  for (size_t i = 0; i < modes.size(); ++i) s += (i ? ", " : "") + modes[i];
  if (!message.empty()) s += ": " + message;
  return s;
}

namespace {

// Findings of one bundle, gathered per subject (a member, or the merged run) and per kind,
// category and message, with the modes where each showed.
void add_groups(const Bundle& bundle, const BundleReport& r, std::vector<FailureGroup>& groups) {
  std::vector<FailureGroup> mine;
  std::vector<int> owners;  // member per group of `mine` (-1: the merged run)
  for (const Finding& f : r.findings) {
    std::string message = f.message_key();
    size_t k = 0;
    while (k < mine.size() && !(owners[k] == f.member && mine[k].kind == f.kind &&
                                mine[k].category == f.category && mine[k].message == message))
      ++k;
    if (k == mine.size()) {
      FailureGroup g;
      g.kind = f.kind;
      g.category = f.category;
      g.message = message;
      Subject subject;
      std::vector<Program> merged;
      for (int m : r.merged) merged.push_back(bundle[m]);
      if (f.member >= 0) {
        subject.program = bundle[f.member];
        bool was_merged = std::find(r.merged.begin(), r.merged.end(), f.member) != r.merged.end();
        if (was_merged && merged.size() > 1) subject.bundle = merged;
      } else {
        subject.members = merged;
        subject.program = merge(merged).program;
        if (subject.members.size() == 1) subject.members.clear();
      }
      g.subjects = {subject};
      g.findings = {f};
      mine.push_back(std::move(g));
      owners.push_back(f.member);
    }
    if (std::find(mine[k].modes.begin(), mine[k].modes.end(), f.mode) == mine[k].modes.end())
      mine[k].modes.push_back(f.mode);
  }
  for (FailureGroup& g : mine) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const FailureGroup& seen) {
      return seen.signature() == g.signature();
    });
    if (it == groups.end()) {
      groups.push_back(std::move(g));
    } else {
      it->subjects.push_back(g.subjects.front());
      it->findings.push_back(g.findings.front());
    }
  }
}

}  // namespace

CampaignReport run_campaign(const CampaignOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  CampaignReport report;
  report.seed = options.seed;

  // Bundles are generated and run in waves when time-boxed, so that the campaign stops soon
  // after max_seconds.
  const int bundle_size = std::max(1, options.bundle_size);
  const int total_bundles = (options.programs + bundle_size - 1) / bundle_size;
  const int wave = options.max_seconds > 0 ? 4 * std::max(1, options.jobs) : total_bundles;
  std::vector<Bundle> bundles;
  std::vector<BundleReport> results;
  while (static_cast<int>(bundles.size()) < total_bundles &&
         (options.max_seconds <= 0 || elapsed() < options.max_seconds)) {
    const size_t first = bundles.size();
    std::vector<Bundle> batch;
    for (int b = 0; b < wave && static_cast<int>(first) + b < total_bundles; ++b) {
      Bundle bundle;
      for (int i = (static_cast<int>(first) + b) * bundle_size;
           i < options.programs && bundle.size() < static_cast<size_t>(bundle_size); ++i)
        bundle.push_back(generate_program(options.seed + i, options.generator));
      batch.push_back(std::move(bundle));
    }
    std::vector<BundleReport> done =
        run_bundles(batch, options.run, options.jobs, [&](size_t i, const BundleReport& r) {
          if (!options.progress) return;
          const Bundle& b = batch[i];
          *options.progress << "[" << first + i + 1 << "] seeds " << b.front().seed << "-"
                            << b.back().seed << " " << (r.failed() ? "FAILED" : "ok") << " ("
                            << seconds_text(r.seconds) << ")";
          for (const Finding& f : r.findings)
            *options.progress << "  " << f.mode << ":" << failure_kind_name(f.kind);
          *options.progress << std::endl;
        });
    bundles.insert(bundles.end(), batch.begin(), batch.end());
    results.insert(results.end(), done.begin(), done.end());
  }
  report.bundles = static_cast<int>(bundles.size());
  for (const Bundle& b : bundles) report.programs += static_cast<int>(b.size());

  std::vector<std::string> modes = {"eager"};
  for (ModeId m : options.run.modes) modes.emplace_back(mode_name(m));
  for (const std::string& m : modes)
    report.per_mode.push_back({m, std::vector<int>(kAllFailureKinds.size(), 0)});
  for (size_t b = 0; b < bundles.size(); ++b) {
    const BundleReport& r = results[b];
    for (const std::string& e : r.eager_errors) report.eager_errors += !e.empty();
    report.pure_replays += r.pure_replays > 0;
    // One count per subject, mode and kind.
    std::vector<std::tuple<std::string, FailureKind, int>> counted;
    for (const Finding& f : r.findings) {
      auto key = std::make_tuple(f.mode, f.kind, f.member);
      if (std::find(counted.begin(), counted.end(), key) != counted.end()) continue;
      counted.push_back(key);
      for (auto& [mode, counts] : report.per_mode)
        if (mode == f.mode)
          ++counts[std::find(kAllFailureKinds.begin(), kAllFailureKinds.end(), f.kind) -
                   kAllFailureKinds.begin()];
    }
    add_groups(bundles[b], r, report.groups);
  }

  // Shrink the first subjects of each signature while the budget lasts. A member that does not
  // fail by itself is left as it is.
  const double shrink_start = elapsed();
  for (FailureGroup& g : report.groups) {
    g.repro = repro_cpp(g.subjects.front().program, g.findings.front());
    if (!options.shrink) continue;
    for (int n = 0; n < options.shrinks_per_signature && n < static_cast<int>(g.subjects.size());
         ++n) {
      double left = options.shrink_budget_seconds - (elapsed() - shrink_start);
      if (left <= 0) break;
      const Subject& subject = g.subjects[n];
      ShrinkOptions so = options.shrink_options;
      so.max_seconds = std::min(so.max_seconds, left);
      if (options.progress)
        *options.progress << "shrinking " << subject.name() << ": " << g.signature() << std::endl;
      ShrinkResult s = shrink(subject.program, g.findings[n], so, subject.members);
      if (!s.reproduced && !subject.bundle.empty()) {
        // It fails only beside the other members: shrink them together.
        if (options.progress) *options.progress << "  fails only in its bundle" << std::endl;
        so.max_seconds = std::max(0.0, so.max_seconds - s.seconds);
        s = shrink(merge(subject.bundle).program, g.findings[n], so, subject.bundle);
      }
      if (options.progress)
        *options.progress << "  " << (s.reproduced ? "" : "did not fail again; ")
                          << subject.program.ops.size() << " ops -> " << s.program.ops.size()
                          << " ops in " << s.runs << " runs, " << seconds_text(s.seconds)
                          << std::endl;
      if (s.reproduced && (!g.shrunk || s.program.ops.size() < g.shrunk->program.ops.size())) {
        g.shrunk = s;
        g.repro = repro_cpp(s.program, s.finding);
      }
    }
  }
  report.seconds = elapsed();
  return report;
}

std::string CampaignReport::table() const {
  std::ostringstream os;
  os << "kiln differential test: " << programs << " programs from seed " << seed << " (" << bundles
     << " bundles) in " << seconds_text(seconds) << "; " << eager_errors
     << " raised eagerly (checked for matching errors only)\n"
     << "failing programs per mode (a bundle counts once for an error or crash of its merged "
        "run):\n\n";
  os << std::left << std::setw(22) << "mode";
  for (FailureKind k : kAllFailureKinds) os << std::setw(18) << failure_kind_name(k);
  os << "\n";
  for (const auto& [mode, counts] : per_mode) {
    bool any = std::any_of(counts.begin(), counts.end(), [](int c) { return c > 0; });
    if (mode == "eager" && !any) continue;
    os << std::setw(22) << mode;
    for (int c : counts) os << std::setw(18) << c;
    os << "\n";
  }
  if (std::any_of(per_mode.begin(), per_mode.end(),
                  [](const auto& m) { return m.first == "kiln_pure"; }))
    os << "kiln_pure replayed calls (skipped the body) in " << pure_replays << " of " << bundles
       << " bundles\n";
  os << "\n"
     << groups.size() << " failure signature" << (groups.size() == 1 ? "" : "s")
     << (groups.empty() ? "" : ":") << "\n";
  for (size_t i = 0; i < groups.size(); ++i) {
    const FailureGroup& g = groups[i];
    os << "  [" << i + 1 << "] " << g.signature() << "\n      " << g.subjects.size()
       << " failing: ";
    for (size_t k = 0; k < g.subjects.size() && k < 6; ++k)
      os << (k ? ", " : "") << g.subjects[k].name();
    if (g.subjects.size() > 6) os << ", ...";
    if (g.shrunk)
      os << "; shrunk to " << g.shrunk->program.ops.size() << " ops in " << g.shrunk->runs
         << " runs";
    os << "\n";
  }
  return os.str();
}

std::string CampaignReport::repros() const {
  std::ostringstream os;
  for (size_t i = 0; i < groups.size(); ++i) {
    const FailureGroup& g = groups[i];
    os << "==== [" << i + 1 << "] " << g.signature() << " ====\n";
    os << g.repro << "\n";
  }
  return os.str();
}

std::string CampaignReport::json() const {
  nlohmann::json j;
  j["seed"] = seed;
  j["programs"] = programs;
  j["bundles"] = bundles;
  j["eager_errors"] = eager_errors;
  j["bundles_with_pure_replays"] = pure_replays;
  j["seconds"] = seconds;
  for (const auto& [mode, counts] : per_mode)
    for (size_t k = 0; k < kAllFailureKinds.size(); ++k)
      j["modes"][mode][failure_kind_name(kAllFailureKinds[k])] = counts[k];
  j["failures"] = nlohmann::json::array();
  for (const FailureGroup& g : groups) {
    nlohmann::json f;
    f["kind"] = failure_kind_name(g.kind);
    f["category"] = g.category;
    f["message"] = g.message;
    f["modes"] = g.modes;
    for (const Subject& s : g.subjects) f["failing"].push_back(s.name());
    f["detail"] = g.shrunk ? g.shrunk->finding.detail : g.findings.front().detail;
    f["program"] = describe(g.shrunk ? g.shrunk->program : g.subjects.front().program);
    f["original_ops"] = g.subjects.front().program.ops.size();
    if (g.shrunk) {
      f["shrunk_ops"] = g.shrunk->program.ops.size();
      f["shrink_runs"] = g.shrunk->runs;
    }
    f["repro"] = g.repro;
    j["failures"].push_back(f);
  }
  return j.dump(2);
}

}  // namespace kiln::differential
