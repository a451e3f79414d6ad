// NCCL and the CUDA runtime, loaded at run time with dlopen: commsched builds, imports and runs
// its tests on machines without CUDA, and picks up NCCL from pip's nvidia-* packages or the system.
// Only the few types and entry points the transport uses are declared here, copied from the
// stable C ABIs of nccl.h (2.x) and cuda_runtime_api.h (11/12).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace commsched::nccl {

using ncclResult_t = int;  // 0: success
using ncclComm_t = struct ncclComm*;
using cudaError_t = int;  // 0: success, 600: not ready
using cudaStream_t = struct CUstream_st*;
using cudaEvent_t = struct CUevent_st*;

inline constexpr int kNcclUniqueIdBytes = 128;
struct ncclUniqueId {
  char internal[kNcclUniqueIdBytes];
};

// ncclDataType_t and ncclRedOp_t values of nccl.h.
enum NcclDataType : int {
  kNcclInt8 = 0, kNcclUint8 = 1, kNcclInt32 = 2, kNcclInt64 = 4,
  kNcclFloat16 = 6, kNcclFloat32 = 7, kNcclFloat64 = 8, kNcclBfloat16 = 9,
};
inline constexpr int kNcclSum = 0;
inline constexpr int kNcclProd = 1;
inline constexpr int kNcclMax = 2;
inline constexpr int kNcclMin = 3;
inline constexpr int kNcclAvg = 4;  // NCCL 2.10 and newer
inline constexpr int kNcclFirstVersionWithAvg = 21000;  // ncclGetVersion's code for 2.10.0
inline constexpr int kNcclFirstVersionWithPreMulSum = 21100;  // ncclRedOpCreatePreMulSum: 2.11.0
inline constexpr int kNcclScalarHostImmediate = 1;  // ncclScalarResidence_t: read once, at creation
inline constexpr cudaError_t kCudaErrorNotReady = 600;
inline constexpr unsigned kCudaStreamNonBlocking = 0x01;
inline constexpr unsigned kCudaEventDisableTiming = 0x02;
inline constexpr int kCudaMemcpyDefault = 4;  // direction inferred from the pointers (unified addressing)

// A dlopen handle, closed when the last user lets go.
class SharedLibrary {
 public:
  // Tries each candidate in order; throws std::runtime_error listing what was tried.
  static std::shared_ptr<SharedLibrary> open_first(const std::vector<std::string>& candidates, const std::string& what);
  SharedLibrary(void* handle, std::string path) : handle_(handle), path_(std::move(path)) {}  // takes the handle
  ~SharedLibrary();
  SharedLibrary(const SharedLibrary&) = delete;
  SharedLibrary& operator=(const SharedLibrary&) = delete;
  void* symbol(const char* name) const;  // throws if missing
  void* find(const char* name) const;    // null if missing
  const std::string& path() const { return path_; }

 private:
  void* handle_;
  std::string path_;
};

// The entry points, resolved once; the libraries stay open while any Api copy lives.
struct Api {
  std::shared_ptr<SharedLibrary> nccl_library;
  std::shared_ptr<SharedLibrary> cuda_library;

  ncclResult_t (*ncclGetVersion)(int*) = nullptr;
  ncclResult_t (*ncclGetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*ncclCommInitRank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*ncclCommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*ncclCommAbort)(ncclComm_t) = nullptr;
  ncclResult_t (*ncclCommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  ncclResult_t (*ncclAllReduce)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*ncclBroadcast)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*ncclReduce)(const void*, void*, size_t, int, int, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*ncclAllGather)(const void*, void*, size_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*ncclReduceScatter)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*ncclGroupStart)() = nullptr;
  ncclResult_t (*ncclGroupEnd)() = nullptr;
  // Null where this NCCL is too old for them: send/recv before 2.7, PreMulSum before 2.11.
  ncclResult_t (*ncclSend)(const void*, size_t, int, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*ncclRecv)(void*, size_t, int, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*ncclRedOpCreatePreMulSum)(int*, void*, int, int, ncclComm_t) = nullptr;
  ncclResult_t (*ncclRedOpDestroy)(int, ncclComm_t) = nullptr;
  const char* (*ncclGetErrorString)(ncclResult_t) = nullptr;

  cudaError_t (*cudaGetDeviceCount)(int*) = nullptr;
  cudaError_t (*cudaSetDevice)(int) = nullptr;
  cudaError_t (*cudaGetDevice)(int*) = nullptr;
  cudaError_t (*cudaStreamCreateWithFlags)(cudaStream_t*, unsigned) = nullptr;
  cudaError_t (*cudaStreamDestroy)(cudaStream_t) = nullptr;
  cudaError_t (*cudaStreamWaitEvent)(cudaStream_t, cudaEvent_t, unsigned) = nullptr;
  cudaError_t (*cudaStreamSynchronize)(cudaStream_t) = nullptr;
  cudaError_t (*cudaMemcpyAsync)(void*, const void*, size_t, int, cudaStream_t) = nullptr;
  cudaError_t (*cudaMemcpy)(void*, const void*, size_t, int) = nullptr;
  cudaError_t (*cudaMalloc)(void**, size_t) = nullptr;
  cudaError_t (*cudaFree)(void*) = nullptr;
  cudaError_t (*cudaEventCreateWithFlags)(cudaEvent_t*, unsigned) = nullptr;
  cudaError_t (*cudaEventRecord)(cudaEvent_t, cudaStream_t) = nullptr;
  cudaError_t (*cudaEventQuery)(cudaEvent_t) = nullptr;
  cudaError_t (*cudaEventSynchronize)(cudaEvent_t) = nullptr;
  cudaError_t (*cudaEventDestroy)(cudaEvent_t) = nullptr;
  const char* (*cudaGetErrorString)(cudaError_t) = nullptr;

  // The CUDA runtime alone (CUDA-aware MPI needs no NCCL); the NCCL entry points stay null.
  static Api load_cuda(const std::vector<std::string>& cuda_candidates);
  // Loads both libraries from the first candidate path that opens; throws naming every try.
  static Api load(const std::vector<std::string>& nccl_candidates, const std::vector<std::string>& cuda_candidates);
  void check(ncclResult_t result, const char* what) const;  // throws std::runtime_error
  void check_cuda(cudaError_t result, const char* what) const;
};

}  // namespace commsched::nccl
