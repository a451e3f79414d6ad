#include "transport/nccl/cuda_objects.h"

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <stdexcept>

namespace commsched::nccl {

namespace {

std::string hex(uintptr_t address) {
  char text[32];
  std::snprintf(text, sizeof(text), "0x%llx", static_cast<unsigned long long>(address));
  return text;
}

}  // namespace

DeviceGuard::DeviceGuard(const Api& api, int device) : api_(api) {
  api_.check_cuda(api_.cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) {
    api_.check_cuda(api_.cudaSetDevice(device), "cudaSetDevice");
  } else {
    previous_ = -1;  // nothing to restore
  }
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) api_.cudaSetDevice(previous_);
}

Event::Event(std::shared_ptr<const Api> api) : api_(std::move(api)) {
  api_->check_cuda(api_->cudaEventCreateWithFlags(&event_, kCudaEventDisableTiming), "cudaEventCreateWithFlags");
}

Event::~Event() {
  // Destroying an event that a stream still waits on is allowed: CUDA frees it once satisfied.
  if (event_ != nullptr) api_->cudaEventDestroy(event_);
}

DeviceMemory::DeviceMemory(std::shared_ptr<const Api> api, int device, size_t bytes)
    : api_(std::move(api)), device_(device), bytes_(bytes) {
  DeviceGuard guard(*api_, device_);
  const cudaError_t result = api_->cudaMalloc(&data_, bytes_);
  if (result != 0) {
    throw std::runtime_error("cudaMalloc of a " + std::to_string(bytes_) + "-byte fusion buffer on cuda:" +
                             std::to_string(device_) + " failed: " + api_->cudaGetErrorString(result) +
                             "; lower COMMSCHED_FUSION_BYTES or free GPU memory");
  }
}

DeviceMemory::~DeviceMemory() {
  if (data_ == nullptr) return;
  int previous = -1;
  const bool switched =
      api_->cudaGetDevice(&previous) == 0 && previous != device_ && api_->cudaSetDevice(device_) == 0;
  api_->cudaFree(data_);
  if (switched) api_->cudaSetDevice(previous);
}

void ReadyEvents::record(uintptr_t data, uint64_t bytes, std::optional<uintptr_t> stream) {
  std::shared_ptr<Event> ready;
  if (stream) {
    DeviceGuard guard(*api_, device_);
    ready = std::make_shared<Event>(api_);
    api_->check_cuda(api_->cudaEventRecord(ready->get(), reinterpret_cast<cudaStream_t>(*stream)),
                     "cudaEventRecord (the caller's stream)");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  // The core refuses a name already in flight, not memory: an entry overlapping this one belongs to
  // a tensor that failed before it went on the wire, so the new submission replaces it.
  auto next = submitted_.lower_bound(data);
  if (next != submitted_.begin() && std::prev(next)->second.end > data) --next;
  while (next != submitted_.end() && next->first < data + std::max<uint64_t>(bytes, 1)) next = submitted_.erase(next);
  submitted_[data] = Submitted{data + bytes, bytes, std::move(ready)};
}

void ReadyEvents::forget(uintptr_t data) {
  std::lock_guard<std::mutex> lock(mutex_);
  submitted_.erase(data);
}

size_t ReadyEvents::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return submitted_.size();
}

std::map<uintptr_t, ReadyEvents::Submitted>::iterator ReadyEvents::find(uintptr_t data) {
  auto found = submitted_.upper_bound(data);
  if (found == submitted_.begin()) return submitted_.end();
  --found;
  const bool inside = data < found->second.end || (data == found->first && found->second.end == found->first);
  return inside ? found : submitted_.end();
}

std::shared_ptr<Event> ReadyEvents::claim(uintptr_t data, uint64_t bytes, const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = find(data);
  if (found == submitted_.end()) {
    throw std::runtime_error(what + ": the memory at " + hex(data) +
                             " is in no tensor submitted to commsched on this rank; device tensors must be "
                             "submitted through commsched (allreduce_async, broadcast_async)");
  }
  std::shared_ptr<Event> ready = found->second.ready;
  Submitted& tensor = found->second;
  tensor.bytes_left -= std::min(bytes, tensor.bytes_left);
  if (tensor.bytes_left == 0) submitted_.erase(found);
  return ready;
}

std::shared_ptr<Event> ReadyEvents::claim_if_submitted(uintptr_t data, uint64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (find(data) == submitted_.end()) return nullptr;
  }
  return claim(data, bytes, "");
}

}  // namespace commsched::nccl
