// The runtime's life: construction, submission, settings, stats and stopping.
// The driver's loop is in runtime_drive.cc, the path from agreement to the wire in runtime_wire.cc,
// the stall checks in runtime_stalls.cc.
#include "core/runtime.h"

#include <algorithm>
#include <chrono>

#include "core/polling.h"
#include "core/text.h"

namespace commsched {

namespace {

using Clock = std::chrono::steady_clock;

// How often the core polls collectives in flight: short enough to keep a
// transport's progress engine moving, long enough to leave the CPU to the training.
constexpr auto kPollInterval = std::chrono::microseconds(10);

}  // namespace

Runtime::Runtime(const RuntimeSettings& settings, std::unique_ptr<Transport> transport)
    : settings_(settings),
      transport_(std::move(transport)),
      rank_(transport_->rank()),
      size_(transport_->size()),
      transport_name_(transport_->name()),
      callers_drive_(transport_->any_thread()),
      stages_fusion_(transport_->stages_fusion()),
      transport_averages_(transport_->averages()),
      inline_limit_bytes_(transport_->host_memory()
                              ? std::min<uint64_t>(settings.inline_bytes, kInlineRoundBudgetBytes / size_)
                              : 0),
      cycle_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(settings.cycle_time_s))),
      exchange_timeout_s_(settings.stall_shutdown_s > 0 ? settings.stall_shutdown_s : 10 * settings.stall_timeout_s),
      logger_(settings.log_level, rank_),
      control_(settings.control_channel, settings.control_address, *transport_, exchange_timeout_s_, logger_),
      // Rounds on the TCP channel mean ranks on different network stacks: their data crosses a network.
      poll_interval_(poll_interval_for(transport_->poll_interval(), settings.poll_interval_s,
                                       control_.over_channel() ? settings.link_latency_s : 0.0)),
      caller_spin_(transport_->host_memory() ? std::chrono::microseconds(0) : poll_interval_),
      agreement_(rank_, size_),
      scheduler_(settings.scheduling),
      started_(Clock::now()),
      requested_settings_(settings.scheduling),
      next_round_(Clock::now() + cycle_),
      heartbeat_(cycle_),
      applied_settings_(settings.scheduling) {
  timeline_.open(settings_.timeline_path, rank_);
  doorbell_->connect([this] {
    {
      std::lock_guard<std::mutex> lock(inbox_mutex_);
      doorbell_rang_ = true;
    }
    wake_all();
  });
  transport_->set_doorbell(doorbell_);
  logger_.info("started on " + transport_name_ + " with " + std::to_string(size_) + " ranks, " +
               (poll_interval_.count() > 0 ? "pausing " + std::to_string(poll_interval_.count()) + " us between tests"
                                           : "testing without pause") +
               " of collectives in flight");
  thread_ = std::thread([this] { loop(); });
}

Runtime::~Runtime() {
  shutdown();
  doorbell_->disconnect();
}

std::vector<int> Runtime::check_membership(const TensorSpec& spec) const {
  const std::vector<int> ranks = process_set_ranks(spec.process_set);
  if (!std::binary_search(ranks.begin(), ranks.end(), rank_)) {
    throw UsageError(std::string(kind_name(spec.kind)) + " of '" + spec.name + "' on process set " +
                     std::to_string(spec.process_set) + " (ranks " + join_ranks(ranks) + "): rank " +
                     std::to_string(rank_) + " is not a member; only the set's ranks may call collectives on it");
  }
  return ranks;
}

std::vector<int> Runtime::process_set_ranks(int32_t id) const {
  if (id == 0) {
    std::vector<int> everyone(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) everyone[static_cast<size_t>(r)] = r;
    return everyone;
  }
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  auto found = process_sets_.find(id);
  if (found == process_sets_.end()) {
    throw UsageError("process set " + std::to_string(id) +
                     " is not registered (never added, or removed); add it with add_process_set on every rank first");
  }
  return found->second;
}

void Runtime::add_process_set(int32_t id, const std::vector<int>& ranks) {
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  if (id <= 0) throw UsageError("process set id " + std::to_string(id) + " is reserved; use a positive id");
  if (sorted.empty()) throw UsageError("a process set needs at least one rank");
  if (sorted.front() < 0 || sorted.back() >= size_ || std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    throw UsageError("process set ranks [" + join_ranks(ranks) + "] must be distinct ranks between 0 and " +
                     std::to_string(size_ - 1));
  }
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    if (process_sets_.count(id) != 0) throw UsageError("process set " + std::to_string(id) + " is already registered");
  }
  // Outside the lock: the members meet here to build the set's communicator, while the driver runs on.
  transport_->add_process_set(id, sorted);
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    process_sets_[id] = sorted;
    set_changes_.emplace_back(id, sorted);
  }
  wake_all();
}

void Runtime::remove_process_set(int32_t id) {
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    if (process_sets_.erase(id) == 0) {
      throw UsageError("process set " + std::to_string(id) + " is not registered (never added, or removed already)");
    }
    set_changes_.emplace_back(id, std::vector<int>{});
  }
  transport_->remove_process_set(id);
  wake_all();
}

void Runtime::take_set_changes() {
  std::vector<std::pair<int32_t, std::vector<int>>> changes;
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    if (set_changes_.empty()) return;
    changes.swap(set_changes_);
  }
  for (auto& [id, ranks] : changes) {
    if (ranks.empty()) {
      agreement_.remove_process_set(id);
      set_schedulers_.erase(id);
    } else {
      agreement_.add_process_set(id, std::move(ranks));
    }
  }
}

Scheduler& Runtime::scheduler_for(int32_t process_set) {
  if (process_set == 0) return scheduler_;
  // Without a credit gate every member pops a set's units in the round that agreed them, in the
  // same order; a credit released by completions would let members pop at different rounds.
  SchedulingSettings settings = scheduler_.settings();
  settings.credit_bytes = UINT64_MAX;
  return set_schedulers_.try_emplace(process_set, settings).first->second;
}

int Runtime::position_in(const std::vector<int>& ranks, int rank) {
  return static_cast<int>(std::lower_bound(ranks.begin(), ranks.end(), rank) - ranks.begin());
}

std::string Runtime::local_refusal(const TensorSpec& spec, const std::vector<int>& set_ranks) const {
  const std::string what = std::string(kind_name(spec.kind)) + " of '" + spec.name + "': ";
  if (spec.kind == CollectiveKind::kBroadcast && (spec.root < 0 || spec.root >= size_)) {
    return what + "root " + std::to_string(spec.root) + " is not a rank; use a root between 0 and " +
           std::to_string(size_ - 1);
  }
  if (spec.kind == CollectiveKind::kBroadcast && !std::binary_search(set_ranks.begin(), set_ranks.end(), spec.root)) {
    return what + "root " + std::to_string(spec.root) + " is not in process set " + std::to_string(spec.process_set) +
           " (ranks " + join_ranks(set_ranks) + "); use a member as the root";
  }
  if (kind_reduces(spec.kind)) {
    if (spec.dtype == DType::kBool && (spec.op == ReduceOp::kSum || spec.op == ReduceOp::kAverage)) {
      return what + "op=\"" + op_name(spec.op) +
             "\" is not defined for bool; use op=\"max\" (logical or), \"min\" or \"product\" (logical and)";
    }
    if (spec.kind == CollectiveKind::kReducescatter && spec.op != ReduceOp::kSum && spec.op != ReduceOp::kAverage) {
      return what + "op=\"" + op_name(spec.op) + "\" is not available; reducescatter takes op=\"sum\" or \"average\"";
    }
    if ((spec.prescale != 1.0 || spec.postscale != 1.0) && spec.dtype == DType::kBool) {
      return what + "scale factors are not defined for bool; leave prescale_factor and postscale_factor at 1";
    }
  } else if (spec.prescale != 1.0 || spec.postscale != 1.0) {
    return what + "prescale_factor and postscale_factor apply to reductions only";
  }
  if (kind_has_output(spec.kind)) {
    const uint64_t row = spec.row_elements();
    if ((row == 0 && spec.count != 0) || (row != 0 && spec.count % row != 0)) {
      return what + std::to_string(spec.count) + " elements do not make whole rows of " + std::to_string(row);
    }
  }
  if (spec.kind == CollectiveKind::kAlltoall) {
    if (spec.splits.size() != set_ranks.size()) {
      return what + "splits name " + std::to_string(spec.splits.size()) + " ranks, but there are " +
             std::to_string(set_ranks.size()) + (spec.process_set == 0 ? "" : " in its process set") +
             "; give one row count per rank";
    }
    uint64_t rows = 0;
    for (uint64_t split : spec.splits) rows += split;
    const uint64_t row = spec.row_elements();
    if (rows * row != spec.count) {
      return what + "splits add up to " + std::to_string(rows) + " rows, but the array has " +
             std::to_string(row == 0 ? 0 : spec.count / row) + "; they must add up to its first dimension";
    }
  }
  return transport_->unsupported(spec);
}

std::shared_ptr<HandleState> Runtime::enqueue(const TensorSpec& spec, void* data, bool wake_core,
                                              const Placement& placement) {
  return submit({GroupMember{spec, data, placement}}, wake_core).front();
}

std::vector<std::shared_ptr<HandleState>> Runtime::enqueue_group(const std::vector<GroupMember>& members,
                                                                 bool wake_core) {
  if (members.empty()) return {};
  // The group's length travels with each member, so ranks that pass different numbers of tensors
  // fail at once instead of waiting for members that never come.
  // A group of one is any tensor submitted alone: it needs no tag.
  if (members.size() == 1) return submit(members, wake_core);
  std::vector<GroupMember> tagged(members);
  for (size_t i = 0; i < tagged.size(); ++i) {
    tagged[i].spec.group_size = static_cast<uint32_t>(tagged.size());
    tagged[i].spec.group_index = static_cast<uint32_t>(i);
  }
  return submit(tagged, wake_core);
}

std::vector<std::shared_ptr<HandleState>> Runtime::submit(const std::vector<GroupMember>& members, bool wake_core) {
  std::vector<std::vector<int>> set_ranks;
  for (const GroupMember& member : members) {
    const TensorSpec& spec = member.spec;
    set_ranks.push_back(check_membership(spec));  // a non-member is refused here alone: no member waits for it
    if (spec.name.size() > kMaxTensorNameBytes) {
      // Too long to tell the other ranks about, so refused here alone.
      throw UsageError("tensor name '" + spec.name.substr(0, 64) + "...' is " + std::to_string(spec.name.size()) +
                       " bytes long; tensor names are limited to " + std::to_string(kMaxTensorNameBytes) +
                       " bytes: use a shorter name");
    }
  }
  // A refusal of one member refuses the whole group: every rank then fails all of it alike.
  std::string refusal;
  std::vector<void*> prepared;
  const auto forget_prepared = [&] {
    for (void* data : prepared) transport_->forget(data);
  };
  for (size_t i = 0; i < members.size(); ++i) {
    const GroupMember& member = members[i];
    refusal = local_refusal(member.spec, set_ranks[i]);
    if (!refusal.empty()) break;
    try {
      // On this, the submitting, thread: a GPU producer's stream is known here and nowhere later.
      transport_->prepare(member.spec, member.data, member.placement);
      prepared.push_back(member.data);
    } catch (const std::invalid_argument& refused) {
      refusal = "tensor '" + member.spec.name + "': " + refused.what();
      break;
    }
  }
  if (!refusal.empty()) {
    forget_prepared();
    prepared.clear();
    if (members.size() > 1) refusal = "a member of its group was refused: " + refusal;
  }
  std::vector<std::shared_ptr<HandleState>> handles;
  if (refusal.empty()) {
    for (const GroupMember& member : members) handles.push_back(std::make_shared<HandleState>(member.spec.name));
  }
  {
    std::unique_lock<std::mutex> lock(inbox_mutex_);
    if (stopped_ || shutdown_requested_) {
      const FailureKind kind = stopped_ ? stop_kind_ : FailureKind::kNotRunning;
      const int rank = stopped_ ? stop_rank_ : -1;
      const std::string message = not_running_message("submitting '" + members.front().spec.name + "'");
      lock.unlock();
      forget_prepared();
      throw Failure(kind, message, rank);
    }
    // Entries stay put while others come and go, but iterators do not survive a rehash: keep pointers.
    std::vector<const char**> phases;
    const auto release_names = [&](size_t taken) {
      for (size_t i = 0; i < taken; ++i) name_nodes_.erase(active_names_, active_names_.find(members[i].spec.name));
    };
    for (const GroupMember& member : members) {
      auto [it, inserted] = name_nodes_.try_insert(active_names_, member.spec.name, "submitted");
      if (!inserted) {
        const std::string message = "tensor name '" + member.spec.name + "' is already in flight (" + it->second +
                                    "); wait for its handle before submitting it again, or give this one another name";
        release_names(phases.size());
        lock.unlock();
        forget_prepared();
        throw UsageError(message);
      }
      phases.push_back(&it->second);
    }
    if (!refusal.empty()) {
      // The other ranks may have submitted these names correctly: they hear of the refusal in the
      // next round and fail, instead of waiting for COMMSCHED_STALL_SHUTDOWN.
      release_names(members.size());
      for (const GroupMember& member : members) {
        refusals_.emplace_back(member.spec.name, refusal, member.spec.process_set);
      }
      refusals_waiting_ = true;
    } else {
      const uint64_t now_us = timeline_.stamp_us();
      for (size_t i = 0; i < members.size(); ++i) {
        inbox_.push_back(Submission{members[i].spec, members[i].data, handles[i], now_us, phases[i]});
      }
    }
  }
  if (!refusal.empty()) {
    wake_all();
    throw UsageError(refusal + " (every rank's collective under this name fails with this error)");
  }
  if (wake_core || !callers_drive_) wake_all();
  return handles;
}

void Runtime::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    if (stopped_ || !abort_requested_.empty()) return;
    abort_requested_ = reason;
  }
  wake_all();
}

std::shared_ptr<HandleState> Runtime::join() {
  if (!transport_->host_memory()) {
    throw UsageError("join() is not available on the " + transport_name_ +
                     " transport: a joined rank contributes zeros from host memory; use a host transport (mpi, gloo, "
                     "grpc) for jobs whose ranks run out of data at different steps");
  }
  auto handle = std::make_shared<HandleState>("join");
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    if (stopped_ || shutdown_requested_) {
      throw Failure(stopped_ ? stop_kind_ : FailureKind::kNotRunning, not_running_message("join()"),
                    stopped_ ? stop_rank_ : -1);
    }
    if (join_handle_) {
      throw UsageError("join() is already waiting on rank " + std::to_string(rank_) +
                       "; a rank joins once per epoch, until every rank has joined");
    }
    join_handle_ = handle;
    join_requested_ = true;
  }
  wake_all();
  return handle;
}

void Runtime::end_join(const std::string& error, FailureKind kind, int rank) {
  std::shared_ptr<HandleState> handle;
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    handle.swap(join_handle_);
    join_requested_ = false;
  }
  if (!handle) return;
  if (error.empty()) {
    handle->complete();
  } else {
    handle->fail(error, kind, rank);
  }
}

void Runtime::refuse(const std::string& name, const std::string& reason, int32_t process_set) {

  if (name.empty() || name.size() > kMaxTensorNameBytes) return;  // no other rank can know it
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    if (stopped_ || shutdown_requested_ || active_names_.count(name) != 0) return;
    refusals_.emplace_back(name, reason, process_set);
    refusals_waiting_ = true;
  }
  wake_all();
}

void Runtime::take_refusals() {
  if (!refusals_waiting_.load()) return;
  std::vector<std::tuple<std::string, std::string, int32_t>> refusals;
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    refusals.swap(refusals_);
    refusals_waiting_ = false;
  }
  for (const auto& [name, reason, process_set] : refusals) agreement_.refuse(name, reason, process_set);
}

void Runtime::finish_failed(const TensorFailure& failure) {
  auto found = tensors_.find(failure.local_id);
  if (found == tensors_.end()) return;  // this rank refused it: its caller heard at submission
  logger_.log(LogLevel::kError, failure.message);
  found->second.handle->fail(failure.message, FailureKind::kCollective, failure.refused_by);
  finish_tensor(failure.local_id, failure.message);
}

void Runtime::shutdown() {
  shutdown_requested_ = true;
  wake_all();
  if (thread_.joinable()) thread_.join();
}

void Runtime::require_running(const std::string& what) const {
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  if (stopped_ || shutdown_requested_) {
    throw Failure(stopped_ ? stop_kind_ : FailureKind::kNotRunning, not_running_message(what),
                  stopped_ ? stop_rank_ : -1);
  }
}

void Runtime::request_settings(const SchedulingSettings& settings) {
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  if (stopped_) {
    throw Failure(stop_kind_, not_running_message("reconfigure()"), stop_rank_);
  }
  ++requested_epoch_;
  requested_settings_ = settings;
}

SchedulingSettings Runtime::applied_settings() const {
  std::lock_guard<std::mutex> lock(settings_mutex_);
  return applied_settings_;
}

RuntimeStats LiveStats::snapshot() const {
  RuntimeStats out;
  out.cycles = cycles.load(std::memory_order_relaxed);
  out.launches = launches.load(std::memory_order_relaxed);
  out.fused_launches = fused_launches.load(std::memory_order_relaxed);
  out.chunks = chunks.load(std::memory_order_relaxed);
  out.launched_bytes = launched_bytes.load(std::memory_order_relaxed);
  out.max_bytes_in_flight = max_bytes_in_flight.load(std::memory_order_relaxed);
  out.max_launch_bytes = max_launch_bytes.load(std::memory_order_relaxed);
  out.completed_tensors = completed_tensors.load(std::memory_order_relaxed);
  out.failed_tensors = failed_tensors.load(std::memory_order_relaxed);
  out.inline_tensors = inline_tensors.load(std::memory_order_relaxed);
  out.cached_names = cached_names.load(std::memory_order_relaxed);
  out.control_channel_rounds = control_channel_rounds.load(std::memory_order_relaxed);
  out.spun_rounds = spun_rounds.load(std::memory_order_relaxed);
  return out;
}

RuntimeStats Runtime::stats() const { return stats_.snapshot(); }

std::string Runtime::not_running_message(const std::string& what) const {
  const std::string reason = stop_reason_.empty() ? "" : " (" + stop_reason_ + ")";
  if (stopped_ && stop_kind_ == FailureKind::kRankFailure) {
    // init() again would not help: the failed rank is gone, and the others must agree to go on.
    return "commsched is not running" + reason + ", so " + what +
           " is refused; a job whose rank failed ends here, unless it trains under commsched.elastic.run, which "
           "goes on with the ranks that are left";
  }
  if (stopped_ && stop_kind_ == FailureKind::kNotRunning && !shutdown_requested_.load()) {
    // A shutdown() stopped this rank, which never asked to stop (stop_everything() classes only a
    // shutdown's stop as kNotRunning): init() alone would wait for ranks that have left.
    return "commsched is not running" + reason + ", so " + what +
           " is refused: one rank's shutdown() stops commsched on every rank, so every rank must finish its "
           "collectives and join() before any rank shuts down (or call commsched.init() on every rank again)";
  }
  return "commsched is not running" + reason + "; call commsched.init() before " + what;
}

std::string Runtime::describe(const std::string& name) const {
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  auto found = active_names_.find(name);
  if (found != active_names_.end()) return found->second;
  return stop_reason_.empty() ? "" : "commsched stopped: " + stop_reason_;
}

void Runtime::drain_in_flight(double timeout_s) {
  const auto give_up = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  while (!in_flight_.empty() && Clock::now() < give_up) {
    try {
      if (!poll_in_flight()) std::this_thread::sleep_for(kPollInterval);
    } catch (const std::exception& error) {
      logger_.log(LogLevel::kError, std::string("a collective failed while stopping: ") + error.what());
      return;
    }
  }
  if (!in_flight_.empty()) {
    logger_.log(LogLevel::kError, std::to_string(in_flight_.size()) + " collectives did not finish within " +
                                      seconds_text(timeout_s) + "s while stopping");
  }
}

void Runtime::stop_everything(const std::string& reason, int failed_rank) {
  // Buffers must be out of the transport's hands before their handles fail.
  drain_in_flight(settings_.stall_timeout_s);
  const bool clean = reason.rfind("commsched.shutdown()", 0) == 0;
  const FailureKind kind = clean ? FailureKind::kNotRunning : FailureKind::kRankFailure;
  const int rank = clean ? -1 : failed_rank;
  std::vector<Submission> unclaimed;
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    stop_reason_ = reason;
    stop_kind_ = kind;
    stop_rank_ = rank;
    stopped_ = true;
    unclaimed.swap(inbox_);
    refusals_.clear();
  }
  wake_all();  // a parked core thread and waiting callers see the stop
  if (!clean) logger_.log(LogLevel::kError, "stopping: " + reason);
  for (Submission& submission : unclaimed) {
    submission.handle->fail("commsched stopped before '" + submission.spec.name + "' was sent: " + reason, kind,
                            rank);
  }
  std::vector<uint64_t> ids;
  for (const auto& [id, tensor] : tensors_) ids.push_back(id);
  for (uint64_t id : ids) {
    LocalTensor& tensor = tensors_.at(id);
    const std::string message = "commsched stopped before '" + tensor.spec.name + "' finished: " + reason +
                                (clean ? "; wait for every handle before calling shutdown()" : "");
    tensor.handle->fail(message, kind, rank);  // classified here; finish_tensor's own fail() is then a no-op
    finish_tensor(id, message);
  }
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    active_names_.clear();
  }
  end_join("commsched stopped before every rank joined: " + reason, kind, rank);
  timeline_.flush();
}

}  // namespace commsched
