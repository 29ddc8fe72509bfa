// Stances: process-wide (set_stance) and per thread (StanceGuard, with_stance). Read on every
// call of a compiled callable, so a change affects functions compiled earlier at once (DESIGN §2.4).
#include <array>
#include <mutex>

#include "compiler/capture/runtime.h"

namespace kiln::compiler {

namespace {

constexpr std::array<std::pair<Stance, std::string_view>, 6> kStances{{
    {Stance::default_, "default"},
    {Stance::force_eager, "force_eager"},
    {Stance::eager_on_recompile, "eager_on_recompile"},
    {Stance::fail_on_recompile, "fail_on_recompile"},
    {Stance::eager_then_compile, "eager_then_compile"},
    {Stance::aot_eager_then_compile, "aot_eager_then_compile"},
}};

std::mutex g_mutex;
detail::StanceState g_stance;  // guarded by g_mutex
std::atomic<bool> g_default{true};  // fast path: the process-wide stance is plain default

thread_local std::vector<detail::StanceState> t_stances;  // StanceGuard stack

void validate(Stance stance, const StanceOptions& options, const std::source_location& loc) {
  if (!options.force_backend.empty()) {
    KILN_CHECK(stance == Stance::default_, ValueError,
               "[kiln::set_stance] non-default stance cannot have force_backend set");
    lookup_backend(options.force_backend == "inductor" ? "kiln" : options.force_backend);
  }
  if (is_compiling()) {
    throw Error("[kiln::set_stance] attempted to set_stance in a torch.compile region (at " +
                detail::relative_path(loc.file_name()) + ":" + std::to_string(loc.line()) +
                "). Change the stance outside compiled code (around the call), not inside the compiled function.");
  }
}

}  // namespace

std::string_view stance_name(Stance s) {
  for (auto& [st, name] : kStances)
    if (st == s) return name;
  return "?";
}

Stance parse_stance(std::string_view name) {
  for (auto& [st, n] : kStances)
    if (n == name) return st;
  std::string valid;
  for (auto& [st, n] : kStances) valid += (valid.empty() ? "" : ", ") + std::string(n);
  throw ValueError("[kiln::set_stance] invalid stance '" + std::string(name) + "'. Valid stances: " + valid + ".");
}

void set_stance(Stance stance, StanceOptions options, std::source_location loc) {
  validate(stance, options, loc);
  std::lock_guard lock(g_mutex);
  g_stance = {stance, std::move(options)};
  g_default.store(stance == Stance::default_ && !g_stance.options.skip_guard_eval_unsafe &&
                      g_stance.options.force_backend.empty(),
                  std::memory_order_release);
}

void set_stance(std::string_view stance, StanceOptions options, std::source_location loc) {
  set_stance(parse_stance(stance), std::move(options), loc);
}

Stance current_stance() { return detail::effective_stance().stance; }

StanceGuard::StanceGuard(Stance stance, StanceOptions options, std::source_location loc) {
  validate(stance, options, loc);
  t_stances.push_back({stance, std::move(options)});
  active_ = true;
}

StanceGuard::StanceGuard(std::string_view stance, StanceOptions options, std::source_location loc)
    : StanceGuard(parse_stance(stance), std::move(options), loc) {}

StanceGuard::~StanceGuard() {
  if (active_) t_stances.pop_back();
}

namespace detail {

StanceState effective_stance() {
  if (!t_stances.empty()) return t_stances.back();
  if (g_default.load(std::memory_order_acquire)) return {};
  std::lock_guard lock(g_mutex);
  return g_stance;
}

}  // namespace detail
}  // namespace kiln::compiler

namespace kiln::compiler {

namespace {
std::atomic<int> g_recompile_limit{8};
}

int recompile_limit() { return g_recompile_limit.load(std::memory_order_relaxed); }

void set_recompile_limit(int limit) {
  KILN_CHECK(limit >= 1, ValueError,
             "[kiln::compiler::set_recompile_limit] the limit must be at least 1, got " + std::to_string(limit) + ".");
  g_recompile_limit.store(limit, std::memory_order_relaxed);
}

}  // namespace kiln::compiler
