// An NCCL communicator with its own CUDA stream. A tensor is announced with submitted() on the
// thread that enqueues it, which records an event on that caller's stream; each collective over
// the tensor later makes commsched's stream wait on that event, runs NCCL there (with a fused
// launch's copies in and out around it, on the same stream) and ends with an event the core polls.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/types.h"
#include "transport/transport.h"
#include "transport/nccl/cuda_objects.h"

namespace commsched::nccl {

class Communicator;

// One launch on the communicator's stream; test() is a non-blocking event query. Dropped before
// its event completed (a failed job), it aborts the communicator, so no kernel keeps running on
// memory that is about to be freed.
class Work {
 public:
  Work(std::shared_ptr<Communicator> comm, std::shared_ptr<Event> done);
  ~Work();
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  bool test();  // true once the GPU finished; throws with NCCL's message if the communicator failed
  // The event after the launch on commsched's stream, which a consumer's stream may wait on.
  const std::shared_ptr<Event>& done_event() const { return done_; }
  const std::shared_ptr<const Api>& api() const;

 private:
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Event> done_;
  bool finished_ = false;
};

class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  // `unique_id` comes from rank 0's unique_id(), carried to every rank by the host transport.
  Communicator(std::shared_ptr<const Api> api, const std::string& unique_id, int rank, int size, int device);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Called on the submitting thread before the core sees the tensor: records an event on `stream`
  // (the caller's stream, where the bytes are produced; nullopt: the producer says none is needed),
  // which every later collective or copy over [data, data + bytes) waits on. `average` needs
  // ncclAvg; throws std::invalid_argument if this NCCL lacks it (< 2.10).
  void submitted(uintptr_t data, uint64_t bytes, bool average, std::optional<uintptr_t> stream);
  // Drops what submitted() recorded at `data`, for a tensor the core refused.
  void forget(uintptr_t data);

  // Queues `op` on commsched's stream: for each piece of submitted memory, a wait on its submit
  // event; then, for a fused launch, the copies into op.data, the collective, and the copies back
  // out; then the event the returned Work polls. Nothing here waits for the GPU.
  std::unique_ptr<Work> launch(const WireOp& op);
  // Ends the communicator at once (NCCL's abort), for failures anywhere in the job.
  void abort();
  // Throws with NCCL's message if the communicator failed asynchronously (a peer died), aborting it.
  void check_async_error();

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  int version() const { return version_; }
  const std::shared_ptr<const Api>& api() const { return api_; }
  bool supports_average() const { return version_ >= kNcclFirstVersionWithAvg; }
  size_t submitted_count() const;  // tensors announced and not yet wholly launched (for tests)

 private:
  void wait_for(const Event* ready);
  void copy_on_stream(void* dst, const void* src, uint64_t bytes);

  std::shared_ptr<const Api> api_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int rank_;
  int size_;
  int device_;
  int version_ = 0;
  std::atomic<bool> aborted_{false};
  ReadyEvents ready_;
};

int nccl_dtype(DType dtype);
std::string unique_id(const Api& api);
std::string version_text(int code);

}  // namespace commsched::nccl
