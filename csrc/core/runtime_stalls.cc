// The stall checks: warnings for tensors some ranks submitted and others not, the failure past
// COMMSCHED_STALL_SHUTDOWN, and the hints the plug-ins give for their own tensors' names.
#include <algorithm>

#include "core/runtime.h"
#include "core/text.h"

namespace commsched {

namespace {

constexpr double kStallCheckPeriodS = 1.0;

}  // namespace

void Runtime::add_stall_hint(const std::string& prefix, const std::string& hint) {
  std::lock_guard<std::mutex> lock(stall_hints_mutex_);
  stall_hints_[prefix] = hint;
}

std::string Runtime::stall_hint_for(const std::string& name) const {
  std::lock_guard<std::mutex> lock(stall_hints_mutex_);
  // The longest matching prefix: the most specific hint.
  const std::pair<const std::string, std::string>* best = nullptr;
  for (const auto& entry : stall_hints_) {
    if (name.compare(0, entry.first.size(), entry.first) == 0 &&
        (best == nullptr || entry.first.size() > best->first.size())) {
      best = &entry;
    }
  }
  return best == nullptr ? std::string() : best->second;
}

void Runtime::check_stalls(double now) {
  if (now - last_stall_check_s_ < kStallCheckPeriodS) return;
  last_stall_check_s_ = now;
  const std::vector<StalledTensor> stalled = agreement_.stalled(now, settings_.stall_timeout_s);
  if (stalled.empty()) {
    stall_warned_at_s_.clear();
    return;
  }
  // Forget names no longer stalled, so a long run of stalls does not keep every name it saw.
  for (auto warned = stall_warned_at_s_.begin(); warned != stall_warned_at_s_.end();) {
    const bool still = std::any_of(stalled.begin(), stalled.end(),
                                   [&](const StalledTensor& tensor) { return tensor.name == warned->first; });
    warned = still ? std::next(warned) : stall_warned_at_s_.erase(warned);
  }
  std::string lines;
  std::string worst;
  for (const StalledTensor& tensor : stalled) {
    auto warned = stall_warned_at_s_.find(tensor.name);
    std::string line = "'" + tensor.name + "' ready on ranks " + join_ranks(tensor.ready_ranks) +
                       " but not on ranks " + join_ranks(tensor.missing_ranks) + " for " +
                       std::to_string(static_cast<int>(tensor.waiting_s)) + "s";
    if (!tensor.joined_ranks.empty()) {
      line += " (ranks " + join_ranks(tensor.joined_ranks) +
              " called join() and stand in for it; it waits for the others)";
    }
    const std::string hint = stall_hint_for(tensor.name);
    if (!hint.empty()) line += " (" + hint + ")";
    if (settings_.stall_shutdown_s > 0 && tensor.waiting_s >= settings_.stall_shutdown_s && worst.empty()) {
      worst = line;
    }
    if (warned != stall_warned_at_s_.end() && now - warned->second < settings_.stall_timeout_s) continue;
    stall_warned_at_s_[tensor.name] = now;
    lines += "\n  " + line;
  }
  if (!lines.empty()) {
    logger_.warning("tensors are waiting for other ranks longer than COMMSCHED_STALL_TIMEOUT=" +
                    seconds_text(settings_.stall_timeout_s) +
                    "s; a rank may have stopped submitting or uses other names:" + lines);
  }
  if (!worst.empty() && abort_message_.empty()) {
    abort_message_ = "stalled past COMMSCHED_STALL_SHUTDOWN=" + seconds_text(settings_.stall_shutdown_s) +
                     "s: tensor " + worst;
  }
}

}  // namespace commsched
