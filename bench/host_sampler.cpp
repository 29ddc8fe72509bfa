// A sampling profiler of host time, for machines without perf (the lent GPU machine has none).
//
//   KILN_HOST_SAMPLES=samples.txt LD_PRELOAD=build/bench/libkiln_host_sampler.so \
//       kiln bench densenet121 --device cuda --host-profile 20
//   python3 bench/host_profile.py samples.txt
//
// Preloaded with KILN_HOST_SAMPLES set, it samples the call stack of the thread that switches
// sampling on, every 200 µs of wall-clock time (a SIGPROF from a CLOCK_MONOTONIC timer aimed at
// that thread; time blocked in the driver counts, as it should for launch-bound code), while
// sampling is switched on: a program (kiln bench --host-profile) finds kiln_host_sampler_enable
// with dlsym and brackets the calls it wants to see, each kind of call under its own section
// number, so that start-up and JIT compilation stay out.
// At exit every stack is written as one line, "section|" and then "object+offset" frames
// innermost first, which
// bench/host_profile.py turns into self and inclusive time per function with addr2line.
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int kMaxFrames = 48;
constexpr long kMaxSamples = 200000;
constexpr int kSkippedFrames = 2;
constexpr long kPeriodNs = 200000;  // the handler and the kernel's signal trampoline

struct Sample {
  int section;
  int frames;
  void* pc[kMaxFrames];
};

Sample* g_samples = nullptr;
std::atomic<long> g_count{0};
std::atomic<int> g_section{0};  // 0: off
const char* g_path = nullptr;

void on_sigprof(int, siginfo_t*, void*) {
  const int section = g_section.load(std::memory_order_relaxed);
  if (section == 0) return;
  const long i = g_count.fetch_add(1, std::memory_order_relaxed);
  if (i >= kMaxSamples) return;
  const int saved_errno = errno;
  g_samples[i].section = section;
  g_samples[i].frames = backtrace(g_samples[i].pc, kMaxFrames);
  errno = saved_errno;
}

void write_samples() {
  g_section = 0;
  FILE* f = std::fopen(g_path, "w");
  if (!f) {
    std::fprintf(stderr, "kiln host sampler: cannot write %s\n", g_path);
    return;
  }
  const long n = g_count.load() < kMaxSamples ? g_count.load() : kMaxSamples;
  for (long i = 0; i < n; ++i) {
    std::fprintf(f, "%d|", g_samples[i].section);
    for (int k = kSkippedFrames; k < g_samples[i].frames; ++k) {
      Dl_info info{};
      void* pc = g_samples[i].pc[k];
      if (dladdr(pc, &info) && info.dli_fname)
        std::fprintf(f, "%s%s+0x%lx", k > kSkippedFrames ? ";" : "", info.dli_fname,
                     static_cast<unsigned long>(static_cast<char*>(pc) - static_cast<char*>(info.dli_fbase)));
      else
        std::fprintf(f, "%s?+0x%lx", k > kSkippedFrames ? ";" : "", reinterpret_cast<unsigned long>(pc));
    }
    std::fputc('\n', f);
  }
  std::fclose(f);
  std::fprintf(stderr, "kiln host sampler: %ld samples in %s\n", n, g_path);
}

__attribute__((constructor)) void start() {
  g_path = std::getenv("KILN_HOST_SAMPLES");
  if (!g_path || !*g_path) return;
  g_samples = static_cast<Sample*>(std::calloc(kMaxSamples, sizeof(Sample)));
  if (!g_samples) return;
  void* warm[4];
  backtrace(warm, 4);  // loads the unwinder now, not inside the first signal
  struct sigaction sa {};
  sa.sa_sigaction = on_sigprof;
  sa.sa_flags = SA_SIGINFO | SA_RESTART | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGPROF, &sa, nullptr);
  std::atexit(write_samples);
}

// A wall-clock timer aimed at one thread (the one that enables sampling). A high-resolution
// CLOCK_MONOTONIC timer fires every period; the CPU-time itimers only at the scheduler's tick.
timer_t g_timer{};
bool g_have_timer = false;

void arm(long period_ns) {
  itimerspec spec{};
  spec.it_interval.tv_nsec = period_ns;
  spec.it_value.tv_nsec = period_ns;
  timer_settime(g_timer, 0, &spec, nullptr);
}

}  // namespace

// Records the following samples under `section` (a positive number the program names), or stops
// recording (0).
extern "C" __attribute__((visibility("default"))) void kiln_host_sampler_enable(int section) {
  if (!g_samples) return;
  if (section > 0 && !g_have_timer) {
    // The handler runs on a stack of its own: JIT-generated code (oneDNN's kernels) may keep data
    // below the stack pointer beyond the ABI's red zone, which a handler on the thread's stack
    // would overwrite.
    static char alternate[1 << 16];
    stack_t ss{};
    ss.ss_sp = alternate;
    ss.ss_size = sizeof alternate;
    sigaltstack(&ss, nullptr);
    sigevent ev{};
    ev.sigev_notify = SIGEV_THREAD_ID;
    ev.sigev_signo = SIGPROF;
    ev._sigev_un._tid = static_cast<pid_t>(syscall(SYS_gettid));
    g_have_timer = timer_create(CLOCK_MONOTONIC, &ev, &g_timer) == 0;
    if (!g_have_timer) std::fprintf(stderr, "kiln host sampler: timer_create failed\n");
  }
  g_section = section < 0 ? 0 : section;
  if (g_have_timer) arm(section > 0 ? kPeriodNs : 0);
}
