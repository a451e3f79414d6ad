// The validated settings the core runs with. Parsing and validation of user input
// (arguments, COMMSCHED_* variables, units) happens once in Python at init().
#pragma once

#include <cstdint>
#include <string>

namespace commsched {

enum class Policy : uint8_t { kPriority = 0, kFifo };

enum class LogLevel : uint8_t { kTrace = 0, kDebug, kInfo, kWarning, kError };

struct SchedulingSettings {
  Policy policy = Policy::kPriority;
  uint64_t partition_bytes = 4ull << 20;
  uint64_t credit_bytes = 16ull << 20;
  uint64_t fusion_bytes = 1ull << 20;
};

// Rounds start as soon as a rank has news, so the cycle is only a heartbeat for what a
// single rank knows (shutdown, settings, stalls). Each round that brings nothing new
// doubles it, up to this many cycles: an idle exchange costs every rank CPU (and the
// GIL on Python transports) that the training needs.
inline constexpr int kMaxQuietCycles = 32;

// Every rank receives every rank's inline payload, so the payloads one tensor puts in a round
// (its size times the ranks), and all the payloads of one rank's report times the ranks, stay
// under this budget: at scale only the smallest go inline. It lets
// 64 KiB (COMMSCHED_INLINE_BYTES' largest) go inline at up to 4 ranks, where a CNN's first layer
// (ResNet-50's conv1: 37 KiB), ready last and needed first, then skips the collectives in flight.
inline constexpr uint64_t kInlineRoundBudgetBytes = 256 * 1024;

// Up to this many ranks the MPI transport exchanges agreement reports point-to-point, every rank
// to every other at once (one message step); beyond, by allgather (log2 n steps), since n
// messages per rank then cost more. The simulator charges the exchange the same way.
inline constexpr int kDirectExchangeMaxRanks = 8;

// Where agreement reports travel: kTransport through the transport's exchange(); kTcp over a
// mesh of TCP connections of their own, which never queue behind data; kAuto picks kTcp when the
// ranks do not all share one network stack (on one host the transport's path, shared memory, wins).
enum class ControlChannel : uint8_t { kAuto = 0, kTcp, kTransport };

struct RuntimeSettings {
  SchedulingSettings scheduling;
  // Tensors up to this size ride in the agreement report and are reduced there (host memory only).
  uint64_t inline_bytes = 4096;
  double cycle_time_s = 0.001;
  // The link's per-message latency init() measured or was given (0: unknown), and the pause between
  // tests of collectives in flight the user asked for (negative: unset); see poll_interval_for.
  double link_latency_s = 0.0;
  double poll_interval_s = -1.0;
  double stall_timeout_s = 60.0;
  double stall_shutdown_s = 300.0;  // 0 disables failing stalled tensors
  std::string timeline_path;
  ControlChannel control_channel = ControlChannel::kAuto;
  std::string control_address;  // COMMSCHED_CONTROL_ADDRESS: an IPv4 address or interface name; empty: all
  LogLevel log_level = LogLevel::kWarning;
};

}  // namespace commsched
