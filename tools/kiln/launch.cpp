// `kiln launch`: torchrun's job for Kiln programs. Starts one process per local rank with the
// variables kiln::distributed::init_process_group reads, and returns the first non-zero exit code.
//
// When a rank fails, the others get a grace period to notice on their own (their collectives fail
// with a message naming the rank) before they are sent SIGTERM, then SIGKILL.
#include "launch.h"

#include <signal.h>
#include <sys/random.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "distributed/socket_util.h"
#include "kiln/error.h"

namespace kiln::cli {
namespace {

constexpr const char* kLaunchUsage = R"(usage: kiln launch --nproc N [options] [--] PROGRAM [ARGS...]

Starts N processes of PROGRAM on this host, one per rank, with RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT set (as torchrun does), and returns the
first non-zero exit code of a rank.

options:
  --nproc N            processes on this host (also --nproc-per-node)
  --nnodes M           hosts in the job (default 1); start `kiln launch` on each
  --node-rank R        this host's index, 0..M-1 (default 0)
  --master-addr A      the host of rank 0, which serves the rendezvous store (default 127.0.0.1)
  --master-port P      its port (default: a free port for one host, 29500 for several)
  --exit-grace S       seconds the other ranks get to exit on their own after one failed (default 10)

Environment: KILN_STORE_TOKEN (the rendezvous store's shared secret; a random one is made for a
single-host job when unset; for several hosts, set the same value on each). OMP_NUM_THREADS,
when unset, becomes the host's cores divided by N.
)";

volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

int parse_int(const std::string& flag, const std::string& value, int lo, int hi) {
  char* end = nullptr;
  long v = std::strtol(value.c_str(), &end, 10);
  if (value.empty() || !end || *end != '\0' || v < lo || v > hi)
    throw ValueError(fmt::format("{} needs a number in [{}, {}], got '{}'.", flag, lo, hi, value));
  return int(v);
}

std::string random_token() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t r = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (r < 0) throw Error(fmt::format("[kiln launch] getrandom: {}", std::strerror(errno)));
    got += size_t(r);
  }
  std::string hex;
  for (unsigned char b : bytes) hex += fmt::format("{:02x}", b);
  return hex;
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

int run_launch(std::vector<std::string> args) {
  int nproc = 0, nnodes = 1, node_rank = 0;
  std::string master_addr = "127.0.0.1";
  std::optional<int> master_port;
  double exit_grace = 10;
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a == "-h" || a == "--help") {
      std::cout << kLaunchUsage;
      return 0;
    }
    if (a.rfind("--", 0) != 0) break;  // the program
    if (i + 1 >= args.size()) throw ValueError(fmt::format("{} needs a value.\n{}", a, kLaunchUsage));
    const std::string& v = args[++i];
    if (a == "--nproc" || a == "--nproc-per-node" || a == "--nproc_per_node") nproc = parse_int(a, v, 1, 4096);
    else if (a == "--nnodes") nnodes = parse_int(a, v, 1, 65536);
    else if (a == "--node-rank" || a == "--node_rank") node_rank = parse_int(a, v, 0, 65535);
    else if (a == "--master-addr" || a == "--master_addr") master_addr = v;
    else if (a == "--master-port" || a == "--master_port") master_port = parse_int(a, v, 1, 65535);
    else if (a == "--exit-grace") exit_grace = parse_int(a, v, 0, 86400);
    else throw ValueError(fmt::format("unknown option {}.\n{}", a, kLaunchUsage));
  }
  if (nproc == 0) throw ValueError(fmt::format("--nproc is required.\n{}", kLaunchUsage));
  if (node_rank >= nnodes) throw ValueError(fmt::format("--node-rank {} is not below --nnodes {}.", node_rank, nnodes));
  if (i >= args.size()) throw ValueError(fmt::format("no program to launch.\n{}", kLaunchUsage));
  std::vector<std::string> program(args.begin() + long(i), args.end());

  int port = master_port ? *master_port : (nnodes == 1 ? distributed::socket_util::free_port() : 29500);
  std::string token;
  if (const char* t = std::getenv("KILN_STORE_TOKEN"); t && *t) token = t;
  else if (nnodes == 1) token = random_token();
  std::string threads;
  if (!std::getenv("OMP_NUM_THREADS"))
    threads = std::to_string(std::max(1u, std::thread::hardware_concurrency() / unsigned(nproc)));

  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  std::vector<pid_t> pids(size_t(nproc), -1);
  std::vector<bool> running(size_t(nproc), false);
  for (int local = 0; local < nproc; ++local) {
    int rank = node_rank * nproc + local;
    pid_t pid = fork();
    if (pid < 0) throw Error(fmt::format("[kiln launch] fork: {}", std::strerror(errno)));
    if (pid == 0) {
      setenv("RANK", std::to_string(rank).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(nnodes * nproc).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      setenv("GROUP_RANK", std::to_string(node_rank).c_str(), 1);
      setenv("MASTER_ADDR", master_addr.c_str(), 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      if (!token.empty()) setenv("KILN_STORE_TOKEN", token.c_str(), 1);
      if (!threads.empty()) setenv("OMP_NUM_THREADS", threads.c_str(), 1);
      std::vector<char*> argv;
      for (auto& s : program) argv.push_back(s.data());
      argv.push_back(nullptr);
      execvp(argv[0], argv.data());
      std::fprintf(stderr, "[kiln launch] cannot run %s: %s\n", argv[0], std::strerror(errno));
      _exit(127);
    }
    pids[size_t(local)] = pid;
    running[size_t(local)] = true;
  }

  using Clock = std::chrono::steady_clock;
  int first_failure = 0;
  std::optional<Clock::time_point> failed_at;
  bool terminated = false, killed = false;
  int left = nproc;
  while (left > 0) {
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (int local = 0; local < nproc; ++local) {
        if (pids[size_t(local)] != pid) continue;
        running[size_t(local)] = false;
        --left;
        int code = exit_code_of(status);
        if (code != 0) {
          std::cerr << fmt::format("[kiln launch] rank {} (pid {}) exited with code {}{}\n", node_rank * nproc + local,
                                   pid, code, WIFSIGNALED(status) ? fmt::format(" (signal {})", WTERMSIG(status)) : "");
          if (first_failure == 0) {
            first_failure = code;
            failed_at = Clock::now();
          }
        }
      }
      continue;
    }
    auto signal_all = [&](int sig) {
      for (int local = 0; local < nproc; ++local)
        if (running[size_t(local)]) kill(pids[size_t(local)], sig);
    };
    if (g_signal != 0 && !terminated) {
      signal_all(int(g_signal));
      terminated = true;
      failed_at = Clock::now();
      if (first_failure == 0) first_failure = 128 + int(g_signal);
    }
    if (failed_at) {
      double waited = std::chrono::duration<double>(Clock::now() - *failed_at).count();
      if (!terminated && waited > exit_grace) {
        std::cerr << "[kiln launch] stopping the remaining ranks (SIGTERM)\n";
        signal_all(SIGTERM);
        terminated = true;
        failed_at = Clock::now();
      } else if (terminated && !killed && waited > 5) {
        signal_all(SIGKILL);
        killed = true;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return first_failure;
}

}  // namespace kiln::cli
