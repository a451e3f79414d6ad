// The signatures of commsched's TensorFlow ops (their kernels are in commsched_ops.cc). Every op
// takes `tensor_name` (the collective's name, the same on every rank), `priority` (smaller goes
// sooner), `process_set_id` (0: every rank) and `core_library` (the loaded core extension).
//
// The collectives are not stateful on purpose: TensorFlow chains stateful ops of a tf.function
// in program order (automatic control dependencies), which would serialise the reductions and
// undo the overlap. Distinct tensor names keep the ops from being merged. Only the barrier,
// which has no output to depend on, is stateful, so it runs where the program puts it.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace commsched_tf {

using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

#define COMMSCHED_COMMON_ATTRS                 \
  Attr("tensor_name: string")                  \
      .Attr("priority: int = 0")               \
      .Attr("process_set_id: int = 0")         \
      .Attr("core_library: string")

// Reductions: bool reduces with min/max/product (logical and/or) only, which the core checks.
constexpr char kReducedTypes[] = "T: {half, bfloat16, float, double, int32, int64, uint8, int8, int16, bool}";
// Moved unchanged: uint16 travels as int16.
constexpr char kMovedTypes[] =
    "T: {half, bfloat16, float, double, int32, int64, uint8, int8, uint16, int16, bool}";

tensorflow::Status SameShape(InferenceContext* c) {
  c->set_output(0, c->input(0));
  return absl::OkStatus();
}

// The input's shape with an unknown first dimension (a scalar counts as one row).
tensorflow::Status RowsUnknown(InferenceContext* c) {
  ShapeHandle input = c->input(0);
  if (!c->RankKnown(input)) {
    c->set_output(0, c->UnknownShape());
    return absl::OkStatus();
  }
  if (c->Rank(input) == 0) {
    c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
    return absl::OkStatus();
  }
  ShapeHandle output;
  TF_RETURN_IF_ERROR(c->ReplaceDim(input, 0, c->UnknownDim(), &output));
  c->set_output(0, output);
  return absl::OkStatus();
}

// The rows-per-rank output: one count per rank.
tensorflow::Status RowsUnknownAndCounts(InferenceContext* c) {
  TF_RETURN_IF_ERROR(RowsUnknown(c));
  c->set_output(1, c->Vector(InferenceContext::kUnknownDim));
  return absl::OkStatus();
}

REGISTER_OP("CommschedAllreduce")
    .Attr(kReducedTypes)
    .Attr("reduce_op: int = 0")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .COMMSCHED_COMMON_ATTRS
    .Input("tensor: T")
    .Output("reduced: T")
    .SetShapeFn(SameShape);

REGISTER_OP("CommschedGroupedAllreduce")
    .Attr(kReducedTypes)
    .Attr("num_tensors: int >= 1")
    .Attr("reduce_op: int = 0")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .COMMSCHED_COMMON_ATTRS
    .Input("tensors: num_tensors * T")
    .Output("reduced: num_tensors * T")
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return absl::OkStatus();
    });

REGISTER_OP("CommschedBroadcast")
    .Attr(kMovedTypes)
    .Attr("root_rank: int = 0")
    .COMMSCHED_COMMON_ATTRS
    .Input("tensor: T")
    .Output("broadcast: T")
    .SetShapeFn(SameShape);

// `rows`: the first dimension each rank contributed, by rank (what the gradient splits by).
REGISTER_OP("CommschedAllgather")
    .Attr(kMovedTypes)
    .COMMSCHED_COMMON_ATTRS
    .Input("tensor: T")
    .Output("gathered: T")
    .Output("rows: int32")
    .SetShapeFn(RowsUnknownAndCounts);

REGISTER_OP("CommschedReducescatter")
    .Attr(kReducedTypes)
    .Attr("reduce_op: int = 1")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .COMMSCHED_COMMON_ATTRS
    .Input("tensor: T")
    .Output("part: T")
    .SetShapeFn(RowsUnknown);

// `splits`: rows to send to each rank (empty: equal parts); `received_splits`: rows received
// from each rank.
REGISTER_OP("CommschedAlltoall")
    .Attr(kMovedTypes)
    .COMMSCHED_COMMON_ATTRS
    .Input("tensor: T")
    .Input("splits: int32")
    .Output("received: T")
    .Output("received_splits: int32")
    .SetShapeFn(RowsUnknownAndCounts);

REGISTER_OP("CommschedBarrier").COMMSCHED_COMMON_ATTRS.SetIsStateful().SetShapeFn(
    tensorflow::shape_inference::NoOutputs);

}  // namespace commsched_tf
