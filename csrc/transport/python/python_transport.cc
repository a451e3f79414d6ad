#include "transport/python/python_transport.h"

#include <pybind11/stl.h>

namespace py = pybind11;

namespace commsched {

namespace {

// The Python exception as "Type: message", without the traceback pybind11 appends to what(): the
// text ends up in handle errors, which should read as one sentence. Called with the GIL held.
std::string error_text(const py::error_already_set& error) {
  try {
    const std::string message = py::str(error.value()).cast<std::string>();
    const std::string type = py::str(error.type().attr("__name__")).cast<std::string>();
    return message.empty() ? type : type + ": " + message;
  } catch (const std::exception&) {
    return error.what();
  }
}

class PythonOp : public PendingOp {
 public:
  explicit PythonOp(py::object op) : op_(std::move(op)) {}
  ~PythonOp() override {
    py::gil_scoped_acquire gil;
    op_ = py::object();
  }
  bool test() override {
    py::gil_scoped_acquire gil;
    try {
      return op_.attr("test")().cast<bool>();
    } catch (const py::error_already_set& error) {
      throw CommError(std::string("collective failed: ") + error_text(error));
    }
  }

 private:
  py::object op_;
};

}  // namespace

PythonTransport::PythonTransport(py::object impl)
    : impl_(std::move(impl)),
      rank_(impl_.attr("rank").cast<int>()),
      size_(impl_.attr("size").cast<int>()),
      name_(impl_.attr("name").cast<std::string>()),
      poll_interval_(py::hasattr(impl_, "poll_interval_us") ? impl_.attr("poll_interval_us").cast<int64_t>() : 200),
      // Looked up once: the hooks run per fused chunk and per averaged collective.
      has_copy_(py::hasattr(impl_, "copy")),
      has_scale_(py::hasattr(impl_, "scale")),
      has_unsupported_(py::hasattr(impl_, "unsupported")),
      // Without add_process_set a transport takes only sets of every rank, which run as its own collectives.
      has_process_sets_(py::hasattr(impl_, "add_process_set")),
      host_memory_(!py::hasattr(impl_, "host_memory") || impl_.attr("host_memory").cast<bool>()) {}

PythonTransport::~PythonTransport() {
  py::gil_scoped_acquire gil;
  if (py::hasattr(impl_, "close")) {
    try {
      impl_.attr("close")();
    } catch (const py::error_already_set& error) {
      // Nothing is left to fail: say so on stderr, as the interpreter does for errors in __del__.
      PySys_WriteStderr("commsched: closing the %s transport failed: %s\n", name_.c_str(), error_text(error).c_str());
    }
  }
  impl_ = py::object();
}

std::vector<std::string> PythonTransport::exchange(const std::string& mine, double timeout_s) {
  py::gil_scoped_acquire gil;
  try {
    py::list gathered = impl_.attr("exchange")(py::bytes(mine), timeout_s);
    std::vector<std::string> reports;
    reports.reserve(gathered.size());
    for (const py::handle& item : gathered) reports.push_back(item.cast<std::string>());
    return reports;
  } catch (const py::error_already_set& error) {
    throw CommError(name_ + " agreement exchange failed: " + error_text(error));
  }
}

std::unique_ptr<PendingOp> PythonTransport::start(const WireOp& op) {
  py::gil_scoped_acquire gil;
  try {
    py::object pending;
    // Only set collectives name their set, so transports without process sets keep their signature.
    py::dict extra;
    if (op.process_set != 0 && has_process_sets_) extra["process_set"] = op.process_set;
    const auto address = reinterpret_cast<uintptr_t>(op.data);
    const bool plain = op.op == ReduceOp::kSum || op.op == ReduceOp::kAverage;
    if (kind_has_output(op.kind)) {
      pending = impl_.attr("start_collective")(kind_name(op.kind), dtype_name(op.dtype), op_name(op.op), address,
                                               op.count, reinterpret_cast<uintptr_t>(op.output), op.recv_counts,
                                               op.send_counts, op.layout, **extra);
    } else if (op.kind == CollectiveKind::kAllreduce && !plain) {
      pending = impl_.attr("start")(address, op.count, dtype_name(op.dtype), kind_name(op.kind), op.root,
                                    py::arg("op") = op_name(op.op), **extra);
    } else {
      // Sum (the core divides for "average") or broadcast: the call every Python transport takes.
      pending = impl_.attr("start")(address, op.count, dtype_name(op.dtype), kind_name(op.kind), op.root, **extra);
    }
    if (doorbell_ && py::hasattr(pending, "on_done")) {
      // The callback may run on the library's own thread holding the GIL: let go of it
      // before taking the core's lock, which the core may hold while waiting for the GIL.
      pending.attr("on_done")(py::cpp_function([bell = doorbell_]() {
        py::gil_scoped_release released;
        bell->ring();
      }));
    }
    return std::make_unique<PythonOp>(std::move(pending));
  } catch (const py::error_already_set& error) {
    throw CommError(name_ + " failed to start a " + kind_name(op.kind) + ": " + error_text(error));
  }
}

void PythonTransport::add_process_set(int32_t id, const std::vector<int>& ranks) {
  py::gil_scoped_acquire gil;
  if (!py::hasattr(impl_, "add_process_set")) return Transport::add_process_set(id, ranks);
  try {
    impl_.attr("add_process_set")(id, ranks);
  } catch (const py::error_already_set& error) {
    throw CommError(name_ + " failed to build process set " + std::to_string(id) + ": " + error_text(error));
  }
}

void PythonTransport::remove_process_set(int32_t id) {
  py::gil_scoped_acquire gil;
  if (!py::hasattr(impl_, "remove_process_set")) return;
  try {
    impl_.attr("remove_process_set")(id);
  } catch (const py::error_already_set& error) {
    throw CommError(name_ + " failed to remove process set " + std::to_string(id) + ": " + error_text(error));
  }
}

std::string PythonTransport::unsupported(const TensorSpec& spec) const {
  const std::string basic = Transport::unsupported(spec);
  if (basic.empty() || !has_unsupported_) return basic;
  // Bools reach the transport as uint8 (see WireOp): asked about in that form.
  const DType wire_dtype = spec.dtype == DType::kBool ? DType::kUInt8 : spec.dtype;
  py::gil_scoped_acquire gil;
  try {
    return impl_.attr("unsupported")(kind_name(spec.kind), dtype_name(wire_dtype), op_name(spec.op)).cast<std::string>();
  } catch (const py::error_already_set& error) {
    return "the " + name_ + " transport could not say whether it runs " + kind_name(spec.kind) + ": " + error.what();
  }
}

void PythonTransport::copy(void* dst, const void* src, size_t bytes) {
  if (!has_copy_) return Transport::copy(dst, src, bytes);
  py::gil_scoped_acquire gil;
  try {
    impl_.attr("copy")(reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(src), bytes);
  } catch (const py::error_already_set& error) {
    throw CommError(name_ + " failed to copy a fused chunk: " + error_text(error));
  }
}

void PythonTransport::scale(void* data, uint64_t count, DType dtype, double divisor) {
  if (!has_scale_) return Transport::scale(data, count, dtype, divisor);
  py::gil_scoped_acquire gil;
  try {
    impl_.attr("scale")(reinterpret_cast<uintptr_t>(data), count, dtype_name(dtype), divisor);
  } catch (const py::error_already_set& error) {
    throw CommError(name_ + " failed to average: " + error_text(error));
  }
}

}  // namespace commsched
