// The core's collectives as NCCL calls on one stream: the reductions (with NCCL's own ops and
// PreMulSum for scale factors), allgather and reducescatter with even or uneven parts, and
// alltoall as grouped send/recv. Only calls are queued here; nothing waits for the GPU.
#pragma once

#include <string>

#include "core/types.h"
#include "transport/nccl/nccl_loader.h"
#include "transport/transport.h"

namespace commsched::nccl {

// Where a collective goes: the communicator, commsched's stream on it, and this rank's place.
struct NcclTarget {
  const Api& api;
  ncclComm_t comm;
  cudaStream_t stream;
  int rank;
  int size;
};

// Queues `op` on the target's stream, including its prescale and postscale factors (folded into one
// PreMulSum factor together with the division of op="average"). Throws std::runtime_error naming
// the NCCL call that failed, std::invalid_argument for an op the layout does not fit.
void enqueue_collective(const NcclTarget& target, const WireOp& op);

// Why this NCCL cannot run `spec` (empty: it can): types NCCL lacks, integer averages, scale
// factors it cannot apply exactly, entry points an old NCCL does not have.
std::string nccl_refusal(const Api& api, int version, const TensorSpec& spec);

}  // namespace commsched::nccl
