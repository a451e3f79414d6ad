// Choices of MPI's own collective algorithms that commsched makes where the library's defaults
// cost bandwidth, through the MPI tool interface (MPI_T), so they hold however MPI was started.
#pragma once

#include <string>

namespace commsched {

// MPICH reduce-scatters below 512 KiB by recursive halving; on a communicator whose size is not a
// power of two, one rank first sends its whole buffer to a partner and takes its part back at the
// end, and on a 3-rank 1 Gbit link such a reduce-scatter took 2.2-2.4x a ring's time where
// pairwise exchange took 1.0x (at 4 ranks both 1.0x). Switches MPICH's nonblocking reduce-scatter
// to pairwise exchange unless the user chose an algorithm (MPIR_CVAR_IREDUCE_SCATTER_INTRA_ALGORITHM
// set, or the variable no longer at its automatic choice); does nothing on other MPI libraries.
// Returns the algorithm in effect afterwards ("" where the library has no such variable).
std::string prefer_pairwise_reduce_scatter();

// The algorithm MPICH's nonblocking reduce-scatter runs now ("" where the library has no such variable).
std::string reduce_scatter_algorithm();

}  // namespace commsched
