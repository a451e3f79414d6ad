// The `commsched._mpi` extension: the only part of commsched linked against libmpi,
// so the core imports and runs (torchrun, Gloo, loopback) where MPI is absent.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <type_traits>

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
