// The simulator: commsched's real Scheduler driven by a virtual clock, with the
// transport replaced by a network model and the framework by a replayed model profile.
//
// It mirrors the runtime loop (csrc/core/runtime_drive.cc) cycle by cycle: the core
// waits for news (a new tensor or a completion, at most one cycle time), spends
// one exchange on agreement, hands the agreed tensors and the completed byte count
// of that report to the Scheduler, and starts what it returns. Ranks are taken as
// identical, so one rank's timeline stands for all of them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/settings.h"
#include "sim/network.h"

namespace commsched::sim {

struct LayerSpec {
  std::string name;
  double forward_s = 0;
  double backward_s = 0;
  std::vector<uint64_t> param_bytes;  // float32 gradients, in forward order
};

// How the training loop waits for its reductions.
enum class Mode : uint8_t {
  kBarrier = 0,  // the next iteration starts once every reduction is done (Horovod, DDP)
  kOverlap,      // each layer's next forward waits only for its own parameters
};

struct SimSettings {
  SchedulingSettings scheduling;
  Mode mode = Mode::kOverlap;
  double cycle_time_s = 0.001;
  double exchange_s = -1;  // one agreement exchange; below 0: latency, times ceil(log2 n) past 8 ranks
  // Agreement rounds wait behind the bytes queued on the link (rounds in the transport's own
  // connection); false: on a connection of their own (the TCP control channel), they do not.
  bool rounds_behind_data = true;
  int iterations = 6;      // measured iterations
  int warmup = 2;          // iterations run before measuring
  // ZeRO-2's split: each gradient is reduce-scattered in backward and each parameter all-gathered
  // after its step, before its next forward; each collective costs half an allreduce of the tensor.
  // Overlap steps each parameter once its reduce-scatter is done after the backward, so its gather
  // competes with the reduce-scatters still queued; barrier steps once all are done.
  bool shard = false;
};

struct SimResult {
  double iteration_s = 0;      // steady-state period between starts of the first forward
  double compute_s = 0;        // forward + backward of one iteration
  double communication_s = 0;  // every gradient in one allreduce of the network's algorithm
  double bound_s = 0;          // max(compute, communication)
  double sum_s = 0;            // compute + communication
  uint64_t launches = 0;
  uint64_t fused_launches = 0;
  uint64_t cycles = 0;
  uint64_t max_bytes_in_flight = 0;
  std::vector<double> iteration_starts_s;
};

// Replays the profile through the real Scheduler and the modelled network.
SimResult simulate(const std::vector<LayerSpec>& layers, const NetworkSpec& network, const SimSettings& settings);

// The best schedule possible for the profile: overlap, zero overhead, and a link that
// always serves the most urgent ready byte (infinitely preemptive priority); each reduction
// moves the wire bytes of the network's algorithm and pays that algorithm's latency once,
// after its last byte (none when latency_s is 0), both for a message of that tensor.
// With `shard`, the same for the split: each reduce-scatter and all-gather moves half an allreduce's wire
// bytes and pays half its latency, and each parameter's all-gather starts once its own reduce-scatter is
// done and the backward has ended (a per-parameter step at once), in the one priority order.
SimResult simulate_ideal(const std::vector<LayerSpec>& layers, const NetworkSpec& network, int iterations,
                         int warmup, bool shard = false);

}  // namespace commsched::sim
