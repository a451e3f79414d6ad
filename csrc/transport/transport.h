// The one interface every transport implements (MPI, loopback, and Python-side
// transports through the trampoline). The core calls it from its background thread only.
#pragma once

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/elementwise.h"
#include "core/types.h"

namespace commsched {

// A piece of a tensor in a fused launch, in the order it sits in the fusion buffer.
struct Segment {
  void* data = nullptr;
  uint64_t bytes = 0;
};

// One collective on the wire. Allreduce and reducescatter reduce with `op`, where "average" means
// sum unless the transport averages() itself (the core then divides with scale()). Bool data
// arrives as uint8 (0 or 1) with op min, max or product.
struct WireOp {
  CollectiveKind kind = CollectiveKind::kAllreduce;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  // Allreduce, broadcast: in place. Allgather, reducescatter, alltoall: this rank's input (read only).
  void* data = nullptr;  // the tensor's own memory, or the fusion buffer of a fused launch
  uint64_t count = 0;  // elements at `data`
  // Allgather, reducescatter, alltoall: where the result goes, in the transport's memory
  // (allocate_fusion_buffer), and the elements it receives from each rank, in rank order
  // (reducescatter: what each rank keeps of the reduced input, this rank's part at `output`).
  void* output = nullptr;
  std::vector<uint64_t> recv_counts;
  // Alltoall: the elements of `data` that go to each rank, in rank order.
  std::vector<uint64_t> send_counts;
  // The agreed TensorSpec::layout (alltoall: every rank's send counts, [source * size + target]).
  std::vector<uint64_t> layout;
  // A fused launch on a transport that stages_fusion(): the tensors' memory that goes in and out of
  // `data`. Empty otherwise (the core has copied already).
  std::vector<Segment> fused;
  // Allreduce, reducescatter: the agreed prescale_factor / postscale_factor. Only a transport that
  // scales() applies them; for the others the core has applied them around start() already.
  double prescale = 1.0;
  double postscale = 1.0;
  // The process set it runs on (0: every rank), on the communicator add_process_set() built. Every
  // rank-indexed field above (root, recv_counts, send_counts, layout) then numbers the set's members
  // 0..n-1 in rank order, as that communicator does.
  int32_t process_set = 0;
};

// Where a submitted tensor's bytes live and on which stream they are produced.
struct Placement {
  bool device = false;  // GPU memory
  int device_id = -1;   // -1: the producer did not say
  // The CUDA stream that produces the bytes; nullopt: no ordering needed (or host memory).
  std::optional<uintptr_t> stream;
};

// Memory for fused launches, in the transport's memory space (host or device). The core keeps a
// pool of them and asks for a bigger one when a launch outgrows what it holds.
class FusionBuffer {
 public:
  virtual ~FusionBuffer() = default;
  virtual void* data() = 0;
  virtual size_t capacity() const = 0;
};

class HostFusionBuffer : public FusionBuffer {
 public:
  explicit HostFusionBuffer(size_t bytes) : bytes_(bytes) {}
  void* data() override { return bytes_.data(); }
  size_t capacity() const override { return bytes_.size(); }

 private:
  std::vector<uint8_t> bytes_;
};

// A point on a device transport's stream, right after a launch. A consumer's stream can be made
// to wait there on the GPU, so it may use the launch's result without the host waiting for it.
class StreamMark {
 public:
  virtual ~StreamMark() = default;
  // Makes `stream` (a CUDA stream handle of the transport's device) wait until this point is reached.
  virtual void make_wait(uintptr_t stream) = 0;
};

// An operation in flight. test() returns true once the data is final; it throws
// CommError if the operation failed.
class PendingOp {
 public:
  virtual ~PendingOp() = default;
  virtual bool test() = 0;
  // Device transports: the stream point after this launch (null: the host must wait for test()).
  virtual std::shared_ptr<StreamMark> mark() { return nullptr; }
};

// Lets a transport wake the core the moment a collective completes, instead of the core
// polling for it. Any thread may ring it, also after the core has gone (it then does nothing).
class Doorbell {
 public:
  void ring() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (target_) target_();
  }
  void connect(std::function<void()> target) {
    std::lock_guard<std::mutex> lock(mutex_);
    target_ = std::move(target);
  }
  void disconnect() { connect(nullptr); }

 private:
  std::mutex mutex_;
  std::function<void()> target_;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;

  // Blocking allgather of one byte string per rank; every rank calls it in the same
  // order. Returns the strings indexed by rank. Throws CommError on failure or after
  // `timeout_s` seconds without every rank joining.
  virtual std::vector<std::string> exchange(const std::string& mine, double timeout_s) = 0;

  // exchange() for a caller with a deadline of its own: false once `yield_at` passed with the
  // exchange unfinished, which stays open; the next call, from any thread and with the same
  // `mine`, goes on with it, and `timeout_s` counts from the first. True with `reports` set once
  // complete. A transport that cannot leave an exchange halfway runs it whole.
  virtual bool exchange_until(const std::string& mine, double timeout_s,
                              std::chrono::steady_clock::time_point yield_at, std::vector<std::string>& reports) {
    (void)yield_at;
    reports = exchange(mine, timeout_s);
    return true;
  }
  // The ranks whose report an exchange left open by exchange_until() still lacks; empty when
  // none is open or the transport cannot tell.
  virtual std::vector<int> silent_ranks() const { return {}; }

  // Starts a collective (allreduce and broadcast in place on `op.data`). Every rank starts
  // collectives in the same order (the agreement guarantees it). Only what unsupported() accepts
  // arrives here.
  virtual std::unique_ptr<PendingOp> start(const WireOp& op) = 0;

  // Why this transport cannot run `spec` (empty: it can). Called at submission, so a collective a
  // transport lacks is refused on every rank with this reason instead of failing on the wire. The
  // default takes what every transport started with: allreduce (sum, average) and broadcast.
  virtual std::string unsupported(const TensorSpec& spec) const {
    const bool basic_kind = spec.kind == CollectiveKind::kAllreduce || spec.kind == CollectiveKind::kBroadcast ||
                            spec.kind == CollectiveKind::kBarrier;
    if (!basic_kind) return "the " + name() + " transport does not implement " + kind_name(spec.kind);
    const bool basic_op = spec.op == ReduceOp::kSum || spec.op == ReduceOp::kAverage;
    if (spec.kind == CollectiveKind::kAllreduce && !basic_op) {
      return "the " + name() + " transport does not implement allreduce with op=\"" + op_name(spec.op) + "\"";
    }
    if (spec.kind == CollectiveKind::kAllreduce && spec.dtype == DType::kBool) {
      return "the " + name() + " transport does not implement allreduce of bool";
    }
    return {};
  }

  // Builds what process set `id` (its ranks, ascending) runs on, before any collective names it.
  // Every rank calls it with the same arguments in the same order, on a user thread while the core's
  // thread goes on with other collectives; it may block until the members have all called it.
  // Throws UsageError when the transport has no process sets.
  virtual void add_process_set(int32_t id, const std::vector<int>& ranks) {
    (void)id;
    if (static_cast<int>(ranks.size()) == size()) return;  // every rank: the transport's own communicator
    throw UsageError("the " + name() + " transport does not implement process sets; use the mpi or gloo transport");
  }
  // Frees what add_process_set() built; nothing runs on the set any more. Any thread.
  virtual void remove_process_set(int32_t id) { (void)id; }

  // How long the core may sleep between polls of collectives in flight. Zero means the
  // library moves data only while polled (MPI's progress engine), so the core keeps
  // polling and only yields the CPU; transports with their own threads get a real sleep.
  virtual std::chrono::microseconds poll_interval() const { return std::chrono::microseconds(0); }

  // True when exchange(), start() and test() may be called from any thread (one at a time):
  // a caller waiting for its collective then runs the core itself instead of handing the
  // work to the core's thread and back. Python-side transports need their own thread.
  virtual bool any_thread() const { return false; }

  // True when tensors live in host memory the core may read and write directly: small ones then
  // travel inside the agreement reports and are reduced there, without a collective of their own.
  virtual bool host_memory() const { return true; }

  // Called on the submitting thread (any thread, concurrently with the core's), before the core
  // sees the tensor: a device transport records there the point on the producer's stream that the
  // collectives over this memory must wait for. Throws std::invalid_argument to refuse the tensor.
  virtual void prepare(const TensorSpec& spec, void* data, const Placement& placement) {
    (void)spec, (void)data, (void)placement;
  }
  // Drops what prepare() recorded, for a tensor the core then refused. Any thread.
  virtual void forget(void* data) { (void)data; }

  // True when exchange() between ranks of one host goes through shared memory (MPI: a few
  // microseconds a round), so COMMSCHED_CONTROL_CHANNEL=auto keeps it there. Every other exchange
  // (Gloo's pair sockets and worker threads, gRPC and the Python Gloo path) costs hundreds of
  // microseconds a round on one host, against tens over the TCP control channel, so auto takes the
  // channel for it wherever the ranks run.
  virtual bool exchange_in_shared_memory() const { return false; }

  // Told when the core's own control channel (not this transport) found `rank` gone (-1: unknown),
  // so the transport stops waiting for it where it would otherwise block (MPI_Finalize). Driver only.
  virtual void peer_lost(const std::string& why, int rank) { (void)why, (void)rank; }

  // Fusion buffers live in the transport's memory: host memory unless it says otherwise.
  virtual std::unique_ptr<FusionBuffer> allocate_fusion_buffer(size_t bytes) {
    return std::make_unique<HostFusionBuffer>(bytes);
  }
  // True when start() copies a fused launch's segments in and out itself, in order with the
  // collective (a device stream): the core then neither copies nor waits between the steps.
  virtual bool stages_fusion() const { return false; }
  // True when start() applies ReduceOp::kAverage itself (NCCL's ncclAvg): the core never calls scale().
  virtual bool averages() const { return false; }
  // True when start() applies WireOp::prescale and postscale itself, in order with the collective
  // (NCCL's PreMulSum): the core then never calls multiply() and makes no scaled copy of an input.
  virtual bool scales() const { return false; }

  // Transports that can tell when a collective completes ring this; their poll interval
  // is then only a fallback.
  virtual void set_doorbell(std::shared_ptr<Doorbell> doorbell) { (void)doorbell; }
  // The only places the core touches buffer memory itself go through these two hooks, so a
  // transport whose buffers live on a device (NCCL) can do them there, or refuse them.
  // Fusion: copies a chunk into the core's fusion buffer before start(), and back after test().
  // The copy must be complete when copy() returns: the core reads or hands out the bytes next.
  virtual void copy(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
  // op="average": divides the summed `data` by the number of ranks once test() returned true.
  // The result must be final when scale() returns: the core completes the handle next.
  virtual void scale(void* data, uint64_t count, DType dtype, double divisor) {
    divide_by(data, count, dtype, divisor);
  }
  // prescale_factor / postscale_factor: multiplies `data` by `factor`; final when it returns.
  virtual void multiply(void* data, uint64_t count, DType dtype, double factor) {
    multiply_by(data, count, dtype, factor);
  }
};

}  // namespace commsched

namespace commsched {

// A natively compiled transport living in another extension module hands the core
// a factory through a capsule of this name: the module is loaded only when chosen.
using TransportFactory = std::unique_ptr<Transport> (*)(uint64_t handle);
inline constexpr const char* kTransportFactoryCapsule = "commsched.transport_factory";

// A device transport (NCCL) moves the data and leaves the agreement, and its own bootstrap, to a
// host transport it wraps. Its module hands the core one of these through a capsule of this name.
class DeviceTransportMaker {
 public:
  virtual ~DeviceTransportMaker() = default;
  virtual std::unique_ptr<Transport> make(std::unique_ptr<Transport> control) = 0;
};
inline constexpr const char* kDeviceTransportMakerCapsule = "commsched.device_transport_maker";

}  // namespace commsched
