// The road agreement reports take between ranks: the transport's own exchange(), or the TCP
// control channel, chosen once at start (settings.h, ControlChannel) and bootstrapped through the
// transport's exchange.
#pragma once

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

  // Every rank's report, indexed by rank; throws CommError as Transport::exchange does.
  std::vector<std::string> exchange(const std::string& mine, double timeout_s);

  // True when reports travel over the TCP control channel.
  bool over_channel() const { return channel_ != nullptr; }

 private:
  Transport& transport_;
  std::unique_ptr<control::TcpControlChannel> channel_;
};

}  // namespace commsched
