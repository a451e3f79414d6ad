// An NCCL communicator with its own CUDA stream. A tensor is announced with submitted() on the
// thread that enqueues it, which records an event on that caller's stream; each collective over
// the tensor later makes commsched's stream wait on that event, runs NCCL there and ends with an
// event the core polls.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "transport/nccl/nccl_loader.h"

namespace commsched::nccl {

// Makes `device` current for the calling thread and restores the previous one on exit: the
// current device is per thread, and the user's, the core's and the init thread all call in here.
class DeviceGuard {
 public:
  DeviceGuard(const Api& api, int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  const Api& api_;
  int previous_ = -1;
};

// A CUDA event, destroyed with the API that made it.
class Event {
 public:
  explicit Event(std::shared_ptr<const Api> api);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  std::shared_ptr<const Api> api_;
  cudaEvent_t event_ = nullptr;
};

// One collective on the communicator's stream; test() is a non-blocking event query.
class Work {
 public:
  Work(std::shared_ptr<const Api> api, ncclComm_t comm, std::unique_ptr<Event> done);
  bool test();  // true once the GPU finished; throws with NCCL's message if the communicator failed

 private:
  std::shared_ptr<const Api> api_;
  ncclComm_t comm_;
  std::unique_ptr<Event> done_;
};

class Communicator {
 public:
  // `unique_id` comes from rank 0's unique_id(), carried to every rank by the core's bootstrap.
  Communicator(std::shared_ptr<const Api> api, const std::string& unique_id, int rank, int size, int device);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Called on the submitting thread before the core sees the tensor: records an event on `stream`
  // (the caller's stream, where the bytes are produced; nullopt: the producer says none is needed),
  // which every later collective or copy over [data, data + bytes) waits on. `average` makes the
  // allreduces over it use ncclAvg; throws std::invalid_argument if this NCCL lacks it (< 2.10).
  void submitted(uintptr_t data, uint64_t bytes, bool average, std::optional<uintptr_t> stream);
  // Drops what submitted() recorded at `data`, for a tensor the core refused.
  void forget(uintptr_t data);

  // In-place allreduce (SUM, or AVG for tensors submitted with average) / broadcast of `count`
  // elements at `data`, which must lie in a submitted tensor: fusion buffers of the core are host
  // memory and are refused, so fusion must be off for device tensors.
  std::unique_ptr<Work> allreduce(uintptr_t data, uint64_t count, const std::string& dtype);
  std::unique_ptr<Work> broadcast(uintptr_t data, uint64_t count, const std::string& dtype, int root);
  // The core's copy hook: cudaMemcpyAsync on commsched's stream (after the source's submit event),
  // then a stream synchronize, because the core uses the bytes as soon as this returns.
  void copy(uintptr_t dst, uintptr_t src, uint64_t bytes);
  // The core's average hook: a no-op for data NCCL already averaged; anything else is refused.
  void scale(uintptr_t data, uint64_t count, const std::string& dtype, double divisor);
  // Ends the communicator at once (NCCL's abort), for failures elsewhere in the job.
  void abort();

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  int version() const { return version_; }
  bool supports_average() const { return version_ >= kNcclFirstVersionWithAvg; }
  size_t submitted_count() const;  // tensors announced and not yet wholly started (for tests)

 private:
  // A tensor announced by submitted() and not yet wholly on the wire.
  struct Submitted {
    uintptr_t end = 0;
    uint64_t bytes_left = 0;
    bool average = false;
    std::shared_ptr<Event> ready;  // null when the producer needs no ordering
  };
  // What one collective needs of its tensor.
  struct Claim {
    bool average = false;
    std::shared_ptr<Event> ready;
  };

  // The submitted tensor holding `data`; `consume` bytes of it go on the wire now.
  Claim claim(uintptr_t data, uint64_t consume, const char* what);
  std::map<uintptr_t, Submitted>::iterator find(uintptr_t data);  // caller holds mutex_
  void order_after(const Event* ready);
  std::unique_ptr<Work> finish();

  std::shared_ptr<const Api> api_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int rank_;
  int size_;
  int device_;
  int version_ = 0;
  bool aborted_ = false;

  // submitted() runs on the callers' threads, everything else on the core's thread.
  mutable std::mutex mutex_;
  std::map<uintptr_t, Submitted> submitted_;  // by start address
  std::multiset<uintptr_t> averaged_;          // chunks NCCL averaged, awaiting the core's scale()
};

int nccl_dtype(const std::string& dtype);  // throws std::invalid_argument for unknown names
size_t nccl_dtype_size(int type);
std::string unique_id(const Api& api);

}  // namespace commsched::nccl
