// Cross-rank agreement without a transport: reports are exchanged by hand between
// Agreement objects standing for the ranks.
#include <algorithm>
#include <random>

#include "check.h"
#include "core/agreement.h"

using namespace commsched;

namespace {

TensorSpec spec(const std::string& name, uint64_t count, int priority = 0, DType dtype = DType::kFloat32) {
  TensorSpec result;
  result.name = name;
  result.count = count;
  result.priority = priority;
  result.dtype = dtype;
  return result;
}

struct World {
  explicit World(int size) {
    for (int r = 0; r < size; ++r) ranks.emplace_back(r, size);
  }
  // One cycle: every rank reports, every rank applies all reports.
  std::vector<CycleOutcome> cycle(double now = 0, std::vector<ReportStatus> statuses = {}) {
    statuses.resize(ranks.size());
    std::vector<std::string> reports;
    for (size_t r = 0; r < ranks.size(); ++r) reports.push_back(ranks[r].build_report(statuses[r]));
    last_report_bytes.clear();
    for (const std::string& report : reports) last_report_bytes.push_back(report.size());
    std::vector<CycleOutcome> outcomes;
    for (Agreement& agreement : ranks) outcomes.push_back(agreement.apply(reports, now));
    return outcomes;
  }
  std::vector<Agreement> ranks;
  std::vector<size_t> last_report_bytes;
};

std::vector<std::string> names(const CycleOutcome& outcome) {
  std::vector<std::string> result;
  for (const TensorSpec& agreed : outcome.agreed) result.push_back(agreed.name);
  return result;
}

}  // namespace

TEST_CASE(tensor_is_agreed_only_when_every_rank_announced_it) {
  World world(3);
  world.ranks[0].announce(spec("a", 10));
  world.ranks[1].announce(spec("a", 10));
  std::vector<CycleOutcome> outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) EXPECT(outcome.agreed.empty());
  world.ranks[2].announce(spec("a", 10));
  outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) EXPECT(names(outcome) == std::vector<std::string>{"a"});
  EXPECT_EQ(world.ranks[0].pending(), 0u);
}

TEST_CASE(every_rank_derives_the_same_order_from_different_local_orders) {
  std::mt19937 random(5);
  World world(4);
  std::vector<std::string> all;
  for (int i = 0; i < 300; ++i) all.push_back("t" + std::to_string(i));
  std::vector<std::vector<std::string>> local_orders(4, all);
  for (auto& order : local_orders) std::shuffle(order.begin(), order.end(), random);
  std::vector<std::vector<std::string>> agreed(4);
  std::vector<size_t> position(4, 0);
  while (agreed[0].size() < all.size()) {
    for (int r = 0; r < 4; ++r) {  // each rank makes a random number ready per cycle
      const size_t burst = random() % 7;
      for (size_t k = 0; k < burst && position[r] < all.size(); ++k) {
        world.ranks[r].announce(spec(local_orders[r][position[r]++], 5));
      }
    }
    std::vector<CycleOutcome> outcomes = world.cycle();
    for (int r = 0; r < 4; ++r) {
      for (const std::string& name : names(outcomes[r])) agreed[r].push_back(name);
    }
  }
  for (int r = 1; r < 4; ++r) EXPECT(agreed[r] == agreed[0]);
  std::vector<std::string> sorted = agreed[0];
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::string> expected = all;
  std::sort(expected.begin(), expected.end());
  EXPECT(sorted == expected);
}

TEST_CASE(outcomes_name_each_tensor_by_the_id_its_own_rank_announced_it_with) {
  World world(2);
  world.ranks[0].announce(spec("a", 4), {}, 10);
  world.ranks[0].announce(spec("b", 4), {}, 11);
  world.ranks[0].announce(spec("bad", 4), {}, 12);
  world.ranks[1].announce(spec("bad", 5), {}, 22);
  world.ranks[1].announce(spec("b", 4), {}, 21);
  std::vector<CycleOutcome> outcomes = world.cycle();
  EXPECT(outcomes[0].agreed_ids == std::vector<uint64_t>{11});
  EXPECT(outcomes[1].agreed_ids == std::vector<uint64_t>{21});
  EXPECT_EQ(outcomes[0].failures.at(0).local_id, 12u);
  EXPECT_EQ(outcomes[1].failures.at(0).local_id, 22u);
  world.ranks[1].announce(spec("a", 4), {}, 20);
  outcomes = world.cycle();
  EXPECT(names(outcomes[0]) == std::vector<std::string>{"a"});
  EXPECT(outcomes[0].agreed_ids == std::vector<uint64_t>{10});
  EXPECT(outcomes[1].agreed_ids == std::vector<uint64_t>{20});
}

TEST_CASE(agreed_priority_is_the_most_urgent_one) {
  World world(2);
  world.ranks[0].announce(spec("p", 1, 7));
  world.ranks[1].announce(spec("p", 1, 2));
  const std::vector<CycleOutcome> outcomes = world.cycle();
  EXPECT_EQ(outcomes[0].agreed[0].priority, 2);
  EXPECT_EQ(outcomes[1].agreed[0].priority, 2);
}

TEST_CASE(mismatched_sizes_fail_on_every_rank_naming_tensor_and_ranks) {
  World world(3);
  world.ranks[0].announce(spec("w", 10));
  world.ranks[1].announce(spec("w", 20));
  world.ranks[2].announce(spec("w", 10));
  const std::vector<CycleOutcome> outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) {
    EXPECT(outcome.agreed.empty());
    EXPECT_EQ(outcome.failures.size(), 1u);
    const std::string& message = outcome.failures[0].message;
    EXPECT(message.find("'w'") != std::string::npos);
    EXPECT(message.find("ranks 0,2 submitted allreduce float32[10]") != std::string::npos);
    EXPECT(message.find("rank 1 submitted allreduce float32[20]") != std::string::npos);
  }
  EXPECT_EQ(world.ranks[0].pending(), 0u);
}

TEST_CASE(mismatched_dtypes_fail) {
  World world(2);
  world.ranks[0].announce(spec("d", 10, 0, DType::kFloat32));
  world.ranks[1].announce(spec("d", 10, 0, DType::kFloat64));
  const std::vector<CycleOutcome> outcomes = world.cycle();
  EXPECT_EQ(outcomes[1].failures.size(), 1u);
  EXPECT(outcomes[1].failures[0].message.find("float64") != std::string::npos);
}

TEST_CASE(second_use_of_a_name_travels_as_a_cached_id) {
  World world(2);
  const std::string long_name = "model.encoder.layer.11.attention.self.query.weight";
  for (Agreement& rank : world.ranks) rank.announce(spec(long_name, 1000));
  world.cycle();
  const size_t first_size = world.last_report_bytes[0];
  for (Agreement& rank : world.ranks) rank.announce(spec(long_name, 1000, 3));
  const std::vector<CycleOutcome> outcomes = world.cycle();
  EXPECT(world.last_report_bytes[0] + long_name.size() <= first_size);
  EXPECT(names(outcomes[0]) == std::vector<std::string>{long_name});
  EXPECT_EQ(outcomes[0].agreed[0].priority, 3);
  // A new shape under a cached name goes out in full and is checked again.
  world.ranks[0].announce(spec(long_name, 1000));
  world.ranks[1].announce(spec(long_name, 999));
  EXPECT_EQ(world.cycle()[0].failures.size(), 1u);
}

TEST_CASE(completed_bytes_shutdown_and_abort_are_shared) {
  World world(3);
  std::vector<ReportStatus> statuses(3);
  statuses[0].completed_bytes = 500;
  statuses[1].completed_bytes = 300;
  statuses[2].completed_bytes = 900;
  statuses[2].shutdown = true;
  statuses[1].abort_message = "disk on fire";
  const std::vector<CycleOutcome> outcomes = world.cycle(0, statuses);
  for (const CycleOutcome& outcome : outcomes) {
    EXPECT_EQ(outcome.min_completed_bytes, 300u);
    EXPECT_EQ(outcome.shutdown_rank, 2);
    EXPECT_EQ(outcome.abort_rank, 1);
    EXPECT_EQ(outcome.abort_message, std::string("disk on fire"));
  }
}

TEST_CASE(settings_requests_switch_every_rank_once_all_asked_and_then_stop_riding) {
  World world(3);
  std::vector<ReportStatus> statuses(3);
  const size_t idle_bytes = [&] {
    world.cycle(0, statuses);
    return world.last_report_bytes[0];
  }();
  statuses[0].settings_epoch = 1;
  statuses[0].settings.credit_bytes = 1u << 20;
  statuses[0].settings.policy = Policy::kFifo;
  statuses[1].settings_epoch = 1;
  std::vector<CycleOutcome> outcomes = world.cycle(0, statuses);
  for (const CycleOutcome& outcome : outcomes) EXPECT_EQ(outcome.min_settings_epoch, 0u);
  EXPECT(world.last_report_bytes[0] > idle_bytes);
  statuses[2].settings_epoch = 1;
  outcomes = world.cycle(0, statuses);
  for (const CycleOutcome& outcome : outcomes) {
    EXPECT_EQ(outcome.min_settings_epoch, 1u);
    EXPECT_EQ(outcome.root_settings_epoch, 1u);
    EXPECT_EQ(outcome.root_settings.credit_bytes, uint64_t{1} << 20);
    EXPECT(outcome.root_settings.policy == Policy::kFifo);
  }
  // Agreed: the settings no longer ride in every report.
  world.cycle(0, statuses);
  for (size_t bytes : world.last_report_bytes) EXPECT_EQ(bytes, idle_bytes);
}

TEST_CASE(a_cached_small_tensor_report_fits_the_smallest_exchange_slot) {
  World world(2);
  const std::string payload(4, 'p');
  for (Agreement& rank : world.ranks) rank.announce(spec("loss", 1), payload);
  world.cycle();
  std::vector<ReportStatus> statuses(2);
  statuses[0].completed_bytes = statuses[1].completed_bytes = uint64_t{1} << 34;
  for (Agreement& rank : world.ranks) rank.announce(spec("loss", 1, -7), payload);
  const std::vector<CycleOutcome> outcomes = world.cycle(0, statuses);
  EXPECT_EQ(outcomes[1].agreed[0].priority, -7);
  EXPECT_EQ(outcomes[1].inline_payloads[0][0], payload);
  EXPECT_EQ(outcomes[1].min_completed_bytes, uint64_t{1} << 34);
  // MPI's smallest slot is 32 bytes, 4 of them the report's length.
  EXPECT(world.last_report_bytes[0] <= 28u);
}

TEST_CASE(stalled_tensors_name_the_missing_ranks) {
  World world(3);
  world.ranks[0].announce(spec("late", 1));
  world.ranks[2].announce(spec("late", 1));
  world.cycle(10.0);
  EXPECT(world.ranks[0].stalled(15.0, 60.0).empty());
  const std::vector<StalledTensor> stalled = world.ranks[0].stalled(75.0, 60.0);
  EXPECT_EQ(stalled.size(), 1u);
  EXPECT_EQ(stalled[0].name, std::string("late"));
  EXPECT(stalled[0].missing_ranks == std::vector<int>{1});
  EXPECT(stalled[0].ready_ranks == (std::vector<int>{0, 2}));
}

TEST_CASE(malformed_reports_are_rejected_with_the_sender) {
  Agreement agreement(0, 2);
  Agreement other(1, 2);
  other.announce(spec("x", 4));
  std::string good = other.build_report({});
  std::string mine = agreement.build_report({});
  EXPECT_THROWS(agreement.apply({mine, good.substr(0, good.size() - 3)}, 0), CommError, "rank 1");
  std::string bad_magic = good;
  bad_magic[0] = 'X';
  std::string bad_flags = good;
  bad_flags[1] = static_cast<char>(0x80);
  EXPECT_THROWS(agreement.apply({mine, bad_flags}, 0), CommError, "bad flags");
  EXPECT_THROWS(agreement.apply({mine, bad_magic}, 0), CommError, "bad magic");
  EXPECT_THROWS(agreement.apply({mine, good + "junk"}, 0), CommError, "trailing");
  EXPECT_THROWS(agreement.apply({mine}, 0), CommError, "expected 2 reports");
}

TEST_CASE(announcing_a_name_twice_before_agreement_is_an_error) {
  World world(2);
  world.ranks[0].announce(spec("twice", 1));
  world.cycle();
  world.ranks[0].announce(spec("twice", 1));
  EXPECT_THROWS(world.cycle(), CommError, "twice");
}


TEST_CASE(inline_payloads_reach_every_rank_only_when_complete) {
  World world(3);
  const std::string bytes[3] = {std::string(8, 'a'), std::string(8, 'b'), std::string(8, 'c')};
  // Arriving in different rounds, the payloads are kept until the last rank announces.
  world.ranks[0].announce(spec("small", 2), bytes[0]);
  world.ranks[1].announce(spec("small", 2), bytes[1]);
  world.cycle();
  world.ranks[2].announce(spec("small", 2), bytes[2]);
  for (const CycleOutcome& outcome : world.cycle()) {
    EXPECT(names(outcome) == std::vector<std::string>{"small"});
    EXPECT(outcome.inline_payloads.size() == 1);
    EXPECT(outcome.inline_payloads[0] == std::vector<std::string>(bytes, bytes + 3));
  }
  // One rank without its payload (it turned inline off): every rank launches a collective instead.
  world.ranks[0].announce(spec("small", 2), bytes[0]);
  world.ranks[1].announce(spec("small", 2));
  world.ranks[2].announce(spec("small", 2), bytes[2]);
  for (const CycleOutcome& outcome : world.cycle()) {
    EXPECT(names(outcome) == std::vector<std::string>{"small"});
    EXPECT(outcome.inline_payloads[0].empty());
  }
}

TEST_CASE(inline_broadcast_needs_only_the_roots_payload) {
  World world(2);
  TensorSpec broadcast = spec("b", 4, 0, DType::kUInt8);
  broadcast.kind = CollectiveKind::kBroadcast;
  broadcast.root = 1;
  world.ranks[0].announce(broadcast);
  world.ranks[1].announce(broadcast, "root");
  for (const CycleOutcome& outcome : world.cycle()) {
    EXPECT(outcome.inline_payloads.size() == 1);
    EXPECT(outcome.inline_payloads[0].size() == 2);
    EXPECT(outcome.inline_payloads[0][1] == "root");
  }
}

TEST_CASE(inline_payload_of_the_wrong_size_is_rejected) {
  World world(2);
  world.ranks[0].announce(spec("small", 2), "seven b");
  world.ranks[1].announce(spec("small", 2), std::string(8, 'x'));
  EXPECT_THROWS(world.cycle(), CommError, "inline payload of 7 bytes for 'small'");
}

TEST_CASE(a_refusal_fails_the_tensor_on_every_rank_naming_the_rank_and_reason) {
  World world(3);
  world.ranks[0].announce(spec("g", 4), {}, 7);
  world.ranks[1].refuse("g", "op=\"average\" needs a floating dtype");
  std::vector<CycleOutcome> outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) EXPECT(outcome.failures.empty());  // rank 2 has not submitted
  world.ranks[2].announce(spec("g", 4), {}, 9);
  outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) {
    EXPECT(outcome.agreed.empty());
    EXPECT_EQ(outcome.failures.size(), 1u);
    EXPECT_EQ(outcome.failures[0].refused_by, 1);
    EXPECT(outcome.failures[0].message.find("'g' was refused on rank 1: op=\"average\" needs a floating dtype") !=
           std::string::npos);
  }
  EXPECT_EQ(outcomes[0].failures[0].local_id, 7u);
  EXPECT_EQ(outcomes[1].failures[0].local_id, kNoLocalTensor);
  EXPECT_EQ(outcomes[2].failures[0].local_id, 9u);
  for (const Agreement& rank : world.ranks) EXPECT(!rank.waiting_on_others());
  // The name is free again on every rank.
  for (Agreement& rank : world.ranks) rank.announce(spec("g", 4));
  for (const CycleOutcome& outcome : world.cycle()) EXPECT(names(outcome) == std::vector<std::string>{"g"});
}

TEST_CASE(a_refusing_rank_that_submits_again_ends_its_refusal_for_the_ranks_that_reported) {
  World world(3);
  world.ranks[0].announce(spec("g", 4), {}, 1);
  world.ranks[1].refuse("g", "bad root");
  world.ranks[1].announce(spec("g", 4), {}, 2);  // fixed, before rank 2 submitted
  std::vector<CycleOutcome> outcomes = world.cycle();
  EXPECT_EQ(outcomes[0].failures.size(), 1u);
  EXPECT_EQ(outcomes[0].failures[0].local_id, 1u);
  world.ranks[0].announce(spec("g", 4), {}, 3);
  world.ranks[2].announce(spec("g", 4), {}, 4);
  outcomes = world.cycle();
  for (const CycleOutcome& outcome : outcomes) EXPECT(names(outcome) == std::vector<std::string>{"g"});
  EXPECT(outcomes[1].agreed_ids == std::vector<uint64_t>{2});
}

TEST_CASE(overlong_names_and_messages_are_cut_or_rejected) {
  World world(2);
  world.ranks[0].refuse("x", std::string(200000, 'r'));  // a message is cut to fit, not malformed
  world.ranks[1].announce(spec("x", 1));
  const std::vector<CycleOutcome> outcomes = world.cycle();
  EXPECT_EQ(outcomes[1].failures.size(), 1u);
  Agreement receiver(0, 2);
  Agreement sender(1, 2);
  sender.announce(spec(std::string(kMaxTensorNameBytes + 1, 'n'), 1));
  EXPECT_THROWS(receiver.apply({receiver.build_report({}), sender.build_report({})}, 0), CommError, "string of");
}

TEST_CASE(the_name_cache_forgets_the_least_recently_agreed_names_alike_on_every_rank) {
  const size_t cap = 8;
  std::vector<Agreement> ranks;
  for (int r = 0; r < 3; ++r) ranks.emplace_back(r, 3, cap);
  std::mt19937 random(11);
  std::vector<std::string> agreed_names;
  // A few names used every round stay cached while a stream of new names passes through.
  for (int round = 0; round < 200; ++round) {
    std::vector<std::string> batch = {"hot0", "hot1", "new" + std::to_string(round)};
    if (round % 3 == 0) batch.push_back("new" + std::to_string(random() % (round + 1)));  // an old one, maybe forgotten
    std::sort(batch.begin(), batch.end());
    batch.erase(std::unique(batch.begin(), batch.end()), batch.end());
    std::vector<std::string> reports;
    for (Agreement& rank : ranks) {
      std::vector<std::string> order = batch;
      std::shuffle(order.begin(), order.end(), random);
      for (const std::string& name : order) rank.announce(spec(name, name.size()));
      reports.push_back(rank.build_report({}));
    }
    std::vector<std::vector<std::string>> outcomes;
    for (Agreement& rank : ranks) outcomes.push_back(names(rank.apply(reports, 0)));
    for (size_t r = 1; r < ranks.size(); ++r) EXPECT(outcomes[r] == outcomes[0]);
    std::vector<std::string> sorted = outcomes[0];
    std::sort(sorted.begin(), sorted.end());
    EXPECT(sorted == batch);
    for (const Agreement& rank : ranks) EXPECT(rank.cached_names() <= cap);
  }
  // The hot names travel as cached ids: a report of both is far smaller than their names.
  for (Agreement& rank : ranks) {
    rank.announce(spec("hot0", 4));
    rank.announce(spec("hot1", 4));
  }
  std::vector<std::string> reports;
  for (Agreement& rank : ranks) reports.push_back(rank.build_report({}));
  EXPECT(reports[0].size() <= 14u);
  for (Agreement& rank : ranks) EXPECT_EQ(rank.apply(reports, 0).agreed.size(), 2u);
}

TEST_CASE(a_grouped_call_of_another_length_fails_every_member_on_every_rank) {
  World world(3);
  const auto member = [](const std::string& group, uint32_t index, uint32_t size) {
    TensorSpec result = spec(group + "." + std::to_string(index), 4);
    if (size > 1) {  // a group of one goes untagged, as Runtime::enqueue_group sends it
      result.group_size = size;
      result.group_index = index;
    }
    return result;
  };
  world.ranks[0].announce(member("g", 0, 1), {}, 100);
  for (int r = 1; r < 3; ++r) {
    world.ranks[r].announce(member("g", 0, 2), {}, 10 * r);
    world.ranks[r].announce(member("g", 1, 2), {}, 10 * r + 1);
  }
  std::vector<CycleOutcome> outcomes = world.cycle();
  const std::string expected = "grouped_allreduce 'g' was called with 1 tensor on rank 0 and 2 tensors on ranks 1,2";
  for (int r = 0; r < 3; ++r) {
    EXPECT(outcomes[r].agreed.empty());
    EXPECT_EQ(outcomes[r].failures.size(), 2u);  // g.0, and g.1 that rank 0 will never send
    for (const TensorFailure& failure : outcomes[r].failures) {
      EXPECT(failure.message.find(expected) != std::string::npos);
    }
    EXPECT_EQ(world.ranks[r].pending(), 0u);
    EXPECT(!world.ranks[r].waiting_on_others());
  }
  EXPECT_EQ(outcomes[0].failures[0].local_id, 100u);
  EXPECT_EQ(outcomes[0].failures[1].local_id, kNoLocalTensor);
  EXPECT_EQ(outcomes[2].failures[0].local_id, 20u);
  EXPECT_EQ(outcomes[2].failures[1].local_id, 21u);
  // The same lengths agree, also when the group is submitted in later rounds and cached.
  for (int round = 0; round < 2; ++round) {
    for (int r = 0; r < 3; ++r) {
      world.ranks[r].announce(member("g", 0, 2), {}, 1);
      world.ranks[r].announce(member("g", 1, 2), {}, 2);
    }
    outcomes = world.cycle();
    for (const CycleOutcome& outcome : outcomes) EXPECT((names(outcome) == std::vector<std::string>{"g.0", "g.1"}));
  }
}

TEST_CASE(a_longer_group_reported_rounds_before_the_shorter_one_is_failed_when_it_comes) {
  World world(2);
  TensorSpec first = spec("h.0", 4), second = spec("h.1", 4), third = spec("h.2", 4);
  first.group_size = second.group_size = third.group_size = 3;
  second.group_index = 1;
  third.group_index = 2;
  world.ranks[0].announce(first, {}, 1);
  world.ranks[0].announce(second, {}, 2);
  world.ranks[0].announce(third, {}, 3);
  world.cycle();
  EXPECT_EQ(world.ranks[1].pending(), 3u);
  TensorSpec other_first = spec("h.0", 4), other_second = spec("h.1", 4);
  other_first.group_size = other_second.group_size = 2;
  other_second.group_index = 1;
  world.ranks[1].announce(other_first, {}, 4);
  world.ranks[1].announce(other_second, {}, 5);
  std::vector<CycleOutcome> outcomes = world.cycle();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(outcomes[r].failures.size(), 3u);
    EXPECT(outcomes[r].failures[0].message.find("2 tensors on rank 1 and 3 tensors on rank 0") != std::string::npos);
    EXPECT_EQ(world.ranks[r].pending(), 0u);
  }
}
