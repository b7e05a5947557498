#pragma once
// One training step's forwards and backwards run as a pipeline schedule (core/pipeline.hpp's table):
// the batch cut into micro-batches, each rank running its actions in order, the stage boundaries'
// hidden states and their gradients passed by point-to-point transfers over the pp group. Without pp
// (one rank, one stage) the same loop is gradient accumulation over the micro-batches.
//
// A forward's receive waits for the previous stage; sends are posted, and each is waited for (and its
// buffer let go) only once the schedule shows that its receiver has it (core/pipeline.hpp's
// send_release), so that no two ranks ever block sending to each other (the table's order alone cannot
// deadlock: core/pipeline.hpp's replay checks it). Gradients accumulate in each parameter's .grad in
// the order the schedule runs the backwards, micro-batch by micro-batch, as one process accumulating
// the same micro-batches in that order does.
#include <functional>
#include <set>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "core/pipeline.hpp"
#include "suites/models/models.hpp"
#include "suites/parallel/comm.hpp"

namespace trainscope::suites {

// What one step of the pipeline measured on this rank.
struct PipelineStats {
  double span_s = 0;     // first action's start to the last one's end (sends completed)
  double compute_s = 0;  // the actions' time, less what they waited for a transfer
  double wait_s = 0;     // waiting for the previous or next stage's tensors
  int64_t peak_in_flight = 0;  // micro-batch stages forwarded and not yet backwarded, at most
  int64_t p2p_bytes = 0;       // sent and received
  // Idle over compute, as the schedule's replay defines the bubble.
  double bubble() const { return compute_s > 0 ? (span_s - compute_s) / compute_s : 0; }
};

class Pipeline {
 public:
  // `forward` runs layers [first, last) of a micro-batch from `in` (tokens when first == 0) and returns
  // the hidden states, or the micro-batch's loss when last is the layer count; `objective` turns a loss
  // into what its backward starts from (the 1/m share, the loss scale).
  struct Steps {
    std::function<torch::Tensor(const torch::Tensor& in, int64_t first, int64_t last, const Batch& mb)> forward;
    std::function<torch::Tensor(const torch::Tensor& loss)> objective;
    // An empty tensor of a stage boundary's shape and dtype for a micro-batch (what a receive fills).
    std::function<torch::Tensor(const Batch& mb)> boundary_like;
  };
  // `group`: the pp communicator (null with one rank); `layers`: the model's, cut evenly into stages.
  Pipeline(pipeline::Schedule schedule, Communicator* group, int64_t layers);
  const pipeline::Schedule& schedule() const { return schedule_; }
  // The layers of `stage`: [first, last).
  std::pair<int64_t, int64_t> layers_of(int64_t stage) const;
  // The stages this rank runs, in order.
  std::vector<int64_t> my_stages() const;
  bool holds_stage(int64_t stage) const { return schedule_.rank_of(stage) == rank_; }
  int64_t last_stage_rank() const { return schedule_.rank_of(schedule_.stages() - 1); }

  // Runs this rank's actions on the batch; returns the mean of the micro-batches' losses on the rank of
  // the last stage (an undefined tensor elsewhere).
  torch::Tensor run(const Batch& batch, const Steps& steps);
  const PipelineStats& stats() const { return stats_; }

 private:
  struct Slot;  // one (stage, micro-batch): its input, output and the transfers it posted
  torch::Tensor receive(torch::Tensor into, int src, int tag, double* waited);
  void backward_input(const pipeline::Action& a, Slot& slot, Slot* previous, const Steps& steps, int64_t release, double* waited);
  void backward_weight(const pipeline::Action& a, Slot& slot);
  std::vector<torch::autograd::FunctionPreHook*> capture_meets(Slot& slot) const;
  int tag(int64_t stage, int64_t mb, bool backward) const;

  pipeline::Schedule schedule_;
  Communicator* group_;
  int64_t layers_;
  int rank_ = 0;
  PipelineStats stats_;
  std::vector<std::vector<int64_t>> release_;  // per rank and action: after which action its send is received
  struct Send {
    torch::Tensor tensor;
    c10::intrusive_ptr<c10d::Work> work;
    int64_t release = 0;
  };
  std::vector<Send> sends_;  // kept alive until received
  void complete_sends(int64_t after);  // those released after action `after` (all: -1)
};

// The micro-batches of a batch: m equal slices along the first dimension.
std::vector<Batch> split_microbatches(const Batch& b, int64_t m);

}  // namespace trainscope::suites
