// Agreement, scheduling and element-wise logic of the collectives beyond allreduce, without a
// transport: reports are exchanged by hand between Agreement objects standing for the ranks.
#include <cstring>

#include "check.h"
#include "core/agreement.h"
#include "core/elementwise.h"
#include "core/scheduler.h"

using namespace commsched;

namespace {

TensorSpec shaped(const std::string& name, CollectiveKind kind, uint64_t rows, std::vector<uint64_t> row_shape) {
  TensorSpec spec;
  spec.name = name;
  spec.kind = kind;
  spec.row_shape = std::move(row_shape);
  spec.count = rows * spec.row_elements();
  return spec;
}

std::vector<CycleOutcome> exchange(std::vector<Agreement>& ranks) {
  std::vector<std::string> reports;
  for (Agreement& rank : ranks) reports.push_back(rank.build_report(ReportStatus{}));
  std::vector<CycleOutcome> outcomes;
  for (Agreement& rank : ranks) outcomes.push_back(rank.apply(reports, 0));
  return outcomes;
}

std::vector<Agreement> world(int size) {
  std::vector<Agreement> ranks;
  for (int r = 0; r < size; ++r) ranks.emplace_back(r, size);
  return ranks;
}

}  // namespace

TEST_CASE(allgather_agrees_on_different_first_dimensions_and_lays_out_every_rank) {
  auto ranks = world(3);
  for (int r = 0; r < 3; ++r) ranks[r].announce(shaped("g", CollectiveKind::kAllgather, r + 1, {2, 3}));
  for (const CycleOutcome& outcome : exchange(ranks)) {
    EXPECT(outcome.failures.empty());
    EXPECT_EQ(outcome.agreed.size(), 1u);
    EXPECT((outcome.agreed[0].layout == std::vector<uint64_t>{6, 12, 18}));
    EXPECT_EQ(outcome.agreed[0].count, 36u);  // the total: the same on every rank, for the credit
    EXPECT(outcome.inline_payloads[0].empty());
  }
}

TEST_CASE(allgather_row_shape_mismatch_fails_on_every_rank_naming_each_submission) {
  auto ranks = world(2);
  ranks[0].announce(shaped("g", CollectiveKind::kAllgather, 2, {3, 4}));
  ranks[1].announce(shaped("g", CollectiveKind::kAllgather, 2, {4, 3}));
  for (const CycleOutcome& outcome : exchange(ranks)) {
    EXPECT(outcome.agreed.empty());
    EXPECT_EQ(outcome.failures.size(), 1u);
    const std::string& message = outcome.failures[0].message;
    EXPECT(message.find("rank 0 submitted allgather float32(2, 3, 4)") != std::string::npos);
    EXPECT(message.find("rank 1 submitted allgather float32(2, 4, 3)") != std::string::npos);
  }
}

TEST_CASE(reducescatter_gives_the_first_ranks_one_row_more) {
  auto ranks = world(3);
  for (int r = 0; r < 3; ++r) ranks[r].announce(shaped("rs", CollectiveKind::kReducescatter, 7, {2}));
  for (const CycleOutcome& outcome : exchange(ranks)) {
    EXPECT((outcome.agreed.at(0).layout == std::vector<uint64_t>{6, 4, 4}));
  }
}

TEST_CASE(alltoall_agrees_on_every_ranks_splits) {
  auto ranks = world(2);
  TensorSpec first = shaped("a", CollectiveKind::kAlltoall, 3, {2});
  first.splits = {1, 2};
  TensorSpec second = shaped("a", CollectiveKind::kAlltoall, 1, {2});
  second.splits = {0, 1};
  ranks[0].announce(first);
  ranks[1].announce(second);
  for (const CycleOutcome& outcome : exchange(ranks)) {
    EXPECT((outcome.agreed.at(0).layout == std::vector<uint64_t>{2, 4, 0, 2}));
    EXPECT_EQ(outcome.agreed.at(0).count, 8u);
  }
}

TEST_CASE(scale_factor_or_op_mismatch_fails_and_matching_ones_travel_cached) {
  auto ranks = world(2);
  TensorSpec scaled;
  scaled.name = "s";
  scaled.count = 4;
  scaled.op = ReduceOp::kMax;
  scaled.prescale = 0.5;
  TensorSpec other = scaled;
  other.prescale = 2.0;
  ranks[0].announce(scaled);
  ranks[1].announce(other);
  for (const CycleOutcome& outcome : exchange(ranks)) EXPECT_EQ(outcome.failures.size(), 1u);
  for (int round = 0; round < 2; ++round) {
    ranks[0].announce(scaled);
    ranks[1].announce(scaled);
    for (const CycleOutcome& outcome : exchange(ranks)) {
      EXPECT_EQ(outcome.agreed.size(), 1u);
      EXPECT_EQ(outcome.agreed[0].prescale, 0.5);
      EXPECT(outcome.agreed[0].op == ReduceOp::kMax);
    }
  }
  EXPECT_EQ(ranks[0].cached_names(), 1u);
}

TEST_CASE(barrier_completes_at_agreement_without_a_launch) {
  auto ranks = world(2);
  TensorSpec barrier;
  barrier.name = "b";
  barrier.kind = CollectiveKind::kBarrier;
  barrier.count = 0;
  ranks[0].announce(barrier);
  for (const CycleOutcome& outcome : exchange(ranks)) EXPECT(outcome.agreed.empty());
  ranks[1].announce(barrier);
  for (const CycleOutcome& outcome : exchange(ranks)) {
    EXPECT_EQ(outcome.agreed.size(), 1u);
    EXPECT_EQ(outcome.inline_payloads.at(0).size(), 2u);  // complete from the agreement alone
  }
}

TEST_CASE(scheduler_fuses_only_same_op_and_scale_and_never_cuts_shaped_collectives) {
  SchedulingSettings settings;
  settings.partition_bytes = 64;
  settings.fusion_bytes = 1 << 20;
  settings.credit_bytes = 1 << 20;
  Scheduler scheduler(settings);
  TensorSpec sum;
  sum.count = 4;
  TensorSpec max = sum;
  max.op = ReduceOp::kMax;
  TensorSpec scaled = sum;
  scaled.postscale = 3.0;
  scheduler.add(0, sum);
  scheduler.add(1, max);
  scheduler.add(2, sum);
  scheduler.add(3, scaled);
  TensorSpec gathered = shaped("g", CollectiveKind::kAllgather, 100, {4});  // 1600 bytes, partition 64
  scheduler.add(4, gathered);
  scheduler.add(5, gathered);
  const std::vector<Launch> launches = scheduler.next_launches();
  EXPECT_EQ(launches.size(), 5u);  // sum (0 and 2 fused), max, scaled, and each allgather whole and alone
  EXPECT_EQ(launches[0].chunks.size(), 2u);
  EXPECT(launches[1].op == ReduceOp::kMax);
  EXPECT_EQ(launches[2].postscale, 3.0);
  EXPECT_EQ(launches[3].chunks.size(), 1u);
  EXPECT_EQ(launches[3].chunks[0].elem_count, 400u);
  EXPECT(launches[4].kind == CollectiveKind::kAllgather);
}

TEST_CASE(elementwise_ops_follow_horovod) {
  int32_t ints[] = {7, -7, 5};
  divide_by(ints, 3, DType::kInt32, 2.0);  // integer average floor-divides
  EXPECT(ints[0] == 3 && ints[1] == -4 && ints[2] == 2);
  int16_t shorts[] = {3, -2};
  const int16_t other_shorts[] = {-1, 5};
  reduce_into(shorts, other_shorts, 2, DType::kInt16, ReduceOp::kMin);
  EXPECT(shorts[0] == -1 && shorts[1] == -2);
  reduce_into(shorts, other_shorts, 2, DType::kInt16, ReduceOp::kProduct);
  EXPECT(shorts[0] == 1 && shorts[1] == -10);
  uint8_t bools[] = {1, 1, 0, 0};
  const uint8_t other_bools[] = {1, 0, 1, 0};
  uint8_t ored[4];
  std::memcpy(ored, bools, 4);
  reduce_into(bools, other_bools, 4, DType::kBool, ReduceOp::kMin);
  reduce_into(ored, other_bools, 4, DType::kBool, ReduceOp::kMax);
  EXPECT(bools[0] == 1 && bools[1] == 0 && bools[2] == 0 && bools[3] == 0);
  EXPECT(ored[0] == 1 && ored[1] == 1 && ored[2] == 1 && ored[3] == 0);
  bool refused = false;
  try {
    reduce_into(bools, other_bools, 4, DType::kBool, ReduceOp::kSum);
  } catch (const UsageError&) {
    refused = true;
  }
  EXPECT(refused);
  uint16_t halves[] = {float_to_half(1.5f), float_to_half(-2.0f)};
  const uint16_t other_halves[] = {float_to_half(2.0f), float_to_half(3.0f)};
  reduce_into(halves, other_halves, 2, DType::kFloat16, ReduceOp::kProduct);
  EXPECT(half_to_float(halves[0]) == 3.0f && half_to_float(halves[1]) == -6.0f);
  int64_t scaled[] = {5, -5};
  multiply_by(scaled, 2, DType::kInt64, 0.5);  // truncated toward zero, as Horovod scales integers
  EXPECT(scaled[0] == 2 && scaled[1] == -2);
}
