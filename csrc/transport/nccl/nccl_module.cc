// The `commsched._nccl` extension: NCCL collectives on commsched's own CUDA stream. It links
// against neither NCCL nor CUDA; both are loaded when a communicator is made, so the extension
// is built and imported everywhere and fails with a clear message only when used without CUDA.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "transport/nccl/nccl_comm.h"

namespace py = pybind11;
using namespace commsched::nccl;

PYBIND11_MODULE(_nccl, module) {
  module.doc() = "commsched's NCCL transport (NCCL and CUDA loaded at run time)";
  py::class_<Api, std::shared_ptr<Api>>(module, "Api");
  module.def(
      "load", [](const std::vector<std::string>& nccl, const std::vector<std::string>& cuda) {
        return std::make_shared<Api>(Api::load(nccl, cuda));
      },
      py::arg("nccl_candidates"), py::arg("cuda_candidates"),
      "Loads NCCL and the CUDA runtime from the first candidate paths that open; raises RuntimeError listing tries.");
  module.def(
      "version", [](const Api& api) {
        int version = 0;
        api.check(api.ncclGetVersion(&version), "ncclGetVersion");
        return version;
      },
      "NCCL's version code (e.g. 22105 for 2.21.5).");
  module.def(
      "device_count", [](const Api& api) {
        int count = 0;
        return api.cudaGetDeviceCount(&count) == 0 ? count : 0;
      },
      "CUDA devices visible to this process (0 when the driver has none).");
  module.def("unique_id", [](const Api& api) { return py::bytes(unique_id(api)); },
             "A fresh NCCL unique id (128 bytes) for rank 0 to hand to every rank.");
  module.def("nccl_dtype", &nccl_dtype, "NCCL's data type code for a commsched dtype name.");

  py::class_<Work>(module, "Work").def("test", &Work::test, "True once the GPU finished the collective.");
  py::class_<Communicator>(module, "Communicator")
      .def(py::init([](std::shared_ptr<Api> api, py::bytes id, int rank, int size, int device) {
             std::string raw = id;
             py::gil_scoped_release release;  // ncclCommInitRank waits for every rank
             return std::make_unique<Communicator>(std::move(api), raw, rank, size, device);
           }),
           py::arg("api"), py::arg("unique_id"), py::arg("rank"), py::arg("size"), py::arg("device"))
      .def("submitted", &Communicator::submitted, py::arg("data"), py::arg("nbytes"), py::arg("average"),
           py::arg("stream"),
           "On the submitting thread: records an event on the caller's stream (None: no ordering needed) that "
           "the collectives over this memory will wait on.")
      .def("forget", &Communicator::forget, py::arg("data"), "Drops a submission the core refused.")
      .def("allreduce", &Communicator::allreduce, py::arg("data"), py::arg("count"), py::arg("dtype"),
           py::keep_alive<0, 1>(), "Starts an in-place allreduce (ncclAvg if submitted with average, else sum).")
      .def("broadcast", &Communicator::broadcast, py::arg("data"), py::arg("count"), py::arg("dtype"), py::arg("root"),
           py::keep_alive<0, 1>(), "Starts an in-place broadcast from root.")
      .def("copy", &Communicator::copy, py::arg("dst"), py::arg("src"), py::arg("nbytes"),
           "Copies on commsched's stream and waits for it (the core's fusion copy hook).")
      .def("scale", &Communicator::scale, py::arg("data"), py::arg("count"), py::arg("dtype"), py::arg("divisor"),
           "The core's average hook: checks that NCCL already averaged this data.")
      .def("abort", &Communicator::abort, "Aborts the communicator (NCCL's ncclCommAbort).")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("device", &Communicator::device)
      .def_property_readonly("version", &Communicator::version, "NCCL's version code.")
      .def_property_readonly("supports_average", &Communicator::supports_average, "True with NCCL 2.10+ (ncclAvg).")
      .def_property_readonly("submitted_count", &Communicator::submitted_count,
                             "Tensors submitted and not yet wholly started.");
}
