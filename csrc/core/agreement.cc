#include "agreement.h"

#include <algorithm>
#include <cstring>
#include <limits>

namespace commsched {

namespace {

constexpr uint32_t kReportMagic = 0x32525343;  // "CSR2"
constexpr uint8_t kEntryCached = 0;
constexpr uint8_t kEntryFull = 1;
constexpr size_t kMaxCachedNames = 1u << 20;
constexpr size_t kMaxNameBytes = 1u << 16;

class Writer {
 public:
  template <typename T>
  void put(T value) {
    const auto* bytes = reinterpret_cast<const char*>(&value);
    out_.append(bytes, sizeof(T));
  }
  void put_string(const std::string& text) {
    put<uint32_t>(static_cast<uint32_t>(text.size()));
    out_.append(text);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  Reader(const std::string& data, int from_rank) : data_(data), from_rank_(from_rank) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T value;
    std::memcpy(&value, data_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  std::string get_bytes(size_t length) {
    need(length);
    std::string bytes = data_.substr(pos_, length);
    pos_ += length;
    return bytes;
  }
  std::string get_string(size_t max_bytes) {
    const auto length = get<uint32_t>();
    if (length > max_bytes) fail("string of " + std::to_string(length) + " bytes");
    need(length);
    std::string text = data_.substr(pos_, length);
    pos_ += length;
    return text;
  }
  bool at_end() const { return pos_ == data_.size(); }
  [[noreturn]] void fail(const std::string& what) const {
    throw CommError("malformed agreement report from rank " + std::to_string(from_rank_) + ": " + what +
                    " at byte " + std::to_string(pos_) + " of " + std::to_string(data_.size()));
  }

 private:
  void need(size_t bytes) const {
    if (data_.size() - pos_ < bytes) fail("truncated");
  }
  const std::string& data_;
  int from_rank_;
  size_t pos_ = 0;
};

std::string rank_list(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) text += ",";
    text += std::to_string(ranks[i]);
  }
  return text;
}

}  // namespace

Agreement::Agreement(int rank, int size) : rank_(rank), size_(size) {}

void Agreement::announce(const TensorSpec& spec, std::string payload) {
  outbox_.emplace_back(spec, std::move(payload));
}

std::string Agreement::build_report(const ReportStatus& status) {
  Writer writer;
  writer.put<uint32_t>(kReportMagic);
  writer.put<uint8_t>(status.shutdown ? 1 : 0);
  writer.put<uint64_t>(status.completed_bytes);
  writer.put_string(status.abort_message);
  writer.put<uint32_t>(status.settings_epoch);
  writer.put<uint8_t>(static_cast<uint8_t>(status.settings.policy));
  writer.put<uint64_t>(status.settings.partition_bytes);
  writer.put<uint64_t>(status.settings.credit_bytes);
  writer.put<uint64_t>(status.settings.fusion_bytes);
  writer.put<uint32_t>(static_cast<uint32_t>(outbox_.size()));
  for (const auto& [spec, payload] : outbox_) {
    auto cached = cache_ids_.find(spec.name);
    if (cached != cache_ids_.end() && cache_[cached->second].same_shape_as(spec)) {
      writer.put<uint8_t>(kEntryCached);
      writer.put<uint32_t>(cached->second);
      writer.put<int32_t>(spec.priority);
      writer.put_string(payload);
      continue;
    }
    writer.put<uint8_t>(kEntryFull);
    writer.put_string(spec.name);
    writer.put<uint8_t>(static_cast<uint8_t>(spec.dtype));
    writer.put<uint8_t>(static_cast<uint8_t>(spec.op));
    writer.put<uint8_t>(static_cast<uint8_t>(spec.kind));
    writer.put<int32_t>(spec.root);
    writer.put<uint64_t>(spec.count);
    writer.put<int32_t>(spec.priority);
    writer.put_string(payload);
  }
  outbox_.clear();
  return writer.take();
}

CycleOutcome Agreement::apply(const std::vector<std::string>& reports, double now_s) {
  if (static_cast<int>(reports.size()) != size_) {
    throw CommError("agreement expected " + std::to_string(size_) + " reports, got " +
                    std::to_string(reports.size()));
  }
  CycleOutcome outcome;
  outcome.min_completed_bytes = std::numeric_limits<uint64_t>::max();
  for (int from = 0; from < size_; ++from) {
    Reader reader(reports[from], from);
    if (reader.get<uint32_t>() != kReportMagic) reader.fail("bad magic");
    const bool shutdown = reader.get<uint8_t>() != 0;
    outcome.min_completed_bytes = std::min(outcome.min_completed_bytes, reader.get<uint64_t>());
    std::string abort_message = reader.get_string(kMaxNameBytes);
    const auto settings_epoch = reader.get<uint32_t>();
    SchedulingSettings settings;
    const auto policy = reader.get<uint8_t>();
    if (policy > 1) reader.fail("bad policy");
    settings.policy = static_cast<Policy>(policy);
    settings.partition_bytes = reader.get<uint64_t>();
    settings.credit_bytes = reader.get<uint64_t>();
    settings.fusion_bytes = reader.get<uint64_t>();
    outcome.min_settings_epoch = from == 0 ? settings_epoch : std::min(outcome.min_settings_epoch, settings_epoch);
    if (from == 0) {
      outcome.root_settings_epoch = settings_epoch;
      outcome.root_settings = settings;
    }
    if (shutdown && outcome.shutdown_rank < 0) outcome.shutdown_rank = from;
    if (!abort_message.empty() && outcome.abort_rank < 0) {
      outcome.abort_rank = from;
      outcome.abort_message = std::move(abort_message);
    }
    const auto entries = reader.get<uint32_t>();
    outcome.announcements += entries;
    for (uint32_t i = 0; i < entries; ++i) {
      TensorSpec spec;
      const auto tag = reader.get<uint8_t>();
      if (tag == kEntryCached) {
        const auto id = reader.get<uint32_t>();
        if (id >= cache_.size()) reader.fail("unknown cached tensor id " + std::to_string(id));
        spec = cache_[id];
        spec.priority = reader.get<int32_t>();
      } else if (tag == kEntryFull) {
        spec.name = reader.get_string(kMaxNameBytes);
        const auto dtype = reader.get<uint8_t>();
        const auto op = reader.get<uint8_t>();
        const auto kind = reader.get<uint8_t>();
        if (dtype >= kNumDTypes || op > 1 || kind > 1) reader.fail("bad tensor metadata");
        spec.dtype = static_cast<DType>(dtype);
        spec.op = static_cast<ReduceOp>(op);
        spec.kind = static_cast<CollectiveKind>(kind);
        spec.root = reader.get<int32_t>();
        spec.count = reader.get<uint64_t>();
        spec.priority = reader.get<int32_t>();
      } else {
        reader.fail("bad entry tag " + std::to_string(tag));
      }
      const auto payload_bytes = reader.get<uint32_t>();
      if (payload_bytes != 0 && payload_bytes != spec.bytes()) {
        reader.fail("inline payload of " + std::to_string(payload_bytes) + " bytes for '" + spec.name + "' of " +
                    std::to_string(spec.bytes()));
      }
      record(from, std::move(spec), reader.get_bytes(payload_bytes), now_s, outcome);
    }
    if (!reader.at_end()) reader.fail("trailing bytes");
  }
  return outcome;
}

void Agreement::record(int from_rank, TensorSpec spec, std::string payload, double now_s, CycleOutcome& outcome) {
  const std::string name = spec.name;
  auto [it, inserted] = pending_.try_emplace(name);
  Pending& entry = it->second;
  if (inserted) {
    entry.by_rank.resize(size_);
    entry.payloads.resize(size_);
    entry.first_seen_s = now_s;
  }
  if (entry.by_rank[from_rank]) {
    throw CommError("rank " + std::to_string(from_rank) + " announced tensor '" + name +
                    "' twice before it was agreed");
  }
  entry.by_rank[from_rank] = std::move(spec);
  entry.payloads[from_rank] = std::move(payload);
  if (from_rank == rank_) ++own_pending_;
  if (++entry.reported == size_) {
    --own_pending_;
    finish(name, entry, outcome);
    pending_.erase(it);
  }
}

void Agreement::finish(const std::string& name, Pending& entry, CycleOutcome& outcome) {
  TensorSpec agreed = *entry.by_rank[0];
  bool consistent = true;
  for (int r = 1; r < size_; ++r) {
    const TensorSpec& other = *entry.by_rank[r];
    consistent = consistent && other.same_shape_as(agreed);
    agreed.priority = std::min(agreed.priority, other.priority);
  }
  if (!consistent) {
    // Group ranks by what they submitted so the message stays short at scale.
    std::vector<std::pair<std::string, std::vector<int>>> variants;
    for (int r = 0; r < size_; ++r) {
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
    message += ". Every rank must submit the same dtype, element count, op and root under one name.";
    outcome.failures.push_back({name, std::move(message)});
    return;
  }
  if (cache_ids_.find(name) == cache_ids_.end() && cache_.size() < kMaxCachedNames) {
    cache_ids_.emplace(name, static_cast<uint32_t>(cache_.size()));
    cache_.push_back(agreed);
  }
  // Inline only when the result follows from the payloads alone; else every rank launches it.
  const bool complete =
      agreed.kind == CollectiveKind::kBroadcast
          ? !entry.payloads[agreed.root].empty()
          : std::all_of(entry.payloads.begin(), entry.payloads.end(), [](const std::string& p) { return !p.empty(); });
  outcome.inline_payloads.push_back(complete ? std::move(entry.payloads) : std::vector<std::string>{});
  outcome.agreed.push_back(std::move(agreed));
}

std::vector<StalledTensor> Agreement::stalled(double now_s, double older_than_s) const {
  std::vector<StalledTensor> result;
  for (const auto& [name, entry] : pending_) {
    if (now_s - entry.first_seen_s < older_than_s) continue;
    StalledTensor stalled{name, {}, {}, now_s - entry.first_seen_s};
    for (int r = 0; r < size_; ++r) (entry.by_rank[r] ? stalled.ready_ranks : stalled.missing_ranks).push_back(r);
    result.push_back(std::move(stalled));
  }
  return result;
}

}  // namespace commsched
