// The NCCL transport: data over NCCL on commsched's own CUDA stream, launched and polled on the
// core's thread with no Python in the way; the agreement, and NCCL's unique id, over the host
// transport it wraps (MPI under mpiexec, otherwise Gloo or gRPC).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "transport/nccl/nccl_comm.h"
#include "transport/transport.h"

namespace commsched::nccl {

class NcclTransport : public Transport {
 public:
  // Bootstraps the communicator: rank 0's unique id travels over `control`'s exchange.
  NcclTransport(std::shared_ptr<const Api> api, std::unique_ptr<Transport> control, int device);
  ~NcclTransport() override;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  int rank() const override { return control_->rank(); }
  int size() const override { return control_->size(); }
  std::string name() const override { return "nccl"; }
  std::vector<std::string> exchange(const std::string& mine, double timeout_s) override;
  bool exchange_until(const std::string& mine, double timeout_s, std::chrono::steady_clock::time_point yield_at,
                      std::vector<std::string>& reports) override;
  std::vector<int> silent_ranks() const override { return control_->silent_ranks(); }
  std::unique_ptr<PendingOp> start(const WireOp& op) override;
  // One cudaEventQuery per poll: cheap, and the GPU does the work meanwhile.
  std::chrono::microseconds poll_interval() const override { return std::chrono::microseconds(20); }
  bool any_thread() const override { return control_->any_thread(); }
  bool host_memory() const override { return false; }
  void prepare(const TensorSpec& spec, void* data, const Placement& placement) override;
  void forget(void* data) override;
  std::unique_ptr<FusionBuffer> allocate_fusion_buffer(size_t bytes) override;
  bool stages_fusion() const override { return true; }
  bool averages() const override { return true; }
  bool scales() const override { return true; }
  std::string unsupported(const TensorSpec& spec) const override;
  // The core never touches device memory itself: these are refused rather than run on the host.
  void copy(void* dst, const void* src, size_t bytes) override;
  void scale(void* data, uint64_t count, DType dtype, double divisor) override;
  void multiply(void* data, uint64_t count, DType dtype, double factor) override;

  const Communicator& communicator() const { return *comm_; }

 private:
  std::unique_ptr<Transport> control_;
  std::shared_ptr<Communicator> comm_;
};

// What commsched._nccl hands the core (through a capsule) to build the transport around a host one.
class NcclTransportMaker : public DeviceTransportMaker {
 public:
  NcclTransportMaker(std::shared_ptr<const Api> api, int device) : api_(std::move(api)), device_(device) {}
  std::unique_ptr<Transport> make(std::unique_ptr<Transport> control) override;

 private:
  std::shared_ptr<const Api> api_;
  int device_;
};

}  // namespace commsched::nccl
