// The process's one owned runtime, shared by the pybind11 module and the C ABI.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "core/runtime.h"

namespace commsched {

class RuntimeSlot {
 public:
  // Installs a new runtime; refuses while one is running.
  void install(std::shared_ptr<Runtime> runtime);
  std::shared_ptr<Runtime> get() const;
  // Like get(), but throws UsageError naming `what` when commsched was never started.
  std::shared_ptr<Runtime> require(const char* what) const;
  std::shared_ptr<Runtime> release();

 private:
  mutable std::mutex mutex_;
  std::shared_ptr<Runtime> runtime_;
  std::shared_ptr<Runtime> previous_;  // a stopped runtime, kept until the next one is up
};

RuntimeSlot& runtime_slot();

}  // namespace commsched
