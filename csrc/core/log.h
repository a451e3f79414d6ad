// Leveled logging to stderr, prefixed with the rank so interleaved output stays readable.
#pragma once

#include <string>

#include "settings.h"

namespace commsched {

class Logger {
 public:
  Logger(LogLevel level, int rank) : level_(level), rank_(rank) {}
  bool enabled(LogLevel level) const { return level >= level_; }
  void log(LogLevel level, const std::string& message) const;
  void warning(const std::string& message) const { log(LogLevel::kWarning, message); }
  void info(const std::string& message) const { log(LogLevel::kInfo, message); }
  void debug(const std::string& message) const { log(LogLevel::kDebug, message); }

 private:
  LogLevel level_;
  int rank_;
};

}  // namespace commsched
