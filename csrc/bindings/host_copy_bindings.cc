// `commsched._core.copy_bypassing_cache`: a batch of host copies in one call with the GIL released,
// for checkpoint captures, whose copies nothing reads until a restore.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "core/host_copy.h"

namespace py = pybind11;

void register_host_copy(py::module_& module) {
  module.def(
      "copy_bypassing_cache",
      [](const std::vector<std::tuple<std::uintptr_t, std::uintptr_t, std::size_t>>& copies) {
        for (const auto& [destination, source, bytes] : copies) {
          if (bytes != 0 && (destination == 0 || source == 0)) {
            throw std::invalid_argument("copy_bypassing_cache: a copy of bytes has a null address");
          }
        }
        py::gil_scoped_release release;  // the training thread runs on while the capture copies
        for (const auto& [destination, source, bytes] : copies) {
          commsched::copy_bypassing_cache(reinterpret_cast<void*>(destination),
                                          reinterpret_cast<const void*>(source), bytes);
        }
      },
      py::arg("copies"),
      "Copies each (destination address, source address, bytes) of host memory, the GIL released; large "
      "copies bypass the cache. The caller guarantees the memory stays valid and that no two overlap.");
}
