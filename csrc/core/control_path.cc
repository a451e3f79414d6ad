// Chooses and bootstraps the agreement's road between ranks (see control_path.h).
#include "core/control_path.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "transport/control/host_identity.h"

namespace commsched {

namespace {

// Building the mesh starts once every rank is past the bootstrap exchange, so it takes moments; a
// loaded host may take a while to schedule the ranks, and a firewall that drops the connections
// should fail (or, under auto, fall back) well before COMMSCHED_STALL_SHUTDOWN's 300 s.
constexpr double kMinConnectTimeoutS = 10.0;
constexpr double kMaxConnectTimeoutS = 30.0;
// A rank that cannot take part in the bootstrap says so in its entry, so the others fail at once.
constexpr char kRefusalMark = '!';
// How long a critical round checks the channel's sockets before sleeping in poll(). On one host a
// peer's report arrives within microseconds of its send, while waking a sleeping thread cost
// 20-25 us on the 2-core VM (a 32-byte TCP ping-pong through poll(): 42-53 us a round trip), so a
// 50 us spin saves a wake-up per round without outlasting one.
constexpr auto kCriticalRoundSpin = std::chrono::microseconds(50);

}  // namespace

ControlPath::ControlPath(ControlChannel mode, const std::string& address_override, Transport& transport,
                         double timeout_s, const Logger& logger)
    : transport_(transport) {
  if (mode == ControlChannel::kTransport || transport.size() < 2 || !transport.host_memory()) return;
  const int rank = transport.rank();
  std::unique_ptr<control::TcpControlChannel> channel;
  std::string mine;
  std::string refusal;
  try {
    channel = std::make_unique<control::TcpControlChannel>(rank, transport.size(), address_override);
    mine = control::network_identity() + "\n" + channel->bootstrap_entry();
  } catch (const std::exception& error) {
    refusal = error.what();
    mine = kRefusalMark + refusal;
  }
  const std::vector<std::string> entries = transport.exchange(mine, timeout_s);
  std::vector<std::string> identities;
  std::vector<std::string> channel_entries;
  for (int peer = 0; peer < static_cast<int>(entries.size()); ++peer) {
    const std::string& entry = entries[peer];
    if (!entry.empty() && entry.front() == kRefusalMark) {
      const std::string why = "the TCP control channel could not start on rank " + std::to_string(peer) + ": " +
                              entry.substr(1);
      if (peer == rank) throw UsageError(why);
      throw CommError(why);
    }
    const size_t split = entry.find('\n');
    if (split == std::string::npos) {
      throw CommError("control channel bootstrap: rank " + std::to_string(peer) + " sent a malformed entry");
    }
    identities.push_back(entry.substr(0, split));
    channel_entries.push_back(entry.substr(split + 1));
  }
  const bool one_stack = std::all_of(identities.begin(), identities.end(),
                                     [&](const std::string& identity) { return identity == identities.front(); });
  if (mode == ControlChannel::kAuto && one_stack && transport.exchange_in_shared_memory()) {
    logger.debug("agreement over the " + transport.name() + " transport: every rank shares one network stack");
    return;
  }
  const double connect_s = std::clamp(timeout_s, kMinConnectTimeoutS, kMaxConnectTimeoutS);
  std::string failure;
  try {
    channel->connect(channel_entries, std::chrono::duration_cast<control::Clock::duration>(
                                          std::chrono::duration<double>(connect_s)));
  } catch (const std::exception& error) {
    failure = error.what();
  }
  // Every rank learns whether every other one got its connections, so all take the same road.
  const std::vector<std::string> verdicts = transport.exchange(failure.empty() ? "ok" : kRefusalMark + failure,
                                                               timeout_s);
  for (int peer = 0; peer < static_cast<int>(verdicts.size()); ++peer) {
    if (verdicts[peer] == "ok") continue;
    const std::string why = "rank " + std::to_string(peer) + ": " +
                            (verdicts[peer].empty() ? std::string("no verdict") : verdicts[peer].substr(1));
    if (mode == ControlChannel::kAuto) {
      logger.warning("COMMSCHED_CONTROL_CHANNEL=auto: the TCP control channel could not connect (" + why +
                     "); agreement rounds stay on the " + transport.name() + " transport");
      return;
    }
    throw CommError("COMMSCHED_CONTROL_CHANNEL=tcp: the TCP control channel could not connect (" + why + ")");
  }
  // Ranks that outnumber the CPUs would spin while the peer they wait for has none to answer on.
  spins_ = one_stack && static_cast<unsigned>(transport.size()) <= std::max(1u, std::thread::hardware_concurrency());
  std::string where;
  for (const std::string& address : channel->addresses()) where += (where.empty() ? "" : ",") + address;
  logger.info("agreement over the TCP control channel (listening at " + where + ")" +
              (spins_ ? "; rounds with nothing in flight spin " + std::to_string(kCriticalRoundSpin.count()) +
                            " us before sleeping"
                      : ""));
  channel_ = std::move(channel);
}

bool ControlPath::exchange_until(const std::string& mine, double timeout_s, bool critical,
                                 std::chrono::steady_clock::time_point yield_at, std::vector<std::string>& reports) {
  if (!channel_) return transport_.exchange_until(mine, timeout_s, yield_at, reports);
  try {
    return channel_->exchange_until(mine, timeout_s,
                                    spins_ && critical ? kCriticalRoundSpin : std::chrono::microseconds(0), yield_at,
                                    reports);
  } catch (const control::PeerLost& lost) {
    transport_.peer_lost(lost.what(), lost.rank());
    throw;
  }
}

}  // namespace commsched
