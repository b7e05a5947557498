#pragma once
// The hook interface between the training loop (suites/) and the instruments (probes/).
//
// The loop calls these at fixed points of every step; each probe overrides what it needs and
// contributes one named JSON section to the cell's metrics. Suites know probes only through this.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/config.hpp"

namespace trainscope {

// What a probe learns about the run before the first step.
struct RunInfo {
  const RunConfig* config = nullptr;
  std::string device;          // resolved: "cpu" or "cuda:0"
  std::string model_name;
  int64_t parameters = 0;            // trainable parameter count
  double flops_per_sample = 0;       // analytic training FLOPs (forward + backward) per sample
  // Decoders: the convention flops_per_sample follows (full attention), and the causal count beside it.
  std::string flops_convention;
  double causal_flops_per_sample = 0;
  double recompute_flops_per_sample = 0;  // forward FLOPs that activation checkpointing repeats
  double attention_flops_per_sample = 0;  // of flops_per_sample, the attention core's (the rest: linear layers)
  int64_t tokens_per_sample = 0;     // 0 for non-sequence models
  std::string compute_dtype;         // the dtype the GEMMs run in (core/precision.hpp: compute_dtype)
  int64_t rank = 0, world_size = 1;
  int64_t model_parallel = 1;        // ranks one sample's model is split over (tp x pp x cp)
  std::string collectives;           // how the collectives are implemented ("" on one rank)
  // The pipeline schedule (core/pipeline.hpp; empty: none) and what its replay on equal costs (F = 1,
  // B = 2, free transfers) gives: the bubble and this rank's peak of micro-batch stages in flight.
  std::string pipeline_schedule;
  int64_t pipeline_ranks = 1, pipeline_stages_per_rank = 1, pipeline_microbatches = 1;
  double pipeline_bubble_formula = 0;
  int64_t pipeline_in_flight_formula = 0;
  std::string pipeline_actions;  // this rank's, in torch's notation (core/pipeline.hpp: format_actions)
  // Context parallelism (suites/parallel/context_parallel.hpp; cp_ranks 1: none): the method, whether the
  // shards are head-tail balanced, and the causal query-key pairs each cp rank's attention computes in
  // one forward with the balanced shards and with contiguous ones (the imbalance either would have).
  std::string cp_method;
  bool cp_balance = true;
  int64_t cp_ranks = 1, cp_rank = 0;
  std::vector<double> cp_pairs_balanced, cp_pairs_contiguous;
};

// One collective the parallel layer ran (the hooks collective begin/end). `bytes` follows
// nccl-tests: the per-rank buffer for all-reduce and broadcast, the full (gathered) buffer for
// all-gather and reduce-scatter.
struct CollectiveInfo {
  std::string op;  // all-reduce | all-gather | reduce-scatter | broadcast
  int64_t bytes = 0;
  int64_t group_size = 1;
  double seconds = 0;        // launch to completion
  double exposed_s = 0;      // of which the step waited (blocking collectives: all of it)
  int64_t step = -1;         // -1 outside training steps (set-up)
  double end_s = 0;          // when it completed (steady clock, s), if reported later; 0: now
  std::string level;         // hsdp's groups: "intra-node" or "inter-node" (empty: the whole world)
  std::string dimension;     // the mesh dimension whose group ran it (tp, dp_shard, ...; empty: none named)
};

// A fingerprint (64-bit hash) of one RNG stream or state on this rank. `cls` is must-match (equal on
// every rank: parameters after sync, generator states the replicated model draws from) or
// should-differ (data shards, augmentation draws).
struct Fingerprint {
  std::string stream, cls;
  int64_t step = 0;
  uint64_t value = 0;
};

struct StepInfo {
  int64_t step = 0;         // 0-based, warm-up steps included
  bool measured = false;    // false during warm-up
  int64_t samples = 0;      // samples in this step (global)
  // A sampling probe (per-block statistics, embeddings) runs inside this step: its own temporaries
  // count in the step's memory, so the memory probe keeps such steps apart.
  bool instrumented = false;
  // Filled for step_end:
  at::Tensor loss;               // the true loss (device tensor, not synchronised)
  double loss_scale = 0;         // the scale this step used; 0 without a scaler
  bool grads_nonfinite = false;  // some gradient was inf/NaN (checked where a scaler or fp16 runs)
  bool skipped = false;          // the optimizer step was skipped (scaler found inf/NaN)
  // Pipelines (suites/parallel/pipeline.hpp), from forward_end: this rank's part of the schedule, its
  // span, compute and waits for the neighbouring stages (s), its most micro-batch stages in flight, the
  // bytes it sent and received. span_s 0: no pipeline.
  struct Pipeline {
    double span_s = 0, compute_s = 0, wait_s = 0;
    int64_t peak_in_flight = 0, p2p_bytes = 0;
  } pipeline;
  // Context parallelism, from step_end: this rank's seconds inside the cp attention (forward, backward),
  // of them blocked on transfers, the transfers' own seconds, the bytes it sent. attention_s 0: none.
  struct Context {
    double attention_s = 0, wait_s = 0, transfer_s = 0;
    int64_t bytes = 0;
  } context;
};

// What a self-supervised objective saw on a step, for the SSL health probe (probes/ssl).
struct EmbeddingSample {
  int64_t step = 0;
  at::Tensor embeddings;            // [B, d] detached: the representation the loss acts on
  double loss = 0;
  double collapse_loss = -1;        // the loss at collapse (SimCLR ln(2N-1), DINO ln K); < 0: none
  at::Tensor teacher_probs, student_probs;  // DINO: [B, K] (undefined for the other methods)
};

// Sees the tensors at the model's block boundaries: activations on the way forward and the gradients
// arriving at them on the way back, on the steps it asks for.
class BlockObserver {
 public:
  virtual ~BlockObserver() = default;
  virtual bool wants(int64_t step) const = 0;
  virtual void activation(int64_t step, const std::string& block, const at::Tensor& x) = 0;
  virtual void gradient(int64_t step, const std::string& block, const at::Tensor& g) = 0;
};

// Model-state bytes (docs/metrics.md#memory), measured from the live tensors.
struct ModelStateBytes {
  int64_t params = 0, grads = 0, optimizer = 0;
  int64_t expected = 0;  // analytic (ZeRO paper): parameters + gradients + optimizer states per rank
  std::string expected_formula;
};

struct RunEnd {
  int64_t steps_run = 0;
  ModelStateBytes model_state;
};

class Probe {
 public:
  virtual ~Probe() = default;
  virtual std::string name() const = 0;  // the metrics section it fills: "timing", "memory", ...
  virtual void run_begin(const RunInfo&) {}
  virtual void step_begin(const StepInfo&) {}
  virtual void forward_end(const StepInfo&) {}
  virtual void backward_end(const StepInfo&) {}
  virtual void optimizer_end(const StepInfo&) {}
  virtual void step_end(const StepInfo&) {}
  virtual void run_end(const RunEnd&) {}
  virtual void collective(const CollectiveInfo&) {}
  virtual bool wants_fingerprints(int64_t step) const { return false; }
  virtual void fingerprint(const Fingerprint&) {}
  virtual bool wants_embeddings(int64_t step) const { return false; }
  virtual void embeddings(const EmbeddingSample&) {}
  // Multi-rank, on fingerprint steps: the largest |difference| of one parameter value across ranks.
  virtual void parameter_spread(int64_t /*step*/, double /*max_abs_diff*/) {}
  virtual json section() const = 0;
  virtual BlockObserver* block_observer() { return nullptr; }
};

// Fans every hook out to a list of probes, in order.
class Hooks {
 public:
  void add(std::shared_ptr<Probe> p) { probes_.push_back(std::move(p)); }
  const std::vector<std::shared_ptr<Probe>>& probes() const { return probes_; }
  std::vector<BlockObserver*> block_observers() const {
    std::vector<BlockObserver*> out;
    for (const auto& p : probes_)
      if (auto* o = p->block_observer()) out.push_back(o);
    return out;
  }
  void run_begin(const RunInfo& r) { for (auto& p : probes_) p->run_begin(r); }
  void step_begin(const StepInfo& s) { for (auto& p : probes_) p->step_begin(s); }
  void forward_end(const StepInfo& s) { for (auto& p : probes_) p->forward_end(s); }
  void backward_end(const StepInfo& s) { for (auto& p : probes_) p->backward_end(s); }
  void optimizer_end(const StepInfo& s) { for (auto& p : probes_) p->optimizer_end(s); }
  void step_end(const StepInfo& s) { for (auto& p : probes_) p->step_end(s); }
  void run_end(const RunEnd& e) { for (auto& p : probes_) p->run_end(e); }
  void collective(const CollectiveInfo& c) { for (auto& p : probes_) p->collective(c); }
  bool wants_fingerprints(int64_t step) const {
    for (const auto& p : probes_)
      if (p->wants_fingerprints(step)) return true;
    return false;
  }
  void fingerprint(const Fingerprint& f) { for (auto& p : probes_) p->fingerprint(f); }
  bool wants_embeddings(int64_t step) const {
    for (const auto& p : probes_)
      if (p->wants_embeddings(step)) return true;
    return false;
  }
  void embeddings(const EmbeddingSample& e) { for (auto& p : probes_) p->embeddings(e); }
  void parameter_spread(int64_t step, double d) { for (auto& p : probes_) p->parameter_spread(step, d); }

 private:
  std::vector<std::shared_ptr<Probe>> probes_;
};

}  // namespace trainscope
