#include "types.h"

namespace commsched {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kUInt8:
    case DType::kInt8:
      return 1;
  }
  throw std::invalid_argument("unknown dtype code");
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
  }
  return "unknown";
}

DType dtype_from_name(const std::string& name) {
  for (int code = 0; code < kNumDTypes; ++code) {
    auto dtype = static_cast<DType>(code);
    if (name == dtype_name(dtype)) return dtype;
  }
  throw UsageError("unsupported dtype '" + name +
                   "'; commsched handles float16, bfloat16, float32, float64, int32, int64, uint8, int8");
}

bool dtype_is_floating(DType dtype) {
  return dtype == DType::kFloat16 || dtype == DType::kBFloat16 || dtype == DType::kFloat32 ||
         dtype == DType::kFloat64;
}

const char* op_name(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "average"; }

ReduceOp op_from_name(const std::string& name) {
  if (name == "sum") return ReduceOp::kSum;
  if (name == "average") return ReduceOp::kAverage;
  throw UsageError("unsupported op '" + name + "'; use op=\"sum\" or op=\"average\"");
}

const char* kind_name(CollectiveKind kind) {
  return kind == CollectiveKind::kAllreduce ? "allreduce" : "broadcast";
}

std::string TensorSpec::describe() const {
  std::string text = std::string(kind_name(kind)) + " " + dtype_name(dtype) + "[" + std::to_string(count) + "]";
  if (kind == CollectiveKind::kAllreduce) {
    text += std::string(" op=") + op_name(op);
  } else {
    text += " root=" + std::to_string(root);
  }
  return text;
}

}  // namespace commsched
