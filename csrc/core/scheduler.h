// Transport-free scheduling logic: partition, priority queue, fusion and credit.
//
// Every rank feeds the scheduler the same agreed tensors in the same order and the
// same globally completed byte count, so every rank computes the same launches in
// the same order. Nothing here reads a clock or touches memory of the tensors.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "settings.h"
#include "types.h"

namespace commsched {

// A contiguous slice of one tensor, in elements.
struct ChunkRef {
  uint64_t tensor_id = 0;
  uint64_t elem_offset = 0;
  uint64_t elem_count = 0;
  uint32_t index = 0;  // position of the chunk within its tensor
};

// One collective to put on the wire: a single chunk, or several fused ones.
struct Launch {
  uint64_t seq = 0;  // launch number, identical on every rank
  CollectiveKind kind = CollectiveKind::kAllreduce;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int32_t root = 0;
  double prescale = 1.0;
  double postscale = 1.0;
  uint64_t bytes = 0;
  std::vector<ChunkRef> chunks;
  int32_t process_set = 0;  // set by the runtime, which keeps one scheduler per process set
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulingSettings& settings);

  // Queues an agreed tensor; the order of calls is the readiness order.
  // Returns the number of chunks it was cut into.
  uint32_t add(uint64_t tensor_id, const TensorSpec& spec);

  // Releases credit: `cumulative_bytes` is the total of launched bytes completed on every rank.
  void set_completed_bytes(uint64_t cumulative_bytes);

  // Pops what may launch now, in launch order, while the credit allows. A unit (one chunk,
  // or small tensors fused up to the fusion size) never depends on the credit, so every
  // rank cuts the queue into the same units whenever it pops them.
  std::vector<Launch> next_launches();

  // Applies new sizes or policy; takes effect for tensors added afterwards.
  void reconfigure(const SchedulingSettings& settings);

  const SchedulingSettings& settings() const { return settings_; }
  uint64_t bytes_in_flight() const { return launched_bytes_ - completed_bytes_; }
  uint64_t launched_bytes() const { return launched_bytes_; }
  size_t queued_chunks() const { return queue_.size(); }

 private:
  // (priority, readiness sequence, chunk index): smaller goes first.
  using OrderKey = std::tuple<int64_t, uint64_t, uint32_t>;
  // Chunks fuse only with chunks of the same collective shape: (kind, dtype, op, root, prescale, postscale).
  using FusionKey = std::tuple<uint8_t, uint8_t, uint8_t, int32_t, double, double>;

  struct QueuedChunk {
    ChunkRef ref;
    FusionKey fusion_key;
    uint64_t bytes = 0;
    bool fusible = false;  // whole small tensors fuse; chunks of a partitioned one go alone
  };

  bool credit_limited() const { return settings_.policy == Policy::kPriority; }
  uint64_t partition_elements(const TensorSpec& spec) const;
  // The keys of the next unit and its bytes, without popping it.
  std::vector<OrderKey> next_unit(uint64_t* bytes) const;
  Launch pop_unit();
  void take(const OrderKey& key, Launch& launch);

  SchedulingSettings settings_;
  std::map<OrderKey, QueuedChunk> queue_;
  std::map<FusionKey, std::set<OrderKey>> by_fusion_key_;  // fusible chunks only
  uint64_t next_ready_seq_ = 0;
  uint64_t next_launch_seq_ = 0;
  uint64_t launched_bytes_ = 0;
  uint64_t completed_bytes_ = 0;
};

}  // namespace commsched
