// How long the core pauses between tests of the collectives in flight.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>

namespace commsched {

// Below this per-message latency (one host's shared memory, RDMA) a test finds news within a few
// microseconds: the core tests without pause, as a sleep and its wake-up would cost more.
inline constexpr double kSleepingPollMinLatencyS = 8e-6;
// The longest derived pause: a finished collective is seen at most this late.
inline constexpr std::chrono::microseconds kMaxSleepingPoll{50};

// The pause between tests of collectives in flight. `transport_interval` is the transport's own
// (0: it moves data only while tested, as MPI does); `requested_s` is COMMSCHED_POLL_INTERVAL
// (negative: unset); `link_latency_s` the per-message latency init() measured or was given, where
// the ranks' data crosses a network (0: unknown, or one host). Over TCP between hosts, testing
// without pause kept a core busy per rank for data the link delivers a message latency at a time;
// with more ranks than cores the spinning ranks delayed the ones whose gradients were ready. Half a
// latency sees a finished collective well within the latency it paid anyway.
inline std::chrono::microseconds poll_interval_for(std::chrono::microseconds transport_interval,
                                                    double requested_s, double link_latency_s) {
  if (requested_s >= 0) return std::chrono::microseconds(std::llround(requested_s * 1e6));
  if (transport_interval.count() > 0) return transport_interval;
  if (!(link_latency_s >= kSleepingPollMinLatencyS)) return std::chrono::microseconds(0);
  const auto half = std::chrono::microseconds(std::llround(link_latency_s * 1e6 / 2));
  return std::min(half, kMaxSleepingPoll);
}

}  // namespace commsched
