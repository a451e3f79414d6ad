// Completion state of one submitted collective, shared by the caller and the core thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace commsched {

class HandleState {
 public:
  explicit HandleState(std::string name) : name_(std::move(name)) {}

  void complete();
  void fail(const std::string& message);
  bool done() const;
  // Blocks until done; a negative timeout waits without limit. Returns false on timeout.
  bool wait(double timeout_s) const;
  bool failed() const;
  std::string error() const;
  const std::string& name() const { return name_; }

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
  std::string error_;
  std::vector<Callback> callbacks_;
};

}  // namespace commsched
