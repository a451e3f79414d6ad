// Who takes part in an entry: the members of its process set; of them, the ranks that joined() stand
// in for what they did not announce (zeros for an allreduce; the other kinds fail naming them).
#include <algorithm>

#include "agreement.h"

namespace commsched {

void Agreement::add_process_set(int32_t id, std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  process_sets_[id] = std::move(ranks);
}

void Agreement::remove_process_set(int32_t id) { process_sets_.erase(id); }

const std::vector<int>& Agreement::members(int32_t id) const {
  if (id == 0) return all_ranks_;
  auto found = process_sets_.find(id);
  if (found == process_sets_.end()) {
    throw CommError("an agreement report names process set " + std::to_string(id) +
                    ", which this rank has not registered; every rank must call add_process_set in the same order");
  }
  return found->second;
}

bool Agreement::covered(const Pending& entry) const {
  const std::vector<int>* ranks = &all_ranks_;
  if (entry.process_set != 0) {
    auto set = process_sets_.find(entry.process_set);
    if (set == process_sets_.end()) return false;  // removed meanwhile: nobody stands in for it
    ranks = &set->second;
  }
  // A joined rank stands in for the collectives of every set it is a member of.
  for (int r : *ranks) {
    if (!entry.by_rank[r] && !joined_[r]) return false;
  }
  return true;
}

void Agreement::mark_joined(int rank, CycleOutcome& outcome) {
  if (joined_[rank]) {
    throw CommError("malformed agreement report from rank " + std::to_string(rank) +
                    ": it joined again before every rank had joined");
  }
  joined_[rank] = 1;
  ++joined_count_;
  last_joined_ = rank;
  // In name order, the same on every rank (each holds the same pending entries).
  std::vector<PendingMap::iterator> ready;
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (covered(it->second)) ready.push_back(it);
  }
  for (PendingMap::iterator it : ready) close(it, outcome);
  if (joined_count_ == size_) {
    outcome.last_joined_rank = last_joined_;
    std::fill(joined_.begin(), joined_.end(), 0);
    joined_count_ = 0;
    last_joined_ = -1;
  }
}

}  // namespace commsched
