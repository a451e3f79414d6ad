#include "transport/gloo/peer_probe.h"
#include "core/text.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <vector>

namespace commsched {

namespace {

std::string first_line(const std::string& text) {
  const size_t start = text.find_first_not_of(" \n");
  if (start == std::string::npos) return "unknown error";
  const size_t end = text.find('\n', start);
  return text.substr(start, end == std::string::npos ? std::string::npos : end - start);
}

bool says_timed_out(const std::exception& error) {
  std::string text = error.what();
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text.find("timed out") != std::string::npos;
}

enum class Answer { kAnswered, kSilent, kDead };

}  // namespace

PeerProbe::PeerProbe(c10::intrusive_ptr<c10d::Backend> control, int rank, int size)
    : control_(std::move(control)), rank_(rank), size_(size) {}

std::string PeerProbe::lost() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return lost_;
}

void PeerProbe::release() {
  std::lock_guard<std::mutex> lock(mutex_);
  control_.reset();
}

std::string PeerProbe::explain(const std::string& error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (lost_.empty() && control_) {
    using Clock = std::chrono::steady_clock;
    const auto deadline = Clock::now() + kProbeWait;
    const auto time_left = [&] {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      return std::max(left, std::chrono::milliseconds(10));
    };
    struct Probe {
      int peer;
      at::Tensor answer;
      c10::intrusive_ptr<c10d::Work> sent, received;
      Answer outcome = Answer::kSilent;
    };
    at::Tensor mine = at::full({1}, rank_, at::kLong);
    std::vector<Probe> probes;
    // Every send and receive is posted before any wait, so an answer is taken as it arrives
    // whichever peer this rank waits for first.
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      Probe probe{peer, at::full({1}, -1, at::kLong), {}, {}};
      try {
        std::vector<at::Tensor> out{mine}, in{probe.answer};
        probe.sent = control_->send(out, peer, kProbeTag);
        probe.received = control_->recv(in, peer, kProbeTag);
      } catch (const std::exception&) {
        probe.outcome = Answer::kDead;
      }
      probes.push_back(std::move(probe));
    }
    for (Probe& probe : probes) {
      if (!probe.received) continue;
      try {
        probe.received->wait(time_left());
        probe.outcome = probe.answer.item<int64_t>() == probe.peer ? Answer::kAnswered : Answer::kDead;
      } catch (const std::exception& failure) {
        probe.outcome = says_timed_out(failure) ? Answer::kSilent : Answer::kDead;
      }
    }
    // Stays until its own probes were taken (or the wait is over), so a peer slower to start
    // probing does not take this rank for dead once it has exited.
    for (Probe& probe : probes) {
      if (!probe.sent) continue;
      try {
        probe.sent->wait(time_left());
      } catch (const std::exception&) {  // the peer is gone or hangs: its outcome says so
      }
    }
    std::vector<int> silent, dead;
    for (const Probe& probe : probes) {
      if (probe.outcome == Answer::kSilent) silent.push_back(probe.peer);
      if (probe.outcome == Answer::kDead) dead.push_back(probe.peer);
    }
    std::string found;
    if (!dead.empty()) found = rank_list(dead) + " closed the connection (the process ended?)";
    if (!silent.empty()) {
      found += (found.empty() ? "" : "; ") + rank_list(silent) + " did not answer within " +
               std::to_string(kProbeWait.count() / 1000) + "s (hung or stopped?)";
    }
    if (found.empty()) return first_line(error) + "; every rank answered a probe, so one of them was only slow";
    lost_ = found;
  }
  if (lost_.empty()) return first_line(error);
  return lost_ + " (Gloo: " + first_line(error) + ")";
}

}  // namespace commsched
