#include "transport/nccl/nccl_comm.h"

#include <cstring>
#include <stdexcept>

namespace commsched::nccl {

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

std::string unique_id(const Api& api) {
  ncclUniqueId id;
  api.check(api.ncclGetUniqueId(&id), "ncclGetUniqueId");
  return std::string(id.internal, sizeof(id.internal));
}

Event::Event(std::shared_ptr<const Api> api) : api_(std::move(api)) {
  api_->check_cuda(api_->cudaEventCreateWithFlags(&event_, kCudaEventDisableTiming), "cudaEventCreateWithFlags");
}

Event::~Event() {
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
    : api_(std::move(api)), rank_(rank), size_(size) {
  if (id.size() != static_cast<size_t>(kNcclUniqueIdBytes)) {
    throw std::invalid_argument("NCCL unique id must be " + std::to_string(kNcclUniqueIdBytes) + " bytes, got " +
                                std::to_string(id.size()));
  }
  api_->check_cuda(api_->cudaSetDevice(device), "cudaSetDevice");
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
  if (comm_ != nullptr) aborted_ ? api_->ncclCommAbort(comm_) : api_->ncclCommDestroy(comm_);
  if (stream_ != nullptr) api_->cudaStreamDestroy(stream_);
}

void Communicator::abort() {
  if (comm_ != nullptr && !aborted_) api_->ncclCommAbort(comm_);
  aborted_ = true;
  comm_ = nullptr;
}

void Communicator::order_after(uintptr_t framework_stream) {
  if (comm_ == nullptr) throw std::runtime_error("NCCL communicator was aborted");
  Event ready(api_);
  api_->check_cuda(api_->cudaEventRecord(ready.get(), reinterpret_cast<cudaStream_t>(framework_stream)),
                   "cudaEventRecord (framework stream)");
  api_->check_cuda(api_->cudaStreamWaitEvent(stream_, ready.get(), 0), "cudaStreamWaitEvent");
  // Destroying an event that a stream still waits on is allowed: CUDA frees it once satisfied.
}

std::unique_ptr<Work> Communicator::finish() {
  auto done = std::make_unique<Event>(api_);
  api_->check_cuda(api_->cudaEventRecord(done->get(), stream_), "cudaEventRecord (commsched stream)");
  return std::make_unique<Work>(api_, comm_, std::move(done));
}

std::unique_ptr<Work> Communicator::allreduce(uintptr_t data, uint64_t count, const std::string& dtype,
                                              uintptr_t framework_stream) {
  const int type = nccl_dtype(dtype);
  order_after(framework_stream);
  void* buffer = reinterpret_cast<void*>(data);
  api_->check(api_->ncclAllReduce(buffer, buffer, count, type, kNcclSum, comm_, stream_), "ncclAllReduce");
  return finish();
}

std::unique_ptr<Work> Communicator::broadcast(uintptr_t data, uint64_t count, const std::string& dtype, int root,
                                              uintptr_t framework_stream) {
  const int type = nccl_dtype(dtype);
  if (root < 0 || root >= size_) throw std::invalid_argument("broadcast root " + std::to_string(root) + " is no rank");
  order_after(framework_stream);
  void* buffer = reinterpret_cast<void*>(data);
  api_->check(api_->ncclBroadcast(buffer, buffer, count, type, root, comm_, stream_), "ncclBroadcast");
  return finish();
}

}  // namespace commsched::nccl
