#include "transport/nccl/nccl_comm.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <stdexcept>

namespace commsched::nccl {

namespace {

std::string hex(uintptr_t address) {
  char text[32];
  std::snprintf(text, sizeof(text), "0x%llx", static_cast<unsigned long long>(address));
  return text;
}

std::string version_text(int code) {
  // ncclGetVersion: major*10000 + minor*100 + patch since 2.9, major*1000 + minor*100 + patch before.
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? (code % 10000) / 100 : (code % 1000) / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

}  // namespace

int nccl_dtype(const std::string& dtype) {
  if (dtype == "float16") return kNcclFloat16;
  if (dtype == "bfloat16") return kNcclBfloat16;
  if (dtype == "float32") return kNcclFloat32;
  if (dtype == "float64") return kNcclFloat64;
  if (dtype == "int32") return kNcclInt32;
  if (dtype == "int64") return kNcclInt64;
  if (dtype == "uint8") return kNcclUint8;
  if (dtype == "int8") return kNcclInt8;
  throw std::invalid_argument("NCCL transport: unknown dtype " + dtype);
}

size_t nccl_dtype_size(int type) {
  switch (type) {
    case kNcclInt8:
    case kNcclUint8:
      return 1;
    case kNcclFloat16:
    case kNcclBfloat16:
      return 2;
    case kNcclInt32:
    case kNcclFloat32:
      return 4;
    default:
      return 8;
  }
}

std::string unique_id(const Api& api) {
  ncclUniqueId id;
  api.check(api.ncclGetUniqueId(&id), "ncclGetUniqueId");
  return std::string(id.internal, sizeof(id.internal));
}

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

Work::Work(std::shared_ptr<const Api> api, ncclComm_t comm, std::unique_ptr<Event> done)
    : api_(std::move(api)), comm_(comm), done_(std::move(done)) {}

bool Work::test() {
  const cudaError_t state = api_->cudaEventQuery(done_->get());
  if (state == 0) return true;
  if (state != kCudaErrorNotReady) api_->check_cuda(state, "cudaEventQuery");
  // Still running: a peer that died shows up only as NCCL's asynchronous error.
  ncclResult_t async_error = 0;
  api_->check(api_->ncclCommGetAsyncError(comm_, &async_error), "ncclCommGetAsyncError");
  api_->check(async_error, "NCCL collective");
  return false;
}

Communicator::Communicator(std::shared_ptr<const Api> api, const std::string& id, int rank, int size, int device)
    : api_(std::move(api)), rank_(rank), size_(size), device_(device) {
  if (id.size() != static_cast<size_t>(kNcclUniqueIdBytes)) {
    throw std::invalid_argument("NCCL unique id must be " + std::to_string(kNcclUniqueIdBytes) + " bytes, got " +
                                std::to_string(id.size()));
  }
  api_->check(api_->ncclGetVersion(&version_), "ncclGetVersion");
  DeviceGuard guard(*api_, device_);  // the stream and the communicator belong to `device`
  api_->check_cuda(api_->cudaStreamCreateWithFlags(&stream_, kCudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  ncclUniqueId unique;
  std::memcpy(unique.internal, id.data(), sizeof(unique.internal));
  const ncclResult_t result = api_->ncclCommInitRank(&comm_, size, unique, rank);
  if (result != 0) {
    api_->cudaStreamDestroy(stream_);
    api_->check(result, "ncclCommInitRank");
  }
}

Communicator::~Communicator() {
  // The last reference may go on any thread: destroy on our device, as DeviceGuard would, but
  // without throwing from a destructor.
  int previous = -1;
  const bool switched =
      api_->cudaGetDevice(&previous) == 0 && previous != device_ && api_->cudaSetDevice(device_) == 0;
  if (comm_ != nullptr) aborted_ ? api_->ncclCommAbort(comm_) : api_->ncclCommDestroy(comm_);
  if (stream_ != nullptr) api_->cudaStreamDestroy(stream_);
  if (switched) api_->cudaSetDevice(previous);
}

void Communicator::abort() {
  if (comm_ != nullptr && !aborted_) api_->ncclCommAbort(comm_);
  aborted_ = true;
  comm_ = nullptr;
}

size_t Communicator::submitted_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return submitted_.size();
}

void Communicator::submitted(uintptr_t data, uint64_t bytes, bool average, std::optional<uintptr_t> stream) {
  if (average && !supports_average()) {
    throw std::invalid_argument("op=\"average\" on device memory needs NCCL 2.10 or newer (ncclAvg), but NCCL " +
                                version_text(version_) +
                                " is loaded; upgrade it (pip install -U nvidia-nccl-cu12) or submit with op=\"sum\" "
                                "and divide by commsched.size()");
  }
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
  submitted_[data] = Submitted{data + bytes, bytes, average, std::move(ready)};
}

void Communicator::forget(uintptr_t data) {
  std::lock_guard<std::mutex> lock(mutex_);
  submitted_.erase(data);
}

std::map<uintptr_t, Communicator::Submitted>::iterator Communicator::find(uintptr_t data) {
  auto found = submitted_.upper_bound(data);
  if (found == submitted_.begin()) return submitted_.end();
  --found;
  const bool inside = data < found->second.end || (data == found->first && found->second.end == found->first);
  return inside ? found : submitted_.end();
}

Communicator::Claim Communicator::claim(uintptr_t data, uint64_t consume, const char* what) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = find(data);
  if (found == submitted_.end()) {
    throw std::runtime_error(std::string("NCCL transport: the ") + what + " at " + hex(data) +
                             " is in no tensor submitted to commsched on this rank; device tensors must be "
                             "submitted through commsched.allreduce_async/broadcast_async, and are never fused "
                             "(the core's fusion buffer is host memory: keep COMMSCHED_FUSION_BYTES=0)");
  }
  Claim claim{found->second.average, found->second.ready};
  Submitted& tensor = found->second;
  tensor.bytes_left -= std::min(consume, tensor.bytes_left);
  if (tensor.bytes_left == 0) submitted_.erase(found);
  return claim;
}

void Communicator::order_after(const Event* ready) {
  if (comm_ == nullptr) throw std::runtime_error("NCCL communicator was aborted");
  if (ready != nullptr) {
    api_->check_cuda(api_->cudaStreamWaitEvent(stream_, ready->get(), 0), "cudaStreamWaitEvent");
  }
}

std::unique_ptr<Work> Communicator::finish() {
  auto done = std::make_unique<Event>(api_);
  api_->check_cuda(api_->cudaEventRecord(done->get(), stream_), "cudaEventRecord (commsched stream)");
  return std::make_unique<Work>(api_, comm_, std::move(done));
}

std::unique_ptr<Work> Communicator::allreduce(uintptr_t data, uint64_t count, const std::string& dtype) {
  const int type = nccl_dtype(dtype);
  const Claim tensor = claim(data, count * nccl_dtype_size(type), "allreduce");
  DeviceGuard guard(*api_, device_);
  order_after(tensor.ready.get());
  void* buffer = reinterpret_cast<void*>(data);
  // The core divides an average itself after the sum (scale()); NCCL does it inside the collective
  // instead, where the data already is, and scale() then only checks that it did.
  const int op = tensor.average ? kNcclAvg : kNcclSum;
  api_->check(api_->ncclAllReduce(buffer, buffer, count, type, op, comm_, stream_), "ncclAllReduce");
  if (tensor.average) {
    std::lock_guard<std::mutex> lock(mutex_);
    averaged_.insert(data);
  }
  return finish();
}

std::unique_ptr<Work> Communicator::broadcast(uintptr_t data, uint64_t count, const std::string& dtype, int root) {
  const int type = nccl_dtype(dtype);
  if (root < 0 || root >= size_) throw std::invalid_argument("broadcast root " + std::to_string(root) + " is no rank");
  const Claim tensor = claim(data, count * nccl_dtype_size(type), "broadcast");
  DeviceGuard guard(*api_, device_);
  order_after(tensor.ready.get());
  void* buffer = reinterpret_cast<void*>(data);
  api_->check(api_->ncclBroadcast(buffer, buffer, count, type, root, comm_, stream_), "ncclBroadcast");
  return finish();
}

void Communicator::copy(uintptr_t dst, uintptr_t src, uint64_t bytes) {
  std::shared_ptr<Event> ready;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = find(src);
    if (found != submitted_.end()) ready = found->second.ready;  // copy-in: the source is a submitted tensor
  }
  DeviceGuard guard(*api_, device_);
  order_after(ready.get());
  api_->check_cuda(api_->cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes,
                                         kCudaMemcpyDefault, stream_),
                   "cudaMemcpyAsync");
  api_->check_cuda(api_->cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

void Communicator::scale(uintptr_t data, uint64_t count, const std::string& dtype, double divisor) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = averaged_.find(data);
  if (found == averaged_.end()) {
    throw std::runtime_error("NCCL transport: asked to average " + std::to_string(count) + " " + dtype + " at " +
                             hex(data) + " that NCCL did not average; device tensors are averaged inside the "
                             "allreduce (ncclAvg) when submitted with op=\"average\"");
  }
  averaged_.erase(found);
  if (divisor != static_cast<double>(size_)) {
    throw std::runtime_error("NCCL transport: ncclAvg divided by " + std::to_string(size_) + " ranks, but the core "
                             "asked for " + std::to_string(divisor));
  }
}

}  // namespace commsched::nccl
