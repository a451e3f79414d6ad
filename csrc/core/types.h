// Value types shared by the scheduling core, the transports and the bindings.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace commsched {

enum class DType : uint8_t {
  kFloat16 = 0, kBFloat16, kFloat32, kFloat64, kInt32, kInt64, kUInt8, kInt8, kInt16, kBool
};
enum class ReduceOp : uint8_t { kSum = 0, kAverage, kMin, kMax, kProduct };
// kBarrier completes once every rank announced it: the agreement itself is the barrier.
enum class CollectiveKind : uint8_t { kAllreduce = 0, kBroadcast, kAllgather, kReducescatter, kAlltoall, kBarrier };

constexpr int kNumDTypes = 10;
constexpr int kNumReduceOps = 5;
constexpr int kNumKinds = 6;

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
DType dtype_from_name(const std::string& name);  // throws std::invalid_argument
bool dtype_is_floating(DType dtype);
const char* op_name(ReduceOp op);
ReduceOp op_from_name(const std::string& name);
const char* kind_name(CollectiveKind kind);
CollectiveKind kind_from_name(const std::string& name);
// True for the kinds whose result is a new buffer whose size depends on every rank's submission.
bool kind_has_output(CollectiveKind kind);
// True for the kinds that reduce with `op` (and take scale factors).
bool kind_reduces(CollectiveKind kind);

// Thrown for misuse that the caller can fix; surfaces in Python as ValueError.
class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Thrown when communication itself fails; surfaces in Python as CommschedError.
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Metadata of one collective request; agreed across ranks before it launches.
struct TensorSpec {
  std::string name;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  CollectiveKind kind = CollectiveKind::kAllreduce;
  int32_t root = 0;
  uint64_t count = 0;  // elements this rank submits; once agreed, see `layout`
  int32_t priority = 0;
  // Applied to this rank's data before the reduction and to the result after (Horovod's
  // prescale_factor / postscale_factor); 1 leaves the data as it is.
  double prescale = 1.0;
  double postscale = 1.0;
  // Allgather, reducescatter, alltoall: the extents of one row (every dimension but the first).
  std::vector<uint64_t> row_shape;
  // Alltoall: the rows this rank sends to each rank, by rank.
  std::vector<uint64_t> splits;
  // Filled by the agreement for the kinds with an output, identical on every rank: allgather and
  // reducescatter, the elements each rank receives (by rank); alltoall, the elements rank s sends
  // to rank d at [s * size + d]. `count` then becomes the total over ranks, the same everywhere.
  std::vector<uint64_t> layout;
  // The process set the collective runs on (0: every rank). Once the set is registered, every
  // rank-indexed field above (root excepted: a global rank) counts the set's members in rank order.
  int32_t process_set = 0;
  // A member of grouped_allreduce(): `group_size` tensors submitted together, this one named
  // "<group>.<group_index>". 0: submitted alone (agrees with a group of one). The group's length
  // is agreed like the shape, so a rank that passes another number of tensors fails at once.
  uint32_t group_size = 0;
  uint32_t group_index = 0;

  uint64_t bytes() const { return count * dtype_size(dtype); }
  uint64_t row_elements() const;
  // Everything but the name and priority is equal: what a cached name stands for.
  bool same_shape_as(const TensorSpec& other) const {
    return dtype == other.dtype && op == other.op && kind == other.kind && root == other.root &&
           count == other.count && prescale == other.prescale && postscale == other.postscale &&
           row_shape == other.row_shape && splits == other.splits && process_set == other.process_set &&
           group_size == other.group_size && group_index == other.group_index;
  }
  // The number of tensors in the grouped call this one came with (1 when submitted alone).
  uint32_t group_length() const { return group_size == 0 ? 1 : group_size; }
  // The submissions of one collective agree across ranks: like same_shape_as, except that the
  // element counts (and alltoall's splits) of an allgather or alltoall may differ.
  bool agrees_with(const TensorSpec& other) const;
  std::string describe() const;
};

}  // namespace commsched
