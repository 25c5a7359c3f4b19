// POSIX socket plumbing for socket_util.h. Writes use MSG_NOSIGNAL so a closed peer is an error
// return, never SIGPIPE.
#include "parallel/socket_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "core/error.h"

namespace deltamoe {
namespace {

int poll_ms(Deadline deadline) {
  const double seconds = seconds_until(deadline);
  if (seconds <= 0) return 0;
  return static_cast<int>(std::min(seconds * 1000 + 1, 1000.0));
}

// Waits for `events` on fd until the deadline: 1 ready, 0 timeout, -1 error (errno set).
int wait_for(int fd, short events, Deadline deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, poll_ms(deadline));
    if (n > 0) return 1;
    if (n < 0 && errno != EINTR) return -1;
    if (seconds_until(deadline) <= 0) return 0;
  }
}

bool resolve_ipv4(const std::string& host, int port, sockaddr_in* out, std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &result);
  if (rc != 0 || result == nullptr) {
    *error = str_cat("cannot resolve host '", host, "': ", gai_strerror(rc));
    return false;
  }
  std::memcpy(out, result->ai_addr, sizeof(sockaddr_in));
  ::freeaddrinfo(result);
  return true;
}

}  // namespace

Deadline deadline_after(double seconds) {
  return SteadyClock::now() + std::chrono::duration_cast<SteadyClock::duration>(std::chrono::duration<double>(seconds));
}

double seconds_until(Deadline deadline) {
  return std::chrono::duration<double>(deadline - SteadyClock::now()).count();
}

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.release();
  }
  return *this;
}

int Socket::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

void Socket::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

Socket listen_tcp(int port, std::string* error) {
  Socket socket(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!socket.valid()) {
    *error = std::strerror(errno);
    return Socket();
  }
  int one = 1;
  ::setsockopt(socket.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(socket.fd(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::listen(socket.fd(), 128) != 0) {
    *error = std::strerror(errno);
    return Socket();
  }
  set_nonblocking(socket.fd());
  return socket;
}

int local_port(int fd) {
  sockaddr_in address{};
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  return ntohs(address.sin_port);
}

std::string peer_address(int fd) {
  sockaddr_in address{};
  socklen_t length = sizeof(address);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return "?";
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &address.sin_addr, text, sizeof(text));
  return text;
}

Socket connect_tcp(const std::string& host, int port, Deadline deadline, std::string* error) {
  double pause = 0.02;
  for (;;) {
    sockaddr_in address{};
    if (resolve_ipv4(host, port, &address, error)) {
      Socket socket(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
      set_nonblocking(socket.fd());
      int rc = ::connect(socket.fd(), reinterpret_cast<sockaddr*>(&address), sizeof(address));
      if (rc != 0 && errno == EINPROGRESS) {
        const int ready = wait_for(socket.fd(), POLLOUT, std::min(deadline, deadline_after(5)));
        int socket_error = ETIMEDOUT;
        socklen_t length = sizeof(socket_error);
        if (ready > 0) ::getsockopt(socket.fd(), SOL_SOCKET, SO_ERROR, &socket_error, &length);
        rc = socket_error == 0 ? 0 : -1;
        errno = socket_error;
      }
      if (rc == 0) {
        set_nodelay(socket.fd());
        return socket;
      }
      *error = std::strerror(errno);
    }
    if (seconds_until(deadline) <= 0) return Socket();
    std::this_thread::sleep_for(std::chrono::duration<double>(std::min(pause, std::max(0.0, seconds_until(deadline)))));
    pause = std::min(pause * 2, 1.0);
  }
}

Socket accept_tcp(int listen_fd, Deadline deadline) {
  for (;;) {
    const int ready = wait_for(listen_fd, POLLIN, deadline);
    if (ready <= 0) return Socket();
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      set_nodelay(fd);
      return Socket(fd);
    }
    if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) return Socket();
  }
}

std::string write_all(int fd, const void* data, size_t bytes, Deadline deadline) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      bytes -= n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      const int ready = wait_for(fd, POLLOUT, deadline);
      if (ready == 0) return "timed out";
      if (ready < 0) return std::strerror(errno);
      continue;
    }
    return errno == EPIPE || errno == ECONNRESET ? kPeerClosed : std::strerror(errno);
  }
  return "";
}

std::string read_exact(int fd, void* data, size_t bytes, Deadline deadline) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::recv(fd, p, bytes, 0);
    if (n > 0) {
      p += n;
      bytes -= n;
      continue;
    }
    if (n == 0) return kPeerClosed;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      const int ready = wait_for(fd, POLLIN, deadline);
      if (ready == 0) return "timed out";
      if (ready < 0) return std::strerror(errno);
      continue;
    }
    return errno == ECONNRESET ? kPeerClosed : std::strerror(errno);
  }
  return "";
}

std::string write_frame(int fd, uint32_t type, std::string_view payload, Deadline deadline) {
  CHECK(payload.size() <= kMaxFramePayload, "control message of ", payload.size(), " bytes is over the ",
        kMaxFramePayload, "-byte limit");
  std::string frame(8 + payload.size(), '\0');
  const uint32_t length = static_cast<uint32_t>(payload.size());
  std::memcpy(frame.data(), &type, 4);
  std::memcpy(frame.data() + 4, &length, 4);
  std::memcpy(frame.data() + 8, payload.data(), payload.size());
  return write_all(fd, frame.data(), frame.size(), deadline);
}

std::optional<Frame> read_frame(int fd, Deadline deadline, std::string* error) {
  uint32_t head[2];
  *error = read_exact(fd, head, 8, deadline);
  if (!error->empty()) return std::nullopt;
  if (head[1] > kMaxFramePayload) {
    *error = str_cat("frame of ", head[1], " bytes is over the limit (not a deltamoe peer?)");
    return std::nullopt;
  }
  Frame frame;
  frame.type = head[0];
  frame.payload.resize(head[1]);
  *error = read_exact(fd, frame.payload.data(), head[1], deadline);
  if (!error->empty()) return std::nullopt;
  return frame;
}

std::string FrameReader::read_available(int fd) {
  char chunk[65536];
  for (;;) {
    const ssize_t n = ::recv(fd, chunk, sizeof(chunk), 0);
    if (n > 0) {
      buffer_.append(chunk, n);
      continue;
    }
    if (n == 0) return kPeerClosed;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return "";
    return errno == ECONNRESET ? kPeerClosed : std::strerror(errno);
  }
}

std::optional<Frame> FrameReader::next() {
  if (buffer_.size() - offset_ < 8) return std::nullopt;
  uint32_t head[2];
  std::memcpy(head, buffer_.data() + offset_, 8);
  CHECK(head[1] <= kMaxFramePayload, "control message of ", head[1], " bytes is over the limit");
  if (buffer_.size() - offset_ < 8 + head[1]) return std::nullopt;
  Frame frame;
  frame.type = head[0];
  frame.payload.assign(buffer_.data() + offset_ + 8, head[1]);
  offset_ += 8 + head[1];
  if (offset_ == buffer_.size()) {
    buffer_.clear();
    offset_ = 0;
  }
  return frame;
}

WireWriter& WireWriter::raw(const void* p, size_t n) {
  bytes_.append(static_cast<const char*>(p), n);
  return *this;
}

WireWriter& WireWriter::str(std::string_view s) {
  u32(static_cast<uint32_t>(s.size()));
  bytes_.append(s.data(), s.size());
  return *this;
}

void WireReader::take(void* out, size_t n) {
  CHECK(bytes_.size() - offset_ >= n, "malformed ", what_, ": ends after ", bytes_.size(), " bytes");
  std::memcpy(out, bytes_.data() + offset_, n);
  offset_ += n;
}

uint32_t WireReader::u32() {
  uint32_t v;
  take(&v, 4);
  return v;
}
int32_t WireReader::i32() {
  int32_t v;
  take(&v, 4);
  return v;
}
uint64_t WireReader::u64() {
  uint64_t v;
  take(&v, 8);
  return v;
}
double WireReader::f64() {
  double v;
  take(&v, 8);
  return v;
}
std::string WireReader::str() {
  const uint32_t n = u32();
  CHECK(bytes_.size() - offset_ >= n, "malformed ", what_, ": a string of ", n, " bytes runs past the end");
  std::string s(bytes_.substr(offset_, n));
  offset_ += n;
  return s;
}

}  // namespace deltamoe
