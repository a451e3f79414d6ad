#include "transport/mpi/cuda_aware_mpi.h"

#include <dlfcn.h>
#include <mpi.h>

#include <stdexcept>

#include "core/elementwise.h"

namespace commsched {

namespace {

class DeviceFusionBuffer : public FusionBuffer {
 public:
  DeviceFusionBuffer(std::shared_ptr<const nccl::Api> api, int device, size_t bytes)
      : memory_(std::move(api), device, bytes) {}
  void* data() override { return memory_.data(); }
  size_t capacity() const override { return memory_.bytes(); }

 private:
  nccl::DeviceMemory memory_;
};

}  // namespace

bool mpi_is_cuda_aware() {
  // MPICH 4, MVAPICH2-GDR and Open MPI export this query; libraries without it are not CUDA-aware
  // as far as anyone can tell at run time. Looked up, not linked, so an MPI without it still loads:
  // first in the global scope (an interposed or globally loaded MPI), then in the library that
  // holds MPI_Init, which Python may have loaded privately.
  using Query = int (*)();
  auto query = reinterpret_cast<Query>(dlsym(RTLD_DEFAULT, "MPIX_Query_cuda_support"));
  Dl_info info{};
  if (query == nullptr && dladdr(reinterpret_cast<void*>(&MPI_Init), &info) != 0 && info.dli_fname != nullptr) {
    if (void* library = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD)) {
      query = reinterpret_cast<Query>(dlsym(library, "MPIX_Query_cuda_support"));
      dlclose(library);  // RTLD_NOLOAD took one more reference to an already loaded library
    }
  }
  return query != nullptr && query() == 1;
}

CudaAwareMpiTransport::CudaAwareMpiTransport(std::shared_ptr<const nccl::Api> cuda, std::unique_ptr<Transport> mpi,
                                             int device)
    : cuda_(std::move(cuda)), mpi_(std::move(mpi)), device_(device), ready_(cuda_, device) {}

void CudaAwareMpiTransport::prepare(const TensorSpec& spec, void* data, const Placement& placement) {
  if (spec.kind == CollectiveKind::kBarrier) return;  // no memory: the agreement is the barrier
  if (!placement.device) {
    throw std::invalid_argument(
        "it is in host memory, but commsched runs MPI on GPU memory (init(device='cuda')); move it to the GPU, or "
        "use init(device='cpu') in a job whose tensors all stay on the CPU");
  }
  if (placement.device_id >= 0 && placement.device_id != device_) {
    throw std::invalid_argument("it is on cuda:" + std::to_string(placement.device_id) + ", but commsched runs on cuda:" +
                                std::to_string(device_) + "; move it there, or start one process per GPU");
  }
  ready_.record(reinterpret_cast<uintptr_t>(data), spec.bytes(), placement.stream);
}

void CudaAwareMpiTransport::forget(void* data) { ready_.forget(reinterpret_cast<uintptr_t>(data)); }

void CudaAwareMpiTransport::wait_for_producer(const void* data, uint64_t bytes, bool required) {
  const auto address = reinterpret_cast<uintptr_t>(data);
  const std::shared_ptr<nccl::Event> ready =
      required ? ready_.claim(address, bytes, "CUDA-aware MPI transport") : ready_.claim_if_submitted(address, bytes);
  if (ready) cuda_->check_cuda(cuda_->cudaEventSynchronize(ready->get()), "cudaEventSynchronize (the producer)");
}

std::unique_ptr<PendingOp> CudaAwareMpiTransport::start(const WireOp& op) {
  // A fused launch's pieces waited in copy(); the fusion buffer itself was never submitted.
  wait_for_producer(op.data, op.count * dtype_size(op.dtype), /*required=*/false);
  return mpi_->start(op);
}

std::unique_ptr<FusionBuffer> CudaAwareMpiTransport::allocate_fusion_buffer(size_t bytes) {
  return std::make_unique<DeviceFusionBuffer>(cuda_, device_, bytes);
}

void CudaAwareMpiTransport::copy(void* dst, const void* src, size_t bytes) {
  wait_for_producer(src, bytes, /*required=*/false);  // copy-in reads a submitted tensor
  nccl::DeviceGuard guard(*cuda_, device_);
  cuda_->check_cuda(cuda_->cudaMemcpy(dst, src, bytes, nccl::kCudaMemcpyDefault), "cudaMemcpy (fusion)");
}

void CudaAwareMpiTransport::scale(void* data, uint64_t count, DType dtype, double divisor) {
  const size_t bytes = count * dtype_size(dtype);
  staging_.resize(bytes);
  nccl::DeviceGuard guard(*cuda_, device_);
  cuda_->check_cuda(cuda_->cudaMemcpy(staging_.data(), data, bytes, nccl::kCudaMemcpyDefault), "cudaMemcpy (average)");
  divide_by(staging_.data(), count, dtype, divisor);
  cuda_->check_cuda(cuda_->cudaMemcpy(data, staging_.data(), bytes, nccl::kCudaMemcpyDefault), "cudaMemcpy (average)");
}

}  // namespace commsched
