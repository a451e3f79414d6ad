// Ring reduce-scatter and all-gather over Gloo's point-to-point messages, pipelined in segments.
// Gloo's own alltoall and allgather move a whole part per message, and a message that reaches a
// rank before it posted the receive moves at about half the link's rate (on the shaped rig, 8 MiB
// each way at 1 Gbit: 105-138 ms against 67 for the bytes). Here every receive of a collective is
// posted before its first send, in segments, so each link carries (n-1)/n of the bytes at its rate.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/types.h"

namespace commsched {

// The message of a c10 error without the C++ backtrace torch appends to what().
std::string gloo_message(const std::exception& error);

// Keeps `held` alive until the process exits, deliberately never freed: what Gloo may still use after
// a failure or an abort (a group whose destructor would wait for a stopped rank, a receive a late
// message may yet land in) must outlive every owner that lets go of it.
template <typename T>
void keep_until_exit(T held) {
  static_cast<void>(std::make_unique<T>(std::move(held)).release());
}

// One ring collective: a reduce-scatter of `input` (the blocks of every rank, in group order) into
// this rank's block at `output`, or an all-gather of this rank's `input` into `output`.
struct RingJob {
  CollectiveKind kind = CollectiveKind::kReducescatter;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  at::Tensor input;   // views of the core's memory, typed as the wire carries them
  at::Tensor output;
  std::vector<uint64_t> counts;  // elements of each rank's block
  std::string what;              // names the collective in errors
  c10::intrusive_ptr<c10::ivalue::Future> done;
};

// Runs the ring collectives of one group, one at a time in the order submitted (every rank submits
// them in the same order), on a thread of its own: Gloo's point-to-point works complete only by
// waiting on them. A failure fails every later collective at once, as the ring is then out of step.
class RingRunner {
 public:
  RingRunner(c10::intrusive_ptr<c10d::Backend> backend, int rank, int size);
  // Interrupts the wait in progress and joins the thread; collectives not finished fail.
  ~RingRunner();
  RingRunner(const RingRunner&) = delete;
  RingRunner& operator=(const RingRunner&) = delete;

  // Queues `job`; returns the future that completes (or fails) once its result is in `output`.
  c10::intrusive_ptr<c10::ivalue::Future> submit(RingJob job);

  // Below this many bytes moved per rank, one Gloo collective's single round beats the ring's
  // n-1 steps and the hand-off to this thread.
  static constexpr uint64_t kMinBytes = 64 * 1024;
  // Segments of this size keep several messages in flight on every link.
  static constexpr uint64_t kSegmentBytes = 1024 * 1024;
  // Point-to-point tags (Gloo slots) of the ring: apart from the probe's and from small user tags.
  static constexpr int kTagBase = 0x2C000000;

 private:
  struct Segment {
    int step;
    int block;
    int64_t offset;  // into the whole tensor of all blocks
    int64_t count;
    int tag;
  };
  void loop();
  void run(RingJob& job);
  // Waits for `work` (throws Gloo's error naming `what`); false once the runner is stopping.
  bool wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what);
  std::vector<Segment> segments(const RingJob& job, bool sending) const;

  c10::intrusive_ptr<c10d::Backend> backend_;
  int rank_;
  int size_;
  uint64_t sequence_ = 0;      // collectives run, for their tags; the loop's thread only
  at::Tensor scratch_;         // reduce-scatter partial sums; reused, as collectives run one at a time
  std::string broken_;         // why the ring is out of step; the loop's thread only
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<RingJob> queue_;  // guarded by mutex_
  bool stopping_ = false;      // guarded by mutex_
  c10::intrusive_ptr<c10d::Work> waiting_;  // guarded by mutex_: what the loop waits on, to abort it
  std::thread thread_;
};

}  // namespace commsched
