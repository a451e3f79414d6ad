// The `commsched._core` extension: owns the process's one Runtime and exposes it to
// Python. The commsched package wraps this module; users never import it directly.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <mutex>
#include <optional>

#include "bindings/owner_table.h"
#include "bindings/runtime_slot.h"
#include "core/runtime.h"
#include "transport/loopback/loopback_transport.h"
#include "transport/python/python_transport.h"

namespace py = pybind11;

namespace commsched {

void RuntimeSlot::install(std::shared_ptr<Runtime> runtime) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (runtime_ && runtime_->running()) {
    throw UsageError("commsched is already initialised; call commsched.shutdown() before init() again");
  }
  previous_ = std::move(runtime_);
  runtime_ = std::move(runtime);
}

std::shared_ptr<Runtime> RuntimeSlot::get() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return runtime_;
}

std::shared_ptr<Runtime> RuntimeSlot::require(const char* what) const {
  auto runtime = get();
  if (!runtime) {
    throw Failure(FailureKind::kNotRunning, std::string("commsched.") + what + "() needs commsched.init() first");
  }
  return runtime;
}

std::shared_ptr<Runtime> RuntimeSlot::release() {
  std::lock_guard<std::mutex> lock(mutex_);
  previous_.reset();
  return std::move(runtime_);
}

RuntimeSlot& runtime_slot() {
  static RuntimeSlot slot;
  return slot;
}

}  // namespace commsched

using namespace commsched;

void register_simulator(pybind11::module_& module);
void register_run_buffer(pybind11::module_& module, std::shared_ptr<OwnerTable> owners);
void register_timeline(pybind11::module_& module);
void register_host_copy(pybind11::module_& module);

namespace {

LogLevel log_level_from_name(const std::string& name) {
  static const std::pair<const char*, LogLevel> kLevels[] = {{"trace", LogLevel::kTrace},
                                                              {"debug", LogLevel::kDebug},
                                                              {"info", LogLevel::kInfo},
                                                              {"warning", LogLevel::kWarning},
                                                              {"error", LogLevel::kError}};
  for (const auto& [text, level] : kLevels) {
    if (name == text) return level;
  }
  throw UsageError("unknown log level '" + name + "'");
}

ControlChannel control_channel_from_name(const std::string& name) {
  if (name == "auto") return ControlChannel::kAuto;
  if (name == "tcp") return ControlChannel::kTcp;
  if (name == "transport") return ControlChannel::kTransport;
  throw UsageError("COMMSCHED_CONTROL_CHANNEL: unknown value '" + name + "'; use auto, tcp or transport");
}

std::unique_ptr<Transport> make_transport(const std::string& kind, py::object argument) {
  if (kind == "loopback") return std::make_unique<LoopbackTransport>();
  if (kind == "python") return std::make_unique<PythonTransport>(std::move(argument));
  if (kind == "native") {
    auto pair = argument.cast<py::tuple>();
    auto capsule = pair[0].cast<py::capsule>();
    if (std::string(capsule.name()) != kTransportFactoryCapsule) throw UsageError("not a commsched transport factory");
    auto factory = reinterpret_cast<TransportFactory>(capsule.get_pointer());
    return factory(pair[1].cast<uint64_t>());
  }
  if (kind == "device") {
    // (maker capsule, control kind, control argument): the host transport first, then the device
    // transport around it. The caller keeps the maker's owner alive during this call.
    auto triple = argument.cast<py::tuple>();
    auto capsule = triple[0].cast<py::capsule>();
    if (std::string(capsule.name()) != kDeviceTransportMakerCapsule) {
      throw UsageError("not a commsched device transport maker");
    }
    auto control = make_transport(triple[1].cast<std::string>(), triple[2]);
    return static_cast<DeviceTransportMaker*>(capsule.get_pointer())->make(std::move(control));
  }
  throw UsageError("unknown transport kind '" + kind + "'");
}

py::dict stats_dict(const RuntimeStats& stats) {
  py::dict out;
  out["cycles"] = stats.cycles;
  out["launches"] = stats.launches;
  out["fused_launches"] = stats.fused_launches;
  out["chunks"] = stats.chunks;
  out["launched_bytes"] = stats.launched_bytes;
  out["max_bytes_in_flight"] = stats.max_bytes_in_flight;
  out["max_launch_bytes"] = stats.max_launch_bytes;
  out["completed_tensors"] = stats.completed_tensors;
  out["failed_tensors"] = stats.failed_tensors;
  out["inline_tensors"] = stats.inline_tensors;
  out["cached_names"] = stats.cached_names;
  out["control_channel_rounds"] = stats.control_channel_rounds;
  out["spun_rounds"] = stats.spun_rounds;
  return out;
}

const char* failure_class(FailureKind kind) {
  switch (kind) {
    case FailureKind::kNotRunning: return "NotRunningError";
    case FailureKind::kRankFailure: return "RankFailure";
    case FailureKind::kCollective: break;
  }
  return "CollectiveError";
}

// Raises a Failure as its Python class, with `rank` set (None when unknown).
void raise_failure(const Failure& failure) {
  py::object type = py::module_::import("commsched._core").attr(failure_class(failure.kind()));
  py::object error = type(failure.what());
  error.attr("rank") = failure.rank() >= 0 ? py::object(py::int_(failure.rank())) : py::object(py::none());
  PyErr_SetObject(type.ptr(), error.ptr());
}

// Adds an exception class `name` under `base` to the module.
py::object add_error(py::module_& module, const char* name, py::handle base, const char* doc) {
  const std::string qualified = std::string("commsched._core.") + name;
  py::object type =
      py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(qualified.c_str(), doc, base.ptr(), nullptr));
  if (!type) throw py::error_already_set();
  module.add_object(name, type);
  return type;
}

}  // namespace

PYBIND11_MODULE(_core, module) {
  module.doc() = "commsched's C++ scheduling core";
  // UsageError derives from std::invalid_argument, which pybind11 raises as ValueError: an
  // argument the caller can fix. Failures at run time are CommschedError and its subclasses.
  static auto& comm_error = py::register_exception<CommError>(module, "CommschedError", PyExc_RuntimeError);
  comm_error.attr("__doc__") = "A failure of commsched at run time; `rank` is the rank it started on, if known.";
  comm_error.attr("rank") = py::none();
  py::object not_running = add_error(
      module, "NotRunningError", comm_error,
      "commsched is not running: never initialised, shut down, or stopped; raised by submissions and by "
      "handles pending when it stopped.");
  add_error(module, "RankFailure", not_running,
            "commsched stopped because a rank failed, lost contact or stalled past COMMSCHED_STALL_SHUTDOWN; "
            "`rank` names it when known.");
  add_error(module, "CollectiveError", comm_error,
            "One collective failed on every rank while commsched goes on: its ranks submitted different "
            "metadata, or a rank refused it (`rank`).");
  // Tried before the CommError translator above (pybind11 tries the latest first).
  py::register_exception_translator([](std::exception_ptr pointer) {
    try {
      if (pointer) std::rethrow_exception(pointer);
    } catch (const Failure& failure) {
      raise_failure(failure);
    }
  });
  const auto owners = std::make_shared<OwnerTable>();

  // The result of an allgather, reducescatter or alltoall: memory the core allocated through the
  // transport, kept alive by this object (and whatever Python object views it). Host memory
  // exposes the buffer protocol; device memory only its address.
  py::class_<FusionBuffer, std::shared_ptr<FusionBuffer>>(module, "OutputMemory", py::buffer_protocol(),
                                                         "Memory holding a collective's result.")
      .def_property_readonly("address", [](FusionBuffer& memory) { return reinterpret_cast<uintptr_t>(memory.data()); })
      .def_property_readonly("nbytes", &FusionBuffer::capacity)
      .def_buffer([](FusionBuffer& memory) {
        return py::buffer_info(memory.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(memory.capacity())}, {1});
      });

  py::class_<HandleState, std::shared_ptr<HandleState>>(module, "Handle", "Completion of one submitted collective.")
      .def(
          "output",
          [](const HandleState& handle) -> py::object {
            if (!handle.done() || handle.failed() || !handle.output()) return py::none();
            return py::make_tuple(handle.output(), handle.output_elements(), handle.layout());
          },
          "(memory, elements, per-rank layout) of a finished collective with an output, else None.")
      .def_property_readonly("name", &HandleState::name)
      .def("done", &HandleState::done, "True once the collective finished or failed.")
      .def(
          "wait",
          [owners](const HandleState& handle, std::optional<double> timeout_s) {
            bool finished;
            {
              py::gil_scoped_release release;
              const double timeout = timeout_s ? *timeout_s : -1.0;
              // Through the runtime, so this thread may run the core while it waits.
              const std::shared_ptr<Runtime> runtime = runtime_slot().get();
              finished = runtime ? runtime->wait(handle, timeout) : handle.wait(timeout);
            }
            if (finished) owners->prune();  // its owner, and others finished meanwhile, may go now
            if (finished && handle.failed()) handle.throw_failure();
            return finished;
          },
          py::arg("timeout") = py::none(), "Waits; False on timeout, raises a CommschedError if it failed.")
      .def(
          "wait_stream",
          [owners](const HandleState& handle, uintptr_t stream, std::optional<double> timeout_s) {
            bool ready;
            {
              py::gil_scoped_release release;
              const double timeout = timeout_s ? *timeout_s : -1.0;
              const std::shared_ptr<Runtime> runtime = runtime_slot().get();
              ready = runtime ? runtime->wait(handle, timeout, true) : handle.wait_launched(timeout);
              // Launched and not known done: `stream` waits for it on the GPU, the host goes on.
              if (ready && !handle.done()) {
                if (const std::shared_ptr<StreamMark> mark = handle.launched_mark()) mark->make_wait(stream);
              }
            }
            if (ready && handle.done()) {
              owners->prune();
              if (handle.failed()) handle.throw_failure();
            }
            return ready;
          },
          py::arg("stream"), py::arg("timeout") = py::none(),
          "Device transports: waits until the collective is launched, then makes CUDA `stream` wait for it on the "
          "GPU; host transports: as wait(). False on timeout, raises a CommschedError if it failed.")
      .def("launched", &HandleState::launched_or_done,
           "True once done, or launched on a device transport's stream (wait_stream() then returns at once).")
      .def_property_readonly(
          "error", [](const HandleState& handle) -> std::optional<std::string> {
            if (!handle.failed()) return std::nullopt;
            return handle.error();
          });

  module.def(
      "start",
      [](const std::string& policy, uint64_t partition_bytes, uint64_t credit_bytes, uint64_t fusion_bytes,
         double cycle_time_s, double stall_timeout_s, double stall_shutdown_s, const std::string& timeline_path,
         const std::string& log_level, const std::string& transport_kind, py::object transport_argument,
         uint64_t inline_bytes, const std::string& control_channel, const std::string& control_address,
         double link_latency_s, double poll_interval_s) {
        RuntimeSettings settings;
        settings.scheduling.policy = policy == "fifo" ? Policy::kFifo : Policy::kPriority;
        settings.scheduling.partition_bytes = partition_bytes;
        settings.scheduling.credit_bytes = credit_bytes;
        settings.scheduling.fusion_bytes = fusion_bytes;
        settings.inline_bytes = inline_bytes;
        settings.cycle_time_s = cycle_time_s;
        settings.stall_timeout_s = stall_timeout_s;
        settings.stall_shutdown_s = stall_shutdown_s;
        settings.timeline_path = timeline_path;
        settings.log_level = log_level_from_name(log_level);
        settings.control_channel = control_channel_from_name(control_channel);
        settings.control_address = control_address;
        settings.link_latency_s = link_latency_s;
        settings.poll_interval_s = poll_interval_s;
        auto transport = make_transport(transport_kind, std::move(transport_argument));
        std::shared_ptr<Runtime> runtime;
        {
          // Without the GIL: the constructor's control-channel bootstrap waits for the other ranks,
          // whose reports a Python transport (gRPC) sends and receives on threads of its own.
          py::gil_scoped_release release;
          runtime = std::make_shared<Runtime>(settings, std::move(transport));
        }
        runtime_slot().install(std::move(runtime));
      },
      py::arg("policy"), py::arg("partition_bytes"), py::arg("credit_bytes"), py::arg("fusion_bytes"),
      py::arg("cycle_time_s"), py::arg("stall_timeout_s"), py::arg("stall_shutdown_s"), py::arg("timeline_path"),
      py::arg("log_level"), py::arg("transport_kind"), py::arg("transport_argument") = py::none(),
      py::arg("inline_bytes") = RuntimeSettings{}.inline_bytes, py::arg("control_channel") = "auto",
      py::arg("control_address") = "", py::arg("link_latency_s") = RuntimeSettings{}.link_latency_s,
      py::arg("poll_interval_s") = RuntimeSettings{}.poll_interval_s, "Starts the runtime (called by commsched.init()).");

  module.def(
      "stop",
      [owners] {
        auto runtime = runtime_slot().release();
        if (!runtime) return;
        {
          py::gil_scoped_release release;
          runtime->shutdown();
          runtime.reset();
        }
        owners->prune();  // every handle has ended
      },
      "Stops the runtime (called by commsched.shutdown()).");

  module.def(
      "enqueue",
      [owners](const std::string& name, uintptr_t address, uint64_t count, const std::string& dtype,
               const std::string& op, const std::string& kind, int root, int priority, bool wake_core,
               py::object owner, bool device, int device_id, std::optional<uintptr_t> stream, double prescale,
               double postscale, std::vector<uint64_t> row_shape, std::vector<uint64_t> splits, int32_t process_set) {
        TensorSpec spec;
        spec.process_set = process_set;
        spec.name = name;
        spec.dtype = dtype_from_name(dtype);
        spec.op = op_from_name(op);
        spec.kind = kind_from_name(kind);
        spec.root = root;
        spec.count = count;
        spec.priority = priority;
        spec.prescale = prescale;
        spec.postscale = postscale;
        spec.row_shape = std::move(row_shape);
        spec.splits = std::move(splits);
        const Placement placement{device, device_id, device ? stream : std::nullopt};
        auto handle = runtime_slot().require("allreduce_async")->enqueue(spec, reinterpret_cast<void*>(address),
                                                                         wake_core, placement);
        if (!owner.is_none()) owners->keep(handle, std::move(owner));
        return handle;
      },
      py::arg("name"), py::arg("address"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("kind"),
      py::arg("root"), py::arg("priority"), py::arg("wake_core") = true, py::arg("owner") = py::none(),
      py::arg("device") = false, py::arg("device_id") = -1, py::arg("stream") = py::none(),
      py::arg("prescale") = 1.0, py::arg("postscale") = 1.0, py::arg("row_shape") = std::vector<uint64_t>{},
      py::arg("splits") = std::vector<uint64_t>{}, py::arg("process_set") = 0,
      "Submits a collective on raw memory; `owner` (what keeps that memory alive) is held until it finishes. GPU "
      "memory says its device and the stream that produces it (None: no ordering needed).");
  module.def(
      "abort",
      [](const std::string& reason) {
        auto runtime = runtime_slot().get();
        if (runtime) runtime->abort(reason);
      },
      py::arg("reason"), "Stops every rank in the next round with this rank's failure `reason`.");
  module.def(
      "add_stall_hint",
      [](const std::string& prefix, const std::string& hint) {
        auto runtime = runtime_slot().get();
        if (runtime) runtime->add_stall_hint(prefix, hint);
      },
      py::arg("prefix"), py::arg("hint"),
      "Adds `hint` to the stall warnings and failures of tensors whose names start with `prefix`.");
  module.def(
      "enqueue_group",
      [owners](const std::vector<py::tuple>& members, const std::string& op, int priority, double prescale,
               double postscale, bool wake_core, int32_t process_set) {
        // Each member: (name, address, count, dtype, owner, device, device_id, stream).
        std::vector<Runtime::GroupMember> specs;
        for (const py::tuple& member : members) {
          Runtime::GroupMember entry;
          entry.spec.name = member[0].cast<std::string>();
          entry.spec.dtype = dtype_from_name(member[3].cast<std::string>());
          entry.spec.op = op_from_name(op);
          entry.spec.kind = CollectiveKind::kAllreduce;
          entry.spec.count = member[2].cast<uint64_t>();
          entry.spec.priority = priority;
          entry.spec.prescale = prescale;
          entry.spec.postscale = postscale;
          entry.spec.process_set = process_set;
          entry.data = reinterpret_cast<void*>(member[1].cast<uintptr_t>());
          const bool device = member[5].cast<bool>();
          entry.placement = Placement{device, member[6].cast<int>(),
                                      device ? member[7].cast<std::optional<uintptr_t>>() : std::nullopt};
          specs.push_back(std::move(entry));
        }
        auto handles = runtime_slot().require("grouped_allreduce")->enqueue_group(specs, wake_core);
        for (size_t i = 0; i < handles.size(); ++i) {
          py::object owner = members[i][4];
          if (!owner.is_none()) owners->keep(handles[i], std::move(owner));
        }
        return handles;
      },
      py::arg("members"), py::arg("op"), py::arg("priority"), py::arg("prescale") = 1.0, py::arg("postscale") = 1.0,
      py::arg("wake_core") = true, py::arg("process_set") = 0,
      "Submits allreduces that every rank announces and the core admits together (one fused launch when they fit).");
  module.def(
      "join", [] { return runtime_slot().require("join")->join(); },
      "Announces that this rank ran out of data; the handle completes once every rank has joined.");
  module.def(
      "last_joined_rank", [] { return runtime_slot().require("join")->last_joined_rank(); },
      "The last rank to join in the latest completed join (-1 before any).");
  module.def(
      "raise_if_stopped",
      [](const std::string& what) {
        auto runtime = runtime_slot().get();
        if (runtime) runtime->require_running(what);
      },
      py::arg("what"),
      "Raises the error a submission would get from a runtime that stopped (RankFailure once a rank was lost); "
      "nothing before the first init() or while running.");
  module.def(
      "refuse",
      [](const std::string& name, const std::string& reason, int32_t process_set) {
        auto runtime = runtime_slot().get();
        if (runtime) runtime->refuse(name, reason, process_set);
      },
      py::arg("name"), py::arg("reason"), py::arg("process_set") = 0,
      "Tells every rank this rank refused a submission of `name`, so theirs fail instead of waiting.");
  module.def(
      "add_process_set",
      [](int32_t id, const std::vector<int>& ranks) {
        auto runtime = runtime_slot().require("add_process_set");
        py::gil_scoped_release release;  // the members meet in the transport; Python transports need the GIL
        runtime->add_process_set(id, ranks);
      },
      py::arg("id"), py::arg("ranks"),
      "Registers process set `id` with the transport and the agreement (every rank, same order).");
  module.def(
      "remove_process_set", [](int32_t id) { runtime_slot().require("remove_process_set")->remove_process_set(id); },
      py::arg("id"), "Forgets process set `id` on this rank.");
  module.def(
      "process_set_ranks", [](int32_t id) { return runtime_slot().require("process_set_ranks")->process_set_ranks(id); },
      py::arg("id"), "The ranks of a registered process set (0: every rank).");
  module.def("kept_owners", [owners] { return owners->held(); },
             "How many owners of unfinished collectives the core keeps alive (finished ones are released).");

  module.def(
      "reconfigure",
      [](const std::string& policy, uint64_t partition_bytes, uint64_t credit_bytes, uint64_t fusion_bytes) {
        SchedulingSettings settings;
        settings.policy = policy == "fifo" ? Policy::kFifo : Policy::kPriority;
        settings.partition_bytes = partition_bytes;
        settings.credit_bytes = credit_bytes;
        settings.fusion_bytes = fusion_bytes;
        runtime_slot().require("reconfigure")->request_settings(settings);
      },
      py::arg("policy"), py::arg("partition_bytes"), py::arg("credit_bytes"), py::arg("fusion_bytes"),
      "Requests new scheduling settings; they switch on every rank in one cycle.");
  module.def(
      "scheduling_settings",
      [] {
        const SchedulingSettings settings = runtime_slot().require("config")->applied_settings();
        py::dict out;
        out["policy"] = settings.policy == Policy::kFifo ? "fifo" : "priority";
        out["partition_bytes"] = settings.partition_bytes;
        out["credit_bytes"] = settings.credit_bytes;
        out["fusion_bytes"] = settings.fusion_bytes;
        return out;
      },
      "The scheduling settings in effect now.");
  module.def("running", [] {
    auto runtime = runtime_slot().get();
    return runtime && runtime->running();
  }, "True while a runtime is up.");
  module.def("rank", [] { return runtime_slot().require("rank")->rank(); }, "This process's rank.");
  module.def("size", [] { return runtime_slot().require("size")->size(); }, "The number of ranks.");
  module.def("transport_name", [] { return runtime_slot().require("config")->transport_name(); }, "The active transport.");
  module.def("stats", [] { return stats_dict(runtime_slot().require("stats")->stats()); }, "Counters of the running core.");
  module.def("describe", [](const std::string& name) { return runtime_slot().require("describe")->describe(name); },
             "Where a pending tensor stands.");
  register_simulator(module);
  register_run_buffer(module, owners);
  register_timeline(module);
  register_host_copy(module);
}
