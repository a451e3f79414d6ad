#include "sim/network.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace commsched::sim {

namespace {
// Wire bytes below this count as sent: floating-point residue of the fair-share drain.
constexpr double kByteEpsilon = 1e-6;
}  // namespace

double ring_wire_bytes(uint64_t bytes, int ranks) {
  return 2.0 * (ranks - 1) / ranks * static_cast<double>(bytes);
}

double size_cost_factor(uint64_t bytes, const std::vector<SizeCost>& size_costs) {
  if (size_costs.empty()) return 1.0;
  if (bytes <= size_costs.front().bytes) return size_costs.front().factor;
  if (bytes >= size_costs.back().bytes) return size_costs.back().factor;
  const auto above = std::upper_bound(size_costs.begin(), size_costs.end(), bytes,
                                      [](uint64_t size, const SizeCost& cost) { return size < cost.bytes; });
  const SizeCost& low = *(above - 1);
  const double along = std::log(static_cast<double>(bytes) / static_cast<double>(low.bytes)) /
                       std::log(static_cast<double>(above->bytes) / static_cast<double>(low.bytes));
  return low.factor + along * (above->factor - low.factor);
}

namespace {

// The largest power of two <= ranks, and its log2.
int lower_power_of_two_log2(int ranks) {
  int log2 = 0;
  while ((2LL << log2) <= ranks) ++log2;
  return log2;
}

CollectiveCost cost_of(Algorithm algorithm, uint64_t bytes, int ranks) {
  const double m = static_cast<double>(bytes);
  const int log2 = lower_power_of_two_log2(ranks);
  const double power = static_cast<double>(1LL << log2);
  // Ranks beyond the power of two hand their whole message to a partner and get the result back.
  const bool folds = (1LL << log2) != ranks;
  const double fold_steps = folds ? 2.0 : 0.0;
  const double fold_bytes = folds ? 2.0 * m : 0.0;
  switch (algorithm) {
    case Algorithm::kRecursiveDoubling:
      return {log2 + fold_steps, log2 * m + fold_bytes};
    case Algorithm::kHalvingDoubling:
      return {2.0 * log2 + fold_steps, 2.0 * (power - 1) / power * m + fold_bytes};
    case Algorithm::kTree:
      // NCCL's tuning model: up and down a tree of depth floor(log2 n), each rank moving twice the message.
      return {2.0 * log2, 2.0 * m};
    case Algorithm::kRing:
    default:
      return {2.0 * (ranks - 1), ring_wire_bytes(bytes, ranks)};
  }
}

double alone_s(const CollectiveCost& cost, const NetworkSpec& network) {
  return cost.steps * network.latency_s + cost.wire_bytes / network.bandwidth_bytes_per_s;
}

}  // namespace

Algorithm resolve_algorithm(uint64_t bytes, const NetworkSpec& network) {
  switch (network.algorithm) {
    case Algorithm::kMpich: {
      // MPICH reduces short messages, and ones with fewer (float32) elements than the power of two,
      // by recursive doubling.
      const uint64_t power = uint64_t{1} << lower_power_of_two_log2(network.ranks);
      const bool short_message = bytes <= kMpichShortMessageBytes || bytes / 4 < power;
      return short_message ? Algorithm::kRecursiveDoubling : Algorithm::kHalvingDoubling;
    }
    case Algorithm::kNccl: {
      const double ring = alone_s(cost_of(Algorithm::kRing, bytes, network.ranks), network);
      const double tree = alone_s(cost_of(Algorithm::kTree, bytes, network.ranks), network);
      return tree < ring ? Algorithm::kTree : Algorithm::kRing;
    }
    default:
      return network.algorithm;
  }
}

CollectiveCost collective_cost(uint64_t bytes, const NetworkSpec& network) {
  return cost_of(resolve_algorithm(bytes, network), bytes, network.ranks);
}

double collective_latency_s(uint64_t bytes, const NetworkSpec& network) {
  return collective_cost(bytes, network).steps * network.latency_s;
}

double collective_wire_bytes(uint64_t bytes, const NetworkSpec& network) {
  return collective_cost(bytes, network).wire_bytes * size_cost_factor(bytes, network.size_costs);
}

double allreduce_s(uint64_t bytes, const NetworkSpec& network) {
  return collective_wire_bytes(bytes, network) / network.bandwidth_bytes_per_s + collective_latency_s(bytes, network);
}

double ring_latency_s(const NetworkSpec& network) { return 2.0 * (network.ranks - 1) * network.latency_s; }

double ring_allreduce_s(uint64_t bytes, const NetworkSpec& network) {
  return ring_wire_bytes(bytes, network.ranks) * size_cost_factor(bytes, network.size_costs) /
             network.bandwidth_bytes_per_s +
         ring_latency_s(network);
}

SharedLink::SharedLink(double bytes_per_s, LinkSharing sharing) : rate_(bytes_per_s), sharing_(sharing) {
  if (!(bytes_per_s > 0)) throw std::invalid_argument("link bandwidth must be above 0 bytes/s");
}

void SharedLink::start(uint64_t id, double now_s, double latency_s, double wire_bytes) {
  drain(now_s);
  joining_.push_back(Flow{id, now_s + std::max(0.0, latency_s), std::max(0.0, wire_bytes)});
}

double SharedLink::next_event_s() const {
  double next = kNever;
  for (const Flow& flow : joining_) next = std::min(next, flow.join_s);
  const size_t served_now = served();
  if (served_now > 0) {
    double least = kNever;
    for (size_t i = 0; i < served_now; ++i) least = std::min(least, active_[i].remaining);
    next = std::min(next, now_s_ + least * static_cast<double>(served_now) / rate_);
  }
  return next;
}

double SharedLink::backlog_bytes(double at_s) const {
  // Shared fairly, a small message gets its share at once and waits behind nothing.
  if (sharing_ == LinkSharing::kFair) return 0;
  double bytes = 0;
  for (const Flow& flow : joining_) bytes += flow.remaining;
  for (const Flow& flow : active_) bytes += flow.remaining;
  if (served() > 0 && at_s > now_s_) bytes -= (at_s - now_s_) * rate_;
  return std::max(0.0, bytes);
}

void SharedLink::drain(double until_s) {
  if (until_s <= now_s_) return;
  const size_t served_now = served();
  if (served_now > 0) {
    const double share = (until_s - now_s_) * rate_ / static_cast<double>(served_now);
    for (size_t i = 0; i < served_now; ++i) active_[i].remaining -= share;
  }
  now_s_ = until_s;
}

std::vector<uint64_t> SharedLink::advance(double t_s) {
  std::vector<uint64_t> finished;
  while (true) {
    const double next = next_event_s();
    if (next > t_s) break;
    drain(next);
    // Joins before completions, so a zero-byte flow that joins now finishes now.
    for (auto it = joining_.begin(); it != joining_.end();) {
      if (it->join_s <= now_s_) {
        active_.push_back(*it);
        it = joining_.erase(it);
      } else {
        ++it;
      }
    }
    const double k = static_cast<double>(std::max<size_t>(1, served()));
    for (auto it = active_.begin(); it != active_.end();) {
      // The second test catches a residue too small to move the clock, which would loop forever.
      if (it->remaining <= kByteEpsilon || now_s_ + it->remaining * k / rate_ <= now_s_) {
        finished.push_back(it->id);
        it = active_.erase(it);
      } else {
        ++it;
      }
    }
  }
  drain(t_s);
  return finished;
}

}  // namespace commsched::sim
