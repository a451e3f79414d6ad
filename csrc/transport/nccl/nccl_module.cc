// The `commsched._nccl` extension: NCCL collectives on commsched's own CUDA stream. It links
// against neither NCCL nor CUDA; both are loaded when a communicator is made, so the extension
// is built and imported everywhere and fails with a clear message only when used without CUDA.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "transport/nccl/nccl_transport.h"

namespace py = pybind11;
using namespace commsched;
using namespace commsched::nccl;

namespace {

// A raw communicator for baselines and checks: NCCL on its own stream, without the scheduler.
class RawCommunicator {
 public:
  RawCommunicator(std::shared_ptr<const Api> api, const std::string& id, int rank, int size, int device)
      : comm_(std::make_shared<Communicator>(std::move(api), id, rank, size, device)) {}

  std::unique_ptr<Work> collective(uintptr_t data, uint64_t count, const std::string& dtype, bool average,
                                   std::optional<uintptr_t> stream, CollectiveKind kind, int root) {
    WireOp op;
    op.kind = kind;
    op.dtype = dtype_from_name(dtype);
    op.op = average ? ReduceOp::kAverage : ReduceOp::kSum;
    op.root = root;
    op.data = reinterpret_cast<void*>(data);
    op.count = count;
    comm_->submitted(data, count * dtype_size(op.dtype), average, stream);
    return comm_->launch(op);
  }
  const Communicator& get() const { return *comm_; }

 private:
  std::shared_ptr<Communicator> comm_;
};

}  // namespace

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
  module.def("version_text", &version_text, "NCCL's version code as major.minor.patch.");
  module.def(
      "device_count", [](const Api& api) {
        int count = 0;
        return api.cudaGetDeviceCount(&count) == 0 ? count : 0;
      },
      "CUDA devices visible to this process (0 when the driver has none).");
  module.def("unique_id", [](const Api& api) { return py::bytes(unique_id(api)); },
             "A fresh NCCL unique id (128 bytes) for rank 0 to hand to every rank.");

  py::class_<NcclTransportMaker>(module, "TransportMaker", "Builds the NCCL transport around a host transport.")
      .def(py::init([](std::shared_ptr<Api> api, int device) {
             return std::make_unique<NcclTransportMaker>(std::move(api), device);
           }),
           py::arg("api"), py::arg("device"))
      .def(
          "capsule",
          [](NcclTransportMaker& maker) {
            return py::capsule(static_cast<DeviceTransportMaker*>(&maker), kDeviceTransportMakerCapsule);
          },
          "The capsule commsched._core.start takes; valid while this maker lives (keep it referenced).");

  py::class_<Work>(module, "Work").def("test", &Work::test, "True once the GPU finished the launch.");
  py::class_<RawCommunicator>(module, "Communicator", "NCCL on its own stream, without the scheduler.")
      .def(py::init([](std::shared_ptr<Api> api, py::bytes id, int rank, int size, int device) {
             std::string raw = id;
             py::gil_scoped_release release;  // ncclCommInitRank waits for every rank
             return std::make_unique<RawCommunicator>(std::move(api), raw, rank, size, device);
           }),
           py::arg("api"), py::arg("unique_id"), py::arg("rank"), py::arg("size"), py::arg("device"))
      .def(
          "allreduce",
          [](RawCommunicator& comm, uintptr_t data, uint64_t count, const std::string& dtype, bool average,
             std::optional<uintptr_t> stream) {
            return comm.collective(data, count, dtype, average, stream, CollectiveKind::kAllreduce, 0);
          },
          py::arg("data"), py::arg("count"), py::arg("dtype"), py::arg("average") = false,
          py::arg("stream") = py::none(), "Starts an in-place allreduce after the producer's stream.")
      .def(
          "broadcast",
          [](RawCommunicator& comm, uintptr_t data, uint64_t count, const std::string& dtype, int root,
             std::optional<uintptr_t> stream) {
            return comm.collective(data, count, dtype, false, stream, CollectiveKind::kBroadcast, root);
          },
          py::arg("data"), py::arg("count"), py::arg("dtype"), py::arg("root"), py::arg("stream") = py::none(),
          "Starts an in-place broadcast from root after the producer's stream.")
      .def_property_readonly("rank", [](const RawCommunicator& c) { return c.get().rank(); })
      .def_property_readonly("size", [](const RawCommunicator& c) { return c.get().size(); })
      .def_property_readonly("device", [](const RawCommunicator& c) { return c.get().device(); })
      .def_property_readonly("version", [](const RawCommunicator& c) { return c.get().version(); },
                             "NCCL's version code.");
}
