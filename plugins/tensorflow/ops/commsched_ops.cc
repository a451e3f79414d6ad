// TensorFlow ops that hand a tensor to commsched's one runtime and finish when its
// collective is done. They are AsyncOpKernels, so no TensorFlow thread blocks while the
// bytes are on the wire: inside tf.function each gradient's reduction overlaps the rest
// of the backward pass. The runtime is reached through the C ABI table that the
// commsched/_core extension exports (core/c_api.h); this library never links the core.
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core_link.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace commsched_tf {

// A collective that failed on every rank (their submissions disagree, a rank refused it, or
// commsched stopped): FailedPrecondition, the status Horovod's ops give such a failure.
tensorflow::Status CollectiveFailed(const std::string& message) {
  return tensorflow::errors::FailedPrecondition("commsched: ", message);
}

using tensorflow::AsyncOpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

// In place: the result is the input's buffer (or a copy TensorFlow lets the op own).
struct InPlace {
  OpKernelContext* context;
  AsyncOpKernel::DoneCallback done;
  Tensor output;  // keeps the buffer alive while the collective writes into it
};

void FinishInPlace(void* raw, const commsched_result_t* /*result*/, const char* error) {
  std::unique_ptr<InPlace> pending(static_cast<InPlace*>(raw));
  if (error != nullptr) pending->context->SetStatus(CollectiveFailed(error));
  AsyncOpKernel::DoneCallback done = std::move(pending->done);
  pending.reset();
  done();
}

// The result is memory the core allocated: copied into outputs allocated once its size is known.
struct WithOutput {
  OpKernelContext* context;
  AsyncOpKernel::DoneCallback done;
  Tensor input;  // read by the core until the collective ends
  int kind;
  int rank;
  int size;
};

// Every dimension of `tensor` but the first (none for a scalar, which counts as one row).
TensorShape RowShape(const Tensor& tensor) {
  TensorShape row = tensor.shape();
  if (row.dims() > 0) row.RemoveDim(0);
  return row;
}

std::vector<uint64_t> Extents(const TensorShape& shape) {
  std::vector<uint64_t> extents;
  for (int i = 0; i < shape.dims(); ++i) extents.push_back(static_cast<uint64_t>(shape.dim_size(i)));
  return extents;
}

tensorflow::Status CopyResult(WithOutput& pending, const commsched_result_t& result) {
  OpKernelContext* context = pending.context;
  const TensorShape row = RowShape(pending.input);
  const uint64_t row_elements = static_cast<uint64_t>(row.num_elements());
  const auto rows_of = [row_elements](uint64_t elements) {
    return static_cast<int64_t>(row_elements == 0 ? 0 : elements / row_elements);
  };
  TensorShape shape({rows_of(result.elements)});
  shape.AppendShape(row);
  Tensor* output = nullptr;
  TF_RETURN_IF_ERROR(context->allocate_output(0, shape, &output));
  const size_t bytes = result.elements * tensorflow::DataTypeSize(pending.input.dtype());
  if (bytes != output->TotalBytes()) {
    return tensorflow::errors::Internal("commsched: result of ", bytes, " bytes for an output of ",
                                        output->TotalBytes());
  }
  if (bytes > 0) std::memcpy(output->data(), result.data, bytes);
  if (pending.kind == COMMSCHED_REDUCESCATTER) return tensorflow::OkStatus();
  // Rows per rank: contributed (allgather), or received from each rank (alltoall).
  Tensor* rows = nullptr;
  TF_RETURN_IF_ERROR(context->allocate_output(1, TensorShape({pending.size}), &rows));
  auto flat = rows->flat<int32_t>();
  for (int source = 0; source < pending.size; ++source) {
    const size_t at = pending.kind == COMMSCHED_ALLTOALL ? static_cast<size_t>(source) * pending.size + pending.rank
                                                         : static_cast<size_t>(source);
    if (at >= result.layout_size) return tensorflow::errors::Internal("commsched: short result layout");
    flat(source) = static_cast<int32_t>(rows_of(result.layout[at]));
  }
  return tensorflow::OkStatus();
}

void FinishWithOutput(void* raw, const commsched_result_t* result, const char* error) {
  std::unique_ptr<WithOutput> pending(static_cast<WithOutput*>(raw));
  if (error != nullptr) {
    pending->context->SetStatus(CollectiveFailed(error));
  } else if (result == nullptr) {
    pending->context->SetStatus(tensorflow::errors::Internal("commsched: the collective returned no result"));
  } else {
    pending->context->SetStatus(CopyResult(*pending, *result));
  }
  AsyncOpKernel::DoneCallback done = std::move(pending->done);
  pending.reset();
  done();
}

// Allreduce and broadcast: the output is the input's buffer when TensorFlow no longer needs
// the input, so most gradients are reduced without a copy.
class InPlaceOp : public CommschedKernel {
 public:
  InPlaceOp(OpKernelConstruction* construction, int kind) : CommschedKernel(construction), kind_(kind) {
    if (kind == COMMSCHED_ALLREDUCE) {
      float prescale = 1.0f;
      float postscale = 1.0f;
      OP_REQUIRES_OK(construction, construction->GetAttr("reduce_op", &op_));
      OP_REQUIRES_OK(construction, construction->GetAttr("prescale_factor", &prescale));
      OP_REQUIRES_OK(construction, construction->GetAttr("postscale_factor", &postscale));
      prescale_ = prescale;
      postscale_ = postscale;
      OP_REQUIRES(construction, op_ >= COMMSCHED_OP_SUM && op_ <= COMMSCHED_OP_PRODUCT,
                  tensorflow::errors::InvalidArgument("commsched: reduce_op ", op_,
                                                      " is not one of 0 (sum) to 4 (product)"));
    } else {
      OP_REQUIRES_OK(construction, construction->GetAttr("root_rank", &root_));
    }
    dtype_ = DTypeCode(construction->input_type(0), kind == COMMSCHED_ALLREDUCE);
    OP_REQUIRES(construction, dtype_ >= 0,
                tensorflow::errors::InvalidArgument("commsched: unsupported dtype for '", name_, "'"));
  }

  void ComputeAsync(OpKernelContext* context, DoneCallback done) override {
    const Tensor& input = context->input(0);
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(context, context->forward_input_or_allocate_output({0}, 0, input.shape(), &output),
                         done);
    if (output->data() != input.data() && input.TotalBytes() > 0) {
      std::memcpy(output->data(), input.data(), input.TotalBytes());
    }
    auto pending = std::make_unique<InPlace>(InPlace{context, std::move(done), *output});
    // The row shape travels with the request, so ranks whose tensors have the same size but not
    // the same shape fail together, as in Horovod.
    const std::vector<uint64_t> row_shape = Extents(RowShape(input));
    commsched_request_t request = Request(name_);
    request.row_shape = row_shape.data();
    request.row_rank = row_shape.size();
    request.data = output->data();
    request.count = static_cast<uint64_t>(output->NumElements());
    request.dtype = dtype_;
    request.kind = kind_;
    request.op = op_;
    request.root = root_;
    request.prescale = prescale_;
    request.postscale = postscale_;
    request.done = &FinishInPlace;
    request.context = pending.get();
    // The completion may run on commsched's thread before Submit even returns.
    InPlace* raw = pending.release();
    if (!Submit(context, &request, 1)) {
      std::unique_ptr<InPlace> failed(raw);  // refused: the core never calls FinishInPlace
      DoneCallback failed_done = std::move(failed->done);
      failed.reset();
      failed_done();
    }
  }

 private:
  int kind_;
  int op_ = COMMSCHED_OP_SUM;
  int root_ = 0;
  double prescale_ = 1.0;
  double postscale_ = 1.0;
  int dtype_ = -1;
};

class AllreduceOp : public InPlaceOp {
 public:
  explicit AllreduceOp(OpKernelConstruction* construction) : InPlaceOp(construction, COMMSCHED_ALLREDUCE) {}
};

class BroadcastOp : public InPlaceOp {
 public:
  explicit BroadcastOp(OpKernelConstruction* construction) : InPlaceOp(construction, COMMSCHED_BROADCAST) {}
};

// One TensorFlow op for several allreduces that every rank agrees on together: the op is done
// when the last member is, with the first failure as its status.
struct Group {
  OpKernelContext* context;
  AsyncOpKernel::DoneCallback done;
  std::vector<Tensor> outputs;
  std::atomic<size_t> remaining;
  std::mutex mutex;
  std::string first_error;
};

void FinishGroupMember(void* raw, const commsched_result_t* /*result*/, const char* error) {
  auto* group = static_cast<Group*>(raw);
  if (error != nullptr) {
    std::lock_guard<std::mutex> lock(group->mutex);
    if (group->first_error.empty()) group->first_error = error;
  }
  if (group->remaining.fetch_sub(1) != 1) return;
  std::unique_ptr<Group> last(group);
  if (!last->first_error.empty()) {
    last->context->SetStatus(CollectiveFailed(last->first_error));
  }
  AsyncOpKernel::DoneCallback done = std::move(last->done);
  last.reset();
  done();
}

class GroupedAllreduceOp : public CommschedKernel {
 public:
  explicit GroupedAllreduceOp(OpKernelConstruction* construction) : CommschedKernel(construction) {
    float prescale = 1.0f;
    float postscale = 1.0f;
    OP_REQUIRES_OK(construction, construction->GetAttr("reduce_op", &op_));
    OP_REQUIRES_OK(construction, construction->GetAttr("prescale_factor", &prescale));
    OP_REQUIRES_OK(construction, construction->GetAttr("postscale_factor", &postscale));
    prescale_ = prescale;
    postscale_ = postscale;
    OP_REQUIRES(construction, op_ >= COMMSCHED_OP_SUM && op_ <= COMMSCHED_OP_PRODUCT,
                tensorflow::errors::InvalidArgument("commsched: reduce_op ", op_,
                                                    " is not one of 0 (sum) to 4 (product)"));
    dtype_ = DTypeCode(construction->input_type(0), true);
    OP_REQUIRES(construction, dtype_ >= 0,
                tensorflow::errors::InvalidArgument("commsched: unsupported dtype for '", name_, "'"));
  }

  void ComputeAsync(OpKernelContext* context, DoneCallback done) override {
    const int members = context->num_inputs();
    if (members == 0) {
      done();
      return;
    }
    auto group = std::make_unique<Group>();
    group->context = context;
    std::vector<std::string> names;
    for (int i = 0; i < members; ++i) {
      const Tensor& input = context->input(i);
      Tensor* output = nullptr;
      OP_REQUIRES_OK_ASYNC(context, context->forward_input_or_allocate_output({i}, i, input.shape(), &output),
                           done);
      if (output->data() != input.data() && input.TotalBytes() > 0) {
        std::memcpy(output->data(), input.data(), input.TotalBytes());
      }
      group->outputs.push_back(*output);
      names.push_back(name_ + "." + std::to_string(i));
    }
    group->done = std::move(done);
    group->remaining = static_cast<size_t>(members);
    std::vector<commsched_request_t> requests;
    std::vector<std::vector<uint64_t>> row_shapes;
    for (int i = 0; i < members; ++i) row_shapes.push_back(Extents(RowShape(group->outputs[i])));
    for (int i = 0; i < members; ++i) {
      commsched_request_t request = Request(names[i]);
      request.row_shape = row_shapes[i].data();
      request.row_rank = row_shapes[i].size();
      request.data = group->outputs[i].data();
      request.count = static_cast<uint64_t>(group->outputs[i].NumElements());
      request.dtype = dtype_;
      request.kind = COMMSCHED_ALLREDUCE;
      request.op = op_;
      request.prescale = prescale_;
      request.postscale = postscale_;
      request.done = &FinishGroupMember;
      request.context = group.get();
      requests.push_back(request);
    }
    Group* raw = group.release();
    if (!Submit(context, requests.data(), requests.size())) {
      std::unique_ptr<Group> failed(raw);
      DoneCallback failed_done = std::move(failed->done);
      failed.reset();
      failed_done();
    }
  }

 private:
  int op_ = COMMSCHED_OP_SUM;
  double prescale_ = 1.0;
  double postscale_ = 1.0;
  int dtype_ = -1;
};

// Allgather, reducescatter and alltoall: outputs whose first dimension depends on every rank.
class OutputOp : public CommschedKernel {
 public:
  OutputOp(OpKernelConstruction* construction, int kind) : CommschedKernel(construction), kind_(kind) {
    if (kind == COMMSCHED_REDUCESCATTER) {
      float prescale = 1.0f;
      float postscale = 1.0f;
      OP_REQUIRES_OK(construction, construction->GetAttr("reduce_op", &op_));
      OP_REQUIRES_OK(construction, construction->GetAttr("prescale_factor", &prescale));
      OP_REQUIRES_OK(construction, construction->GetAttr("postscale_factor", &postscale));
      prescale_ = prescale;
      postscale_ = postscale;
      OP_REQUIRES(construction, op_ == COMMSCHED_OP_SUM || op_ == COMMSCHED_OP_AVERAGE,
                  tensorflow::errors::InvalidArgument("commsched: reducescatter takes reduce_op 0 (sum) or 1 "
                                                      "(average), not ",
                                                      op_));
    }
    dtype_ = DTypeCode(construction->input_type(0), kind == COMMSCHED_REDUCESCATTER);
    OP_REQUIRES(construction, dtype_ >= 0,
                tensorflow::errors::InvalidArgument("commsched: unsupported dtype for '", name_, "'"));
  }

  void ComputeAsync(OpKernelContext* context, DoneCallback done) override {
    const Tensor& input = context->input(0);
    const int size = Size();
    const TensorShape row = RowShape(input);
    const std::vector<uint64_t> row_shape = Extents(row);
    const int64_t rows = input.dims() > 0 ? input.dim_size(0) : 1;
    std::vector<uint64_t> splits;
    // A rank outside the op's set (rank -1) skips the check: the core refuses its submission alone.
    if (kind_ == COMMSCHED_ALLTOALL && Rank() >= 0) {
      std::string problem = AlltoallSplits(context->input(1), rows, size, &splits);
      if (!problem.empty()) {
        Refuse(context, "alltoall of '" + name_ + "': " + problem);
        done();
        return;
      }
    }
    auto pending = std::make_unique<WithOutput>(WithOutput{context, std::move(done), input, kind_, Rank(), size});
    commsched_request_t request = Request(name_);
    request.data = const_cast<char*>(input.tensor_data().data());
    request.count = static_cast<uint64_t>(input.NumElements());
    request.dtype = dtype_;
    request.kind = kind_;
    request.op = op_;
    request.prescale = prescale_;
    request.postscale = postscale_;
    request.row_shape = row_shape.data();
    request.row_rank = row_shape.size();
    request.splits = splits.data();
    request.num_splits = splits.size();
    request.done = &FinishWithOutput;
    request.context = pending.get();
    WithOutput* raw = pending.release();
    if (!Submit(context, &request, 1)) {
      std::unique_ptr<WithOutput> failed(raw);
      DoneCallback failed_done = std::move(failed->done);
      failed.reset();
      failed_done();
    }
  }

 private:
  // Rows to send to each rank: `given` (int32, one per rank), or equal parts when it is empty.
  static std::string AlltoallSplits(const Tensor& given, int64_t rows, int size, std::vector<uint64_t>* splits) {
    if (given.NumElements() == 0) {
      if (size <= 0 || rows % size != 0) {
        return std::to_string(rows) + " rows do not split equally over " + std::to_string(size) +
               " ranks; pass splits=";
      }
      splits->assign(static_cast<size_t>(size), static_cast<uint64_t>(rows / size));
      return {};
    }
    const auto values = given.flat<int32_t>();
    for (int64_t i = 0; i < values.size(); ++i) {
      if (values(i) < 0) return "splits must not be negative (split " + std::to_string(values(i)) + ")";
      splits->push_back(static_cast<uint64_t>(values(i)));
    }
    return {};
  }

  int kind_;
  int op_ = COMMSCHED_OP_SUM;
  double prescale_ = 1.0;
  double postscale_ = 1.0;
  int dtype_ = -1;
};

class AllgatherOp : public OutputOp {
 public:
  explicit AllgatherOp(OpKernelConstruction* construction) : OutputOp(construction, COMMSCHED_ALLGATHER) {}
};

class ReducescatterOp : public OutputOp {
 public:
  explicit ReducescatterOp(OpKernelConstruction* construction) : OutputOp(construction, COMMSCHED_REDUCESCATTER) {}
};

class AlltoallOp : public OutputOp {
 public:
  explicit AlltoallOp(OpKernelConstruction* construction) : OutputOp(construction, COMMSCHED_ALLTOALL) {}
};

struct BarrierWait {
  OpKernelContext* context;
  AsyncOpKernel::DoneCallback done;
};

void FinishBarrier(void* raw, const commsched_result_t* /*result*/, const char* error) {
  std::unique_ptr<BarrierWait> pending(static_cast<BarrierWait*>(raw));
  if (error != nullptr) pending->context->SetStatus(CollectiveFailed(error));
  AsyncOpKernel::DoneCallback done = std::move(pending->done);
  pending.reset();
  done();
}

class BarrierOp : public CommschedKernel {
 public:
  explicit BarrierOp(OpKernelConstruction* construction) : CommschedKernel(construction) {}

  void ComputeAsync(OpKernelContext* context, DoneCallback done) override {
    auto pending = std::make_unique<BarrierWait>(BarrierWait{context, std::move(done)});
    commsched_request_t request = Request(name_);
    request.dtype = COMMSCHED_UINT8;
    request.kind = COMMSCHED_BARRIER;
    request.done = &FinishBarrier;
    request.context = pending.get();
    BarrierWait* raw = pending.release();
    if (!Submit(context, &request, 1)) {
      std::unique_ptr<BarrierWait> failed(raw);
      DoneCallback failed_done = std::move(failed->done);
      failed.reset();
      failed_done();
    }
  }
};

using tensorflow::DEVICE_CPU;
REGISTER_KERNEL_BUILDER(Name("CommschedAllreduce").Device(DEVICE_CPU), AllreduceOp);
REGISTER_KERNEL_BUILDER(Name("CommschedGroupedAllreduce").Device(DEVICE_CPU), GroupedAllreduceOp);
REGISTER_KERNEL_BUILDER(Name("CommschedBroadcast").Device(DEVICE_CPU), BroadcastOp);
REGISTER_KERNEL_BUILDER(Name("CommschedAllgather").Device(DEVICE_CPU), AllgatherOp);
REGISTER_KERNEL_BUILDER(Name("CommschedReducescatter").Device(DEVICE_CPU), ReducescatterOp);
REGISTER_KERNEL_BUILDER(Name("CommschedAlltoall").Device(DEVICE_CPU), AlltoallOp);
REGISTER_KERNEL_BUILDER(Name("CommschedBarrier").Device(DEVICE_CPU), BarrierOp);

}  // namespace commsched_tf
