#pragma once
// Pipeline schedules as data, in the shape of torch.distributed.pipelining's schedule IR: per rank, the
// actions it runs in order, each a (stage, F | B | I | W, micro-batch). One table drives the pipelined
// training step, the planner's bubble and in-flight memory, and the deadlock check (replay() below).
// Torch-free.
//
// Stages are placed in a loop: with p ranks and v stages per rank, rank r holds stages r, r + p, ...,
// r + (v-1)p (Megatron's and torch's interleaved placement). B is a stage's whole backward; I and W are
// its two halves under a zero-bubble schedule (the gradient with respect to the stage's input, which the
// previous stage waits for; then the weights' gradients, which nothing waits for).
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace trainscope::pipeline {

enum class Op { Forward, Backward, BackwardInput, BackwardWeight };
const char* op_name(Op op);  // "F", "B", "I", "W"

struct Action {
  int64_t stage = 0;
  Op op = Op::Forward;
  int64_t microbatch = 0;
};

struct Schedule {
  std::string name;  // one of schedule_names()
  int64_t ranks = 1, stages_per_rank = 1, microbatches = 1;
  std::vector<std::vector<Action>> actions;  // per rank, in the order it runs them
  // The layers of each stage, [first, last) (stage_layers; empty until a model's layers are cut).
  std::vector<std::pair<int64_t, int64_t>> cuts;
  int64_t stages() const { return ranks * stages_per_rank; }
  int64_t rank_of(int64_t stage) const { return stage % ranks; }
};

// A rank's actions in torch.distributed.pipelining's notation (its _Action's repr): "0F0 0F1 0I0 0W0 ...".
std::string format_actions(const std::vector<Action>& actions);

// gpipe, 1f1b, interleaved-1f1b, zb-1p (1F1B with each backward split into I and W, the W deferred
// into the bubbles: Qi et al. 2023's ZB-H1, and with several stages per rank torch's
// ScheduleInterleavedZeroBubble, whose table it is at any pp_virtual).
const std::vector<std::string>& schedule_names();
// Stages per rank the schedule runs: 2 for interleaved-1f1b unless given, 1 for the others.
int64_t default_stages_per_rank(const std::string& name);
// Micro-batches when none are given: enough to fill the pipeline twice (2p), so that the bubble of
// gpipe and 1f1b is (p-1)/2p < 1/2; interleaved-1f1b's count must be a multiple of p, which 2p is.
int64_t default_microbatches(const std::string& name, int64_t ranks);
// The schedule's table; UsageError (one line) when it cannot take the numbers: an unknown name, v != 1
// for a schedule of one stage per rank, v > 1 with m not a multiple of p (Megatron's rule), interleaved-1f1b
// with v < 2.
Schedule make_schedule(const std::string& name, int64_t ranks, int64_t microbatches, int64_t stages_per_rank);

// The layers of each stage, [first, last): equal cuts when the stages divide the layers; otherwise each
// holds ceil(L / stages) and the shortfall is taken a layer at a time from the last stage, the first,
// the second last, the second, ...: the stages that also run the head and the embedding (the Llama 3
// paper's 405B, Section 3.3.2: 126 layers on 16 stages, 7 on the first and the last, 8 on the others).
// `split` (pp_split) gives each stage's layer count instead. UsageError, one line, when there are more
// stages than layers, or a split that is not one positive count per stage adding up to the layers.
std::vector<std::pair<int64_t, int64_t>> stage_layers(int64_t layers, int64_t stages, const std::vector<int64_t>& split = {});

// The time of one action of one stage on one micro-batch; B = I + W. p2p is the time a boundary
// tensor takes between two ranks (0 between stages on one rank).
struct Costs {
  double forward = 1, backward_input = 1, backward_weight = 1, p2p = 0;
};
struct Replay {
  double makespan = 0;  // the last action's end
  double busy = 0;      // the most compute any rank does
  // Idle over compute: (makespan - busy) / busy, the convention of Narayanan et al. 2021, Section 2.2.
  double bubble() const { return busy > 0 ? (makespan - busy) / busy : 0; }
  // Per rank, the most micro-batch stages forwarded and not yet released (by B, or by W when split):
  // whose activations it holds at once.
  std::vector<int64_t> peak_in_flight;
  // Per rank, the actions' start times in its order (what a timeline draws).
  std::vector<std::vector<double>> start;
};
// Runs the table on the costs, each action as soon as its rank is free and its input has arrived.
// std::runtime_error naming the ranks and their waiting actions when the table deadlocks.
Replay replay(const Schedule& s, const Costs& c);

// When each send is known to have been received, so that its buffer can go: per rank, per action, the
// index of the first later action of that rank after which the receiver has taken it (its receive
// happened before that action ended, through the transfers between them); actions.size() when nothing
// later tells (the end of the step); -1 for an action that sends nothing. A forward's output is
// released after the same micro-batch's backward on that rank (whose gradient came back through it);
// an input gradient after the next transfer from the previous stage that was sent after it arrived.
std::vector<std::vector<int64_t>> send_release(const Schedule& s);

}  // namespace trainscope::pipeline
