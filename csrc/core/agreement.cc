// Resolving the decoded entries: tallying each name across ranks, agreeing or failing it, and the
// bounded cache of agreed names. The report's wire format is in agreement_report.cc.
#include "agreement.h"

#include <algorithm>
#include <functional>

#include "text.h"

namespace commsched {

Agreement::Agreement(int rank, int size, size_t max_cached_names)
    : rank_(rank),
      size_(size),
      max_cached_names_(std::min<size_t>(max_cached_names, UINT32_MAX)),
      joined_(static_cast<size_t>(size), 0) {
  for (int r = 0; r < size; ++r) all_ranks_.push_back(r);
}

void Agreement::announce(const TensorSpec& spec, std::string payload, uint64_t local_id) {
  outbox_.push_back(Outgoing{spec, std::move(payload), {}, local_id});
}

void Agreement::refuse(const std::string& name, const std::string& reason, int32_t process_set) {
  TensorSpec spec;
  spec.name = name;
  spec.process_set = process_set;
  outbox_.push_back(Outgoing{std::move(spec), {}, reason.empty() ? "refused" : reason, kNoLocalTensor});
}

void CycleOutcome::reset() {
  agreed.clear();
  agreed_ids.clear();
  inline_payloads.clear();
  failures.clear();
  min_completed_bytes = 0;
  shutdown_rank = -1;
  abort_rank = -1;
  abort_message.clear();
  announcements = 0;
  min_settings_epoch = 0;
  root_settings_epoch = 0;
  root_settings = SchedulingSettings{};
  last_joined_rank = -1;
}

void Agreement::record(int from_rank, TensorSpec spec, std::string payload, std::string refusal, uint64_t local_id,
                       double now_s, CycleOutcome& outcome) {
  auto it = pending_.find(spec.name);
  if (it != pending_.end() && it->second.by_rank[from_rank] && !it->second.refusals[from_rank].empty()) {
    // The rank that refused the name submits it again before every rank has: the refusal ends
    // here for the ranks that reported it, and the new submission starts afresh.
    close(it, outcome);
    it = pending_.end();
  }
  if (it == pending_.end()) {
    // A finished entry's node is reused, vectors and all: most rounds agree what they announce.
    if (spare_.empty()) {
      it = pending_.try_emplace(spec.name).first;
      it->second.by_rank.resize(size_);
      it->second.payloads.resize(size_);
      it->second.refusals.resize(size_);
    } else {
      spare_.key() = spec.name;
      it = pending_.insert(std::move(spare_)).position;
    }
    it->second.first_seen_s = now_s;
  }
  const std::string& name = it->first;
  Pending& entry = it->second;
  const std::vector<int>& expected = members(spec.process_set);
  if (!std::binary_search(expected.begin(), expected.end(), from_rank)) {
    throw CommError("rank " + std::to_string(from_rank) + " announced tensor '" + name + "' on process set " +
                    std::to_string(spec.process_set) + ", which it is not a member of");
  }
  if (entry.reported > 0 && entry.process_set != spec.process_set) {
    throw CommError("tensor '" + name + "' was announced on process sets " + std::to_string(entry.process_set) +
                    " and " + std::to_string(spec.process_set) + "; one name belongs to one set at a time");
  }
  entry.process_set = spec.process_set;
  if (entry.by_rank[from_rank]) {
    throw CommError("rank " + std::to_string(from_rank) + " announced tensor '" + name +
                    "' twice before it was agreed");
  }
  entry.by_rank[from_rank] = std::move(spec);
  entry.payloads[from_rank] = std::move(payload);
  entry.refusals[from_rank] = std::move(refusal);
  if (from_rank == rank_) {
    ++own_pending_;
    entry.local_id = local_id;
  }
  if (++entry.reported == static_cast<int>(expected.size()) || (joined_count_ > 0 && covered(entry))) {
    close(it, outcome);
  }
}

void Agreement::close(PendingMap::iterator it, CycleOutcome& outcome) {
  Pending& entry = it->second;
  if (entry.by_rank[rank_]) --own_pending_;
  const bool refused = std::any_of(entry.refusals.begin(), entry.refusals.end(),
                                   [](const std::string& reason) { return !reason.empty(); });
  if (refused) {
    fail_refused(it->first, entry, outcome);
  } else {
    finish(it->first, entry, outcome);
  }
  release(it);
}

void Agreement::release(PendingMap::iterator it) {
  spare_ = pending_.extract(it);
  Pending& reused = spare_.mapped();
  reused.reported = 0;
  reused.local_id = kNoLocalTensor;
  for (std::optional<TensorSpec>& spec_of_rank : reused.by_rank) spec_of_rank.reset();
  reused.payloads.assign(size_, std::string());
  reused.refusals.assign(size_, std::string());
}

void Agreement::fail_group_lengths(const std::string& name, const Pending& entry, CycleOutcome& outcome) {
  // Ranks grouped by the length of their grouped call, shortest first.
  std::map<uint32_t, std::vector<int>> by_length;
  const TensorSpec* member = nullptr;
  for (int r = 0; r < size_; ++r) {
    if (!entry.by_rank[r]) continue;
    by_length[entry.by_rank[r]->group_length()].push_back(r);
    if (entry.by_rank[r]->group_size != 0) member = &*entry.by_rank[r];
  }
  // The group's name, as the callers gave it: the members' names without ".<index>" (which
  // grouped_allreduce adds; a caller of the C ABI may name its members otherwise).
  std::string prefix;
  if (member != nullptr) {
    const std::string suffix = "." + std::to_string(member->group_index);
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      prefix = name.substr(0, name.size() - suffix.size() + 1);
    }
  }
  const std::string group = prefix.empty() ? name : prefix.substr(0, prefix.size() - 1);
  std::string message = "grouped_allreduce '" + group + "' was called with";
  size_t i = 0;
  for (const auto& [length, ranks] : by_length) {
    message += std::string(i == 0 ? " " : i + 1 == by_length.size() ? " and " : ", ") + std::to_string(length) +
               (length == 1 ? " tensor on " : " tensors on ") + rank_list(ranks);
    ++i;
  }
  message += ": every rank must pass the same number of tensors to one grouped_allreduce. Every member of the "
             "group failed on every rank.";
  outcome.failures.push_back({name, message, entry.local_id, -1});
  if (!prefix.empty()) {
    const uint32_t longest = by_length.rbegin()->first;
    auto known = std::find_if(broken_groups_.begin(), broken_groups_.end(),
                              [&](const BrokenGroup& broken) { return broken.prefix == prefix; });
    if (known == broken_groups_.end()) {
      broken_groups_.push_back({prefix, longest, message});
    } else {
      known->longest = std::max(known->longest, longest);
    }
  }
}

void Agreement::fail_broken_groups(CycleOutcome& outcome) {
  // Every rank's members of one grouped call ride in one report, so by the end of the round that
  // found the lengths differ, the longer groups' members are all pending: none is agreed again.
  for (const BrokenGroup& broken : broken_groups_) {
    for (uint32_t index = 0; index < broken.longest; ++index) {
      auto it = pending_.find(broken.prefix + std::to_string(index));
      if (it == pending_.end()) continue;
      if (it->second.by_rank[rank_]) --own_pending_;
      outcome.failures.push_back({it->first, broken.message, it->second.local_id, -1});
      release(it);
    }
  }
  broken_groups_.clear();
}

void Agreement::fail_refused(const std::string& name, const Pending& entry, CycleOutcome& outcome) {
  std::string message = "tensor '" + name + "' was refused";
  int first = -1;
  for (int r = 0; r < size_; ++r) {
    if (entry.refusals[r].empty()) continue;
    message += (first < 0 ? " on rank " : "; on rank ") + std::to_string(r) + ": " + entry.refusals[r];
    if (first < 0) first = r;
  }
  message += ". Every rank must submit it with valid arguments; it failed on every rank.";
  outcome.failures.push_back({name, std::move(message), entry.local_id, first});
}

void Agreement::finish(const std::string& name, Pending& entry, CycleOutcome& outcome) {
  // Ranks that joined without announcing the tensor are missing here; at least one rank announced it.
  const std::vector<int>& ranks = members(entry.process_set);
  std::vector<int> joined_without;
  int first = -1;
  for (int r : ranks) {
    if (!entry.by_rank[r]) {
      joined_without.push_back(r);
    } else if (first < 0) {
      first = r;
    }
  }
  TensorSpec agreed = *entry.by_rank[first];
  bool consistent = true;
  bool group_lengths_differ = false;
  for (int r : ranks) {
    if (r == first || !entry.by_rank[r]) continue;
    const TensorSpec& other = *entry.by_rank[r];
    consistent = consistent && other.agrees_with(agreed);
    group_lengths_differ = group_lengths_differ || other.group_length() != agreed.group_length();
    agreed.priority = std::min(agreed.priority, other.priority);
  }
  if (group_lengths_differ) {
    fail_group_lengths(name, entry, outcome);
    return;
  }
  // As Horovod: a joined rank adds zeros to an allreduce and needs no data for a barrier; every
  // other collective (allgather too: its output shape would change with who joined) fails.
  const bool joinable = agreed.kind == CollectiveKind::kAllreduce || agreed.kind == CollectiveKind::kBarrier;
  if (consistent && !joined_without.empty() && !joinable) {
    // As Horovod: a joined rank has no data to send or room to receive.
    outcome.failures.push_back(
        {name,
         std::string(kind_name(agreed.kind)) + " of '" + name + "' cannot run while " + rank_list(joined_without) +
             " joined; only allreduce and barrier take part in join(), as in Horovod. Run it before a rank joins, or "
             "after join() returned on every rank.",
         entry.local_id, -1});
    return;
  }
  if (!consistent) {
    // Group ranks by what they submitted so the message stays short at scale.
    std::vector<std::pair<std::string, std::vector<int>>> variants;
    for (int r : ranks) {
      if (!entry.by_rank[r]) continue;
      const std::string described = entry.by_rank[r]->describe();
      auto found = std::find_if(variants.begin(), variants.end(),
                                [&](const auto& variant) { return variant.first == described; });
      if (found == variants.end()) {
        variants.push_back({described, {r}});
      } else {
        found->second.push_back(r);
      }
    }
    std::string message = "tensor '" + name + "' does not match across ranks:";
    for (size_t i = 0; i < variants.size(); ++i) {
      message += (i ? "; " : " ") + rank_list(variants[i].second) + " submitted " + variants[i].first;
    }
    message += agreed.kind == CollectiveKind::kAllgather || agreed.kind == CollectiveKind::kAlltoall
                   ? ". Every rank must submit the same dtype and row shape (all dimensions but the first) under one name."
                   : ". Every rank must submit the same dtype, shape, op, scale factors and root under one name.";
    outcome.failures.push_back({name, std::move(message), entry.local_id, -1});
    return;
  }
  ++agreements_;
  auto cached = cache_ids_.find(name);
  if (cached != cache_ids_.end() && cache_[cached->second].spec.same_shape_as(agreed)) {
    cache_[cached->second].last_agreed = agreements_;
  } else {
    to_cache_.push_back(agreed);
  }
  fill_layout(entry, agreed);
  // Inline only when the result follows from the payloads alone; else every rank launches it. A
  // barrier is complete once agreed.
  bool complete = agreed.kind == CollectiveKind::kBarrier;
  if (agreed.process_set != 0) {
    // Set collectives carry no inline bytes: the non-members' empty payloads would mislead the test below.
  } else if (agreed.kind == CollectiveKind::kBroadcast) {
    complete = !entry.payloads[agreed.root].empty();
  } else if (agreed.kind == CollectiveKind::kAllreduce) {
    // A joined rank that did not announce it adds zeros: its payload stays empty.
    complete = true;
    for (int r = 0; r < size_ && complete; ++r) complete = !entry.by_rank[r] || !entry.payloads[r].empty();
  }
  outcome.inline_payloads.push_back(complete ? std::move(entry.payloads) : std::vector<std::string>{});
  outcome.agreed.push_back(std::move(agreed));
  outcome.agreed_ids.push_back(entry.local_id);
}

void Agreement::fill_layout(const Pending& entry, TensorSpec& agreed) const {
  if (!kind_has_output(agreed.kind)) return;
  const uint64_t row = agreed.row_elements();
  // Indexed by position in the process set (every rank for set 0).
  const std::vector<int>& members_in_order = members(entry.process_set);
  const size_t ranks = members_in_order.size();
  agreed.layout.clear();
  if (agreed.kind == CollectiveKind::kAllgather) {
    agreed.count = 0;
    for (size_t r = 0; r < ranks; ++r) {
      const uint64_t count = entry.by_rank[members_in_order[r]] ? entry.by_rank[members_in_order[r]]->count : 0;
      agreed.layout.push_back(count);  // a joined rank gives nothing
      agreed.count += count;
    }
  } else if (agreed.kind == CollectiveKind::kReducescatter) {
    // As Horovod splits the first dimension: the first (rows % ranks) ranks get one row more.
    const uint64_t rows = row == 0 ? 0 : agreed.count / row;
    for (size_t r = 0; r < ranks; ++r) agreed.layout.push_back((rows / ranks + (r < rows % ranks ? 1 : 0)) * row);
  } else {
    agreed.count = 0;
    for (size_t source = 0; source < ranks; ++source) {
      const TensorSpec& sent = *entry.by_rank[members_in_order[source]];
      for (size_t target = 0; target < ranks; ++target) agreed.layout.push_back(sent.splits.at(target) * row);
      agreed.count += sent.count;
    }
    agreed.splits.clear();
  }
}

void Agreement::cache_agreed() {
  for (TensorSpec& spec : to_cache_) {
    auto found = cache_ids_.find(spec.name);
    if (found != cache_ids_.end()) {  // a new shape under a cached name
      cache_[found->second] = CachedName{std::move(spec), agreements_};
      continue;
    }
    if (max_cached_names_ == 0) break;
    if (cache_ids_.size() >= max_cached_names_) forget_least_recent();
    uint32_t id;
    if (free_ids_.empty()) {
      id = static_cast<uint32_t>(cache_.size());
      cache_.push_back(CachedName{std::move(spec), agreements_});
    } else {
      id = free_ids_.back();
      free_ids_.pop_back();
      cache_[id] = CachedName{std::move(spec), agreements_};
    }
    cache_ids_.emplace(cache_[id].spec.name, id);
  }
  to_cache_.clear();
}

void Agreement::forget_least_recent() {
  // A quarter at a time, so the sort is paid once per many new names. Every rank holds the same
  // cache and the (last agreed, id) keys are unique, so every rank forgets the same names.
  std::vector<std::pair<uint64_t, uint32_t>> ages;
  ages.reserve(cache_ids_.size());
  for (const auto& [name, id] : cache_ids_) ages.emplace_back(cache_[id].last_agreed, id);
  const size_t forget = std::min(ages.size(), std::max<size_t>(1, max_cached_names_ / 4));
  std::nth_element(ages.begin(), ages.begin() + static_cast<std::ptrdiff_t>(forget - 1), ages.end());
  for (size_t i = 0; i < forget; ++i) {
    CachedName& entry = cache_[ages[i].second];
    cache_ids_.erase(entry.spec.name);
    entry = CachedName{};  // frees the name; an empty name marks the id unused
    free_ids_.push_back(ages[i].second);
  }
  std::sort(free_ids_.begin(), free_ids_.end(), std::greater<uint32_t>());
}

std::vector<StalledTensor> Agreement::stalled(double now_s, double older_than_s) const {
  std::vector<StalledTensor> result;
  for (const auto& [name, entry] : pending_) {
    if (now_s - entry.first_seen_s < older_than_s) continue;
    StalledTensor stalled{name, {}, {}, now_s - entry.first_seen_s, {}};
    auto set = process_sets_.find(entry.process_set);
    const std::vector<int>& ranks = set == process_sets_.end() ? all_ranks_ : set->second;  // removed: say all
    for (int r : ranks) {
      (entry.by_rank[r] ? stalled.ready_ranks : stalled.missing_ranks).push_back(r);
      if (!entry.by_rank[r] && joined_[r]) stalled.joined_ranks.push_back(r);
    }
    result.push_back(std::move(stalled));
  }
  return result;
}

}  // namespace commsched