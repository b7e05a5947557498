#pragma once
// Data-parallel strategies: how the layout's dp_replicate and dp_shard dimensions (core/layout.hpp)
// synchronise the model, each over its mesh group (suites/parallel/mesh.hpp):
//   ddp    torch's C++ DDP engine (c10d::Reducer): bucketed all-reduce overlapping backward, after an
//          initial broadcast of rank 0's parameters.
//   zero1  optimizer state sharded: gradients all-reduced, each rank steps its slice of the flat
//          parameters, the slices are all-gathered.
//   zero2  gradients sharded too: each bucket reduced to the ranks owning its slices while backward
//          runs (DeepSpeed's overlap_comm), the full gradient buffer freed once reduced.
//   zero3  FSDP-style: parameters flattened per block and sharded; a block's full parameters are
//          all-gathered for its forward and again for its backward, freed after each, and its
//          gradients reduce-scattered as soon as its backward is done. With `prefetch` the next block's
//          gather runs while the current block computes (FSDP's forward and backward prefetch). Parameters outside blocks
//          (embeddings, head, stem) form a root unit gathered for the whole step.
//   hsdp   hybrid sharding: zero3 within a shard group (a node's ranks by default), each gradient
//          slice then all-reduced across the groups; one full copy of the model state per group.
// Every strategy averages gradients over ranks, so K steps on N ranks equal K steps of one process on
// the concatenated global batch (BatchNorm statistics aside: they stay per rank, as in DDP).
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "core/hooks.hpp"
#include "suites/models/models.hpp"
#include "suites/parallel/comm.hpp"
#include "suites/parallel/mesh.hpp"

namespace trainscope::suites {

class ParallelStrategy {
 public:
  virtual ~ParallelStrategy() = default;
  // Synchronises (or shards) the model's parameters and returns the tensors the optimizer owns.
  // broadcast=false leaves every rank with its own initial weights (the skip-broadcast fault).
  virtual std::vector<torch::Tensor> setup(ReferenceModel& model, bool broadcast) = 0;
  virtual void zero_grad(torch::optim::Optimizer& opt);
  virtual void before_forward() {}
  virtual void before_backward() {}
  // After backward: the optimizer's tensors hold gradients averaged over the ranks.
  virtual void reduce_gradients() {}
  // After the optimizer step (taken or skipped): every rank's parameters are in sync.
  virtual void after_step() {}
  // The model's full parameters usable for evaluation and comparison (zero3 gathers them for good).
  virtual void materialize() {}
  // Bytes of parameters, gradients and optimizer state this rank holds now, and the ZeRO paper's value.
  virtual ModelStateBytes model_state(const torch::optim::Optimizer& opt, int64_t optimizer_words) const;
  // A hash of this rank's full parameters (zero3 gathers them for it).
  virtual uint64_t parameter_fingerprint();
  // What the optimizer steps, per model parameter and in its order, as full tensors: the parameters
  // themselves, or the fp32 masters behind bf16 compute copies (gathered: a collective every rank calls).
  virtual std::vector<torch::Tensor> master_values();
  // The largest |difference| of one parameter value between any two ranks (0: the ranks agree
  // exactly); a collective every rank must call. Outside the step's communication.
  double parameter_spread();
  // Global gradient-norm clipping over the optimizer's tensors (all ranks agree on the norm). Under
  // tensor parallelism `counted` (per model parameter, in its order) says which parameters this rank
  // counts (the split ones on every tp rank, the whole ones on one: Megatron's clip_grad_norm) and
  // `across` (the tp group, the pp group, or both) adds the ranks' sums.
  void clip_grad_norm(const std::vector<torch::Tensor>& opt_params, double max_norm, const std::vector<bool>& counted = {},
                      const std::vector<Communicator*>& across = {});
  Communicator* comm() const { return comm_; }
  // The number of ranks one copy of the model state is spread over (zero3: the world; hsdp: a shard
  // group); the N of the ZeRO paper's formulas.
  virtual int64_t sharding_degree() const { return comm_ ? comm_->world_size() : 1; }
  // What the state is sharded at (core/precision.hpp's expected_model_state): single, ddp, zero1, zero2, zero3.
  virtual std::string sharding_level() const = 0;

 protected:
  explicit ParallelStrategy(Communicator* comm) : comm_(comm) {}
  // Whether each rank's optimizer sees only a slice of the gradients (zero), so that a global norm
  // needs the ranks' sums; ddp's ranks all hold the whole averaged gradient.
  virtual bool sliced_gradients() const { return false; }
  // The ranks whose gradient slices together make one whole gradient (the global norm's sum).
  virtual Communicator* gradient_group() const { return comm_; }
  // Per optimizer tensor, the element ranges [begin, end) of its flattened gradient that belong to the
  // `counted` model parameters: the parameters themselves here, slices of flat buffers when sharded.
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  virtual std::vector<Ranges> counted_ranges(const std::vector<bool>& counted) const;
  // The counted parameters by identity (a flat buffer's views keep their parameters' TensorImpl).
  std::set<const void*> counted_parameters(const std::vector<bool>& counted) const;
  // This rank's full parameters as one flat fp32 copy (zero3 gathers them).
  virtual torch::Tensor full_parameters();
  Communicator* comm_;  // null for single
  ReferenceModel* model_ = nullptr;
};

// How a strategy holds the model's parameters: as they are, or (`master`: bf16-master) as fp32 masters
// the optimizer steps, cast to `compute` for each forward and backward, their gradients reduced and
// accumulated in `reduce` (FSDP2's MixedPrecisionPolicy(param_dtype, reduce_dtype)).
struct ParamPolicy {
  bool master = false;
  at::ScalarType compute = at::kBFloat16;
  at::ScalarType reduce = at::kFloat;
  // zero3, hsdp: after a block's forward free its gathered parameters ("true"), keep them until its
  // backward ("false"), or keep a 1/r slice and gather over r ranks in backward ("r"), as FSDP2.
  std::string reshard_after_forward = "true";
  // Units inside a pipeline stage, with data-parallel ranks to reduce over: each block stays gathered for
  // the step and its gradient accumulates
  // unsharded (in reduce_dtype), reduce-scattered once after the last micro-batch, as
  // torch.distributed.pipelining runs FSDP2 (reshard_after_backward and requires_gradient_sync off until
  // the last micro-batch; torchtitan's reshard_after_forward off with pp). Gradient accumulation without
  // pp reduces every micro-batch, as torchtitan's does (the memory-lean default).
  bool defer_reduce = false;
};

// The strategy of the mesh's layout over its dp_replicate and dp_shard groups. prefetch (zero3, hsdp):
// all-gather the next block's parameters while the current block computes. With masters every layout
// runs on full sharding's units (ddp as FSDP2's replicate); zero1 and zero2 keep a bf16 copy whole.
std::unique_ptr<ParallelStrategy> make_strategy(const Mesh& mesh, double bucket_mb, bool prefetch = true, const ParamPolicy& policy = {});

// A 64-bit hash of a tensor's exact bytes, computed on its device, chained onto `seed`; for fingerprints.
uint64_t fingerprint(const torch::Tensor& t, uint64_t seed = 1469598103934665603ULL);

// Sum of the distinct storages' allocated bytes behind the tensors (views of one buffer count once).
int64_t storage_bytes(const std::vector<torch::Tensor>& tensors);

}  // namespace trainscope::suites
