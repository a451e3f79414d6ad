// Python bindings of the simulator (`commsched._core.simulate`, `simulate_ideal`),
// registered into the `_core` module by register_simulator().
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <vector>

#include "core/types.h"
#include "sim/simulator.h"

namespace py = pybind11;
using namespace commsched;

namespace {

// (name, forward seconds, backward seconds, [gradient bytes per parameter]) per layer, forward order.
using LayerTuple = std::tuple<std::string, double, double, std::vector<uint64_t>>;

std::vector<sim::LayerSpec> to_layers(const std::vector<LayerTuple>& tuples) {
  std::vector<sim::LayerSpec> layers;
  layers.reserve(tuples.size());
  for (const auto& [name, forward_s, backward_s, params] : tuples) {
    layers.push_back(sim::LayerSpec{name, forward_s, backward_s, params});
  }
  return layers;
}

using SizeCostTuple = std::pair<uint64_t, double>;

constexpr const char* kAlgorithms = "ring, recursive-doubling, halving-doubling, tree, mpich or nccl";

sim::Algorithm to_algorithm(const std::string& name) {
  if (name == "ring") return sim::Algorithm::kRing;
  if (name == "recursive-doubling") return sim::Algorithm::kRecursiveDoubling;
  if (name == "halving-doubling") return sim::Algorithm::kHalvingDoubling;
  if (name == "tree") return sim::Algorithm::kTree;
  if (name == "mpich") return sim::Algorithm::kMpich;
  if (name == "nccl") return sim::Algorithm::kNccl;
  throw UsageError("algorithm '" + name + "' is not one of " + kAlgorithms);
}

const char* algorithm_name(sim::Algorithm algorithm) {
  switch (algorithm) {
    case sim::Algorithm::kRecursiveDoubling:
      return "recursive-doubling";
    case sim::Algorithm::kHalvingDoubling:
      return "halving-doubling";
    case sim::Algorithm::kTree:
      return "tree";
    case sim::Algorithm::kMpich:
      return "mpich";
    case sim::Algorithm::kNccl:
      return "nccl";
    case sim::Algorithm::kRing:
    default:
      return "ring";
  }
}

sim::NetworkSpec to_network(int ranks, double bandwidth_bytes_per_s, double latency_s,
                           const std::string& link = "fifo", const std::vector<SizeCostTuple>& size_costs = {},
                           const std::string& algorithm = "ring") {
  if (link != "fifo" && link != "fair") throw UsageError("link must be 'fifo' or 'fair'");
  if (ranks < 2) throw UsageError("the network model needs at least 2 ranks, got " + std::to_string(ranks));
  sim::NetworkSpec network{ranks, bandwidth_bytes_per_s, latency_s,
                           link == "fair" ? sim::LinkSharing::kFair : sim::LinkSharing::kFifo, {},
                           to_algorithm(algorithm)};
  for (const auto& [bytes, factor] : size_costs) network.size_costs.push_back(sim::SizeCost{bytes, factor});
  return network;
}

py::dict to_dict(const sim::SimResult& result) {
  py::dict out;
  out["iteration_s"] = result.iteration_s;
  out["compute_s"] = result.compute_s;
  out["communication_s"] = result.communication_s;
  out["bound_s"] = result.bound_s;
  out["sum_s"] = result.sum_s;
  out["launches"] = result.launches;
  out["fused_launches"] = result.fused_launches;
  out["cycles"] = result.cycles;
  out["max_bytes_in_flight"] = result.max_bytes_in_flight;
  out["iteration_starts_s"] = result.iteration_starts_s;
  return out;
}

}  // namespace

void register_simulator(py::module_& module) {
  module.def(
      "simulate",
      [](const std::vector<LayerTuple>& layers, int ranks, double bandwidth_bytes_per_s, double latency_s,
         const std::string& policy, uint64_t partition_bytes, uint64_t credit_bytes, uint64_t fusion_bytes,
         const std::string& mode, double cycle_time_s, double exchange_s, int iterations, int warmup,
         const std::string& link, const std::vector<SizeCostTuple>& size_costs, const std::string& algorithm,
         const std::string& rounds, bool shard) {
        if (policy != "priority" && policy != "fifo") throw UsageError("policy must be 'priority' or 'fifo'");
        if (mode != "barrier" && mode != "overlap") throw UsageError("mode must be 'barrier' or 'overlap'");
        if (rounds != "data" && rounds != "channel") throw UsageError("rounds must be 'data' or 'channel'");
        sim::SimSettings settings;
        settings.rounds_behind_data = rounds == "data";
        settings.scheduling = SchedulingSettings{policy == "fifo" ? Policy::kFifo : Policy::kPriority,
                                                 partition_bytes, credit_bytes, fusion_bytes};
        settings.mode = mode == "barrier" ? sim::Mode::kBarrier : sim::Mode::kOverlap;
        settings.cycle_time_s = cycle_time_s;
        settings.exchange_s = exchange_s;
        settings.iterations = iterations;
        settings.warmup = warmup;
        settings.shard = shard;
        const auto spec = to_layers(layers);
        sim::SimResult result;
        {
          py::gil_scoped_release release;
          result = sim::simulate(spec, to_network(ranks, bandwidth_bytes_per_s, latency_s, link, size_costs, algorithm),
                                 settings);
        }
        return to_dict(result);
      },
      py::arg("layers"), py::arg("ranks"), py::arg("bandwidth_bytes_per_s"), py::arg("latency_s"),
      py::arg("policy"), py::arg("partition_bytes"), py::arg("credit_bytes"), py::arg("fusion_bytes"),
      py::arg("mode"), py::arg("cycle_time_s") = 0.001, py::arg("exchange_s") = -1.0, py::arg("iterations") = 6,
      py::arg("warmup") = 2, py::arg("link") = "fifo", py::arg("size_costs") = std::vector<SizeCostTuple>{},
      py::arg("algorithm") = "ring", py::arg("rounds") = "data", py::arg("shard") = false,
      "Predicts the iteration time of a profile under the real Scheduler and a network model; rounds='data' "
      "queues agreement rounds behind the bytes on the link (rounds in the transport's own connection), "
      "'channel' does not (the TCP control channel, low-delay marked, the default across hosts). shard=True "
      "replays ZeRO-2's split: reduce-scatters in backward, each half an allreduce's cost, then each parameter's "
      "step and all-gather (overlap: once its own reduce-scatter is done; barrier: once all are).");

  module.def(
      "simulate_ideal",
      [](const std::vector<LayerTuple>& layers, int ranks, double bandwidth_bytes_per_s, int iterations,
         int warmup, double latency_s, const std::string& algorithm, bool shard) {
        const auto spec = to_layers(layers);
        const auto network = to_network(ranks, bandwidth_bytes_per_s, latency_s, "fifo", {}, algorithm);
        sim::SimResult result;
        {
          py::gil_scoped_release release;
          result = sim::simulate_ideal(spec, network, iterations, warmup, shard);
        }
        return to_dict(result);
      },
      py::arg("layers"), py::arg("ranks"), py::arg("bandwidth_bytes_per_s"), py::arg("iterations") = 6,
      py::arg("warmup") = 2, py::arg("latency_s") = 0.0, py::arg("algorithm") = "ring", py::arg("shard") = false,
      "The best schedule possible: overlap with an infinitely preemptive, zero-overhead link; each reduction "
      "moves the algorithm's wire bytes and pays its latency once (ring: 2(n-1) * latency_s) after its last byte. "
      "shard=True: the best for ZeRO-2's split, each reduce-scatter and all-gather half of that, a parameter's "
      "all-gather starting once its reduce-scatter is done and the backward has ended.");

  module.def(
      "allreduce_cost",
      [](uint64_t bytes, int ranks, const std::string& algorithm, double bandwidth_bytes_per_s, double latency_s) {
        const auto network = to_network(ranks, bandwidth_bytes_per_s, latency_s, "fifo", {}, algorithm);
        const sim::CollectiveCost cost = sim::collective_cost(bytes, network);
        py::dict out;
        out["algorithm"] = algorithm_name(sim::resolve_algorithm(bytes, network));
        out["steps"] = cost.steps;
        out["wire_bytes"] = cost.wire_bytes;
        out["seconds"] = sim::allreduce_s(bytes, network);
        return out;
      },
      py::arg("bytes"), py::arg("ranks"), py::arg("algorithm") = "ring", py::arg("bandwidth_bytes_per_s") = 1.25e9,
      py::arg("latency_s") = 0.0,
      "The simulator's model of one allreduce of `bytes` alone on the link: the algorithm run (a library's "
      "choice resolved for this size), its message latencies (steps), wire bytes per rank and seconds.");

  module.def(
      "ring_allreduce_s",
      [](uint64_t bytes, int ranks, double bandwidth_bytes_per_s, double latency_s) {
        return sim::ring_allreduce_s(bytes, to_network(ranks, bandwidth_bytes_per_s, latency_s));
      },
      py::arg("bytes"), py::arg("ranks"), py::arg("bandwidth_bytes_per_s"), py::arg("latency_s"),
      "Modelled time of one ring allreduce: 2(n-1)/n * bytes / bandwidth + 2(n-1) * latency.");
}
