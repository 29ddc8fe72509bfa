// Progress of long work on stderr: compiles (graph by graph, with their kernel builds) and
// `kiln bench`'s timing rounds.
//
// A Progress shows nothing for its first 2 seconds (KILN_PROGRESS_AFTER_MS), so quick work stays
// silent. After that, on a terminal, one live line rewritten in place ("[kiln] compiling graph 3
// of f (412 ops): 17 of 40 kernels built, 3.2 s") and finished with its total time; otherwise (a
// log file, CI) a line every 5 seconds and one at the end. KILN_PROGRESS=0 turns it off. A
// background thread prints, so the work itself only bumps atomic counters. Tasks nest (a compile
// inside `kiln bench`'s timing rounds): the newest one past its delay has the line.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace kiln::detail {

class Progress {
 public:
  // `what` names the work; `unit` the things it counts ("kernels built"). `make_current`: whether
  // it becomes current() on this thread until destroyed (tasks that start and end out of order
  // with others on the thread, such as autotuning inside a graph run, should not).
  Progress(std::string what, std::string unit, bool make_current = true);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Thread safe: worker threads of the task (parallel kernel builds) count into it.
  void add_total(int64_t n);
  void advance(int64_t n = 1);

  // The innermost Progress alive on this thread, or nullptr: how code deep inside a task (a kernel
  // build inside a compile) finds what to count into.
  static Progress* current();

  struct State;

 private:
  std::shared_ptr<State> state_;
  Progress* outer_ = nullptr;
  bool current_ = true;
};

}  // namespace kiln::detail
