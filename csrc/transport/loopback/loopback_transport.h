// A single-rank transport: every collective of one rank is already complete.
#pragma once

#include "transport/transport.h"

namespace commsched {

class LoopbackTransport : public Transport {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "loopback"; }
  std::vector<std::string> exchange(const std::string& mine, double timeout_s) override;
  std::unique_ptr<PendingOp> start(const WireOp& op) override;
  bool any_thread() const override { return true; }
  // One rank can run every collective.
  std::string unsupported(const TensorSpec& spec) const override { return {}; }
};

}  // namespace commsched
