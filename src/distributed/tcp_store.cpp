// The rendezvous store: a key-value server on one thread of rank 0's process, and a blocking
// client per process. Framing is length-prefixed binary; the server never trusts a message: a
// length past its limits or an unknown command closes that connection.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "distributed/socket_util.h"
#include "kiln/distributed.h"

namespace kiln::distributed {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

enum class Command : uint8_t { hello = 1, set, get, add, check, wait, erase, lost, bye };

constexpr size_t kMaxKeyBytes = 4096;
constexpr size_t kMaxValueBytes = size_t(64) << 20;
constexpr uint32_t kMaxKeysPerWait = 4096;
// Before a client has presented the token it may send only a hello: at most this many bytes are
// buffered for it, so strangers cannot make the server hold large buffers.
constexpr size_t kMaxUnauthenticatedBytes = kMaxKeyBytes + 64;
constexpr size_t kMaxConnections = 4096;
constexpr size_t kMaxMessageBytes = kMaxValueBytes + kMaxKeyBytes + 64;  // a set of the largest value

// ---- message building and parsing ----

struct Writer {
  std::vector<uint8_t> bytes;
  template <class T> void pod(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof(T));
  }
  void blob(const void* data, size_t n) {
    pod<uint64_t>(n);
    const auto* p = static_cast<const uint8_t*>(data);
    bytes.insert(bytes.end(), p, p + n);
  }
  void str(const std::string& s) { blob(s.data(), s.size()); }
};

// Reads from a buffer that may hold only part of a message: every read says whether the bytes
// were there; `bad` marks a message that breaks the limits.
struct Reader {
  const uint8_t* p;
  size_t n;
  size_t at = 0;
  bool bad = false;
  template <class T> bool pod(T& v) {
    if (n - at < sizeof(T)) return false;
    std::memcpy(&v, p + at, sizeof(T));
    at += sizeof(T);
    return true;
  }
  bool blob(std::vector<uint8_t>& out, size_t limit) {
    uint64_t len = 0;
    if (!pod(len)) return false;
    if (len > limit) {
      bad = true;
      return false;
    }
    if (n - at < len) return false;
    out.assign(p + at, p + at + len);
    at += len;
    return true;
  }
  bool str(std::string& out, size_t limit = kMaxKeyBytes) {
    std::vector<uint8_t> b;
    if (!blob(b, limit)) return false;
    out.assign(b.begin(), b.end());
    return true;
  }
};

bool same_token(const std::string& a, const std::string& b) {
  // Constant time in the content: a local attacker cannot learn the token byte by byte.
  unsigned diff = a.size() != b.size();
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i)
    diff |= unsigned(i < a.size() ? a[i] : 0) ^ unsigned(i < b.size() ? b[i] : 0);
  return diff == 0;
}

std::optional<std::string> token_from_env() {
  if (const char* t = std::getenv("KILN_STORE_TOKEN"); t && *t) return std::string(t);
  return std::nullopt;
}

// ---- the server ----

class StoreServer {
 public:
  StoreServer(const std::string& host, int port, std::optional<std::string> token)
      : token_(std::move(token)) {
    listen_fd_ = socket_util::listen_on(host, port, "[kiln::distributed::TcpStore]");
    port_ = socket_util::local_port(listen_fd_);
    if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
      ::close(listen_fd_);
      throw DistributedError(fmt::format("[kiln::distributed::TcpStore] pipe: {}", std::strerror(errno)));
    }
    thread_ = std::thread([this] { loop(); });
  }
  ~StoreServer() {
    running_ = false;
    char c = 1;
    [[maybe_unused]] ssize_t r = ::write(wake_[1], &c, 1);
    thread_.join();
    for (auto& [fd, conn] : conns_) ::close(fd);
    ::close(listen_fd_);
    ::close(wake_[0]);
    ::close(wake_[1]);
  }
  int port() const { return port_; }

 private:
  struct Conn {
    std::vector<uint8_t> in, out;
    bool authed = false;
    bool said_bye = false;
    int rank = -1;
    // A wait that is not satisfied yet: the connection reads nothing more until it is answered.
    std::vector<std::string> waiting_for;
    Clock::time_point deadline;
    bool waiting = false;
  };

  void loop() {
    while (running_) {
      std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
      for (auto& [fd, c] : conns_)
        fds.push_back({fd, short((c.waiting ? 0 : POLLIN) | (c.out.empty() ? 0 : POLLOUT)), 0});
      int timeout_ms = 1000;
      auto now = Clock::now();
      for (auto& [fd, c] : conns_)
        if (c.waiting)
          timeout_ms = std::min<int64_t>(
              timeout_ms, std::max<int64_t>(0, std::chrono::duration_cast<milliseconds>(c.deadline - now).count() + 1));
      if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) break;
      if (!running_) break;
      if (fds[0].revents & POLLIN) accept_clients();
      for (size_t i = 2; i < fds.size(); ++i) {
        int fd = fds[i].fd;
        auto it = conns_.find(fd);
        if (it == conns_.end()) continue;
        bool alive = true;
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) alive = read_from(fd, it->second);
        if (alive && (fds[i].revents & POLLOUT)) alive = flush(fd, it->second);
        if (!alive) drop(fd);
      }
      answer_waits();
    }
  }

  void accept_clients() {
    for (;;) {
      int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      if (conns_.size() >= kMaxConnections) {  // a flood of connections: refuse, keep serving
        ::close(fd);
        continue;
      }
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      conns_[fd].authed = !token_.has_value();
    }
  }

  void drop(int fd) {
    auto it = conns_.find(fd);
    if (it->second.rank >= 0 && !it->second.said_bye) lost_.insert(it->second.rank);
    ::close(fd);
    conns_.erase(it);
  }

  bool read_from(int fd, Conn& c) {
    uint8_t buf[65536];
    for (;;) {
      ssize_t r = ::recv(fd, buf, sizeof(buf), 0);
      if (r == 0) return false;
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        return false;
      }
      c.in.insert(c.in.end(), buf, buf + r);
      if (!c.authed && c.in.size() > kMaxUnauthenticatedBytes) return false;
      if (c.in.size() > kMaxMessageBytes) break;  // handle what is there first
    }
    if (!handle_buffered(c) || c.in.size() > kMaxMessageBytes) return false;
    return flush(fd, c);
  }

  // Handles the complete messages buffered for `c`, up to a wait that parks it. False: the
  // connection must close.
  bool handle_buffered(Conn& c) {
    while (!c.waiting) {
      Reader rd{c.in.data(), c.in.size()};
      int handled = handle(rd, c);
      if (handled < 0) return false;
      if (handled == 0) break;
      c.in.erase(c.in.begin(), c.in.begin() + rd.at);
    }
    return true;
  }

  bool flush(int fd, Conn& c) {
    while (!c.out.empty()) {
      ssize_t w = ::send(fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (w < 0) {
        if (errno == EINTR) continue;
        return errno == EAGAIN || errno == EWOULDBLOCK;
      }
      c.out.erase(c.out.begin(), c.out.begin() + w);
    }
    return true;
  }

  // 1: one message handled; 0: incomplete; -1: the connection must close.
  int handle(Reader& rd, Conn& c) {
    uint8_t raw = 0;
    if (!rd.pod(raw)) return 0;
    auto cmd = Command(raw);
    Writer w;
    if (!c.authed && cmd != Command::hello) return -1;
    switch (cmd) {
      case Command::hello: {
        std::string token;
        int32_t rank = -1;
        if (!rd.str(token) || !rd.pod(rank)) return rd.bad ? -1 : 0;
        if (token_ && !same_token(*token_, token)) return -1;
        c.authed = true;
        c.rank = rank;
        w.pod<uint8_t>(0);
        break;
      }
      case Command::set: {
        std::string key;
        std::vector<uint8_t> value;
        if (!rd.str(key) || !rd.blob(value, kMaxValueBytes)) return rd.bad ? -1 : 0;
        data_[key] = std::move(value);
        w.pod<uint8_t>(0);
        break;
      }
      case Command::get: {
        std::string key;
        if (!rd.str(key)) return rd.bad ? -1 : 0;
        auto it = data_.find(key);
        w.pod<uint8_t>(it != data_.end());
        if (it != data_.end()) w.blob(it->second.data(), it->second.size());
        break;
      }
      case Command::add: {
        std::string key;
        int64_t delta = 0;
        if (!rd.str(key) || !rd.pod(delta)) return rd.bad ? -1 : 0;
        int64_t value = 0;
        if (auto it = data_.find(key); it != data_.end() && it->second.size() == sizeof(int64_t))
          std::memcpy(&value, it->second.data(), sizeof(value));
        value += delta;
        auto& slot = data_[key];
        slot.resize(sizeof(value));
        std::memcpy(slot.data(), &value, sizeof(value));
        w.pod<int64_t>(value);
        break;
      }
      case Command::check:
      case Command::wait: {
        uint32_t count = 0;
        if (!rd.pod(count)) return 0;
        if (count > kMaxKeysPerWait) return -1;
        std::vector<std::string> keys(count);
        for (auto& k : keys)
          if (!rd.str(k)) return rd.bad ? -1 : 0;
        int64_t timeout_ms = 0;
        if (cmd == Command::wait && !rd.pod(timeout_ms)) return 0;
        if (cmd == Command::check) {
          w.pod<uint8_t>(all_present(keys));
          break;
        }
        c.waiting_for = std::move(keys);
        c.deadline = Clock::now() + milliseconds(std::max<int64_t>(0, timeout_ms));
        c.waiting = true;  // answer_waits replies, now or when the keys come
        return 1;
      }
      case Command::erase: {
        std::string key;
        if (!rd.str(key)) return rd.bad ? -1 : 0;
        w.pod<uint8_t>(data_.erase(key) > 0);
        break;
      }
      case Command::lost: {
        w.pod<uint32_t>(uint32_t(lost_.size()));
        for (int r : lost_) w.pod<int32_t>(r);
        break;
      }
      case Command::bye:
        c.said_bye = true;
        w.pod<uint8_t>(0);
        break;
      default:
        return -1;
    }
    c.out.insert(c.out.end(), w.bytes.begin(), w.bytes.end());
    return 1;
  }

  bool all_present(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data_.count(k) > 0; });
  }

  void answer_waits() {
    auto now = Clock::now();
    std::vector<int> resumed;
    for (auto& [fd, c] : conns_) {
      if (!c.waiting) continue;
      bool ready = all_present(c.waiting_for);
      if (!ready && now < c.deadline) continue;
      c.waiting = false;
      c.waiting_for.clear();
      c.out.push_back(ready ? 0 : 1);
      resumed.push_back(fd);
    }
    // A resumed connection may have more requests buffered behind its wait.
    for (int fd : resumed) {
      auto it = conns_.find(fd);
      if (it == conns_.end()) continue;
      if (!handle_buffered(it->second) || !flush(fd, it->second)) drop(fd);
    }
  }

  std::optional<std::string> token_;
  int listen_fd_ = -1;
  int port_ = 0;
  int wake_[2] = {-1, -1};
  std::atomic<bool> running_{true};
  std::thread thread_;
  std::map<int, Conn> conns_;
  std::map<std::string, std::vector<uint8_t>> data_;
  std::set<int> lost_;
};

}  // namespace

// ---- the client ----

struct TcpStore::Impl {
  Options options;
  std::unique_ptr<StoreServer> server;
  std::mutex mutex;  // one request at a time on the connection
  int fd = -1;
  std::string where;

  void send_all(const std::vector<uint8_t>& bytes) {
    size_t off = 0;
    while (off < bytes.size()) {
      ssize_t w = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) throw lost_server(std::strerror(errno));
      off += size_t(w);
    }
  }

  void recv_all(void* dst, size_t n, milliseconds limit) {
    auto* p = static_cast<uint8_t*>(dst);
    auto deadline = Clock::now() + limit;
    while (n > 0) {
      auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
      if (left <= 0)
        throw DistributedError(fmt::format("[kiln::distributed::TcpStore] the store at {} did not answer within "
                                           "{} s.",
                                           where, limit.count() / 1000.0));
      pollfd pfd{fd, POLLIN, 0};
      int pr = ::poll(&pfd, 1, int(std::min<int64_t>(left, 1000)));
      if (pr < 0 && errno != EINTR) throw lost_server(std::strerror(errno));
      if (pr <= 0) continue;
      ssize_t r = ::recv(fd, p, n, 0);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) throw lost_server(r == 0 ? "connection closed" : std::strerror(errno));
      p += r;
      n -= size_t(r);
    }
  }
  template <class T> T recv_pod(milliseconds limit) {
    T v{};
    recv_all(&v, sizeof(v), limit);
    return v;
  }
  DistributedError lost_server(const std::string& why) const {
    return DistributedError(fmt::format(
        "[kiln::distributed::TcpStore] lost the rendezvous store at {} ({}). The store runs in rank 0's "
        "process: rank 0 exited or crashed, or refused this client's KILN_STORE_TOKEN.",
        where, why));
  }
  milliseconds reply_limit() const { return options.timeout + std::chrono::seconds(30); }
};

TcpStore::TcpStore(const Options& options) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.options = options;
  if (!s.options.token) s.options.token = token_from_env();
  if (options.port < 0 || options.port > 65535 || (options.port == 0 && !options.is_server))
    throw ValueError(fmt::format("[kiln::distributed::TcpStore] port {} is out of range.", options.port));
  if (options.timeout.count() <= 0) throw ValueError("[kiln::distributed::TcpStore] the timeout must be positive.");
  int port = options.port;
  if (options.is_server) {
    s.server = std::make_unique<StoreServer>(options.host, options.port, s.options.token);
    port = s.server->port();
  }
  s.options.port = port;
  s.where = fmt::format("{}:{}", options.host, port);
  s.fd = socket_util::connect_with_retry(options.host, port, options.timeout, "[kiln::distributed::TcpStore]");
  Writer w;
  w.pod(uint8_t(Command::hello));
  w.str(s.options.token.value_or(""));
  w.pod<int32_t>(options.rank);
  s.send_all(w.bytes);
  s.recv_pod<uint8_t>(s.reply_limit());
}

TcpStore::~TcpStore() {
  if (impl_->fd >= 0) {
    try {
      std::lock_guard lock(impl_->mutex);
      Writer w;
      w.pod(uint8_t(Command::bye));
      impl_->send_all(w.bytes);
      impl_->recv_pod<uint8_t>(milliseconds(2000));
    } catch (const Error&) {
      // the server is gone already; nothing to tell it
    }
    ::close(impl_->fd);
  }
}

void TcpStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  if (key.size() > kMaxKeyBytes || value.size() > kMaxValueBytes)
    throw ValueError("[kiln::distributed::TcpStore] keys hold at most 4 KiB and values 64 MiB.");
  std::lock_guard lock(impl_->mutex);
  Writer w;
  w.pod(uint8_t(Command::set));
  w.str(key);
  w.blob(value.data(), value.size());
  impl_->send_all(w.bytes);
  impl_->recv_pod<uint8_t>(impl_->reply_limit());
}

void TcpStore::set(const std::string& key, const std::string& value) {
  set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::vector<uint8_t> TcpStore::get(const std::string& key) {
  wait({key});
  std::lock_guard lock(impl_->mutex);
  Writer w;
  w.pod(uint8_t(Command::get));
  w.str(key);
  impl_->send_all(w.bytes);
  if (!impl_->recv_pod<uint8_t>(impl_->reply_limit()))
    throw DistributedError(fmt::format("[kiln::distributed::TcpStore] key '{}' was deleted while waiting.", key));
  auto len = impl_->recv_pod<uint64_t>(impl_->reply_limit());
  if (len > kMaxValueBytes) throw impl_->lost_server("a reply longer than any value");
  std::vector<uint8_t> value(len);
  impl_->recv_all(value.data(), len, impl_->reply_limit());
  return value;
}

std::string TcpStore::get_string(const std::string& key) {
  auto v = get(key);
  return std::string(v.begin(), v.end());
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  std::lock_guard lock(impl_->mutex);
  Writer w;
  w.pod(uint8_t(Command::add));
  w.str(key);
  w.pod(delta);
  impl_->send_all(w.bytes);
  return impl_->recv_pod<int64_t>(impl_->reply_limit());
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  std::lock_guard lock(impl_->mutex);
  Writer w;
  w.pod(uint8_t(Command::check));
  w.pod<uint32_t>(uint32_t(keys.size()));
  for (const auto& k : keys) w.str(k);
  impl_->send_all(w.bytes);
  return impl_->recv_pod<uint8_t>(impl_->reply_limit()) != 0;
}

void TcpStore::wait(const std::vector<std::string>& keys, std::optional<milliseconds> timeout) {
  if (keys.size() > kMaxKeysPerWait) throw ValueError("[kiln::distributed::TcpStore] at most 4096 keys per wait.");
  milliseconds limit = timeout.value_or(impl_->options.timeout);
  std::lock_guard lock(impl_->mutex);
  Writer w;
  w.pod(uint8_t(Command::wait));
  w.pod<uint32_t>(uint32_t(keys.size()));
  for (const auto& k : keys) w.str(k);
  w.pod<int64_t>(limit.count());
  impl_->send_all(w.bytes);
  if (impl_->recv_pod<uint8_t>(limit + std::chrono::seconds(30)) != 0) {
    std::string names;
    for (const auto& k : keys) names += (names.empty() ? "'" : ", '") + k + "'";
    throw DistributedError(fmt::format("[kiln::distributed::TcpStore] timed out after {} s waiting for {} at {}.",
                                       limit.count() / 1000.0, names, impl_->where));
  }
}

bool TcpStore::delete_key(const std::string& key) {
  std::lock_guard lock(impl_->mutex);
  Writer w;
  w.pod(uint8_t(Command::erase));
  w.str(key);
  impl_->send_all(w.bytes);
  return impl_->recv_pod<uint8_t>(impl_->reply_limit()) != 0;
}

std::vector<int> TcpStore::lost_ranks() {
  std::lock_guard lock(impl_->mutex);
  Writer w;
  w.pod(uint8_t(Command::lost));
  impl_->send_all(w.bytes);
  auto n = impl_->recv_pod<uint32_t>(impl_->reply_limit());
  if (n > 1u << 20) throw impl_->lost_server("a reply with too many ranks");
  std::vector<int> ranks(n);
  for (auto& r : ranks) r = impl_->recv_pod<int32_t>(impl_->reply_limit());
  return ranks;
}

int TcpStore::port() const { return impl_->options.port; }
milliseconds TcpStore::timeout() const { return impl_->options.timeout; }

}  // namespace kiln::distributed
