// kiln::distributed — process groups and collectives across processes (and hosts).
//
//   #include <kiln/distributed.h>
//   namespace dist = kiln::distributed;
//   dist::init_process_group({.backend = "gloo"});   // rank, world size, rendezvous from the env
//   Tensor t = full({4}, float(dist::get_rank() + 1));
//   dist::all_reduce(t);                              // in place, sum by default
//   dist::destroy_process_group();
//
// Backends: "gloo" (Gloo over TCP; CPU tensors, CUDA tensors staged through the host) and "nccl"
// (NCCL, in builds with CUDA: CUDA tensors, one GPU per process, $LOCAL_RANK's by default).
// NCCL collectives run on a stream of the group's own, ordered after the caller's queued work;
// Work::wait() makes the caller's current stream wait (the host does not block), as in PyTorch. Ranks meet through a TCP key-value store that rank 0
// serves (TcpStore). `kiln launch --nproc N program args` starts one process per rank with the
// environment torchrun sets: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT (see docs/distributed.md).
//
// Every rank must issue the same collectives in the same order with matching tensors (dtype and
// element count), as in PyTorch. KILN_DISTRIBUTED_DEBUG=detail checks that before each collective
// and names the ranks that disagree instead of letting them hang or exchange garbage.
//
// Failures: a collective that cannot finish within the group's timeout, or whose peer died, throws
// DistributedError naming the rank (from then on the group is broken: every later call throws the
// same error). Nothing waits forever.
//
// Thread safety: collectives of one group may be issued from several threads, but every rank must
// issue them in the same order; the simplest correct use is one thread per group.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/error.h"
#include "kiln/nn/module.h"
#include "kiln/tensor.h"

namespace kiln::distributed {

// A collective failed: a timeout, a peer that died or closed its connection, mismatched calls, or
// a rendezvous that could not complete. The message names the rank(s) involved.
class DistributedError : public Error { using Error::Error; };

enum class ReduceOp : uint8_t { sum, avg, max, min, product };
const char* reduce_op_name(ReduceOp op);  // "sum", "avg", ...

// ---- the rendezvous store ----

// A TCP key-value store (torch.distributed.TCPStore): the server runs on a thread of the process
// that creates it with `is_server`; every process (the server's included) talks to it as a client.
// Values are bytes; `add` keeps a 64-bit counter. Safe to call from several threads.
//
// On a shared machine: when KILN_STORE_TOKEN is set (kiln launch sets a random one for single-host
// runs), the server refuses clients that do not present the same token, so another local user
// cannot join or feed a job's rendezvous. The server listens only on host's address (loopback
// for 127.0.0.1/localhost).
class TcpStore {
 public:
  struct Options {
    std::string host = "127.0.0.1";
    int port = 29500;                 // 0 with is_server: any free port (see port())
    bool is_server = false;
    int rank = -1;                    // reported to the server; names a client that disconnects
    std::chrono::milliseconds timeout = std::chrono::seconds(300);  // connect and wait limit
    std::optional<std::string> token; // unset: KILN_STORE_TOKEN from the environment, if any
  };
  explicit TcpStore(const Options& options);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const std::vector<uint8_t>& value);
  void set(const std::string& key, const std::string& value);
  // Waits (up to the timeout) for the key, then returns its value.
  std::vector<uint8_t> get(const std::string& key);
  std::string get_string(const std::string& key);
  int64_t add(const std::string& key, int64_t delta);  // returns the new value
  bool check(const std::vector<std::string>& keys);    // all present now
  // Waits until every key is present; DistributedError after `timeout` (default: the store's).
  void wait(const std::vector<std::string>& keys,
            std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  bool delete_key(const std::string& key);
  // Ranks whose connection to the server closed without saying goodbye (crashed or killed).
  std::vector<int> lost_ranks();
  int port() const;
  std::chrono::milliseconds timeout() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---- process groups ----

struct InitOptions {
  std::string backend;  // "gloo" or "nccl"; empty: nccl when built with it and a GPU is visible, else gloo
  int rank = -1;        // -1: $RANK
  int world_size = -1;  // -1: $WORLD_SIZE
  // "env://" (or empty): $MASTER_ADDR and $MASTER_PORT; "tcp://host:port": that store.
  std::string init_method;
  // How long a collective (and the rendezvous) may take before DistributedError;
  // unset: $KILN_DISTRIBUTED_TIMEOUT seconds, else 600 s (PyTorch's default is 10 minutes too).
  std::optional<std::chrono::milliseconds> timeout;
};

// A finished or pending collective. wait() blocks until it finished and rethrows its error; for
// NCCL work still running it instead makes the calling thread's current CUDA stream wait for it
// (errors then surface from later calls, or from the group's watchdog).
class Work {
 public:
  struct State;
  Work() = default;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}
  void wait() const;
  bool is_completed() const;
  bool defined() const { return state_ != nullptr; }

 private:
  std::shared_ptr<State> state_;
};

// One communicator among `size()` processes. Backends implement the collectives on tensors that
// the checks in process_group.cpp have made dense and of the backend's device.
class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual const std::string& backend() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::chrono::milliseconds timeout() const = 0;
  virtual Device device() const = 0;  // where its ops run: kCPU for gloo, the rank's GPU for nccl

  // All asynchronous: the returned Work finishes when the result is in the output tensor(s).
  // Inputs must stay alive and unmodified until then (the Work holds a reference to them).
  virtual Work all_reduce(Tensor tensor, ReduceOp op) = 0;
  virtual Work broadcast(Tensor tensor, int root) = 0;
  virtual Work all_gather(Tensor output, Tensor input) = 0;        // output: size() * input, dense
  virtual Work reduce_scatter(Tensor output, Tensor input, ReduceOp op) = 0;  // input: size() * output
  virtual Work barrier() = 0;
};

// Whether this build has the nccl backend (built with CUDA where NCCL was found); gloo is always there.
bool is_nccl_available();

// Creates the default group (once per process; DistributedError if one exists).
void init_process_group(const InitOptions& options = {});
bool is_initialized();
// Waits for the group's pending work, then closes its connections. Peers still using it see
// their collectives fail; call it on every rank after the last collective.
void destroy_process_group();
int get_rank();        // of the default group
int get_world_size();
int get_local_rank();  // $LOCAL_RANK (0 when unset): which GPU this process should use
std::shared_ptr<ProcessGroup> default_group();  // ValueError when none was initialized
// A group over the same ranks with its own connections: its collectives do not queue behind the
// default group's (DistributedDataParallel uses one so that its gradient traffic overlaps).
std::shared_ptr<ProcessGroup> new_group();

// ---- collectives on the default group (or `group`) ----
// Tensors of any dtype, dense or not (a strided tensor is gathered into a buffer and written back).
// `avg` needs a floating-point tensor. Each blocking call has an *_async twin returning Work.

void all_reduce(Tensor& tensor, ReduceOp op = ReduceOp::sum, std::shared_ptr<ProcessGroup> group = nullptr);
Work all_reduce_async(Tensor& tensor, ReduceOp op = ReduceOp::sum, std::shared_ptr<ProcessGroup> group = nullptr);

// Copies `root`'s tensor into every rank's.
void broadcast(Tensor& tensor, int root = 0, std::shared_ptr<ProcessGroup> group = nullptr);
Work broadcast_async(Tensor& tensor, int root = 0, std::shared_ptr<ProcessGroup> group = nullptr);

// outputs[r] receives rank r's input. outputs: one tensor per rank, each of input's shape and dtype.
void all_gather(std::vector<Tensor>& outputs, const Tensor& input, std::shared_ptr<ProcessGroup> group = nullptr);
Work all_gather_async(std::vector<Tensor>& outputs, const Tensor& input,
                      std::shared_ptr<ProcessGroup> group = nullptr);
// output: the ranks' inputs concatenated along dim 0 (world_size * input.size(0) rows).
void all_gather_into_tensor(Tensor& output, const Tensor& input, std::shared_ptr<ProcessGroup> group = nullptr);

// Reduces inputs[r] over all ranks into rank r's output. inputs: one tensor per rank, each of
// output's shape and dtype.
void reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs, ReduceOp op = ReduceOp::sum,
                    std::shared_ptr<ProcessGroup> group = nullptr);
// input: world_size slices of output's shape along dim 0; rank r gets the reduction of slice r.
void reduce_scatter_tensor(Tensor& output, const Tensor& input, ReduceOp op = ReduceOp::sum,
                           std::shared_ptr<ProcessGroup> group = nullptr);
Work reduce_scatter_tensor_async(Tensor& output, const Tensor& input, ReduceOp op = ReduceOp::sum,
                                 std::shared_ptr<ProcessGroup> group = nullptr);

void barrier(std::shared_ptr<ProcessGroup> group = nullptr);

}  // namespace kiln::distributed

namespace kiln::nn {

struct DistributedDataParallelOptions {
  std::shared_ptr<distributed::ProcessGroup> process_group;  // null: the default group
  double bucket_cap_mb = 25;            // gradient bytes per all-reduce (the first bucket: 1 MiB)
  bool find_unused_parameters = false;  // parameters a forward did not use count as ready
  bool broadcast_buffers = true;        // rank 0's buffers (BatchNorm statistics) before each forward
};

// Data-parallel training (torch.nn.parallel.DistributedDataParallel): every rank holds a replica
// of `module` and trains on its own part of the batch; gradients are averaged across ranks during
// the backward, so after it every replica holds the same .grad() and the same optimizer step.
//
//   auto ddp = std::make_shared<nn::DistributedDataParallel>(model);
//   auto opt = optim::SGD(ddp->parameters(), {.lr = 0.1});
//   loss(ddp->forward(x), y).backward();   // all-reduces overlap the rest of the backward
//   opt.step();
//
// - At construction, rank 0's parameters and buffers are broadcast to every rank, and the ranks
//   check that their models have the same parameter shapes.
// - Gradients are grouped into buckets of about bucket_cap_mb, in reverse registration order
//   (roughly the order the backward produces them). A hook on each parameter copies its gradient
//   into its bucket once accumulated; a full bucket's all-reduce (avg) starts at once on the
//   group's thread while the backward goes on. Buckets are reduced in one order on every rank.
//   When the last bucket was started, the hook waits for all of them and writes the averages
//   back into each parameter's .grad().
// - Every forward must be followed by a backward that reaches every parameter, or
//   find_unused_parameters must be set: then parameters the forward did not reach count as ready
//   with a zero gradient, and a parameter no rank used keeps an undefined .grad(). A forward while
//   the previous reduction is unfinished throws, naming the parameters that never got a gradient.
// - no_sync(): backwards inside accumulate gradients locally; the first backward after it
//   reduces the accumulated sums (gradient accumulation).
class DistributedDataParallel : public Module {
 public:
  explicit DistributedDataParallel(ModulePtr module, DistributedDataParallelOptions options = {});
  ~DistributedDataParallel() override;
  std::string name() const override { return "DistributedDataParallel"; }
  Tensor forward(const Tensor& input) override;
  const ModulePtr& module() const { return module_; }

  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool previous_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  // The parameter names of each gradient bucket, in the order buckets are all-reduced.
  std::vector<std::vector<std::string>> buckets() const;

  struct Reducer;  // the per-iteration bookkeeping (src/distributed/ddp.cpp)

 private:
  ModulePtr module_;
  DistributedDataParallelOptions options_;
  std::shared_ptr<distributed::ProcessGroup> group_;
  std::shared_ptr<Reducer> reducer_;
};

}  // namespace kiln::nn
