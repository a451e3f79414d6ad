// `commsched._core.timeline_span`: lets Python code (the torch Checkpointer) put spans of
// its background work on the COMMSCHED_TIMELINE trace, each named track a row of its own;
// `start_timeline`/`stop_timeline`: the trace started and stopped while commsched runs.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "bindings/runtime_slot.h"

namespace py = pybind11;

void register_timeline(py::module_& module) {
  module.def(
      "timeline_span",
      [](const std::string& track, const std::string& name, uint64_t start_us, uint64_t duration_us,
         const std::string& args_json) {
        auto runtime = commsched::runtime_slot().get();
        if (runtime) runtime->trace_span(track, name, start_us, duration_us, args_json);
      },
      py::arg("track"), py::arg("name"), py::arg("start_us"), py::arg("duration_us"), py::arg("args_json") = "{}",
      py::call_guard<py::gil_scoped_release>(),
      "Adds a span (wall-clock microseconds) on the timeline track `track`; a no-op unless COMMSCHED_TIMELINE is set.");
  module.def(
      "start_timeline",
      [](const std::string& path, bool mark_cycles) {
        commsched::runtime_slot().require("start_timeline")->start_timeline(path, mark_cycles);
      },
      py::arg("path"), py::arg("mark_cycles") = false, py::call_guard<py::gil_scoped_release>(),
      "Writes this rank's Chrome trace to `path` from now on (ending the file written so far).");
  module.def(
      "stop_timeline", [] { commsched::runtime_slot().require("stop_timeline")->stop_timeline(); },
      py::call_guard<py::gil_scoped_release>(), "Ends the trace file; a no-op when none is being written.");
}
