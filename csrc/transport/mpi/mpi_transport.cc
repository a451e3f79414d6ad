#include "transport/mpi/mpi_transport.h"
#include "core/text.h"
#include "transport/mpi/mpi_algorithms.h"

#include <chrono>
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <cstring>
#include <thread>

#include "core/elementwise.h"

namespace commsched {

namespace {

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, static_cast<size_t>(length));
}

void check(int code, const char* what) {
  if (code != MPI_SUCCESS) throw CommError(std::string("MPI ") + what + " failed: " + mpi_error_text(code));
}

template <DType Type, ReduceOp Op>
void half_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_into(inout, in, static_cast<uint64_t>(*len), Type, Op);
}

template <DType Type>
void create_half_ops(MPI_Op (&ops)[kNumReduceOps]) {
  check(MPI_Op_create(&half_reduce<Type, ReduceOp::kSum>, 1, &ops[static_cast<int>(ReduceOp::kSum)]), "Op_create");
  check(MPI_Op_create(&half_reduce<Type, ReduceOp::kMin>, 1, &ops[static_cast<int>(ReduceOp::kMin)]), "Op_create");
  check(MPI_Op_create(&half_reduce<Type, ReduceOp::kMax>, 1, &ops[static_cast<int>(ReduceOp::kMax)]), "Op_create");
  check(MPI_Op_create(&half_reduce<Type, ReduceOp::kProduct>, 1, &ops[static_cast<int>(ReduceOp::kProduct)]),
        "Op_create");
}

#if MPI_VERSION >= 4
using Count = MPI_Count;
using Displacement = MPI_Aint;
#else
using Count = int;
using Displacement = int;
#endif

// Counts and displacements of a vector collective: MPI reads them until the collective completes,
// so the op that polls it owns them.
struct VectorArguments {
  std::vector<Count> send_counts, recv_counts;
  std::vector<Displacement> send_offsets, recv_offsets;
};

Count to_count(uint64_t value) {
  if (value > static_cast<uint64_t>(std::numeric_limits<Count>::max())) {
    throw CommError("a collective of " + std::to_string(value) + " elements exceeds this MPI's count type");
  }
  return static_cast<Count>(value);
}

void fill(const std::vector<uint64_t>& counts, std::vector<Count>& out_counts, std::vector<Displacement>& out_offsets) {
  uint64_t offset = 0;
  for (uint64_t count : counts) {
    out_counts.push_back(to_count(count));
    if (offset > static_cast<uint64_t>(std::numeric_limits<Displacement>::max())) {
      throw CommError("a collective's displacement of " + std::to_string(offset) + " elements exceeds this MPI's range");
    }
    out_offsets.push_back(static_cast<Displacement>(offset));
    offset += count;
  }
}

// Polls a request: spinning for a few microseconds (a peer already in the exchange answers
// within one or two, and a yield is a system call that cost ~0.9 us of a 3.7 us small
// allreduce), then yielding between tests for a short while, then with short sleeps, so
// waiting ranks leave the CPU to others (ranks often outnumber cores on a test machine).
// The spin stays short: at 50 us, rounds came so fast that small tensors stopped fusing.
// kTimedOut when `timeout_s` passed since `started` (the requests stay pending); `started`, when
// unset (min), is set at the 8th test: a peer already waiting answers before that, unclocked.
// kYielded when `yield_at` passed first, the requests pending for the next call.
enum class Polled { kDone, kTimedOut, kYielded };

Polled poll_requests(MPI_Request* requests, int count, double timeout_s, std::chrono::steady_clock::time_point& started,
                     std::chrono::steady_clock::time_point yield_at, const char* what) {
  constexpr auto kSpinFor = std::chrono::microseconds(4);
  constexpr auto kYieldFor = std::chrono::microseconds(200);
  using Clock = std::chrono::steady_clock;
  // Spinning and yielding count from this call: a resumed exchange tests its peers at once.
  Clock::time_point call_start;
  int sleeps = 0;
  for (unsigned tests = 1;; ++tests) {
    int flag = 0;
    check(MPI_Testall(count, requests, &flag, MPI_STATUSES_IGNORE), what);
    if (flag) return Polled::kDone;
    if (tests % 8 != 0) continue;  // a test costs ~60 ns, a clock read ~20
    const auto now = Clock::now();
    if (tests == 8) {
      call_start = now;
      if (started == Clock::time_point::min()) started = now;
    }
    if (now >= yield_at) return Polled::kYielded;
    const auto waited = now - call_start;
    if (waited < kSpinFor) continue;
    if (waited < kYieldFor) {
      std::this_thread::yield();
      continue;
    }
    if (timeout_s >= 0 && now - started > std::chrono::duration<double>(timeout_s)) return Polled::kTimedOut;
    std::this_thread::sleep_for(std::chrono::microseconds(++sleeps < 1024 ? 10 : 200));
  }
}

// Returns false when `timeout_s` passed first (the requests stay pending).
bool wait_polling(MPI_Request* requests, int count, double timeout_s, const char* what) {
  auto started = std::chrono::steady_clock::time_point::min();
  return poll_requests(requests, count, timeout_s, started, std::chrono::steady_clock::time_point::max(), what) ==
         Polled::kDone;
}

// MPI_Finalize deletes MPI_COMM_SELF's attributes before anything else (MPI-2.2, 8.7.1): this
// delete callback turns the finalize of a process whose peer stopped responding into MPI_Abort,
// since MPICH's finalize waits for every rank of the job and would wait for that one forever.
// The attribute's value is the lost rank plus one (0: not known).
int abort_instead_of_finalize(MPI_Comm, int, void* lost_rank_plus_one, void*) {
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const auto lost = reinterpret_cast<intptr_t>(lost_rank_plus_one) - 1;
  const std::string who = lost >= 0 ? "rank " + std::to_string(lost) : std::string("a rank");
  std::fprintf(stderr,
               "[commsched rank %d ERROR] ending the job with MPI_Abort instead of MPI_Finalize: %s stopped "
               "responding, and MPI_Finalize would wait for it forever\n",
               rank, who.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  return MPI_SUCCESS;
}

}  // namespace

// A collective in flight. Once a peer is known lost it fails at once instead of waiting for the
// lost rank, so stopping takes no longer than finding out.
class MpiTransport::Op : public PendingOp {
 public:
  Op(MPI_Request request, MpiTransport& transport, std::unique_ptr<VectorArguments> arguments = nullptr)
      : request_(request), transport_(transport), arguments_(std::move(arguments)) {}
  ~Op() override {
    // A collective abandoned half-way cannot be cancelled; its communicator cannot finalize either.
    if (request_ != MPI_REQUEST_NULL) transport_.lose_peer("a collective was abandoned while in flight");
  }
  Op(const Op&) = delete;
  Op& operator=(const Op&) = delete;
  bool test() override {
    int flag = 0;
    try {
      check(MPI_Test(&request_, &flag, MPI_STATUS_IGNORE), "collective");
    } catch (const CommError& error) {
      transport_.lose_peer(error.what());
      throw;
    }
    if (!flag && !transport_.lost_.empty()) {
      throw CommError("MPI collective abandoned: " + transport_.lost_);
    }
    return flag != 0;
  }

 private:
  MPI_Request request_;
  MpiTransport& transport_;
  std::unique_ptr<VectorArguments> arguments_;  // the counts and offsets a vector collective reads
};

MpiTransport::MpiTransport(MPI_Comm parent) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw UsageError("MPI is not initialised; import mpi4py.MPI before commsched.init()");
  int provided = 0;
  MPI_Query_thread(&provided);
  if (provided != MPI_THREAD_MULTIPLE) {
    throw UsageError("MPI was initialised without MPI_THREAD_MULTIPLE (level " + std::to_string(provided) +
                     "); commsched's thread calls MPI beside yours. Leave mpi4py.rc.thread_level at 'multiple'");
  }
  check(MPI_Comm_dup(parent, &control_), "Comm_dup");
  check(MPI_Comm_dup(parent, &data_), "Comm_dup");
  check(MPI_Comm_dup(parent, &sets_parent_), "Comm_dup");
  MPI_Comm_set_errhandler(control_, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(data_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(data_, &rank_);
  MPI_Comm_size(data_, &size_);
  // Every rank decides from the same size at the same point of the program, so all run one
  // algorithm (MPI requires it). Process sets are left to MPICH's choice: switching when one is
  // made would race with collectives that other ranks have already started.
  const bool power_of_two = (size_ & (size_ - 1)) == 0;
  if (!power_of_two) prefer_pairwise_reduce_scatter();
  check(MPI_Type_contiguous(2, MPI_BYTE, &half_type_), "Type_contiguous");
  check(MPI_Type_commit(&half_type_), "Type_commit");
  check(MPI_Type_contiguous(2, MPI_BYTE, &bfloat_type_), "Type_contiguous");
  check(MPI_Type_commit(&bfloat_type_), "Type_commit");
  create_half_ops<DType::kFloat16>(half_ops_[0]);
  create_half_ops<DType::kBFloat16>(half_ops_[1]);
}

MpiTransport::~MpiTransport() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;  // MPI already released everything
  // Freeing what a collective stuck on a lost rank still uses is not allowed: the job aborts at finalize.
  if (!lost_.empty()) return;
  for (auto& ops : half_ops_) {
    for (MPI_Op& op : ops) {
      if (op != MPI_OP_NULL && op != MPI_Op{}) MPI_Op_free(&op);
    }
  }
  if (half_type_ != MPI_DATATYPE_NULL) MPI_Type_free(&half_type_);
  if (bfloat_type_ != MPI_DATATYPE_NULL) MPI_Type_free(&bfloat_type_);
  if (control_ != MPI_COMM_NULL) MPI_Comm_free(&control_);
  if (data_ != MPI_COMM_NULL) MPI_Comm_free(&data_);
  for (auto& [id, comm] : set_comms_) MPI_Comm_free(&comm);
  if (sets_parent_ != MPI_COMM_NULL) MPI_Comm_free(&sets_parent_);
}

void MpiTransport::add_process_set(int32_t id, const std::vector<int>& ranks) {
  if (!std::binary_search(ranks.begin(), ranks.end(), rank_)) return;  // the members alone build it
  MPI_Group parent_group = MPI_GROUP_NULL;
  MPI_Group members = MPI_GROUP_NULL;
  MPI_Comm comm = MPI_COMM_NULL;
  check(MPI_Comm_group(sets_parent_, &parent_group), "Comm_group");
  const int incl = MPI_Group_incl(parent_group, static_cast<int>(ranks.size()), ranks.data(), &members);
  const int created = incl == MPI_SUCCESS ? MPI_Comm_create_group(sets_parent_, members, id, &comm) : incl;
  if (members != MPI_GROUP_NULL) MPI_Group_free(&members);
  MPI_Group_free(&parent_group);
  check(created, "Comm_create_group");
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  std::lock_guard<std::mutex> lock(sets_mutex_);
  set_comms_[id] = comm;
}

void MpiTransport::remove_process_set(int32_t id) {
  std::lock_guard<std::mutex> lock(sets_mutex_);
  auto found = set_comms_.find(id);
  if (found == set_comms_.end()) return;
  MPI_Comm_free(&found->second);
  set_comms_.erase(found);
}

MPI_Comm MpiTransport::communicator(int32_t process_set) {
  if (process_set == 0) return data_;
  std::lock_guard<std::mutex> lock(sets_mutex_);
  auto found = set_comms_.find(process_set);
  if (found == set_comms_.end()) {
    throw CommError("the mpi transport has no communicator for process set " + std::to_string(process_set) +
                    " on rank " + std::to_string(rank_));
  }
  return found->second;
}

MPI_Datatype MpiTransport::datatype(DType dtype) const {
  switch (dtype) {
    case DType::kFloat16: return half_type_;
    case DType::kBFloat16: return bfloat_type_;
    case DType::kFloat32: return MPI_FLOAT;
    case DType::kFloat64: return MPI_DOUBLE;
    case DType::kInt32: return MPI_INT32_T;
    case DType::kInt64: return MPI_INT64_T;
    case DType::kUInt8: return MPI_UINT8_T;
    case DType::kInt8: return MPI_INT8_T;
    case DType::kInt16: return MPI_INT16_T;
    case DType::kBool: return MPI_UINT8_T;  // the core sends bools as uint8
  }
  throw CommError("unknown dtype");
}

MPI_Op MpiTransport::reduce_op(DType dtype, ReduceOp op) const {
  const ReduceOp reduction = op == ReduceOp::kAverage ? ReduceOp::kSum : op;  // the core divides
  if (dtype == DType::kFloat16 || dtype == DType::kBFloat16) {
    return half_ops_[dtype == DType::kFloat16 ? 0 : 1][static_cast<int>(reduction)];
  }
  switch (reduction) {
    case ReduceOp::kMin: return MPI_MIN;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kProduct: return MPI_PROD;
    default: return MPI_SUM;
  }
}

std::vector<std::string> MpiTransport::exchange(const std::string& mine, double timeout_s) {
  std::vector<std::string> reports;
  exchange_until(mine, timeout_s, std::chrono::steady_clock::time_point::max(), reports);
  return reports;
}

bool MpiTransport::exchange_until(const std::string& mine, double timeout_s,
                                  std::chrono::steady_clock::time_point yield_at, std::vector<std::string>& reports) {
  // One exchange of equal slots carries every report in the common case; only reports
  // longer than a slot need a second, an allgatherv of their tails.
  const size_t slot_size = slot_bytes_;
  const size_t in_slot = slot_size - sizeof(uint32_t);
  if (mine.size() > static_cast<size_t>(INT_MAX)) throw CommError("agreement report exceeds 2 GiB");
  // Kept across rounds: a round on shared memory costs ~1 us, and each allocation ~30 ns.
  std::string& slot = send_slot_;
  std::string& slots = received_slots_;
  const auto length = static_cast<uint32_t>(mine.size());
  const bool direct = size_ <= kDirectExchangeMaxRanks;
  if (!exchange_open_) {
    slot.resize(slot_size);  // past the report the slot's bytes are never read: not cleared
    std::memcpy(slot.data(), &length, sizeof(length));
    std::memcpy(slot.data() + sizeof(length), mine.data(), std::min(mine.size(), in_slot));
    slots.resize(slot_size * static_cast<size_t>(size_));
    const int slot_count = static_cast<int>(slot_size);
    requests_.clear();
    if (direct) {
      // Every rank sends its slot to every other: at 2 ranks on shared memory that took 0.6 us
      // where MPICH's nonblocking allgather, which runs a general schedule, took 1.3.
      for (int peer = 0; peer < size_; ++peer) {
        if (peer == rank_) continue;
        requests_.emplace_back();
        check(MPI_Irecv(slots.data() + peer * slot_size, slot_count, MPI_BYTE, peer, kExchangeTag, control_,
                        &requests_.back()),
              "Irecv");
      }
      for (int peer = 0; peer < size_; ++peer) {
        if (peer == rank_) continue;
        requests_.emplace_back();
        check(MPI_Isend(slot.data(), slot_count, MPI_BYTE, peer, kExchangeTag, control_, &requests_.back()),
              "Isend");
      }
    } else {
      requests_.emplace_back();
      check(MPI_Iallgather(slot.data(), slot_count, MPI_BYTE, slots.data(), slot_count, MPI_BYTE, control_,
                           &requests_.back()),
            "Iallgather");
    }
    exchange_open_ = true;
    exchange_timeout_s_ = timeout_s;
    exchange_started_ = std::chrono::steady_clock::time_point::min();
  }
  const Polled polled = poll_requests(requests_.data(), static_cast<int>(requests_.size()), exchange_timeout_s_,
                                      exchange_started_, yield_at, "agreement exchange");
  if (polled == Polled::kYielded) return false;
  exchange_open_ = false;
  if (polled == Polled::kTimedOut) {
    throw_exchange_timeout(direct ? silent_peers() : std::vector<int>{}, exchange_timeout_s_);
  }

  reports.assign(static_cast<size_t>(size_), std::string());
  uint64_t tail_total = 0;
  uint64_t longest = 0;
  // This rank's report is `mine` (the direct exchange leaves its own slot unfilled).
  const auto length_of = [&](int r) {
    if (r == rank_) return length;
    uint32_t their_length;
    std::memcpy(&their_length, slots.data() + r * slot_size, sizeof(their_length));
    return their_length;
  };
  for (int r = 0; r < size_; ++r) {
    const uint32_t their_length = length_of(r);
    const char* their_report = r == rank_ ? mine.data() : slots.data() + r * slot_size + sizeof(uint32_t);
    reports[r].assign(their_report, std::min<size_t>(their_length, in_slot));
    tail_total += their_length > in_slot ? their_length - in_slot : 0;
    longest = std::max<uint64_t>(longest, their_length);
  }
  resize_slot(longest + sizeof(uint32_t));
  if (tail_total == 0) return true;
  if (tail_total > static_cast<uint64_t>(INT_MAX)) throw CommError("agreement reports exceed 2 GiB");
  std::vector<int> tail_counts(static_cast<size_t>(size_));
  std::vector<int> tail_offsets(static_cast<size_t>(size_));
  int offset = 0;
  for (int r = 0; r < size_; ++r) {
    const uint32_t their_length = length_of(r);
    tail_counts[r] = their_length > in_slot ? static_cast<int>(their_length - in_slot) : 0;
    tail_offsets[r] = offset;
    offset += tail_counts[r];
  }
  std::string tails(tail_total, '\0');
  const int my_tail = tail_counts[rank_];
  MPI_Request request;
  check(MPI_Iallgatherv(mine.data() + std::min(mine.size(), in_slot), my_tail, MPI_BYTE, tails.data(),
                        tail_counts.data(), tail_offsets.data(), MPI_BYTE, control_, &request),
        "Iallgatherv");
  // The tails follow at once on every rank that sent its slot: they block, under the round's limit.
  if (!wait_polling(&request, 1, exchange_timeout_s_, "agreement exchange")) {
    throw_exchange_timeout({}, exchange_timeout_s_);
  }
  for (int r = 0; r < size_; ++r) reports[r].append(tails, tail_offsets[r], tail_counts[r]);
  return true;
}

std::vector<int> MpiTransport::silent_peers() const {
  // The direct exchange posts one receive per peer, in rank order, before the sends.
  std::vector<int> silent;
  size_t index = 0;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    MPI_Request request = requests_[index++];
    int flag = 1;
    if (request != MPI_REQUEST_NULL) MPI_Request_get_status(request, &flag, MPI_STATUS_IGNORE);
    if (!flag) silent.push_back(peer);
  }
  return silent;
}

void MpiTransport::throw_exchange_timeout(const std::vector<int>& silent, double timeout_s) {
  // Past kDirectExchangeMaxRanks the exchange is one allgather, which cannot tell who is missing.
  const std::string who = silent.empty() ? "at least one rank" : rank_list(silent);
  const std::string what = "MPI agreement exchange got no report from " + who + " within " +
                           seconds_text(timeout_s) + "s: " + (silent.size() == 1 ? "it" : "they") +
                           " stopped taking part (crashed, hung, stopped, or never called commsched.init())";
  lose_peer(what, silent.empty() ? -1 : silent.front());
  throw CommError(what);
}

void MpiTransport::lose_peer(const std::string& why, int lost_rank) {
  if (!lost_.empty()) return;
  lost_ = why;
  // From here on MPI_Finalize would block: make it abort the job instead.
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  int keyval = MPI_KEYVAL_INVALID;
  if (MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, abort_instead_of_finalize, &keyval, nullptr) == MPI_SUCCESS) {
    MPI_Comm_set_attr(MPI_COMM_SELF, keyval, reinterpret_cast<void*>(static_cast<intptr_t>(lost_rank) + 1));
  }
}

void MpiTransport::resize_slot(uint64_t wanted) {
  // Every rank sees the same reports, so every rank picks the same slot for the next round:
  // it grows at once to fit the longest report (inline payloads make reports longer) and
  // shrinks slowly, so a training loop's rounds settle into one allgather each. Past 1 KiB it
  // grows in 1 KiB steps, not by doubling: a 4 KiB inline payload then rides in a 5 KiB slot,
  // under MPICH's shared-memory eager limit, where an 8 KiB slot took 3.6 us instead of 0.9.
  uint64_t fit = kMinSlotBytes;
  while (fit < wanted && fit < kSlotStepBytes) fit *= 2;
  if (fit < wanted) fit = (wanted + kSlotStepBytes - 1) / kSlotStepBytes * kSlotStepBytes;
  fit = std::min(fit, kMaxSlotBytes);
  if (fit > slot_bytes_) {
    slot_bytes_ = fit;
  } else if (fit * 4 <= slot_bytes_) {
    slot_bytes_ = std::max(fit, slot_bytes_ / 2);
  }
}

std::unique_ptr<PendingOp> MpiTransport::start(const WireOp& op) {
  MPI_Request request;
  const MPI_Datatype type = datatype(op.dtype);
  const Count count = to_count(op.count);
  const MPI_Comm comm = communicator(op.process_set);
#if MPI_VERSION >= 4
#define COMMSCHED_MPI(call) call##_c
#else
#define COMMSCHED_MPI(call) call
#endif
  switch (op.kind) {
    case CollectiveKind::kAllreduce:
      check(COMMSCHED_MPI(MPI_Iallreduce)(MPI_IN_PLACE, op.data, count, type, reduce_op(op.dtype, op.op), comm,
                                          &request),
            "Iallreduce");
      return std::make_unique<Op>(request, *this);
    case CollectiveKind::kBroadcast:
      check(COMMSCHED_MPI(MPI_Ibcast)(op.data, count, type, op.root, comm, &request), "Ibcast");
      return std::make_unique<Op>(request, *this);
    case CollectiveKind::kAllgather: {
      auto arguments = std::make_unique<VectorArguments>();
      fill(op.recv_counts, arguments->recv_counts, arguments->recv_offsets);
      check(COMMSCHED_MPI(MPI_Iallgatherv)(op.data, count, type, op.output, arguments->recv_counts.data(),
                                           arguments->recv_offsets.data(), type, comm, &request),
            "Iallgatherv");
      return std::make_unique<Op>(request, *this, std::move(arguments));
    }
    case CollectiveKind::kReducescatter: {
      auto arguments = std::make_unique<VectorArguments>();
      fill(op.recv_counts, arguments->recv_counts, arguments->recv_offsets);
      check(COMMSCHED_MPI(MPI_Ireduce_scatter)(op.data, op.output, arguments->recv_counts.data(), type,
                                               reduce_op(op.dtype, op.op), comm, &request),
            "Ireduce_scatter");
      return std::make_unique<Op>(request, *this, std::move(arguments));
    }
    case CollectiveKind::kAlltoall: {
      auto arguments = std::make_unique<VectorArguments>();
      fill(op.send_counts, arguments->send_counts, arguments->send_offsets);
      fill(op.recv_counts, arguments->recv_counts, arguments->recv_offsets);
      check(COMMSCHED_MPI(MPI_Ialltoallv)(op.data, arguments->send_counts.data(), arguments->send_offsets.data(), type,
                                          op.output, arguments->recv_counts.data(), arguments->recv_offsets.data(),
                                          type, comm, &request),
            "Ialltoallv");
      return std::make_unique<Op>(request, *this, std::move(arguments));
    }
    case CollectiveKind::kBarrier: break;
  }
#undef COMMSCHED_MPI
  throw CommError(std::string("the mpi transport was asked to start a ") + kind_name(op.kind));
}

}  // namespace commsched
