// How a TensorFlow kernel reaches commsched's runtime: the C ABI table looked up in the already
// loaded core extension, TensorFlow dtypes as commsched dtype codes, and the base kernel that
// reads the attributes every commsched op has.
#ifndef COMMSCHED_TF_CORE_LINK_H_
#define COMMSCHED_TF_CORE_LINK_H_

#include <dlfcn.h>

#include <memory>
#include <string>

#include "core/c_api.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace commsched_tf {

// The commsched dtype code for `type`, or -1. `reduces` false (the bytes only move) also takes
// uint16, carried as int16, whose bits travel unchanged.
inline int DTypeCode(tensorflow::DataType type, bool reduces) {
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
    case tensorflow::DT_INT16:
      return COMMSCHED_INT16;
    case tensorflow::DT_BOOL:
      return COMMSCHED_BOOL;
    case tensorflow::DT_UINT16:
      return reduces ? -1 : COMMSCHED_INT16;
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

// The attributes and core link every commsched kernel shares.
class CommschedKernel : public tensorflow::AsyncOpKernel {
 public:
  explicit CommschedKernel(tensorflow::OpKernelConstruction* construction) : AsyncOpKernel(construction) {
    std::string library;
    OP_REQUIRES_OK(construction, construction->GetAttr("tensor_name", &name_));
    OP_REQUIRES_OK(construction, construction->GetAttr("priority", &priority_));
    OP_REQUIRES_OK(construction, construction->GetAttr("process_set_id", &process_set_id_));
    OP_REQUIRES_OK(construction, construction->GetAttr("core_library", &library));
    // RTLD_NOLOAD: Python imported commsched._core already; a second copy of the core
    // would be a second runtime, so refuse to load one.
    library_.reset(dlopen(library.c_str(), RTLD_NOW | RTLD_NOLOAD));
    OP_REQUIRES(construction, library_ != nullptr,
                tensorflow::errors::FailedPrecondition("commsched: the core extension ", library,
                                                       " is not loaded in this process; import commsched first"));
    api_ = static_cast<const commsched_api_v2_t*>(dlsym(library_.get(), "commsched_api_v2"));
    OP_REQUIRES(construction, api_ != nullptr && api_->version == 2,
                tensorflow::errors::FailedPrecondition(
                    "commsched: ", library,
                    " does not export the C ABI commsched_api_v2; rebuild commsched (python setup.py build_ext)"));
  }

 protected:
  // A request with this op's name, priority and process set; the rest is the caller's.
  commsched_request_t Request(const std::string& name) const {
    commsched_request_t request{};
    request.name = name.c_str();
    request.priority = priority_;
    request.process_set_id = static_cast<int32_t>(process_set_id_);
    request.prescale = 1.0;
    request.postscale = 1.0;
    return request;
  }

  // Submits; false, with the status set, when the core refused (it then calls no callback, so
  // the caller still owns what it gave as contexts and must call TensorFlow's done itself).
  bool Submit(tensorflow::OpKernelContext* context, const commsched_request_t* requests, size_t count) const {
    char error[1024] = {0};
    if (api_->submit(requests, count, error, sizeof(error)) == 0) return true;
    context->SetStatus(tensorflow::errors::FailedPrecondition("commsched: ", error));
    return false;
  }

  // Refuses this op's collective on every rank (for input this rank cannot submit) and sets the
  // status here; the caller then calls TensorFlow's done.
  void Refuse(tensorflow::OpKernelContext* context, const std::string& reason) const {
    api_->refuse_on_set(name_.c_str(), reason.c_str(), static_cast<int32_t>(process_set_id_));
    context->SetStatus(tensorflow::errors::InvalidArgument("commsched: ", reason));
  }

  // The number of ranks in this op's process set, and this rank's position in it (-1: not a member).
  int Size() const { return api_->process_set_size(static_cast<int32_t>(process_set_id_)); }
  int Rank() const { return api_->process_set_rank(static_cast<int32_t>(process_set_id_)); }

  std::string name_;
  int priority_ = 0;
  int64_t process_set_id_ = 0;

 private:
  LibraryHandle library_;
  const commsched_api_v2_t* api_ = nullptr;
};

}  // namespace commsched_tf

#endif  // COMMSCHED_TF_CORE_LINK_H_
