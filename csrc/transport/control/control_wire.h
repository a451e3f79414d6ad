// The TCP control channel's wire: owned socket descriptors, the frames ranks send each other
// (every length and field checked before it is used), and the socket calls with deadlines.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "core/types.h"

namespace commsched::control {

using Clock = std::chrono::steady_clock;

// Reports are a few KiB; the first rounds of a big model announce every tensor name at once.
// Anything past this is a broken or foreign stream, not a report.
inline constexpr uint32_t kMaxFrameBytes = 64u << 20;
inline constexpr uint32_t kFrameMagic = 0x43534346;  // "CSCF"
inline constexpr uint32_t kHelloMagic = 0x43534348;  // "CSCH"
inline constexpr uint32_t kAckMagic = 0x43534341;    // "CSCA"
inline constexpr uint32_t kWireVersion = 1;
inline constexpr size_t kFrameHeaderBytes = 12;  // magic, round, length (little-endian u32 each)
inline constexpr size_t kHelloBytes = 24;        // magic, version, token (u64), rank, size
inline constexpr size_t kAckBytes = 16;          // magic, rank, token (u64)
// What IP_TOS and SO_PRIORITY say: low delay, and the band a priority queue serves first.
inline constexpr int kLowDelayTos = 0x10;  // IPTOS_LOWDELAY
inline constexpr int kSocketPriority = 6;  // TC_PRIO_INTERACTIVE: pfifo_fast's band 0

// A peer broke the channel: it closed or reset its connection, sent a bad frame, or did not answer.
class PeerLost : public CommError {
 public:
  PeerLost(const std::string& what, int rank) : CommError(what), rank_(rank) {}
  int rank() const { return rank_; }  // the (first) rank at fault

 private:
  int rank_;
};

// Owns one file descriptor and closes it once.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

struct Hello {
  uint64_t token = 0;  // the listener's token, from the bootstrap: proves the dialler is of this job
  uint32_t rank = 0;   // the dialler's rank
  uint32_t size = 0;
};

struct FrameHeader {
  uint32_t round = 0;
  uint32_t length = 0;
};

std::string encode_hello(const Hello& hello);
// Throws CommError saying what is wrong with `bytes` (kHelloBytes of them).
Hello decode_hello(const char* bytes);
std::string encode_ack(uint32_t rank, uint64_t token);
// True when `bytes` (kAckBytes) acknowledge a hello to `rank` with `token`.
bool ack_matches(const char* bytes, uint32_t rank, uint64_t token);
void encode_frame_header(uint32_t round, uint32_t length, char* out);
// Checks magic and length limit; `peer` names the sender in the error. Round checks are the caller's.
FrameHeader decode_frame_header(const char* bytes, int peer);

// TCP_NODELAY, IP_TOS low delay, SO_PRIORITY 6 and non-blocking mode; throws CommError.
void configure_socket(int fd);
// A socket of `fd`'s family, configured, connected to ip:port within `timeout`; an invalid fd and
// `error` set on failure.
UniqueFd connect_with_timeout(const std::string& ip, uint16_t port, Clock::duration timeout, std::string& error);
// Writes or reads exactly `bytes` on a non-blocking socket by `deadline`; false on timeout,
// CommError (with errno's text) on a closed or failed connection.
bool write_all(int fd, const char* data, size_t bytes, Clock::time_point deadline);
bool read_exact(int fd, char* data, size_t bytes, Clock::time_point deadline);
// Milliseconds until `deadline` for poll(), at least 0, capped so a long wait still wakes now and then.
int poll_timeout_ms(Clock::time_point deadline, int cap_ms = 1000);

}  // namespace commsched::control
