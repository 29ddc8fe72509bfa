// The backend registry and the two debug backends (DESIGN §2.5, spec §4.3).
//
//   eager      runs the captured graph op by op through the eager dispatcher. If a program fails
//              with it, the capture is at fault.
//   aot_eager  first runs the graph machinery the code generator builds on — validation (every
//              node's meta re-run on the recorded metadata), dead-code elimination and common
//              subexpression elimination — then runs op by op. If eager works and aot_eager does
//              not, the graph passes are at fault. Tagged "aot_autograd": a forward it compiles
//              saves only what the backward cannot recompute (capture/recompute.cpp).
#include <algorithm>
#include <map>
#include <mutex>

#include "compiler/capture/runtime.h"
#include "compiler/graph/pipeline.h"

namespace kiln::compiler {

namespace {

struct Registered {
  BackendFn fn;
  std::vector<std::string> tags;
};

struct Registry {
  std::mutex mutex;
  std::map<std::string, Registered> backends;
  std::string default_backend = "kiln";
};

Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry;  // never destroyed: compiled callables may outlive static destructors
    reg->backends["eager"] = {[](Graph& g, const Arguments&) { return interpreter(g); }, {"debug"}};
    reg->backends["aot_eager"] = {[](Graph& g, const Arguments&) {
                                    passes::run_aot_eager_pipeline(g);  // compiler/graph/pipeline.cpp
                                    return interpreter(g);
                                  },
                                  {"debug", "aot_autograd"}};
    return reg;
  }();
  return *r;
}

}  // namespace

void register_backend(std::string name, BackendFn fn, std::vector<std::string> tags) {
  KILN_CHECK(!name.empty(), ValueError, "[kiln::compiler::register_backend] the backend name is empty.");
  KILN_CHECK(static_cast<bool>(fn), ValueError,
             "[kiln::compiler::register_backend] the backend function for '" + name + "' is empty.");
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  KILN_CHECK(!r.backends.count(name), ValueError,
             "[kiln::compiler::register_backend] duplicate name: " + name + ". Pick another name.");
  r.backends[name] = {std::move(fn), std::move(tags)};
}

std::vector<std::string> list_backends(const std::vector<std::string>& exclude_tags) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  std::vector<std::string> out;
  for (const auto& [name, b] : r.backends) {
    bool excluded = std::any_of(b.tags.begin(), b.tags.end(), [&](const std::string& t) {
      return std::find(exclude_tags.begin(), exclude_tags.end(), t) != exclude_tags.end();
    });
    if (!excluded) out.push_back(name);
  }
  return out;
}

BackendFn lookup_backend(std::string_view name) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  auto it = r.backends.find(std::string(name));
  if (it == r.backends.end()) {
    throw CompileError("[kiln::compile] Invalid backend: '" + std::string(name) +
                       "', see kiln::compiler::list_backends() for available backends.");
  }
  return it->second.fn;
}

namespace detail {
bool backend_has_tag(std::string_view name, std::string_view tag) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  auto it = r.backends.find(std::string(name));
  return it != r.backends.end() && std::find(it->second.tags.begin(), it->second.tags.end(), tag) != it->second.tags.end();
}
}  // namespace detail

std::string default_backend() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  return r.default_backend;
}

void set_default_backend(std::string name) {
  lookup_backend(name);
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.default_backend = std::move(name);
}

}  // namespace kiln::compiler
