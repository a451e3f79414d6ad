// Frames, socket options and deadline-bound socket calls of the TCP control channel.
#include "transport/control/control_wire.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace commsched::control {

namespace {

void put_u32(char* out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
}

void put_u64(char* out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
}

uint32_t get_u32(const char* in) {
  uint32_t value = 0;
  for (int i = 3; i >= 0; --i) value = (value << 8) | static_cast<uint8_t>(in[i]);
  return value;
}

uint64_t get_u64(const char* in) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | static_cast<uint8_t>(in[i]);
  return value;
}

std::string hex(uint32_t value) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08x", value);
  return text;
}

void set_option(int fd, int level, int name, int value, const char* what) {
  if (setsockopt(fd, level, name, &value, sizeof(value)) != 0) {
    throw CommError(std::string("control channel: setsockopt(") + what + ") failed: " + std::strerror(errno));
  }
}

// Waits for `events` on `fd` until `deadline`: false on timeout.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  while (true) {
    pollfd entry{fd, events, 0};
    const int timeout_ms = poll_timeout_ms(deadline);
    const int ready = poll(&entry, 1, timeout_ms);
    if (ready > 0) return true;
    if (ready < 0 && errno != EINTR) throw CommError(std::string("control channel: poll failed: ") + std::strerror(errno));
    if (ready == 0 && Clock::now() >= deadline) return false;
  }
}

}  // namespace

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string encode_hello(const Hello& hello) {
  std::string out(kHelloBytes, '\0');
  put_u32(&out[0], kHelloMagic);
  put_u32(&out[4], kWireVersion);
  put_u64(&out[8], hello.token);
  put_u32(&out[16], hello.rank);
  put_u32(&out[20], hello.size);
  return out;
}

Hello decode_hello(const char* bytes) {
  const uint32_t magic = get_u32(bytes);
  if (magic != kHelloMagic) throw CommError("not a commsched control hello (magic " + hex(magic) + ")");
  const uint32_t version = get_u32(bytes + 4);
  if (version != kWireVersion) {
    throw CommError("control hello of wire version " + std::to_string(version) + ", this rank speaks " +
                    std::to_string(kWireVersion) + ": every rank must run the same commsched");
  }
  return Hello{get_u64(bytes + 8), get_u32(bytes + 16), get_u32(bytes + 20)};
}

std::string encode_ack(uint32_t rank, uint64_t token) {
  std::string out(kAckBytes, '\0');
  put_u32(&out[0], kAckMagic);
  put_u32(&out[4], rank);
  put_u64(&out[8], token);
  return out;
}

bool ack_matches(const char* bytes, uint32_t rank, uint64_t token) {
  return get_u32(bytes) == kAckMagic && get_u32(bytes + 4) == rank && get_u64(bytes + 8) == token;
}

void encode_frame_header(uint32_t round, uint32_t length, char* out) {
  put_u32(out, kFrameMagic);
  put_u32(out + 4, round);
  put_u32(out + 8, length);
}

FrameHeader decode_frame_header(const char* bytes, int peer) {
  const uint32_t magic = get_u32(bytes);
  if (magic != kFrameMagic) {
    throw PeerLost("control channel: malformed frame from rank " + std::to_string(peer) + " (magic " + hex(magic) +
                       ", expected " + hex(kFrameMagic) + "); refused",
                   peer);
  }
  FrameHeader header{get_u32(bytes + 4), get_u32(bytes + 8)};
  if (header.length > kMaxFrameBytes) {
    throw PeerLost("control channel: rank " + std::to_string(peer) + " announced a report of " +
                       std::to_string(header.length) + " bytes, over the limit of " +
                       std::to_string(kMaxFrameBytes) + " bytes; refused",
                   peer);
  }
  return header;
}

void configure_socket(int fd) {
  set_option(fd, IPPROTO_TCP, TCP_NODELAY, 1, "TCP_NODELAY");
  // IP_TOS first: setting it also sets the socket's priority, which SO_PRIORITY then overrides.
  set_option(fd, IPPROTO_IP, IP_TOS, kLowDelayTos, "IP_TOS");
  set_option(fd, SOL_SOCKET, SO_PRIORITY, kSocketPriority, "SO_PRIORITY");
  const int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    throw CommError(std::string("control channel: cannot make a socket non-blocking: ") + std::strerror(errno));
  }
}

UniqueFd connect_with_timeout(const std::string& ip, uint16_t port, Clock::duration timeout, std::string& error) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  if (inet_pton(AF_INET, ip.c_str(), &address.sin_addr) != 1) {
    error = "not an IPv4 address";
    return {};
  }
  UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    error = std::string("socket: ") + std::strerror(errno);
    return {};
  }
  configure_socket(fd.get());
  if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    if (errno != EINPROGRESS) {
      error = std::strerror(errno);
      return {};
    }
    if (!wait_for(fd.get(), POLLOUT, Clock::now() + timeout)) {
      error = "no answer within the connect timeout";
      return {};
    }
    int status = 0;
    socklen_t length = sizeof(status);
    if (getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &status, &length) != 0 || status != 0) {
      error = std::strerror(status != 0 ? status : errno);
      return {};
    }
  }
  return fd;
}

bool write_all(int fd, const char* data, size_t bytes, Clock::time_point deadline) {
  size_t done = 0;
  while (done < bytes) {
    const ssize_t sent = send(fd, data + done, bytes - done, MSG_NOSIGNAL);
    if (sent > 0) {
      done += static_cast<size_t>(sent);
    } else if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (!wait_for(fd, POLLOUT, deadline)) return false;
    } else {
      throw CommError(std::string("send failed: ") + std::strerror(errno));
    }
  }
  return true;
}

bool read_exact(int fd, char* data, size_t bytes, Clock::time_point deadline) {
  size_t done = 0;
  while (done < bytes) {
    const ssize_t got = recv(fd, data + done, bytes - done, 0);
    if (got > 0) {
      done += static_cast<size_t>(got);
    } else if (got == 0) {
      throw CommError("the connection was closed");
    } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      if (!wait_for(fd, POLLIN, deadline)) return false;
    } else {
      throw CommError(std::string("recv failed: ") + std::strerror(errno));
    }
  }
  return true;
}

int poll_timeout_ms(Clock::time_point deadline, int cap_ms) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return static_cast<int>(std::min<long long>(left + 1, cap_ms));
}

}  // namespace commsched::control
