// Scheduling logic without a transport: partition, priority, preemption, credit, fusion, FIFO.
#include <algorithm>
#include <memory>
#include <random>

#include "check.h"
#include "core/scheduler.h"

using namespace commsched;

namespace {

constexpr uint64_t kMiB = 1ull << 20;

TensorSpec spec(const std::string& name, uint64_t count, int priority, DType dtype = DType::kFloat32) {
  TensorSpec result;
  result.name = name;
  result.count = count;
  result.priority = priority;
  result.dtype = dtype;
  return result;
}

SchedulingSettings priority_settings(uint64_t partition, uint64_t credit, uint64_t fusion) {
  SchedulingSettings settings;
  settings.policy = Policy::kPriority;
  settings.partition_bytes = partition;
  settings.credit_bytes = credit;
  settings.fusion_bytes = fusion;
  return settings;
}

// Completes every launch at once and collects the order in which tensor ids reached the wire.
std::vector<uint64_t> drain_order(Scheduler& scheduler) {
  std::vector<uint64_t> order;
  while (scheduler.queued_chunks() > 0) {
    for (const Launch& launch : scheduler.next_launches()) {
      for (const ChunkRef& chunk : launch.chunks) order.push_back(chunk.tensor_id);
    }
    scheduler.set_completed_bytes(scheduler.launched_bytes());
  }
  return order;
}

}  // namespace

TEST_CASE(partition_cuts_large_tensors_into_aligned_chunks) {
  Scheduler scheduler(priority_settings(4 * kMiB, 64 * kMiB, 0));
  const uint32_t chunks = scheduler.add(7, spec("big", (10 * kMiB) / 4, 0));
  EXPECT_EQ(chunks, 3u);
  const std::vector<Launch> launches = scheduler.next_launches();
  EXPECT_EQ(launches.size(), 3u);
  uint64_t expected_offset = 0;
  for (size_t i = 0; i < launches.size(); ++i) {
    EXPECT_EQ(launches[i].chunks.size(), 1u);
    const ChunkRef& chunk = launches[i].chunks[0];
    EXPECT_EQ(chunk.tensor_id, 7u);
    EXPECT_EQ(chunk.index, static_cast<uint32_t>(i));
    EXPECT_EQ(chunk.elem_offset, expected_offset);
    expected_offset += chunk.elem_count;
  }
  EXPECT_EQ(expected_offset, (10 * kMiB) / 4);
  EXPECT_EQ(launches[2].bytes, 2 * kMiB);
}

TEST_CASE(partition_respects_element_size) {
  Scheduler scheduler(priority_settings(1000, 64 * kMiB, 0));
  scheduler.add(1, spec("doubles", 1000, 0, DType::kFloat64));  // 8000 bytes, 125 doubles per chunk
  const std::vector<Launch> launches = scheduler.next_launches();
  EXPECT_EQ(launches.size(), 8u);
  for (const Launch& launch : launches) EXPECT_EQ(launch.bytes % 8, 0u);
}

TEST_CASE(ready_chunks_launch_in_priority_order) {
  Scheduler scheduler(priority_settings(4 * kMiB, 64 * kMiB, 0));
  scheduler.add(0, spec("a", 100, 5));
  scheduler.add(1, spec("b", 100, 1));
  scheduler.add(2, spec("c", 100, 3));
  scheduler.add(3, spec("d", 100, -2));
  const std::vector<uint64_t> order = drain_order(scheduler);
  EXPECT(order == (std::vector<uint64_t>{3, 1, 2, 0}));
}

TEST_CASE(equal_priorities_keep_readiness_order) {
  Scheduler scheduler(priority_settings(4 * kMiB, 64 * kMiB, 0));
  for (uint64_t id = 0; id < 5; ++id) scheduler.add(id, spec("t" + std::to_string(id), 10, 4));
  const std::vector<uint64_t> order = drain_order(scheduler);
  EXPECT(order == (std::vector<uint64_t>{0, 1, 2, 3, 4}));
}

TEST_CASE(late_urgent_tensor_overtakes_queued_chunks) {
  // Credit for one chunk: the big tensor trickles out chunk by chunk.
  Scheduler scheduler(priority_settings(1 * kMiB, 1 * kMiB, 0));
  scheduler.add(0, spec("big", 4 * kMiB / 4, 10));
  std::vector<Launch> first = scheduler.next_launches();
  EXPECT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].chunks[0].index, 0u);
  scheduler.add(1, spec("urgent", 1000, 0));
  EXPECT(scheduler.next_launches().empty());  // credit is spent until the chunk completes
  scheduler.set_completed_bytes(scheduler.launched_bytes());
  std::vector<Launch> next = scheduler.next_launches();
  EXPECT(!next.empty());
  EXPECT_EQ(next[0].chunks[0].tensor_id, 1u);
}

TEST_CASE(credit_caps_bytes_in_flight) {
  std::mt19937 random(3);
  Scheduler scheduler(priority_settings(256 * 1024, 1 * kMiB, 64 * 1024));
  for (uint64_t id = 0; id < 200; ++id) {
    scheduler.add(id, spec("t" + std::to_string(id), 1 + random() % 200000, static_cast<int>(random() % 50)));
  }
  uint64_t completed = 0;
  while (scheduler.queued_chunks() > 0) {
    for (const Launch& launch : scheduler.next_launches()) {
      EXPECT(launch.bytes <= 256 * 1024 || launch.chunks.size() == 1);
      EXPECT(scheduler.bytes_in_flight() <= 1 * kMiB);
    }
    // Complete a random share of what is in flight, as a transport would.
    if (random() % 3 == 0) {
      completed = scheduler.launched_bytes();
    } else {
      completed += (scheduler.launched_bytes() - completed) / 2;
    }
    scheduler.set_completed_bytes(completed);
  }
}

TEST_CASE(chunk_larger_than_credit_goes_alone) {
  Scheduler scheduler(priority_settings(0, 1000, 0));  // partition off, tiny credit
  scheduler.add(0, spec("huge", 100000, 0));
  scheduler.add(1, spec("next", 10, 1));
  std::vector<Launch> launches = scheduler.next_launches();
  EXPECT_EQ(launches.size(), 1u);
  EXPECT_EQ(launches[0].bytes, 400000u);
  EXPECT(scheduler.next_launches().empty());
  scheduler.set_completed_bytes(400000);
  launches = scheduler.next_launches();
  EXPECT_EQ(launches.size(), 1u);
  EXPECT_EQ(launches[0].chunks[0].tensor_id, 1u);
}

TEST_CASE(fusion_packs_small_tensors_in_priority_order) {
  Scheduler scheduler(priority_settings(4 * kMiB, 64 * kMiB, 1 * kMiB));
  // Ten 100 KiB float32 tensors with shuffled priorities.
  const int priorities[] = {9, 3, 7, 1, 8, 0, 6, 2, 5, 4};
  for (uint64_t id = 0; id < 10; ++id) scheduler.add(id, spec("s" + std::to_string(id), 25600, priorities[id]));
  const std::vector<Launch> launches = scheduler.next_launches();
  EXPECT_EQ(launches.size(), 1u);
  EXPECT_EQ(launches[0].chunks.size(), 10u);
  EXPECT_EQ(launches[0].bytes, 1024000u);
  int previous = -1;
  for (const ChunkRef& chunk : launches[0].chunks) {
    EXPECT(priorities[chunk.tensor_id] > previous);
    previous = priorities[chunk.tensor_id];
  }
}

TEST_CASE(chunks_of_a_partitioned_tensor_are_never_fused) {
  Scheduler scheduler(priority_settings(1024, 64 * kMiB, 1 * kMiB));
  scheduler.add(0, spec("big", 1000, 1));  // 4000 bytes: four chunks
  scheduler.add(1, spec("small_a", 10, 0));
  scheduler.add(2, spec("small_b", 10, 2));
  const std::vector<Launch> launches = scheduler.next_launches();
  EXPECT_EQ(launches.size(), 5u);
  EXPECT_EQ(launches[0].chunks.size(), 2u);  // the two small tensors, most urgent first
  EXPECT_EQ(launches[0].chunks[1].tensor_id, 2u);
  for (size_t i = 1; i < launches.size(); ++i) {
    EXPECT_EQ(launches[i].chunks.size(), 1u);
    EXPECT_EQ(launches[i].chunks[0].tensor_id, 0u);
  }
}

TEST_CASE(fusion_stops_at_fusion_size) {
  Scheduler scheduler(priority_settings(4 * kMiB, 64 * kMiB, 300 * 1024));
  for (uint64_t id = 0; id < 10; ++id) scheduler.add(id, spec("s" + std::to_string(id), 25600, 0));  // 100 KiB
  const std::vector<Launch> launches = scheduler.next_launches();
  EXPECT_EQ(launches.size(), 4u);  // 3 + 3 + 3 + 1
  for (const Launch& launch : launches) EXPECT(launch.bytes <= 300 * 1024);
  EXPECT_EQ(launches[3].chunks.size(), 1u);
}

TEST_CASE(fusion_never_mixes_dtypes_or_kinds) {
  Scheduler scheduler(priority_settings(4 * kMiB, 64 * kMiB, 1 * kMiB));
  scheduler.add(0, spec("f32", 100, 0, DType::kFloat32));
  scheduler.add(1, spec("f64", 100, 1, DType::kFloat64));
  scheduler.add(2, spec("f32b", 100, 2, DType::kFloat32));
  TensorSpec broadcast = spec("bcast", 100, 3, DType::kFloat32);
  broadcast.kind = CollectiveKind::kBroadcast;
  broadcast.root = 1;
  scheduler.add(3, broadcast);
  TensorSpec average = spec("avg", 100, 4, DType::kFloat32);
  average.op = ReduceOp::kAverage;
  scheduler.add(4, average);
  const std::vector<Launch> launches = scheduler.next_launches();
  EXPECT_EQ(launches.size(), 4u);
  EXPECT_EQ(launches[0].chunks.size(), 2u);  // f32 and f32b
  EXPECT_EQ(launches[0].chunks[1].tensor_id, 2u);
  EXPECT(launches[1].dtype == DType::kFloat64);
  EXPECT(launches[2].kind == CollectiveKind::kBroadcast);
  EXPECT_EQ(launches[2].root, 1);
  EXPECT(launches[3].op == ReduceOp::kAverage);
}

TEST_CASE(fifo_keeps_readiness_order_without_partition_or_credit) {
  SchedulingSettings settings = priority_settings(1 * kMiB, 1 * kMiB, 0);
  settings.policy = Policy::kFifo;
  Scheduler scheduler(settings);
  scheduler.add(0, spec("first", 4 * kMiB / 4, 9));
  scheduler.add(1, spec("second", 10, 0));
  scheduler.add(2, spec("third", 2 * kMiB / 4, -5));
  const std::vector<Launch> launches = scheduler.next_launches();
  EXPECT_EQ(launches.size(), 3u);  // no credit gate, nothing cut
  EXPECT_EQ(launches[0].chunks[0].tensor_id, 0u);
  EXPECT_EQ(launches[0].bytes, 4 * kMiB);
  EXPECT_EQ(launches[1].chunks[0].tensor_id, 1u);
  EXPECT_EQ(launches[2].chunks[0].tensor_id, 2u);
}

TEST_CASE(zero_length_tensor_gets_one_empty_chunk) {
  Scheduler scheduler(priority_settings(4 * kMiB, 64 * kMiB, 0));
  EXPECT_EQ(scheduler.add(0, spec("empty", 0, 0)), 1u);
  const std::vector<Launch> launches = scheduler.next_launches();
  EXPECT_EQ(launches.size(), 1u);
  EXPECT_EQ(launches[0].bytes, 0u);
}

TEST_CASE(launch_sequence_is_deterministic) {
  auto run = [] {
    std::mt19937 random(11);
    Scheduler scheduler(priority_settings(64 * 1024, 256 * 1024, 32 * 1024));
    std::vector<std::tuple<uint64_t, uint64_t, uint64_t>> trace;
    for (uint64_t id = 0; id < 300; ++id) {
      scheduler.add(id, spec("t" + std::to_string(id), random() % 40000,
                             static_cast<int>(random() % 10), random() % 2 ? DType::kFloat32 : DType::kInt64));
      for (const Launch& launch : scheduler.next_launches()) {
        for (const ChunkRef& chunk : launch.chunks) trace.emplace_back(launch.seq, chunk.tensor_id, chunk.index);
      }
      if (id % 3 == 0) scheduler.set_completed_bytes(scheduler.launched_bytes());
    }
    return trace;
  };
  EXPECT(run() == run());
}

