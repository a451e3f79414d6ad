// The C ABI tables (commsched/include/core/c_api.h) over the process's one runtime.
#include "core/c_api.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bindings/runtime_slot.h"

namespace {

using namespace commsched;

void copy_error(const std::string& message, char* error, size_t error_size) {
  if (error == nullptr || error_size == 0) return;
  std::snprintf(error, error_size, "%s", message.c_str());
}

// Version 1: in-place sum/average allreduce and broadcast.
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

// Why `request` cannot be submitted, or empty. Checked before the core sees it, so the caller
// tells every rank of the refusal (Runtime::refuse) instead of leaving them waiting.
std::string request_problem(const commsched_request_t& request) {
  if (request.dtype < 0 || request.dtype >= kNumDTypes) return "unknown dtype code " + std::to_string(request.dtype);
  if (request.op < 0 || request.op >= kNumReduceOps) return "unknown reduce op code " + std::to_string(request.op);
  if (request.kind < 0 || request.kind >= kNumKinds) return "unknown collective kind code " + std::to_string(request.kind);
  if (request.count > 0 && request.data == nullptr) return "data is NULL for " + std::to_string(request.count) + " elements";
  if (request.row_rank > 0 && request.row_shape == nullptr) return "row_shape is NULL for a row of rank " + std::to_string(request.row_rank);
  if (request.num_splits > 0 && request.splits == nullptr) return "splits is NULL for " + std::to_string(request.num_splits) + " ranks";
  if (request.done == nullptr) return "no done callback";
  return {};
}

// The name the core agrees a collective under: each process set has its own names, as in
// Horovod (the same prefix the Python API gives).
std::string qualified_name(const std::string& name, int32_t process_set) {
  if (process_set == 0) return name;
  const std::string prefix = "process_set." + std::to_string(process_set) + "/";
  return name.rfind(prefix, 0) == 0 ? name : prefix + name;
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) text += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  return text;
}

// Refuses a collective on a set this rank is not in (or one never registered) here alone, with the
// message the Python API gives: no member waits for this rank, so no other rank is told.
void require_member(const Runtime& runtime, int32_t process_set) {
  if (process_set == 0) return;
  const std::vector<int> ranks = runtime.process_set_ranks(process_set);  // throws for an unknown set
  if (!std::binary_search(ranks.begin(), ranks.end(), runtime.rank())) {
    throw UsageError("rank " + std::to_string(runtime.rank()) + " is not a member of ProcessSet(process_set_id=" +
                     std::to_string(process_set) + ", ranks=[" + ranks_text(ranks) +
                     "]); only its ranks may call collectives on it");
  }
}

TensorSpec spec_of(const commsched_request_t& request) {
  TensorSpec spec;
  spec.name = qualified_name(request.name, request.process_set_id);
  spec.process_set = request.process_set_id;
  spec.dtype = static_cast<DType>(request.dtype);
  spec.op = static_cast<ReduceOp>(request.op);
  spec.kind = static_cast<CollectiveKind>(request.kind);
  spec.root = request.root;
  spec.count = request.count;
  spec.priority = request.priority;
  spec.prescale = request.prescale;
  spec.postscale = request.postscale;
  spec.row_shape.assign(request.row_shape, request.row_shape + request.row_rank);
  spec.splits.assign(request.splits, request.splits + request.num_splits);
  return spec;
}

// Hands the handle's output (if any) to the request's callback. The callback is stored in the
// handle and runs while the handle lives, so the raw pointer stays valid for the call.
void report_when_done(HandleState* handle, commsched_result_fn done, void* context) {
  handle->on_done([handle, done, context](const std::string& message) {
    if (!message.empty()) {
      done(context, nullptr, message.c_str());
      return;
    }
    const auto& output = handle->output();
    if (!output) {
      done(context, nullptr, nullptr);
      return;
    }
    const commsched_result_t result{output->data(), handle->output_elements(), handle->layout().data(),
                                    handle->layout().size()};
    done(context, &result, nullptr);
  });
}

// Version 2: any collective, alone or as a group of allreduces.
int submit_requests(const commsched_request_t* requests, size_t count, char* error, size_t error_size) {
  try {
    if (requests == nullptr || count == 0) throw UsageError("no requests to submit");
    const auto runtime = runtime_slot().require(kind_name(static_cast<CollectiveKind>(
        requests[0].kind >= 0 && requests[0].kind < kNumKinds ? requests[0].kind : 0)));
    std::vector<Runtime::GroupMember> members(count);
    std::string problem;
    for (size_t i = 0; i < count; ++i) {
      const commsched_request_t& request = requests[i];
      if (request.name == nullptr || *request.name == '\0') throw UsageError("a tensor name is required");
      require_member(*runtime, request.process_set_id);
      problem = request_problem(request);
      if (problem.empty() && count > 1 && request.kind != COMMSCHED_ALLREDUCE) {
        problem = "only allreduces are submitted as a group";
      }
      if (!problem.empty()) {
        problem = "tensor '" + std::string(request.name) + "': " + problem;
        break;
      }
      members[i].spec = spec_of(request);
      members[i].data = request.data;
    }
    if (!problem.empty()) {
      for (size_t i = 0; i < count; ++i) {
        const commsched_request_t& request = requests[i];
        if (request.name != nullptr && *request.name != '\0') {
          runtime->refuse(qualified_name(request.name, request.process_set_id), problem, request.process_set_id);
        }
      }
      throw UsageError(problem);
    }
    const auto handles = runtime->enqueue_group(members);
    for (size_t i = 0; i < count; ++i) report_when_done(handles[i].get(), requests[i].done, requests[i].context);
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

void refuse(const char* name, const char* reason) {
  auto runtime = runtime_slot().get();
  if (runtime && name != nullptr && reason != nullptr) runtime->refuse(name, reason);
}

int process_set_rank(int32_t process_set) {
  auto runtime = runtime_slot().get();
  if (!runtime) return -1;
  try {
    const std::vector<int> ranks = runtime->process_set_ranks(process_set);
    const auto found = std::lower_bound(ranks.begin(), ranks.end(), runtime->rank());
    return found != ranks.end() && *found == runtime->rank() ? static_cast<int>(found - ranks.begin()) : -1;
  } catch (const std::exception&) {
    return -1;
  }
}

int process_set_size(int32_t process_set) {
  auto runtime = runtime_slot().get();
  if (!runtime) return -1;
  try {
    return static_cast<int>(runtime->process_set_ranks(process_set).size());
  } catch (const std::exception&) {
    return -1;
  }
}

void refuse_on_set(const char* name, const char* reason, int32_t process_set) {
  auto runtime = runtime_slot().get();
  if (runtime && name != nullptr && reason != nullptr) {
    runtime->refuse(qualified_name(name, process_set), reason, process_set);
  }
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const commsched_api_v1_t commsched_api_v1 = {1, &submit, &rank,
                                                                                                &size, &running};
extern "C" __attribute__((visibility("default"))) const commsched_api_v2_t commsched_api_v2 = {
    2, &submit_requests, &rank, &size, &running, &refuse, &process_set_rank, &process_set_size, &refuse_on_set};
