#include "transport/nccl/nccl_collectives.h"

#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>

#include "core/elementwise.h"
#include "transport/nccl/nccl_comm.h"

namespace commsched::nccl {

namespace {

int nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return kNcclSum;
    case ReduceOp::kAverage: return kNcclAvg;
    case ReduceOp::kMin: return kNcclMin;
    case ReduceOp::kMax: return kNcclMax;
    case ReduceOp::kProduct: return kNcclProd;
  }
  throw std::invalid_argument("NCCL transport: no NCCL reduction for this op");
}

bool reduces(CollectiveKind kind) {
  return kind == CollectiveKind::kAllreduce || kind == CollectiveKind::kReducescatter;
}

// The one factor a sum is multiplied by: prescale, postscale and the average's 1/size together.
// NCCL's PreMulSum multiplies each rank's input before summing, which is the same number.
double sum_factor(double prescale, double postscale, ReduceOp op, int size) {
  const double factor = prescale * postscale;
  return op == ReduceOp::kAverage ? factor / size : factor;
}

// Whether `factor` is a whole number `dtype` holds, so PreMulSum's integer factor is exact.
bool integer_factor_fits(double factor, DType dtype) {
  if (factor != std::floor(factor)) return false;
  switch (dtype) {
    case DType::kInt8: return factor >= -128 && factor <= 127;
    case DType::kUInt8: return factor >= 0 && factor <= 255;
    case DType::kInt32: return factor >= -2147483648.0 && factor <= 2147483647.0;
    case DType::kInt64: return std::fabs(factor) < 9.2e18;
    default: return false;
  }
}

// A PreMulSum reduction (sum of factor * input) for one launch; destroyed once its calls are queued,
// which NCCL allows (a host-immediate factor is read when the op is made).
class PreMulSum {
 public:
  PreMulSum(const NcclTarget& target, DType dtype, double factor) : api_(target.api), comm_(target.comm) {
    alignas(8) unsigned char scalar[8] = {};
    switch (dtype) {
      case DType::kFloat32: store(scalar, static_cast<float>(factor)); break;
      case DType::kFloat64: store(scalar, factor); break;
      case DType::kFloat16: store(scalar, float_to_half(static_cast<float>(factor))); break;
      case DType::kBFloat16: store(scalar, float_to_bfloat16(static_cast<float>(factor))); break;
      case DType::kInt32: store(scalar, static_cast<int32_t>(factor)); break;
      case DType::kInt64: store(scalar, static_cast<int64_t>(factor)); break;
      case DType::kInt8: store(scalar, static_cast<int8_t>(factor)); break;
      case DType::kUInt8: store(scalar, static_cast<uint8_t>(factor)); break;
      default: throw std::invalid_argument("NCCL transport: scale factors are not defined for this dtype");
    }
    api_.check(api_.ncclRedOpCreatePreMulSum(&op_, scalar, nccl_dtype(dtype), kNcclScalarHostImmediate, comm_),
               "ncclRedOpCreatePreMulSum");
  }
  ~PreMulSum() { api_.ncclRedOpDestroy(op_, comm_); }
  PreMulSum(const PreMulSum&) = delete;
  PreMulSum& operator=(const PreMulSum&) = delete;
  int op() const { return op_; }

 private:
  template <typename T>
  static void store(unsigned char* scalar, T value) {
    std::memcpy(scalar, &value, sizeof(T));
  }
  const Api& api_;
  ncclComm_t comm_;
  int op_ = 0;
};

// Calls queued between ncclGroupStart and ncclGroupEnd, launched together: uneven parts and
// send/recv pairs then cannot deadlock on the order of the calls.
template <typename Calls>
void in_group(const Api& api, Calls&& calls) {
  api.check(api.ncclGroupStart(), "ncclGroupStart");
  try {
    calls();
  } catch (...) {
    api.ncclGroupEnd();
    throw;
  }
  api.check(api.ncclGroupEnd(), "ncclGroupEnd");
}

bool all_equal(const std::vector<uint64_t>& counts) {
  for (uint64_t count : counts) {
    if (count != counts.front()) return false;
  }
  return true;
}

void check_counts(const std::vector<uint64_t>& counts, int size, const char* what) {
  if (counts.size() != static_cast<size_t>(size)) {
    throw std::invalid_argument(std::string("NCCL transport: ") + what + " has " + std::to_string(counts.size()) +
                                " per-rank counts for " + std::to_string(size) + " ranks");
  }
}

void allgather(const NcclTarget& t, const WireOp& op, int type, size_t elem_size) {
  check_counts(op.recv_counts, t.size, "allgather");
  char* out = static_cast<char*>(op.output);
  if (all_equal(op.recv_counts)) {
    t.api.check(t.api.ncclAllGather(op.data, out, op.recv_counts.front(), type, t.comm, t.stream), "ncclAllGather");
    return;
  }
  // Uneven first dimensions: each rank broadcasts its part into its place in every rank's output.
  in_group(t.api, [&] {
    uint64_t offset = 0;
    for (int root = 0; root < t.size; ++root) {
      const uint64_t count = op.recv_counts[static_cast<size_t>(root)];
      char* place = out + offset * elem_size;
      if (count > 0) {
        const void* send = root == t.rank ? op.data : place;  // read on the root only
        t.api.check(t.api.ncclBroadcast(send, place, count, type, root, t.comm, t.stream), "ncclBroadcast");
      }
      offset += count;
    }
  });
}

void reducescatter(const NcclTarget& t, const WireOp& op, int type, int reduction, size_t elem_size) {
  check_counts(op.recv_counts, t.size, "reducescatter");
  if (all_equal(op.recv_counts)) {
    t.api.check(
        t.api.ncclReduceScatter(op.data, op.output, op.recv_counts.front(), type, reduction, t.comm, t.stream),
        "ncclReduceScatter");
    return;
  }
  // Horovod's uneven split: one reduce per part, to the rank that keeps it.
  in_group(t.api, [&] {
    const char* in = static_cast<const char*>(op.data);
    uint64_t offset = 0;
    for (int root = 0; root < t.size; ++root) {
      const uint64_t count = op.recv_counts[static_cast<size_t>(root)];
      if (count > 0) {
        // The output is written on the root only; elsewhere NCCL leaves it alone.
        t.api.check(t.api.ncclReduce(in + offset * elem_size, op.output, count, type, reduction, root, t.comm, t.stream),
                    "ncclReduce");
      }
      offset += count;
    }
  });
}

void alltoall(const NcclTarget& t, const WireOp& op, int type, size_t elem_size) {
  check_counts(op.send_counts, t.size, "alltoall");
  check_counts(op.recv_counts, t.size, "alltoall");
  if (t.api.ncclSend == nullptr || t.api.ncclRecv == nullptr) {
    throw std::runtime_error("alltoall needs ncclSend/ncclRecv (NCCL 2.7 or newer)");
  }
  const char* in = static_cast<const char*>(op.data);
  char* out = static_cast<char*>(op.output);
  std::vector<uint64_t> send_offsets(op.send_counts.size()), recv_offsets(op.recv_counts.size());
  std::exclusive_scan(op.send_counts.begin(), op.send_counts.end(), send_offsets.begin(), uint64_t{0});
  std::exclusive_scan(op.recv_counts.begin(), op.recv_counts.end(), recv_offsets.begin(), uint64_t{0});
  in_group(t.api, [&] {
    for (int peer = 0; peer < t.size; ++peer) {
      if (peer == t.rank) continue;
      const auto p = static_cast<size_t>(peer);
      if (op.send_counts[p] > 0) {
        t.api.check(t.api.ncclSend(in + send_offsets[p] * elem_size, op.send_counts[p], type, peer, t.comm, t.stream),
                    "ncclSend");
      }
      if (op.recv_counts[p] > 0) {
        t.api.check(t.api.ncclRecv(out + recv_offsets[p] * elem_size, op.recv_counts[p], type, peer, t.comm, t.stream),
                    "ncclRecv");
      }
    }
  });
  const auto me = static_cast<size_t>(t.rank);
  if (op.send_counts[me] != op.recv_counts[me]) {
    throw std::invalid_argument("NCCL transport: alltoall sends " + std::to_string(op.send_counts[me]) +
                                " elements to itself but expects " + std::to_string(op.recv_counts[me]));
  }
  if (op.send_counts[me] > 0) {  // this rank's own part is a copy on the same stream
    t.api.check_cuda(t.api.cudaMemcpyAsync(out + recv_offsets[me] * elem_size, in + send_offsets[me] * elem_size,
                                           op.send_counts[me] * elem_size, kCudaMemcpyDefault, t.stream),
                     "cudaMemcpyAsync (alltoall, own part)");
  }
}

}  // namespace

void enqueue_collective(const NcclTarget& t, const WireOp& op) {
  const int type = nccl_dtype(op.dtype);
  const size_t elem_size = dtype_size(op.dtype);
  std::unique_ptr<PreMulSum> scaled;
  int reduction = kNcclSum;
  if (reduces(op.kind)) {
    reduction = nccl_op(op.op);
    if (op.prescale != 1.0 || op.postscale != 1.0) {
      scaled = std::make_unique<PreMulSum>(t, op.dtype, sum_factor(op.prescale, op.postscale, op.op, t.size));
      reduction = scaled->op();
    }
  }
  switch (op.kind) {
    case CollectiveKind::kAllreduce:
      t.api.check(t.api.ncclAllReduce(op.data, op.data, op.count, type, reduction, t.comm, t.stream), "ncclAllReduce");
      return;
    case CollectiveKind::kBroadcast:
      if (op.root < 0 || op.root >= t.size) {
        throw std::invalid_argument("broadcast root " + std::to_string(op.root) + " is no rank");
      }
      t.api.check(t.api.ncclBroadcast(op.data, op.data, op.count, type, op.root, t.comm, t.stream), "ncclBroadcast");
      return;
    case CollectiveKind::kAllgather: return allgather(t, op, type, elem_size);
    case CollectiveKind::kReducescatter: return reducescatter(t, op, type, reduction, elem_size);
    case CollectiveKind::kAlltoall: return alltoall(t, op, type, elem_size);
    case CollectiveKind::kBarrier: break;
  }
  throw std::invalid_argument(std::string("NCCL transport: ") + kind_name(op.kind) + " never goes on the wire");
}

std::string nccl_refusal(const Api& api, int version, const TensorSpec& spec) {
  const std::string prefix = "the nccl transport does not implement ";
  if (spec.kind == CollectiveKind::kBarrier) return {};  // the agreement is the barrier
  if (spec.dtype == DType::kInt16) return prefix + "int16 (NCCL has no such type)";
  if (spec.kind == CollectiveKind::kAlltoall && (api.ncclSend == nullptr || api.ncclRecv == nullptr)) {
    return prefix + "alltoall on NCCL " + version_text(version) +
           " (it needs ncclSend/ncclRecv, NCCL 2.7 or newer); upgrade NCCL (pip install -U nvidia-nccl-cu12)";
  }
  if (!reduces(spec.kind)) return {};
  if (spec.op == ReduceOp::kAverage && !dtype_is_floating(spec.dtype)) {
    return prefix + "op=\"average\" of integers (ncclAvg truncates where commsched floor-divides); use op=\"sum\" "
           "and divide";
  }
  if (spec.prescale == 1.0 && spec.postscale == 1.0) return {};
  if (spec.op != ReduceOp::kSum && spec.op != ReduceOp::kAverage) {
    return prefix + "prescale_factor / postscale_factor with op=\"" + op_name(spec.op) +
           "\" (NCCL scales sums only); scale the tensor before or after";
  }
  if (version < kNcclFirstVersionWithPreMulSum || api.ncclRedOpCreatePreMulSum == nullptr ||
      api.ncclRedOpDestroy == nullptr) {
    return prefix + "prescale_factor / postscale_factor on NCCL " + version_text(version) +
           " (they need ncclRedOpCreatePreMulSum, NCCL 2.11 or newer); upgrade NCCL (pip install -U "
           "nvidia-nccl-cu12) or scale the tensor before or after";
  }
  if (!dtype_is_floating(spec.dtype) && !integer_factor_fits(spec.prescale * spec.postscale, spec.dtype)) {
    return prefix + "prescale_factor / postscale_factor of " + dtype_name(spec.dtype) +
           " unless their product is a whole number the type holds (NCCL multiplies integers by an integer); "
           "scale the tensor before or after";
  }
  return {};
}

}  // namespace commsched::nccl
