// Wording shared by every error and warning that names ranks or durations, so messages from the
// core, the control channel and each transport read alike.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace commsched {

// "1,2": the ranks alone, for messages that word the noun themselves.
inline std::string join_ranks(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? "," : "") + std::to_string(ranks[i]);
  return text;
}

// "rank 3" or "ranks 1,2".
inline std::string rank_list(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + join_ranks(ranks);
}

// Three significant digits: "0.5", "10", "1.23e+03"; callers append the unit.
inline std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3g", seconds);
  return text;
}

inline std::string seconds_text(std::chrono::steady_clock::duration duration) {
  return seconds_text(std::chrono::duration<double>(duration).count());
}

}  // namespace commsched
