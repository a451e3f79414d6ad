// After a Gloo failure, finds out which ranks stopped answering, so the error names them: every rank
// still there sends every other its number on the agreement group and waits a few seconds for theirs.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <mutex>
#include <string>

namespace commsched {

class PeerProbe {
 public:
  PeerProbe(c10::intrusive_ptr<c10d::Backend> control, int rank, int size);

  // `error` with the ranks that stopped answering. The first call probes (blocking up to
  // kProbeWait); once a rank is known lost, later calls name it again without probing.
  std::string explain(const std::string& error);
  // Why a rank is known to be gone; empty while every rank answers.
  std::string lost() const;
  // Drops the agreement group, so the Python side can destroy it.
  void release();

  // The ranks that fail together enter the probe within a round of each other, so a few seconds
  // tell a stopped rank from a live one.
  static constexpr std::chrono::milliseconds kProbeWait{3000};
  // Keeps the probes apart from point-to-point messages of the user's own (the Python transport's too).
  static constexpr int kProbeTag = 0x636D73;

 private:
  mutable std::mutex mutex_;
  c10::intrusive_ptr<c10d::Backend> control_;
  int rank_;
  int size_;
  std::string lost_;
};

}  // namespace commsched
