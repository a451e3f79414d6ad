// A tensor's way from the agreement to the wire and back: intake, inline completion, launch
// (with fusion), completion and the handle's end.
#include <algorithm>
#include <cctype>
#include <cstring>

#include "core/elementwise.h"
#include "core/runtime.h"

namespace commsched {

namespace {

std::string human_bytes(uint64_t bytes) {
  char text[32];
  if (bytes >= (1ull << 20)) {
    std::snprintf(text, sizeof(text), "%.1f MiB", bytes / 1048576.0);
  } else if (bytes >= 1024) {
    std::snprintf(text, sizeof(text), "%.1f KiB", bytes / 1024.0);
  } else {
    std::snprintf(text, sizeof(text), "%llu B", static_cast<unsigned long long>(bytes));
  }
  return text;
}

}  // namespace

void Runtime::take_submissions(ReportStatus& status) {
  // Swapped with a kept vector, so neither side allocates again once both have grown. Cleared
  // first too: a batch an exception cut short must not come back through the inbox.
  std::vector<Submission>& batch = intake_;
  batch.clear();
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    status.settings_epoch = requested_epoch_;
    status.settings = requested_settings_;
    batch.swap(inbox_);
    for (const Submission& submission : batch) *submission.phase = "waiting for other ranks";
  }
  const uint64_t now_us = timeline_.stamp_us();
  // The payloads of one report stay within the round's budget, not only each tensor: every rank
  // copies every rank's payloads several times over in a round (report, exchange, decode, reduce),
  // which on one host's shared memory costs more per byte than a fused collective, and a report
  // past the MPI transport's largest slot needs a second exchange. ResNet-50 replays at 2 ranks with
  // 64 KiB inline ran 20% slower when one round carried all its small tensors' bytes. What does not
  // fit goes as a collective, fused with its neighbours; another rank inlining it still agrees,
  // since a tensor whose payload one rank left out is launched by every rank.
  uint64_t inline_room = kInlineRoundBudgetBytes / static_cast<uint64_t>(size_);
  for (Submission& submission : batch) {
    const uint64_t id = next_tensor_id_++;
    timeline_.async_begin(submission.spec.name, "negotiate", id, submission.enqueued_us);
    if (timeline_.enabled()) {
      // Horovod's name for the phase that starts here (NEGOTIATE_ALLREDUCE, ...), which its tools look for.
      std::string activity = std::string("NEGOTIATE_") + kind_name(submission.spec.kind);
      for (char& c : activity) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      timeline_.instant("ready " + submission.spec.name, Timeline::kTensorTrack, now_us,
                        "{\"activity\":\"" + activity + "\"}");
    }
    const uint64_t bytes = submission.spec.bytes();
    const bool sends_bytes = submission.spec.kind == CollectiveKind::kAllreduce ||
                             (submission.spec.kind == CollectiveKind::kBroadcast && submission.spec.root == rank_);
    std::string payload;
    // A tensor the partition size would cut is not small: it goes on the wire in chunks.
    const uint64_t partition = scheduler_.settings().partition_bytes;
    const bool global = submission.spec.process_set == 0;
    if (global && bytes > 0 && bytes <= inline_limit_bytes_ && bytes <= inline_room &&
        (partition == 0 || bytes <= partition) && sends_bytes) {
      payload.assign(static_cast<const char*>(submission.data), bytes);
      inline_room -= bytes;
    }
    agreement_.announce(submission.spec, std::move(payload), id);
    tensor_nodes_.try_insert(tensors_, id,
                             LocalTensor{std::move(submission.spec), submission.data, std::move(submission.handle), 0,
                                         id, false, false, submission.phase});
  }
  batch.clear();
}

void Runtime::apply_outcome(const CycleOutcome& outcome) {
  agreed_completed_bytes_ = outcome.min_completed_bytes;
  if (outcome.min_settings_epoch > applied_epoch_) {
    // Every rank sees the same reports, so every rank switches in this same cycle.
    applied_epoch_ = outcome.root_settings_epoch;
    scheduler_.reconfigure(outcome.root_settings);
    for (auto& [process_set, set_scheduler] : set_schedulers_) {
      SchedulingSettings uncredited = outcome.root_settings;
      uncredited.credit_bytes = UINT64_MAX;
      set_scheduler.reconfigure(uncredited);
    }
    std::lock_guard<std::mutex> lock(settings_mutex_);
    applied_settings_ = outcome.root_settings;
  }
  for (const TensorFailure& failure : outcome.failures) {
    finish_failed(failure);
  }
  const uint64_t now_us = timeline_.stamp_us();
  std::vector<const char**> queued_phases;
  for (size_t i = 0; i < outcome.agreed.size(); ++i) {
    const TensorSpec& agreed = outcome.agreed[i];
    const uint64_t id = outcome.agreed_ids[i];
    if (id == kNoLocalTensor) {
      if (agreed.process_set != 0) {
        const std::vector<int>& members = agreement_.members(agreed.process_set);
        if (!std::binary_search(members.begin(), members.end(), rank_)) continue;  // a set this rank is not in
      }
      // This rank joined: an inline result needs nothing from it, a collective its zeros.
      if (outcome.inline_payloads[i].empty()) queue_stand_in(agreed);
      continue;
    }
    timeline_.async_end(agreed.name, "negotiate", id, now_us);
    if (!outcome.inline_payloads[i].empty()) {
      complete_inline(id, agreed, outcome.inline_payloads[i]);
      continue;
    }
    LocalTensor& tensor = tensors_.at(id);
    tensor.agreed = true;
    tensor.layout = agreed.layout;
    tensor.chunks_left = scheduler_for(agreed.process_set).add(id, agreed);
    tensor.chunks_unlaunched = tensor.chunks_left;
    timeline_.async_begin(agreed.name, "queued", id, now_us);
    queued_phases.push_back(tensor.phase);
  }
  if (!queued_phases.empty()) {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    for (const char** phase : queued_phases) *phase = "agreed, queued for the wire";
  }
  if (outcome.last_joined_rank >= 0) {
    last_joined_rank_ = outcome.last_joined_rank;
    end_join("");
  }
}

void Runtime::queue_stand_in(const TensorSpec& agreed) {
  const uint64_t id = next_tensor_id_++;
  LocalTensor stand_in;
  stand_in.spec = agreed;
  // An allgather's own part is empty (the agreed layout says 0 for this rank); an allreduce's is all of it.
  if (agreed.kind == CollectiveKind::kAllgather) {
    stand_in.spec.count = agreed.layout.at(static_cast<size_t>(position_in(agreement_.members(agreed.process_set), rank_)));
  }
  stand_in.zeros.assign(stand_in.spec.bytes() / sizeof(uint64_t) + 1, 0);
  stand_in.data = stand_in.zeros.data();
  stand_in.handle = std::make_shared<HandleState>(agreed.name);
  stand_in.trace_id = id;
  stand_in.agreed = true;
  stand_in.stand_in = true;
  stand_in.launched = true;  // keeps it off the timeline, which shows this rank's own tensors
  stand_in.layout = agreed.layout;
  stand_in.chunks_left = scheduler_for(agreed.process_set).add(id, agreed);
  tensor_nodes_.try_insert(tensors_, id, std::move(stand_in));
}

void Runtime::complete_inline(uint64_t id, const TensorSpec& spec, const std::vector<std::string>& payloads) {
  if (spec.kind == CollectiveKind::kBarrier) {  // agreed means every rank has arrived
    stats_.inline_tensors.fetch_add(1, std::memory_order_relaxed);
    finish_tensor(id, "");
    return;
  }
  const uint64_t bytes = spec.bytes();
  void* data = tensors_.at(id).data;
  if (spec.kind == CollectiveKind::kBroadcast) {
    std::memcpy(data, payloads[spec.root].data(), bytes);
  } else {
    // Reduced in rank order from the same bytes, so every rank gets a bit-identical result.
    // Addends go through aligned scratch, kept across rounds: the payload strings promise no
    // alignment. The result builds in the tensor itself when it is 8-byte aligned (numpy's and
    // torch's are), which saves two copies of it.
    const bool aligned = reinterpret_cast<uintptr_t>(data) % alignof(uint64_t) == 0;
    std::vector<uint64_t>& addend = inline_addend_;
    addend.resize((bytes + 7) / 8);
    void* sum = data;
    if (!aligned) {
      inline_sum_.resize(addend.size());
      sum = inline_sum_.data();
    }
    // An empty payload is a joined rank's: zeros.
    if (payloads[0].empty()) {
      std::memset(sum, 0, bytes);
    } else {
      std::memcpy(sum, payloads[0].data(), bytes);
    }
    if (spec.prescale != 1.0) multiply_by(sum, spec.count, spec.dtype, spec.prescale);
    for (int r = 1; r < size_; ++r) {
      if (payloads[r].empty()) {
        std::memset(addend.data(), 0, bytes);
      } else {
        std::memcpy(addend.data(), payloads[r].data(), bytes);
      }
      if (spec.prescale != 1.0) multiply_by(addend.data(), spec.count, spec.dtype, spec.prescale);
      reduce_into(sum, addend.data(), spec.count, spec.dtype, spec.op);
    }
    if (spec.op == ReduceOp::kAverage) divide_by(sum, spec.count, spec.dtype, static_cast<double>(size_));
    if (spec.postscale != 1.0) multiply_by(sum, spec.count, spec.dtype, spec.postscale);
    if (!aligned) std::memcpy(data, sum, bytes);
  }
  stats_.inline_tensors.fetch_add(1, std::memory_order_relaxed);
  finish_tensor(id, "");
}

std::unique_ptr<FusionBuffer> Runtime::take_fusion_buffer(size_t bytes) {
  // The pool's largest buffer first: a launch that fits reuses it, and one that does not replaces
  // it, so the pool converges on buffers of the largest fused launch and allocates no more.
  std::unique_ptr<FusionBuffer> buffer;
  if (!buffer_pool_.empty()) {
    auto largest = std::max_element(buffer_pool_.begin(), buffer_pool_.end(),
                                    [](const auto& a, const auto& b) { return a->capacity() < b->capacity(); });
    buffer = std::move(*largest);
    buffer_pool_.erase(largest);
  }
  if (!buffer || buffer->capacity() < bytes) {
    buffer.reset();  // freed before the bigger one is made: device memory may be tight
    buffer = transport_->allocate_fusion_buffer(bytes);
  }
  return buffer;
}

void Runtime::launch_ready() {
  // The credit is what every rank has completed, so every rank pops the same units here.
  scheduler_.set_completed_bytes(agreed_completed_bytes_);
  for (Launch& next : scheduler_.next_launches()) launch(std::move(next));
  for (auto& [process_set, set_scheduler] : set_schedulers_) {
    for (Launch& next : set_scheduler.next_launches()) {
      next.process_set = process_set;
      launch(std::move(next));
    }
  }
}

void Runtime::launch(Launch next) {
  InFlight flight;
  flight.launch = std::move(next);
  const Launch& plan = flight.launch;
  const size_t elem_size = dtype_size(plan.dtype);
  WireOp op;
  op.kind = plan.kind;
  op.dtype = plan.dtype;
  op.op = plan.op;
  op.process_set = plan.process_set;
  // A set's communicator numbers its members 0..n-1 in rank order: the root goes by that number.
  op.root = plan.process_set == 0 ? plan.root : position_in(agreement_.members(plan.process_set), plan.root);
  op.count = plan.bytes / elem_size;
  if (kind_has_output(plan.kind)) {
    prepare_output(flight, tensors_.at(plan.chunks.front().tensor_id), op);
  } else if (plan.chunks.size() == 1) {
    const ChunkRef& chunk = plan.chunks.front();
    op.data = static_cast<char*>(tensors_.at(chunk.tensor_id).data) + chunk.elem_offset * elem_size;
  } else {
    // Fusion copies small tensors into one buffer so the latency is paid once.
    flight.fusion_buffer = take_fusion_buffer(std::max<size_t>(plan.bytes, 1));
    char* buffer = static_cast<char*>(flight.fusion_buffer->data());
    size_t offset = 0;
    for (const ChunkRef& chunk : plan.chunks) {
      const size_t bytes = chunk.elem_count * elem_size;
      char* source = static_cast<char*>(tensors_.at(chunk.tensor_id).data) + chunk.elem_offset * elem_size;
      if (stages_fusion_) {
        op.fused.push_back(Segment{source, bytes});  // copied on the transport's stream, in order
      } else {
        transport_->copy(buffer + offset, source, bytes);
      }
      offset += bytes;
    }
    op.data = buffer;
  }
  flight.wire_data = op.data;
  flight.set_size = plan.process_set == 0 ? size_ : static_cast<int>(agreement_.members(plan.process_set).size());
  flight.started_us = timeline_.stamp_us();
  for (const ChunkRef& chunk : plan.chunks) {
    LocalTensor& tensor = tensors_.at(chunk.tensor_id);
    if (!tensor.launched) {
      tensor.launched = true;
      timeline_.async_end(tensor.spec.name, "queued", tensor.trace_id, flight.started_us);
      timeline_.async_begin(tensor.spec.name, "on the wire", tensor.trace_id, flight.started_us);
    }
  }
  stats_.launches.fetch_add(1, std::memory_order_relaxed);
  stats_.fused_launches.fetch_add(plan.chunks.size() > 1 ? 1 : 0, std::memory_order_relaxed);
  stats_.chunks.fetch_add(plan.chunks.size(), std::memory_order_relaxed);
  stats_.launched_bytes.fetch_add(plan.bytes, std::memory_order_relaxed);
  bytes_in_flight_ += plan.bytes;
  // Only the driver writes the maxima, so a load and a store cannot lose a larger value.
  if (bytes_in_flight_ > stats_.max_bytes_in_flight.load(std::memory_order_relaxed)) {
    stats_.max_bytes_in_flight.store(bytes_in_flight_, std::memory_order_relaxed);
  }
  if (plan.bytes > stats_.max_launch_bytes.load(std::memory_order_relaxed)) {
    stats_.max_launch_bytes.store(plan.bytes, std::memory_order_relaxed);
  }
  timeline_.counter("bytes in flight", flight.started_us, static_cast<double>(bytes_in_flight_));
  op.prescale = plan.prescale;
  op.postscale = plan.postscale;
  if (plan.kind == CollectiveKind::kAllreduce && plan.prescale != 1.0 && !transport_->scales()) {
    transport_->multiply(op.data, op.count, op.dtype, plan.prescale);
  }
  // Bools are bytes of 0 or 1 on the wire: min, max and product on uint8 are and, or, and.
  if (op.dtype == DType::kBool) op.dtype = DType::kUInt8;
  flight.op = transport_->start(op);
  // Launches go onto one stream in order: the mark after a tensor's last chunk covers all of it.
  if (std::shared_ptr<StreamMark> mark = flight.op->mark()) {
    for (const ChunkRef& chunk : plan.chunks) {
      LocalTensor& tensor = tensors_.at(chunk.tensor_id);
      if (tensor.chunks_unlaunched > 0 && --tensor.chunks_unlaunched == 0 && !tensor.stand_in) {
        tensor.handle->set_launched(mark);
      }
    }
  }
  in_flight_.push_back(std::move(flight));
}

void Runtime::prepare_output(InFlight& flight, LocalTensor& tensor, WireOp& op) {
  const size_t elem_size = dtype_size(tensor.spec.dtype);
  const std::vector<int>& members = agreement_.members(tensor.spec.process_set);
  const auto ranks = members.size();
  const auto me = static_cast<size_t>(position_in(members, rank_));
  const std::vector<uint64_t>& layout = tensor.layout;
  op.layout = layout;
  op.data = tensor.data;
  op.count = tensor.spec.count;  // this rank's own elements: an allgather's or alltoall's differ by rank
  uint64_t elements = 0;
  if (tensor.spec.kind == CollectiveKind::kAlltoall) {
    for (size_t other = 0; other < ranks; ++other) {
      op.send_counts.push_back(layout.at(me * ranks + other));
      op.recv_counts.push_back(layout.at(other * ranks + me));
      elements += op.recv_counts.back();
    }
  } else {
    op.recv_counts = layout;
    if (tensor.spec.kind == CollectiveKind::kAllgather) {
      for (uint64_t count : layout) elements += count;
    } else {
      elements = layout.at(me);
    }
  }
  if (tensor.spec.kind == CollectiveKind::kReducescatter && tensor.spec.prescale != 1.0 && op.count > 0 &&
      !transport_->scales()) {
    // The input is the caller's and stays as it is: the scaled copy goes on the wire.
    flight.scratch = take_fusion_buffer(op.count * elem_size);
    transport_->copy(flight.scratch->data(), tensor.data, op.count * elem_size);
    transport_->multiply(flight.scratch->data(), op.count, tensor.spec.dtype, tensor.spec.prescale);
    op.data = flight.scratch->data();
  }
  tensor.output = std::shared_ptr<FusionBuffer>(transport_->allocate_fusion_buffer(std::max<size_t>(elements * elem_size, 1)));
  tensor.output_elements = elements;
  flight.output = tensor.output;
  op.output = tensor.output->data();
}

bool Runtime::poll_in_flight() {
  bool any = false;
  for (size_t i = 0; i < in_flight_.size();) {
    if (in_flight_[i].op->test()) {
      InFlight done = std::move(in_flight_[i]);
      in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(i));
      finish(done);
      any = true;
    } else {
      ++i;
    }
  }
  return any;
}

void Runtime::finish(InFlight& done) {
  const Launch& plan = done.launch;
  const size_t elem_size = dtype_size(plan.dtype);
  const auto ranks = static_cast<double>(done.set_size);
  if (plan.kind == CollectiveKind::kAllreduce) {
    if (plan.op == ReduceOp::kAverage && !transport_averages_) {
      transport_->scale(done.wire_data, plan.bytes / elem_size, plan.dtype, ranks);
    }
    if (plan.postscale != 1.0 && !transport_->scales()) transport_->multiply(done.wire_data, plan.bytes / elem_size, plan.dtype, plan.postscale);
  } else if (plan.kind == CollectiveKind::kReducescatter && done.output) {
    const uint64_t elements = tensors_.at(plan.chunks.front().tensor_id).output_elements;
    if (plan.op == ReduceOp::kAverage && !transport_averages_ && elements > 0) {
      transport_->scale(done.output->data(), elements, plan.dtype, ranks);
    }
    if (plan.postscale != 1.0 && elements > 0 && !transport_->scales()) {
      transport_->multiply(done.output->data(), elements, plan.dtype, plan.postscale);
    }
  }
  const uint64_t now_us = timeline_.stamp_us();
  std::string members;
  size_t offset = 0;
  for (const ChunkRef& chunk : plan.chunks) {
    LocalTensor& tensor = tensors_.at(chunk.tensor_id);
    const size_t bytes = chunk.elem_count * elem_size;
    if (done.fusion_buffer && !stages_fusion_) {
      transport_->copy(static_cast<char*>(tensor.data) + chunk.elem_offset * elem_size,
                       static_cast<char*>(done.fusion_buffer->data()) + offset, bytes);
    }
    offset += bytes;
    if (timeline_.enabled()) {
      members += (members.empty() ? "" : ",") + Timeline::quote(tensor.spec.name + "#" + std::to_string(chunk.index));
    }
    if (--tensor.chunks_left == 0) finish_tensor(chunk.tensor_id, "");
  }
  // The credit gate counts set 0's launches only: the other sets' schedulers have no credit.
  if (plan.process_set == 0) completed_bytes_ += plan.bytes;
  bytes_in_flight_ -= plan.bytes;
  if (timeline_.enabled()) {
    const std::string label = std::string(kind_name(plan.kind)) + " " + dtype_name(plan.dtype) + " " +
                              human_bytes(plan.bytes) +
                              (plan.chunks.size() > 1 ? " (" + std::to_string(plan.chunks.size()) + " fused)" : "");
    timeline_.complete(label, Timeline::kWireTrack, done.started_us, now_us - done.started_us,
                       "{\"seq\":" + std::to_string(plan.seq) + ",\"bytes\":" + std::to_string(plan.bytes) +
                           ",\"chunks\":[" + members + "]}");
    timeline_.counter("bytes in flight", now_us, static_cast<double>(bytes_in_flight_));
  }
  if (done.fusion_buffer) buffer_pool_.push_back(std::move(done.fusion_buffer));
  if (done.scratch) buffer_pool_.push_back(std::move(done.scratch));
}

void Runtime::finish_tensor(uint64_t id, const std::string& error) {
  auto found = tensors_.find(id);
  if (found == tensors_.end()) return;  // already finished (failed while stopping)
  LocalTensor tensor = std::move(found->second);
  tensor_nodes_.erase(tensors_, found);
  if (tensor.stand_in) {
    // Nobody waits on a stand-in and its name belongs to no submission of this rank.
    (error.empty() ? stats_.completed_tensors : stats_.failed_tensors).fetch_add(1, std::memory_order_relaxed);
    return;
  }
  {
    // Free the name before signalling, so the caller may resubmit it at once.
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    auto active = active_names_.find(tensor.spec.name);
    if (active != active_names_.end()) name_nodes_.erase(active_names_, active);
  }
  const uint64_t now_us = timeline_.stamp_us();
  if (tensor.launched) timeline_.async_end(tensor.spec.name, "on the wire", tensor.trace_id, now_us);
  if (timeline_.enabled()) {
    timeline_.instant((error.empty() ? "done " : "failed ") + tensor.spec.name, Timeline::kTensorTrack, now_us);
  }
  (error.empty() ? stats_.completed_tensors : stats_.failed_tensors).fetch_add(1, std::memory_order_relaxed);
  // Callers waiting on the core's condition (not the handle's) hear of it when the driver
  // gives up its role: loop(), wait_for_news() and wait() notify them then, under the lock.
  if (error.empty()) {
    if (tensor.output) {
      tensor.handle->set_output(std::move(tensor.output), std::move(tensor.layout), tensor.output_elements);
    }
    tensor.handle->complete();
  } else {
    tensor.handle->fail(error);
  }
}

}  // namespace commsched
