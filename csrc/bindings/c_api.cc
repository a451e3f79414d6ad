// The C ABI table (csrc/core/c_api.h) over the process's one runtime.
#include "core/c_api.h"

#include <cstdio>
#include <cstring>

#include "bindings/runtime_slot.h"

namespace {

using namespace commsched;

void copy_error(const std::string& message, char* error, size_t error_size) {
  if (error == nullptr || error_size == 0) return;
  std::snprintf(error, error_size, "%s", message.c_str());
}

int submit(const char* name, void* data, uint64_t count, int dtype, int op, int kind, int root, int priority,
           commsched_done_fn done, void* context, char* error, size_t error_size) {
  try {
    if (name == nullptr || *name == '\0') throw UsageError("a tensor name is required");
    if (dtype < 0 || dtype >= kNumDTypes) throw UsageError("unknown dtype code " + std::to_string(dtype));
    if (op < 0 || op > 1 || kind < 0 || kind > 1) throw UsageError("unknown op or kind code");
    TensorSpec spec;
    spec.name = name;
    spec.dtype = static_cast<DType>(dtype);
    spec.op = static_cast<ReduceOp>(op);
    spec.kind = static_cast<CollectiveKind>(kind);
    spec.root = root;
    spec.count = count;
    spec.priority = priority;
    auto handle = runtime_slot().require("allreduce")->enqueue(spec, data);
    handle->on_done([done, context](const std::string& message) {
      if (done != nullptr) done(context, message.empty() ? nullptr : message.c_str());
    });
    return 0;
  } catch (const std::exception& failure) {
    copy_error(failure.what(), error, error_size);
    return -1;
  }
}

int rank() {
  auto runtime = runtime_slot().get();
  return runtime ? runtime->rank() : -1;
}

int size() {
  auto runtime = runtime_slot().get();
  return runtime ? runtime->size() : -1;
}

int running() {
  auto runtime = runtime_slot().get();
  return runtime && runtime->running() ? 1 : 0;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const commsched_api_v1_t commsched_api_v1 = {1, &submit, &rank,
                                                                                                &size, &running};
