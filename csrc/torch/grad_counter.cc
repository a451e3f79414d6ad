// commsched._torch_hooks: the per-gradient path of commsched.torch's DistributedOptimizer in C++.
//
// Once gradients live in priority buckets, a gradient becoming ready only counts its bucket down;
// the last member's gradient sends the bucket. A Python post-accumulate-grad hook costs about a
// microsecond and a half per parameter (GIL, call, argument tuple), more than everything else the
// wrapper spends per gradient. Here the count runs in a post hook on the parameter's
// AccumulateGrad node, as DDP's Reducer does it, without the GIL; Python is called once per bucket,
// and for the rare cases (a gradient without a bucket, one ready again while in flight).
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/pybind.h>  // the at::Tensor caster; torch/extension.h would add 25 s of headers

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "capture_copies.h"  // beside this file: torch/ alone would search torch's headers first

namespace py = pybind11;

namespace commsched {
namespace {

// What the hook asks Python to do (the `kind` of on_event).
enum Event : int { kUnbucketed = 0, kAgain = 1, kBucketFull = 2 };

class GradCounter {
 public:
  GradCounter(int64_t slots, int64_t passes_per_step, py::function on_event)
      : passes_per_step_(passes_per_step),
        on_event_(std::move(on_event)),
        passes_(checked_count(slots), 0),
        used_(slots, 0),
        flying_(slots, 0),
        bucket_of_(slots, -1) {
    if (passes_per_step < 1) throw std::invalid_argument("passes_per_step must be at least 1");
  }

  GradCounter(const GradCounter&) = delete;
  GradCounter& operator=(const GradCounter&) = delete;

  ~GradCounter() { unhook_all(); }

  // Counts `slot` each time autograd has accumulated `param`'s gradient.
  void hook(const at::Tensor& param, int64_t slot) {
    check_slot(slot);
    if (hooks_.count(slot)) return;
    auto accumulator = torch::autograd::impl::grad_accumulator(param);
    if (!accumulator) throw std::invalid_argument("the parameter has no gradient accumulator (requires_grad=False?)");
    const uintptr_t key = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, slot](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          on_grad(slot);
          return outputs;
        }));
    // Held, as DDP holds them: the tensor keeps only a weak reference to its accumulator.
    hooks_.emplace(slot, Hook{std::move(accumulator), key});
  }

  void unhook(int64_t slot) {
    auto found = hooks_.find(slot);
    if (found == hooks_.end()) return;
    found->second.accumulator->del_post_hook(found->second.key);
    hooks_.erase(found);
  }

  void unhook_all() {
    for (auto& [slot, hook] : hooks_) hook.accumulator->del_post_hook(hook.key);
    hooks_.clear();
  }

  bool hooked(int64_t slot) const { return hooks_.count(slot) != 0; }

  // A new bucket layout: each slot's bucket (-1: none) and each bucket's member count.
  void set_buckets(const std::vector<int64_t>& bucket_of, const std::vector<int64_t>& members) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (bucket_of.size() != bucket_of_.size()) throw std::invalid_argument("one bucket per slot, -1 for none");
    for (int64_t bucket : bucket_of) {
      if (bucket < -1 || bucket >= static_cast<int64_t>(members.size()))
        throw std::invalid_argument("bucket index out of range");
    }
    bucket_of_ = bucket_of;
    members_ = members;
    waiting_ = members;
  }

  // Readies a bucket for the next iteration's gradients.
  void reset_bucket(int64_t bucket) {
    std::lock_guard<std::mutex> lock(mutex_);
    check_bucket(bucket);
    waiting_[bucket] = members_[bucket];
  }

  // Each slot's backward passes since the last call, which zeroes them.
  std::vector<int64_t> take_passes() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<int64_t> taken(passes_);
    std::fill(passes_.begin(), passes_.end(), 0);
    return taken;
  }

  // Whether each of `slots` reported its gradient (or was marked used), clearing the marks.
  std::vector<bool> take_used(const std::vector<int64_t>& slots) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<bool> taken;
    taken.reserve(slots.size());
    for (int64_t slot : slots) {
      check_slot(slot);
      taken.push_back(used_[slot] != 0);
      used_[slot] = 0;
    }
    return taken;
  }

  void set_used(int64_t slot) {
    std::lock_guard<std::mutex> lock(mutex_);
    check_slot(slot);
    used_[slot] = 1;
  }

  // Marks slots whose gradient is on the wire: a gradient ready again meanwhile is an error.
  void set_flying(const std::vector<int64_t>& slots, bool flying) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t slot : slots) {
      check_slot(slot);
      flying_[slot] = flying ? 1 : 0;
    }
  }

  // True once a gradient arrived since the last mark_closed().
  bool opened() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return opened_;
  }

  void mark_closed() {
    std::lock_guard<std::mutex> lock(mutex_);
    opened_ = false;
  }

 private:
  struct Hook {
    c10::intrusive_ptr<torch::autograd::Node> accumulator;
    uintptr_t key;
  };

  static size_t checked_count(int64_t slots) {
    if (slots < 0) throw std::invalid_argument("slots must not be negative");
    return static_cast<size_t>(slots);
  }

  void check_slot(int64_t slot) const {
    if (slot < 0 || slot >= static_cast<int64_t>(passes_.size())) throw std::out_of_range("slot index out of range");
  }

  void check_bucket(int64_t bucket) const {
    if (bucket < 0 || bucket >= static_cast<int64_t>(members_.size()))
      throw std::out_of_range("bucket index out of range");
  }

  // Runs on autograd's thread, usually without the GIL.
  void on_grad(int64_t slot) {
    int event = -1;
    int64_t bucket = -1;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      opened_ = true;
      const int64_t passes = ++passes_[slot];
      if (passes < passes_per_step_) return;
      bucket = bucket_of_[slot];
      if (bucket < 0) {
        event = kUnbucketed;
      } else if (flying_[slot]) {
        event = kAgain;
      } else if (passes == passes_per_step_) {  // later passes accumulate into the same, unsent bucket
        used_[slot] = 1;
        if (--waiting_[bucket] == 0) event = kBucketFull;
      }
    }
    if (event < 0) return;
    py::gil_scoped_acquire gil;
    on_event_(event, slot, bucket);  // a Python exception propagates into backward as its error
  }

  const int64_t passes_per_step_;
  py::function on_event_;
  mutable std::mutex mutex_;
  bool opened_ = false;
  std::vector<int64_t> passes_;
  std::vector<uint8_t> used_;
  std::vector<uint8_t> flying_;
  std::vector<int64_t> bucket_of_;
  std::vector<int64_t> members_;
  std::vector<int64_t> waiting_;
  std::unordered_map<int64_t, Hook> hooks_;
};

}  // namespace
}  // namespace commsched

PYBIND11_MODULE(_torch_hooks, m) {
  m.doc() =
      "commsched.torch's gradient counter (post hooks on AccumulateGrad nodes, no Python per gradient) and a "
      "checkpoint capture's host copies";
  m.attr("built_for_torch") = COMMSCHED_BUILT_FOR_TORCH;
  py::class_<commsched::GradCounter>(m, "GradCounter")
      .def(py::init<int64_t, int64_t, py::function>(), py::arg("slots"), py::arg("passes_per_step"),
           py::arg("on_event"))
      .def("hook", &commsched::GradCounter::hook, py::arg("param"), py::arg("slot"))
      .def("unhook", &commsched::GradCounter::unhook, py::arg("slot"))
      .def("unhook_all", &commsched::GradCounter::unhook_all)
      .def("hooked", &commsched::GradCounter::hooked, py::arg("slot"))
      .def("set_buckets", &commsched::GradCounter::set_buckets, py::arg("bucket_of"), py::arg("members"))
      .def("reset_bucket", &commsched::GradCounter::reset_bucket, py::arg("bucket"))
      .def("take_passes", &commsched::GradCounter::take_passes)
      .def("take_used", &commsched::GradCounter::take_used, py::arg("slots"))
      .def("set_used", &commsched::GradCounter::set_used, py::arg("slot"))
      .def("set_flying", &commsched::GradCounter::set_flying, py::arg("slots"), py::arg("flying"))
      .def("opened", &commsched::GradCounter::opened)
      .def("mark_closed", &commsched::GradCounter::mark_closed);
  commsched::register_capture_copies(m);
}
