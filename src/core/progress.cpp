// Progress lines on stderr (progress.h).
#include "core/progress.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

namespace kiln::detail {

using Clock = std::chrono::steady_clock;

struct Progress::State {
  std::string what, unit;
  Clock::time_point start = Clock::now();
  std::atomic<int64_t> done{0}, total{0};
  std::chrono::milliseconds after{0};  // shown from then on
  Clock::time_point last_print{};
  bool shown = false;  // guarded by the printer's mutex
};

namespace {

thread_local Progress* t_current = nullptr;

bool enabled() {
  const char* v = std::getenv("KILN_PROGRESS");
  return !(v && std::strcmp(v, "0") == 0);
}

std::chrono::milliseconds show_after() {
  const char* v = std::getenv("KILN_PROGRESS_AFTER_MS");
  if (v && *v) {
    char* end = nullptr;
    const long ms = std::strtol(v, &end, 10);
    if (end && *end == '\0' && ms >= 0) return std::chrono::milliseconds(ms);
  }
  return std::chrono::milliseconds(2000);
}

std::string line_of(const Progress::State& s) {
  const double seconds = std::chrono::duration<double>(Clock::now() - s.start).count();
  const int64_t done = s.done.load(std::memory_order_relaxed), total = s.total.load(std::memory_order_relaxed);
  std::string counts;
  if (total > 0) counts = fmt::format(": {} of {} {}", std::min(done, total), total, s.unit);
  else if (done > 0) counts = fmt::format(": {} {}", done, s.unit);
  return fmt::format("[kiln] {}{}, {:.1f} s", s.what, counts, seconds);
}

// The tasks alive and the thread that prints them; leaked, so that it outlives static destructors.
class Printer {
 public:
  static Printer& instance() {
    static Printer* p = new Printer;
    return *p;
  }

  void add(const std::shared_ptr<Progress::State>& s) {
    std::lock_guard lock(mutex_);
    tasks_.push_back(s);
    if (!thread_started_) {
      thread_started_ = true;
      std::thread([this] { loop(); }).detach();
    }
    wake_.notify_one();
  }

  void remove(const std::shared_ptr<Progress::State>& s) {
    std::lock_guard lock(mutex_);
    tasks_.erase(std::remove(tasks_.begin(), tasks_.end(), s), tasks_.end());
    // A task that outlived its delay ends with a line even if the printer had no turn yet.
    if (!s->shown && Clock::now() - s->start < s->after) return;
    print(line_of(*s) + " (done)", /*last=*/true);
  }

 private:
  Printer() : tty_(::isatty(STDERR_FILENO) == 1) {}

  // On a terminal the line is rewritten in place and ended by the task's last line; elsewhere
  // every line stands on its own.
  void print(const std::string& line, bool last) {
    if (tty_) std::fprintf(stderr, last ? "\r\033[K%s\n" : "\r\033[K%s", line.c_str());
    else std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  }

  void loop() {
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait_for(lock, std::chrono::milliseconds(100));
      // The newest task past its delay shows: a compile inside `kiln bench`'s timing rounds takes
      // the line while it runs, and the rounds get it back after.
      const auto now = Clock::now();
      Progress::State* shown = nullptr;
      for (auto it = tasks_.rbegin(); it != tasks_.rend() && !shown; ++it)
        if (now - (*it)->start >= (*it)->after) shown = it->get();
      if (!shown) continue;
      Progress::State& s = *shown;
      const auto every = tty_ ? std::chrono::milliseconds(250) : std::chrono::milliseconds(5000);
      if (s.shown && now - s.last_print < every) continue;
      s.shown = true;
      s.last_print = now;
      print(line_of(s), /*last=*/false);
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::shared_ptr<Progress::State>> tasks_;
  bool thread_started_ = false;
  const bool tty_;
};

}  // namespace

Progress::Progress(std::string what, std::string unit, bool make_current)
    : outer_(make_current ? t_current : nullptr), current_(make_current) {
  if (current_) t_current = this;
  if (!enabled()) return;
  state_ = std::make_shared<State>();
  state_->what = std::move(what);
  state_->unit = std::move(unit);
  state_->after = show_after();
  Printer::instance().add(state_);
}

Progress::~Progress() {
  if (current_) t_current = outer_;
  if (state_) Printer::instance().remove(state_);
}

void Progress::add_total(int64_t n) {
  if (state_) state_->total.fetch_add(n, std::memory_order_relaxed);
}

void Progress::advance(int64_t n) {
  if (state_) state_->done.fetch_add(n, std::memory_order_relaxed);
}

Progress* Progress::current() { return t_current; }

}  // namespace kiln::detail
