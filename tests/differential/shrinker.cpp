#include "shrinker.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <sstream>

namespace kiln::differential {

namespace {

bool same_type(const ValueType& a, const ValueType& b) {
  return a.sizes == b.sizes && a.dtype == b.dtype;
}

// The program without op k, its results replaced by `substitute` (an earlier value).
Program without_op(const Program& p, int k, int first, int count, int substitute) {
  Program q = p;
  q.ops.erase(q.ops.begin() + k);
  auto remap = [&](int& id) {
    if (id >= first && id < first + count) {
      id = substitute;
    } else if (id >= first + count) {
      id -= count;
    }
  };
  for (Op& op : q.ops)
    for (int& a : op.args)
      if (a >= 0) remap(a);
  for (Output& o : q.outputs) remap(o.value);
  // A value returned twice after the substitution is returned once.
  std::vector<Output> unique;
  for (const Output& o : q.outputs)
    if (std::none_of(unique.begin(), unique.end(),
                     [&](const Output& u) { return u.value == o.value; }))
      unique.push_back(o);
  q.outputs = unique;
  return q;
}

// Op k removed, its uses redirected to its target (in place), one of its arguments or an
// earlier value of the same type; nullopt when no redirection gives a valid program.
std::optional<Program> remove_op(const Program& p, int k) {
  Inference inf = infer(p);
  if (!inf.ok()) return std::nullopt;
  const Op& op = p.ops[k];
  const int first = inf.first_result[k], count = result_count(op.kind);
  std::vector<int> substitutes;
  for (int a : op.args)
    if (a >= 0) substitutes.push_back(a);
  for (int v = 0; v < first; ++v)
    if (same_type(inf.values[v], inf.values[first]) &&
        std::find(substitutes.begin(), substitutes.end(), v) == substitutes.end())
      substitutes.push_back(v);
  for (int s : substitutes) {
    Program q = without_op(p, k, first, count, s);
    if (infer(q).ok()) return q;
  }
  return std::nullopt;
}

std::optional<Program> remove_ops(const Program& p, int begin, int end) {
  std::optional<Program> q = p;
  for (int k = end - 1; k >= begin && q; --k) q = remove_op(*q, k);
  return q;
}

// Inputs no op reads and no output returns go; later ids move down.
Program without_unused_inputs(const Program& p) {
  Program q = p;
  for (int i = static_cast<int>(q.inputs.size()) - 1; i >= 0; --i) {
    bool used = std::any_of(q.outputs.begin(), q.outputs.end(),
                            [i](const Output& o) { return o.value == i; });
    for (const Op& op : q.ops)
      used |= std::find(op.args.begin(), op.args.end(), i) != op.args.end();
    if (used) continue;
    q.inputs.erase(q.inputs.begin() + i);
    auto shift = [i](int& id) {
      if (id > i) --id;
    };
    for (Op& op : q.ops)
      for (int& a : op.args) shift(a);
    for (Output& o : q.outputs) shift(o.value);
  }
  return q;
}

std::optional<Program> without_dead_code(const Program& p) {
  std::vector<bool> live = live_ops(p);
  Program q = p;
  for (int k = static_cast<int>(p.ops.size()) - 1; k >= 0; --k) {
    if (live[k]) continue;
    std::optional<Program> r = remove_op(q, k);
    if (!r) return std::nullopt;
    q = *r;
  }
  q = without_unused_inputs(q);
  if (q.ops.size() == p.ops.size() && q.inputs.size() == p.inputs.size()) return std::nullopt;
  return q;
}

size_t size_of(const Program& p) {
  size_t n = p.ops.size() * 100 + p.inputs.size() * 10 + p.outputs.size();
  for (const Op& op : p.ops) n += op.scalars.size();
  for (const InputSpec& in : p.inputs) {
    for (int64_t s : in.sizes) n += static_cast<size_t>(s);
    n += in.requires_grad + (in.layout != Layout::contiguous) + (in.dtype != kFloat32);
  }
  return n;
}

using Candidates = std::vector<Program>;

Candidates output_candidates(const Program& p) {
  Candidates c;
  if (p.outputs.size() < 2) return c;
  for (size_t i = 0; i < p.outputs.size(); ++i) {
    Program q = p;
    q.outputs.erase(q.outputs.begin() + static_cast<std::ptrdiff_t>(i));
    c.push_back(q);
  }
  return c;
}

// Chunks of ops, largest first: halves, quarters, ..., single ops (the last op first).
Candidates removal_candidates(const Program& p) {
  Candidates c;
  const int n = static_cast<int>(p.ops.size());
  for (int chunk = std::max(1, n / 2); n > 0; chunk /= 2) {
    for (int end = n; end - chunk >= 0; end -= chunk)
      if (auto q = remove_ops(p, end - chunk, end)) c.push_back(*q);
    if (chunk == 1) break;
  }
  return c;
}

// A use of an op's result rerouted to one of that op's arguments, and the ops this leaves dead
// removed (a candidate must be smaller).
Candidates bypass_candidates(const Program& p) {
  Candidates c;
  Inference inf = infer(p);
  if (!inf.ok()) return c;
  const int num_inputs = static_cast<int>(p.inputs.size());
  auto producer = [&](int id) {
    for (size_t k = 0; k < p.ops.size(); ++k)
      if (id >= inf.first_result[k] && id < inf.first_result[k] + result_count(p.ops[k].kind))
        return static_cast<int>(k);
    return -1;
  };
  for (size_t k = 0; k < p.ops.size(); ++k) {
    for (size_t a = 0; a < p.ops[k].args.size(); ++a) {
      int v = p.ops[k].args[a];
      if (v < num_inputs) continue;
      int j = producer(v);
      if (j < 0) continue;
      for (int u : p.ops[j].args) {
        if (u < 0 || u == v) continue;
        Program q = p;
        q.ops[k].args[a] = u;
        if (!infer(q).ok()) continue;
        if (auto smaller = without_dead_code(q)) c.push_back(*smaller);
      }
    }
  }
  return c;
}

Candidates input_candidates(const Program& p) {
  Candidates c;
  auto add = [&](Program q) {
    if (infer(q).ok()) c.push_back(std::move(q));
  };
  for (size_t i = 0; i < p.inputs.size(); ++i) {
    const InputSpec& in = p.inputs[i];
    if (in.requires_grad) {
      Program q = p;
      q.inputs[i].requires_grad = false;
      add(q);
    }
    if (in.layout != Layout::contiguous) {
      Program q = p;
      q.inputs[i].layout = Layout::contiguous;
      q.inputs[i].layout_dims.clear();
      add(q);
    }
    if (in.dtype == kFloat64) {
      Program q = p;
      q.inputs[i].dtype = kFloat32;
      add(q);
    }
    for (size_t d = 0; d < in.sizes.size(); ++d) {
      if (in.sizes[d] == 1) continue;
      for (int64_t size : {int64_t{1}, in.sizes[d] / 2}) {
        if (size < 1 || size == in.sizes[d]) continue;
        Program q = p;
        q.inputs[i].sizes[d] = size;
        if (q.inputs[i].layout == Layout::expanded || q.inputs[i].layout == Layout::strided) {
          q.inputs[i].layout = Layout::contiguous;
          q.inputs[i].layout_dims.clear();
        }
        add(q);
      }
    }
  }
  return c;
}

// Host numbers simplified: alpha dropped.
Candidates scalar_candidates(const Program& p) {
  Candidates c;
  for (size_t k = 0; k < p.ops.size(); ++k) {
    OpKind kind = p.ops[k].kind;
    bool alpha =
        kind == OpKind::add || kind == OpKind::sub || kind == OpKind::add_ || kind == OpKind::sub_;
    if (!alpha || p.ops[k].scalars.empty()) continue;
    Program q = p;
    q.ops[k].scalars.clear();
    if (infer(q).ok()) c.push_back(q);
  }
  return c;
}

class Shrinker {
 public:
  Shrinker(const Finding& target, const ShrinkOptions& options)
      : target_(target), options_(options) {
    config_.timeout_seconds = options.timeout_seconds;
    config_.modes.clear();
    if (auto mode = parse_mode(target.mode)) config_.modes = {*mode};
  }

  ShrinkResult run(const Program& failing, const std::vector<Program>& first_candidates) {
    ShrinkResult result;
    result.program = failing;
    result.finding = target_;
    if (auto found = first_failing({failing}, std::nullopt)) {
      result.reproduced = true;
      result.finding = found->second;
    } else {
      result.runs = runs_;
      result.seconds = elapsed();
      return result;
    }
    if (auto found = first_failing(first_candidates, result.program)) {
      result.program = std::move(found->first);
      result.finding = std::move(found->second);
    }
    bool progress = true;
    while (progress && !out_of_budget()) {
      progress = false;
      for (auto pass : {&Shrinker::dead_code_pass, &Shrinker::output_pass, &Shrinker::removal_pass,
                        &Shrinker::bypass_pass, &Shrinker::scalar_pass, &Shrinker::input_pass}) {
        while (!out_of_budget()) {
          Candidates candidates = (this->*pass)(result.program);
          std::optional<std::pair<Program, Finding>> found =
              first_failing(candidates, result.program);
          if (!found) break;
          result.program = std::move(found->first);
          result.finding = std::move(found->second);
          progress = true;
        }
      }
    }
    result.runs = runs_;
    result.seconds = elapsed();
    return result;
  }

 private:
  Candidates dead_code_pass(const Program& p) {
    Candidates c;
    if (auto q = without_dead_code(p)) c.push_back(*q);
    return c;
  }
  Candidates output_pass(const Program& p) { return output_candidates(p); }
  Candidates removal_pass(const Program& p) { return removal_candidates(p); }
  Candidates bypass_pass(const Program& p) { return bypass_candidates(p); }
  Candidates scalar_pass(const Program& p) { return scalar_candidates(p); }
  Candidates input_pass(const Program& p) {
    Candidates c = input_candidates(p);
    Program q = without_unused_inputs(p);
    if (q.inputs.size() < p.inputs.size()) c.insert(c.begin(), q);
    return c;
  }

  // The first candidate (in order) smaller than `current` that fails the same way; candidates
  // run `jobs` at a time.
  // (All of them when `current` is nullopt.)
  std::optional<std::pair<Program, Finding>> first_failing(Candidates candidates,
                                                           const std::optional<Program>& current) {
    if (current) {
      size_t limit = size_of(*current);
      std::erase_if(candidates, [&](const Program& q) { return size_of(q) >= limit; });
    }
    for (size_t begin = 0; begin < candidates.size() && !out_of_budget(); begin += options_.jobs) {
      size_t end = std::min(candidates.size(), begin + static_cast<size_t>(options_.jobs));
      std::vector<Bundle> batch;
      for (size_t i = begin; i < end; ++i) batch.push_back({candidates[i]});
      std::vector<BundleReport> reports = run_bundles(batch, config_, options_.jobs);
      runs_ += static_cast<int>(batch.size());
      for (size_t i = 0; i < batch.size(); ++i)
        for (const Finding& f : reports[i].findings)
          if (f.same_failure(target_)) return std::make_pair(batch[i].front(), f);
    }
    return std::nullopt;
  }

  double elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  bool out_of_budget() const {
    return runs_ >= options_.max_runs || elapsed() >= options_.max_seconds;
  }

  Finding target_;
  ShrinkOptions options_;
  RunConfig config_;
  int runs_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

std::string comment_block(const std::string& text) {
  std::string out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) out += "//   " + line + "\n";
  return out;
}

}  // namespace

ShrinkResult shrink(const Program& failing, const Finding& finding, const ShrinkOptions& options,
                    const std::vector<Program>& first_candidates) {
  return Shrinker(finding, options).run(failing, first_candidates);
}

std::string repro_cpp(const Program& program, const Finding& finding) {
  std::optional<ModeId> mode = parse_mode(finding.mode);
  std::ostringstream os;
  os << "// kiln differential test, program seed " << program.seed << ": "
     << failure_kind_name(finding.kind) << " in mode " << finding.mode
     << (finding.category.empty() ? "" : " (" + finding.category + ")") << "\n";
  os << comment_block(finding.detail);
  os << "#include <iostream>\n#include <kiln/kiln.h>\nusing namespace kiln;\nusing Ts = "
        "std::vector<Tensor>;\n\n";
  os << program_function_cpp(program) << "\n" << make_inputs_cpp(program) << "\n";
  os << "// The harness's loss: sum(output * weight) over the floating outputs that require grad, "
        "with\n"
        "// fixed random weights.\n"
        "Ts loss_weights(const Ts& out) {\n"
        "  const std::vector<uint64_t> weight_seeds = {";
  for (size_t k = 0; k < program.outputs.size(); ++k)
    os << (k ? ", " : "") << program.outputs[k].weight_seed;
  os << "};\n"
        "  Ts weights;\n"
        "  for (size_t k = 0; k < out.size(); ++k) {\n"
        "    manual_seed(weight_seeds[k]);\n"
        "    weights.push_back(rand(out[k].sizes()) * 2 - 1);\n"
        "  }\n"
        "  return weights;\n"
        "}\n\n"
        "Tensor weighted_sum(const Ts& out, const Ts& weights) {\n"
        "  Tensor loss;\n"
        "  for (size_t k = 0; k < out.size(); ++k) {\n"
        "    if (!out[k].is_floating_point() || !out[k].requires_grad()) continue;\n"
        "    Tensor term = (out[k] * weights[k].to(out[k].dtype())).sum();\n"
        "    loss = loss.defined() ? loss + term : term;\n"
        "  }\n"
        "  return loss;\n"
        "}\n\n"
        "// Runs fn on fresh inputs and (unless fn did) the loss's backward; returns the outputs, "
        "the\n"
        "// inputs' gradients and the inputs (in-place writes show there).\n"
        "template <class F>\n"
        "Ts run(F&& fn, bool backward_inside = false) {\n"
        "  Ts in = make_inputs();\n"
        "  Ts out = fn(in);\n"
        "  if (!backward_inside) {\n"
        "    if (Tensor loss = weighted_sum(out, loss_weights(out)); loss.defined()) "
        "loss.backward();\n"
        "  }\n"
        "  Ts result = out;\n"
        "  for (const Tensor& t : in) result.push_back(t.requires_grad() ? t.grad() : Tensor());\n"
        "  for (const Tensor& t : in) result.push_back(t.detach());\n"
        "  return result;\n"
        "}\n\n"
        "bool same(const Tensor& a, const Tensor& b) {\n"
        "  if (!a.defined() || !b.defined()) return a.defined() == b.defined();\n"
        "  if (a.sizes() != b.sizes() || a.dtype() != b.dtype()) return false;\n"
        "  return a.is_floating_point() ? allclose(a, b, 1e-4, 1e-5) : equal(a, b);\n"
        "}\n\n";
  os << "int main() {\n"
        "  Ts expected;\n"
        "  try {\n"
        "    expected = run(program);\n"
        "  } catch (const Error& e) {\n"
        "    std::cout << \"eager raised: \" << e.what() << \"\\n\";\n"
        "  }\n";
  if (mode) {
    std::string call = "run(compiled)";
    if (backward_inside(*mode)) {
      // The harness compiles a training step in this mode (runner.h).
      os << "  Ts weights = loss_weights(program(make_inputs()));\n"
            "  auto step = compile(\n"
            "      [](const Ts& in, const Ts& weights) {\n"
            "        Ts out = program(in);\n"
            "        if (Tensor loss = weighted_sum(out, weights); loss.defined()) "
            "loss.backward();\n"
            "        return out;\n"
            "      },\n"
            "      "
         << compile_options_cpp(*mode) << ");\n";
      call = "run([&](const Ts& in) { return step(in, weights); }, true)";
    } else {
      os << "  auto compiled = compile(program, " << compile_options_cpp(*mode) << ");\n";
    }
    os << "  for (int call = 1; call <= " << calls_per_mode(*mode) << "; ++call) {\n"
       << "    try {\n"
          "      Ts actual = "
       << call
       << ";\n"
          "      for (size_t i = 0; i < actual.size() && i < expected.size(); ++i)\n"
          "        if (!same(actual[i], expected[i]))\n"
          "          std::cout << \"call \" << call << \": result \" << i << \" differs:\\n\" << "
          "actual[i] << \"\\neager:\\n\" << expected[i] << \"\\n\";\n"
          "    } catch (const Error& e) {\n"
          "      std::cout << \"call \" << call << \" raised: \" << e.what() << \"\\n\";\n"
          "    }\n"
          "  }\n";
  }
  os << "}\n";
  return os.str();
}

}  // namespace kiln::differential
