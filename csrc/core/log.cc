#include "log.h"

#include <cstdio>

namespace commsched {

void Logger::log(LogLevel level, const std::string& message) const {
  if (!enabled(level)) return;
  static constexpr const char* kNames[] = {"TRACE", "DEBUG", "INFO", "WARNING", "ERROR"};
  // One fprintf per line keeps lines from different threads whole.
  std::fprintf(stderr, "[commsched rank %d %s] %s\n", rank_, kNames[static_cast<int>(level)], message.c_str());
}

}  // namespace commsched
