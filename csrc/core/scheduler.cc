#include "scheduler.h"

#include <algorithm>

namespace commsched {

Scheduler::Scheduler(const SchedulingSettings& settings) : settings_(settings) {}

void Scheduler::reconfigure(const SchedulingSettings& settings) { settings_ = settings; }

uint64_t Scheduler::partition_elements(const TensorSpec& spec) const {
  // FIFO sends whole tensors, as Horovod does; priority cuts them so an urgent
  // tensor waits for at most one chunk.
  if (settings_.policy == Policy::kFifo || settings_.partition_bytes == 0) return spec.count;
  // Only element-wise collectives can be cut; the others (allgather, alltoall, ...) go whole.
  if (spec.kind != CollectiveKind::kAllreduce && spec.kind != CollectiveKind::kBroadcast) return spec.count;
  return std::max<uint64_t>(1, settings_.partition_bytes / dtype_size(spec.dtype));
}

uint32_t Scheduler::add(uint64_t tensor_id, const TensorSpec& spec) {
  const uint64_t seq = next_ready_seq_++;
  const int64_t priority = settings_.policy == Policy::kPriority ? spec.priority : 0;
  const bool reduces = kind_reduces(spec.kind);
  const FusionKey fusion_key{static_cast<uint8_t>(spec.kind),
                             static_cast<uint8_t>(spec.dtype),
                             static_cast<uint8_t>(reduces ? spec.op : ReduceOp::kSum),
                             spec.kind == CollectiveKind::kBroadcast ? spec.root : 0,
                             reduces ? spec.prescale : 1.0,
                             reduces ? spec.postscale : 1.0};
  const uint64_t step = partition_elements(spec);
  const size_t elem_size = dtype_size(spec.dtype);
  const bool elementwise = spec.kind == CollectiveKind::kAllreduce || spec.kind == CollectiveKind::kBroadcast;
  const bool fusible = elementwise && step >= spec.count;
  uint32_t index = 0;
  uint64_t offset = 0;
  do {  // a zero-length tensor still gets one (empty) chunk so its handle completes in order
    const uint64_t count = std::min(step, spec.count - offset);
    const OrderKey key{priority, seq, index};
    queue_.emplace(key,
                   QueuedChunk{ChunkRef{tensor_id, offset, count, index}, fusion_key, count * elem_size, fusible});
    if (fusible) by_fusion_key_[fusion_key].insert(key);
    offset += count;
    ++index;
  } while (offset < spec.count);
  return index;
}

void Scheduler::set_completed_bytes(uint64_t cumulative_bytes) {
  completed_bytes_ = std::min(std::max(completed_bytes_, cumulative_bytes), launched_bytes_);
}

void Scheduler::take(const OrderKey& key, Launch& launch) {
  auto found = queue_.find(key);
  const QueuedChunk& chunk = found->second;
  launch.bytes += chunk.bytes;
  launch.chunks.push_back(chunk.ref);
  if (chunk.fusible) {
    auto group = by_fusion_key_.find(chunk.fusion_key);
    group->second.erase(key);
    if (group->second.empty()) by_fusion_key_.erase(group);
  }
  queue_.erase(found);
}

std::vector<Scheduler::OrderKey> Scheduler::next_unit(uint64_t* bytes) const {
  std::vector<OrderKey> keys;
  const auto& [head_key, head] = *queue_.begin();
  keys.push_back(head_key);
  *bytes = head.bytes;
  if (!head.fusible || head.bytes >= settings_.fusion_bytes) return keys;
  // A fusible head is the smallest key of its group too, so the rest follows in priority order.
  const std::set<OrderKey>& group = by_fusion_key_.at(head.fusion_key);
  for (auto it = std::next(group.begin()); it != group.end(); ++it) {
    const uint64_t more = queue_.at(*it).bytes;
    if (*bytes + more > settings_.fusion_bytes) break;
    keys.push_back(*it);
    *bytes += more;
  }
  return keys;
}

Launch Scheduler::pop_unit() {
  uint64_t bytes = 0;
  const std::vector<OrderKey> keys = next_unit(&bytes);
  const QueuedChunk& head = queue_.at(keys.front());
  Launch launch;
  launch.seq = next_launch_seq_++;
  launch.kind = static_cast<CollectiveKind>(std::get<0>(head.fusion_key));
  launch.dtype = static_cast<DType>(std::get<1>(head.fusion_key));
  launch.op = static_cast<ReduceOp>(std::get<2>(head.fusion_key));
  launch.root = std::get<3>(head.fusion_key);
  launch.prescale = std::get<4>(head.fusion_key);
  launch.postscale = std::get<5>(head.fusion_key);
  for (const OrderKey& key : keys) take(key, launch);
  launched_bytes_ += launch.bytes;
  return launch;
}

std::vector<Launch> Scheduler::next_launches() {
  std::vector<Launch> launches;
  while (!queue_.empty()) {
    uint64_t bytes = 0;
    next_unit(&bytes);
    const uint64_t in_flight = bytes_in_flight();
    // A unit larger than the whole credit may still go alone when nothing is in flight.
    if (credit_limited() && in_flight > 0 && in_flight + bytes > settings_.credit_bytes) break;
    launches.push_back(pop_unit());
  }
  return launches;
}

}  // namespace commsched
