#include "transport/nccl/nccl_loader.h"

#include <dlfcn.h>

#include <stdexcept>

namespace commsched::nccl {

std::shared_ptr<SharedLibrary> SharedLibrary::open_first(const std::vector<std::string>& candidates,
                                                         const std::string& what) {
  std::string tried;
  for (const std::string& candidate : candidates) {
    // RTLD_LOCAL keeps NCCL's symbols away from a framework's own copy in the same process.
    void* handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) return std::make_shared<SharedLibrary>(handle, candidate);
    const char* reason = dlerror();
    tried += "\n  " + candidate + ": " + (reason != nullptr ? reason : "not found");
  }
  throw std::runtime_error("cannot load " + what + "; tried:" + tried);
}

SharedLibrary::~SharedLibrary() { dlclose(handle_); }

void* SharedLibrary::find(const char* name) const { return dlsym(handle_, name); }

void* SharedLibrary::symbol(const char* name) const {
  void* found = find(name);
  if (found == nullptr) throw std::runtime_error(path_ + " has no symbol " + name + " (too old?)");
  return found;
}

namespace {

template <typename Function>
void bind(const SharedLibrary& library, Function& slot, const char* name) {
  slot = reinterpret_cast<Function>(library.symbol(name));
}

// Entry points newer than the oldest NCCL the transport runs on: left null when missing, and
// the collectives that need them are refused at submit.
template <typename Function>
void bind_if_present(const SharedLibrary& library, Function& slot, const char* name) {
  slot = reinterpret_cast<Function>(library.find(name));
}

}  // namespace

Api Api::load_cuda(const std::vector<std::string>& cuda_candidates) {
  Api api;
  api.cuda_library = SharedLibrary::open_first(cuda_candidates, "the CUDA runtime (libcudart)");
  const SharedLibrary& c = *api.cuda_library;
  bind(c, api.cudaGetDeviceCount, "cudaGetDeviceCount");
  bind(c, api.cudaSetDevice, "cudaSetDevice");
  bind(c, api.cudaGetDevice, "cudaGetDevice");
  bind(c, api.cudaStreamCreateWithFlags, "cudaStreamCreateWithFlags");
  bind(c, api.cudaStreamDestroy, "cudaStreamDestroy");
  bind(c, api.cudaStreamWaitEvent, "cudaStreamWaitEvent");
  bind(c, api.cudaStreamSynchronize, "cudaStreamSynchronize");
  bind(c, api.cudaMemcpyAsync, "cudaMemcpyAsync");
  bind(c, api.cudaMemcpy, "cudaMemcpy");
  bind(c, api.cudaMalloc, "cudaMalloc");
  bind(c, api.cudaFree, "cudaFree");
  bind(c, api.cudaEventCreateWithFlags, "cudaEventCreateWithFlags");
  bind(c, api.cudaEventRecord, "cudaEventRecord");
  bind(c, api.cudaEventQuery, "cudaEventQuery");
  bind(c, api.cudaEventSynchronize, "cudaEventSynchronize");
  bind(c, api.cudaEventDestroy, "cudaEventDestroy");
  bind(c, api.cudaGetErrorString, "cudaGetErrorString");
  return api;
}

Api Api::load(const std::vector<std::string>& nccl_candidates, const std::vector<std::string>& cuda_candidates) {
  // The CUDA runtime first: NCCL needs it loaded, and a missing runtime is the likelier problem.
  Api api = load_cuda(cuda_candidates);
  api.nccl_library = SharedLibrary::open_first(nccl_candidates, "NCCL (libnccl)");
  const SharedLibrary& n = *api.nccl_library;
  bind(n, api.ncclGetVersion, "ncclGetVersion");
  bind(n, api.ncclGetUniqueId, "ncclGetUniqueId");
  bind(n, api.ncclCommInitRank, "ncclCommInitRank");
  bind(n, api.ncclCommDestroy, "ncclCommDestroy");
  bind(n, api.ncclCommAbort, "ncclCommAbort");
  bind(n, api.ncclCommGetAsyncError, "ncclCommGetAsyncError");
  bind(n, api.ncclAllReduce, "ncclAllReduce");
  bind(n, api.ncclBroadcast, "ncclBroadcast");
  bind(n, api.ncclReduce, "ncclReduce");
  bind(n, api.ncclAllGather, "ncclAllGather");
  bind(n, api.ncclReduceScatter, "ncclReduceScatter");
  bind(n, api.ncclGroupStart, "ncclGroupStart");
  bind(n, api.ncclGroupEnd, "ncclGroupEnd");
  bind_if_present(n, api.ncclSend, "ncclSend");
  bind_if_present(n, api.ncclRecv, "ncclRecv");
  bind_if_present(n, api.ncclRedOpCreatePreMulSum, "ncclRedOpCreatePreMulSum");
  bind_if_present(n, api.ncclRedOpDestroy, "ncclRedOpDestroy");
  bind(n, api.ncclGetErrorString, "ncclGetErrorString");
  return api;
}

void Api::check(ncclResult_t result, const char* what) const {
  if (result != 0) throw std::runtime_error(std::string(what) + " failed: " + ncclGetErrorString(result));
}

void Api::check_cuda(cudaError_t result, const char* what) const {
  if (result != 0) throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(result));
}

}  // namespace commsched::nccl
