// Process sets in the agreement: a set's collective is agreed once its members reported it, in the
// same round and order on every rank, members or not; names, splits and layouts count the set.
#include "check.h"
#include "core/agreement.h"

using namespace commsched;

namespace {

TensorSpec on_set(const std::string& name, int32_t process_set, uint64_t count = 4,
                  CollectiveKind kind = CollectiveKind::kAllreduce) {
  TensorSpec result;
  result.name = name;
  result.count = count;
  result.kind = kind;
  result.process_set = process_set;
  return result;
}

struct SetWorld {
  explicit SetWorld(int size) {
    for (int r = 0; r < size; ++r) ranks.emplace_back(r, size);
  }
  void add(int32_t id, const std::vector<int>& members) {
    for (Agreement& agreement : ranks) agreement.add_process_set(id, members);
  }
  std::vector<CycleOutcome> cycle() {
    std::vector<std::string> reports;
    for (Agreement& agreement : ranks) reports.push_back(agreement.build_report(ReportStatus{}));
    std::vector<CycleOutcome> outcomes;
    for (Agreement& agreement : ranks) outcomes.push_back(agreement.apply(reports, 0));
    return outcomes;
  }
  std::vector<Agreement> ranks;
};

}  // namespace

TEST_CASE(a_set_collective_is_agreed_by_its_members_alone_and_everywhere_in_one_order) {
  SetWorld world(3);
  world.add(1, {0, 1});
  world.ranks[2].announce(on_set("global", 0), {}, 20);  // rank 2 waits for a global one meanwhile
  world.ranks[0].announce(on_set("pair", 1), {}, 5);
  world.ranks[1].announce(on_set("pair", 1), {}, 6);
  std::vector<CycleOutcome> outcomes = world.cycle();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(outcomes[r].agreed.size(), 1u);
    EXPECT(outcomes[r].agreed[0].name == "pair" && outcomes[r].agreed[0].process_set == 1);
  }
  EXPECT_EQ(outcomes[0].agreed_ids[0], 5u);
  EXPECT_EQ(outcomes[1].agreed_ids[0], 6u);
  EXPECT_EQ(outcomes[2].agreed_ids[0], kNoLocalTensor);  // rank 2 launches nothing for it
  EXPECT_EQ(world.ranks[2].pending(), 1u);  // "global" still waits for ranks 0 and 1
}

TEST_CASE(one_name_on_two_sets_at_once_is_rejected_so_the_api_names_them_apart) {
  SetWorld world(3);
  world.add(1, {0, 1});
  world.add(2, {1, 2});
  world.ranks[0].announce(on_set("x", 1));
  world.ranks[2].announce(on_set("x", 2));
  bool refused = false;
  try {
    world.cycle();
  } catch (const CommError& error) {
    refused = std::string(error.what()).find("one name belongs to one set") != std::string::npos;
  }
  EXPECT(refused);
}

TEST_CASE(layouts_and_splits_count_the_members_in_rank_order) {
  SetWorld world(3);
  world.add(4, {0, 2});
  TensorSpec gather = on_set("g", 4, 0, CollectiveKind::kAllgather);
  gather.row_shape = {2};
  TensorSpec exchange = on_set("a", 4, 0, CollectiveKind::kAlltoall);
  exchange.row_shape = {1};
  for (int r : {0, 2}) {
    gather.count = 2 * (r + 1);
    world.ranks[r].announce(gather);
    exchange.splits = {static_cast<uint64_t>(r + 1), 1};
    exchange.count = static_cast<uint64_t>(r + 2);
    world.ranks[r].announce(exchange);
  }
  std::vector<CycleOutcome> outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) {
    EXPECT_EQ(outcome.agreed.size(), 2u);
    EXPECT(outcome.agreed[0].layout == (std::vector<uint64_t>{2, 6}));
    EXPECT(outcome.agreed[1].layout == (std::vector<uint64_t>{1, 1, 3, 1}));
  }
}

TEST_CASE(a_cached_set_collective_keeps_its_set_and_a_stall_names_members_only) {
  SetWorld world(3);
  world.add(1, {1, 2});
  for (int round = 0; round < 2; ++round) {
    world.ranks[1].announce(on_set("c", 1));
    world.ranks[2].announce(on_set("c", 1));
    for (const CycleOutcome& outcome : world.cycle()) {
      EXPECT(outcome.agreed.size() == 1 && outcome.agreed[0].process_set == 1);
    }
  }
  world.ranks[1].announce(on_set("late", 1));
  world.cycle();
  const std::vector<StalledTensor> stalled = world.ranks[0].stalled(100, 1);
  EXPECT_EQ(stalled.size(), 1u);
  EXPECT(stalled[0].ready_ranks == std::vector<int>{1} && stalled[0].missing_ranks == std::vector<int>{2});
}

TEST_CASE(a_refusal_on_a_set_fails_the_members_without_waiting_for_the_others) {
  SetWorld world(3);
  world.add(3, {0, 2});
  world.ranks[0].announce(on_set("r", 3), {}, 9);
  world.ranks[2].refuse("r", "bad shape", 3);
  std::vector<CycleOutcome> outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) {
    EXPECT_EQ(outcome.failures.size(), 1u);
    EXPECT_EQ(outcome.failures[0].refused_by, 2);
  }
  EXPECT_EQ(outcomes[0].failures[0].local_id, 9u);
}
