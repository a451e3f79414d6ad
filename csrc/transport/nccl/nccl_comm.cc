#include "transport/nccl/nccl_comm.h"

#include "transport/nccl/nccl_collectives.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <stdexcept>

namespace commsched::nccl {

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
    case DType::kBool: return kNcclUint8;
    case DType::kInt16: break;
  }
  throw std::invalid_argument("NCCL transport: no NCCL type for this dtype");
}

std::string unique_id(const Api& api) {
  ncclUniqueId id;
  api.check(api.ncclGetUniqueId(&id), "ncclGetUniqueId");
  return std::string(id.internal, sizeof(id.internal));
}

Work::Work(std::shared_ptr<Communicator> comm, std::shared_ptr<Event> done)
    : comm_(std::move(comm)), done_(std::move(done)) {}

const std::shared_ptr<const Api>& Work::api() const { return comm_->api(); }

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
    : api_(std::move(api)), rank_(rank), size_(size), device_(device), ready_(api_, device) {
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

void Communicator::submitted(uintptr_t data, uint64_t bytes, bool average, std::optional<uintptr_t> stream) {
  if (average && !supports_average()) {
    throw std::invalid_argument("op=\"average\" on device memory needs NCCL 2.10 or newer (ncclAvg), but NCCL " +
                                version_text(version_) +
                                " is loaded; upgrade it (pip install -U nvidia-nccl-cu12) or submit with op=\"sum\" "
                                "and divide by commsched.size()");
  }
  ready_.record(data, bytes, stream);
}

void Communicator::forget(uintptr_t data) { ready_.forget(data); }

size_t Communicator::submitted_count() const { return ready_.size(); }

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
  const size_t elem_size = dtype_size(op.dtype);
  static const std::string kWhat = "NCCL transport";
  DeviceGuard guard(*api_, device_);
  // Every piece waits for the point its producer reached at submit, then goes in (fused launches).
  if (op.fused.empty()) {
    const std::shared_ptr<Event> ready = ready_.claim(reinterpret_cast<uintptr_t>(op.data), op.count * elem_size, kWhat);
    wait_for(ready.get());
  } else {
    char* buffer = static_cast<char*>(op.data);
    for (const Segment& piece : op.fused) {
      const std::shared_ptr<Event> ready = ready_.claim(reinterpret_cast<uintptr_t>(piece.data), piece.bytes, kWhat);
      wait_for(ready.get());
      copy_on_stream(buffer, piece.data, piece.bytes);
      buffer += piece.bytes;
    }
  }
  // NCCL divides where the data already is (ncclAvg, PreMulSum): no extra pass, no host round trip.
  enqueue_collective(NcclTarget{*api_, comm_, stream_, rank_, size_}, op);
  const char* buffer = static_cast<const char*>(op.data);
  for (const Segment& piece : op.fused) {
    copy_on_stream(piece.data, buffer, piece.bytes);
    buffer += piece.bytes;
  }
  auto done = std::make_shared<Event>(api_);
  api_->check_cuda(api_->cudaEventRecord(done->get(), stream_), "cudaEventRecord (commsched stream)");
  return std::make_unique<Work>(shared_from_this(), std::move(done));
}

}  // namespace commsched::nccl
