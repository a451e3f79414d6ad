// The `commsched._mpi` extension: the only part of commsched linked against libmpi,
// so the core imports and runs (torchrun, Gloo, loopback) where MPI is absent.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <type_traits>

#include "transport/mpi/cuda_aware_mpi.h"
#include "transport/mpi/mpi_algorithms.h"
#include "transport/mpi/mpi_transport.h"

namespace {

template <typename Comm>
Comm comm_from_handle(intptr_t raw) {
  if constexpr (std::is_pointer_v<Comm>) {
    return reinterpret_cast<Comm>(raw);
  } else {
    return static_cast<Comm>(raw);
  }
}

std::unique_ptr<commsched::Transport> create_mpi_transport(uint64_t comm_handle) {
  // mpi4py hands a communicator over as MPI._handleof(comm); MPICH handles are ints,
  // Open MPI's are pointers, and intptr_t carries both.
  return std::make_unique<commsched::MpiTransport>(comm_from_handle<MPI_Comm>(static_cast<intptr_t>(comm_handle)));
}

}  // namespace

PYBIND11_MODULE(_mpi, module) {
  module.doc() = "commsched's native MPI transport";
  module.def(
      "transport_factory",
      [] { return pybind11::capsule(reinterpret_cast<void*>(&create_mpi_transport), commsched::kTransportFactoryCapsule); },
      "Returns a capsule holding the factory the core calls to build the MPI transport.");
  module.def("cuda_aware", &commsched::mpi_is_cuda_aware,
             "True when the MPI library reports CUDA support (MPIX_Query_cuda_support).");
  pybind11::class_<commsched::CudaAwareMpiMaker>(module, "CudaAwareMaker",
                                                 "Wraps the MPI transport for GPU memory (CUDA-aware MPI).")
      .def(pybind11::init([](const std::vector<std::string>& cuda_candidates, int device) {
             auto api = std::make_shared<commsched::nccl::Api>(commsched::nccl::Api::load_cuda(cuda_candidates));
             return std::make_unique<commsched::CudaAwareMpiMaker>(std::move(api), device);
           }),
           pybind11::arg("cuda_candidates"), pybind11::arg("device"))
      .def(
          "capsule",
          [](commsched::CudaAwareMpiMaker& maker) {
            return pybind11::capsule(static_cast<commsched::DeviceTransportMaker*>(&maker),
                                     commsched::kDeviceTransportMakerCapsule);
          },
          "The capsule commsched._core.start takes; valid while this maker lives (keep it referenced).");
  module.def("reduce_scatter_algorithm", &commsched::reduce_scatter_algorithm,
             "MPICH's algorithm for nonblocking reduce-scatter now ('' on other MPI libraries).");
  module.def(
      "library_version",
      [] {
        char text[MPI_MAX_LIBRARY_VERSION_STRING];
        int length = 0;
        MPI_Get_library_version(text, &length);
        return std::string(text, static_cast<size_t>(length));
      },
      "The MPI library this transport was linked against.");
}
