#include "transport/gloo/gloo_transport.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
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
  }
  throw CommError("gloo: unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

std::string describe(const WireOp& op) {
  std::string text = std::string("gloo ") + kind_name(op.kind) + " of " + std::to_string(op.count) + " " +
                     dtype_name(op.dtype) + " elements";
  if (op.kind == CollectiveKind::kBroadcast) text += " from rank " + std::to_string(op.root);
  return text;
}

// The message of a c10 error without the C++ backtrace torch appends to what().
std::string message_of(const std::exception& error) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&error)) return c10_error->what_without_backtrace();
  return error.what();
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
      return "did not complete within " + std::to_string(timeout_s) + "s";
    }
  }
  return future.hasError() ? future.tryRetrieveErrorMessage() : "";
}

// A c10d work seen through the core's PendingOp: done once its future completes.
class GlooOp : public PendingOp {
 public:
  GlooOp(c10::intrusive_ptr<c10d::Work> work, std::string what, std::shared_ptr<PeerProbe> probe)
      : work_(std::move(work)), future_(work_->getFuture()), what_(std::move(what)), probe_(std::move(probe)) {}
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
    return true;
  }
  c10::ivalue::Future& future() { return *future_; }

 private:
  c10::intrusive_ptr<c10d::Work> work_;  // keeps the tensors (views of the core's memory) referenced
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::string what_;
  std::shared_ptr<PeerProbe> probe_;
};

class DoneOp : public PendingOp {
 public:
  bool test() override { return true; }
};

}  // namespace

GlooTransport::GlooTransport(c10::intrusive_ptr<c10d::Backend> data, c10::intrusive_ptr<c10d::Backend> control,
                             std::shared_ptr<GlooCounters> counters, std::function<void()> on_close)
    : data_(std::move(data)),
      control_(std::move(control)),
      probe_(std::make_shared<PeerProbe>(control_, data_->getRank(), data_->getSize())),
      counters_(counters ? std::move(counters) : std::make_shared<GlooCounters>()),
      on_close_(std::move(on_close)),
      rank_(data_->getRank()),
      size_(data_->getSize()) {
  if (control_->getSize() != size_ || control_->getRank() != rank_) {
    throw UsageError("gloo: the agreement group (rank " + std::to_string(control_->getRank()) + " of " +
                     std::to_string(control_->getSize()) + ") does not match the data group (rank " +
                     std::to_string(rank_) + " of " + std::to_string(size_) + ")");
  }
  send_slot_ = at::empty({slot_bytes_}, at::kByte);
  received_slots_ = at::empty({slot_bytes_ * size_}, at::kByte);
}

GlooTransport::~GlooTransport() {
  if (exchange_abandoned_ || in_flight_->load() > 0 || !probe_->lost().empty()) {
    // Work waiting for a rank that is gone holds its group's destructor until Gloo's own timeout
    // (30 minutes by default): abort the groups instead.
    for (auto* backend : {&data_, &control_}) {
      try {
        (*backend)->abort();
      } catch (const std::exception&) {  // a backend that cannot abort: its destructor waits, as before
      }
    }
  }
  // The backends go first: the groups the Python side destroys in on_close_ are then unreferenced.
  probe_->release();
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
    throw CommError(what + " failed to start: " + probe_->explain(message_of(error)));
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

std::unique_ptr<PendingOp> GlooTransport::start(const WireOp& op) {
  if (op.count == 0) return std::make_unique<DoneOp>();
  std::string what = describe(op);
  c10::intrusive_ptr<c10d::Work> work;
  try {
    std::vector<at::Tensor> tensors{at::from_blob(op.data, {static_cast<int64_t>(op.count)},
                                                  at::TensorOptions().dtype(scalar_type(op.dtype)))};
    if (op.kind == CollectiveKind::kAllreduce) {
      c10d::AllreduceOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      work = data_->allreduce(tensors, options);
    } else {
      c10d::BroadcastOptions options;
      options.rootRank = op.root;
      work = data_->broadcast(tensors, options);
    }
  } catch (const CommError&) {
    throw;
  } catch (const std::exception& error) {
    throw CommError(what + " failed to start: " + message_of(error));
  }
  counters_->launches.fetch_add(1, std::memory_order_relaxed);
  auto pending = std::make_unique<GlooOp>(std::move(work), std::move(what), probe_);
  in_flight_->fetch_add(1);
  // Runs on Gloo's worker thread the moment the collective completes (or at once if it has); it
  // takes no GIL, so it may run at any time, also while the interpreter finalizes.
  pending->future().addCallback([bell = doorbell_, in_flight = in_flight_](c10::ivalue::Future&) {
    in_flight->fetch_sub(1);
    if (bell) bell->ring();
  });
  return pending;
}

}  // namespace commsched
