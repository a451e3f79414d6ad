// Native MPI transport: nonblocking collectives for the data, and point-to-point messages (an
// allgather past 8 ranks) for the agreement, on communicators duplicated from the one the user
// hands over (MPI_COMM_WORLD from mpi4py by default).
#pragma once

#include <mpi.h>

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/settings.h"
#include "transport/transport.h"

namespace commsched {

class MpiTransport : public Transport {
 public:
  // `parent` must outlive nothing: the transport works on duplicates of it.
  explicit MpiTransport(MPI_Comm parent);
  ~MpiTransport() override;
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }
  std::vector<std::string> exchange(const std::string& mine, double timeout_s) override;
  bool exchange_until(const std::string& mine, double timeout_s, std::chrono::steady_clock::time_point yield_at,
                      std::vector<std::string>& reports) override;
  std::vector<int> silent_ranks() const override {
    return exchange_open_ && size_ <= kDirectExchangeMaxRanks ? silent_peers() : std::vector<int>{};
  }
  std::unique_ptr<PendingOp> start(const WireOp& op) override;
  bool any_thread() const override { return true; }
  // MPI's exchange between ranks of one host runs over its shared memory.
  bool exchange_in_shared_memory() const override { return true; }
  // MPI has every collective and op (min, max and product of half types through user ops).
  std::string unsupported(const TensorSpec& spec) const override { return {}; }
  // A process set runs on a communicator of its members (MPI_Comm_create_group, collective over them only).
  void add_process_set(int32_t id, const std::vector<int>& ranks) override;
  void remove_process_set(int32_t id) override;
  void peer_lost(const std::string& why, int rank) override { lose_peer(why, rank); }

 private:
  class Op;

  MPI_Datatype datatype(DType dtype) const;
  // The communicator a collective of `process_set` runs on.
  MPI_Comm communicator(int32_t process_set);
  MPI_Op reduce_op(DType dtype, ReduceOp op) const;
  void resize_slot(uint64_t wanted);
  // The peers whose report the direct exchange has not received.
  std::vector<int> silent_peers() const;
  [[noreturn]] void throw_exchange_timeout(const std::vector<int>& silent, double timeout_s);
  // Remembers that a peer stopped responding: collectives in flight fail, and MPI_Finalize aborts.
  // `lost_rank`: the rank that stopped, or -1 when not known.
  void lose_peer(const std::string& why, int lost_rank = -1);

  // A small report (a few cached tensors) fits 32 bytes: at 2 ranks on shared memory a
  // 32-byte allgather took 1.2 us and a 128-byte one 1.5.
  static constexpr uint64_t kMinSlotBytes = 32;
  static constexpr uint64_t kSlotStepBytes = 1024;
  static constexpr uint64_t kMaxSlotBytes = 256 * 1024;
  static constexpr int kExchangeTag = 1;

  MPI_Comm control_ = MPI_COMM_NULL;  // agreement traffic, never behind data
  MPI_Comm data_ = MPI_COMM_NULL;
  // Process sets' communicators are made from this one, on the caller's thread, never on data_,
  // which the core's thread uses at the same time.
  MPI_Comm sets_parent_ = MPI_COMM_NULL;
  std::mutex sets_mutex_;
  std::map<int32_t, MPI_Comm> set_comms_;  // guarded by sets_mutex_; this rank's sets only
  uint64_t slot_bytes_ = kMinSlotBytes;  // bytes per rank of the agreement allgather
  std::string send_slot_, received_slots_;  // exchange()'s buffers, kept for their capacity
  std::vector<MPI_Request> requests_;
  // An exchange a caller with a deadline left open (exchange_until): its requests are requests_.
  bool exchange_open_ = false;
  double exchange_timeout_s_ = -1;
  std::chrono::steady_clock::time_point exchange_started_;  // min until the clock starts
  int rank_ = 0;
  int size_ = 1;
  MPI_Datatype half_type_ = MPI_DATATYPE_NULL;  // 16-bit floats as opaque 2-byte elements
  MPI_Datatype bfloat_type_ = MPI_DATATYPE_NULL;
  // User ops for the 16-bit floats MPI lacks, by ReduceOp (average sums): [half, bfloat16][op].
  MPI_Op half_ops_[2][kNumReduceOps] = {};
  std::string lost_;  // why a peer is known lost; empty while every rank answers
};

}  // namespace commsched
