// kiln::distributed: the rendezvous store (in process), a one-rank group's checks, and real
// multi-process jobs over Gloo started with `kiln launch` (tests/distributed_worker.cpp).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include <gtest/gtest.h>

#include "kiln/distributed.h"
#include "kiln/kiln.h"

namespace dist = kiln::distributed;
using namespace kiln;
using namespace std::chrono_literals;

namespace {

dist::TcpStore::Options server_options() {
  dist::TcpStore::Options o;
  o.port = 0;
  o.is_server = true;
  o.rank = 0;
  o.timeout = 10s;
  o.token = "secret";
  return o;
}

dist::TcpStore::Options client_of(const dist::TcpStore& server, int rank, std::string token = "secret") {
  dist::TcpStore::Options o;
  o.port = server.port();
  o.rank = rank;
  o.timeout = 10s;
  o.token = std::move(token);
  return o;
}

int raw_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

struct RunResult {
  int code = -1;
  std::string output;
  double seconds = 0;
};

RunResult run(const std::string& command) {
  auto start = std::chrono::steady_clock::now();
  RunResult r;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  EXPECT_NE(p, nullptr);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

std::string launch(int nproc, const std::string& scenario, const std::string& env = "",
                   const std::string& backend = "gloo") {
  return env + " " + KILN_BINARY_DIR + "/bin/kiln launch --nproc " + std::to_string(nproc) + " --exit-grace 30 " +
         KILN_DISTRIBUTED_WORKER + " " + scenario + " " + backend;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST(TcpStore, SetGetAddCheckWaitAndDelete) {
  dist::TcpStore server(server_options());
  dist::TcpStore client(client_of(server, 1));
  server.set("a", std::string("hello"));
  EXPECT_EQ(client.get_string("a"), "hello");
  EXPECT_EQ(client.add("n", 5), 5);
  EXPECT_EQ(server.add("n", -2), 3);
  EXPECT_TRUE(client.check({"a", "n"}));
  EXPECT_FALSE(client.check({"a", "missing"}));
  // A get waits for a key another client sets later.
  std::thread setter([&] {
    std::this_thread::sleep_for(100ms);
    server.set("late", std::vector<uint8_t>{1, 2, 3});
  });
  EXPECT_EQ(client.get("late"), (std::vector<uint8_t>{1, 2, 3}));
  setter.join();
  EXPECT_TRUE(client.delete_key("a"));
  EXPECT_FALSE(client.delete_key("a"));
  EXPECT_FALSE(client.check({"a"}));
  EXPECT_TRUE(server.lost_ranks().empty());
}

TEST(TcpStore, WaitTimesOutNamingTheKeys) {
  dist::TcpStore server(server_options());
  auto start = std::chrono::steady_clock::now();
  try {
    server.wait({"never", "nor-this"}, 300ms);
    FAIL() << "wait did not time out";
  } catch (const dist::DistributedError& e) {
    EXPECT_NE(std::string(e.what()).find("'never', 'nor-this'"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  server.set("after", std::string("x"));  // the connection is still usable
  EXPECT_EQ(server.get_string("after"), "x");
}

TEST(TcpStore, RefusesAClientWithoutTheToken) {
  dist::TcpStore server(server_options());
  auto wrong = client_of(server, 1, "guess");
  EXPECT_THROW(dist::TcpStore bad(wrong), dist::DistributedError);
  // Nothing a refused client sent reached the data.
  int fd = raw_connect(server.port());
  uint8_t set_without_hello[] = {2, 1, 0, 0, 0, 0, 0, 0, 0, 'k'};
  ASSERT_EQ(send(fd, set_without_hello, sizeof(set_without_hello), 0), ssize_t(sizeof(set_without_hello)));
  char c;
  EXPECT_EQ(recv(fd, &c, 1, 0), 0);  // closed by the server
  close(fd);
  EXPECT_FALSE(server.check({"k"}));
}

TEST(TcpStore, AStrangerCannotMakeTheServerBufferMuch) {
  dist::TcpStore server(server_options());
  int fd = raw_connect(server.port());
  // 16 MiB of bytes that are not a hello: the server reads a few KiB, hangs up, and the rest
  // cannot be delivered (more than the kernel's socket buffers hold).
  std::vector<uint8_t> flood(16 << 20, 'x');
  flood[0] = 1;
  uint64_t len = 4000;  // a plausible token length: only the byte limit stops the read
  std::memcpy(flood.data() + 1, &len, sizeof(len));
  timeval five_seconds{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &five_seconds, sizeof(five_seconds));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &five_seconds, sizeof(five_seconds));
  ssize_t sent = send(fd, flood.data(), flood.size(), MSG_NOSIGNAL);
  EXPECT_LT(sent, ssize_t(flood.size())) << "the server took all 16 MiB from a client without the token";
  char c;
  errno = 0;
  ssize_t r = recv(fd, &c, 1, 0);
  EXPECT_TRUE(r == 0 || (r < 0 && errno == ECONNRESET)) << "the server kept the connection open";
  close(fd);
  server.set("fine", std::string("yes"));
  EXPECT_EQ(server.get_string("fine"), "yes");
}

TEST(TcpStore, SurvivesGarbageAndNamesLostRanks) {
  auto options = server_options();
  options.token.reset();
  setenv("KILN_STORE_TOKEN", "", 1);
  dist::TcpStore server(options);
  // A length past every limit closes that connection only.
  int fd = raw_connect(server.port());
  uint8_t hello[] = {1, 0, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0};  // hello, empty token, rank 7
  uint8_t huge_key[] = {2, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f};
  ASSERT_EQ(send(fd, hello, sizeof(hello), 0), ssize_t(sizeof(hello)));
  char ack;
  ASSERT_EQ(recv(fd, &ack, 1, 0), 1);
  ASSERT_EQ(send(fd, huge_key, sizeof(huge_key), 0), ssize_t(sizeof(huge_key)));
  EXPECT_EQ(recv(fd, &ack, 1, 0), 0);
  close(fd);
  // Rank 7 left without saying goodbye: it is reported lost; the store still serves.
  for (int i = 0; i < 100 && server.lost_ranks().empty(); ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(server.lost_ranks(), std::vector<int>{7});
  server.set("still", std::string("here"));
  EXPECT_EQ(server.get_string("still"), "here");
  // A client that closes properly is not lost.
  { dist::TcpStore polite(client_of(server, 9, "")); }
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(server.lost_ranks(), std::vector<int>{7});
}

TEST(TcpStore, ManyThreadsShareOneClient) {
  dist::TcpStore server(server_options());
  dist::TcpStore client(client_of(server, 1));
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) client.add("counter", 1);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(server.add("counter", 0), 1600);
}

TEST(TcpStore, ConnectingToNobodyFailsWithinTheTimeout) {
  dist::TcpStore::Options o;
  o.port = 1;  // nothing listens on port 1
  o.timeout = 300ms;
  auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(dist::TcpStore s(o), dist::DistributedError);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(ProcessGroup, OneRankGroupChecksItsArguments) {
  EXPECT_FALSE(dist::is_initialized());
  EXPECT_THROW(dist::get_rank(), ValueError);
  EXPECT_THROW(dist::destroy_process_group(), ValueError);
  EXPECT_THROW(dist::init_process_group({.backend = "mpi", .rank = 0, .world_size = 1}), ValueError);
  EXPECT_THROW(dist::init_process_group({.backend = "gloo", .rank = 2, .world_size = 2}), ValueError);
  EXPECT_THROW(dist::init_process_group({.backend = "gloo", .rank = 0, .world_size = 1, .init_method = "file:///x"}),
               ValueError);
  dist::init_process_group({.backend = "gloo", .rank = 0, .world_size = 1});
  EXPECT_TRUE(dist::is_initialized());
  EXPECT_THROW(dist::init_process_group({.backend = "gloo", .rank = 0, .world_size = 1}), dist::DistributedError);
  EXPECT_EQ(dist::get_rank(), 0);
  EXPECT_EQ(dist::get_world_size(), 1);
  EXPECT_EQ(dist::default_group()->backend(), "gloo");

  Tensor t = arange(6, kFloat32);
  dist::all_reduce(t, dist::ReduceOp::avg);
  EXPECT_TRUE(equal(t, arange(6, kFloat32)));
  Tensor i = arange(6, kInt64);
  EXPECT_THROW(dist::all_reduce(i, dist::ReduceOp::avg), DTypeError);
  Tensor undefined;
  EXPECT_THROW(dist::all_reduce(undefined), ValueError);
  EXPECT_THROW(dist::broadcast(t, 1), ValueError);
  std::vector<Tensor> two = {empty({6}), empty({6})};
  EXPECT_THROW(dist::all_gather(two, t), ValueError);
  std::vector<Tensor> wrong_shape = {empty({5})};
  EXPECT_THROW(dist::all_gather(wrong_shape, t), ShapeError);
  Tensor out = empty({3});
  EXPECT_THROW(dist::reduce_scatter_tensor(out, t), ShapeError);
  Tensor small = empty({6});
  dist::reduce_scatter_tensor(small, t);
  EXPECT_TRUE(equal(small, t));
  Tensor gathered = empty({2, 3});
  dist::all_gather_into_tensor(gathered, t.view({2, 3}));
  EXPECT_TRUE(equal(gathered, t.view({2, 3})));
  // The backend's own entry points take only dense CPU tensors; the free functions stage the rest.
  EXPECT_THROW(dist::default_group()->all_reduce(t.view({2, 3}).t(), dist::ReduceOp::sum), ValueError);
  dist::barrier();
  dist::destroy_process_group();
  EXPECT_FALSE(dist::is_initialized());
}

TEST(ProcessGroup, EnvironmentErrorsSayHowToStart) {
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  try {
    dist::init_process_group({.backend = "gloo"});
    FAIL() << "init without RANK/WORLD_SIZE succeeded";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("kiln launch"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(dist::is_initialized());
}

TEST(Launch, CollectivesMatchLocalResultsOnTwoRanks) {
  RunResult r = run(launch(2, "collectives"));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "PASS collectives"), 2u) << r.output;
}

TEST(Launch, CollectivesMatchLocalResultsOnThreeRanks) {
  RunResult r = run(launch(3, "collectives"));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "PASS collectives"), 3u) << r.output;
}

TEST(Launch, MismatchedCallsAreNamedUnderDebugDetail) {
  RunResult r = run(launch(2, "mismatch", "KILN_DISTRIBUTED_DEBUG=detail"));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "PASS mismatch"), 2u) << r.output;
}

TEST(Launch, AKilledRankIsNamedByTheOthersWithinTheTimeout) {
  RunResult r = run(launch(2, "kill-rank-1"));
  EXPECT_EQ(r.code, 128 + SIGKILL) << r.output;  // the launcher returns the killed rank's code
  EXPECT_EQ(count(r.output, "PASS kill-rank-1 rank 0"), 1u) << r.output;
  EXPECT_LT(r.seconds, 20) << r.output;  // the group's timeout: the failure came from the socket, not a timer
}

TEST(Launch, LosingRankZeroAndItsStoreIsNamed) {
  RunResult r = run(launch(2, "kill-rank-0"));
  EXPECT_EQ(r.code, 128 + SIGKILL) << r.output;
  EXPECT_EQ(count(r.output, "PASS kill-rank-0 rank 1"), 1u) << r.output;
  EXPECT_LT(r.seconds, 20) << r.output;
}

TEST(Launch, ReturnsTheFirstNonZeroExitCode) {
  RunResult r = run(launch(2, "exit-code"));
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_NE(r.output.find("rank 1"), std::string::npos) << r.output;
}

TEST(Launch, RefusesBadArguments) {
  std::string kiln = std::string(KILN_BINARY_DIR) + "/bin/kiln launch";
  RunResult no_nproc = run(kiln + " true");
  EXPECT_EQ(no_nproc.code, 1);
  EXPECT_NE(no_nproc.output.find("--nproc is required"), std::string::npos) << no_nproc.output;
  RunResult bad_rank = run(kiln + " --nproc 1 --nnodes 2 --node-rank 2 true");
  EXPECT_EQ(bad_rank.code, 1);
  RunResult missing = run(kiln + " --nproc 2 /nonexistent/program");
  EXPECT_EQ(missing.code, 127) << missing.output;
  EXPECT_NE(missing.output.find("cannot run"), std::string::npos) << missing.output;
}

TEST(Launch, DataParallelTrainingMatchesOneProcessOnTheWholeBatch) {
  RunResult r = run(launch(2, "ddp"));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "PASS ddp"), 2u) << r.output;
}

// ---- NCCL: one rank on any GPU; two ranks where two GPUs are visible ----

bool have_nccl_gpus(int n) { return dist::is_nccl_available() && cuda::is_available() && cuda::device_count() >= n; }

TEST(ProcessGroup, NcclOneRankRunsEveryCollectiveOnTheGpu) {
  if (!have_nccl_gpus(1)) GTEST_SKIP() << "no NCCL or no GPU";
  dist::init_process_group({.backend = "nccl", .rank = 0, .world_size = 1});
  auto group = dist::default_group();
  EXPECT_EQ(group->backend(), "nccl");
  EXPECT_TRUE(group->device().is_cuda());
  Tensor t = arange(6, TensorOptions(kFloat32, group->device()));
  dist::all_reduce(t, dist::ReduceOp::avg);
  EXPECT_TRUE(equal(t.cpu(), arange(6, kFloat32)));
  Tensor host = arange(4, kInt64);  // a CPU tensor is staged through the GPU and written back
  dist::all_reduce(host, dist::ReduceOp::max);
  EXPECT_TRUE(equal(host, arange(4, kInt64)));
  Tensor out = empty({6}, TensorOptions(kFloat32, group->device()));
  dist::all_gather_into_tensor(out, t);
  EXPECT_TRUE(equal(out.cpu(), t.cpu()));
  dist::Work w = dist::all_reduce_async(t);
  w.wait();  // the current stream waits; the host read below synchronizes
  EXPECT_TRUE(equal(t.cpu(), arange(6, kFloat32)));
  dist::barrier();
  dist::destroy_process_group();
}

TEST(Launch, NcclCollectivesMatchLocalResultsOnTwoGpus) {
  if (!have_nccl_gpus(2)) GTEST_SKIP() << "fewer than two GPUs";
  RunResult r = run(launch(2, "collectives", "", "nccl"));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "PASS collectives"), 2u) << r.output;
}

TEST(Launch, NcclDataParallelTrainingMatchesOneProcess) {
  if (!have_nccl_gpus(2)) GTEST_SKIP() << "fewer than two GPUs";
  RunResult r = run(launch(2, "ddp", "", "nccl"));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "PASS ddp"), 2u) << r.output;
}

TEST(Launch, NcclAKilledRankIsNamedWithinTheTimeout) {
  if (!have_nccl_gpus(2)) GTEST_SKIP() << "fewer than two GPUs";
  RunResult r = run(launch(2, "kill-rank-1", "", "nccl"));
  EXPECT_EQ(r.code, 128 + SIGKILL) << r.output;
  EXPECT_EQ(count(r.output, "PASS kill-rank-1 rank 0"), 1u) << r.output;
  EXPECT_LT(r.seconds, 20) << r.output;
}

TEST(Launch, TheDdpExampleTrainsIdenticalReplicasOnTwoRanks) {
  const std::string example = std::string(KILN_BINARY_DIR) + "/examples/example_train_ddp";
  if (access(example.c_str(), X_OK) != 0) GTEST_SKIP() << "examples not built (KILN_BUILD_EXAMPLES=OFF)";
  RunResult r = run(std::string(KILN_BINARY_DIR) + "/bin/kiln launch --nproc 2 " + example);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("over 2 ranks"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("largest weight difference between replicas: 0\n"), std::string::npos) << r.output;
}
