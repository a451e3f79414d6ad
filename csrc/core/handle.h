// Completion state of one submitted collective, shared by the caller and the core thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/types.h"
#include "transport/transport.h"

namespace commsched {

// What ended a collective, or refused a call, at run time; each surfaces in Python as its own
// subclass of commsched.CommschedError.
enum class FailureKind : uint8_t {
  kCollective,   // this collective failed on every rank (mismatch, refused on a rank); commsched goes on
  kNotRunning,   // commsched is not running: never started, or shut down
  kRankFailure,  // commsched stopped because a rank failed or lost contact
};

// A classified runtime failure; `rank` is where it started (the refusing or failed rank), -1 if unknown.
class Failure : public CommError {
 public:
  Failure(FailureKind kind, const std::string& message, int rank = -1)
      : CommError(message), kind_(kind), rank_(rank) {}
  FailureKind kind() const { return kind_; }
  int rank() const { return rank_; }

 private:
  FailureKind kind_;
  int rank_;
};

class HandleState {
 public:
  explicit HandleState(std::string name) : name_(std::move(name)) {}

  void complete();
  // Ends the collective with an error; the first end wins, later calls change nothing.
  void fail(const std::string& message, FailureKind kind = FailureKind::kCollective, int rank = -1);
  // Throws the Failure this handle ended with; only for a failed handle.
  [[noreturn]] void throw_failure() const;
  bool done() const;
  // Blocks until done; a negative timeout waits without limit. Returns false on timeout.
  bool wait(double timeout_s) const;
  bool failed() const;
  std::string error() const;
  const std::string& name() const { return name_; }

  // The result of a collective with an output (allgather, reducescatter, alltoall), in the
  // transport's memory, and the agreed per-rank element counts (TensorSpec::layout). Set by the
  // core before it completes the handle; read once done.
  void set_output(std::shared_ptr<FusionBuffer> output, std::vector<uint64_t> layout, uint64_t elements) {
    output_ = std::move(output);
    layout_ = std::move(layout);
    output_elements_ = elements;
  }
  const std::shared_ptr<FusionBuffer>& output() const { return output_; }
  const std::vector<uint64_t>& layout() const { return layout_; }
  uint64_t output_elements() const { return output_elements_; }

  // Device transports: the stream point after the tensor's last launch, set once every chunk is
  // launched (before done). A consumer stream that waits there may use the result at once.
  void set_launched(std::shared_ptr<StreamMark> mark);
  // The mark set_launched() left (null before, or on host transports).
  std::shared_ptr<StreamMark> launched_mark() const;
  // True once done, or launched with a mark.
  bool launched_or_done() const { return done() || marked_.load(std::memory_order_acquire); }
  // Blocks until launched_or_done(); a negative timeout waits without limit. False on timeout.
  bool wait_launched(double timeout_s) const;

  // Runs `callback(error)` once the collective is done (error empty on success): at once
  // on the calling thread if it already is, otherwise on the core's thread, which it
  // must not block.
  using Callback = std::function<void(const std::string& error)>;
  void on_done(Callback callback);

 private:
  const std::string name_;
  mutable std::mutex mutex_;
  mutable std::condition_variable done_cv_;
  // Set under mutex_ (so wait() cannot miss it) but read without it: a caller driving the
  // core checks its handle after every pass.
  std::atomic<bool> done_{false};
  std::atomic<bool> marked_{false};
  std::shared_ptr<StreamMark> mark_;  // guarded by mutex_
  std::string error_;
  FailureKind kind_ = FailureKind::kCollective;
  int failed_rank_ = -1;
  std::vector<Callback> callbacks_;
  // Written by the driver before done_ is set, read by callers only after: no lock needed.
  std::shared_ptr<FusionBuffer> output_;
  std::vector<uint64_t> layout_;
  uint64_t output_elements_ = 0;
};

}  // namespace commsched
