// The validated settings the core runs with. Parsing and validation of user input
// (arguments, COMMSCHED_* variables, units) happens once in Python at init().
#pragma once

#include <cstdint>
#include <string>

namespace commsched {

enum class Policy : uint8_t { kPriority = 0, kFifo };

enum class LogLevel : uint8_t { kTrace = 0, kDebug, kInfo, kWarning, kError };

struct SchedulingSettings {
  Policy policy = Policy::kPriority;
  uint64_t partition_bytes = 4ull << 20;
  uint64_t credit_bytes = 16ull << 20;
  uint64_t fusion_bytes = 1ull << 20;
};

struct RuntimeSettings {
  SchedulingSettings scheduling;
  double cycle_time_s = 0.001;
  double stall_timeout_s = 60.0;
  double stall_shutdown_s = 300.0;  // 0 disables failing stalled tensors
  std::string timeline_path;
  LogLevel log_level = LogLevel::kWarning;
};

}  // namespace commsched
