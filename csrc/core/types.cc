#include "types.h"

namespace commsched {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt16:
      return 2;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kUInt8:
    case DType::kInt8:
    case DType::kBool:
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
    case DType::kInt16: return "int16";
    case DType::kBool: return "bool";
  }
  return "unknown";
}

DType dtype_from_name(const std::string& name) {
  for (int code = 0; code < kNumDTypes; ++code) {
    auto dtype = static_cast<DType>(code);
    if (name == dtype_name(dtype)) return dtype;
  }
  throw UsageError("unsupported dtype '" + name +
                   "'; commsched handles float16, bfloat16, float32, float64, int16, int32, int64, uint8, int8, bool");
}

bool dtype_is_floating(DType dtype) {
  return dtype == DType::kFloat16 || dtype == DType::kBFloat16 || dtype == DType::kFloat32 ||
         dtype == DType::kFloat64;
}

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAverage: return "average";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kProduct: return "product";
  }
  return "unknown";
}

ReduceOp op_from_name(const std::string& name) {
  for (int code = 0; code < kNumReduceOps; ++code) {
    auto op = static_cast<ReduceOp>(code);
    if (name == op_name(op)) return op;
  }
  throw UsageError("unsupported op '" + name + "'; use op=\"sum\", \"average\", \"min\", \"max\" or \"product\"");
}

const char* kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllreduce: return "allreduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kAllgather: return "allgather";
    case CollectiveKind::kReducescatter: return "reducescatter";
    case CollectiveKind::kAlltoall: return "alltoall";
    case CollectiveKind::kBarrier: return "barrier";
  }
  return "unknown";
}

CollectiveKind kind_from_name(const std::string& name) {
  for (int code = 0; code < kNumKinds; ++code) {
    auto kind = static_cast<CollectiveKind>(code);
    if (name == kind_name(kind)) return kind;
  }
  throw UsageError("unknown collective '" + name + "'");
}

bool kind_has_output(CollectiveKind kind) {
  return kind == CollectiveKind::kAllgather || kind == CollectiveKind::kReducescatter ||
         kind == CollectiveKind::kAlltoall;
}

bool kind_reduces(CollectiveKind kind) {
  return kind == CollectiveKind::kAllreduce || kind == CollectiveKind::kReducescatter;
}

uint64_t TensorSpec::row_elements() const {
  uint64_t elements = 1;
  for (uint64_t extent : row_shape) elements *= extent;
  return elements;
}

bool TensorSpec::agrees_with(const TensorSpec& other) const {
  const bool counts_may_differ = kind == CollectiveKind::kAllgather || kind == CollectiveKind::kAlltoall;
  return dtype == other.dtype && op == other.op && kind == other.kind && root == other.root &&
         (counts_may_differ || count == other.count) && prescale == other.prescale &&
         postscale == other.postscale && row_shape == other.row_shape && process_set == other.process_set &&
         group_length() == other.group_length();
}

namespace {

std::string shape_text(uint64_t rows, const std::vector<uint64_t>& row_shape) {
  std::string text = "(" + std::to_string(rows);
  for (uint64_t extent : row_shape) text += ", " + std::to_string(extent);
  return text + (row_shape.empty() ? ",)" : ")");
}

}  // namespace

std::string TensorSpec::describe() const {
  std::string text = std::string(kind_name(kind)) + " " + dtype_name(dtype);
  if (kind_has_output(kind) || !row_shape.empty()) {  // a shape beyond 1-D tells apart equal counts
    const uint64_t row = row_elements();
    text += shape_text(row == 0 ? 0 : count / row, row_shape);
  } else {
    text += "[" + std::to_string(count) + "]";
  }
  if (kind_reduces(kind)) {
    text += std::string(" op=") + op_name(op);
    if (prescale != 1.0) text += " prescale=" + std::to_string(prescale);
    if (postscale != 1.0) text += " postscale=" + std::to_string(postscale);
  } else if (kind == CollectiveKind::kBroadcast) {
    text += " root=" + std::to_string(root);
  } else if (kind == CollectiveKind::kAlltoall) {
    text += " splits=[";
    for (size_t i = 0; i < splits.size(); ++i) text += (i ? "," : "") + std::to_string(splits[i]);
    text += "]";
  }
  if (process_set != 0) text += " process_set=" + std::to_string(process_set);
  if (group_length() > 1) text += " in a group of " + std::to_string(group_size);
  return text;
}

}  // namespace commsched
