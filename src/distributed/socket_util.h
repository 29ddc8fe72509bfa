// TCP helpers shared by the rendezvous store and the launcher: listen, connect with retries, and
// the local address peers can reach this host by.
#pragma once

#include <chrono>
#include <string>

namespace kiln::distributed::socket_util {

// A listening, non-blocking, close-on-exec socket on host:port (port 0: any free port).
// `who` prefixes error messages. Throws DistributedError.
int listen_on(const std::string& host, int port, const std::string& who);
int local_port(int fd);
// A blocking, close-on-exec connection to host:port, retried until `timeout` while nobody listens
// yet (the server may start after its clients). Throws DistributedError naming host:port.
int connect_with_retry(const std::string& host, int port, std::chrono::milliseconds timeout, const std::string& who);
// The address of this host's interface that routes to `peer` ("127.0.0.1" for a loopback peer).
std::string local_address_towards(const std::string& peer);
bool is_loopback(const std::string& host);
// A free TCP port on the loopback interface (bound and released: a launcher hands it to rank 0).
int free_port();

}  // namespace kiln::distributed::socket_util
