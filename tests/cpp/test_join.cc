// Horovod's join() in the agreement, without a transport: ranks that joined stand in for every
// tensor the others announce, and every rank learns the last rank to join in the same round.
#include <string>
#include <vector>

#include "check.h"
#include "core/agreement.h"

using namespace commsched;

namespace {

TensorSpec tensor(const std::string& name, uint64_t count, CollectiveKind kind = CollectiveKind::kAllreduce) {
  TensorSpec result;
  result.name = name;
  result.count = count;
  result.kind = kind;
  if (kind == CollectiveKind::kAllgather || kind == CollectiveKind::kReducescatter ||
      kind == CollectiveKind::kAlltoall) {
    result.row_shape = {1};
  }
  return result;
}

struct JoinWorld {
  explicit JoinWorld(int size) {
    for (int r = 0; r < size; ++r) ranks.emplace_back(r, size);
  }
  // One round; `joining` lists the ranks whose report announces their join.
  std::vector<CycleOutcome> cycle(const std::vector<int>& joining = {}) {
    std::vector<std::string> reports;
    for (size_t r = 0; r < ranks.size(); ++r) {
      ReportStatus status;
      for (int joiner : joining) status.join = status.join || joiner == static_cast<int>(r);
      reports.push_back(ranks[r].build_report(status));
    }
    std::vector<CycleOutcome> outcomes;
    for (Agreement& agreement : ranks) outcomes.push_back(agreement.apply(reports, 0));
    return outcomes;
  }
  std::vector<Agreement> ranks;
};

std::vector<std::string> agreed_names(const CycleOutcome& outcome) {
  std::vector<std::string> result;
  for (const TensorSpec& agreed : outcome.agreed) result.push_back(agreed.name);
  return result;
}

}  // namespace

TEST_CASE(join_agrees_what_every_other_rank_announced_and_marks_the_stand_in) {
  JoinWorld world(3);
  std::vector<CycleOutcome> outcomes = world.cycle({2});
  for (const CycleOutcome& outcome : outcomes) EXPECT(outcome.agreed.empty() && outcome.last_joined_rank == -1);
  EXPECT(world.ranks[0].has_joined(2) && !world.ranks[0].has_joined(0));
  world.ranks[0].announce(tensor("a", 8), {}, 10);
  world.ranks[1].announce(tensor("a", 8), {}, 11);
  outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) EXPECT(agreed_names(outcome) == std::vector<std::string>{"a"});
  EXPECT_EQ(outcomes[0].agreed_ids[0], 10u);
  EXPECT_EQ(outcomes[1].agreed_ids[0], 11u);
  EXPECT_EQ(outcomes[2].agreed_ids[0], kNoLocalTensor);  // rank 2 launches it with zeros
  EXPECT_EQ(outcomes[2].agreed[0].count, 8u);
}

TEST_CASE(a_join_releases_entries_that_waited_for_the_joining_rank) {
  JoinWorld world(3);
  world.ranks[0].announce(tensor("b", 4), {}, 1);
  world.ranks[1].announce(tensor("b", 4), {}, 2);
  std::vector<CycleOutcome> outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) EXPECT(outcome.agreed.empty());
  outcomes = world.cycle({2});
  for (const CycleOutcome& outcome : outcomes) EXPECT(agreed_names(outcome) == std::vector<std::string>{"b"});
  EXPECT_EQ(outcomes[2].agreed_ids[0], kNoLocalTensor);
  EXPECT_EQ(world.ranks[0].pending(), 0u);
}

TEST_CASE(what_a_rank_announced_before_joining_it_contributes_itself) {
  JoinWorld world(2);
  world.ranks[1].announce(tensor("c", 4), {}, 7);
  world.cycle({1});  // the entry comes first in the report, the join after it
  world.ranks[0].announce(tensor("c", 4), {}, 3);
  std::vector<CycleOutcome> outcomes = world.cycle();
  EXPECT_EQ(outcomes[1].agreed_ids.at(0), 7u);  // rank 1's own tensor, not a stand-in
  EXPECT_EQ(outcomes[0].agreed_ids.at(0), 3u);
}

TEST_CASE(inline_allreduce_completes_with_a_joined_rank_as_an_empty_payload) {
  JoinWorld world(3);
  world.cycle({1});
  const std::string bytes_of_0(16, '\1'), bytes_of_2(16, '\2');
  world.ranks[0].announce(tensor("small", 4), bytes_of_0, 1);
  world.ranks[2].announce(tensor("small", 4), bytes_of_2, 2);
  std::vector<CycleOutcome> outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) {
    EXPECT_EQ(outcome.inline_payloads.at(0).size(), 3u);
    EXPECT(outcome.inline_payloads[0][0] == bytes_of_0 && outcome.inline_payloads[0][2] == bytes_of_2);
    EXPECT(outcome.inline_payloads[0][1].empty());
  }
}

TEST_CASE(allgather_fails_on_every_rank_while_a_rank_joined_as_in_horovod) {
  JoinWorld world(3);
  world.cycle({1});
  world.ranks[0].announce(tensor("g", 4, CollectiveKind::kAllgather), {}, 1);
  world.ranks[2].announce(tensor("g", 6, CollectiveKind::kAllgather), {}, 2);
  std::vector<CycleOutcome> outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) {
    EXPECT(outcome.agreed.empty());
    EXPECT_EQ(outcome.failures.size(), 1u);
    EXPECT(outcome.failures.at(0).message.find("cannot run while rank 1 joined") != std::string::npos);
  }
  EXPECT_EQ(outcomes[0].failures[0].local_id, 1u);
  EXPECT_EQ(outcomes[2].failures[0].local_id, 2u);
  EXPECT_EQ(outcomes[1].failures[0].local_id, kNoLocalTensor);
}

TEST_CASE(broadcast_reducescatter_and_alltoall_fail_on_every_rank_while_a_rank_joined) {
  JoinWorld world(2);
  world.cycle({0});
  TensorSpec broadcast = tensor("bc", 4, CollectiveKind::kBroadcast);
  broadcast.root = 1;
  TensorSpec alltoall = tensor("a2a", 2, CollectiveKind::kAlltoall);
  alltoall.splits = {1, 1};
  world.ranks[1].announce(broadcast, {}, 1);
  world.ranks[1].announce(tensor("rs", 4, CollectiveKind::kReducescatter), {}, 2);
  world.ranks[1].announce(alltoall, {}, 3);
  std::vector<CycleOutcome> outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) {
    EXPECT(outcome.agreed.empty());
    EXPECT_EQ(outcome.failures.size(), 3u);
    for (const TensorFailure& failure : outcome.failures) {
      EXPECT(failure.message.find("cannot run while rank 0 joined") != std::string::npos);
    }
  }
  EXPECT_EQ(outcomes[1].failures[0].local_id, 1u);  // the submitting rank's handle fails
  EXPECT_EQ(outcomes[0].failures[0].local_id, kNoLocalTensor);
}

TEST_CASE(mismatches_among_the_ranks_that_did_not_join_still_fail) {
  JoinWorld world(3);
  world.cycle({0});
  world.ranks[1].announce(tensor("m", 4), {}, 1);
  world.ranks[2].announce(tensor("m", 5), {}, 2);
  std::vector<CycleOutcome> outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) {
    EXPECT(outcome.agreed.empty() && outcome.failures.size() == 1);
    EXPECT(outcome.failures[0].message.find("does not match") != std::string::npos);
  }
}

TEST_CASE(every_rank_learns_the_last_rank_to_join_and_the_next_epoch_starts_afresh) {
  JoinWorld world(3);
  world.cycle({0, 2});
  std::vector<CycleOutcome> outcomes = world.cycle({1});
  for (const CycleOutcome& outcome : outcomes) EXPECT_EQ(outcome.last_joined_rank, 1);
  for (int r = 0; r < 3; ++r) EXPECT(!world.ranks[0].has_joined(r));
  // A new epoch: a tensor needs every rank again.
  world.ranks[0].announce(tensor("e", 4), {}, 1);
  world.ranks[1].announce(tensor("e", 4), {}, 2);
  outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) EXPECT(outcome.agreed.empty());
  world.ranks[2].announce(tensor("e", 4), {}, 3);
  outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) EXPECT_EQ(outcome.agreed.size(), 1u);
}

TEST_CASE(ranks_joining_in_the_same_round_name_the_highest_as_last) {
  JoinWorld world(3);
  world.cycle({1});
  std::vector<CycleOutcome> outcomes = world.cycle({0, 2});
  for (const CycleOutcome& outcome : outcomes) EXPECT_EQ(outcome.last_joined_rank, 2);
  outcomes = world.cycle({0, 1, 2});
  for (const CycleOutcome& outcome : outcomes) EXPECT_EQ(outcome.last_joined_rank, 2);
}

TEST_CASE(a_tensor_only_joined_ranks_announced_is_agreed_when_the_last_rank_joins) {
  JoinWorld world(2);
  world.ranks[0].announce(tensor("left", 4), {}, 5);
  world.cycle({0});
  std::vector<CycleOutcome> outcomes = world.cycle({1});
  for (const CycleOutcome& outcome : outcomes) {
    EXPECT(agreed_names(outcome) == std::vector<std::string>{"left"});
    EXPECT_EQ(outcome.last_joined_rank, 1);
  }
  EXPECT_EQ(outcomes[0].agreed_ids[0], 5u);
  EXPECT_EQ(outcomes[1].agreed_ids[0], kNoLocalTensor);
}

TEST_CASE(joining_twice_in_one_epoch_is_a_malformed_report) {
  JoinWorld world(2);
  world.cycle({0});
  bool threw = false;
  try {
    world.cycle({0});
  } catch (const CommError& error) {
    threw = std::string(error.what()).find("joined again") != std::string::npos;
  }
  EXPECT(threw);
}

TEST_CASE(a_joined_member_stands_in_for_the_collectives_of_its_process_sets) {
  JoinWorld world(3);
  for (Agreement& agreement : world.ranks) {
    agreement.add_process_set(1, {0, 1});
    agreement.add_process_set(2, {1, 2});
  }
  world.cycle({0});
  TensorSpec pair = tensor("pair", 8);
  pair.process_set = 1;
  world.ranks[1].announce(pair, {}, 11);
  TensorSpec right = tensor("right", 8);
  right.process_set = 2;
  world.ranks[1].announce(right, {}, 12);
  std::vector<CycleOutcome> outcomes = world.cycle();
  // {0,1} is agreed at once: rank 0 joined and launches it with zeros; {1,2} waits for rank 2.
  for (const CycleOutcome& outcome : outcomes) EXPECT(agreed_names(outcome) == std::vector<std::string>{"pair"});
  EXPECT_EQ(outcomes[0].agreed_ids[0], kNoLocalTensor);
  EXPECT_EQ(outcomes[1].agreed_ids[0], 11u);
  EXPECT_EQ(world.ranks[1].pending(), 1u);
  world.ranks[2].announce(right, {}, 22);
  outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) EXPECT(agreed_names(outcome) == std::vector<std::string>{"right"});
}

TEST_CASE(a_set_allgather_fails_at_once_naming_its_joined_member) {
  JoinWorld world(3);
  for (Agreement& agreement : world.ranks) agreement.add_process_set(1, {0, 1});
  TensorSpec gathered = tensor("rows", 3, CollectiveKind::kAllgather);
  gathered.process_set = 1;
  world.ranks[1].announce(gathered, {}, 7);
  std::vector<CycleOutcome> outcomes = world.cycle({0});  // rank 0 joins in the same round
  for (const CycleOutcome& outcome : outcomes) {
    EXPECT(outcome.agreed.empty());
    EXPECT_EQ(outcome.failures.size(), 1u);
    EXPECT(outcome.failures[0].message.find("cannot run while rank 0 joined") != std::string::npos);
  }
  EXPECT_EQ(outcomes[1].failures[0].local_id, 7u);
  EXPECT_EQ(world.ranks[1].pending(), 0u);
}
