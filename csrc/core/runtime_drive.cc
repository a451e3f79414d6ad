// Who drives the core and when: the core's thread, or a caller waiting for its handle, runs
// agreement rounds and polls collectives in flight.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>

#include "core/runtime.h"
#include "core/text.h"
#include "core/timer_slack.h"

namespace commsched {

namespace {

// While this rank waits for others to announce what it already has, it retries the
// exchange at once and backs off up to a quarter cycle when nothing moves.
constexpr auto kEagerBackoffStep = std::chrono::microseconds(10);
// A waiting caller looks at its handle and the core at least this often.
constexpr auto kCallerSlice = std::chrono::milliseconds(50);
// A caller's sleep shorter than this is a poll that the default timer slack would stretch.
constexpr auto kShortSleep = std::chrono::milliseconds(1);
// A caller driving a transport that wants constant polling yields once per this many passes,
// each a burst of up to this many tests.
constexpr unsigned kPollsPerYield = 16;
constexpr unsigned kTestsPerBurst = 32;
// The core's thread leaves a round no peer answers this often, to look for a shutdown()...
constexpr auto kRoundSlice = std::chrono::milliseconds(100);
// ...and stops without them after COMMSCHED_STALL_TIMEOUT, at most this long: a running peer's
// core thread answers every round within a cycle, even while its program computes.
constexpr double kShutdownAnswerS = 10.0;

}  // namespace

Runtime::Clock::duration Runtime::shutdown_answer_limit() const {
  return std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(std::min(kShutdownAnswerS, settings_.stall_timeout_s)));
}

void Runtime::loop() {
  const FineTimerSlack slack;  // short polling sleeps are only cheap if the kernel wakes us on time
  Clock::time_point shutdown_seen{};
  while (wait_for_news()) {
    // Rounds run in slices, so a shutdown() that comes while a peer never answers (stopped, frozen)
    // waits on it for shutdown_answer_limit() rather than COMMSCHED_STALL_SHUTDOWN.
    bool running = run_round(Clock::now() + kRoundSlice);
    if (running && round_open_) warn_of_silent_ranks();
    const bool waiting_at_shutdown = running && round_open_ && shutdown_requested_.load();
    if (waiting_at_shutdown && shutdown_seen == Clock::time_point{}) shutdown_seen = Clock::now();
    if (waiting_at_shutdown && Clock::now() - shutdown_seen >= shutdown_answer_limit()) {
      const std::string why = "commsched.shutdown() on rank " + std::to_string(rank_) +
                              ": the other ranks did not all answer within " + seconds_text(shutdown_answer_limit()) +
                              "s (a rank stopped or hung), so this rank stopped without them";
      logger_.warning(why);
      transport_->peer_lost(why, -1);  // what waits on the silent ranks gives up instead (MPI: no finalize)
      stop_everything(why);
      running = false;
    }
    {
      std::lock_guard<std::mutex> lock(inbox_mutex_);
      driving_ = false;
    }
    callers_cv_.notify_all();  // a caller waiting for the driver role may take it
    if (!running) return;
  }
}

bool Runtime::round_due_locked(Clock::time_point now) const {
  return round_open_ || !inbox_.empty() || refusals_waiting_ || join_requested_ || shutdown_requested_ ||
         !abort_message_.empty() || !abort_requested_.empty() || now >= next_round_;
}

bool Runtime::poll_for_news() {
  // A completion is news only when queued chunks wait for the credit it frees: credit comes
  // back through the next round, as the least any rank has completed, so every rank pops the
  // same units at the same round. (Releasing it at the local completion lets ranks pop at
  // different times, which hangs a grid of reconfigure() switches on the rig even with catch-up.)
  if (in_flight_.empty()) return false;
  try {
    return poll_in_flight() && scheduler_.queued_chunks() > 0;
  } catch (const std::exception& error) {
    record_failure(error);
    return true;
  }
}

bool Runtime::wait_for_news() {
  std::unique_lock<std::mutex> lock(inbox_mutex_);
  while (true) {
    if (stopped_) return false;
    if (driving_ || (callers_drive_ && callers_waiting_ > 0)) {
      // A waiting caller runs the core; it wakes this thread when it leaves work behind.
      // Otherwise this thread takes up the heartbeat by itself within a cycle of the last
      // caller leaving: waking it after every short collective would cost a context switch,
      // and a CPU, per collective.
      lock.unlock();
      sleep_while_callers_drive();
      lock.lock();
      continue;
    }
    driving_ = true;
    lock.unlock();
    const bool completion_news = poll_for_news();
    lock.lock();
    const auto now = Clock::now();
    if (completion_news || round_due_locked(now)) return true;
    driving_ = false;
    if (callers_waiting_ > 0) callers_cv_.notify_all();  // one may take the role now
    if (doorbell_rang_) {  // a completion: poll again before sleeping
      doorbell_rang_ = false;
      continue;
    }
    // Sleep without the driver role, so a caller that starts waiting may drive.
    Clock::time_point wake_at;
    if (in_flight_.empty()) {
      wake_at = next_round_;
    } else if (poll_interval_.count() > 0) {
      wake_at = std::min(next_round_, now + poll_interval_);
    } else {
      // The transport moves data only while polled: keep polling, but give the core to
      // any other runnable thread between polls.
      lock.unlock();
      std::this_thread::yield();
      lock.lock();
      continue;
    }
    loop_cv_.wait_until(lock, wake_at);
  }
}

void Runtime::sleep_while_callers_drive() {
  // Looks each cycle without inbox_mutex_, which every pass of a driving caller takes: taking
  // it here, and the hand-offs that followed, slowed a 4 MiB MPI allreduce 10-15% on a host
  // with no spare core (about as fast as raw MPI without).
  std::unique_lock<std::mutex> idle(idle_mutex_);
  while (callers_waiting_.load() > 0 && !idle_wake_) idle_cv_.wait_for(idle, cycle_);
  idle_wake_ = false;
}

void Runtime::wake_core_thread() {
  loop_cv_.notify_all();
  {
    std::lock_guard<std::mutex> idle(idle_mutex_);  // so a thread deciding to sleep sees the flag or the notice
    idle_wake_ = true;
  }
  idle_cv_.notify_all();
}

void Runtime::wake_all() {
  wake_core_thread();
  callers_cv_.notify_all();
}

void Runtime::record_failure(const std::exception& error) {
  // Told to every rank with the next report, so all stop in the same cycle.
  if (abort_message_.empty()) abort_message_ = error.what();
  logger_.log(LogLevel::kError, abort_message_);
}

bool Runtime::wait(const HandleState& handle, double timeout_s, bool until_launched) {
  const auto ready = [&handle, until_launched] { return until_launched ? handle.launched_or_done() : handle.done(); };
  if (!callers_drive_) return until_launched ? handle.wait_launched(timeout_s) : handle.wait(timeout_s);
  // The limit counts from the first pass's clock read (one read fewer per small collective).
  auto give_up = Clock::time_point::max();
  const auto limit = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  std::unique_lock<std::mutex> lock(inbox_mutex_);
  ++callers_waiting_;
  bool leave_work = false;
  unsigned polls = 0;
  // Set at the first short sleep: a caller polling NCCL's events every 20 us otherwise woke 50 us
  // late each time (Linux's default timer slack): 108 us for a 4-byte allreduce on
  // tests/fake_cuda's library at one rank, 47 us with the fine slack.
  std::optional<FineTimerSlack> slack;
  // A device collective in flight is tested without sleeping for caller_spin_ from the start.
  auto spin_until = Clock::time_point::min();
  for (bool first = true; !ready() && !stopped_; first = false) {
    const auto now = Clock::now();
    if (first && timeout_s >= 0) give_up = now + limit;
    if (first) spin_until = now + caller_spin_;
    if (now >= give_up) break;
    auto look_again = std::min(give_up, now + kCallerSlice);
    if (!driving_) {
      driving_ = true;
      doorbell_rang_ = false;  // this pass polls whatever rang it
      const bool due = round_due_locked(now);
      lock.unlock();
      look_again = std::min(look_again, drive_for_caller(due, give_up));
      // What this caller leaves behind needs the core's thread once no caller waits.
      const bool in_flight = !in_flight_.empty();
      leave_work = round_open_ || in_flight || scheduler_.queued_chunks() > 0 || agreement_.waiting_on_others();
      lock.lock();
      // Not for a heartbeat due soon: the core's thread looks each cycle by itself, and a
      // wake-up per collective here kept it bouncing in and out of its sleep.
      leave_work = leave_work || !inbox_.empty();
      driving_ = false;
      // This pass may have finished other callers' tensors, and one of them may drive next.
      if (callers_waiting_ > 1) callers_cv_.notify_all();
      if (ready()) break;
      const auto after = Clock::now();
      if (look_again <= after || (in_flight && after < spin_until)) {
        // MPI moves a large message only inside its test calls: yielding after every poll
        // slowed a 4 MiB allreduce by 7%. Every few polls still leave the CPU to other threads.
        if (++polls % kPollsPerYield == 0) {
          lock.unlock();
          std::this_thread::yield();
          lock.lock();
        }
        continue;
      }
      // A completion that rang during this pass notified before this caller waits: sleeping
      // now would leave it until look_again (a transport's whole poll interval).
      if (doorbell_rang_) continue;
    }
    if (!slack && look_again - now < kShortSleep) slack.emplace();
    callers_cv_.wait_until(lock, look_again);
  }
  --callers_waiting_;
  if (callers_waiting_ == 0 && !driving_ && leave_work) wake_core_thread();
  const bool stopped = stopped_;
  lock.unlock();
  if (ready()) return true;
  if (!stopped) return false;
  // Stopping fails every handle; wait for that on the handle itself.
  if (timeout_s < 0) return handle.wait(-1.0);
  if (give_up == Clock::time_point::max()) return handle.wait(timeout_s);  // stopped before the first pass
  return handle.wait(std::max(0.0, std::chrono::duration<double>(give_up - Clock::now()).count()));
}

Runtime::Clock::time_point Runtime::drive_for_caller(bool due, Clock::time_point give_up) {
  due = poll_for_news() || due;
  if (!due && poll_interval_.count() == 0) {
    // A transport that moves data only while tested (MPI progresses a large message inside its
    // test calls) gets a burst of tests without the locks and clock reads of a whole pass.
    for (unsigned tests = 1; tests < kTestsPerBurst && !due && !in_flight_.empty(); ++tests) due = poll_for_news();
  }
  if (due) {
    if (run_round(give_up) && round_open_) warn_of_silent_ranks();
    return Clock::time_point::min();  // look again at once
  }
  if (!in_flight_.empty()) return Clock::now() + poll_interval_;
  return next_round_;
}

void Runtime::open_round() {
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    if (abort_message_.empty() && !abort_requested_.empty()) abort_message_ = abort_requested_;
  }
  ReportStatus status{completed_bytes_, shutdown_requested_.load(), abort_message_};
  take_set_changes();  // before the submissions: a set's first collective may be among them
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    status.join = join_requested_;
    join_requested_ = false;
  }
  take_refusals();
  take_submissions(status);
  open_had_news_ = agreement_.has_announcements();
  open_exchange_start_us_ = timeline_.stamp_us();
  if (timeline_.marks_cycles()) timeline_.instant("CYCLE_START", Timeline::kAgreementTrack, open_exchange_start_us_);
  timeline_.flush_if_due(open_exchange_start_us_);
  // With nothing in flight a round carrying news is all this rank waits on: worth a brief spin.
  // Heartbeats and retries while a slower rank catches up sleep, so waiting costs no CPU.
  open_critical_ = open_had_news_ && in_flight_.empty();
  open_report_ = agreement_.build_report(status);
  round_open_ = true;
  round_opened_at_ = Clock::now();
  round_silence_warned_ = false;
}

void Runtime::warn_of_silent_ranks() {
  const Clock::duration open_for = Clock::now() - round_opened_at_;
  if (round_silence_warned_ || open_for < std::chrono::duration<double>(settings_.stall_timeout_s)) return;
  round_silence_warned_ = true;
  const std::vector<int> silent = control_.silent_ranks();
  const std::string who = silent.empty() ? "another rank" : rank_list(silent);
  const auto limit = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(exchange_timeout_s_));
  logger_.warning("an agreement round has waited " + seconds_text(open_for) + "s, past COMMSCHED_STALL_TIMEOUT, for " +
                  who + " to answer (a running rank's core thread answers within a cycle: stopped, frozen or hung?); " +
                  "the job stops at COMMSCHED_STALL_SHUTDOWN=" + seconds_text(limit) + "s");
}

bool Runtime::run_round(Clock::time_point yield_at) {
  CycleOutcome& outcome = outcome_;
  // Read once: a round on shared memory takes a few microseconds, and each read ~20 ns.
  Clock::time_point after_exchange;
  try {
    if (!round_open_) open_round();
    // A caller whose deadline comes first leaves the round open: its wait returns on time, and the
    // next driver goes on with the same report (a stopped peer would hold it until the stall limit).
    if (!control_.exchange_until(open_report_, exchange_timeout_s_, open_critical_, yield_at, round_reports_)) {
      return true;
    }
    round_open_ = false;
    after_exchange = Clock::now();
    agreement_.apply(round_reports_, std::chrono::duration<double>(after_exchange - started_).count(), outcome);
    if (timeline_.enabled() && (open_had_news_ || !outcome.agreed.empty())) {
      timeline_.complete("agree", Timeline::kAgreementTrack, open_exchange_start_us_,
                         Timeline::now_us() - open_exchange_start_us_,
                         "{\"agreed\":" + std::to_string(outcome.agreed.size()) + "}");
    }
    stats_.cycles.fetch_add(1, std::memory_order_relaxed);
    if (control_.over_channel()) stats_.control_channel_rounds.fetch_add(1, std::memory_order_relaxed);
    if (open_critical_ && control_.spins_on_critical_rounds()) {
      stats_.spun_rounds.fetch_add(1, std::memory_order_relaxed);
    }
    stats_.cached_names.store(agreement_.cached_names(), std::memory_order_relaxed);
  } catch (const control::PeerLost& lost) {
    // The control channel knows which rank it lost: handles then name it (RankFailure.rank).
    stop_everything("rank " + std::to_string(rank_) + " lost contact with the other ranks: " + lost.what(),
                    lost.rank());
    return false;
  } catch (const std::exception& error) {
    // The control path itself failed: nobody can be told, so stop here.
    stop_everything("rank " + std::to_string(rank_) + " lost contact with the other ranks: " + error.what());
    return false;
  }
  if (outcome.abort_rank >= 0) {
    stop_everything("rank " + std::to_string(outcome.abort_rank) + " failed: " + outcome.abort_message,
                    outcome.abort_rank);
    return false;
  }
  bool credit_news = false;
  try {
    apply_outcome(outcome);
    // When stopping, pop nothing new: what is in flight finishes, what is queued fails on every rank alike.
    if (outcome.shutdown_rank < 0) launch_ready();
    credit_news = poll_in_flight() && scheduler_.queued_chunks() > 0;
  } catch (const std::exception& error) {
    record_failure(error);
  }
  if (outcome.shutdown_rank >= 0) {
    stop_everything("commsched.shutdown() was called on rank " + std::to_string(outcome.shutdown_rank));
    return false;
  }
  if (agreement_.waiting_on_others()) {
    const bool progress = outcome.announcements > 0 || !outcome.agreed.empty();
    eager_backoff_ =
        progress ? Clock::duration{0} : std::min<Clock::duration>(2 * eager_backoff_ + kEagerBackoffStep, cycle_ / 4);
    next_round_ = after_exchange + eager_backoff_;
  } else {
    // Only an idle rank stretches its heartbeat. With collectives in flight, another rank
    // may sit in an exchange, unable to launch the unit this rank's next completion needs
    // until this rank joins: so this rank joins within a cycle.
    // A joined rank never stretches it: every collective the others start waits for its report.
    const bool quiet = outcome.announcements == 0 && outcome.agreed.empty() && !agreement_.has_joined(rank_) &&
                       outcome.min_settings_epoch == outcome.root_settings_epoch && in_flight_.empty() &&
                       scheduler_.queued_chunks() == 0;
    heartbeat_ = quiet ? std::min<Clock::duration>(2 * heartbeat_, kMaxQuietCycles * cycle_) : cycle_;
    next_round_ = after_exchange + heartbeat_;
  }
  // Collectives that finished while this round exchanged (its report predates them) free credit
  // that queued chunks wait for, and only the next round gives it back: that round is due now,
  // not a heartbeat later (the link sat idle for a cycle after every credit window on the rig).
  // So is the round after one where another rank's report predated a completion this rank had
  // already reported: that rank opens the next round the moment it sees its completion (its
  // credit_news), and waiting a heartbeat to join it held every other 4 MiB partition on MPICH
  // shared memory for a whole cycle (1.1 ms gaps after 1.1 ms allreduces).
  const bool credit_owed = outcome.min_completed_bytes < completed_bytes_ && scheduler_.queued_chunks() > 0;
  if (credit_news || credit_owed) next_round_ = after_exchange;
  check_stalls(std::chrono::duration<double>(after_exchange - started_).count());
  return true;
}

}  // namespace commsched
