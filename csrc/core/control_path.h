// The road agreement reports take between ranks: the transport's own exchange(), or the TCP
// control channel, chosen once at start (settings.h, ControlChannel) and bootstrapped through the
// transport's exchange.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/log.h"
#include "core/settings.h"
#include "transport/control/tcp_control_channel.h"
#include "transport/transport.h"

namespace commsched {

class ControlPath {
 public:
  // Collective over every rank (one exchange on `transport` unless `mode` is kTransport). The channel
  // serves host transports only: a device transport (NCCL) already sends its agreement over the host
  // transport it wraps, apart from its data. Throws CommError when the channel cannot be built.
  ControlPath(ControlChannel mode, const std::string& address_override, Transport& transport, double timeout_s,
              const Logger& logger);

  // Every rank's report, indexed by rank, in `reports`; throws CommError as Transport::exchange
  // does. A `critical` round (nothing else in flight waits on the link) spins on the channel
  // briefly where every rank shares this host and has a core for it (spins_on_critical_rounds()).
  // Returns false once `yield_at` passed with the round unfinished, which stays open for the next
  // call (any thread, the same `mine`): a caller's wait keeps its timeout (Transport::exchange_until).
  bool exchange_until(const std::string& mine, double timeout_s, bool critical,
                      std::chrono::steady_clock::time_point yield_at, std::vector<std::string>& reports);

  // The ranks whose report the round left open still lacks (empty: none open, or not known).
  std::vector<int> silent_ranks() const { return channel_ ? channel_->silent_ranks() : transport_.silent_ranks(); }

  // True when reports travel over the TCP control channel.
  bool over_channel() const { return channel_ != nullptr; }
  // True when critical rounds spin before sleeping: the channel on one network stack, with no more
  // ranks than the host has CPUs.
  bool spins_on_critical_rounds() const { return spins_; }

 private:
  Transport& transport_;
  std::unique_ptr<control::TcpControlChannel> channel_;
  bool spins_ = false;
};

}  // namespace commsched
