#include "core/runtime.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/elementwise.h"

#ifdef __linux__
#include <sys/prctl.h>
#endif

namespace commsched {

namespace {

using Clock = std::chrono::steady_clock;

// How often the core polls collectives in flight: short enough to keep a
// transport's progress engine moving, long enough to leave the CPU to the training.
constexpr auto kPollInterval = std::chrono::microseconds(10);
// While this rank waits for others to announce what it already has, it retries the
// exchange at once and backs off up to a quarter cycle when nothing moves.
constexpr auto kEagerBackoffStep = std::chrono::microseconds(10);
constexpr double kStallCheckPeriodS = 1.0;
// A waiting caller looks at its handle and the core at least this often.
constexpr auto kCallerSlice = std::chrono::milliseconds(50);
// A caller driving a transport that wants constant polling yields once per this many passes,
// each a burst of up to this many tests.
constexpr unsigned kPollsPerYield = 16;
constexpr unsigned kTestsPerBurst = 32;

std::string human_bytes(uint64_t bytes) {
  char text[32];
  if (bytes >= (1ull << 20)) {
    std::snprintf(text, sizeof(text), "%.1f MiB", bytes / 1048576.0);
  } else if (bytes >= 1024) {
    std::snprintf(text, sizeof(text), "%.1f KiB", bytes / 1024.0);
  } else {
    std::snprintf(text, sizeof(text), "%llu B", static_cast<unsigned long long>(bytes));
  }
  return text;
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? "," : "") + std::to_string(ranks[i]);
  return text;
}

}  // namespace

Runtime::Runtime(const RuntimeSettings& settings, std::unique_ptr<Transport> transport)
    : settings_(settings),
      transport_(std::move(transport)),
      rank_(transport_->rank()),
      size_(transport_->size()),
      transport_name_(transport_->name()),
      poll_interval_(transport_->poll_interval()),
      callers_drive_(transport_->any_thread()),
      inline_limit_bytes_(transport_->host_memory()
                              ? std::min<uint64_t>(settings.inline_bytes, kInlineRoundBudgetBytes / size_)
                              : 0),
      cycle_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(settings.cycle_time_s))),
      exchange_timeout_s_(settings.stall_shutdown_s > 0 ? settings.stall_shutdown_s : 10 * settings.stall_timeout_s),
      logger_(settings.log_level, rank_),
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
  logger_.info("started on " + transport_name_ + " with " + std::to_string(size_) + " ranks");
  thread_ = std::thread([this] { loop(); });
}

Runtime::~Runtime() {
  shutdown();
  doorbell_->disconnect();
}

std::shared_ptr<HandleState> Runtime::enqueue(const TensorSpec& spec, void* data, bool wake_core) {
  if (spec.kind == CollectiveKind::kBroadcast && (spec.root < 0 || spec.root >= size_)) {
    throw UsageError("broadcast of '" + spec.name + "': root " + std::to_string(spec.root) +
                     " is not a rank; use a root between 0 and " + std::to_string(size_ - 1));
  }
  if (spec.kind == CollectiveKind::kAllreduce && spec.op == ReduceOp::kAverage && !dtype_is_floating(spec.dtype)) {
    throw UsageError("allreduce of '" + spec.name + "': op=\"average\" needs a floating dtype, not " +
                     dtype_name(spec.dtype) + "; use op=\"sum\" for integers");
  }
  auto handle = std::make_shared<HandleState>(spec.name);
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    if (stopped_ || shutdown_requested_) {
      throw UsageError("commsched is not running" + (stop_reason_.empty() ? "" : " (" + stop_reason_ + ")") +
                       "; call commsched.init() before submitting '" + spec.name + "'");
    }
    auto [it, inserted] = name_nodes_.try_insert(active_names_, spec.name, "submitted");
    if (!inserted) {
      throw UsageError("tensor name '" + spec.name + "' is already in flight (" + it->second +
                       "); wait for its handle before submitting it again, or give this one another name");
    }
    inbox_.push_back(Submission{spec, data, handle, timeline_.stamp_us(), &it->second});
  }
  if (wake_core || !callers_drive_) wake_all();
  return handle;
}

void Runtime::shutdown() {
  shutdown_requested_ = true;
  wake_all();
  if (thread_.joinable()) thread_.join();
}

void Runtime::request_settings(const SchedulingSettings& settings) {
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  if (stopped_) throw UsageError("commsched is not running; call commsched.init() before reconfigure()");
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
  return out;
}

RuntimeStats Runtime::stats() const { return stats_.snapshot(); }

std::string Runtime::describe(const std::string& name) const {
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  auto found = active_names_.find(name);
  if (found != active_names_.end()) return found->second;
  return stop_reason_.empty() ? "" : "commsched stopped: " + stop_reason_;
}

void Runtime::loop() {
#ifdef __linux__
  // Short polling sleeps are only cheap if the kernel wakes us on time (default slack: 50us).
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
#endif
  while (wait_for_news()) {
    const bool running = run_round();
    {
      std::lock_guard<std::mutex> lock(inbox_mutex_);
      driving_ = false;
    }
    callers_cv_.notify_all();  // a caller waiting for the driver role may take it
    if (!running) return;
  }
}

bool Runtime::round_due_locked(Clock::time_point now) const {
  return !inbox_.empty() || shutdown_requested_ || !abort_message_.empty() || now >= next_round_;
}

bool Runtime::poll_for_news() {
  // A completion is news only when queued chunks wait for the credit it frees: credit comes
  // back through the next round, as the least any rank has completed, so every rank pops the
  // same units at the same round. (Releasing it at the local completion instead let ranks pop
  // at different times; with catch-up that was meant to be safe, but it hung the rig's grid
  // of reconfigure() switches.)
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

bool Runtime::wait(const HandleState& handle, double timeout_s) {
  if (!callers_drive_) return handle.wait(timeout_s);
  // The limit counts from the first pass's clock read (one read fewer per small collective).
  auto give_up = Clock::time_point::max();
  const auto limit = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  std::unique_lock<std::mutex> lock(inbox_mutex_);
  ++callers_waiting_;
  bool leave_work = false;
  unsigned polls = 0;
  for (bool first = true; !handle.done() && !stopped_; first = false) {
    const auto now = Clock::now();
    if (first && timeout_s >= 0) give_up = now + limit;
    if (now >= give_up) break;
    auto look_again = std::min(give_up, now + kCallerSlice);
    if (!driving_) {
      driving_ = true;
      doorbell_rang_ = false;  // this pass polls whatever rang it
      const bool due = round_due_locked(now);
      lock.unlock();
      look_again = std::min(look_again, drive_for_caller(due));
      // What this caller leaves behind needs the core's thread once no caller waits.
      leave_work = !in_flight_.empty() || scheduler_.queued_chunks() > 0 || agreement_.waiting_on_others();
      lock.lock();
      // Not for a heartbeat due soon: the core's thread looks each cycle by itself, and a
      // wake-up per collective here kept it bouncing in and out of its sleep.
      leave_work = leave_work || !inbox_.empty();
      driving_ = false;
      // This pass may have finished other callers' tensors, and one of them may drive next.
      if (callers_waiting_ > 1) callers_cv_.notify_all();
      if (handle.done()) break;
      if (look_again <= Clock::now()) {
        // MPI moves a large message only inside its test calls: yielding after every poll
        // slowed a 4 MiB allreduce by 7%. Every few polls still leave the CPU to other threads.
        if (++polls % kPollsPerYield == 0) {
          lock.unlock();
          std::this_thread::yield();
          lock.lock();
        }
        continue;
      }
    }
    callers_cv_.wait_until(lock, look_again);
  }
  --callers_waiting_;
  if (callers_waiting_ == 0 && !driving_ && leave_work) wake_core_thread();
  const bool stopped = stopped_;
  lock.unlock();
  if (handle.done()) return true;
  if (!stopped) return false;
  // Stopping fails every handle; wait for that on the handle itself.
  if (timeout_s < 0) return handle.wait(-1.0);
  if (give_up == Clock::time_point::max()) return handle.wait(timeout_s);  // stopped before the first pass
  return handle.wait(std::max(0.0, std::chrono::duration<double>(give_up - Clock::now()).count()));
}

Runtime::Clock::time_point Runtime::drive_for_caller(bool due) {
  due = poll_for_news() || due;
  if (!due && poll_interval_.count() == 0) {
    // A transport that moves data only while tested (MPI progresses a large message inside its
    // test calls) gets a burst of tests without the locks and clock reads of a whole pass.
    for (unsigned tests = 1; tests < kTestsPerBurst && !due && !in_flight_.empty(); ++tests) due = poll_for_news();
  }
  if (due) {
    run_round();
    return Clock::time_point::min();  // look again at once
  }
  if (!in_flight_.empty()) return Clock::now() + poll_interval_;
  return next_round_;
}

bool Runtime::run_round() {
  CycleOutcome& outcome = outcome_;
  // Read once: a round on shared memory takes a few microseconds, and each read ~20 ns.
  Clock::time_point after_exchange;
  try {
    ReportStatus status{completed_bytes_, shutdown_requested_.load(), abort_message_};
    take_submissions(status);
    const bool had_news = agreement_.has_announcements();
    const uint64_t exchange_start_us = timeline_.stamp_us();
    const std::vector<std::string> reports = transport_->exchange(agreement_.build_report(status), exchange_timeout_s_);
    after_exchange = Clock::now();
    agreement_.apply(reports, std::chrono::duration<double>(after_exchange - started_).count(), outcome);
    if (timeline_.enabled() && (had_news || !outcome.agreed.empty())) {
      timeline_.complete("agree", Timeline::kAgreementTrack, exchange_start_us, Timeline::now_us() - exchange_start_us,
                         "{\"agreed\":" + std::to_string(outcome.agreed.size()) + "}");
    }
    stats_.cycles.fetch_add(1, std::memory_order_relaxed);
  } catch (const std::exception& error) {
    // The control path itself failed: nobody can be told, so stop here.
    stop_everything("rank " + std::to_string(rank_) + " lost contact with the other ranks: " + error.what());
    return false;
  }
  if (outcome.abort_rank >= 0) {
    stop_everything("rank " + std::to_string(outcome.abort_rank) + " failed: " + outcome.abort_message);
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
    const bool quiet = outcome.announcements == 0 && outcome.agreed.empty() &&
                       outcome.min_settings_epoch == outcome.root_settings_epoch && in_flight_.empty() &&
                       scheduler_.queued_chunks() == 0;
    heartbeat_ = quiet ? std::min<Clock::duration>(2 * heartbeat_, kMaxQuietCycles * cycle_) : cycle_;
    next_round_ = after_exchange + heartbeat_;
  }
  // Collectives that finished while this round exchanged (its report predates them) free credit
  // that queued chunks wait for, and only the next round gives it back: that round is due now,
  // not a heartbeat later (the link sat idle for a cycle after every credit window on the rig).
  if (credit_news) next_round_ = after_exchange;
  check_stalls(std::chrono::duration<double>(after_exchange - started_).count());
  return true;
}

void Runtime::take_submissions(ReportStatus& status) {
  // Swapped with a kept vector, so neither side allocates again once both have grown. Cleared
  // first too: a batch an exception cut short must not come back through the inbox.
  std::vector<Submission>& batch = intake_;
  batch.clear();
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    status.settings_epoch = requested_epoch_;
    status.settings = requested_settings_;
    batch.swap(inbox_);
    for (const Submission& submission : batch) *submission.phase = "waiting for other ranks";
  }
  const uint64_t now_us = timeline_.stamp_us();
  for (Submission& submission : batch) {
    const uint64_t id = next_tensor_id_++;
    timeline_.async_begin(submission.spec.name, "negotiate", id, submission.enqueued_us);
    if (timeline_.enabled()) timeline_.instant("ready " + submission.spec.name, Timeline::kTensorTrack, now_us);
    const uint64_t bytes = submission.spec.bytes();
    const bool sends_bytes =
        submission.spec.kind == CollectiveKind::kAllreduce || submission.spec.root == rank_;
    std::string payload;
    // A tensor the partition size would cut is not small: it goes on the wire in chunks.
    const uint64_t partition = scheduler_.settings().partition_bytes;
    if (bytes > 0 && bytes <= inline_limit_bytes_ && (partition == 0 || bytes <= partition) && sends_bytes) {
      payload.assign(static_cast<const char*>(submission.data), bytes);
    }
    agreement_.announce(submission.spec, std::move(payload), id);
    tensor_nodes_.try_insert(tensors_, id,
                             LocalTensor{std::move(submission.spec), submission.data, std::move(submission.handle), 0,
                                         id, false, false, submission.phase});
  }
  batch.clear();
}

void Runtime::apply_outcome(const CycleOutcome& outcome) {
  agreed_completed_bytes_ = outcome.min_completed_bytes;
  if (outcome.min_settings_epoch > applied_epoch_) {
    // Every rank sees the same reports, so every rank switches in this same cycle.
    applied_epoch_ = outcome.root_settings_epoch;
    scheduler_.reconfigure(outcome.root_settings);
    std::lock_guard<std::mutex> lock(settings_mutex_);
    applied_settings_ = outcome.root_settings;
  }
  for (const TensorFailure& failure : outcome.failures) {
    logger_.log(LogLevel::kError, failure.message);
    finish_tensor(failure.local_id, failure.message);
  }
  const uint64_t now_us = timeline_.stamp_us();
  std::vector<const char**> queued_phases;
  for (size_t i = 0; i < outcome.agreed.size(); ++i) {
    const TensorSpec& agreed = outcome.agreed[i];
    const uint64_t id = outcome.agreed_ids[i];
    timeline_.async_end(agreed.name, "negotiate", id, now_us);
    if (!outcome.inline_payloads[i].empty()) {
      complete_inline(id, agreed, outcome.inline_payloads[i]);
      continue;
    }
    LocalTensor& tensor = tensors_.at(id);
    tensor.agreed = true;
    tensor.chunks_left = scheduler_.add(id, agreed);
    timeline_.async_begin(agreed.name, "queued", id, now_us);
    queued_phases.push_back(tensor.phase);
  }
  if (!queued_phases.empty()) {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    for (const char** phase : queued_phases) *phase = "agreed, queued for the wire";
  }
}

void Runtime::complete_inline(uint64_t id, const TensorSpec& spec, const std::vector<std::string>& payloads) {
  const uint64_t bytes = spec.bytes();
  void* data = tensors_.at(id).data;
  if (spec.kind == CollectiveKind::kBroadcast) {
    std::memcpy(data, payloads[spec.root].data(), bytes);
  } else {
    // Summed in rank order from the same bytes, so every rank gets a bit-identical result.
    // Addends go through aligned scratch, kept across rounds: the payload strings promise no
    // alignment. The sum builds in the tensor itself when it is 8-byte aligned (numpy's and
    // torch's are), which saves two copies of it.
    const bool aligned = reinterpret_cast<uintptr_t>(data) % alignof(uint64_t) == 0;
    std::vector<uint64_t>& addend = inline_addend_;
    addend.resize((bytes + 7) / 8);
    void* sum = data;
    if (!aligned) {
      inline_sum_.resize(addend.size());
      sum = inline_sum_.data();
    }
    std::memcpy(sum, payloads[0].data(), bytes);
    for (int r = 1; r < size_; ++r) {
      std::memcpy(addend.data(), payloads[r].data(), bytes);
      sum_into(sum, addend.data(), spec.count, spec.dtype);
    }
    if (spec.op == ReduceOp::kAverage) divide_by(sum, spec.count, spec.dtype, static_cast<double>(size_));
    if (!aligned) std::memcpy(data, sum, bytes);
  }
  stats_.inline_tensors.fetch_add(1, std::memory_order_relaxed);
  finish_tensor(id, "");
}

void Runtime::launch_ready() {
  // The credit is what every rank has completed, so every rank pops the same units here.
  scheduler_.set_completed_bytes(agreed_completed_bytes_);
  for (Launch& next : scheduler_.next_launches()) launch(std::move(next));
}

void Runtime::launch(Launch next) {
  InFlight flight;
  flight.launch = std::move(next);
  const Launch& plan = flight.launch;
  const size_t elem_size = dtype_size(plan.dtype);
  WireOp op{plan.kind, plan.dtype, plan.root, nullptr, plan.bytes / elem_size};
  if (plan.chunks.size() == 1) {
    const ChunkRef& chunk = plan.chunks.front();
    op.data = static_cast<char*>(tensors_.at(chunk.tensor_id).data) + chunk.elem_offset * elem_size;
  } else {
    // Fusion copies small tensors into one buffer so the latency is paid once.
    if (!buffer_pool_.empty()) {
      flight.fusion_buffer = std::move(buffer_pool_.back());
      buffer_pool_.pop_back();
    }
    flight.fusion_buffer.resize(std::max<size_t>(plan.bytes, 1));
    size_t offset = 0;
    for (const ChunkRef& chunk : plan.chunks) {
      const size_t bytes = chunk.elem_count * elem_size;
      transport_->copy(flight.fusion_buffer.data() + offset,
                       static_cast<char*>(tensors_.at(chunk.tensor_id).data) + chunk.elem_offset * elem_size, bytes);
      offset += bytes;
    }
    op.data = flight.fusion_buffer.data();
  }
  flight.wire_data = op.data;
  flight.started_us = timeline_.stamp_us();
  for (const ChunkRef& chunk : plan.chunks) {
    LocalTensor& tensor = tensors_.at(chunk.tensor_id);
    if (!tensor.launched) {
      tensor.launched = true;
      timeline_.async_end(tensor.spec.name, "queued", tensor.trace_id, flight.started_us);
      timeline_.async_begin(tensor.spec.name, "on the wire", tensor.trace_id, flight.started_us);
    }
  }
  stats_.launches.fetch_add(1, std::memory_order_relaxed);
  stats_.fused_launches.fetch_add(plan.chunks.size() > 1 ? 1 : 0, std::memory_order_relaxed);
  stats_.chunks.fetch_add(plan.chunks.size(), std::memory_order_relaxed);
  stats_.launched_bytes.fetch_add(plan.bytes, std::memory_order_relaxed);
  bytes_in_flight_ += plan.bytes;
  // Only the driver writes the maxima, so a load and a store cannot lose a larger value.
  if (bytes_in_flight_ > stats_.max_bytes_in_flight.load(std::memory_order_relaxed)) {
    stats_.max_bytes_in_flight.store(bytes_in_flight_, std::memory_order_relaxed);
  }
  if (plan.bytes > stats_.max_launch_bytes.load(std::memory_order_relaxed)) {
    stats_.max_launch_bytes.store(plan.bytes, std::memory_order_relaxed);
  }
  timeline_.counter("bytes in flight", flight.started_us, static_cast<double>(bytes_in_flight_));
  flight.op = transport_->start(op);
  in_flight_.push_back(std::move(flight));
}

bool Runtime::poll_in_flight() {
  bool any = false;
  for (size_t i = 0; i < in_flight_.size();) {
    if (in_flight_[i].op->test()) {
      InFlight done = std::move(in_flight_[i]);
      in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(i));
      finish(done);
      any = true;
    } else {
      ++i;
    }
  }
  return any;
}

void Runtime::finish(InFlight& done) {
  const Launch& plan = done.launch;
  const size_t elem_size = dtype_size(plan.dtype);
  if (plan.kind == CollectiveKind::kAllreduce && plan.op == ReduceOp::kAverage) {
    transport_->scale(done.wire_data, plan.bytes / elem_size, plan.dtype, static_cast<double>(size_));
  }
  const uint64_t now_us = timeline_.stamp_us();
  std::string members;
  size_t offset = 0;
  for (const ChunkRef& chunk : plan.chunks) {
    LocalTensor& tensor = tensors_.at(chunk.tensor_id);
    const size_t bytes = chunk.elem_count * elem_size;
    if (!done.fusion_buffer.empty()) {
      transport_->copy(static_cast<char*>(tensor.data) + chunk.elem_offset * elem_size,
                       done.fusion_buffer.data() + offset, bytes);
    }
    offset += bytes;
    if (timeline_.enabled()) {
      members += (members.empty() ? "" : ",") + Timeline::quote(tensor.spec.name + "#" + std::to_string(chunk.index));
    }
    if (--tensor.chunks_left == 0) finish_tensor(chunk.tensor_id, "");
  }
  completed_bytes_ += plan.bytes;
  bytes_in_flight_ -= plan.bytes;
  if (timeline_.enabled()) {
    const std::string label = std::string(kind_name(plan.kind)) + " " + dtype_name(plan.dtype) + " " +
                              human_bytes(plan.bytes) +
                              (plan.chunks.size() > 1 ? " (" + std::to_string(plan.chunks.size()) + " fused)" : "");
    timeline_.complete(label, Timeline::kWireTrack, done.started_us, now_us - done.started_us,
                       "{\"seq\":" + std::to_string(plan.seq) + ",\"bytes\":" + std::to_string(plan.bytes) +
                           ",\"chunks\":[" + members + "]}");
    timeline_.counter("bytes in flight", now_us, static_cast<double>(bytes_in_flight_));
  }
  if (!done.fusion_buffer.empty()) buffer_pool_.push_back(std::move(done.fusion_buffer));
}

void Runtime::finish_tensor(uint64_t id, const std::string& error) {
  auto found = tensors_.find(id);
  if (found == tensors_.end()) return;  // already finished (failed while stopping)
  LocalTensor tensor = std::move(found->second);
  tensor_nodes_.erase(tensors_, found);
  {
    // Free the name before signalling, so the caller may resubmit it at once.
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    auto active = active_names_.find(tensor.spec.name);
    if (active != active_names_.end()) name_nodes_.erase(active_names_, active);
  }
  const uint64_t now_us = timeline_.stamp_us();
  if (tensor.launched) timeline_.async_end(tensor.spec.name, "on the wire", tensor.trace_id, now_us);
  if (timeline_.enabled()) {
    timeline_.instant((error.empty() ? "done " : "failed ") + tensor.spec.name, Timeline::kTensorTrack, now_us);
  }
  (error.empty() ? stats_.completed_tensors : stats_.failed_tensors).fetch_add(1, std::memory_order_relaxed);
  // Callers waiting on the core's condition (not the handle's) hear of it when the driver
  // gives up its role: loop(), wait_for_news() and wait() notify them then, under the lock.
  if (error.empty()) {
    tensor.handle->complete();
  } else {
    tensor.handle->fail(error);
  }
}

void Runtime::check_stalls(double now) {
  if (now - last_stall_check_s_ < kStallCheckPeriodS) return;
  last_stall_check_s_ = now;
  const std::vector<StalledTensor> stalled = agreement_.stalled(now, settings_.stall_timeout_s);
  if (stalled.empty()) {
    stall_warned_at_s_.clear();
    return;
  }
  std::string lines;
  std::string worst;
  for (const StalledTensor& tensor : stalled) {
    auto warned = stall_warned_at_s_.find(tensor.name);
    const std::string line = "'" + tensor.name + "' ready on ranks " + join_ranks(tensor.ready_ranks) +
                             " but not on ranks " + join_ranks(tensor.missing_ranks) + " for " +
                             std::to_string(static_cast<int>(tensor.waiting_s)) + "s";
    if (settings_.stall_shutdown_s > 0 && tensor.waiting_s >= settings_.stall_shutdown_s && worst.empty()) {
      worst = line;
    }
    if (warned != stall_warned_at_s_.end() && now - warned->second < settings_.stall_timeout_s) continue;
    stall_warned_at_s_[tensor.name] = now;
    lines += "\n  " + line;
  }
  if (!lines.empty()) {
    logger_.warning("tensors are waiting for other ranks longer than COMMSCHED_STALL_TIMEOUT=" +
                    std::to_string(settings_.stall_timeout_s) +
                    "s; a rank may have stopped submitting or uses other names:" + lines);
  }
  if (!worst.empty() && abort_message_.empty()) {
    abort_message_ = "stalled past COMMSCHED_STALL_SHUTDOWN=" + std::to_string(settings_.stall_shutdown_s) +
                     "s: tensor " + worst;
  }
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
                                      std::to_string(timeout_s) + "s while stopping");
  }
}

void Runtime::stop_everything(const std::string& reason) {
  // Buffers must be out of the transport's hands before their handles fail.
  drain_in_flight(settings_.stall_timeout_s);
  std::vector<Submission> unclaimed;
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    stop_reason_ = reason;
    stopped_ = true;
    unclaimed.swap(inbox_);
  }
  wake_all();  // a parked core thread and waiting callers see the stop
  const bool clean = reason.rfind("commsched.shutdown()", 0) == 0;
  if (!clean) logger_.log(LogLevel::kError, "stopping: " + reason);
  for (Submission& submission : unclaimed) {
    submission.handle->fail("commsched stopped before '" + submission.spec.name + "' was sent: " + reason);
  }
  std::vector<uint64_t> ids;
  for (const auto& [id, tensor] : tensors_) ids.push_back(id);
  for (uint64_t id : ids) {
    const std::string name = tensors_.at(id).spec.name;
    finish_tensor(id, "commsched stopped before '" + name + "' finished: " + reason +
                          (clean ? "; wait for every handle before calling shutdown()" : ""));
  }
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    active_names_.clear();
  }
  timeline_.flush();
}

}  // namespace commsched
