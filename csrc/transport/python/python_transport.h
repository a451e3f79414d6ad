// Trampoline for transports written in Python (torch.distributed process groups,
// gRPC): the core calls the Python object's methods with the GIL taken.
//
// The Python object provides:
//   rank: int, size: int, name: str
//   exchange(report: bytes, timeout_s: float) -> list[bytes]   (allgather, blocking)
//   start(address: int, count: int, dtype: str, kind: str, root: int) -> op with test() -> bool
//   poll_interval_us: int (optional, default 200): sleep between polls of collectives in flight
//   host_memory: bool (optional, default True): False for a transport of device memory (NCCL)
//   close() (optional): called once when the core stops, to release what the transport created
//   unsupported(kind: str, dtype: str, op: str) -> str (optional): why the transport cannot run a
//     collective beyond allreduce (sum, average) and broadcast, "" when it can; without it those
//     are refused. The ones it takes then arrive as
//   start(address, count, dtype, kind, root, op=op) for allreduce with op "min", "max" or "product", and
//   start_collective(kind, dtype, op, address, count, output, recv_counts, send_counts, layout) -> op for
//     allgather, reducescatter and alltoall: `count` elements at `address` in, the result at
//     `output`; recv_counts / send_counts in elements by rank, as in WireOp.
// An op may also provide on_done(callback): it calls callback() once, from any thread,
// when the op completes, so the core wakes at once rather than at its next poll.
//   add_process_set(id: int, ranks: list[int]) / remove_process_set(id: int) (optional): builds and frees
//     a member-only group; a set's collectives then arrive with process_set=id as a keyword, every
//     rank-indexed argument (root, counts) numbering the set's members 0..n-1
//   copy(dst: int, src: int, nbytes: int) (optional): the fusion copies; default: memcpy on the host
//   scale(address: int, count: int, dtype: str, divisor: float) (optional): op="average" after the
//     sum; default: divides on the host. Both must be complete when they return.
#pragma once

#include <pybind11/pybind11.h>

#include "transport/transport.h"

namespace commsched {

class PythonTransport : public Transport {
 public:
  explicit PythonTransport(pybind11::object impl);
  ~PythonTransport() override;
  PythonTransport(const PythonTransport&) = delete;
  PythonTransport& operator=(const PythonTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }
  std::vector<std::string> exchange(const std::string& mine, double timeout_s) override;
  std::unique_ptr<PendingOp> start(const WireOp& op) override;
  // Every poll takes the GIL from the training thread, so poll sparingly.
  std::chrono::microseconds poll_interval() const override { return poll_interval_; }
  void set_doorbell(std::shared_ptr<Doorbell> doorbell) override { doorbell_ = std::move(doorbell); }
  // Host transports (Gloo, gRPC) leave these to the defaults; device ones (NCCL) provide them.
  void copy(void* dst, const void* src, size_t bytes) override;
  void scale(void* data, uint64_t count, DType dtype, double divisor) override;
  bool host_memory() const override { return host_memory_; }
  std::string unsupported(const TensorSpec& spec) const override;
  // Forwarded to the object's add_process_set(id, ranks) / remove_process_set(id) where it has them.
  void add_process_set(int32_t id, const std::vector<int>& ranks) override;
  void remove_process_set(int32_t id) override;

 private:
  pybind11::object impl_;
  int rank_;
  int size_;
  std::string name_;
  std::chrono::microseconds poll_interval_;
  std::shared_ptr<Doorbell> doorbell_;
  bool has_copy_;
  bool has_scale_;
  bool has_unsupported_;
  bool has_process_sets_;
  bool host_memory_;
};

}  // namespace commsched
