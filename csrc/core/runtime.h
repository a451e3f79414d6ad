// The one runtime object per process: owns the transport, the agreement, the
// scheduler and the background thread that drives them.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core/agreement.h"
#include "core/control_path.h"
#include "core/handle.h"
#include "core/log.h"
#include "core/node_recycler.h"
#include "core/scheduler.h"
#include "core/settings.h"
#include "core/timeline.h"
#include "transport/transport.h"

namespace commsched {

struct RuntimeStats {
  uint64_t cycles = 0;
  uint64_t launches = 0;
  uint64_t fused_launches = 0;
  uint64_t chunks = 0;
  uint64_t launched_bytes = 0;
  uint64_t max_bytes_in_flight = 0;  // as the credit gate saw it
  uint64_t max_launch_bytes = 0;
  uint64_t completed_tensors = 0;
  uint64_t failed_tensors = 0;
  uint64_t inline_tensors = 0;  // completed from the agreement reports, without a collective
  uint64_t cached_names = 0;  // tensor names the agreement remembers (bounded, see Agreement)
  uint64_t control_channel_rounds = 0;  // rounds exchanged over the TCP control channel, not the transport
  uint64_t spun_rounds = 0;  // channel rounds allowed to spin before sleeping (ControlPath::spins_on_critical_rounds)
};

// The counters behind RuntimeStats: bumped by the driver and read from any thread, as relaxed
// atomics, since a lock per bump cost more than the bump on a 2 us collective.
struct LiveStats {
  std::atomic<uint64_t> cycles{0};
  std::atomic<uint64_t> launches{0};
  std::atomic<uint64_t> fused_launches{0};
  std::atomic<uint64_t> chunks{0};
  std::atomic<uint64_t> launched_bytes{0};
  std::atomic<uint64_t> max_bytes_in_flight{0};
  std::atomic<uint64_t> max_launch_bytes{0};
  std::atomic<uint64_t> completed_tensors{0};
  std::atomic<uint64_t> failed_tensors{0};
  std::atomic<uint64_t> inline_tensors{0};
  std::atomic<uint64_t> cached_names{0};
  std::atomic<uint64_t> control_channel_rounds{0};
  std::atomic<uint64_t> spun_rounds{0};

  RuntimeStats snapshot() const;
};

class Runtime {
 public:
  Runtime(const RuntimeSettings& settings, std::unique_ptr<Transport> transport);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // Submits a collective on `data` (in place). Thread-safe. Throws UsageError when the
  // name is already in flight or the arguments are wrong (then every rank hears of the refusal,
  // see refuse()), Failure when the runtime has stopped. `wake_core` false leaves the core's
  // thread asleep: for a caller that waits for the handle next and so runs the core itself.
  // `placement` says where the bytes live (GPU tensors: the stream that produces them).
  std::shared_ptr<HandleState> enqueue(const TensorSpec& spec, void* data, bool wake_core = true,
                                       const Placement& placement = {});

  // One member of enqueue_group().
  struct GroupMember {
    TensorSpec spec;
    void* data = nullptr;
    Placement placement;
  };
  // Submits several collectives at once: they reach the inbox together, so every rank announces
  // them in one report and the agreement admits them in one round, where the scheduler may fuse
  // them into one launch. A member refused here refuses the whole group, on every rank.
  std::vector<std::shared_ptr<HandleState>> enqueue_group(const std::vector<GroupMember>& members,
                                                          bool wake_core = true);

  // Tells every rank that this rank refused a submission of `name` for `reason`, so their
  // collectives under that name fail with it instead of waiting. Nothing happens while the
  // name is in flight here (that submission goes on) or when the runtime has stopped.
  void refuse(const std::string& name, const std::string& reason, int32_t process_set = 0);

  // Registers process set `id` (its ranks, ascending, at least one) with the transport and, before
  // this rank's next report, with the agreement. Every rank calls it with the same arguments in the
  // same order, and then waits for a global barrier before using the set. Blocks while the transport
  // builds the set's communicator (the members meet there); any thread.
  void add_process_set(int32_t id, const std::vector<int>& ranks);
  // Forgets process set `id` on this rank; every rank calls it once nothing runs on the set.
  void remove_process_set(int32_t id);
  // The ranks of process set `id` (0: every rank); throws UsageError for an unknown id.
  std::vector<int> process_set_ranks(int32_t id) const;

  // Stops every rank in the next round with `reason` as this rank's failure (say, the process is
  // exiting on an uncaught exception), so the others name it instead of seeing a plain shutdown.
  void abort(const std::string& reason);

  // Adds `hint` to every stall warning and failure of a tensor whose name starts with `prefix`
  // (replacing an earlier hint for it): what usually leaves a plug-in's own collectives waiting.
  void add_stall_hint(const std::string& prefix, const std::string& hint);

  // Announces that this rank has run out of data (Horovod's join). Until every rank has joined,
  // this rank launches every allreduce the others agree on with zeros and every allgather with
  // nothing of its own; the handle completes once every rank has joined, and last_joined_rank()
  // then names the last to join. Throws UsageError while a join of this rank is pending, or on a
  // transport whose memory the core cannot fill (device memory); Failure when stopped.
  std::shared_ptr<HandleState> join();
  // The rank the last completed join() named; -1 before any.
  int last_joined_rank() const { return last_joined_rank_.load(); }

  // Asks for new scheduling settings; they take effect on every rank in the same cycle,
  // once every rank has asked as many times (rank 0's settings win).
  void request_settings(const SchedulingSettings& settings);
  SchedulingSettings applied_settings() const;

  // Waits until `handle` is done; false on timeout (a negative timeout waits without limit).
  // While the core's thread sleeps, the waiting thread runs the core itself: on a transport
  // callable from any thread that saves two thread hand-offs per collective.
  // `until_launched`: return as soon as a device transport launched every chunk of the tensor (the
  // handle then has a stream mark a consumer's stream can wait on), not when the GPU finished.
  bool wait(const HandleState& handle, double timeout_s, bool until_launched = false);

  // Asks every rank to stop, waits for in-flight collectives, fails what is left.
  void shutdown();

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::string transport_name() const { return transport_name_; }
  bool running() const { return !stopped_.load(); }
  // Throws what a submission would throw once this runtime stopped (RankFailure after a lost rank).
  void require_running(const std::string& what) const;
  RuntimeStats stats() const;
  // Where a pending tensor stands, for timeout messages.
  std::string describe(const std::string& name) const;
  // A span from outside the core (e.g. checkpoint writes) on its own timeline track; any thread.
  void trace_span(const std::string& track, const std::string& name, uint64_t ts_us, uint64_t dur_us,
                  const std::string& args_json) {
    timeline_.span(track, name, ts_us, dur_us, args_json);
  }
  // Starts (or moves) the trace to `path` while running; `mark_cycles` marks each round of the core.
  void start_timeline(const std::string& path, bool mark_cycles) {
    timeline_.open(path, rank_);
    timeline_.set_mark_cycles(mark_cycles);
  }
  // Ends the trace file started by start_timeline() or COMMSCHED_TIMELINE.
  void stop_timeline() { timeline_.close(); }

 private:
  struct Submission {
    TensorSpec spec;
    void* data = nullptr;
    std::shared_ptr<HandleState> handle;
    uint64_t enqueued_us = 0;
    // The tensor's entry in active_names_ (unordered_map entries stay put while others come and
    // go), so its phase changes under the lock without looking the name up again.
    const char** phase = nullptr;
  };
  struct LocalTensor {
    TensorSpec spec;
    void* data = nullptr;
    std::shared_ptr<HandleState> handle;
    uint32_t chunks_left = 0;
    uint64_t trace_id = 0;
    bool agreed = false;
    bool launched = false;
    const char** phase = nullptr;  // as in Submission; guarded by inbox_mutex_
    std::vector<uint64_t> layout;  // the agreed per-rank counts (collectives with an output)
    std::shared_ptr<FusionBuffer> output;  // allocated at launch
    uint64_t output_elements = 0;
    // A joined rank's stand-in for a tensor it never submitted: `data` points here, all zeros.
    std::vector<uint64_t> zeros;
    bool stand_in = false;
    uint32_t chunks_unlaunched = 0;  // until 0, when the handle learns the stream mark of the last launch
  };
  struct InFlight {
    Launch launch;
    // Memory the transport writes or reads until the op ends, declared before `op` to outlive it.
    std::shared_ptr<FusionBuffer> output;
    std::unique_ptr<FusionBuffer> scratch;  // a scaled copy of the input (reducescatter's prescale)
    // Before `op`, so it outlives it: an op dropped unfinished (a failed job) ends its device work
    // when destroyed, and only then may the memory it used go.
    std::unique_ptr<FusionBuffer> fusion_buffer;  // null for an unfused launch
    std::unique_ptr<PendingOp> op;
    void* wire_data = nullptr;
    uint64_t started_us = 0;
    int set_size = 1;  // the ranks of its process set, which average divides by
  };

  using Clock = std::chrono::steady_clock;

  void loop();
  // How long shutdown() waits for the other ranks to answer its rounds before stopping without them.
  Clock::duration shutdown_answer_limit() const;
  // Runs one agreement round and what it admits; false once the runtime has stopped. Once
  // `yield_at` passed with the exchange unfinished it returns true with the round left open
  // (round_open_), for the next driver to go on with.
  bool run_round(Clock::time_point yield_at = Clock::time_point::max());
  // Takes what waits in the inbox into a new round's report (open_report_).
  void open_round();
  // Once per round open past COMMSCHED_STALL_TIMEOUT, warns naming the ranks that did not answer.
  void warn_of_silent_ranks();
  // Background thread: returns holding the driver role once a round is due, false once stopped.
  bool wait_for_news();
  // A waiting caller's turn at the core, driver role held: a round if one is due, else a poll.
  // Returns when the caller should look again without the role.
  // `due`: a round is due by the state the caller saw under the lock; `give_up`: the caller's
  // deadline, at which it leaves a round it cannot finish open.
  Clock::time_point drive_for_caller(bool due, Clock::time_point give_up);
  // Wakes the core's thread and every waiting caller: there is news for whoever drives.
  void wake_all();
  // Wakes the core's thread alone, from whichever sleep it is in.
  void wake_core_thread();
  // The core's thread while callers drive: back when none waits any more or it is woken.
  void sleep_while_callers_drive();
  // Keeps the first failure, which the next report carries to every rank.
  void record_failure(const std::exception& error);
  bool round_due_locked(Clock::time_point now) const;
  // Polls collectives in flight; true when one finished and queued chunks wait for its credit.
  bool poll_for_news();
  // Moves the inbox to the driver's tables and reads the settings request for `status`.
  void take_submissions(ReportStatus& status);
  void apply_outcome(const CycleOutcome& outcome);
  // Reduces (or takes the root's) bytes that every rank sent inline, and completes the tensor.
  void complete_inline(uint64_t id, const TensorSpec& spec, const std::vector<std::string>& payloads);
  // A joined rank's zero-filled stand-in for an agreed tensor it did not submit, queued like its own.
  void queue_stand_in(const TensorSpec& agreed);
  // Completes this rank's join() once every rank has joined; fails it with `error` when stopping.
  void end_join(const std::string& error, FailureKind kind = FailureKind::kNotRunning, int rank = -1);
  // Launches whatever the agreed credit admits.
  void launch_ready();
  void launch(Launch launch);
  // Fills `op` for a collective with an output (allgather, reducescatter, alltoall) of one tensor.
  void prepare_output(InFlight& flight, LocalTensor& tensor, WireOp& op);
  // Why this rank cannot take `spec` (empty: it can): bad arguments, or a transport that lacks it.
  // `set_ranks`: the members of the spec's process set.
  std::string local_refusal(const TensorSpec& spec, const std::vector<int>& set_ranks) const;
  // Throws UsageError unless this rank is a member of `spec`'s process set, whose ranks it returns.
  std::vector<int> check_membership(const TensorSpec& spec) const;
  // Hands process sets added or removed since the last round to the agreement (driver only).
  void take_set_changes();
  // The scheduler of a process set: set 0's is gated by credit; the others launch what is agreed.
  Scheduler& scheduler_for(int32_t process_set);
  // The position of `rank` in `ranks` (ascending): a set's communicator numbers its members so.
  static int position_in(const std::vector<int>& ranks, int rank);
  // Checks, registers and queues submissions under one lock; the caller holds none.
  std::vector<std::shared_ptr<HandleState>> submit(const std::vector<GroupMember>& members, bool wake_core);
  // A pooled fusion buffer of at least `bytes`, allocated through the transport when none fits.
  std::unique_ptr<FusionBuffer> take_fusion_buffer(size_t bytes);
  bool poll_in_flight();
  void finish(InFlight& done);
  void finish_tensor(uint64_t id, const std::string& error);
  void check_stalls(double now_s);
  // The hint of the longest registered prefix of `name` (empty: none).
  std::string stall_hint_for(const std::string& name) const;
  // Hands the refusals callers left to the agreement (driver only), ahead of the submissions.
  void take_refusals();
  // Ends a tensor the agreement failed on every rank, its handle told which rank refused it.
  void finish_failed(const TensorFailure& failure);
  // `failed_rank`: the rank whose failure stops everything (-1: unknown); ignored for shutdown().
  void stop_everything(const std::string& reason, int failed_rank = -1);
  // Why a call cannot run now that commsched stopped or never started, and what to do; inbox_mutex_ held.
  std::string not_running_message(const std::string& what) const;
  void drain_in_flight(double timeout_s);

  const RuntimeSettings settings_;
  std::unique_ptr<Transport> transport_;
  const int rank_;
  const int size_;
  const std::string transport_name_;
  const bool callers_drive_;
  const bool stages_fusion_;      // the transport copies fused segments itself (device streams)
  const bool transport_averages_;  // the transport applies op="average" itself
  const uint64_t inline_limit_bytes_;  // tensors up to this size ride in the agreement report
  const Clock::duration cycle_;
  const double exchange_timeout_s_;
  const std::shared_ptr<Doorbell> doorbell_ = std::make_shared<Doorbell>();
  Logger logger_;
  ControlPath control_;  // where agreement reports travel; bootstrapped before the core's thread starts
  const std::chrono::microseconds poll_interval_;  // after control_: it depends on where rounds travel
  // How long a waiting caller tests a device collective in flight before its first sleep: as
  // cudaStreamSynchronize spins, a small GPU collective is then seen done as soon as it is, not up
  // to a poll interval later, for at most one poll interval of the caller's CPU per wait.
  const std::chrono::microseconds caller_spin_;
  Timeline timeline_;
  Agreement agreement_;
  Scheduler scheduler_;
  const std::chrono::steady_clock::time_point started_;

  // Shared with submitting threads.
  mutable std::mutex inbox_mutex_;
  std::condition_variable loop_cv_;  // wakes the core's thread
  // The core's thread sleeps on these while callers drive (sleep_while_callers_drive).
  std::mutex idle_mutex_;
  std::condition_variable idle_cv_;
  bool idle_wake_ = false;  // guarded by idle_mutex_
  std::condition_variable callers_cv_;  // wakes callers waiting in wait()
  std::vector<Submission> inbox_;
  std::unordered_map<std::string, const char*> active_names_;  // name -> phase (a literal: no allocation per tensor)
  NodeRecycler<std::unordered_map<std::string, const char*>> name_nodes_;  // guarded by inbox_mutex_
  std::string stop_reason_;
  FailureKind stop_kind_ = FailureKind::kNotRunning;  // guarded by inbox_mutex_, like stop_reason_
  int stop_rank_ = -1;
  // (name, reason, process set); guarded by inbox_mutex_
  std::vector<std::tuple<std::string, std::string, int32_t>> refusals_;
  // Guarded by inbox_mutex_: the registered process sets, and the changes the agreement has not
  // seen yet (an empty rank list removes the set).
  std::map<int32_t, std::vector<int>> process_sets_;
  std::vector<std::pair<int32_t, std::vector<int>>> set_changes_;
  std::atomic<bool> refusals_waiting_{false};  // spares the driver the lock when there are none
  std::string abort_requested_;  // guarded by inbox_mutex_; abort()'s reason, for the next report
  std::atomic<bool> shutdown_requested_{false};
  std::atomic<bool> stopped_{false};
  bool doorbell_rang_ = false;  // guarded by inbox_mutex_
  // Whoever holds the driver role (the core's thread or one waiting caller) alone touches
  // the state below "owned by the driver" and calls the transport.
  bool driving_ = false;  // guarded by inbox_mutex_
  // Changed under inbox_mutex_; read without it by the core's thread while callers drive.
  std::atomic<int> callers_waiting_{0};
  uint32_t requested_epoch_ = 0;  // guarded by inbox_mutex_
  bool join_requested_ = false;  // guarded by inbox_mutex_; join() waits for the next report
  std::shared_ptr<HandleState> join_handle_;  // guarded by inbox_mutex_; set from join() until every rank joined
  std::atomic<int> last_joined_rank_{-1};
  SchedulingSettings requested_settings_;

  // Owned by the driver.
  Clock::time_point next_round_;
  Clock::duration eager_backoff_{0};
  Clock::duration heartbeat_;
  std::vector<Submission> intake_;  // take_submissions' batch, kept for its capacity
  CycleOutcome outcome_;  // run_round's, kept for its capacity
  // The round in progress: one a caller left open at its deadline stays here for the next driver.
  bool round_open_ = false;
  std::string open_report_;
  bool open_had_news_ = false;
  bool open_critical_ = false;
  uint64_t open_exchange_start_us_ = 0;
  Clock::time_point round_opened_at_;
  bool round_silence_warned_ = false;
  std::vector<std::string> round_reports_;  // kept for its capacity
  std::unordered_map<uint64_t, LocalTensor> tensors_;
  std::map<int32_t, Scheduler> set_schedulers_;  // process sets other than 0
  NodeRecycler<std::unordered_map<uint64_t, LocalTensor>> tensor_nodes_;
  std::vector<InFlight> in_flight_;
  uint64_t bytes_in_flight_ = 0;
  uint64_t agreed_completed_bytes_ = 0;  // the least any rank has completed, per the last round
  // Fusion buffers of finished launches, for the next ones (allocated through the transport).
  std::vector<std::unique_ptr<FusionBuffer>> buffer_pool_;
  std::vector<uint64_t> inline_sum_, inline_addend_;  // complete_inline's scratch
  uint64_t next_tensor_id_ = 0;
  uint64_t completed_bytes_ = 0;
  std::string abort_message_;
  double last_stall_check_s_ = 0;
  std::map<std::string, double> stall_warned_at_s_;
  mutable std::mutex stall_hints_mutex_;  // add_stall_hint runs on a caller's thread
  std::map<std::string, std::string> stall_hints_;  // name prefix -> hint

  uint32_t applied_epoch_ = 0;

  LiveStats stats_;
  mutable std::mutex settings_mutex_;
  SchedulingSettings applied_settings_;  // guarded by settings_mutex_

  std::thread thread_;  // last member: starts after everything above exists
};

}  // namespace commsched
