#include "transport/loopback/loopback_transport.h"

#include <cstring>

namespace commsched {

namespace {

class CompletedOp : public PendingOp {
 public:
  bool test() override { return true; }
};

}  // namespace

std::vector<std::string> LoopbackTransport::exchange(const std::string& mine, double /*timeout_s*/) {
  return {mine};
}

std::unique_ptr<PendingOp> LoopbackTransport::start(const WireOp& op) {
  // The reduction over one rank, and a broadcast from it, leave the data as it is; the collectives
  // with an output receive this rank's own input.
  if (kind_has_output(op.kind) && op.count > 0) std::memcpy(op.output, op.data, op.count * dtype_size(op.dtype));
  return std::make_unique<CompletedOp>();
}

}  // namespace commsched
