// Value types shared by the scheduling core, the transports and the bindings.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace commsched {

enum class DType : uint8_t { kFloat16 = 0, kBFloat16, kFloat32, kFloat64, kInt32, kInt64, kUInt8, kInt8 };
enum class ReduceOp : uint8_t { kSum = 0, kAverage };
enum class CollectiveKind : uint8_t { kAllreduce = 0, kBroadcast };

constexpr int kNumDTypes = 8;

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
DType dtype_from_name(const std::string& name);  // throws std::invalid_argument
bool dtype_is_floating(DType dtype);
const char* op_name(ReduceOp op);
ReduceOp op_from_name(const std::string& name);
const char* kind_name(CollectiveKind kind);

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
  uint64_t count = 0;
  int32_t priority = 0;

  uint64_t bytes() const { return count * dtype_size(dtype); }
  // Everything but the name and priority must match across ranks.
  bool same_shape_as(const TensorSpec& other) const {
    return dtype == other.dtype && op == other.op && kind == other.kind && root == other.root &&
           count == other.count;
  }
  std::string describe() const;
};

}  // namespace commsched
