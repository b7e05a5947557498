#pragma once
// One rank's training steps replayed on a Tape (suites/train.cpp's Trainer::step with the strategy of
// suites/parallel/strategies.cpp and LibTorch's optimizers): the memory of every phase and the model
// state at the end, predicted from the configuration alone. Torch-free.
#include <string>

#include "core/config.hpp"
#include "core/layout.hpp"
#include "core/pipeline.hpp"
#include "plan/models.hpp"

namespace trainscope::plan {

struct StepSetup {
  Replay replay;
  ParallelLayout layout;  // core/layout.hpp: what `trainscope run` resolves from the same configuration
  // The strategy runs over the data-parallel ranks with cp's folded in (core/layout.hpp: fold_context).
  ParallelLayout strategy_layout() const { return fold_context(layout); }
  std::string strategy() const { return strategy_layout().strategy(); }  // single | ddp | zero1 | zero2 | zero3 | hsdp
  int64_t world() const { return layout.world(); }
  // The data-parallel group the strategy runs over (the world when there is no tp or pp).
  int64_t data_parallel() const { return strategy_layout().dp(); }
  // The ranks one copy of the model state is sharded over: the dp_shard group, else the data-parallel group.
  int64_t sharding() const {
    const ParallelLayout l = strategy_layout();
    return l.dp_shard > 1 ? l.dp_shard : data_parallel();
  }
  std::string optimizer = "adamw";
  double weight_decay = 0.0;
  bool prefetch = true;
  std::string reshard_after_forward = "true";  // zero3, hsdp (and with masters ddp): true | false | r
  double bucket_mb = 25.0;  // ddp / zero1 / zero2 gradient buckets
  bool grad_clip = false;
  int64_t resident_data_bytes = 0;  // the data set held in memory (CPU runs: it counts in the peak)
  std::string data = "synthetic-tokens";
  // The pipeline schedule every pp rank runs (core/layout.hpp: resolve_pipeline; one rank and one
  // micro-batch: none) and the pp rank replayed (set_pp_rank: the layers it holds).
  pipeline::Schedule schedule = pipeline::make_schedule("1f1b", 1, 1, 1);
  int64_t pp_rank = 0;
  bool pipelined() const { return schedule.ranks > 1 || schedule.microbatches > 1; }
  // Full sharding's units (suites/parallel/strategies.cpp: make_strategy): zero3 and hsdp, and with
  // masters one process and ddp (units without a shard group).
  bool units() const {
    const std::string st = strategy();
    return st == "zero3" || st == "hsdp" || (replay.num.master && (st == "single" || st == "ddp"));
  }
  // Units inside a pipeline stage with data-parallel ranks (ParamPolicy::defer_reduce): each block
  // gathered once per step and kept, its unsharded gradient accumulated in reduce_dtype and
  // reduce-scattered once, after the last micro-batch.
  bool reduce_deferred() const { return schedule.ranks > 1 && units() && data_parallel() > 1; }
  void set_pp_rank(int64_t rank);
};

struct ModelState {
  int64_t params = 0, grads = 0, optimizer = 0;
  int64_t total() const { return params + grads + optimizer; }
};

struct MemoryPrediction {
  int64_t peak = 0;  // the highest live bytes over the steps
  int64_t forward = 0, backward = 0, optimizer = 0;  // per phase, as the memory probe's phase peaks
  int64_t baseline = 0;    // live before the first step: data, parameters (and strategy buffers)
  int64_t activations = 0;  // forward peak above the step's start
  ModelState state;         // at the end of a step, as the strategy reports it
  int64_t data = 0;         // resident data set
  std::vector<OpCost> forward_costs;    // the forward's operators, for the time model
  std::vector<OpCost> recompute_costs;  // the operators checkpointing runs again in backward
  int64_t forward_ops = 0;
  json to_json() const;
};

// The prediction for `s`; UsageError when the model's family is not covered.
MemoryPrediction predict_memory(const StepSetup& s);

// Bytes the data source keeps resident (suites/models/data.cpp): Fashion-MNIST's images (uint8) and
// labels (int64), synthetic images' class templates, the text corpus's bytes; synthetic tokens none.
int64_t resident_data_bytes(const std::string& data, const Replay& r);

// The setup of a run configuration (one rank of it).
StepSetup step_setup(const RunConfig& c, bool cuda);

}  // namespace trainscope::plan
