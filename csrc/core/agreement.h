// Cross-rank agreement on which tensors are ready everywhere, without a coordinator.
//
// Each cycle every rank contributes one report (what became ready locally since its
// last report, its completed byte count, shutdown/abort flags); all ranks exchange
// reports in one transport exchange and apply them in rank order, so every rank derives the
// same agreed tensors in the same order. A name agreed once is cached under a small
// id, so a steady-state report costs a few bytes per tensor instead of its metadata. The cache
// is bounded: past its size, every rank forgets the same least recently agreed names in the
// same round, so a job that keeps inventing names does not grow without end.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "settings.h"
#include "types.h"

namespace commsched {

// The longest tensor name a rank may submit: names travel in full until cached, and every rank
// receives every rank's report.
inline constexpr size_t kMaxTensorNameBytes = 4096;
// Names cached under small ids unless told otherwise; a model with more tensors still works, its
// least recently agreed names just travel in full again.
inline constexpr size_t kDefaultMaxCachedNames = 16384;
// The local id of an entry that stands for no local tensor (a refusal).
inline constexpr uint64_t kNoLocalTensor = UINT64_MAX;

struct ReportStatus {
  uint64_t completed_bytes = 0;
  bool shutdown = false;
  std::string abort_message;  // non-empty: this rank has failed and asks everyone to stop
  // Scheduling settings this rank asks for, numbered; they switch once every rank asked.
  uint32_t settings_epoch = 0;
  SchedulingSettings settings;
  // This rank has run out of data (Horovod's join): until every rank has, it contributes zeros to
  // the others' allreduces and nothing to their allgathers. Sent once, in the report that joins.
  bool join = false;
};

struct TensorFailure {
  std::string name;
  std::string message;
  uint64_t local_id = kNoLocalTensor;  // what this rank passed to announce(); kNoLocalTensor: none
  int refused_by = -1;  // the (lowest) rank that refused the tensor at submission; -1: a mismatch
};

struct CycleOutcome {
  std::vector<TensorSpec> agreed;  // launch-eligible, in readiness order
  // Per agreed tensor, what this rank passed to announce(); kNoLocalTensor where this rank had
  // joined without announcing it: it then launches the collective with zeros (nothing to gather).
  std::vector<uint64_t> agreed_ids;
  // Per agreed tensor, by rank: the bytes its ranks sent inline with their reports. Non-empty
  // only when the result is complete from them (every rank's for an allreduce, the root's for a
  // broadcast): then no collective is launched for it. A joined rank's bytes are empty: zeros.
  std::vector<std::vector<std::string>> inline_payloads;
  std::vector<TensorFailure> failures;
  uint64_t min_completed_bytes = 0;
  int shutdown_rank = -1;  // lowest rank that asked to shut down, -1 if none
  int abort_rank = -1;
  std::string abort_message;
  uint32_t announcements = 0;  // entries in all reports: a sign the ranks are making progress
  uint32_t min_settings_epoch = 0;
  uint32_t root_settings_epoch = 0;  // rank 0's request wins, so every rank applies the same settings
  SchedulingSettings root_settings;
  // Every rank has joined in this round: the last to join (of those joining in the same round, the
  // highest rank, as reports apply in rank order); -1 otherwise. The next join starts afresh.
  int last_joined_rank = -1;

  // Back to a fresh outcome, keeping the vectors' capacity for the next round.
  void reset();
};

struct StalledTensor {
  std::string name;
  std::vector<int> ready_ranks;
  std::vector<int> missing_ranks;
  double waiting_s = 0;
  std::vector<int> joined_ranks;  // of missing_ranks, those that joined: they wait for the others too
};

class Agreement {
 public:
  Agreement(int rank, int size, size_t max_cached_names = kDefaultMaxCachedNames);

  // Records that a tensor became ready on this rank; it goes out with the next report, with
  // `payload` (the tensor's bytes, or empty) inline. The outcome names it by `local_id`, so the
  // caller needs no map from names back to its own tensors.
  void announce(const TensorSpec& spec, std::string payload = {}, uint64_t local_id = 0);
  // Records that this rank refused a submission of `name` (bad arguments on this rank only). It
  // stands in for this rank's announcement: once every rank has announced the name, the tensor
  // fails on every rank with `reason` and this rank named, instead of the others waiting for it.
  // `process_set`: the set the refused collective was for; only its members are waited for.
  void refuse(const std::string& name, const std::string& reason, int32_t process_set = 0);
  bool has_announcements() const { return !outbox_.empty(); }

  // Serialises this rank's report and clears the announcements it carries.
  std::string build_report(const ReportStatus& status);

  // Applies every rank's report (index = rank). Throws CommError on a malformed report.
  CycleOutcome apply(const std::vector<std::string>& reports, double now_s);
  // The same into `outcome` (reset first), which a caller keeps across rounds to save allocations.
  void apply(const std::vector<std::string>& reports, double now_s, CycleOutcome& outcome);

  // Tensors some but not all ranks have announced for longer than `older_than_s`.
  std::vector<StalledTensor> stalled(double now_s, double older_than_s) const;
  size_t pending() const { return pending_.size(); }
  // True while this rank announced a tensor that another rank has not: agreement is worth retrying soon.
  bool waiting_on_others() const { return own_pending_ > 0; }
  size_t cached_names() const { return cache_ids_.size(); }
  // True while `rank` has joined and not every rank has yet.
  bool has_joined(int rank) const { return joined_[static_cast<size_t>(rank)] != 0; }

  // Process sets: a collective on one is agreed once every member reported it (or joined), and only
  // they launch it. Every rank registers the same sets under the same ids before any report names them.
  void add_process_set(int32_t id, std::vector<int> ranks);
  void remove_process_set(int32_t id);
  // The ranks of process set `id`, ascending (0: every rank). Throws CommError for an unknown id.
  const std::vector<int>& members(int32_t id) const;

 private:
  struct Outgoing {
    TensorSpec spec;
    std::string payload;
    std::string refusal;  // non-empty: this rank refused the tensor, for this reason
    uint64_t local_id = kNoLocalTensor;
  };
  struct Pending {
    std::vector<std::optional<TensorSpec>> by_rank;
    std::vector<std::string> payloads;
    std::vector<std::string> refusals;  // by rank; non-empty where that rank refused it
    int reported = 0;
    int32_t process_set = 0;  // only its members report the entry
    double first_seen_s = 0;
    uint64_t local_id = kNoLocalTensor;
  };
  struct CachedName {
    TensorSpec spec;
    uint64_t last_agreed = 0;  // agreements_ when it was last agreed: the same on every rank
  };
  using PendingMap = std::map<std::string, Pending>;

  void record(int from_rank, TensorSpec spec, std::string payload, std::string refusal, uint64_t local_id,
              double now_s, CycleOutcome& outcome);
  // Ends a pending entry (every rank reported, or a refusing rank submits the name again) and
  // keeps its node for the next name.
  void close(PendingMap::iterator it, CycleOutcome& outcome);
  // Removes a pending entry without an outcome of its own, keeping its node for the next name.
  void release(PendingMap::iterator it);
  // A member of a grouped call whose length differs across ranks: the failure naming the lengths,
  // and the group's other members remembered for fail_broken_groups().
  void fail_group_lengths(const std::string& name, const Pending& entry, CycleOutcome& outcome);
  // After a round: fails the pending members of groups whose lengths differed, which the ranks with
  // the shorter group will never submit.
  void fail_broken_groups(CycleOutcome& outcome);
  void finish(const std::string& name, Pending& entry, CycleOutcome& outcome);
  // The per-rank element counts of an allgather, reducescatter or alltoall (TensorSpec::layout).
  void fill_layout(const Pending& entry, TensorSpec& agreed) const;
  void fail_refused(const std::string& name, const Pending& entry, CycleOutcome& outcome);
  // Caches what this round agreed, once every report is read: an id is only reused after every
  // report that could name it by its old meaning has been applied.
  void cache_agreed();
  void forget_least_recent();
  // True once every member of the entry's process set has announced it or joined.
  bool covered(const Pending& entry) const;
  // Records `rank`'s join: closes what it alone held back, and ends the join once every rank has.
  void mark_joined(int rank, CycleOutcome& outcome);

  int rank_;
  int size_;
  size_t max_cached_names_;
  std::vector<Outgoing> outbox_;
  // Local ids of the entries in this rank's reports, in report order: apply() meets them in
  // that order in its own report.
  std::deque<uint64_t> sent_ids_;
  std::unordered_map<std::string, uint32_t> cache_ids_;
  std::vector<CachedName> cache_;  // by id; a forgotten name's id goes to free_ids_
  std::vector<uint32_t> free_ids_;  // largest first, so the smallest is reused first
  std::vector<TensorSpec> to_cache_;
  uint64_t agreements_ = 0;
  PendingMap pending_;
  PendingMap::node_type spare_;  // the last finished entry, emptied for the next name
  size_t own_pending_ = 0;
  uint32_t agreed_settings_epoch_ = 0;  // the lowest settings epoch in the last round's reports
  std::vector<int> all_ranks_;  // process set 0
  std::map<int32_t, std::vector<int>> process_sets_;
  std::vector<char> joined_;  // by rank: joined, and not every rank has yet
  int joined_count_ = 0;
  int last_joined_ = -1;
  struct BrokenGroup {
    std::string prefix;  // "<group>.", the members' names without their index
    uint32_t longest = 0;
    std::string message;
  };
  std::vector<BrokenGroup> broken_groups_;  // found this round; failed at its end
};

}  // namespace commsched
