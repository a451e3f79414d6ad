// TensorFlow ops that hand a tensor to commsched's one runtime and finish when its
// collective is done. They are AsyncOpKernels, so no TensorFlow thread blocks while the
// bytes are on the wire: inside tf.function each gradient's reduction overlaps the rest
// of the backward pass. The runtime is reached through the C ABI table that the
// commsched/_core extension exports (core/c_api.h); this library never links the core.
#include <dlfcn.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "core/c_api.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace commsched_tf {

using tensorflow::AsyncOpKernel;
using tensorflow::DataType;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

constexpr char kTypes[] = "T: {half, bfloat16, float, double, int32, int64, uint8, int8}";

int DTypeCode(DataType type) {
  switch (type) {
    case tensorflow::DT_HALF:
      return COMMSCHED_FLOAT16;
    case tensorflow::DT_BFLOAT16:
      return COMMSCHED_BFLOAT16;
    case tensorflow::DT_FLOAT:
      return COMMSCHED_FLOAT32;
    case tensorflow::DT_DOUBLE:
      return COMMSCHED_FLOAT64;
    case tensorflow::DT_INT32:
      return COMMSCHED_INT32;
    case tensorflow::DT_INT64:
      return COMMSCHED_INT64;
    case tensorflow::DT_UINT8:
      return COMMSCHED_UINT8;
    case tensorflow::DT_INT8:
      return COMMSCHED_INT8;
    default:
      return -1;
  }
}

// dlclose for the handle that dlopen(RTLD_NOLOAD) counted up.
struct LibraryCloser {
  void operator()(void* handle) const {
    if (handle != nullptr) dlclose(handle);
  }
};
using LibraryHandle = std::unique_ptr<void, LibraryCloser>;

// What the completion callback needs: the context to report on, TensorFlow's done, and a
// reference to the output so its buffer outlives the collective writing into it.
struct Pending {
  OpKernelContext* context;
  AsyncOpKernel::DoneCallback done;
  Tensor output;
};

void Finish(void* raw, const char* error) {
  std::unique_ptr<Pending> pending(static_cast<Pending*>(raw));
  if (error != nullptr) {
    pending->context->SetStatus(tensorflow::errors::Internal("commsched: ", error));
  }
  AsyncOpKernel::DoneCallback done = std::move(pending->done);
  pending.reset();
  done();
}

class CollectiveOp : public AsyncOpKernel {
 public:
  CollectiveOp(OpKernelConstruction* construction, int kind) : AsyncOpKernel(construction), kind_(kind) {
    std::string library;
    OP_REQUIRES_OK(construction, construction->GetAttr("tensor_name", &name_));
    OP_REQUIRES_OK(construction, construction->GetAttr("priority", &priority_));
    OP_REQUIRES_OK(construction, construction->GetAttr("core_library", &library));
    if (kind == COMMSCHED_ALLREDUCE) {
      OP_REQUIRES_OK(construction, construction->GetAttr("reduce_op", &op_));
    } else {
      OP_REQUIRES_OK(construction, construction->GetAttr("root_rank", &root_));
    }
    OP_REQUIRES(construction, op_ == COMMSCHED_OP_SUM || op_ == COMMSCHED_OP_AVERAGE,
                tensorflow::errors::InvalidArgument("commsched: reduce_op must be 0 (sum) or 1 (average)"));
    dtype_ = DTypeCode(construction->input_type(0));
    OP_REQUIRES(construction, dtype_ >= 0,
                tensorflow::errors::InvalidArgument("commsched: unsupported dtype for '", name_, "'"));
    // RTLD_NOLOAD: Python imported commsched._core already; a second copy of the core
    // would be a second runtime, so refuse to load one.
    library_.reset(dlopen(library.c_str(), RTLD_NOW | RTLD_NOLOAD));
    OP_REQUIRES(construction, library_ != nullptr,
                tensorflow::errors::FailedPrecondition("commsched: the core extension ", library,
                                                       " is not loaded in this process; import commsched first"));
    api_ = static_cast<const commsched_api_v1_t*>(dlsym(library_.get(), "commsched_api_v1"));
    OP_REQUIRES(construction, api_ != nullptr && api_->version == 1,
                tensorflow::errors::FailedPrecondition("commsched: ", library,
                                                       " does not export the C ABI commsched_api_v1"));
  }

  void ComputeAsync(OpKernelContext* context, DoneCallback done) override {
    const Tensor& input = context->input(0);
    Tensor* output = nullptr;
    // Reuses the input buffer when TensorFlow no longer needs it, so most gradients are
    // reduced without a copy.
    OP_REQUIRES_OK_ASYNC(context, context->forward_input_or_allocate_output({0}, 0, input.shape(), &output),
                         done);
    if (output->data() != input.data() && input.TotalBytes() > 0) {
      std::memcpy(output->data(), input.data(), input.TotalBytes());
    }
    auto pending = std::make_unique<Pending>(Pending{context, std::move(done), *output});
    void* data = output->data();
    const auto count = static_cast<uint64_t>(output->NumElements());
    char error[1024] = {0};
    // Ownership passes to the core before submit: the completion may run on commsched's
    // thread before submit even returns.
    Pending* raw = pending.release();
    const int status = api_->submit(name_.c_str(), data, count, dtype_, op_, kind_, root_, priority_, &Finish, raw,
                                    error, sizeof(error));
    if (status != 0) {
      std::unique_ptr<Pending> failed(raw);  // on failure the core never calls Finish
      context->SetStatus(tensorflow::errors::FailedPrecondition("commsched: ", error));
      DoneCallback failed_done = std::move(failed->done);
      failed.reset();
      failed_done();
    }
  }

 private:
  int kind_;
  std::string name_;
  int priority_ = 0;
  int op_ = COMMSCHED_OP_SUM;
  int root_ = 0;
  int dtype_ = -1;
  LibraryHandle library_;
  const commsched_api_v1_t* api_ = nullptr;
};

class AllreduceOp : public CollectiveOp {
 public:
  explicit AllreduceOp(OpKernelConstruction* construction) : CollectiveOp(construction, COMMSCHED_ALLREDUCE) {}
};

class BroadcastOp : public CollectiveOp {
 public:
  explicit BroadcastOp(OpKernelConstruction* construction) : CollectiveOp(construction, COMMSCHED_BROADCAST) {}
};

// Not stateful on purpose: TensorFlow chains stateful ops of a tf.function in program
// order (automatic control dependencies), which would serialise the reductions and
// undo the overlap. Distinct tensor names keep the ops from being merged.
REGISTER_OP("CommschedAllreduce")
    .Attr(kTypes)
    .Attr("tensor_name: string")
    .Attr("reduce_op: int = 0")
    .Attr("priority: int = 0")
    .Attr("core_library: string")
    .Input("tensor: T")
    .Output("reduced: T")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    });

REGISTER_OP("CommschedBroadcast")
    .Attr(kTypes)
    .Attr("tensor_name: string")
    .Attr("root_rank: int = 0")
    .Attr("priority: int = 0")
    .Attr("core_library: string")
    .Input("tensor: T")
    .Output("broadcast: T")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("CommschedAllreduce").Device(tensorflow::DEVICE_CPU), AllreduceOp);
REGISTER_KERNEL_BUILDER(Name("CommschedBroadcast").Device(tensorflow::DEVICE_CPU), BroadcastOp);

}  // namespace commsched_tf
