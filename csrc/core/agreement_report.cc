// The agreement report's wire format: build_report() encodes this rank's outbox and status, apply()
// decodes every rank's report in rank order and hands each entry to record() (agreement.cc).
#include <algorithm>
#include <cstring>
#include <limits>

#include "agreement.h"

namespace commsched {

namespace {

// Reports travel in every round, so they are compact: a small report fits MPI's smallest
// allgather slot (32 bytes), which costs ~0.3 us less than the 128-byte one a fixed-width
// header needed. Counts and ids are LEB128 varints; the settings ride only while a request
// is pending.
constexpr uint8_t kReportMagic = 0xC3;
constexpr uint8_t kFlagShutdown = 1;
constexpr uint8_t kFlagAbort = 2;
constexpr uint8_t kFlagSettings = 4;
constexpr uint8_t kFlagJoin = 8;
constexpr uint8_t kEntryCached = 0;
constexpr uint8_t kEntryFull = 1;
constexpr uint8_t kEntryRefused = 2;
constexpr uint8_t kEntryRefusedInSet = 3;  // a refusal of a collective on a process set other than 0
constexpr uint8_t kExtraPrescale = 1;
constexpr uint8_t kExtraPostscale = 2;
constexpr uint8_t kExtraRowShape = 4;
constexpr uint8_t kExtraSplits = 8;
constexpr uint8_t kExtraProcessSet = 16;
constexpr uint8_t kExtraGroup = 32;  // a member of grouped_allreduce(): the group's length and its index
// A row of an allgather, reducescatter or alltoall has at most this many dimensions.
constexpr size_t kMaxRowDims = 64;
// Abort and refusal messages are cut to this; they name tensors, so they may run long.
constexpr size_t kMaxMessageBytes = 1u << 16;

uint64_t zigzag(int64_t value) { return (static_cast<uint64_t>(value) << 1) ^ static_cast<uint64_t>(value >> 63); }
int64_t unzigzag(uint64_t value) { return static_cast<int64_t>(value >> 1) ^ -static_cast<int64_t>(value & 1); }

class Writer {
 public:
  void put_byte(uint8_t value) { out_.push_back(static_cast<char>(value)); }
  void put_varint(uint64_t value) {
    while (value >= 0x80) {
      put_byte(static_cast<uint8_t>(value | 0x80));
      value >>= 7;
    }
    put_byte(static_cast<uint8_t>(value));
  }
  void put_signed(int64_t value) { put_varint(zigzag(value)); }
  void put_double(double value) {
    uint64_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    for (int shift = 0; shift < 64; shift += 8) put_byte(static_cast<uint8_t>(bits >> shift));
  }
  void put_varints(const std::vector<uint64_t>& values) {
    put_varint(values.size());
    for (uint64_t value : values) put_varint(value);
  }
  void put_string(const std::string& text, size_t max_bytes = SIZE_MAX) {
    const size_t length = std::min(text.size(), max_bytes);
    put_varint(length);
    out_.append(text, 0, length);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  Reader(const std::string& data, int from_rank) : data_(data), from_rank_(from_rank) {}
  uint8_t get_byte() {
    need(1);
    return static_cast<uint8_t>(data_[pos_++]);
  }
  uint64_t get_varint() {
    uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      const uint8_t byte = get_byte();
      value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return value;
    }
    fail("overlong varint");
  }
  int32_t get_int32() {
    const int64_t value = unzigzag(get_varint());
    if (value < std::numeric_limits<int32_t>::min() || value > std::numeric_limits<int32_t>::max()) {
      fail("32-bit field out of range");
    }
    return static_cast<int32_t>(value);
  }
  uint32_t get_uint32() {
    const uint64_t value = get_varint();
    if (value > std::numeric_limits<uint32_t>::max()) fail("32-bit field out of range");
    return static_cast<uint32_t>(value);
  }
  double get_double() {
    uint64_t bits = 0;
    for (int shift = 0; shift < 64; shift += 8) bits |= static_cast<uint64_t>(get_byte()) << shift;
    double value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  }
  std::vector<uint64_t> get_varints(size_t max_count) {
    const uint64_t count = get_varint();
    if (count > max_count) fail("list of " + std::to_string(count) + " values");
    std::vector<uint64_t> values(static_cast<size_t>(count));
    for (uint64_t& value : values) value = get_varint();
    return values;
  }
  std::string get_bytes(size_t length) {
    need(length);
    std::string bytes = data_.substr(pos_, length);
    pos_ += length;
    return bytes;
  }
  std::string get_string(size_t max_bytes) {
    const uint64_t length = get_varint();
    if (length > max_bytes) fail("string of " + std::to_string(length) + " bytes");
    return get_bytes(static_cast<size_t>(length));
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

}  // namespace

std::string Agreement::build_report(const ReportStatus& status) {
  // A rank's settings matter to the others only while its request is not yet in every report;
  // rank 0's then always ride along, since its epoch is past the last agreed one (see apply).
  const bool send_settings = status.settings_epoch > agreed_settings_epoch_;
  Writer writer;
  writer.put_byte(kReportMagic);
  writer.put_byte((status.shutdown ? kFlagShutdown : 0) | (status.abort_message.empty() ? 0 : kFlagAbort) |
                  (send_settings ? kFlagSettings : 0) | (status.join ? kFlagJoin : 0));
  writer.put_varint(status.completed_bytes);
  if (!status.abort_message.empty()) writer.put_string(status.abort_message, kMaxMessageBytes);
  writer.put_varint(status.settings_epoch);
  if (send_settings) {
    writer.put_byte(static_cast<uint8_t>(status.settings.policy));
    writer.put_varint(status.settings.partition_bytes);
    writer.put_varint(status.settings.credit_bytes);
    writer.put_varint(status.settings.fusion_bytes);
  }
  writer.put_varint(outbox_.size());
  for (const Outgoing& outgoing : outbox_) {
    const TensorSpec& spec = outgoing.spec;
    const std::string& payload = outgoing.payload;
    if (!outgoing.refusal.empty()) {
      writer.put_byte(spec.process_set == 0 ? kEntryRefused : kEntryRefusedInSet);
      writer.put_string(spec.name);
      writer.put_string(outgoing.refusal, kMaxMessageBytes);
      if (spec.process_set != 0) writer.put_signed(spec.process_set);
      continue;
    }
    auto cached = cache_ids_.find(spec.name);
    if (cached != cache_ids_.end() && cache_[cached->second].spec.same_shape_as(spec)) {
      writer.put_byte(kEntryCached);
      writer.put_varint(cached->second);
      writer.put_signed(spec.priority);
      writer.put_string(payload);
      continue;
    }
    writer.put_byte(kEntryFull);
    writer.put_string(spec.name);
    writer.put_byte(static_cast<uint8_t>(spec.dtype));
    writer.put_byte(static_cast<uint8_t>(spec.op));
    writer.put_byte(static_cast<uint8_t>(spec.kind));
    writer.put_signed(spec.root);
    writer.put_varint(spec.count);
    writer.put_signed(spec.priority);
    // What most tensors leave at their defaults travels only when set, behind one flags byte.
    const uint8_t extras = (spec.prescale != 1.0 ? kExtraPrescale : 0) | (spec.postscale != 1.0 ? kExtraPostscale : 0) |
                           (spec.row_shape.empty() ? 0 : kExtraRowShape) | (spec.splits.empty() ? 0 : kExtraSplits) |
                           (spec.process_set == 0 ? 0 : kExtraProcessSet) | (spec.group_size == 0 ? 0 : kExtraGroup);
    writer.put_byte(extras);
    if (extras & kExtraProcessSet) writer.put_signed(spec.process_set);
    if (extras & kExtraGroup) {
      writer.put_varint(spec.group_size);
      writer.put_varint(spec.group_index);
    }
    if (extras & kExtraPrescale) writer.put_double(spec.prescale);
    if (extras & kExtraPostscale) writer.put_double(spec.postscale);
    if (extras & kExtraRowShape) writer.put_varints(spec.row_shape);
    if (extras & kExtraSplits) writer.put_varints(spec.splits);
    writer.put_string(payload);
  }
  for (const Outgoing& outgoing : outbox_) sent_ids_.push_back(outgoing.local_id);
  outbox_.clear();
  return writer.take();
}

CycleOutcome Agreement::apply(const std::vector<std::string>& reports, double now_s) {
  CycleOutcome outcome;
  apply(reports, now_s, outcome);
  return outcome;
}

void Agreement::apply(const std::vector<std::string>& reports, double now_s, CycleOutcome& outcome) {
  if (static_cast<int>(reports.size()) != size_) {
    throw CommError("agreement expected " + std::to_string(size_) + " reports, got " +
                    std::to_string(reports.size()));
  }
  outcome.reset();
  to_cache_.clear();
  outcome.min_completed_bytes = std::numeric_limits<uint64_t>::max();
  bool root_sent_settings = false;
  for (int from = 0; from < size_; ++from) {
    Reader reader(reports[from], from);
    if (reader.get_byte() != kReportMagic) reader.fail("bad magic");
    const uint8_t flags = reader.get_byte();
    if (flags & ~(kFlagShutdown | kFlagAbort | kFlagSettings | kFlagJoin)) reader.fail("bad flags");
    outcome.min_completed_bytes = std::min(outcome.min_completed_bytes, reader.get_varint());
    std::string abort_message = (flags & kFlagAbort) ? reader.get_string(kMaxMessageBytes) : std::string();
    const uint32_t settings_epoch = reader.get_uint32();
    SchedulingSettings settings;
    if (flags & kFlagSettings) {
      const uint8_t policy = reader.get_byte();
      if (policy > 1) reader.fail("bad policy");
      settings.policy = static_cast<Policy>(policy);
      settings.partition_bytes = reader.get_varint();
      settings.credit_bytes = reader.get_varint();
      settings.fusion_bytes = reader.get_varint();
    }
    outcome.min_settings_epoch = from == 0 ? settings_epoch : std::min(outcome.min_settings_epoch, settings_epoch);
    if (from == 0) {
      outcome.root_settings_epoch = settings_epoch;
      outcome.root_settings = settings;
      root_sent_settings = (flags & kFlagSettings) != 0;
    }
    if ((flags & kFlagShutdown) && outcome.shutdown_rank < 0) outcome.shutdown_rank = from;
    if (!abort_message.empty() && outcome.abort_rank < 0) {
      outcome.abort_rank = from;
      outcome.abort_message = std::move(abort_message);
    }
    const uint32_t entries = reader.get_uint32();
    outcome.announcements += entries;
    for (uint32_t i = 0; i < entries; ++i) {
      TensorSpec spec;
      std::string refusal;
      const uint8_t tag = reader.get_byte();
      if (tag == kEntryCached) {
        const uint32_t id = reader.get_uint32();
        if (id >= cache_.size() || cache_[id].spec.name.empty()) {
          reader.fail("unknown cached tensor id " + std::to_string(id));
        }
        spec = cache_[id].spec;
        spec.priority = reader.get_int32();
      } else if (tag == kEntryRefused || tag == kEntryRefusedInSet) {
        spec.name = reader.get_string(kMaxTensorNameBytes);
        refusal = reader.get_string(kMaxMessageBytes);
        if (refusal.empty()) reader.fail("refusal of '" + spec.name + "' without a reason");
        if (tag == kEntryRefusedInSet) spec.process_set = reader.get_int32();
      } else if (tag == kEntryFull) {
        spec.name = reader.get_string(kMaxTensorNameBytes);
        const uint8_t dtype = reader.get_byte();
        const uint8_t op = reader.get_byte();
        const uint8_t kind = reader.get_byte();
        if (dtype >= kNumDTypes || op >= kNumReduceOps || kind >= kNumKinds) reader.fail("bad tensor metadata");
        spec.dtype = static_cast<DType>(dtype);
        spec.op = static_cast<ReduceOp>(op);
        spec.kind = static_cast<CollectiveKind>(kind);
        spec.root = reader.get_int32();
        spec.count = reader.get_varint();
        spec.priority = reader.get_int32();
        const uint8_t extras = reader.get_byte();
        if (extras & ~(kExtraPrescale | kExtraPostscale | kExtraRowShape | kExtraSplits | kExtraProcessSet | kExtraGroup)) {
          reader.fail("bad extras");
        }
        if (extras & kExtraProcessSet) spec.process_set = reader.get_int32();
        if (extras & kExtraGroup) {
          spec.group_size = reader.get_uint32();
          spec.group_index = reader.get_uint32();
          if (spec.group_size == 0 || spec.group_index >= spec.group_size) {
            reader.fail("bad group member '" + spec.name + "' (" + std::to_string(spec.group_index) + " of " +
                        std::to_string(spec.group_size) + ")");
          }
        }
        if (extras & kExtraPrescale) spec.prescale = reader.get_double();
        if (extras & kExtraPostscale) spec.postscale = reader.get_double();
        if (extras & kExtraRowShape) spec.row_shape = reader.get_varints(kMaxRowDims);
        if (extras & kExtraSplits) {
          const size_t ranks = members(spec.process_set).size();
          spec.splits = reader.get_varints(ranks);
          if (spec.splits.size() != ranks) reader.fail("alltoall splits for another number of ranks");
        }
      } else {
        reader.fail("bad entry tag " + std::to_string(tag));
      }
      const uint64_t payload_bytes = refusal.empty() ? reader.get_varint() : 0;
      if (payload_bytes != 0 && payload_bytes != spec.bytes()) {
        reader.fail("inline payload of " + std::to_string(payload_bytes) + " bytes for '" + spec.name + "' of " +
                    std::to_string(spec.bytes()));
      }
      uint64_t local_id = 0;
      if (from == rank_) {
        if (sent_ids_.empty()) reader.fail("more entries than this rank announced");
        local_id = sent_ids_.front();
        sent_ids_.pop_front();
      }
      std::string payload = reader.get_bytes(static_cast<size_t>(payload_bytes));
      record(from, std::move(spec), std::move(payload), std::move(refusal), local_id, now_s, outcome);
    }
    if (!reader.at_end()) reader.fail("trailing bytes");
    // After this rank's entries: what it announced before joining it contributes itself.
    if (flags & kFlagJoin) mark_joined(from, outcome);
  }
  // Every rank asked past the last agreed epoch, rank 0 included, so its settings came along.
  if (outcome.min_settings_epoch > agreed_settings_epoch_ && !root_sent_settings) {
    throw CommError("malformed agreement report from rank 0: settings epoch " +
                    std::to_string(outcome.root_settings_epoch) + " without its settings");
  }
  agreed_settings_epoch_ = std::max(agreed_settings_epoch_, outcome.min_settings_epoch);
  fail_broken_groups(outcome);
  cache_agreed();
}

}  // namespace commsched
