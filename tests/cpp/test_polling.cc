// The pause between tests of collectives in flight (core/polling.h).
#include "check.h"
#include "core/polling.h"

using namespace commsched;
using std::chrono::microseconds;

TEST_CASE(a_transport_that_moves_data_only_while_tested_pauses_half_a_network_latency) {
  EXPECT_EQ(poll_interval_for(microseconds(0), -1.0, 44e-6).count(), 22);  // the rig: 30-45 us messages
  EXPECT_EQ(poll_interval_for(microseconds(0), -1.0, 8e-6).count(), 4);
  EXPECT_EQ(poll_interval_for(microseconds(0), -1.0, 1e-3).count(), kMaxSleepingPoll.count());  // capped
}

TEST_CASE(shared_memory_and_unknown_links_are_tested_without_pause) {
  EXPECT_EQ(poll_interval_for(microseconds(0), -1.0, 2.7e-6).count(), 0);  // MPI's shared memory
  EXPECT_EQ(poll_interval_for(microseconds(0), -1.0, 0.0).count(), 0);     // not measured, or one host
}

TEST_CASE(a_transport_with_its_own_pause_keeps_it_and_the_users_request_wins) {
  EXPECT_EQ(poll_interval_for(microseconds(2000), -1.0, 45e-6).count(), 2000);  // Gloo
  EXPECT_EQ(poll_interval_for(microseconds(2000), 0.0, 45e-6).count(), 0);
  EXPECT_EQ(poll_interval_for(microseconds(0), 100e-6, 2.7e-6).count(), 100);
}
