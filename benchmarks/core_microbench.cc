// Cost of the scheduling core alone (no transport): scheduler per chunk and agreement
// per tensor, in steady state. Driven by benchmarks/core_microbench.py.
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/agreement.h"
#include "core/scheduler.h"

using namespace commsched;
using Clock = std::chrono::steady_clock;

namespace {

std::vector<TensorSpec> make_model(int tensors, std::mt19937& random) {
  std::vector<TensorSpec> model;
  for (int i = 0; i < tensors; ++i) {
    TensorSpec spec;
    spec.name = "model.layer" + std::to_string(i / 4) + ".param" + std::to_string(i % 4);
    // Mostly small tensors (biases, norms), some large weights, as in real models.
    spec.count = random() % 10 == 0 ? (1u << 18) + random() % (4u << 20) : 64 + random() % 16384;
    spec.priority = i;
    model.push_back(spec);
  }
  return model;
}

double scheduler_ns_per_chunk(const std::vector<TensorSpec>& model, int iterations, uint64_t* chunks_out) {
  SchedulingSettings settings;  // the defaults: 4 MiB partition, 8 MiB credit, 1 MiB fusion
  Scheduler scheduler(settings);
  uint64_t chunks = 0;
  const auto start = Clock::now();
  for (int iteration = 0; iteration < iterations; ++iteration) {
    // Backward order: the last layer's gradient is ready first; 16 tensors per cycle.
    for (size_t i = model.size(); i-- > 0;) {
      chunks += scheduler.add(i, model[i]);
      if (i % 16 == 0) {
        for (const Launch& launch : scheduler.next_launches()) (void)launch;
        scheduler.set_completed_bytes(scheduler.launched_bytes());
      }
    }
    while (scheduler.queued_chunks() > 0) {
      for (const Launch& launch : scheduler.next_launches()) (void)launch;
      scheduler.set_completed_bytes(scheduler.launched_bytes());
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  *chunks_out = chunks;
  return seconds * 1e9 / static_cast<double>(chunks);
}

double agreement_ns_per_tensor(const std::vector<TensorSpec>& model, int ranks, int iterations) {
  std::vector<Agreement> world;
  for (int r = 0; r < ranks; ++r) world.emplace_back(r, ranks);
  auto run = [&](int rounds) {
    for (int round = 0; round < rounds; ++round) {
      for (size_t i = 0; i < model.size(); ++i) {
        for (Agreement& agreement : world) agreement.announce(model[i]);
        if (i % 16 == 15 || i + 1 == model.size()) {
          std::vector<std::string> reports;
          for (Agreement& agreement : world) reports.push_back(agreement.build_report({}));
          for (Agreement& agreement : world) agreement.apply(reports, 0);
        }
      }
    }
  };
  run(1);  // the first iteration fills the name cache, as training's first step does
  const auto start = Clock::now();
  run(iterations);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // Each rank does its own build and apply; report the cost one rank pays per tensor.
  return seconds * 1e9 / static_cast<double>(model.size() * iterations * ranks);
}

}  // namespace

int main(int argc, char** argv) {
  const int tensors = argc > 1 ? std::atoi(argv[1]) : 2000;
  const int iterations = argc > 2 ? std::atoi(argv[2]) : 50;
  std::mt19937 random(1);
  const std::vector<TensorSpec> model = make_model(tensors, random);
  uint64_t chunks = 0;
  const double per_chunk = scheduler_ns_per_chunk(model, iterations, &chunks);
  const double per_tensor_2 = agreement_ns_per_tensor(model, 2, iterations / 5 + 1);
  const double per_tensor_8 = agreement_ns_per_tensor(model, 8, iterations / 5 + 1);
  std::printf("{\"tensors\": %d, \"iterations\": %d, \"chunks\": %llu, \"scheduler_ns_per_chunk\": %.1f, "
              "\"agreement_ns_per_tensor_2_ranks\": %.1f, \"agreement_ns_per_tensor_8_ranks\": %.1f}\n",
              tensors, iterations, static_cast<unsigned long long>(chunks), per_chunk, per_tensor_2, per_tensor_8);
  return 0;
}
