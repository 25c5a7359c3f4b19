// Small POSIX TCP helpers for the rendezvous, the control plane and TcpComm's data connections:
// an owning fd, listen/connect with deadlines, exact reads and writes on nonblocking sockets, and
// length-prefixed frames with a bounds-checked encoder/decoder. IPv4 only.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace deltamoe {

using SteadyClock = std::chrono::steady_clock;
using Deadline = SteadyClock::time_point;

Deadline deadline_after(double seconds);
double seconds_until(Deadline deadline);  // negative once passed

// Owns a file descriptor.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { reset(); }
  Socket(Socket&& other) noexcept : fd_(other.release()) {}
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  void reset();

 private:
  int fd_ = -1;
};

// Listens on all interfaces at `port` (0: an ephemeral port). On failure returns an invalid socket
// and the reason in *error ("address in use", ...).
Socket listen_tcp(int port, std::string* error);
int local_port(int fd);
// Dotted IPv4 address of the other end / of this end of a connected socket.
std::string peer_address(int fd);

// Connects to host:port, retrying (refused, unreachable, unresolvable) with growing pauses until the
// deadline. Returns an invalid socket and the last reason in *error when the deadline passes.
Socket connect_tcp(const std::string& host, int port, Deadline deadline, std::string* error);

// Accepts one connection, waiting until the deadline; invalid socket on timeout.
Socket accept_tcp(int listen_fd, Deadline deadline);

void set_nonblocking(int fd);
void set_nodelay(int fd);

// What the transfers below return when the peer closed or reset the connection.
inline constexpr const char* kPeerClosed = "connection closed by the peer";

// Exact transfers on a nonblocking socket. Return "" on success, else the reason (kPeerClosed,
// "timed out", strerror text).
std::string write_all(int fd, const void* data, size_t bytes, Deadline deadline);
std::string read_exact(int fd, void* data, size_t bytes, Deadline deadline);

// Frames: [u32 type][u32 payload length][payload]. Payloads are limited to 64 MiB.
inline constexpr uint32_t kMaxFramePayload = 64u << 20;
std::string write_frame(int fd, uint32_t type, std::string_view payload, Deadline deadline);
struct Frame {
  uint32_t type = 0;
  std::string payload;
};
// Reads one whole frame; nullopt and *error on failure or timeout.
std::optional<Frame> read_frame(int fd, Deadline deadline, std::string* error);

// Incremental frame parsing for a poll loop: feed what read() returned, take complete frames.
class FrameReader {
 public:
  // Reads what is available without blocking. Returns "" while the connection is fine, else the
  // reason it ended (kPeerClosed, strerror text, oversized frame).
  std::string read_available(int fd);
  std::optional<Frame> next();

 private:
  std::string buffer_;
  size_t offset_ = 0;
};

// Little encoder / decoder for control-plane payloads (host byte order; the rendezvous magic
// catches a mismatch).
class WireWriter {
 public:
  WireWriter& u32(uint32_t v) { return raw(&v, 4); }
  WireWriter& i32(int32_t v) { return raw(&v, 4); }
  WireWriter& u64(uint64_t v) { return raw(&v, 8); }
  WireWriter& f64(double v) { return raw(&v, 8); }
  WireWriter& str(std::string_view s);
  const std::string& bytes() const { return bytes_; }

 private:
  WireWriter& raw(const void* p, size_t n);
  std::string bytes_;
};

class WireReader {
 public:
  // `what` names the message in errors ("hello from 10.0.0.2").
  WireReader(std::string_view bytes, std::string what) : bytes_(bytes), what_(std::move(what)) {}
  uint32_t u32();
  int32_t i32();
  uint64_t u64();
  double f64();
  std::string str();
  bool done() const { return offset_ == bytes_.size(); }

 private:
  void take(void* out, size_t n);
  std::string_view bytes_;
  std::string what_;
  size_t offset_ = 0;
};

}  // namespace deltamoe
