// `commsched._core.allreduce_buffer` and `broadcast_buffer`: a synchronous collective on a host
// buffer in one call. It reads the array through Python's buffer protocol and waits with the GIL released,
// so a small collective pays for no Python-level view or handle objects (they cost more than
// the collective itself on shared memory). `allreduce_device` does the same for GPU memory that
// Python has viewed (the stream to order after is torch's or the array's own). The async forms,
// `allreduce_buffer_async` and `output_buffer_async` (reducescatter, allgather), return the handle.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings/owner_table.h"
#include "bindings/runtime_slot.h"
#include "core/runtime.h"

namespace py = pybind11;

namespace commsched {
namespace {

constexpr double kWaitSliceS = 0.2;  // between checks for Ctrl-C, as Handle.wait does

// Releases a buffer taken with PyObject_GetBuffer when it leaves scope.
class HeldBuffer {
 public:
  explicit HeldBuffer(PyObject* object) : held_(PyObject_GetBuffer(object, &view_, kFlags) == 0) {
    if (!held_) PyErr_Clear();  // the caller falls back to the path that names the problem
  }
  ~HeldBuffer() {
    if (held_) PyBuffer_Release(&view_);
  }
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;

  bool held() const { return held_; }
  const Py_buffer& view() const { return view_; }

 private:
  static constexpr int kFlags = PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT;
  Py_buffer view_{};
  bool held_;
};

// The dtype of a native-order buffer format, as commsched.buffers maps it; none if unsupported.
std::optional<DType> dtype_of(const char* format, Py_ssize_t itemsize) {
  if (format == nullptr) return DType::kUInt8;  // PyBUF_FORMAT unset means unsigned bytes
  while (*format == '@' || *format == '=' || *format == '<') ++format;
  if (format[0] == '\0' || format[1] != '\0') return std::nullopt;
  switch (format[0]) {
    case 'e': return itemsize == 2 ? std::optional<DType>(DType::kFloat16) : std::nullopt;
    case 'f': return itemsize == 4 ? std::optional<DType>(DType::kFloat32) : std::nullopt;
    case 'd': return itemsize == 8 ? std::optional<DType>(DType::kFloat64) : std::nullopt;
    case 'B': return itemsize == 1 ? std::optional<DType>(DType::kUInt8) : std::nullopt;
    case '?': return itemsize == 1 ? std::optional<DType>(DType::kBool) : std::nullopt;
    case 'b':
    case 'h':
    case 'i':
    case 'l':
    case 'q':
      if (itemsize == 1) return DType::kInt8;
      if (itemsize == 2) return DType::kInt16;
      if (itemsize == 4) return DType::kInt32;
      if (itemsize == 8) return DType::kInt64;
      return std::nullopt;
    default: return std::nullopt;
  }
}

// The spec of a collective on `buffer`; none when it is not a non-empty host buffer of a supported
// dtype (commsched.buffers.view then says why, or handles it if it is a torch or GPU tensor).
std::optional<TensorSpec> spec_of(const HeldBuffer& buffer, const std::string& name, ReduceOp op, CollectiveKind kind,
                                  int root, int priority) {
  if (!buffer.held() || buffer.view().len == 0) return std::nullopt;
  const std::optional<DType> dtype = dtype_of(buffer.view().format, buffer.view().itemsize);
  if (!dtype) return std::nullopt;
  TensorSpec spec;
  spec.name = name;
  spec.dtype = *dtype;
  spec.op = op;
  spec.kind = kind;
  spec.root = root;
  spec.count = static_cast<uint64_t>(buffer.view().len / buffer.view().itemsize);
  spec.priority = priority;
  // The trailing dims, as commsched._submit_view sends them: ranks whose shapes differ but whose
  // element counts agree must still fail the agreement.
  const Py_buffer& view = buffer.view();
  for (int dim = 1; dim < view.ndim && view.shape != nullptr; ++dim) {
    spec.row_shape.push_back(static_cast<uint64_t>(view.shape[dim]));
  }
  return spec;
}

// What keeps `array`'s memory in place until the collective ends: a memoryview keeps the buffer
// exported, so a bytearray cannot resize and an array cannot be freed under the core.
py::object keeper_of(py::handle array) {
  py::object keeper = py::reinterpret_steal<py::object>(PyMemoryView_FromObject(array.ptr()));
  if (!keeper) {
    PyErr_Clear();
    keeper = py::reinterpret_borrow<py::object>(array);
  }
  return keeper;
}

// Sum or average from commsched's op argument, and a priority that fits 32 bits; none when
// Python must check them and name what is wrong (or take a numpy integer priority).
std::optional<std::pair<ReduceOp, int>> checked_op_priority(py::handle op, py::handle priority_object) {
  const bool average = PyUnicode_Check(op.ptr()) && PyUnicode_CompareWithASCIIString(op.ptr(), "average") == 0;
  const bool sum = PyUnicode_Check(op.ptr()) && PyUnicode_CompareWithASCIIString(op.ptr(), "sum") == 0;
  int overflow = 0;
  const bool exact_int = PyLong_CheckExact(priority_object.ptr());
  const long long priority = exact_int ? PyLong_AsLongLongAndOverflow(priority_object.ptr(), &overflow) : 0;
  const bool priority_fits = exact_int && overflow == 0 && priority >= INT32_MIN && priority <= INT32_MAX;
  if (!(sum || average) || !priority_fits) return std::nullopt;
  return std::make_pair(average ? ReduceOp::kAverage : ReduceOp::kSum, static_cast<int>(priority));
}

// Waits for `handle` in slices with the GIL released. 1: done; 0: timed out (or a signal, which is
// raised). A collective this call stops waiting for keeps `keeper()` until it ends.
template <typename Keeper>
int wait_sliced(Runtime& runtime, const std::shared_ptr<HandleState>& handle, double timeout_s, OwnerTable& owners,
                Keeper keeper) {
  using Clock = std::chrono::steady_clock;
  const bool limited = timeout_s >= 0;
  const Clock::time_point start = limited ? Clock::now() : Clock::time_point{};  // no clock read without a limit
  while (true) {
    double slice = kWaitSliceS;
    if (limited) slice = std::min(slice, timeout_s - std::chrono::duration<double>(Clock::now() - start).count());
    bool finished;
    {
      py::gil_scoped_release release;
      finished = runtime.wait(*handle, std::max(slice, 0.0));
    }
    if (finished) {
      if (handle->failed()) handle->throw_failure();  // raised as a commsched.CommschedError
      return 1;
    }
    const bool timed_out = limited && std::chrono::duration<double>(Clock::now() - start).count() >= timeout_s;
    const bool interrupted = !timed_out && PyErr_CheckSignals() != 0;
    if (timed_out || interrupted) {
      // The collective goes on without this call: its memory must stay in place until it finishes.
      std::optional<py::error_already_set> signal;
      if (interrupted) signal.emplace();  // fetched first: no Python call may run with it set
      owners.keep(handle, keeper());
      if (signal) throw *signal;
      return 0;
    }
  }
}

// Starts `kind` on a host buffer without waiting: its handle and spec, or none where Python must check
// the arguments or the array and name what is wrong. `owners` keeps the buffer until it finishes.
std::optional<std::pair<std::shared_ptr<HandleState>, TensorSpec>> start_buffer(
    py::handle array, const std::string& name, py::handle op, py::handle priority_object, CollectiveKind kind,
    bool wake_core, const char* caller, OwnerTable& owners) {
  const auto checked = checked_op_priority(op, priority_object);
  if (name.empty() || !checked) return std::nullopt;
  HeldBuffer buffer(array.ptr());
  std::optional<TensorSpec> spec = spec_of(buffer, name, checked->first, kind, 0, checked->second);
  if (!spec) return std::nullopt;
  auto handle = runtime_slot().require(caller)->enqueue(*spec, buffer.view().buf, wake_core);
  owners.keep(handle, keeper_of(array));
  return std::make_pair(std::move(handle), std::move(*spec));
}

// 1: done; 0: timed out; -1: not a writable, contiguous host buffer of a supported dtype.
int run_buffer(py::handle array, const std::string& name, ReduceOp op, CollectiveKind kind, int root, int priority,
               double timeout_s, OwnerTable& owners) {
  HeldBuffer buffer(array.ptr());
  const std::optional<TensorSpec> spec = spec_of(buffer, name, op, kind, root, priority);
  if (!spec) return -1;
  const std::shared_ptr<Runtime> runtime =
      runtime_slot().require(kind == CollectiveKind::kBroadcast ? "broadcast" : "allreduce");
  // This thread waits next and runs the core itself: waking the core's thread would only take a CPU.
  const std::shared_ptr<HandleState> handle = runtime->enqueue(*spec, buffer.view().buf, /*wake_core=*/false);
  // A memoryview keeps the buffer exported (a bytearray cannot resize, an array cannot be freed).
  return wait_sliced(*runtime, handle, timeout_s, owners, [array] { return keeper_of(array); });
}

// A synchronous allreduce of GPU memory that commsched.buffers has viewed: `view` is (address, count,
// dtype name, device id, producing stream or None, owner, trailing dims). 1: done; 0: timed out.
int run_device_allreduce(const std::string& name, ReduceOp op, int priority, double timeout_s, const py::tuple& view,
                         OwnerTable& owners) {
  TensorSpec spec;
  spec.name = name;
  spec.kind = CollectiveKind::kAllreduce;
  spec.op = op;
  spec.priority = priority;
  spec.count = view[1].cast<uint64_t>();
  spec.dtype = dtype_from_name(view[2].cast<std::string>());
  spec.row_shape = view[6].cast<std::vector<uint64_t>>();
  Placement placement;
  placement.device = true;
  placement.device_id = view[3].cast<int>();
  if (!view[4].is_none()) placement.stream = view[4].cast<uintptr_t>();
  const std::shared_ptr<Runtime> runtime = runtime_slot().require("allreduce");
  const std::shared_ptr<HandleState> handle =
      runtime->enqueue(spec, reinterpret_cast<void*>(view[0].cast<uintptr_t>()), /*wake_core=*/false, placement);
  py::object owner = view[5];
  return wait_sliced(*runtime, handle, timeout_s, owners, [owner] { return owner; });
}

}  // namespace
}  // namespace commsched

void register_run_buffer(py::module_& module, std::shared_ptr<commsched::OwnerTable> owners) {
  // Functions of at most six arguments each: pybind11 takes up to six without an allocation.
  module.def(
      "allreduce_buffer",
      [owners](py::handle array, const std::string& name, py::handle op, py::handle priority_object, double timeout_s) {
        // Arguments commsched.allreduce has not checked yet: -2 sends the call to the path that
        // names what is wrong with them (or takes a numpy integer priority; a bool is refused).
        const auto checked = commsched::checked_op_priority(op, priority_object);
        if (name.empty() || !checked) return -2;
        return commsched::run_buffer(array, name, checked->first, commsched::CollectiveKind::kAllreduce, 0,
                                     checked->second, timeout_s, *owners);
      },
      py::arg("array"), py::arg("name"), py::arg("op"), py::arg("priority"), py::arg("timeout_s"),
      "Allreduces a host buffer in place and waits (timeout_s < 0: no limit); 1 done, 0 timed out, "
      "-1 not a host buffer this call takes, -2 a name, op or priority to check in Python.");
  module.def(
      "allreduce_buffer_async",
      [owners](py::handle array, const std::string& name, py::handle op, py::handle priority_object,
               bool wake_core) -> py::object {
        // As allreduce_buffer, without the wait: the handle, or None for the path that checks the
        // arguments and the array in Python and names what is wrong.
        const auto started = commsched::start_buffer(array, name, op, priority_object,
                                                     commsched::CollectiveKind::kAllreduce, wake_core,
                                                     "allreduce_async", *owners);
        return started ? py::cast(started->first) : py::none();
      },
      py::arg("array"), py::arg("name"), py::arg("op"), py::arg("priority"), py::arg("wake_core"),
      "Starts an in-place allreduce of a host buffer and returns its handle; None: a name, op, priority or "
      "array to check in Python.");
  module.def(
      "output_buffer_async",
      [owners](py::handle array, const std::string& name, const std::string& kind, py::handle op,
               py::handle priority_object, bool wake_core) -> py::object {
        // A reducescatter or allgather of a host buffer in one call, as allreduce_buffer_async:
        // (handle, dtype name, row shape), or None for the path that checks everything in Python and
        // names what is wrong (scale factors and process sets always take that path).
        const bool scatter = kind == "reducescatter";
        if (!scatter && kind != "allgather") return py::none();
        const auto started = commsched::start_buffer(
            array, name, op, priority_object,
            scatter ? commsched::CollectiveKind::kReducescatter : commsched::CollectiveKind::kAllgather, wake_core,
            scatter ? "reducescatter_async" : "allgather_async", *owners);
        if (!started) return py::none();
        const commsched::TensorSpec& spec = started->second;
        return py::make_tuple(py::cast(started->first), py::str(commsched::dtype_name(spec.dtype)),
                              py::tuple(py::cast(spec.row_shape)));
      },
      py::arg("array"), py::arg("name"), py::arg("kind"), py::arg("op"), py::arg("priority"), py::arg("wake_core"),
      "Starts a reducescatter or allgather of a host buffer and returns (handle, dtype name, row shape); None: a "
      "name, op, priority or array to check in Python.");
  module.def(
      "allreduce_device",
      [owners](const std::string& name, py::handle op, py::handle priority_object, double timeout_s,
               const py::tuple& view) {
        // As allreduce_buffer, for GPU memory already viewed in Python (commsched.buffers): -2 sends
        // a name, op or priority that needs checking to the path that names what is wrong.
        const auto checked = commsched::checked_op_priority(op, priority_object);
        if (name.empty() || !checked || view.size() != 7) return -2;
        return commsched::run_device_allreduce(name, checked->first, checked->second, timeout_s, view, *owners);
      },
      py::arg("name"), py::arg("op"), py::arg("priority"), py::arg("timeout_s"), py::arg("view"),
      "Allreduces viewed GPU memory in place and waits until it is done (timeout_s < 0: no limit); view is "
      "(address, count, dtype, device id, stream or None, owner, trailing dims). 1 done, 0 timed out, -2 a name, "
      "op or priority to check in Python.");
  module.def(
      "broadcast_buffer",
      [owners](py::handle array, const std::string& name, int root, int priority, double timeout_s) {
        return commsched::run_buffer(array, name, commsched::ReduceOp::kSum, commsched::CollectiveKind::kBroadcast,
                                     root, priority, timeout_s, *owners);
      },
      py::arg("array"), py::arg("name"), py::arg("root"), py::arg("priority"), py::arg("timeout_s"),
      "Broadcasts a host buffer in place from `root` and waits (timeout_s < 0: no limit); "
      "1 done, 0 timed out, -1 not a host buffer this call takes.");
}
