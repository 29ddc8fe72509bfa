#include "distributed/socket_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "kiln/distributed.h"

namespace kiln::distributed::socket_util {
namespace {

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() {
    if (list) freeaddrinfo(list);
  }
};

void resolve(AddrInfo& out, const std::string& host, int port, bool passive, const std::string& who) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  std::string service = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &out.list);
  if (rc != 0)
    throw DistributedError(fmt::format("{} cannot resolve host '{}': {}.", who, host, gai_strerror(rc)));
}

}  // namespace

int listen_on(const std::string& host, int port, const std::string& who) {
  AddrInfo ai;
  resolve(ai, host, port, true, who);
  std::string last_error = "no address";
  for (addrinfo* a = ai.list; a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 512) == 0) return fd;
    last_error = std::strerror(errno);
    ::close(fd);
  }
  throw DistributedError(fmt::format("{} cannot listen on {}:{}: {}. Another job may use this port: set "
                                     "MASTER_PORT to a free one.",
                                     who, host, port, last_error));
}

int local_port(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return 0;
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return 0;
}

int connect_with_retry(const std::string& host, int port, std::chrono::milliseconds timeout, const std::string& who) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string last_error;
  for (;;) {
    AddrInfo ai;
    resolve(ai, host, port, false, who);
    for (addrinfo* a = ai.list; a; a = a->ai_next) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        return fd;
      }
      last_error = std::strerror(errno);
      ::close(fd);
    }
    if (std::chrono::steady_clock::now() >= deadline)
      throw DistributedError(fmt::format("{} cannot connect to {}:{} within {} s: {}. Is rank 0 running, and are "
                                         "MASTER_ADDR and MASTER_PORT the same on every rank?",
                                         who, host, port, timeout.count() / 1000.0, last_error));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

bool is_loopback(const std::string& host) {
  if (host == "localhost") return true;
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return false;
}

std::string local_address_towards(const std::string& peer) {
  if (is_loopback(peer)) return "127.0.0.1";
  AddrInfo ai;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  if (getaddrinfo(peer.c_str(), "9", &hints, &ai.list) != 0 || !ai.list) return "127.0.0.1";
  // A UDP "connect" sends nothing: it only asks the kernel which interface would route there.
  int fd = ::socket(ai.list->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "127.0.0.1";
  std::string result = "127.0.0.1";
  if (::connect(fd, ai.list->ai_addr, ai.list->ai_addrlen) == 0) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    char text[INET6_ADDRSTRLEN] = {};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      const void* raw = addr.ss_family == AF_INET
                            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&addr)->sin_addr)
                            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&addr)->sin6_addr);
      if (inet_ntop(addr.ss_family, raw, text, sizeof(text))) result = text;
    }
  }
  ::close(fd);
  return result;
}

int free_port() {
  int fd = listen_on("127.0.0.1", 0, "[kiln launch]");
  int port = local_port(fd);
  ::close(fd);
  return port;
}

}  // namespace kiln::distributed::socket_util
