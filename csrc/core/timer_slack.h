// Fine timer slack for a thread that sleeps in short polls.
#pragma once

#ifdef __linux__
#include <sys/prctl.h>
#endif

namespace commsched {

// Linux lets a sleeping thread wake up to its timer slack late (50 us by default), so a 20 us
// poll of a collective in flight slept 74 us on a 2-core VM. The slack this sets keeps such a
// poll within a few microseconds of its deadline.
inline constexpr unsigned long kPollTimerSlackNs = 1000;

// Sets the calling thread's timer slack to kPollTimerSlackNs for its lifetime and restores what
// it was after: the thread may be the user's, which chose its own slack.
class FineTimerSlack {
 public:
  FineTimerSlack() {
#ifdef __linux__
    const int previous = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    if (previous >= 0 && static_cast<unsigned long>(previous) > kPollTimerSlackNs &&
        prctl(PR_SET_TIMERSLACK, kPollTimerSlackNs, 0, 0, 0) == 0) {
      restore_ns_ = static_cast<unsigned long>(previous);
    }
#endif
  }
  ~FineTimerSlack() {
#ifdef __linux__
    if (restore_ns_ != 0) prctl(PR_SET_TIMERSLACK, restore_ns_, 0, 0, 0);
#endif
  }
  FineTimerSlack(const FineTimerSlack&) = delete;
  FineTimerSlack& operator=(const FineTimerSlack&) = delete;

 private:
  unsigned long restore_ns_ = 0;  // 0: nothing to restore
};

}  // namespace commsched
