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

}  // namespace

std::string version_text(int code) {
  // ncclGetVersion: major*10000 + minor*100 + patch since 2.9, major*1000 + minor*100 + patch before.
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? (code % 10000) / 100 : (code % 1000) / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

int nccl_dtype(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return kNcclFloat16;
    case DType::kBFloat16: return kNcclBfloat16;
    case DType::kFloat32: return kNcclFloat32;
    case DType::kFloat64: return kNcclFloat64;
    case DType::kInt32: return kNcclInt32;
    case DType::kInt64: return kNcclInt64;
    case DType::kUInt8: return kNcclUint8;
    case DType::kInt8: return kNcclInt8;
  }
  throw std::invalid_argument("NCCL transport: no NCCL type for this dtype");
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

Work::Work(std::shared_ptr<Communicator> comm, std::unique_ptr<Event> done)
    : comm_(std::move(comm)), done_(std::move(done)) {}

Work::~Work() {
  // Only a failed job drops a launch before it finished; its kernels must not outlive the memory.
  if (!finished_) comm_->abort();
}

bool Work::test() {
  if (finished_) return true;
  const Api& api = *comm_->api();
  const cudaError_t state = api.cudaEventQuery(done_->get());
  if (state == 0) return finished_ = true;
  if (state != kCudaErrorNotReady) {
    comm_->abort();
    api.check_cuda(state, "cudaEventQuery (an NCCL launch)");
  }
  // Still running: a peer that died shows up only as NCCL's asynchronous error.
  comm_->check_async_error();
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
  if (comm_ != nullptr && !aborted_) {
    api_->cudaStreamSynchronize(stream_);  // every launch is done (the core drained them): a clean end
    api_->ncclCommDestroy(comm_);
  }
  if (stream_ != nullptr) api_->cudaStreamDestroy(stream_);
  if (switched) api_->cudaSetDevice(previous);
}

void Communicator::abort() {
  if (aborted_.exchange(true) || comm_ == nullptr) return;
  // NCCL's abort ends kernels that wait for peers, which a destroy would wait for forever.
  api_->ncclCommAbort(comm_);
}

void Communicator::check_async_error() {
  if (aborted_) throw std::runtime_error("the NCCL communicator was aborted after an earlier failure");
  ncclResult_t async_error = 0;
  api_->check(api_->ncclCommGetAsyncError(comm_, &async_error), "ncclCommGetAsyncError");
  if (async_error != 0) {
    abort();
    throw std::runtime_error(std::string("NCCL failed on rank ") + std::to_string(rank_) +
                             " (a peer may have died or hung): " + api_->ncclGetErrorString(async_error));
  }
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
  submitted_[data] = Submitted{data + bytes, bytes, std::move(ready)};
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

std::shared_ptr<Event> Communicator::claim(uintptr_t data, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = find(data);
  if (found == submitted_.end()) {
    throw std::runtime_error("NCCL transport: the memory at " + hex(data) +
                             " is in no tensor submitted to commsched on this rank; device tensors must be "
                             "submitted through commsched (allreduce_async, broadcast_async)");
  }
  std::shared_ptr<Event> ready = found->second.ready;
  Submitted& tensor = found->second;
  tensor.bytes_left -= std::min(bytes, tensor.bytes_left);
  if (tensor.bytes_left == 0) submitted_.erase(found);
  return ready;
}

void Communicator::wait_for(const Event* ready) {
  if (ready != nullptr) {
    api_->check_cuda(api_->cudaStreamWaitEvent(stream_, ready->get(), 0), "cudaStreamWaitEvent");
  }
}

void Communicator::copy_on_stream(void* dst, const void* src, uint64_t bytes) {
  api_->check_cuda(api_->cudaMemcpyAsync(dst, src, bytes, kCudaMemcpyDefault, stream_), "cudaMemcpyAsync");
}

std::unique_ptr<Work> Communicator::launch(const WireOp& op) {
  if (aborted_) throw std::runtime_error("the NCCL communicator was aborted after an earlier failure");
  const int type = nccl_dtype(op.dtype);
  const size_t elem_size = dtype_size(op.dtype);
  DeviceGuard guard(*api_, device_);
  // Every piece waits for the point its producer reached at submit, then goes in (fused launches).
  if (op.fused.empty()) {
    const std::shared_ptr<Event> ready = claim(reinterpret_cast<uintptr_t>(op.data), op.count * elem_size);
    wait_for(ready.get());
  } else {
    char* buffer = static_cast<char*>(op.data);
    for (const Segment& piece : op.fused) {
      const std::shared_ptr<Event> ready = claim(reinterpret_cast<uintptr_t>(piece.data), piece.bytes);
      wait_for(ready.get());
      copy_on_stream(buffer, piece.data, piece.bytes);
      buffer += piece.bytes;
    }
  }
  if (op.kind == CollectiveKind::kAllreduce) {
    // NCCL divides where the data already is (ncclAvg): no extra pass, no host round trip.
    const int reduction = op.op == ReduceOp::kAverage ? kNcclAvg : kNcclSum;
    api_->check(api_->ncclAllReduce(op.data, op.data, op.count, type, reduction, comm_, stream_), "ncclAllReduce");
  } else {
    if (op.root < 0 || op.root >= size_) {
      throw std::invalid_argument("broadcast root " + std::to_string(op.root) + " is no rank");
    }
    api_->check(api_->ncclBroadcast(op.data, op.data, op.count, type, op.root, comm_, stream_), "ncclBroadcast");
  }
  const char* buffer = static_cast<const char*>(op.data);
  for (const Segment& piece : op.fused) {
    copy_on_stream(piece.data, buffer, piece.bytes);
    buffer += piece.bytes;
  }
  auto done = std::make_unique<Event>(api_);
  api_->check_cuda(api_->cudaEventRecord(done->get(), stream_), "cudaEventRecord (commsched stream)");
  return std::make_unique<Work>(shared_from_this(), std::move(done));
}

}  // namespace commsched::nccl
