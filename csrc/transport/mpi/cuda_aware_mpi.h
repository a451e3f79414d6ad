// MPI on GPU memory, for MPI libraries built CUDA-aware (MPICH, MVAPICH2-GDR and Open MPI report it
// through MPIX_Query_cuda_support): the MPI transport, wrapped so that every collective first waits
// for the producer of its bytes, and fusion buffers, fusion copies and averages live on the GPU.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "transport/nccl/cuda_objects.h"
#include "transport/transport.h"

namespace commsched {

// True when the MPI library in this process says it can take CUDA device buffers.
bool mpi_is_cuda_aware();

class CudaAwareMpiTransport : public Transport {
 public:
  CudaAwareMpiTransport(std::shared_ptr<const nccl::Api> cuda, std::unique_ptr<Transport> mpi, int device);

  int rank() const override { return mpi_->rank(); }
  int size() const override { return mpi_->size(); }
  std::string name() const override { return "mpi"; }
  std::vector<std::string> exchange(const std::string& mine, double timeout_s) override {
    return mpi_->exchange(mine, timeout_s);
  }
  bool exchange_until(const std::string& mine, double timeout_s, std::chrono::steady_clock::time_point yield_at,
                      std::vector<std::string>& reports) override {
    return mpi_->exchange_until(mine, timeout_s, yield_at, reports);
  }
  std::vector<int> silent_ranks() const override { return mpi_->silent_ranks(); }
  // MPI reads the bytes as soon as the collective starts: the producer must have finished by then.
  std::unique_ptr<PendingOp> start(const WireOp& op) override;
  bool any_thread() const override { return mpi_->any_thread(); }
  bool host_memory() const override { return false; }
  void prepare(const TensorSpec& spec, void* data, const Placement& placement) override;
  void forget(void* data) override;
  std::unique_ptr<FusionBuffer> allocate_fusion_buffer(size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  // Averages go through host memory (a copy each way): MPI has no device-side divide to call.
  void scale(void* data, uint64_t count, DType dtype, double divisor) override;

 private:
  void wait_for_producer(const void* data, uint64_t bytes, bool required);

  std::shared_ptr<const nccl::Api> cuda_;
  std::unique_ptr<Transport> mpi_;
  int device_;
  nccl::ReadyEvents ready_;
  std::vector<uint8_t> staging_;  // scale()'s host copy, kept for its capacity
};

class CudaAwareMpiMaker : public DeviceTransportMaker {
 public:
  CudaAwareMpiMaker(std::shared_ptr<const nccl::Api> cuda, int device) : cuda_(std::move(cuda)), device_(device) {}
  std::unique_ptr<Transport> make(std::unique_ptr<Transport> control) override {
    return std::make_unique<CudaAwareMpiTransport>(cuda_, std::move(control), device_);
  }

 private:
  std::shared_ptr<const nccl::Api> cuda_;
  int device_;
};

}  // namespace commsched
