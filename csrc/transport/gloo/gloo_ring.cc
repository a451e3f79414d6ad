#include "transport/gloo/gloo_ring.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <stdexcept>
#include <utility>

namespace commsched {

namespace {

// The loop stops: the wait in progress was aborted.
struct Stopped {};

// Reduces `a` and `b` into `out` (which may be `a`) as Gloo would: int16 in int32, so sums and
// products wrap as int16 arithmetic does; bool arrives as bytes of 0 or 1 with min, max or product.
void combine(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, DType dtype, ReduceOp op) {
  if (dtype == DType::kInt16) {
    at::Tensor wide = a.to(at::kInt);
    at::Tensor other = b.to(at::kInt);
    combine(wide, wide, other, DType::kInt32, op);
    out.copy_(wide);
    return;
  }
  switch (op) {
    case ReduceOp::kMin: at::minimum_out(out, a, b); return;
    case ReduceOp::kMax: at::maximum_out(out, a, b); return;
    case ReduceOp::kProduct: at::mul_out(out, a, b); return;
    case ReduceOp::kSum:
    case ReduceOp::kAverage: at::add_out(out, a, b); return;  // the core divides
  }
}

int64_t offset_of(const std::vector<uint64_t>& counts, int block) {
  int64_t offset = 0;
  for (int b = 0; b < block; ++b) offset += static_cast<int64_t>(counts[static_cast<size_t>(b)]);
  return offset;
}

}  // namespace

std::string gloo_message(const std::exception& error) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&error)) return c10_error->what_without_backtrace();
  return error.what();
}

RingRunner::RingRunner(c10::intrusive_ptr<c10d::Backend> backend, int rank, int size)
    : backend_(std::move(backend)), rank_(rank), size_(size), thread_([this] { loop(); }) {}

RingRunner::~RingRunner() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    if (waiting_) waiting_->abort();
  }
  wake_.notify_all();
  thread_.join();
  for (RingJob& job : queue_) {
    job.done->setError(std::make_exception_ptr(std::runtime_error("the transport closed before it started")));
  }
  queue_.clear();
}

c10::intrusive_ptr<c10::ivalue::Future> RingRunner::submit(RingJob job) {
  job.done = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
  c10::intrusive_ptr<c10::ivalue::Future> done = job.done;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) throw CommError(job.what + ": the transport is closing");
    queue_.push_back(std::move(job));
  }
  wake_.notify_one();
  return done;
}

void RingRunner::loop() {
  for (;;) {
    RingJob job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;  // the destructor fails what is queued
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    std::string error;
    if (!broken_.empty()) {
      error = "an earlier ring collective on this group failed (" + broken_ + "), so the ranks are out of step";
    } else {
      try {
        run(job);
      } catch (const Stopped&) {
        error = "the transport closed before it completed";
      } catch (const std::exception& failure) {
        error = gloo_message(failure);
        broken_ = error;
      }
    }
    // Completing runs the transport's callback (the doorbell) on this thread.
    if (error.empty()) {
      job.done->markCompleted(c10::IValue());
    } else {
      job.done->setError(std::make_exception_ptr(std::runtime_error(error)));
    }
  }
}

bool RingRunner::wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return false;
    waiting_ = work;
  }
  bool completed = false;
  try {
    completed = work->wait();
  } catch (const std::exception& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    waiting_.reset();
    throw std::runtime_error(what + ": " + gloo_message(error));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  waiting_.reset();
  return completed && !stopping_;
}

std::vector<RingRunner::Segment> RingRunner::segments(const RingJob& job, bool sending) const {
  // Rank r sends at step s the block its predecessor receives then; a reduce-scatter's blocks are one
  // step further along, so that the last step brings each rank its own block.
  const int shift = (job.kind == CollectiveKind::kReducescatter ? 1 : 0) + (sending ? 0 : 1);
  const int64_t per_segment = std::max<int64_t>(
      1, static_cast<int64_t>(kSegmentBytes / static_cast<uint64_t>(job.output.element_size())));
  const int tag_base = kTagBase + static_cast<int>((sequence_ & 0xFF) << 16);
  std::vector<Segment> out;
  for (int step = 0; step + 1 < size_; ++step) {
    const int block = ((rank_ - step - shift) % size_ + size_) % size_;
    const auto count = static_cast<int64_t>(job.counts[static_cast<size_t>(block)]);
    const int64_t start = offset_of(job.counts, block);
    for (int64_t done = 0; done < count; done += per_segment) {
      const int tag = tag_base + static_cast<int>(out.size() & 0xFFFF);
      out.push_back(Segment{step, block, start + done, std::min(per_segment, count - done), tag});
    }
  }
  return out;
}

void RingRunner::run(RingJob& job) {
  const bool reduce = job.kind == CollectiveKind::kReducescatter;
  const int next = (rank_ + 1) % size_;
  const int previous = (rank_ + size_ - 1) % size_;
  const std::vector<Segment> sends = segments(job, true);
  const std::vector<Segment> receives = segments(job, false);
  ++sequence_;
  const int64_t mine = offset_of(job.counts, rank_);
  at::Tensor partial;  // reduce-scatter: the blocks received, reduced in place before they go on
  if (reduce) {
    const int64_t elements = offset_of(job.counts, size_);
    const int64_t bytes = elements * job.input.element_size();
    if (!scratch_.defined() || scratch_.numel() < bytes) scratch_ = at::empty({bytes}, at::kByte);
    partial = scratch_.narrow(0, 0, bytes).view(job.input.scalar_type());
  }
  // Where a segment travels from: step 0 sends this rank's own data; later steps what it received.
  const auto source = [&](const Segment& segment) {
    if (segment.step == 0) {
      return reduce ? job.input.narrow(0, segment.offset, segment.count)
                    : job.input.narrow(0, segment.offset - mine, segment.count);
    }
    return (reduce ? partial : job.output).narrow(0, segment.offset, segment.count);
  };
  std::vector<c10::intrusive_ptr<c10d::Work>> posted;
  posted.reserve(sends.size() + receives.size());
  // After a failure or an abort a message may yet land in a receive nobody waits for.
  const auto fail = [&] {
    keep_until_exit(std::make_pair(std::move(posted), std::vector<at::Tensor>{scratch_, job.input, job.output}));
  };
  std::vector<c10::intrusive_ptr<c10d::Work>> received(receives.size());
  std::vector<c10::intrusive_ptr<c10d::Work>> sent(sends.size());
  size_t first_later_send = 0;
  try {
    // Every receive is posted before any send: a message that arrives before its receive is posted
    // moves at about half the link's rate.
    for (size_t i = 0; i < receives.size(); ++i) {
      const Segment& segment = receives[i];
      std::vector<at::Tensor> into{(reduce ? partial : job.output).narrow(0, segment.offset, segment.count)};
      received[i] = backend_->recv(into, previous, segment.tag);
      posted.push_back(received[i]);
    }
    for (; first_later_send < sends.size() && sends[first_later_send].step == 0; ++first_later_send) {
      std::vector<at::Tensor> from{source(sends[first_later_send])};
      sent[first_later_send] = backend_->send(from, next, sends[first_later_send].tag);
      posted.push_back(sent[first_later_send]);
    }
    if (!reduce && job.counts[static_cast<size_t>(rank_)] > 0) {
      job.output.narrow(0, mine, static_cast<int64_t>(job.counts[static_cast<size_t>(rank_)])).copy_(job.input);
    }
    // The receives of step s are the sends of step s + 1, segment for segment.
    size_t next_send = first_later_send;
    for (size_t i = 0; i < receives.size(); ++i) {
      const Segment& segment = receives[i];
      const std::string what = "step " + std::to_string(segment.step + 1) + " of " + std::to_string(size_ - 1) +
                               ", receiving from rank " + std::to_string(previous) + " of the group";
      if (!wait(received[i], what)) throw Stopped{};
      received[i].reset();
      const bool last = segment.step + 2 == size_;
      if (reduce) {
        at::Tensor arrived = partial.narrow(0, segment.offset, segment.count);
        const at::Tensor own = job.input.narrow(0, segment.offset, segment.count);
        if (last) {
          at::Tensor result = job.output.narrow(0, segment.offset - mine, segment.count);
          combine(result, arrived, own, job.dtype, job.op);
        } else {
          combine(arrived, arrived, own, job.dtype, job.op);
        }
      }
      if (!last) {
        std::vector<at::Tensor> from{source(sends[next_send])};
        sent[next_send] = backend_->send(from, next, sends[next_send].tag);
        posted.push_back(sent[next_send]);
        ++next_send;
      }
    }
    for (c10::intrusive_ptr<c10d::Work>& work : sent) {
      if (!wait(work, "sending to rank " + std::to_string(next) + " of the group")) throw Stopped{};
    }
  } catch (...) {
    fail();
    throw;
  }
}

}  // namespace commsched
