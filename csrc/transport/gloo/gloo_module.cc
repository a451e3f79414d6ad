// The `commsched._gloo` extension: the native Gloo transport, built against PyTorch's headers and
// libraries (and its bundled pybind11, so torch's ProcessGroup objects cast to their C++ types).
// The core never links torch: it gets the transport through the factory capsule, like MPI's.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>
#include <memory>
#include <string>

#include "transport/gloo/gloo_transport.h"

#ifndef COMMSCHED_BUILT_FOR_TORCH
#error "setup.py defines COMMSCHED_BUILT_FOR_TORCH, the torch version these headers belong to"
#endif

namespace py = pybind11;

namespace commsched {

namespace {

// A Python callable run from C++ that may not hold the GIL (the core stops with the GIL released).
class PythonCallback {
 public:
  explicit PythonCallback(py::object callable) : callable_(std::move(callable)) {}
  ~PythonCallback() {
    py::gil_scoped_acquire gil;
    callable_ = py::object();
  }
  PythonCallback(const PythonCallback&) = delete;
  PythonCallback& operator=(const PythonCallback&) = delete;

  void operator()() {
    py::gil_scoped_acquire gil;
    try {
      callable_();
    } catch (const py::error_already_set& error) {
      // Nothing is left to fail: say so on stderr, as the interpreter does for errors in __del__.
      PySys_WriteStderr("commsched: closing the gloo transport failed: %s\n", error.what());
    }
  }

 private:
  py::object callable_;
};

c10::intrusive_ptr<c10d::Backend> backend_of(const py::object& backend, const char* which) {
  c10d::Backend* raw = nullptr;
  try {
    raw = backend.cast<c10d::Backend*>();
  } catch (const py::cast_error& error) {
    throw UsageError(std::string("gloo: the ") + which + " group's CPU backend (" +
                     py::str(py::type::of(backend)).cast<std::string>() +
                     ") is not a c10d Backend this module can reach: " + error.what() +
                     " (commsched._gloo was built against another PyTorch; reinstall commsched)");
  }
  if (raw == nullptr) throw UsageError(std::string("gloo: the ") + which + " group has no CPU backend");
  const std::string name = raw->getBackendName();
  if (name != "gloo") {
    throw UsageError(std::string("gloo: the ") + which + " group's CPU backend is " + name + ", not gloo");
  }
  // c10d objects count their references themselves: this shares ownership with Python's.
  return c10::intrusive_ptr<c10d::Backend>::reclaim_copy(raw);
}

// Python's maker of process sets' groups, called from C++ on a thread that may not hold the GIL.
class PythonSetMaker {
 public:
  explicit PythonSetMaker(py::object callable) : callable_(std::move(callable)) {}
  ~PythonSetMaker() {
    py::gil_scoped_acquire gil;
    callable_ = py::object();
  }
  PythonSetMaker(const PythonSetMaker&) = delete;
  PythonSetMaker& operator=(const PythonSetMaker&) = delete;

  c10::intrusive_ptr<c10d::Backend> operator()(int32_t id, const std::vector<int>& ranks) {
    py::gil_scoped_acquire gil;
    py::list members;
    for (int rank : ranks) members.append(rank);
    try {
      py::object backend = callable_(id, members);
      if (backend.is_none()) return {};
      return backend_of(backend, "process set");
    } catch (const py::error_already_set& error) {
      throw CommError(std::string("gloo: building process set ") + std::to_string(id) + " failed: " + error.what());
    }
  }

 private:
  py::object callable_;
};

// What the Python side hands the core: the two backends, until the factory turns them into the
// transport, and the transport's counters, which outlive it.
class GlooSeed {
 public:
  GlooSeed(const py::object& data, const py::object& control, py::object on_close, py::object make_set)
      : make_set_(make_set.is_none() ? nullptr : std::make_shared<PythonSetMaker>(std::move(make_set))),
        data_(backend_of(data, "data")),
        control_(backend_of(control, "agreement")),
        on_close_(on_close.is_none() ? nullptr : std::make_shared<PythonCallback>(std::move(on_close))),
        counters_(std::make_shared<GlooCounters>()),
        rank_(data_->getRank()),
        size_(data_->getSize()) {}

  std::unique_ptr<Transport> make() {
    if (!data_) throw UsageError("gloo: this transport seed was used already; build a new one for each init()");
    std::function<void()> on_close;
    if (on_close_) on_close = [callback = std::move(on_close_)] { (*callback)(); };
    GlooSetMaker make_set;
    if (make_set_) {
      // Moved, not shared: the seed outlives the transport (commsched.transports.gloo.last_seed keeps
      // it for its counters), and the maker's closure holds the job's process groups, which would
      // then outlive commsched.shutdown() and dist.destroy_process_group() and be torn down while
      // the interpreter exits, when their worker threads can no longer take the GIL.
      make_set = [maker = std::move(make_set_)](int32_t id, const std::vector<int>& ranks) {
        return (*maker)(id, ranks);
      };
    }
    return std::make_unique<GlooTransport>(std::move(data_), std::move(control_), counters_, std::move(on_close),
                                           std::move(make_set));
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  py::dict counters() const {
    py::dict out;
    out["launches"] = counters_->launches.load();
    out["exchanges"] = counters_->exchanges.load();
    out["rings"] = counters_->rings.load();
    return out;
  }

 private:
  std::shared_ptr<PythonSetMaker> make_set_;
  c10::intrusive_ptr<c10d::Backend> data_;
  c10::intrusive_ptr<c10d::Backend> control_;
  std::shared_ptr<PythonCallback> on_close_;
  std::shared_ptr<GlooCounters> counters_;
  int rank_;
  int size_;
};

// The core calls this with the GIL held, inside commsched._core.start().
std::unique_ptr<Transport> create_gloo_transport(uint64_t seed_address) {
  return reinterpret_cast<GlooSeed*>(static_cast<uintptr_t>(seed_address))->make();
}

}  // namespace

}  // namespace commsched

PYBIND11_MODULE(_gloo, module) {
  using commsched::GlooSeed;
  module.doc() = "commsched's native Gloo transport (torch's C++ Gloo backend, no GIL on the data path)";
  module.attr("built_for_torch") = COMMSCHED_BUILT_FOR_TORCH;
  module.def(
      "transport_factory",
      [] {
        return py::capsule(reinterpret_cast<void*>(&commsched::create_gloo_transport),
                           commsched::kTransportFactoryCapsule);
      },
      "Returns a capsule holding the factory the core calls to build the Gloo transport from a seed's address.");
  py::class_<GlooSeed>(module, "Seed", "The data and agreement groups, until the core turns them into its transport.")
      .def(py::init<const py::object&, const py::object&, py::object, py::object>(), py::arg("data_backend"),
           py::arg("control_backend"), py::arg("on_close") = py::none(), py::arg("make_process_set") = py::none(),
           "Takes the CPU backends (ProcessGroup._get_backend(cpu)) of the data and agreement groups; "
           "`on_close()` runs when the core releases the transport; `make_process_set(id, ranks)` returns a "
           "process set's CPU backend (None outside it).")
      .def_property_readonly("rank", &GlooSeed::rank)
      .def_property_readonly("size", &GlooSeed::size)
      .def(
          "address", [](GlooSeed& seed) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(&seed)); },
          "The handle the factory takes; valid while this seed lives (keep it referenced).")
      .def("counters", &GlooSeed::counters, "Launches, agreement exchanges and ring collectives that went over the native path.");
}
