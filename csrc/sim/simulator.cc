#include "sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <stdexcept>
#include <unordered_map>

#include "core/scheduler.h"
#include "core/settings.h"

namespace commsched::sim {

namespace {

// Past this much virtual time the replay has stopped making progress.
constexpr double kHorizonS = 1e7;

struct Param {
  uint32_t layer = 0;
  uint64_t bytes = 0;
  int32_t priority = 0;  // position in the forward pass: what the next forward needs first
};

std::vector<Param> flatten(const std::vector<LayerSpec>& layers) {
  std::vector<Param> params;
  for (size_t l = 0; l < layers.size(); ++l) {
    for (uint64_t bytes : layers[l].param_bytes) {
      params.push_back(Param{static_cast<uint32_t>(l), bytes, static_cast<int32_t>(params.size())});
    }
  }
  return params;
}

// Tensor ids: iteration * params + index; with the split, (2 * iteration + phase) * params + index, phase 0
// the reduce-scatter of the gradient and 1 the all-gather of the updated parameter.
struct Ids {
  uint64_t params = 1;
  bool shard = false;
  const Param& param(const std::vector<Param>& all, uint64_t id) const { return all[id % params]; }
  bool gather(uint64_t id) const { return shard && (id / params) % 2 == 1; }
  // What one collective of the tensor costs relative to an allreduce of it: the split moves half.
  double share() const { return shard ? 0.5 : 1.0; }
  CollectiveKind kind(uint64_t id) const {
    if (!shard) return CollectiveKind::kAllreduce;
    return gather(id) ? CollectiveKind::kAllgather : CollectiveKind::kReducescatter;
  }
};

// Where gradients go once ready: the modelled runtime, or the ideal link.
class Comm {
 public:
  virtual ~Comm() = default;
  virtual void submit(double now_s, uint64_t tensor_id) = 0;
  virtual double next_event_s() const = 0;
  // Processes every event up to `now_s`; returns the tensors whose reduction is now visible.
  virtual std::vector<uint64_t> advance(double now_s) = 0;
};

// The training loop of one rank: forward layer by layer, backward in reverse, each
// layer's gradients handed to Comm as its backward ends.
class Trainer {
 public:
  // With the split, `eager_gather` steps each parameter and starts its all-gather once its own
  // reduce-scatter is done after the backward (overlap); otherwise the step waits for every
  // reduce-scatter and then starts the all-gathers in forward order (barrier).
  Trainer(const std::vector<LayerSpec>& layers, const std::vector<Param>& params, Mode mode, int iterations,
          Ids ids, bool eager_gather)
      : layers_(layers),
        params_(params),
        mode_(mode),
        iterations_(iterations),
        ids_(ids),
        eager_gather_(eager_gather),
        pending_(layers.size(), 0) {
    for (size_t l = 0; l < layers.size(); ++l) ops_.push_back(Op{true, static_cast<uint32_t>(l)});
    for (size_t l = layers.size(); l-- > 0;) ops_.push_back(Op{false, static_cast<uint32_t>(l)});
    params_of_layer_.resize(layers.size());
    for (size_t p = 0; p < params.size(); ++p) params_of_layer_[params[p].layer].push_back(p);
  }

  bool finished() const { return finished_; }
  double next_event_s() const { return running_ ? op_end_s_ : kNever; }
  const std::vector<double>& starts() const { return starts_; }

  void on_done(uint64_t tensor_id, double now_s, Comm& comm) {
    const Param& param = ids_.param(params_, tensor_id);
    if (ids_.shard && !ids_.gather(tensor_id)) {
      // A reduced gradient shard: the parameter still waits for its step and all-gather.
      --scatters_left_;
      stepped_ids_.push_back(tensor_id + params_.size());
      if (stepped_) start_gathers(now_s, comm);
      return;
    }
    --pending_[param.layer];
    --total_pending_;
  }

  // Ends the running op if its time has come and starts whatever may start now.
  void advance(double now_s, Comm& comm) {
    while (!finished_) {
      if (running_) {
        if (op_end_s_ > now_s) return;
        finish_op(op_end_s_, comm);
      }
      if (!try_start(now_s)) return;
    }
  }

 private:
  struct Op {
    bool forward = true;
    uint32_t layer = 0;
  };

  bool try_start(double now_s) {
    const Op& op = ops_[op_index_];
    if (op.forward) {
      const bool gated = mode_ == Mode::kOverlap ? pending_[op.layer] > 0 : (op.layer == 0 && total_pending_ > 0);
      if (gated) return false;
      if (op_index_ == 0) {
        starts_.push_back(now_s);
        if (iteration_ == iterations_) {
          finished_ = true;
          return false;
        }
      }
    }
    const LayerSpec& layer = layers_[op.layer];
    running_ = true;
    op_end_s_ = now_s + (op.forward ? layer.forward_s : layer.backward_s);
    return true;
  }

  // Starts the all-gathers whose step may run now, in forward order.
  void start_gathers(double now_s, Comm& comm) {
    if (!eager_gather_ && scatters_left_ > 0) return;
    std::sort(stepped_ids_.begin(), stepped_ids_.end());
    for (uint64_t id : stepped_ids_) comm.submit(now_s, id);
    stepped_ids_.clear();
  }

  void finish_op(double now_s, Comm& comm) {
    running_ = false;
    const Op& op = ops_[op_index_];
    if (!op.forward) {
      if (op_index_ == layers_.size()) stepped_ = false;  // a new backward: its step comes after it
      const auto& owned = params_of_layer_[op.layer];
      const uint64_t round = static_cast<uint64_t>(iteration_) * (ids_.shard ? 2 : 1);
      // Autograd produces a layer's gradients last parameter first.
      for (auto it = owned.rbegin(); it != owned.rend(); ++it) {
        ++pending_[op.layer];
        ++total_pending_;
        scatters_left_ += ids_.shard ? 1 : 0;
        comm.submit(now_s, round * params_.size() + *it);
      }
      if (op.layer == 0 && ids_.shard) {
        stepped_ = true;  // the optimizer steps once the backward has ended
        start_gathers(now_s, comm);
      }
    }
    if (++op_index_ == ops_.size()) {
      op_index_ = 0;
      ++iteration_;
    }
  }

  const std::vector<LayerSpec>& layers_;
  const std::vector<Param>& params_;
  const Mode mode_;
  const int iterations_;
  const Ids ids_;
  const bool eager_gather_;
  std::vector<Op> ops_;
  std::vector<std::vector<size_t>> params_of_layer_;
  std::vector<int> pending_;  // unfinished reductions per layer
  int total_pending_ = 0;
  int scatters_left_ = 0;              // reduce-scatters of the running iteration not done yet
  bool stepped_ = false;               // the backward has ended: the step may update reduced shards
  std::vector<uint64_t> stepped_ids_;  // all-gathers whose reduce-scatter is done, not started yet
  size_t op_index_ = 0;
  int iteration_ = 0;
  bool running_ = false;
  bool finished_ = false;
  double op_end_s_ = 0;
  std::vector<double> starts_;
};

// Message steps of one agreement exchange, as the MPI transport runs it.
double exchange_steps(int ranks) {
  return ranks <= kDirectExchangeMaxRanks ? 1.0 : std::ceil(std::log2(static_cast<double>(ranks)));
}

// The runtime loop of csrc/core/runtime_drive.cc on a virtual clock, over a SharedLink.
class RuntimeComm : public Comm {
 public:
  RuntimeComm(const std::vector<Param>& params, const NetworkSpec& network, const SimSettings& settings, Ids ids)
      : params_(params),
        ids_(ids),
        network_(network),
        cycle_s_(settings.cycle_time_s),
        exchange_s_(settings.exchange_s >= 0 ? settings.exchange_s : exchange_steps(network.ranks) * network.latency_s),
        rounds_behind_data_(settings.rounds_behind_data),
        scheduler_(settings.scheduling),
        link_(network.bandwidth_bytes_per_s, network.sharing),
        deadline_s_(settings.cycle_time_s) {}

  void submit(double now_s, uint64_t tensor_id) override {
    inbox_.push_back(tensor_id);
    // A submission wakes a waiting core at once; one arriving mid-exchange waits for the next cycle.
    if (!exchanging_) news_s_ = std::min(news_s_, now_s);
  }

  double next_event_s() const override { return std::min(link_.next_event_s(), own_next_s()); }

  std::vector<uint64_t> advance(double now_s) override {
    std::vector<uint64_t> done;
    while (true) {
      const double link_next = link_.next_event_s();
      const double own_next = own_next_s();
      if (std::min(link_next, own_next) > now_s) break;
      if (link_next <= own_next) {
        for (uint64_t seq : link_.advance(link_next)) complete(seq, link_next, done);
      } else if (exchanging_) {
        end_exchange(own_next, done);
      } else {
        start_exchange(own_next);
      }
    }
    return done;
  }

  void fill(SimResult& result) const {
    result.launches = launches_;
    result.fused_launches = fused_launches_;
    result.cycles = cycles_;
    result.max_bytes_in_flight = max_bytes_in_flight_;
  }

 private:
  double own_next_s() const { return exchanging_ ? exchange_end_s_ : std::min(news_s_, deadline_s_); }

  void start_exchange(double now_s) {
    announced_.swap(inbox_);
    inbox_.clear();
    reported_bytes_ = completed_bytes_;
    exchanging_ = true;
    // Agreement messages share the link with the data: they wait behind what is queued on it.
    const double queued_s = rounds_behind_data_ ? link_.backlog_bytes(now_s) / network_.bandwidth_bytes_per_s : 0.0;
    exchange_end_s_ = now_s + exchange_s_ + queued_s;
    news_s_ = kNever;
    ++cycles_;
  }

  void end_exchange(double now_s, std::vector<uint64_t>& done) {
    exchanging_ = false;
    // As in the core: a round that brought nothing new to an idle rank doubles the heartbeat.
    const bool quiet = announced_.empty() && in_flight_.empty() && scheduler_.queued_chunks() == 0;
    heartbeat_s_ = quiet ? std::min(2 * heartbeat_s_, kMaxQuietCycles * cycle_s_) : cycle_s_;
    for (uint64_t id : announced_) {
      const Param& param = ids_.param(params_, id);
      TensorSpec spec;
      spec.name = std::to_string(id);
      // The scheduler cuts and fuses only allreduces; the split's collectives go whole, as in training.
      spec.kind = ids_.kind(id);
      spec.count = param.bytes / dtype_size(spec.dtype);
      spec.priority = param.priority;
      chunks_left_[id] = scheduler_.add(id, spec);
    }
    announced_.clear();
    launch_ready(now_s);
    // Completions seen during the exchange are polled after the launches, without waking the next cycle.
    done.insert(done.end(), deferred_.begin(), deferred_.end());
    deferred_.clear();
    deadline_s_ = now_s + heartbeat_s_;
    // As in the core, a completion seen after the round is news if chunks wait for its credit.
    const bool credit_news = completed_mid_exchange_ && scheduler_.queued_chunks() > 0;
    completed_mid_exchange_ = false;
    if (!inbox_.empty() || credit_news) news_s_ = now_s;
  }

  // As in the real core, credit comes back through a round: what was completed when it began.
  void launch_ready(double now_s) {
    scheduler_.set_completed_bytes(reported_bytes_);
    for (Launch& launch : scheduler_.next_launches()) {
      ++launches_;
      fused_launches_ += launch.chunks.size() > 1 ? 1 : 0;
      const double share = launch.kind == CollectiveKind::kAllreduce ? 1.0 : ids_.share();
      link_.start(launch.seq, now_s, share * collective_latency_s(launch.bytes, network_),
                  share * collective_wire_bytes(launch.bytes, network_));
      in_flight_.emplace(launch.seq, std::move(launch));
    }
    max_bytes_in_flight_ = std::max(max_bytes_in_flight_, scheduler_.bytes_in_flight());
  }

  void complete(uint64_t seq, double now_s, std::vector<uint64_t>& done) {
    auto found = in_flight_.find(seq);
    const Launch launch = std::move(found->second);
    in_flight_.erase(found);
    completed_bytes_ += launch.bytes;
    for (const ChunkRef& chunk : launch.chunks) {
      auto left = chunks_left_.find(chunk.tensor_id);
      if (--left->second > 0) continue;
      chunks_left_.erase(left);
      (exchanging_ ? deferred_ : done).push_back(chunk.tensor_id);
    }
    if (exchanging_) {
      completed_mid_exchange_ = true;
    } else if (scheduler_.queued_chunks() > 0) {
      news_s_ = std::min(news_s_, now_s);  // chunks wait for this credit: a round now
    }
  }

  const std::vector<Param>& params_;
  const Ids ids_;
  const NetworkSpec network_;
  const double cycle_s_;
  const double exchange_s_;
  const bool rounds_behind_data_;
  Scheduler scheduler_;
  SharedLink link_;
  bool exchanging_ = false;
  double heartbeat_s_ = cycle_s_;
  double deadline_s_;
  double news_s_ = kNever;
  double exchange_end_s_ = 0;
  std::vector<uint64_t> inbox_;
  std::vector<uint64_t> announced_;
  std::vector<uint64_t> deferred_;
  uint64_t completed_bytes_ = 0;
  uint64_t reported_bytes_ = 0;  // completed bytes as of the last round's start
  bool completed_mid_exchange_ = false;
  std::unordered_map<uint64_t, uint32_t> chunks_left_;
  std::unordered_map<uint64_t, Launch> in_flight_;
  uint64_t launches_ = 0;
  uint64_t fused_launches_ = 0;
  uint64_t cycles_ = 0;
  uint64_t max_bytes_in_flight_ = 0;
};

// A fluid link that always serves the ready tensor the next forward needs first. A reduction
// becomes visible one latency of the network's algorithm (for a message of that tensor) after its
// last byte: no schedule avoids paying it once.
class IdealComm : public Comm {
 public:
  IdealComm(const std::vector<Param>& params, const NetworkSpec& network, Ids ids)
      : params_(params), ids_(ids), network_(network), rate_(network.bandwidth_bytes_per_s) {}

  void submit(double now_s, uint64_t tensor_id) override {
    serve(now_s);
    const Param& param = ids_.param(params_, tensor_id);
    ready_.emplace(Key{param.priority, next_seq_++},
                   Ready{tensor_id, ids_.share() * collective_cost(param.bytes, network_).wire_bytes});
  }

  double next_event_s() const override {
    const double served = ready_.empty() ? kNever : now_s_ + ready_.begin()->second.remaining / rate_;
    return std::min(served, delayed_.empty() ? kNever : delayed_.begin()->first);
  }

  std::vector<uint64_t> advance(double now_s) override {
    while (!ready_.empty() && served_next_s() <= now_s) {
      now_s_ = served_next_s();
      // Under a library's choice of algorithm the delay depends on the size: visibility is kept by time.
      const uint64_t tensor_id = ready_.begin()->second.tensor_id;
      const double latency_s = ids_.share() * collective_latency_s(ids_.param(params_, tensor_id).bytes, network_);
      delayed_.emplace(now_s_ + latency_s, tensor_id);
      ready_.erase(ready_.begin());
    }
    serve(now_s);
    std::vector<uint64_t> done;
    while (!delayed_.empty() && delayed_.begin()->first <= now_s) {
      done.push_back(delayed_.begin()->second);
      delayed_.erase(delayed_.begin());
    }
    return done;
  }

 private:
  using Key = std::pair<int32_t, uint64_t>;
  struct Ready {
    uint64_t tensor_id = 0;
    double remaining = 0;  // wire bytes
  };

  double served_next_s() const { return ready_.empty() ? kNever : now_s_ + ready_.begin()->second.remaining / rate_; }

  // Gives the time up to `now_s` to the head; advance() has already retired whatever finishes by then.
  void serve(double now_s) {
    if (now_s <= now_s_) return;
    if (!ready_.empty()) ready_.begin()->second.remaining -= (now_s - now_s_) * rate_;
    now_s_ = now_s;
  }

  const std::vector<Param>& params_;
  const Ids ids_;
  const NetworkSpec network_;
  const double rate_;
  double now_s_ = 0;
  uint64_t next_seq_ = 0;
  std::map<Key, Ready> ready_;
  std::multimap<double, uint64_t> delayed_;  // visible at -> tensor; equal times keep the order of service
};

void check_inputs(const std::vector<LayerSpec>& layers, const NetworkSpec& network, int iterations, int warmup) {
  if (layers.empty()) throw std::invalid_argument("the model profile has no layers");
  if (network.ranks < 2) throw std::invalid_argument("the simulator needs at least 2 ranks");
  if (!(network.bandwidth_bytes_per_s > 0)) throw std::invalid_argument("bandwidth must be above 0");
  if (network.latency_s < 0) throw std::invalid_argument("latency must not be negative");
  if (iterations < 1 || warmup < 0) throw std::invalid_argument("need iterations >= 1 and warmup >= 0");
  for (size_t i = 0; i < network.size_costs.size(); ++i) {
    const SizeCost& cost = network.size_costs[i];
    if (cost.bytes == 0 || !(cost.factor > 0) || (i > 0 && cost.bytes <= network.size_costs[i - 1].bytes)) {
      throw std::invalid_argument("size costs need sizes above 0 in increasing order and factors above 0");
    }
  }
  for (const LayerSpec& layer : layers) {
    if (layer.forward_s < 0 || layer.backward_s < 0) {
      throw std::invalid_argument("layer '" + layer.name + "' has a negative compute time");
    }
  }
}

SimResult run(const std::vector<LayerSpec>& layers, const std::vector<Param>& params, const NetworkSpec& network,
              Mode mode, int iterations, int warmup, Comm& comm, Ids ids, bool eager_gather) {
  Trainer trainer(layers, params, mode, warmup + iterations, ids, eager_gather);
  trainer.advance(0, comm);
  while (!trainer.finished()) {
    const double t = std::min(trainer.next_event_s(), comm.next_event_s());
    if (!(t < kHorizonS)) throw std::logic_error("the simulated training loop stopped making progress");
    for (uint64_t id : comm.advance(t)) trainer.on_done(id, t, comm);
    trainer.advance(t, comm);
  }
  SimResult result;
  result.iteration_starts_s = trainer.starts();
  const auto& starts = result.iteration_starts_s;
  result.iteration_s = (starts.back() - starts[warmup]) / iterations;
  uint64_t total_bytes = 0;
  for (const Param& param : params) total_bytes += param.bytes;
  for (const LayerSpec& layer : layers) result.compute_s += layer.forward_s + layer.backward_s;
  result.communication_s = total_bytes ? allreduce_s(total_bytes, network) : 0.0;
  result.bound_s = std::max(result.compute_s, result.communication_s);
  result.sum_s = result.compute_s + result.communication_s;
  return result;
}

}  // namespace

SimResult simulate(const std::vector<LayerSpec>& layers, const NetworkSpec& network, const SimSettings& settings) {
  check_inputs(layers, network, settings.iterations, settings.warmup);
  if (!(settings.cycle_time_s > 0)) throw std::invalid_argument("cycle time must be above 0");
  const std::vector<Param> params = flatten(layers);
  const Ids ids{std::max<uint64_t>(1, params.size()), settings.shard};
  RuntimeComm comm(params, network, settings, ids);
  SimResult result =
      run(layers, params, network, settings.mode, settings.iterations, settings.warmup, comm, ids,
          settings.mode == Mode::kOverlap);
  comm.fill(result);
  return result;
}

SimResult simulate_ideal(const std::vector<LayerSpec>& layers, const NetworkSpec& network, int iterations,
                         int warmup, bool shard) {
  check_inputs(layers, network, iterations, warmup);
  const std::vector<Param> params = flatten(layers);
  const Ids ids{std::max<uint64_t>(1, params.size()), shard};
  IdealComm comm(params, network, ids);
  return run(layers, params, network, Mode::kOverlap, iterations, warmup, comm, ids, true);
}

}  // namespace commsched::sim
