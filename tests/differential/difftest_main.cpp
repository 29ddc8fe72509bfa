// kiln_difftest: a differential-test campaign from the command line (scripts/difftest builds and
// runs it).
//
//   kiln_difftest --programs N --seed S [--jobs J] [--out report.json] [--bundle B]
//                 [--modes kiln,aot_eager,...] [--timeout SECONDS] [--no-shrink]
//                 [--shrink-budget SECONDS] [--shrinks-per-signature K] [--quiet]
//   kiln_difftest --minutes M ...  as many programs as fit in about M minutes: two thirds
//                                  running programs, one third shrinking
//   kiln_difftest --replay SEED   run one program, print its findings, shrink and print a repro
//   kiln_difftest --print SEED    print one generated program as C++
//   --no-fork runs programs in this process (for a debugger; a crash ends the run)
//
// Kernels go to $KILN_CACHE_DIR, else to a private temporary directory removed at exit.
#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include "campaign.h"

namespace {

using namespace kiln::differential;

int usage(const std::string& problem) {
  std::cerr << "kiln_difftest: " << problem
            << "\nusage: kiln_difftest --programs N --seed S [--jobs J] [--out report.json] "
               "[--bundle B] [--modes m1,m2]\n"
               "                     [--timeout SECONDS] [--no-shrink] [--shrink-budget SECONDS]\n"
               "                     [--shrinks-per-signature K] [--minutes M] [--quiet]\n"
               "       kiln_difftest --replay SEED [--modes ...] | --print SEED\n"
               "modes: eager_backend, aot_eager, kiln, kiln_reduce_overhead, kiln_pure\n";
  return 2;
}

// A private kernel cache for this run unless the user chose one.
class TemporaryCacheDir {
 public:
  TemporaryCacheDir() {
    if (const char* dir = std::getenv("KILN_CACHE_DIR"); dir && *dir) return;
    std::string pattern =
        (std::filesystem::temp_directory_path() / "kiln_difftest_XXXXXX").string();
    if (!::mkdtemp(pattern.data())) return;
    dir_ = pattern;
    ::setenv("KILN_CACHE_DIR", dir_.c_str(), 1);
  }
  ~TemporaryCacheDir() {
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }

 private:
  std::string dir_;
};

std::optional<std::vector<kiln::differential::ModeId>> parse_modes(const std::string& list) {
  std::vector<ModeId> modes;
  std::stringstream ss(list);
  for (std::string name; std::getline(ss, name, ',');) {
    auto m = parse_mode(name);
    if (!m) return std::nullopt;
    modes.push_back(*m);
  }
  return modes;
}

int replay(uint64_t seed, const CampaignOptions& options) {
  Program program = generate_program(seed, options.generator);
  std::cout << describe(program) << "\n\n" << program_function_cpp(program) << "\n";
  BundleReport report = run_bundles({{program}}, options.run, 1).front();
  if (!report.eager_errors.front().empty())
    std::cout << "eager raised: " << report.eager_errors.front() << "\n";
  if (!report.failed()) {
    std::cout << "no findings (" << report.seconds << " s)\n";
    return 0;
  }
  for (const Finding& f : report.findings)
    std::cout << f.mode << ": " << failure_kind_name(f.kind) << " (" << f.category << ")\n  "
              << f.detail << "\n";
  ShrinkOptions so = options.shrink_options;
  so.jobs = options.jobs;
  ShrinkResult s = shrink(program, report.findings.front(), so);
  std::cout << "\nshrunk to " << s.program.ops.size() << " ops in " << s.runs << " runs:\n\n"
            << repro_cpp(s.program, s.finding);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CampaignOptions options;
  options.jobs = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  options.shrinks_per_signature = 2;
  std::string out;
  std::optional<uint64_t> replay_seed, print_seed;
  std::optional<int> programs;
  double minutes = 0;
  bool quiet = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    try {
      if (arg == "--programs") {
        programs = std::stoi(value());
      } else if (arg == "--seed") {
        options.seed = std::stoull(value());
      } else if (arg == "--bundle") {
        options.bundle_size = std::max(1, std::stoi(value()));
      } else if (arg == "--jobs") {
        options.jobs = std::max(1, std::stoi(value()));
      } else if (arg == "--out") {
        out = value();
      } else if (arg == "--modes") {
        auto modes = parse_modes(value());
        if (!modes) return usage("unknown mode in --modes");
        options.run.modes = *modes;
      } else if (arg == "--timeout") {
        options.run.timeout_seconds = std::stod(value());
        options.shrink_options.timeout_seconds = options.run.timeout_seconds;
      } else if (arg == "--no-shrink") {
        options.shrink = false;
      } else if (arg == "--shrink-budget") {
        options.shrink_budget_seconds = std::stod(value());
      } else if (arg == "--shrinks-per-signature") {
        options.shrinks_per_signature = std::stoi(value());
      } else if (arg == "--minutes") {
        minutes = std::stod(value());
      } else if (arg == "--replay") {
        replay_seed = std::stoull(value());
      } else if (arg == "--print") {
        print_seed = std::stoull(value());
      } else if (arg == "--no-fork") {
        options.run.fork = false;  // debugging: a crash ends the run
      } else if (arg == "--help" || arg == "-h") {
        usage("differential-test campaigns");
        return 0;
      } else if (arg == "--quiet") {
        quiet = true;
      } else {
        return usage("unknown argument " + arg);
      }
    } catch (const std::exception& e) {
      return usage(e.what());
    }
  }
  if (print_seed) {
    Program p = generate_program(*print_seed, options.generator);
    std::cout << "// " << describe(p) << "\n"
              << program_function_cpp(p) << "\n"
              << make_inputs_cpp(p);
    return 0;
  }
  if (minutes > 0) {
    options.max_seconds = minutes * 60 * 2 / 3;
    options.shrink_budget_seconds = minutes * 60 / 3;
    options.programs = programs.value_or(1000000);
  } else if (programs) {
    options.programs = *programs;
  }
  TemporaryCacheDir cache;
  options.shrink_options.jobs = options.jobs;
  if (replay_seed) return replay(*replay_seed, options);
  if (!quiet) options.progress = &std::cerr;
  CampaignReport report = run_campaign(options);
  std::cout << report.table() << "\n" << report.repros();
  if (!out.empty()) {
    std::ofstream file(out);
    file << report.json() << "\n";
    if (!file) std::cerr << "kiln_difftest: could not write " << out << "\n";
  }
  return report.groups.empty() ? 0 : 1;
}
