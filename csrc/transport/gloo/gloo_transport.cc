#include "transport/gloo/gloo_transport.h"

#include "core/text.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace commsched {

namespace {

at::ScalarType scalar_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return at::kHalf;
    case DType::kBFloat16: return at::kBFloat16;
    case DType::kFloat32: return at::kFloat;
    case DType::kFloat64: return at::kDouble;
    case DType::kInt32: return at::kInt;
    case DType::kInt64: return at::kLong;
    case DType::kUInt8: return at::kByte;
    case DType::kInt8: return at::kChar;
    case DType::kInt16: return at::kShort;
    case DType::kBool: return at::kByte;  // the core sends bools as bytes of 0 or 1
  }
  throw CommError("gloo: unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

// The type Gloo reduces `dtype` in: it has no int16 arithmetic, and int32's low 16 bits wrap as
// int16 arithmetic would.
at::ScalarType reduced_type(DType dtype) { return dtype == DType::kInt16 ? at::kInt : scalar_type(dtype); }

// The type Gloo moves `dtype` as where nothing is computed: Gloo moves no int16, and any type of the
// same width carries its bytes.
at::ScalarType moved_type(DType dtype) { return dtype == DType::kInt16 ? at::kHalf : scalar_type(dtype); }

c10d::ReduceOp reduce_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kProduct: return c10d::ReduceOp::PRODUCT;
    case ReduceOp::kSum:
    case ReduceOp::kAverage: break;  // the core divides the sum
  }
  return c10d::ReduceOp::SUM;
}

// `count` elements of the core's memory at `data` as a tensor (not owning them).
at::Tensor view_of(void* data, uint64_t count, at::ScalarType type) {
  if (count == 0) return at::empty({0}, at::TensorOptions().dtype(type));
  return at::from_blob(data, {static_cast<int64_t>(count)}, at::TensorOptions().dtype(type));
}

uint64_t total_of(const std::vector<uint64_t>& counts) {
  uint64_t total = 0;
  for (uint64_t count : counts) total += count;
  return total;
}

std::vector<int64_t> split_sizes(const std::vector<uint64_t>& counts) {
  return std::vector<int64_t>(counts.begin(), counts.end());
}

std::string describe(const WireOp& op) {
  std::string text = std::string("gloo ") + kind_name(op.kind) + " of " + std::to_string(op.count) + " " +
                     dtype_name(op.dtype) + " elements";
  if (op.kind == CollectiveKind::kBroadcast) text += " from rank " + std::to_string(op.root);
  if (op.kind == CollectiveKind::kAllreduce || op.kind == CollectiveKind::kReducescatter) {
    text += std::string(" (op ") + op_name(op.op) + ")";
  }
  return text;
}

// Blocks until `future` completes or `timeout_s` passes (negative: no limit); returns what went
// wrong, or "" when it succeeded. The completion callback may fire after a timeout, so what it
// touches is shared.
std::string wait_for(c10::ivalue::Future& future, double timeout_s) {
  if (!future.completed()) {
    struct Completion {
      std::mutex mutex;
      std::condition_variable cv;
      bool done = false;
    };
    auto completion = std::make_shared<Completion>();
    future.addCallback([completion](c10::ivalue::Future&) {
      {
        std::lock_guard<std::mutex> lock(completion->mutex);
        completion->done = true;
      }
      completion->cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(completion->mutex);
    const auto finished = [&] { return completion->done; };
    if (timeout_s < 0) {
      completion->cv.wait(lock, finished);
    } else if (!completion->cv.wait_for(lock, std::chrono::duration<double>(timeout_s), finished)) {
      return "did not complete within " + seconds_text(timeout_s) + "s";
    }
  }
  return future.hasError() ? future.tryRetrieveErrorMessage() : "";
}

// A c10d work seen through the core's PendingOp: done once its future completes.
class GlooOp : public PendingOp {
 public:
  GlooOp(c10::intrusive_ptr<c10d::Work> work, c10::intrusive_ptr<c10::ivalue::Future> future,
         std::function<void()> finish, std::string what, std::shared_ptr<PeerProbe> probe)
      : work_(std::move(work)),
        future_(work_ ? work_->getFuture() : std::move(future)),
        finish_(std::move(finish)),
        what_(std::move(what)),
        probe_(std::move(probe)) {}
  bool test() override {
    // The future is marked complete before the work's own flag, and the doorbell rings from the
    // future's callback: asking the future makes the core's first look after the ring succeed.
    if (!future_->completed()) {
      // It waits for a rank that is gone: stopping need not wait for it too.
      const std::string lost = probe_->lost();
      if (!lost.empty()) throw CommError(what_ + " abandoned: " + lost);
      return false;
    }
    if (future_->hasError()) throw CommError(what_ + " failed: " + probe_->explain(future_->tryRetrieveErrorMessage()));
    if (finish_) {
      // Once only: the result must be in the core's memory when test() first says so.
      const auto finish = std::move(finish_);
      finish_ = nullptr;
      try {
        finish();
      } catch (const std::exception& error) {
        throw CommError(what_ + " completed, but its result could not be copied out: " + gloo_message(error));
      }
    }
    return true;
  }
  c10::ivalue::Future& future() { return *future_; }

 private:
  c10::intrusive_ptr<c10d::Work> work_;  // keeps the tensors (views of the core's memory) referenced; null for a ring
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::function<void()> finish_;  // copies a widened, padded or whole result into the core's memory
  std::string what_;
  std::shared_ptr<PeerProbe> probe_;
};

class DoneOp : public PendingOp {
 public:
  bool test() override { return true; }
};

}  // namespace

GlooTransport::GlooTransport(c10::intrusive_ptr<c10d::Backend> data, c10::intrusive_ptr<c10d::Backend> control,
                             std::shared_ptr<GlooCounters> counters, std::function<void()> on_close,
                             GlooSetMaker make_set)
    : data_(std::move(data)),
      control_(std::move(control)),
      probe_(std::make_shared<PeerProbe>(control_, data_->getRank(), data_->getSize())),
      counters_(counters ? std::move(counters) : std::make_shared<GlooCounters>()),
      on_close_(std::move(on_close)),
      make_set_(std::move(make_set)),
      rank_(data_->getRank()),
      size_(data_->getSize()) {
  if (control_->getSize() != size_ || control_->getRank() != rank_) {
    throw UsageError("gloo: the agreement group (rank " + std::to_string(control_->getRank()) + " of " +
                     std::to_string(control_->getSize()) + ") does not match the data group (rank " +
                     std::to_string(rank_) + " of " + std::to_string(size_) + ")");
  }
  send_slot_ = at::empty({slot_bytes_}, at::kByte);
  received_slots_ = at::empty({slot_bytes_ * size_}, at::kByte);
  if (const char* ring = std::getenv("COMMSCHED_GLOO_RING")) {
    const std::string value = ring;
    if (value == "0") {
      ring_ = false;
    } else if (!value.empty() && value != "1") {
      throw UsageError("COMMSCHED_GLOO_RING=" + value + ": give 1 (ring reduce-scatter and all-gather, the default) " +
                       "or 0 (Gloo's own alltoall and allgather)");
    }
  }
}

GlooTransport::~GlooTransport() {
  const bool stuck = exchange_abandoned_ || in_flight_->load() > 0 || !probe_->lost().empty();
  {
    // Their threads use the backends: they stop (a wait in progress aborted) before anything goes.
    std::lock_guard<std::mutex> lock(sets_mutex_);
    rings_.clear();
  }
  if (stuck) {
    // Work waiting for a rank that is gone (or stopped) holds its group's destructor until Gloo's
    // own timeout (30 minutes by default): ProcessGroupGloo::~ProcessGroupGloo waits for its queue
    // to drain, and Backend::abort() does nothing for Gloo. So the groups are aborted where a
    // backend can, and then kept for the life of the process: whoever drops the last other
    // reference (dist.destroy_process_group(), the garbage collector at exit) never runs the
    // destructor that would wait. Their threads stay blocked until the process exits.
    std::vector<c10::intrusive_ptr<c10d::Backend>> stuck{data_, control_};
    {
      std::lock_guard<std::mutex> lock(sets_mutex_);
      for (const auto& [id, group] : sets_) stuck.push_back(group.backend);
    }
    for (c10::intrusive_ptr<c10d::Backend>& backend : stuck) {
      try {
        backend->abort();
      } catch (const std::exception&) {  // kept below in any case
      }
      keep_until_exit(backend);
    }
  }
  // The backends go first: the groups the Python side destroys in on_close_ are then unreferenced.
  probe_->release();
  {
    std::lock_guard<std::mutex> lock(sets_mutex_);
    sets_.clear();
  }
  data_.reset();
  control_.reset();
  send_slot_.reset();
  received_slots_.reset();
  if (on_close_) {
    try {
      on_close_();
    } catch (...) {  // a destructor reports nothing further; on_close_ logs its own failures
    }
  }
}

const uint8_t* GlooTransport::allgather(const at::Tensor& send, at::Tensor& receive, int64_t width,
                                        double timeout_s) {
  std::vector<at::Tensor> inputs{send};
  std::vector<std::vector<at::Tensor>> outputs(1);
  outputs[0].reserve(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) outputs[0].push_back(receive.narrow(0, r * width, width));
  const std::string what = "gloo agreement exchange (allgather of " + std::to_string(width) + " bytes per rank)";
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = control_->allgather(outputs, inputs);
  } catch (const std::exception& error) {
    throw CommError(what + " failed to start: " + probe_->explain(gloo_message(error)));
  }
  const std::string failure = wait_for(*work->getFuture(), timeout_s);
  if (!failure.empty()) {
    exchange_abandoned_ = !work->getFuture()->completed();
    throw CommError(what + " failed: " + probe_->explain(failure));
  }
  counters_->exchanges.fetch_add(1, std::memory_order_relaxed);
  return receive.data_ptr<uint8_t>();
}

std::vector<std::string> GlooTransport::exchange(const std::string& mine, double timeout_s) {
  // One allgather of equal slots carries every report in the common case; only reports longer
  // than a slot cost a second one, of their tails, as wide as the longest tail.
  const auto started = std::chrono::steady_clock::now();
  const auto time_left = [&] {
    if (timeout_s < 0) return timeout_s;
    const double spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    return std::max(0.0, timeout_s - spent);
  };
  if (mine.size() > UINT32_MAX) throw CommError("gloo: an agreement report exceeds 4 GiB");
  const std::string lost = probe_->lost();
  if (!lost.empty()) throw CommError("gloo agreement exchange: " + lost);
  const int64_t slot = slot_bytes_;
  const size_t in_slot = static_cast<size_t>(slot) - sizeof(uint32_t);
  if (send_slot_.numel() != slot) {
    send_slot_ = at::empty({slot}, at::kByte);
    received_slots_ = at::empty({slot * size_}, at::kByte);
  }
  uint8_t* send = send_slot_.data_ptr<uint8_t>();
  const auto length = static_cast<uint32_t>(mine.size());
  std::memcpy(send, &length, sizeof(length));
  std::memcpy(send + sizeof(length), mine.data(), std::min(mine.size(), in_slot));
  const uint8_t* slots = allgather(send_slot_, received_slots_, slot, time_left());

  std::vector<std::string> reports(static_cast<size_t>(size_));
  std::vector<uint32_t> lengths(static_cast<size_t>(size_));
  uint64_t longest_tail = 0;
  for (int r = 0; r < size_; ++r) {
    const uint8_t* their_slot = slots + r * slot;
    std::memcpy(&lengths[r], their_slot, sizeof(uint32_t));
    const auto* text = reinterpret_cast<const char*>(their_slot + sizeof(uint32_t));
    reports[r].assign(text, std::min<size_t>(lengths[r], in_slot));
    longest_tail = std::max<uint64_t>(longest_tail, lengths[r] > in_slot ? lengths[r] - in_slot : 0);
  }
  fit_slot(*std::max_element(lengths.begin(), lengths.end()) + sizeof(uint32_t));
  if (longest_tail == 0) return reports;

  const auto width = static_cast<int64_t>(longest_tail);
  at::Tensor tail = at::zeros({width}, at::kByte);
  if (mine.size() > in_slot) std::memcpy(tail.data_ptr<uint8_t>(), mine.data() + in_slot, mine.size() - in_slot);
  at::Tensor tails = at::empty({width * size_}, at::kByte);
  const uint8_t* gathered = allgather(tail, tails, width, time_left());
  for (int r = 0; r < size_; ++r) {
    if (lengths[r] <= in_slot) continue;
    reports[r].append(reinterpret_cast<const char*>(gathered + r * width), lengths[r] - in_slot);
  }
  return reports;
}

void GlooTransport::fit_slot(uint64_t wanted) {
  // Every rank sees the same reports, so every rank picks the same slot for the next round: it
  // grows at once to fit the longest report and shrinks slowly, so a training loop's rounds
  // settle into one allgather each.
  uint64_t fit = kMinSlotBytes;
  while (fit < wanted && fit < static_cast<uint64_t>(kSlotStepBytes)) fit *= 2;
  if (fit < wanted) fit = (wanted + kSlotStepBytes - 1) / kSlotStepBytes * kSlotStepBytes;
  const auto bounded = static_cast<int64_t>(std::min<uint64_t>(fit, kMaxSlotBytes));
  if (bounded > slot_bytes_) {
    slot_bytes_ = bounded;
  } else if (bounded * 4 <= slot_bytes_) {
    slot_bytes_ = std::max(bounded, slot_bytes_ / 2);
  }
}

std::string GlooTransport::unsupported(const TensorSpec& spec) const {
  (void)spec;
  return {};
}

std::unique_ptr<PendingOp> GlooTransport::start(const WireOp& op) {
  std::string what = describe(op);
  GlooLaunch launched;
  try {
    launched = launch(op);
  } catch (const CommError&) {
    throw;
  } catch (const std::exception& error) {
    throw CommError(what + " failed to start: " + gloo_message(error));
  }
  if (!launched.work && !launched.ring) return std::make_unique<DoneOp>();  // every rank agreed: nothing to move
  counters_->launches.fetch_add(1, std::memory_order_relaxed);
  auto pending = std::make_unique<GlooOp>(std::move(launched.work), std::move(launched.ring),
                                          std::move(launched.finish), std::move(what), probe_);
  in_flight_->fetch_add(1);
  // Runs on Gloo's worker thread the moment the collective completes (or at once if it has); it
  // takes no GIL, so it may run at any time, also while the interpreter finalizes. It holds the
  // temporaries Gloo reads and writes, so they outlive the collective even if the op is abandoned.
  pending->future().addCallback(
      [bell = doorbell_, in_flight = in_flight_, temporaries = std::move(launched.temporaries)](c10::ivalue::Future&) {
        in_flight->fetch_sub(1);
        if (bell) bell->ring();
      });
  return pending;
}

void GlooTransport::add_process_set(int32_t id, const std::vector<int>& ranks) {
  if (!make_set_) return Transport::add_process_set(id, ranks);
  c10::intrusive_ptr<c10d::Backend> backend = make_set_(id, ranks);
  if (!backend) return;  // not a member
  std::lock_guard<std::mutex> lock(sets_mutex_);
  sets_[id] = Group{backend, backend->getRank(), backend->getSize()};
}

void GlooTransport::remove_process_set(int32_t id) {
  std::lock_guard<std::mutex> lock(sets_mutex_);
  rings_.erase(id);
  sets_.erase(id);
}

GlooTransport::Group GlooTransport::group_for(int32_t process_set) {
  if (process_set == 0) return Group{data_, rank_, size_};
  std::lock_guard<std::mutex> lock(sets_mutex_);
  auto found = sets_.find(process_set);
  if (found == sets_.end()) {
    throw CommError("the gloo transport has no group for process set " + std::to_string(process_set) + " on rank " +
                    std::to_string(rank_));
  }
  return found->second;
}

GlooLaunch GlooTransport::launch(const WireOp& op) {
  switch (op.kind) {
    case CollectiveKind::kAllreduce: return launch_allreduce(op);
    case CollectiveKind::kBroadcast: return launch_broadcast(op);
    case CollectiveKind::kAllgather: return launch_allgather(op);
    case CollectiveKind::kReducescatter: return launch_reducescatter(op);
    case CollectiveKind::kAlltoall: return launch_alltoall(op);
    case CollectiveKind::kBarrier: {
      // The agreement completes barriers before they reach a transport; one that does gets Gloo's.
      GlooLaunch launched;
      launched.work = data_->barrier(c10d::BarrierOptions());
      return launched;
    }
  }
  throw CommError(std::string("the gloo transport was asked to start an unknown collective (kind ") +
                  std::to_string(static_cast<int>(op.kind)) + ")");
}

GlooLaunch GlooTransport::launch_allreduce(const WireOp& op) {
  const Group group = group_for(op.process_set);
  GlooLaunch launched;
  if (op.count == 0) return launched;
  at::Tensor tensor = view_of(op.data, op.count, scalar_type(op.dtype));
  c10d::AllreduceOptions options;
  options.reduceOp = reduce_op(op.op);
  std::vector<at::Tensor> tensors{tensor};
  if (reduced_type(op.dtype) != tensor.scalar_type()) {
    at::Tensor wide = tensor.to(reduced_type(op.dtype));
    tensors[0] = wide;
    launched.temporaries.push_back(wide);
    launched.finish = [tensor, wide]() mutable { tensor.copy_(wide); };
  }
  launched.work = group.backend->allreduce(tensors, options);
  return launched;
}

GlooLaunch GlooTransport::launch_broadcast(const WireOp& op) {
  const Group group = group_for(op.process_set);
  GlooLaunch launched;
  if (op.count == 0) return launched;
  std::vector<at::Tensor> tensors{view_of(op.data, op.count, moved_type(op.dtype))};
  c10d::BroadcastOptions options;
  options.rootRank = op.root;
  launched.work = group.backend->broadcast(tensors, options);
  return launched;
}

GlooLaunch GlooTransport::launch_allgather(const WireOp& op) {
  const Group group = group_for(op.process_set);
  // Gloo gathers equal parts: uneven ones travel padded to the longest and are unpadded after.
  GlooLaunch launched;
  if (op.recv_counts.size() != static_cast<size_t>(group.size)) {
    throw CommError("gloo allgather: " + std::to_string(op.recv_counts.size()) + " receive counts for " +
                    std::to_string(group.size) + " ranks");
  }
  if (op.recv_counts[static_cast<size_t>(group.rank)] != op.count) {
    throw CommError("gloo allgather: this rank submitted " + std::to_string(op.count) + " elements, but the agreed " +
                    "layout gives it " + std::to_string(op.recv_counts[static_cast<size_t>(group.rank)]));
  }
  const uint64_t total = total_of(op.recv_counts);
  if (total == 0) return launched;
  const at::ScalarType type = moved_type(op.dtype);
  GlooLaunch ring = launch_ring(op, group, view_of(op.data, op.count, type), view_of(op.output, total, type));
  if (ring.ring) return ring;
  const uint64_t width = *std::max_element(op.recv_counts.begin(), op.recv_counts.end());
  const bool even = std::all_of(op.recv_counts.begin(), op.recv_counts.end(), [&](uint64_t n) { return n == width; });
  at::Tensor output = view_of(op.output, total, type);
  at::Tensor input = view_of(op.data, op.count, type);
  at::Tensor gathered = output;  // even parts land in place
  if (!even) {
    at::Tensor padded = at::zeros({static_cast<int64_t>(width)}, at::TensorOptions().dtype(type));
    if (op.count > 0) padded.narrow(0, 0, static_cast<int64_t>(op.count)).copy_(input);
    input = padded;
    gathered = at::empty({static_cast<int64_t>(width * static_cast<uint64_t>(group.size))}, at::TensorOptions().dtype(type));
    launched.temporaries = {padded, gathered};
    launched.finish = [gathered, output, counts = op.recv_counts, width]() mutable {
      int64_t offset = 0;
      for (size_t r = 0; r < counts.size(); ++r) {
        const auto received = static_cast<int64_t>(counts[r]);
        if (received == 0) continue;
        output.narrow(0, offset, received).copy_(gathered.narrow(0, static_cast<int64_t>(r * width), received));
        offset += received;
      }
    };
  }
  std::vector<at::Tensor> inputs{input};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < group.size; ++r) {
    outputs[0].push_back(gathered.narrow(0, static_cast<int64_t>(r * width), static_cast<int64_t>(width)));
  }
  launched.work = group.backend->allgather(outputs, inputs, c10d::AllgatherOptions());
  return launched;
}

GlooLaunch GlooTransport::launch_reducescatter(const WireOp& op) {
  const Group group = group_for(op.process_set);
  // An allreduce of a copy of the input (the caller's stays as it is), of which this rank keeps its rows.
  GlooLaunch launched;
  if (op.recv_counts.size() != static_cast<size_t>(group.size)) {
    throw CommError("gloo reducescatter: " + std::to_string(op.recv_counts.size()) + " receive counts for " +
                    std::to_string(group.size) + " ranks");
  }
  uint64_t start = 0;
  for (int r = 0; r < group.rank; ++r) start += op.recv_counts[static_cast<size_t>(r)];
  const uint64_t kept = op.recv_counts[static_cast<size_t>(group.rank)];
  if (start + kept > op.count) {
    throw CommError("gloo reducescatter: this rank's part (elements " + std::to_string(start) + " to " +
                    std::to_string(start + kept) + ") lies outside the " + std::to_string(op.count) +
                    " elements submitted");
  }
  if (op.count == 0) return launched;
  if (total_of(op.recv_counts) == op.count) {
    const at::ScalarType type = scalar_type(op.dtype);
    GlooLaunch ring = launch_ring(op, group, view_of(op.data, op.count, type), view_of(op.output, kept, type));
    if (ring.ring) return ring;
    return launch_reducescatter_by_parts(op, group, kept);
  }
  const at::Tensor input = view_of(op.data, op.count, scalar_type(op.dtype));
  at::Tensor reduced = input.to(reduced_type(op.dtype), /*non_blocking=*/false, /*copy=*/true);
  at::Tensor output = view_of(op.output, kept, scalar_type(op.dtype));
  launched.temporaries = {reduced};
  launched.finish = [reduced, output, start, kept]() mutable {
    if (kept > 0) output.copy_(reduced.narrow(0, static_cast<int64_t>(start), static_cast<int64_t>(kept)));
  };
  c10d::AllreduceOptions options;
  options.reduceOp = reduce_op(op.op);
  std::vector<at::Tensor> tensors{reduced};
  launched.work = group.backend->allreduce(tensors, options);
  return launched;
}

GlooLaunch GlooTransport::launch_reducescatter_by_parts(const WireOp& op, const Group& group, uint64_t kept) {
  // Every rank sends each other rank that rank's part and reduces the parts it receives: each link
  // carries (n-1)/n of the bytes, as a ring reduce-scatter's, where an allreduce kept in part carried
  // 2(n-1)/n. Gloo's own reduce_scatter is no way out: on the rig at 1 Gbit, 16 MiB took 157 ms
  // against 141 ms for its allreduce (torch 2.13).
  GlooLaunch launched;
  const at::ScalarType moved = moved_type(op.dtype);
  at::Tensor input = view_of(op.data, op.count, moved);
  at::Tensor received = at::empty({static_cast<int64_t>(kept) * group.size}, at::TensorOptions().dtype(moved));
  at::Tensor output = view_of(op.output, kept, scalar_type(op.dtype));
  std::vector<int64_t> input_splits = split_sizes(op.recv_counts);
  std::vector<int64_t> output_splits(static_cast<size_t>(group.size), static_cast<int64_t>(kept));
  launched.temporaries = {received};
  const DType dtype = op.dtype;
  const ReduceOp reduction = op.op;
  const int ranks = group.size;
  launched.finish = [received, output, kept, ranks, dtype, reduction]() mutable {
    if (kept == 0) return;
    // Rank by rank, in the type Gloo would have reduced it in; integers wrap as they would there.
    const at::Tensor parts =
        received.view(scalar_type(dtype)).view({ranks, static_cast<int64_t>(kept)}).to(reduced_type(dtype));
    switch (reduction) {
      case ReduceOp::kMin: output.copy_(parts.amin(0)); break;
      case ReduceOp::kMax: output.copy_(parts.amax(0)); break;
      case ReduceOp::kProduct: output.copy_(parts.prod(0, false, parts.scalar_type())); break;
      case ReduceOp::kSum:
      case ReduceOp::kAverage: output.copy_(parts.sum(0, false, parts.scalar_type())); break;  // the core divides
    }
  };
  launched.work = group.backend->alltoall_base(received, input, output_splits, input_splits, c10d::AllToAllOptions());
  return launched;
}

GlooLaunch GlooTransport::launch_ring(const WireOp& op, const Group& group, at::Tensor input, at::Tensor output) {
  GlooLaunch launched;
  const uint64_t bytes = total_of(op.recv_counts) * static_cast<uint64_t>(input.element_size());
  if (!ring_ || group.size < 2 || bytes < RingRunner::kMinBytes) return launched;
  RingJob job;
  job.kind = op.kind;
  job.dtype = op.dtype;
  job.op = op.op;
  job.input = std::move(input);
  job.output = std::move(output);
  job.counts = op.recv_counts;
  job.what = describe(op);
  // Under the lock, so a process set removed meanwhile cannot take its runner away.
  std::lock_guard<std::mutex> lock(sets_mutex_);
  std::unique_ptr<RingRunner>& runner = rings_[op.process_set];
  if (!runner) runner = std::make_unique<RingRunner>(group.backend, group.rank, group.size);
  launched.ring = runner->submit(std::move(job));
  counters_->rings.fetch_add(1, std::memory_order_relaxed);
  return launched;
}

GlooLaunch GlooTransport::launch_alltoall(const WireOp& op) {
  const Group group = group_for(op.process_set);
  GlooLaunch launched;
  const auto ranks = static_cast<size_t>(group.size);
  if (op.send_counts.size() != ranks || op.recv_counts.size() != ranks) {
    throw CommError("gloo alltoall: " + std::to_string(op.send_counts.size()) + " send and " +
                    std::to_string(op.recv_counts.size()) + " receive counts for " + std::to_string(group.size) +
                    " ranks");
  }
  if (total_of(op.send_counts) != op.count) {
    throw CommError("gloo alltoall: the send counts add up to " + std::to_string(total_of(op.send_counts)) +
                    " elements, but " + std::to_string(op.count) + " were submitted");
  }
  // Every rank sees the same layout: when it moves nothing, no rank starts the collective.
  if (!op.layout.empty() && total_of(op.layout) == 0) return launched;
  const at::ScalarType type = moved_type(op.dtype);
  at::Tensor input = view_of(op.data, op.count, type);
  at::Tensor output = view_of(op.output, total_of(op.recv_counts), type);
  std::vector<int64_t> input_splits = split_sizes(op.send_counts);
  std::vector<int64_t> output_splits = split_sizes(op.recv_counts);
  launched.work = group.backend->alltoall_base(output, input, output_splits, input_splits, c10d::AllToAllOptions());
  return launched;
}

}  // namespace commsched
