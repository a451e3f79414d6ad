// An NCCL communicator with its own CUDA stream: commsched's collectives run there, each ordered
// after the framework's stream with an event, and each ends with an event the core polls.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "transport/nccl/nccl_loader.h"

namespace commsched::nccl {

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

class Communicator;

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

  // In-place SUM allreduce / broadcast of `count` elements at device address `data`, started
  // after all work queued so far on `framework_stream` (0: the legacy default stream).
  std::unique_ptr<Work> allreduce(uintptr_t data, uint64_t count, const std::string& dtype, uintptr_t framework_stream);
  std::unique_ptr<Work> broadcast(uintptr_t data, uint64_t count, const std::string& dtype, int root,
                                  uintptr_t framework_stream);
  // Ends the communicator at once (NCCL's abort), for failures elsewhere in the job.
  void abort();
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  void order_after(uintptr_t framework_stream);
  std::unique_ptr<Work> finish();

  std::shared_ptr<const Api> api_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int rank_;
  int size_;
  bool aborted_ = false;
};

int nccl_dtype(const std::string& dtype);  // throws std::invalid_argument for unknown names
std::string unique_id(const Api& api);

}  // namespace commsched::nccl
