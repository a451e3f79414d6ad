// The TCP control channel: bootstrap of the mesh and the per-round exchange of reports.
#include "transport/control/tcp_control_channel.h"
#include "core/text.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <random>
#include <sstream>
#include <thread>

#include "transport/control/host_identity.h"

namespace commsched::control {

namespace {

// A dial to one address gives up after this; the next address of the peer is tried then.
constexpr auto kConnectTimeout = std::chrono::seconds(2);
// After the TCP handshake, the peer's acceptor answers the hello within this, or the address
// reached something else (another host's copy of the address, another job's port).
constexpr auto kAckTimeout = std::chrono::seconds(5);
constexpr auto kRedialPause = std::chrono::milliseconds(50);

uint64_t random_token() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

}  // namespace

TcpControlChannel::TcpControlChannel(int rank, int size, const std::string& address_override)
    : rank_(rank), size_(size), token_(random_token()), addresses_(reachable_addresses(address_override)) {
  listener_ = UniqueFd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!listener_.valid()) throw CommError(std::string("control channel: socket failed: ") + std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = 0;  // ephemeral
  // Overridden: only that address; otherwise every address, since peers try them all.
  if (address_override.empty()) {
    address.sin_addr.s_addr = htonl(INADDR_ANY);
  } else {
    inet_pton(AF_INET, addresses_.front().c_str(), &address.sin_addr);
  }
  if (bind(listener_.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0 ||
      listen(listener_.get(), std::max(16, size)) != 0) {
    throw CommError("control channel: cannot listen on " + (address_override.empty() ? "any address" : addresses_.front()) +
                    ": " + std::strerror(errno));
  }
  socklen_t length = sizeof(address);
  if (getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    throw CommError(std::string("control channel: getsockname failed: ") + std::strerror(errno));
  }
  port_ = ntohs(address.sin_port);
  configure_socket(listener_.get());  // non-blocking accept; accepted sockets are configured again
  peers_.resize(static_cast<size_t>(size_));
  states_.resize(static_cast<size_t>(size_));
}

std::string TcpControlChannel::bootstrap_entry() const {
  std::string entry = std::to_string(token_) + " " + std::to_string(port_) + " ";
  for (size_t i = 0; i < addresses_.size(); ++i) entry += (i ? "," : "") + addresses_[i];
  return entry;
}

TcpControlChannel::PeerEntry TcpControlChannel::parse_entry(const std::string& entry, int peer) {
  std::istringstream in(entry);
  PeerEntry parsed;
  unsigned long port = 0;
  std::string list;
  if (!(in >> parsed.token >> port >> list) || port == 0 || port > 65535) {
    throw CommError("control channel: rank " + std::to_string(peer) + " sent a malformed bootstrap entry '" + entry +
                    "'");
  }
  parsed.port = static_cast<uint16_t>(port);
  std::istringstream items(list);
  for (std::string ip; std::getline(items, ip, ',');) {
    if (!ip.empty()) parsed.addresses.push_back(ip);
  }
  if (parsed.addresses.empty()) {
    throw CommError("control channel: rank " + std::to_string(peer) + " sent no address to reach it at");
  }
  return parsed;
}

UniqueFd TcpControlChannel::dial(int peer, const PeerEntry& entry, Clock::time_point deadline,
                                 std::string& error) const {
  const std::string hello = encode_hello({entry.token, static_cast<uint32_t>(rank_), static_cast<uint32_t>(size_)});
  do {
    error.clear();
    for (const std::string& ip : entry.addresses) {
      const std::string where = ip + ":" + std::to_string(entry.port);
      std::string why;
      UniqueFd fd = connect_with_timeout(ip, entry.port, kConnectTimeout, why);
      if (fd.valid()) {
        try {
          char ack[kAckBytes];
          const auto ack_deadline = std::min(deadline, Clock::now() + kAckTimeout);
          if (write_all(fd.get(), hello.data(), hello.size(), ack_deadline) &&
              read_exact(fd.get(), ack, sizeof(ack), ack_deadline)) {
            if (ack_matches(ack, static_cast<uint32_t>(peer), entry.token)) return fd;
            why = "answered by something other than rank " + std::to_string(peer);
          } else {
            why = "no answer to the hello";
          }
        } catch (const CommError& failure) {
          why = failure.what();
        }
      }
      error += (error.empty() ? "" : "; ") + where + ": " + why;
    }
    std::this_thread::sleep_for(kRedialPause);
  } while (Clock::now() < deadline);
  return {};
}

void TcpControlChannel::accept_peers(Clock::time_point deadline, const std::atomic<bool>& stop_requested,
                                     std::string& error) {
  int expected = size_ - 1 - rank_;
  while (expected > 0 && !stop_requested.load() && Clock::now() < deadline) {
    pollfd entry{listener_.get(), POLLIN, 0};
    if (poll(&entry, 1, poll_timeout_ms(deadline, 100)) <= 0) continue;
    UniqueFd fd(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!fd.valid()) continue;
    try {
      configure_socket(fd.get());
      char bytes[kHelloBytes];
      if (!read_exact(fd.get(), bytes, sizeof(bytes), std::min(deadline, Clock::now() + kAckTimeout))) continue;
      const Hello hello = decode_hello(bytes);
      const bool ours = hello.token == token_ && hello.size == static_cast<uint32_t>(size_) &&
                        hello.rank > static_cast<uint32_t>(rank_) && hello.rank < static_cast<uint32_t>(size_);
      // A stranger (another job, a port scan) or a duplicate is dropped without an answer.
      if (!ours || peers_[hello.rank].valid()) continue;
      const std::string ack = encode_ack(static_cast<uint32_t>(rank_), token_);
      if (!write_all(fd.get(), ack.data(), ack.size(), deadline)) continue;
      peers_[hello.rank] = std::move(fd);
      --expected;
    } catch (const CommError&) {
      continue;  // a connection that broke or spoke nonsense during the hello: not a peer
    }
  }
  if (expected > 0 && !stop_requested.load()) {
    std::vector<int> missing;
    for (int peer = rank_ + 1; peer < size_; ++peer) {
      if (!peers_[peer].valid()) missing.push_back(peer);
    }
    error = rank_list(missing) + " did not connect to rank " + std::to_string(rank_);
  }
}

void TcpControlChannel::connect(const std::vector<std::string>& entries, Clock::duration timeout) {
  if (static_cast<int>(entries.size()) != size_) {
    throw CommError("control channel: " + std::to_string(entries.size()) + " bootstrap entries for " +
                    std::to_string(size_) + " ranks");
  }
  std::vector<PeerEntry> parsed;
  for (int peer = 0; peer < size_; ++peer) parsed.push_back(parse_entry(entries[peer], peer));
  const auto deadline = Clock::now() + timeout;
  std::atomic<bool> stop{false};
  std::string accept_error;
  std::thread acceptor([&] {
    try {
      accept_peers(deadline, stop, accept_error);
    } catch (const std::exception& failure) {
      accept_error = std::string("accepting peers failed: ") + failure.what();
    }
  });
  std::string dial_error;
  try {
    for (int peer = 0; peer < rank_ && dial_error.empty(); ++peer) {
      std::string why;
      peers_[peer] = dial(peer, parsed[peer], deadline, why);
      if (!peers_[peer].valid()) dial_error = "rank " + std::to_string(peer) + " could not be reached (" + why + ")";
    }
  } catch (...) {
    stop = true;
    acceptor.join();
    throw;
  }
  if (!dial_error.empty()) stop = true;
  acceptor.join();
  listener_.reset();  // every peer is in, or the channel failed
  if (!dial_error.empty() || !accept_error.empty()) {
    throw CommError("control channel of rank " + std::to_string(rank_) + ": " + dial_error +
                    (dial_error.empty() || accept_error.empty() ? "" : "; ") + accept_error +
                    ". Set COMMSCHED_CONTROL_ADDRESS to an address the ranks reach each other at, or "
                    "COMMSCHED_CONTROL_CHANNEL=transport");
  }
}

void TcpControlChannel::fail(const std::string& why, int peer) {
  broken_ = why;
  broken_rank_ = peer;
  throw PeerLost(why, peer);
}

bool TcpControlChannel::receive_from(int peer, std::vector<std::string>& reports) {
  PeerState& state = states_[peer];
  const int fd = peers_[peer].get();
  while (true) {
    char* target;
    size_t wanted;
    if (!state.body_known) {
      target = state.header + state.header_got;
      wanted = kFrameHeaderBytes - state.header_got;
    } else {
      target = reports[peer].data() + state.body_got;
      wanted = reports[peer].size() - state.body_got;
      if (wanted == 0) return true;
    }
    const ssize_t got = recv(fd, target, wanted, 0);
    if (got == 0) {
      fail("control channel: rank " + std::to_string(peer) +
               " closed its connection (it exited, crashed or shut down) while rank " + std::to_string(rank_) +
               " waited for its report",
           peer);
    }
    if (got < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      fail("control channel: the connection to rank " + std::to_string(peer) + " failed (" + std::strerror(errno) +
               "): it exited or crashed",
           peer);
    }
    if (!state.body_known) {
      state.header_got += static_cast<size_t>(got);
      if (state.header_got < kFrameHeaderBytes) continue;
      FrameHeader header;
      try {
        header = decode_frame_header(state.header, peer);
      } catch (const PeerLost& bad) {
        fail(bad.what(), peer);
      }
      if (header.round != round_) {
        fail("control channel: rank " + std::to_string(peer) + " sent the report of round " +
                 std::to_string(header.round) + " during round " + std::to_string(round_) +
                 "; the ranks are out of step",
             peer);
      }
      state.body_known = true;
      reports[peer].resize(header.length);
    } else {
      state.body_got += static_cast<size_t>(got);
    }
  }
}

std::vector<std::string> TcpControlChannel::exchange(const std::string& mine, double timeout_s,
                                                     std::chrono::microseconds spin) {
  std::vector<std::string> reports;
  exchange_until(mine, timeout_s, spin, Clock::time_point::max(), reports);
  return reports;
}

bool TcpControlChannel::exchange_until(const std::string& mine, double timeout_s, std::chrono::microseconds spin,
                                       Clock::time_point yield_at, std::vector<std::string>& reports_out) {
  if (!broken_.empty()) throw PeerLost(broken_, broken_rank_);
  if (!round_open_) {
    if (mine.size() > kMaxFrameBytes) {
      throw CommError("control channel: this rank's report of " + std::to_string(mine.size()) +
                      " bytes is over the limit of " + std::to_string(kMaxFrameBytes) + " bytes");
    }
    frame_.resize(kFrameHeaderBytes);
    encode_frame_header(round_, static_cast<uint32_t>(mine.size()), frame_.data());
    frame_ += mine;
    reports_.assign(static_cast<size_t>(size_), std::string());
    for (PeerState& state : states_) state = PeerState{};
    round_timeout_s_ = timeout_s;
    round_deadline_ = timeout_s < 0 ? Clock::time_point::max()
                                    : Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                         std::chrono::duration<double>(timeout_s));
    spin_until_ = spin.count() > 0 ? Clock::now() + spin : Clock::time_point::min();
    round_open_ = true;
  }
  std::vector<std::string>& reports = reports_;
  const double round_timeout_s = round_timeout_s_;
  const Clock::time_point deadline = round_deadline_;
  const Clock::time_point spin_until = spin_until_;
  std::vector<pollfd> polled;
  std::vector<int> polled_peers;
  bool past_yield = false;
  while (true) {
    polled.clear();
    polled_peers.clear();
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      const PeerState& state = states_[peer];
      const bool sending = state.sent < frame_.size();
      const bool receiving = !state.body_known || state.body_got < reports[peer].size();
      if (!sending && !receiving) continue;
      polled.push_back({peers_[peer].get(), static_cast<short>((sending ? POLLOUT : 0) | (receiving ? POLLIN : 0)), 0});
      polled_peers.push_back(peer);
    }
    if (polled.empty()) break;
    if (past_yield) return false;  // the round stays open for the next call
    const int wait_ms = Clock::now() < spin_until ? 0 : poll_timeout_ms(std::min(deadline, yield_at));
    const int ready = poll(polled.data(), polled.size(), wait_ms);
    if (ready < 0 && errno != EINTR) fail(std::string("control channel: poll failed: ") + std::strerror(errno), -1);
    const auto now = Clock::now();
    past_yield = now >= yield_at;
    if (ready == 0 && now >= deadline) {
      std::vector<int> silent;
      for (int peer : polled_peers) {
        if (states_[peer].body_known && states_[peer].body_got >= reports[peer].size()) continue;
        silent.push_back(peer);
      }
      if (silent.empty()) silent = polled_peers;  // only our sends are stuck: they stopped reading
      fail("control channel: no report from " + rank_list(silent) +
               " within " + seconds_text(round_timeout_s) + "s: " + (silent.size() == 1 ? "it" : "they") +
               " stopped taking part (crashed, hung, stopped, or never called commsched.init())",
           silent.front());
    }
    for (size_t i = 0; i < polled.size(); ++i) {
      const int peer = polled_peers[i];
      const short events = polled[i].revents;
      if (events == 0) continue;
      PeerState& state = states_[peer];
      if ((events & (POLLIN | POLLHUP | POLLERR)) != 0) receive_from(peer, reports);
      if ((events & (POLLOUT | POLLERR)) != 0 && state.sent < frame_.size()) {
        const ssize_t sent = send(peers_[peer].get(), frame_.data() + state.sent, frame_.size() - state.sent,
                                  MSG_NOSIGNAL);
        if (sent > 0) {
          state.sent += static_cast<size_t>(sent);
        } else if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          fail("control channel: sending to rank " + std::to_string(peer) + " failed (" + std::strerror(errno) +
                   "): it exited or crashed",
               peer);
        }
      }
    }
  }
  reports[rank_].assign(frame_, kFrameHeaderBytes, std::string::npos);
  ++round_;
  round_open_ = false;
  reports_out.swap(reports);
  return true;
}

std::vector<int> TcpControlChannel::silent_ranks() const {
  std::vector<int> silent;
  if (!round_open_) return silent;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    const PeerState& state = states_[peer];
    if (!state.body_known || state.body_got < reports_[peer].size()) silent.push_back(peer);
  }
  return silent;
}

}  // namespace commsched::control
