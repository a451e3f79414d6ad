// A full mesh of TCP connections between the ranks that carries only agreement reports, so a round
// never queues behind data in a transport's own connection. Its sockets are marked low-delay
// (IP_TOS 0x10, SO_PRIORITY 6): a host's priority or fair queueing serves them ahead of bulk data.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "transport/control/control_wire.h"

namespace commsched::control {

class TcpControlChannel {
 public:
  // Listens on an ephemeral port of every address (or of the one COMMSCHED_CONTROL_ADDRESS names).
  TcpControlChannel(int rank, int size, const std::string& address_override);
  TcpControlChannel(const TcpControlChannel&) = delete;
  TcpControlChannel& operator=(const TcpControlChannel&) = delete;

  // This rank's bootstrap entry ("token port ip,ip,..."), for every other rank's connect().
  std::string bootstrap_entry() const;

  // Builds the mesh from every rank's bootstrap_entry() (indexed by rank): this rank dials every lower
  // rank, trying its addresses in order, and accepts every higher one. Throws CommError naming the
  // ranks it could not reach within `timeout`.
  void connect(const std::vector<std::string>& entries, Clock::duration timeout);

  // Sends `mine` to every peer and returns every rank's report, indexed by rank. Throws PeerLost
  // naming the peer that closed, reset or sent a bad frame, or the ranks silent for `timeout_s`
  // (negative: no limit). For the first `spin` it checks the sockets without sleeping: a sleeping
  // thread's wake-up can cost more than the peers take to answer. After a failure every call
  // throws the same error.
  std::vector<std::string> exchange(const std::string& mine, double timeout_s,
                                    std::chrono::microseconds spin = std::chrono::microseconds(0));
  // exchange() for a caller with a deadline of its own: false once `yield_at` passed with the round
  // unfinished, which stays open; the next call (from any thread) goes on with it, its `mine`,
  // `timeout_s` and `spin` then unused: the round keeps its first deadline. True with `reports` set
  // once the round is complete.
  bool exchange_until(const std::string& mine, double timeout_s, std::chrono::microseconds spin,
                      Clock::time_point yield_at, std::vector<std::string>& reports);
  // The ranks whose report the open round still lacks (empty: none is open).
  std::vector<int> silent_ranks() const;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::vector<std::string>& addresses() const { return addresses_; }

 private:
  struct PeerEntry {
    uint64_t token = 0;
    uint16_t port = 0;
    std::vector<std::string> addresses;
  };
  // One peer's part of a round.
  struct PeerState {
    size_t sent = 0;      // bytes of frame_ written
    size_t header_got = 0;
    char header[kFrameHeaderBytes] = {};
    bool body_known = false;
    size_t body_got = 0;
  };

  static PeerEntry parse_entry(const std::string& entry, int peer);
  // Dials `peer` (a lower rank) at its addresses in order until `deadline`; an invalid fd and
  // `error` filled when none answered.
  UniqueFd dial(int peer, const PeerEntry& entry, Clock::time_point deadline, std::string& error) const;
  // Accepts the higher ranks' connections into peers_ until `deadline` or `stop`.
  void accept_peers(Clock::time_point deadline, const std::atomic<bool>& stop_requested, std::string& error);
  // Reads what `peer` has sent of this round; true when its frame is complete.
  bool receive_from(int peer, std::vector<std::string>& reports);
  [[noreturn]] void fail(const std::string& why, int peer);

  const int rank_;
  const int size_;
  const uint64_t token_;
  UniqueFd listener_;
  uint16_t port_ = 0;
  std::vector<std::string> addresses_;
  std::vector<UniqueFd> peers_;  // by rank; this rank's own slot stays empty
  uint32_t round_ = 0;
  std::string frame_;  // this round's outgoing frame, kept for its capacity
  std::vector<PeerState> states_;
  // The round in progress, which a caller with a deadline may leave open for the next call.
  bool round_open_ = false;
  std::vector<std::string> reports_;
  double round_timeout_s_ = -1;
  Clock::time_point round_deadline_;
  Clock::time_point spin_until_;
  std::string broken_;  // why the channel failed; empty while it works
  int broken_rank_ = -1;
};

}  // namespace commsched::control
