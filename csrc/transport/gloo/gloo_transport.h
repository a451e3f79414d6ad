// Native Gloo transport: the core calls torch's C++ Gloo backend (c10d::ProcessGroupGloo, reached
// through its c10d::Backend interface) directly, so no launch, poll or agreement round takes the GIL.
// Data and agreement run on two backends (two process groups), so an agreement never queues behind
// a large reduction in the data group's worker threads.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/gloo/gloo_ring.h"
#include "transport/gloo/peer_probe.h"
#include "transport/transport.h"

namespace commsched {

// What went over the native path, for tests and diagnostics: shared by the transport and the
// Python-side object that built it, so it outlives either.
struct GlooCounters {
  std::atomic<uint64_t> launches{0};
  std::atomic<uint64_t> exchanges{0};
  std::atomic<uint64_t> rings{0};  // launches that ran as ring collectives (gloo_ring.h)
};

// A collective handed to Gloo: its work, or the future of a ring collective (both null when there was
// nothing to move), what copies its result into the core's memory once it completes, and the
// temporaries it reads or writes meanwhile.
struct GlooLaunch {
  c10::intrusive_ptr<c10d::Work> work;
  c10::intrusive_ptr<c10::ivalue::Future> ring;
  std::function<void()> finish;
  std::vector<at::Tensor> temporaries;
};

// Builds the group of a process set (every rank calls it, in the same order): the members' backend,
// null on a rank outside the set.
using GlooSetMaker = std::function<c10::intrusive_ptr<c10d::Backend>(int32_t id, const std::vector<int>& ranks)>;

class GlooTransport : public Transport {
 public:
  // `on_close` runs once after the backends are released (the Python side destroys the process
  // groups it created there); may be empty. `make_set` builds process sets' groups; empty: none.
  GlooTransport(c10::intrusive_ptr<c10d::Backend> data, c10::intrusive_ptr<c10d::Backend> control,
                std::shared_ptr<GlooCounters> counters, std::function<void()> on_close, GlooSetMaker make_set = {});
  ~GlooTransport() override;
  GlooTransport(const GlooTransport&) = delete;
  GlooTransport& operator=(const GlooTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "gloo"; }
  std::vector<std::string> exchange(const std::string& mine, double timeout_s) override;
  std::unique_ptr<PendingOp> start(const WireOp& op) override;
  // Gloo runs every collective, op and dtype the core has (int16 reduced in int32, bool as uint8):
  // what the core refuses itself (sum of bool, reducescatter with min) never gets here.
  std::string unsupported(const TensorSpec& spec) const override;
  // Gloo's own worker threads move the data; completions ring the doorbell, so polling is only
  // a fallback.
  std::chrono::microseconds poll_interval() const override { return std::chrono::microseconds(2000); }
  // c10d backends take calls from any thread: a waiting caller drives the core itself, sparing a
  // hand-off to the core's thread per small collective.
  bool any_thread() const override { return true; }
  void set_doorbell(std::shared_ptr<Doorbell> doorbell) override { doorbell_ = std::move(doorbell); }
  void add_process_set(int32_t id, const std::vector<int>& ranks) override;
  void remove_process_set(int32_t id) override;

 private:
  // The backend a collective runs on, and this rank's place and the ranks in it.
  struct Group {
    c10::intrusive_ptr<c10d::Backend> backend;
    int rank = 0;
    int size = 1;
  };
  Group group_for(int32_t process_set);
  // One allgather of `width` bytes per rank on the control group; returns the gathered bytes.
  const uint8_t* allgather(const at::Tensor& send, at::Tensor& receive, int64_t width, double timeout_s);
  void fit_slot(uint64_t wanted);
  // One launcher per kind; each leaves the result in the core's memory once `finish` ran.
  GlooLaunch launch(const WireOp& op);
  GlooLaunch launch_allreduce(const WireOp& op);
  GlooLaunch launch_broadcast(const WireOp& op);
  GlooLaunch launch_allgather(const WireOp& op);
  GlooLaunch launch_reducescatter(const WireOp& op);
  GlooLaunch launch_reducescatter_by_parts(const WireOp& op, const Group& group, uint64_t kept);
  GlooLaunch launch_alltoall(const WireOp& op);
  // `op` (a reduce-scatter or an all-gather) as a ring collective over `group` where the ring moves
  // it faster than Gloo's own collective; an empty launch otherwise.
  GlooLaunch launch_ring(const WireOp& op, const Group& group, at::Tensor input, at::Tensor output);

  static constexpr int64_t kMinSlotBytes = 64;
  static constexpr int64_t kSlotStepBytes = 1024;
  static constexpr int64_t kMaxSlotBytes = 256 * 1024;

  c10::intrusive_ptr<c10d::Backend> data_;
  c10::intrusive_ptr<c10d::Backend> control_;
  std::shared_ptr<PeerProbe> probe_;  // shared with the collectives in flight, which name lost ranks too
  // Collectives whose completion callback has not run: a work waiting for a lost rank holds its
  // group's destructor (and the process's exit) until Gloo's own timeout, so close keeps the groups
  // alive for the rest of the process then.
  std::shared_ptr<std::atomic<int>> in_flight_ = std::make_shared<std::atomic<int>>(0);
  bool exchange_abandoned_ = false;  // an agreement round failed with its allgather still pending
  std::shared_ptr<GlooCounters> counters_;
  std::function<void()> on_close_;
  std::shared_ptr<Doorbell> doorbell_;
  GlooSetMaker make_set_;
  std::mutex sets_mutex_;
  std::map<int32_t, Group> sets_;  // guarded by sets_mutex_; this rank's process sets only
  // Each group's ring runner, built at its first ring collective; guarded by sets_mutex_.
  std::map<int32_t, std::unique_ptr<RingRunner>> rings_;
  bool ring_ = true;  // COMMSCHED_GLOO_RING=0 turns the ring collectives off
  int rank_ = 0;
  int size_ = 1;
  // Agreement buffers, owned by torch so a round that timed out may still land in them safely.
  int64_t slot_bytes_ = kMinSlotBytes;
  at::Tensor send_slot_;
  at::Tensor received_slots_;
};

}  // namespace commsched
