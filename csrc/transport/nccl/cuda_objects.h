// CUDA objects the device transports share (NCCL, CUDA-aware MPI), over the runtime loaded by
// nccl_loader: the current-device guard, events, device memory, and the submit-time events that
// order a collective after the producer of its bytes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
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

// Device memory from cudaMalloc, freed with cudaFree.
class DeviceMemory {
 public:
  DeviceMemory(std::shared_ptr<const Api> api, int device, size_t bytes);
  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  std::shared_ptr<const Api> api_;
  int device_;
  void* data_ = nullptr;
  size_t bytes_;
};

// The point each submitted tensor's producer had reached on its stream at submit, filed by the
// tensor's address range: every collective or copy over that memory is ordered after it.
// record() runs on the submitting threads, claim() on the core's driver.
class ReadyEvents {
 public:
  ReadyEvents(std::shared_ptr<const Api> api, int device) : api_(std::move(api)), device_(device) {}
  // Records an event on `stream` (nullopt: the producer needs no ordering) for [data, data + bytes).
  void record(uintptr_t data, uint64_t bytes, std::optional<uintptr_t> stream);
  void forget(uintptr_t data);  // a tensor the core refused
  // The event of the tensor holding [data, data + bytes), which now goes on the wire (null: none
  // needed); the tensor's record ends once all its bytes went. Throws naming `what` for memory
  // that was never submitted.
  std::shared_ptr<Event> claim(uintptr_t data, uint64_t bytes, const std::string& what);
  // As claim(), but memory that was never submitted (a fusion buffer) is no error: null.
  std::shared_ptr<Event> claim_if_submitted(uintptr_t data, uint64_t bytes);
  size_t size() const;

 private:
  struct Submitted {
    uintptr_t end = 0;
    uint64_t bytes_left = 0;
    std::shared_ptr<Event> ready;
  };
  std::map<uintptr_t, Submitted>::iterator find(uintptr_t data);  // caller holds mutex_

  std::shared_ptr<const Api> api_;
  int device_;
  mutable std::mutex mutex_;
  std::map<uintptr_t, Submitted> submitted_;  // by start address
};

}  // namespace commsched::nccl
