// Network model of the simulator: collectives in flight share one link fairly.
//
// A collective first waits out its latency (per-message latency times the number
// of sequential steps of its allreduce algorithm) and then moves that algorithm's wire
// bytes over the link,
// which the collectives in that phase share in one of two ways: in start order
// (kFifo: one TCP stream per peer, as MPI over TCP sends queued messages in order)
// or in equal shares (kFair: processor sharing, as separate streams or channels do).
#pragma once

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace commsched::sim {

enum class LinkSharing : uint8_t { kFifo = 0, kFair };

// The allreduce algorithm the library runs. Per message of m bytes on n ranks (p: the largest power of
// two <= n; a fold costs the ranks beyond p one full message in and one out, as MPICH runs it):
//   kRing                2(n-1) steps, 2(n-1)/n m bytes (Gloo, torch's Gloo group, commsched's gRPC ring)
//   kRecursiveDoubling   log2 p steps of the whole message (+2 steps and 2m when folding)
//   kHalvingDoubling     Rabenseifner: 2 log2 p steps, 2(p-1)/p m bytes (+2 steps and 2m when folding)
//   kTree                NCCL's double binary tree: 2 floor(log2 n) steps, 2m bytes (its tuning model)
//   kMpich               MPICH's choice: recursive doubling up to 2048 bytes or fewer elements than p,
//                        halving-doubling above
//   kNccl                NCCL's choice: whichever of ring and tree takes less time for the message
enum class Algorithm : uint8_t { kRing = 0, kRecursiveDoubling, kHalvingDoubling, kTree, kMpich, kNccl };

// Up to this many bytes MPICH reduces with recursive doubling (MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE).
constexpr uint64_t kMpichShortMessageBytes = 2048;

// A measured cost per byte of collectives of `bytes`, relative to the link bandwidth: 0.6 means
// such messages move 1/0.6 times as fast per byte (an MPI library may pick another algorithm,
// or pipeline better, at some sizes).
struct SizeCost {
  uint64_t bytes = 0;
  double factor = 1.0;
};

struct NetworkSpec {
  int ranks = 2;
  double bandwidth_bytes_per_s = 125e6;  // of each rank's link, per direction
  double latency_s = 50e-6;              // one message, one hop
  LinkSharing sharing = LinkSharing::kFifo;
  std::vector<SizeCost> size_costs;      // by size; empty: every size costs the same per byte
  Algorithm algorithm = Algorithm::kRing;
};

// One allreduce's cost under an algorithm: sequential message latencies and bytes on the busiest link.
struct CollectiveCost {
  double steps = 0;
  double wire_bytes = 0;
};

// Bytes each rank puts on its link for a ring allreduce of `bytes`: 2(n-1)/n of them.
double ring_wire_bytes(uint64_t bytes, int ranks);
// The algorithm `algorithm` runs for a message of `bytes` (itself unless it is a library's choice).
Algorithm resolve_algorithm(uint64_t bytes, const NetworkSpec& network);
// Steps and wire bytes (at the nominal rate, before size costs) of one allreduce of `bytes`.
CollectiveCost collective_cost(uint64_t bytes, const NetworkSpec& network);
// Sequential message latency of one allreduce of `bytes` under the network's algorithm.
double collective_latency_s(uint64_t bytes, const NetworkSpec& network);
// The cost factor for a collective of `bytes`: linear in log(size) between the measured sizes,
// the nearest one's outside them, 1 when none were measured.
double size_cost_factor(uint64_t bytes, const std::vector<SizeCost>& size_costs);
// Link time of one collective of `bytes` in bytes at the nominal rate: the algorithm's wire bytes times
// its size's factor.
double collective_wire_bytes(uint64_t bytes, const NetworkSpec& network);
// Time of one allreduce alone on the link under the network's algorithm.
double allreduce_s(uint64_t bytes, const NetworkSpec& network);
// Sequential message latency of a ring allreduce: 2(n-1) steps.
double ring_latency_s(const NetworkSpec& network);
// Time of one ring allreduce alone on the link, whatever the network's algorithm.
double ring_allreduce_s(uint64_t bytes, const NetworkSpec& network);

constexpr double kNever = std::numeric_limits<double>::infinity();

class SharedLink {
 public:
  SharedLink(double bytes_per_s, LinkSharing sharing);

  // Starts flow `id` at `now_s`: idle for `latency_s`, then `wire_bytes` at a fair share.
  void start(uint64_t id, double now_s, double latency_s, double wire_bytes);
  // Time of the next join or completion; kNever when nothing is in flight.
  double next_event_s() const;
  // Moves the clock to `t_s` (no later than next_event_s()) and returns the flows that finished.
  std::vector<uint64_t> advance(double t_s);
  bool idle() const { return joining_.empty() && active_.empty(); }
  // Wire bytes still to cross the link at `at_s` (no earlier than the last advance and no
  // later than next_event_s()): what a message sent then queues behind (nothing when fair).
  double backlog_bytes(double at_s) const;
  size_t in_flight() const { return joining_.size() + active_.size(); }

 private:
  struct Flow {
    uint64_t id = 0;
    double join_s = 0;
    double remaining = 0;  // wire bytes left
  };

  void drain(double until_s);

  // Flows served at once: all of them when fair, the oldest one in start order otherwise.
  size_t served() const { return sharing_ == LinkSharing::kFair ? active_.size() : std::min<size_t>(1, active_.size()); }

  double rate_;
  LinkSharing sharing_;
  double now_s_ = 0;
  std::vector<Flow> joining_;  // in their latency phase, in start order
  std::vector<Flow> active_;   // sharing the bandwidth, in start order
};

}  // namespace commsched::sim
