#include "handle.h"

#include <chrono>

namespace commsched {

void HandleState::complete() { fail(""); }

void HandleState::fail(const std::string& message, FailureKind kind, int rank) {
  std::vector<Callback> callbacks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    error_ = message;
    kind_ = kind;
    failed_rank_ = rank;
    done_.store(true, std::memory_order_release);
    callbacks.swap(callbacks_);
  }
  done_cv_.notify_all();
  for (Callback& callback : callbacks) callback(message);
}

void HandleState::on_done(Callback callback) {
  std::string error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_) {
      callbacks_.push_back(std::move(callback));
      return;
    }
    error = error_;
  }
  callback(error);
}

bool HandleState::done() const { return done_.load(std::memory_order_acquire); }

// error_ is written once, before done_ is set, and never again: once done, it reads without the lock.
bool HandleState::failed() const { return done() && !error_.empty(); }

void HandleState::throw_failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  throw Failure(kind_, error_, failed_rank_);
}

std::string HandleState::error() const {
  if (done()) return error_;
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

void HandleState::set_launched(std::shared_ptr<StreamMark> mark) {
  if (!mark) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    mark_ = std::move(mark);
    marked_.store(true, std::memory_order_release);
  }
  done_cv_.notify_all();
}

std::shared_ptr<StreamMark> HandleState::launched_mark() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return mark_;
}

bool HandleState::wait_launched(double timeout_s) const {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto ready = [this] { return done_.load() || marked_.load(); };
  if (timeout_s < 0) {
    done_cv_.wait(lock, ready);
    return true;
  }
  return done_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), ready);
}

bool HandleState::wait(double timeout_s) const {
  std::unique_lock<std::mutex> lock(mutex_);
  if (timeout_s < 0) {
    done_cv_.wait(lock, [this] { return done_.load(); });
    return true;
  }
  return done_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return done_.load(); });
}

}  // namespace commsched
