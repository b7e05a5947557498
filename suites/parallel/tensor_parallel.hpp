#pragma once
// Tensor parallelism (the layout's tp dimension) as Megatron-LM splits a decoder block (Shoeybi et al.
// 2019, Section 3) and as PyTorch's DTensor plans express it (ColwiseParallel, RowwiseParallel,
// SequenceParallel, loss_parallel), over the mesh's tp communicator:
//   column-parallel  q, k, v, gate, up and the output head: each rank holds a block of output rows; their
//                    input passes `enter` once per attention and once per MLP (Megatron's f: identity
//                    forward, all-reduce backward; with sequence parallelism an all-gather along the
//                    sequence forward and a reduce-scatter backward)
//   row-parallel     o and down: each rank holds a block of input columns; their partial output passes
//                    `leave` (Megatron's g: all-reduce forward, identity backward; with sequence
//                    parallelism a reduce-scatter along the sequence forward and an all-gather backward)
//   vocabulary       the embedding and the head split by vocabulary rows; the loss computed on the
//                    vocabulary shards without gathering the logits, op for op as DTensor's loss_parallel
//   replicated       norm weights (and key/value projections when tp exceeds the key/value heads) are
//                    whole on every rank; where each rank's use gives only part of the gradient (norms on
//                    sequence shards, key/value heads shared by ranks) the weight passes `replicated`,
//                    whose backward all-reduces it.
//   dropout          inside a region split by tp (attention over this rank's heads; with sequence
//                    parallelism, every sequence shard) from Megatron's model-parallel generator (seed +
//                    2718 + tp rank: the tp ranks' masks differ); where the tensor is whole on every tp
//                    rank, from the default generator, seeded alike (the masks match).
// Every collective runs inside autograd in the graph's order, which is the same on every rank of the group.
#include <cstdint>
#include <functional>

#include <torch/torch.h>

namespace trainscope::suites {

class Communicator;

struct TensorParallel {
  Communicator* group = nullptr;  // the tp communicator (null: one rank holds each layer whole)
  int64_t rank = 0, degree = 1;
  bool sequence = false;  // sequence parallelism: activations between blocks split along the sequence (dim 1)
  bool regather = false;  // with it, the column-parallel inputs re-gathered in backward (Megatron), not kept
  bool active() const { return degree > 1; }
};

namespace tensor_parallel {

// How a parameter is split: along `dim`, in `groups` equal parts each split over the tp ranks (GPT's
// fused q, k, v projection: 3 groups, so that each rank holds its heads of each).
struct Split {
  int64_t dim = 0, groups = 1;
  Split(int64_t d = 0, int64_t g = 1) : dim(d), groups(g) {}
};

// This rank's block of `full` (a copy: the parameter's storage is its own).
torch::Tensor shard(const torch::Tensor& full, const Split& split, const TensorParallel& tp);
// The whole tensor from every rank's block (a collective over the tp group).
torch::Tensor unshard(const torch::Tensor& local, const Split& split, const TensorParallel& tp);

// Megatron's model-parallel RNG tracker (megatron/core/tensor_parallel/random.py), one per process:
// seeded once per run, its state swapped into the default generator of the tensor's device around each
// draw inside a tp region, so that torch::dropout itself is unchanged. Activation checkpointing saves
// and restores its state with the default generator's (suites/techniques/checkpoint.cpp).
class RngTracker {
 public:
  void seed(uint64_t s);
  void reset();  // unseeded: dropout() draws from the default generator
  bool seeded() const { return seeded_; }
  at::Tensor state() const { return state_; }  // undefined until the first draw
  void set_state(const at::Tensor& s) { state_ = s; }
  // `draw` run with the tracker's state in the default generator of `device` (unseeded: as it is).
  torch::Tensor fork(const torch::Device& device, const std::function<torch::Tensor()>& draw);
  // torch::dropout with the tracker's generator.
  torch::Tensor dropout(const torch::Tensor& x, double p, bool train);
  // Where the tracker's stream stands (its state, or its seed before the first draw): the RNG probe's
  // fingerprint.
  at::Tensor snapshot() const;

 private:
  bool seeded_ = false;
  uint64_t seed_ = 0;
  at::Tensor state_;
};
RngTracker& rng_tracker();
// Dropout in a region split by tp: the tracker's generator when tp is active, else the default one.
torch::Tensor split_dropout(const torch::Tensor& x, double p, bool train, const TensorParallel& tp);

// Before a column-parallel layer: Megatron's f (copy, or all-gather along the sequence).
torch::Tensor enter(const torch::Tensor& x, const TensorParallel& tp);
// The column-parallel layers that share one input, x @ W_i^T (+ b_i) for each weight (an undefined bias:
// none), after `enter`. With `regather` one autograd node instead keeps only x's sequence shard and
// all-gathers it again in backward, as Megatron's LinearWithGradAccumulationAndAsyncCommunication does
// (its input gradients summed in the weights' order, then reduce-scattered).
std::vector<torch::Tensor> column_parallel(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                                           const std::vector<torch::Tensor>& biases, const TensorParallel& tp,
                                           const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>& linear);
// After a row-parallel layer: Megatron's g (all-reduce, or reduce-scatter along the sequence).
torch::Tensor leave(const torch::Tensor& partial, const TensorParallel& tp);
// A whole weight whose gradient each rank holds only part of: identity forward, all-reduce backward.
torch::Tensor replicated(const torch::Tensor& weight, const TensorParallel& tp);

// The vocabulary-parallel embedding: tokens [B, S] against this rank's rows of the table; tokens of
// other ranks' rows give zeros; then `leave` (the sum over ranks, or its sequence shard).
torch::Tensor vocab_embedding(const torch::Tensor& tokens, const torch::Tensor& weight_shard, const TensorParallel& tp);
// Mean cross-entropy of vocabulary-sharded logits [N, V / tp] against targets [N] (values in [0, V)),
// in fp32 at least: all-reduces of the row max, the sum of exponentials and the target's log-probability;
// backward (softmax - onehot) / N on the shard, without communication (DTensor's loss_parallel).
torch::Tensor vocab_cross_entropy(const torch::Tensor& logits_shard, const torch::Tensor& target, const TensorParallel& tp);

}  // namespace tensor_parallel
}  // namespace trainscope::suites
