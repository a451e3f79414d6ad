#include "transport/nccl/nccl_transport.h"

#include "transport/nccl/nccl_collectives.h"

#include <stdexcept>

namespace commsched::nccl {

namespace {

// How long rank 0's unique id may take to reach every rank: the others may still be importing.
constexpr double kBootstrapTimeoutS = 300.0;

// The event after a launch, for a consumer's stream to wait on (cudaStreamWaitEvent: no host wait).
class EventMark : public StreamMark {
 public:
  EventMark(std::shared_ptr<const Api> api, std::shared_ptr<Event> event)
      : api_(std::move(api)), event_(std::move(event)) {}
  void make_wait(uintptr_t stream) override {
    api_->check_cuda(api_->cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), event_->get(), 0),
                     "cudaStreamWaitEvent (a consumer waiting for commsched's stream)");
  }

 private:
  std::shared_ptr<const Api> api_;
  std::shared_ptr<Event> event_;
};

class NcclPending : public PendingOp {
 public:
  explicit NcclPending(std::unique_ptr<Work> work) : work_(std::move(work)) {}
  bool test() override {
    try {
      return work_->test();
    } catch (const std::exception& error) {
      throw CommError(error.what());
    }
  }
  std::shared_ptr<StreamMark> mark() override {
    return std::make_shared<EventMark>(work_->api(), work_->done_event());
  }

 private:
  std::unique_ptr<Work> work_;
};

class DeviceFusionBuffer : public FusionBuffer {
 public:
  DeviceFusionBuffer(std::shared_ptr<const Api> api, int device, size_t bytes)
      : memory_(std::move(api), device, bytes) {}
  void* data() override { return memory_.data(); }
  size_t capacity() const override { return memory_.bytes(); }

 private:
  DeviceMemory memory_;
};

}  // namespace

NcclTransport::NcclTransport(std::shared_ptr<const Api> api, std::unique_ptr<Transport> control, int device)
    : control_(std::move(control)) {
  const std::string mine = control_->rank() == 0 ? unique_id(*api) : std::string();
  const std::vector<std::string> ids = control_->exchange(mine, kBootstrapTimeoutS);
  comm_ = std::make_shared<Communicator>(std::move(api), ids.at(0), control_->rank(), control_->size(), device);
}

NcclTransport::~NcclTransport() = default;

std::vector<std::string> NcclTransport::exchange(const std::string& mine, double timeout_s) {
  std::vector<std::string> reports;
  exchange_until(mine, timeout_s, std::chrono::steady_clock::time_point::max(), reports);
  return reports;
}

bool NcclTransport::exchange_until(const std::string& mine, double timeout_s,
                                   std::chrono::steady_clock::time_point yield_at, std::vector<std::string>& reports) {
  try {
    return control_->exchange_until(mine, timeout_s, yield_at, reports);
  } catch (...) {
    // The other ranks are gone or unreachable: NCCL kernels waiting for them would never end.
    comm_->abort();
    throw;
  }
}

std::unique_ptr<PendingOp> NcclTransport::start(const WireOp& op) {
  try {
    return std::make_unique<NcclPending>(comm_->launch(op));
  } catch (const std::invalid_argument&) {
    throw;
  } catch (const std::exception& error) {
    throw CommError(error.what());
  }
}

void NcclTransport::prepare(const TensorSpec& spec, void* data, const Placement& placement) {
  if (spec.kind == CollectiveKind::kBarrier) return;  // no memory: the agreement is the barrier
  if (!placement.device) {
    throw std::invalid_argument(
        "it is in host memory, but commsched runs the nccl transport, which moves GPU memory only; move it to "
        "the GPU (tensor.cuda(), cupy.asarray), or use init(device='cpu') in a job whose tensors all stay on the "
        "CPU");
  }
  if (placement.device_id >= 0 && placement.device_id != comm_->device()) {
    throw std::invalid_argument("it is on cuda:" + std::to_string(placement.device_id) +
                                ", but commsched's NCCL communicator is on cuda:" + std::to_string(comm_->device()) +
                                "; move it there, or start one process per GPU with torch.cuda.set_device(local_rank)"
                                " and commsched.init(device='cuda') on each");
  }
  const bool average = (spec.kind == CollectiveKind::kAllreduce || spec.kind == CollectiveKind::kReducescatter) &&
                       spec.op == ReduceOp::kAverage && spec.prescale == 1.0 && spec.postscale == 1.0;
  comm_->submitted(reinterpret_cast<uintptr_t>(data), spec.bytes(), average, placement.stream);
}

std::string NcclTransport::unsupported(const TensorSpec& spec) const {
  return nccl_refusal(*comm_->api(), comm_->version(), spec);
}

void NcclTransport::forget(void* data) { comm_->forget(reinterpret_cast<uintptr_t>(data)); }

std::unique_ptr<FusionBuffer> NcclTransport::allocate_fusion_buffer(size_t bytes) {
  return std::make_unique<DeviceFusionBuffer>(comm_->api(), comm_->device(), bytes);
}

void NcclTransport::copy(void* dst, const void* src, size_t bytes) {
  (void)dst, (void)src, (void)bytes;
  throw std::logic_error("NCCL transport: the core asked for a host copy of device memory (fusion is staged on "
                         "commsched's stream)");
}

void NcclTransport::scale(void* data, uint64_t count, DType dtype, double divisor) {
  (void)data, (void)count, (void)dtype, (void)divisor;
  throw std::logic_error("NCCL transport: the core asked to average device memory on the host (ncclAvg does it)");
}

void NcclTransport::multiply(void* data, uint64_t count, DType dtype, double factor) {
  (void)data, (void)count, (void)dtype, (void)factor;
  throw std::logic_error("NCCL transport: the core asked to scale device memory on the host (PreMulSum does it)");
}

std::unique_ptr<Transport> NcclTransportMaker::make(std::unique_ptr<Transport> control) {
  return std::make_unique<NcclTransport>(api_, std::move(control), device_);
}

}  // namespace commsched::nccl
