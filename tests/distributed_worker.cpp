// One rank of the multi-process tests in tests/test_distributed.cpp, started by `kiln launch`.
// Usage: kiln_distributed_worker SCENARIO [gloo|nccl]   (nccl: CUDA tensors on each rank's GPU)
//   collectives  every collective, every dtype and reduce op, against results computed locally
//   mismatch     ranks call all_reduce with different sizes under KILN_DISTRIBUTED_DEBUG=detail
//   kill-rank-1  rank 1 dies (SIGKILL) after a barrier; rank 0's next all_reduce must fail naming it
//   kill-rank-0  the same with rank 0, which also serves the rendezvous store
//   exit-code    rank 1 exits with 3 (the launcher must return it)
//   ddp          DistributedDataParallel trains 5 steps; parameters must match one process
//                training on the whole batch
// Prints "PASS <scenario>" on success; otherwise an error on stderr and a non-zero exit code.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <thread>

#include "kiln/distributed.h"
#include "kiln/kiln.h"

namespace dist = kiln::distributed;
using namespace kiln;

namespace {

Device g_device = kCPU;  // nccl runs: this rank's GPU
Tensor on_device(const Tensor& t) { return t.to(g_device); }

[[noreturn]] void fail(const std::string& what) {
  std::cerr << "rank " << dist::get_rank() << ": FAIL " << what << std::endl;
  std::exit(1);
}

void expect(bool ok, const std::string& what) {
  if (!ok) fail(what);
}

// Rank r's input: small integers (exact in every dtype, int8 products included).
Tensor input_of(int rank, DType dtype, int64_t n = 11) {
  Tensor base = remainder(arange(n, kFloat64), 5.0) + 1.0;  // 1..5
  if (dtype == kBool) return eq(remainder(arange(n, kInt64) + rank, 2), 0);
  return (base * double(rank + 1)).to(dtype);
}

Tensor reference(const std::vector<Tensor>& all, dist::ReduceOp op, DType dtype) {
  Tensor acc = all[0].to(kFloat64);
  for (size_t r = 1; r < all.size(); ++r) {
    Tensor x = all[r].to(kFloat64);
    switch (op) {
      case dist::ReduceOp::sum:
      case dist::ReduceOp::avg: acc = acc + x; break;
      case dist::ReduceOp::product: acc = acc * x; break;
      case dist::ReduceOp::max: acc = maximum(acc, x); break;
      case dist::ReduceOp::min: acc = minimum(acc, x); break;
    }
  }
  if (op == dist::ReduceOp::avg) acc = acc / double(all.size());
  if (dtype == kBool) return ne(acc, 0.0);
  return acc.to(dtype);
}

void collectives() {
  int rank = dist::get_rank(), world = dist::get_world_size();
  const DType dtypes[] = {kBool, kUInt8, kInt8, kInt32, kInt64, kFloat16, kBFloat16, kFloat32, kFloat64};
  const dist::ReduceOp ops[] = {dist::ReduceOp::sum, dist::ReduceOp::avg, dist::ReduceOp::max, dist::ReduceOp::min,
                                dist::ReduceOp::product};
  for (DType dtype : dtypes) {
    std::vector<Tensor> all;
    for (int r = 0; r < world; ++r) all.push_back(input_of(r, dtype));
    std::string name(dtype_name(dtype));
    for (dist::ReduceOp op : ops) {
      if (op == dist::ReduceOp::avg && !is_floating_point(dtype)) continue;
      if (dtype == kBool && op == dist::ReduceOp::avg) continue;
      Tensor t = on_device(input_of(rank, dtype));
      dist::all_reduce(t, op);
      Tensor want = dtype == kBool && (op == dist::ReduceOp::sum || op == dist::ReduceOp::max)
                        ? reference(all, dist::ReduceOp::max, dtype)  // logical or
                        : reference(all, op, dtype);
      expect(equal(t.cpu(), want), "all_reduce " + std::string(dist::reduce_op_name(op)) + " " + name + ": got " + t.str() +
                                 " want " + want.str());
    }
    // broadcast from every root
    for (int root = 0; root < world; ++root) {
      Tensor t = on_device(input_of(rank, dtype));
      dist::broadcast(t, root);
      expect(equal(t.cpu(), all[size_t(root)]), "broadcast " + name);
    }
    // all_gather (list and tensor forms)
    std::vector<Tensor> outs;
    for (int r = 0; r < world; ++r) outs.push_back(empty({11}, TensorOptions(dtype, g_device)));
    dist::all_gather(outs, on_device(input_of(rank, dtype)));
    for (int r = 0; r < world; ++r) expect(equal(outs[size_t(r)].cpu(), all[size_t(r)]), "all_gather " + name);
    Tensor gathered = empty({world * 11}, TensorOptions(dtype, g_device));
    dist::all_gather_into_tensor(gathered, on_device(input_of(rank, dtype)));
    expect(equal(gathered.cpu(), cat(all, 0)), "all_gather_into_tensor " + name);
    // reduce_scatter: rank r gets slice r of the sum of everyone's inputs
    if (dtype != kBool) {
      std::vector<Tensor> pieces;
      for (int r = 0; r < world; ++r) pieces.push_back(on_device(input_of(rank + r, dtype, 4)));
      Tensor out = empty({4}, TensorOptions(dtype, g_device));
      dist::reduce_scatter(out, pieces, dist::ReduceOp::sum);
      std::vector<Tensor> contributions;
      for (int src = 0; src < world; ++src) contributions.push_back(input_of(src + rank, dtype, 4));
      expect(equal(out.cpu(), reference(contributions, dist::ReduceOp::sum, dtype)), "reduce_scatter " + name);
    }
  }
  // Strided tensors are staged and written back; the rest of the storage is untouched.
  Tensor m = full({4, 6}, float(rank + 1), g_device);
  Tensor column = m.select(1, 2);
  dist::all_reduce(column);
  float total = float(world * (world + 1) / 2);
  expect(equal(m.select(1, 2).cpu(), full({4}, total)), "strided all_reduce");
  expect(equal(m.select(1, 0).cpu(), full({4}, float(rank + 1))), "strided all_reduce left the rest alone");
  // Async work, several in flight, waited out of order.
  std::vector<Tensor> ts;
  std::vector<dist::Work> works;
  for (int k = 0; k < 8; ++k) ts.push_back(full({1000}, float(k + rank), g_device));
  for (auto& t : ts) works.push_back(dist::all_reduce_async(t));
  for (int k = 7; k >= 0; --k) works[size_t(k)].wait();
  for (int k = 0; k < 8; ++k)
    expect(equal(ts[size_t(k)].cpu(), full({1000}, float(world * k + world * (world - 1) / 2))), "async all_reduce");
  // A large tensor (several Gloo segments).
  Tensor big = full({3 << 20}, 1.0f, g_device);
  dist::all_reduce(big);
  expect(big.min().item<float>() == float(world) && big.max().item<float>() == float(world), "large all_reduce");
  // A second group runs beside the default one.
  auto other = dist::new_group();
  Tensor o = full({3}, 2.0f, g_device);
  dist::all_reduce(o, dist::ReduceOp::product, other);
  expect(equal(o.cpu(), full({3}, float(1 << world))), "new_group all_reduce");
  // An in-place write bumps the version (autograd's saved-tensor check sees it).
  Tensor v = ones({2}, g_device);
  uint64_t before = v.version();
  dist::all_reduce(v);
  expect(v.version() > before, "version bumped");
  dist::barrier();
}

void mismatch() {
  int rank = dist::get_rank();
  Tensor t = ones({rank == 0 ? 4 : 5}, g_device);
  try {
    dist::all_reduce(t);
  } catch (const dist::DistributedError& e) {
    std::string m = e.what();
    expect(m.find("ranks disagree") != std::string::npos && m.find("4 elements") != std::string::npos &&
               m.find("5 elements") != std::string::npos,
           "mismatch message: " + m);
    std::cout << "mismatch detected: " << m << std::endl;
    return;
  }
  fail("mismatched all_reduce did not throw");
}

void kill_rank(int victim) {
  int rank = dist::get_rank();
  dist::barrier();
  if (rank == victim) raise(SIGKILL);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  auto start = std::chrono::steady_clock::now();
  Tensor t = ones({1 << 16}, g_device);
  try {
    dist::all_reduce(t);
    dist::barrier();  // nccl: all_reduce only queued the work; the barrier waits on the host
  } catch (const dist::DistributedError& e) {
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::string m = e.what();
    std::cout << "rank " << rank << " saw after " << s << " s: " << m << std::endl;
    std::string want = victim == 0 ? "rank 0, which serves the rendezvous store" : "rank 1 exited or crashed";
    expect(m.find(want) != std::string::npos, "the error names the dead rank: " + m);
    // The group is broken from now on: the next call fails at once with the same message.
    try {
      dist::barrier();
    } catch (const dist::DistributedError& again) {
      expect(std::string(again.what()).find(want) != std::string::npos, "broken group repeats the error");
      return;
    }
    fail("a broken group accepted another collective");
  }
  fail("all_reduce with a dead peer did not throw");
}

// A small model with a branch the forward can skip (find_unused_parameters).
struct Net : nn::Module {
  std::shared_ptr<nn::Linear> a, b, spare;
  bool use_spare = false;
  Net() {
    a = register_module("a", std::make_shared<nn::Linear>(8, 16));
    b = register_module("b", std::make_shared<nn::Linear>(16, 4));
    spare = register_module("spare", std::make_shared<nn::Linear>(16, 4));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = relu(a->forward(x));
    return use_spare ? b->forward(h) + spare->forward(h) : b->forward(h);
  }
};

// Starts `dst` from `src`'s weights (two replicas of one model).
void copy_parameters(nn::Module& dst, const nn::Module& src) {
  NoGradGuard no_grad;
  TensorList to = dst.parameters(), from = src.parameters();
  for (size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i]);
}

bool same_parameters(const nn::Module& x, const nn::Module& y, const std::string& what) {
  auto px = x.named_parameters(), py = y.named_parameters();
  if (px.size() != py.size()) fail(what + ": parameter count");
  for (size_t i = 0; i < px.size(); ++i)
    if (!allclose(px[i].second, py[i].second, 1e-5, 1e-6))
      fail(what + ": " + px[i].first + " differs: " + px[i].second.str() + " vs " + py[i].second.str());
  return true;
}

// DDP on this rank's half of each batch must end where one process training on the whole batch
// ends: the averaged gradient of two half-batch means is the gradient of the whole-batch mean.
void ddp() {
  int rank = dist::get_rank(), world = dist::get_world_size();
  const int per_rank = 4;
  // Different seeds: the constructor's broadcast must make the replicas equal.
  manual_seed(100 + uint64_t(rank));
  auto model = std::make_shared<Net>();
  manual_seed(100);
  auto reference = std::make_shared<Net>();
  model->to(g_device);
  reference->to(g_device);
  {
    // Tiny buckets: several all-reduces per backward, launched in order.
    auto ddp_model = std::make_shared<nn::DistributedDataParallel>(
        model, nn::DistributedDataParallelOptions{.bucket_cap_mb = 0.0002});
    expect(ddp_model->buckets().size() >= 3, "several buckets");
    expect(ddp_model->buckets()[0][0] == "spare.bias", "buckets start from the last parameter");
    same_parameters(*model, *reference, "after the constructor's broadcast");
    model->use_spare = reference->use_spare = true;  // every parameter gets a gradient
    optim::SGD opt(ddp_model->parameters(), {.lr = 0.1, .momentum = 0.9});
    optim::SGD ref_opt(reference->parameters(), {.lr = 0.1, .momentum = 0.9});
    for (int step = 0; step < 5; ++step) {
      manual_seed(1000 + uint64_t(step));
      Tensor x = on_device(randn({per_rank * world, 8}));
      Tensor y = on_device(randn({per_rank * world, 4}));
      Tensor mine_x = x.narrow(0, rank * per_rank, per_rank), mine_y = y.narrow(0, rank * per_rank, per_rank);
      opt.zero_grad();
      mse_loss(ddp_model->forward(mine_x), mine_y).backward();
      opt.step();
      ref_opt.zero_grad();
      mse_loss(reference->forward(x), y).backward();
      ref_opt.step();
    }
    same_parameters(*model, *reference, "after 5 DDP steps");

    // Gradient accumulation: a backward inside no_sync() stays local; the next one reduces the sum.
    manual_seed(2000);
    Tensor x = on_device(randn({2 * per_rank * world, 8})), y = on_device(randn({2 * per_rank * world, 4}));
    opt.zero_grad();
    for (int micro = 0; micro < 2; ++micro) {
      Tensor mx = x.narrow(0, (2 * rank + micro) * per_rank, per_rank);
      Tensor my = y.narrow(0, (2 * rank + micro) * per_rank, per_rank);
      if (micro == 0) {
        auto guard = ddp_model->no_sync();
        (mse_loss(ddp_model->forward(mx), my) * 0.5).backward();
      } else {
        (mse_loss(ddp_model->forward(mx), my) * 0.5).backward();
      }
    }
    opt.step();
    ref_opt.zero_grad();
    // The same samples in the same per-rank, per-micro-batch grouping.
    Tensor ref_loss = zeros({}, g_device);
    for (int r = 0; r < world; ++r)
      for (int micro = 0; micro < 2; ++micro) {
        Tensor mx = x.narrow(0, (2 * r + micro) * per_rank, per_rank);
        Tensor my = y.narrow(0, (2 * r + micro) * per_rank, per_rank);
        ref_loss = ref_loss + mse_loss(reference->forward(mx), my) * (0.5 / world);
      }
    ref_loss.backward();
    ref_opt.step();
    same_parameters(*model, *reference, "after accumulating with no_sync");

    // A forward whose backward never ran: the next forward says what is missing.
    bool threw = false;
    try {
      ddp_model->forward(x.narrow(0, 0, 2));
      ddp_model->forward(x.narrow(0, 0, 2));
    } catch (const ValueError& e) {
      threw = std::string(e.what()).find("find_unused_parameters") != std::string::npos;
    }
    expect(threw, "a forward before the previous backward names find_unused_parameters");
  }
  // find_unused_parameters: rank 0 uses the spare branch, rank 1 does not.
  manual_seed(7);
  auto m2 = std::make_shared<Net>();
  auto r2 = std::make_shared<Net>();
  m2->to(g_device);
  r2->to(g_device);
  copy_parameters(*r2, *m2);
  auto d2 = std::make_shared<nn::DistributedDataParallel>(
      m2, nn::DistributedDataParallelOptions{.bucket_cap_mb = 0.0002, .find_unused_parameters = true});
  manual_seed(3000);
  Tensor x = on_device(randn({per_rank * world, 8})), y = on_device(randn({per_rank * world, 4}));
  m2->use_spare = rank == 0;
  mse_loss(d2->forward(x.narrow(0, rank * per_rank, per_rank)), y.narrow(0, rank * per_rank, per_rank)).backward();
  // Reference: the average of both ranks' losses, each with its own branch choice.
  Tensor ref_loss = zeros({}, g_device);
  for (int r = 0; r < world; ++r) {
    r2->use_spare = r == 0;
    ref_loss = ref_loss + mse_loss(r2->forward(x.narrow(0, r * per_rank, per_rank)), y.narrow(0, r * per_rank, per_rank)) / double(world);
  }
  ref_loss.backward();
  auto gm = m2->named_parameters(), gr = r2->named_parameters();
  for (size_t i = 0; i < gm.size(); ++i)
    expect(allclose(gm[i].second.grad(), gr[i].second.grad(), 1e-5, 1e-6), "find_unused gradient of " + gm[i].first);

  // A compiled training step around a DDP model: its graphs end at the bucket boundaries (each
  // bucket's all-reduce starts while the rest of the backward runs), and it trains exactly as
  // eager DDP does.
  manual_seed(11);
  auto m3 = std::make_shared<Net>(), r3 = std::make_shared<Net>();
  m3->use_spare = r3->use_spare = true;
  copy_parameters(*r3, *m3);
  m3->to(g_device);
  r3->to(g_device);
  nn::DistributedDataParallelOptions small{.bucket_cap_mb = 0.0002};
  auto d3 = std::make_shared<nn::DistributedDataParallel>(m3, small);
  auto e3 = std::make_shared<nn::DistributedDataParallel>(r3, small);
  optim::SGD o3(d3->parameters(), {.lr = 0.1}), oe(e3->parameters(), {.lr = 0.1});
  auto body = [&](const Tensor& bx, const Tensor& by) {
    o3.zero_grad();
    Tensor loss = mse_loss(d3->forward(bx), by);
    loss.backward();
    o3.step();
    return loss;
  };
  auto step = compile(body);
  for (int s = 0; s < 3; ++s) {
    manual_seed(4000 + uint64_t(s));
    Tensor bx = on_device(randn({per_rank * world, 8})).narrow(0, rank * per_rank, per_rank);
    Tensor by = on_device(randn({per_rank * world, 4})).narrow(0, rank * per_rank, per_rank);
    step(bx, by);
    oe.zero_grad();
    mse_loss(e3->forward(bx), by).backward();
    oe.step();
  }
  same_parameters(*m3, *r3, "compiled DDP step vs eager DDP");
  manual_seed(5000);
  Tensor bx = on_device(randn({per_rank, 8})), by = on_device(randn({per_rank, 4}));
  std::string report = compiler::explain(body)(bx, by).str();
  size_t splits = 0;
  for (size_t at = report.find("is all-reduced here"); at != std::string::npos; at = report.find("is all-reduced here", at + 1))
    ++splits;
  expect(splits == d3->buckets().size(), "explain shows one split per bucket:\n" + report);
  // Module style: the model compiled, the backward outside the compiled call. Its captured
  // backward breaks at every bucket too (the graph-break counter moves by one per bucket per
  // step), and it trains exactly as eager DDP does.
  manual_seed(12);
  auto m4 = std::make_shared<Net>(), r4 = std::make_shared<Net>();
  m4->use_spare = r4->use_spare = true;
  copy_parameters(*r4, *m4);
  m4->to(g_device);
  r4->to(g_device);
  auto d4 = std::make_shared<nn::DistributedDataParallel>(m4, small);
  auto e4 = std::make_shared<nn::DistributedDataParallel>(r4, small);
  optim::SGD o4(d4->parameters(), {.lr = 0.1}), oe4(e4->parameters(), {.lr = 0.1});
  auto compiled_model = compile(d4);
  int64_t breaks = 0;
  for (int s = 0; s < 3; ++s) {
    manual_seed(6000 + uint64_t(s));
    Tensor mx = on_device(randn({per_rank, 8})), my = on_device(randn({per_rank, 4}));
    o4.zero_grad();
    Tensor loss = mse_loss(compiled_model(mx), my);
    int64_t before = compiler::counters().graph_breaks;
    loss.backward();
    breaks = compiler::counters().graph_breaks - before;
    o4.step();
    oe4.zero_grad();
    mse_loss(e4->forward(mx), my).backward();
    oe4.step();
  }
  same_parameters(*m4, *r4, "compiled DDP module vs eager DDP");
  expect(breaks >= int64_t(d4->buckets().size()),
         "the compiled backward splits at each bucket: " + std::to_string(breaks) + " breaks");

  size_t at = report.find("Graph Count: ");
  expect(at != std::string::npos && std::stoi(report.substr(at + 13)) >= 2,
         "the step ran as compiled graphs (not eagerly):\n" + report);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: kiln_distributed_worker SCENARIO\n";
    return 2;
  }
  std::string scenario = argv[1];
  std::string backend = argc > 2 ? argv[2] : "gloo";
  try {
    dist::InitOptions options{.backend = backend};
    if (scenario.rfind("kill", 0) == 0) options.timeout = std::chrono::seconds(20);
    dist::init_process_group(options);
    if (backend == "nccl") g_device = dist::default_group()->device();
    if (scenario == "collectives") collectives();
    else if (scenario == "mismatch") mismatch();
    else if (scenario == "ddp") ddp();
    else if (scenario == "kill-rank-1") kill_rank(1);
    else if (scenario == "kill-rank-0") kill_rank(0);
    else if (scenario == "exit-code") {
      dist::barrier();
      if (dist::get_rank() == 1) return 3;
    } else {
      std::cerr << "unknown scenario " << scenario << "\n";
      return 2;
    }
    std::cout << "PASS " << scenario << " rank " << dist::get_rank() << std::endl;
    if (scenario == "collectives" || scenario == "exit-code" || scenario == "ddp") dist::destroy_process_group();
  } catch (const std::exception& e) {
    std::cerr << "rank ? error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
