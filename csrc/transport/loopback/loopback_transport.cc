#include "transport/loopback/loopback_transport.h"

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

std::unique_ptr<PendingOp> LoopbackTransport::start(const WireOp& /*op*/) {
  // The sum over one rank, and a broadcast from it, leave the data as it is.
  return std::make_unique<CompletedOp>();
}

}  // namespace commsched
