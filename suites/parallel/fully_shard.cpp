// Full sharding: zero3 (FSDP) over the dp_shard group, and hsdp, zero3 within each shard group with
// the gradient slices all-reduced across the dp_replicate group. With fp32 masters (bf16-master) the
// same units run FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype): each rank's fp32 shard
// is cast to bf16 and the bf16 shards gathered; the bf16 gradients are copied into a reduce_dtype
// buffer and reduce-scattered (mean over the ranks) into the fp32 shard's gradient. Without a shard
// group the units are FSDP2's replicate (ddp: the cast per unit, gradients all-reduced) or one process.
#include <set>

#include "core/errors.hpp"
#include "suites/parallel/sharding.hpp"

namespace trainscope::suites::detail {
namespace {

// One unit of full sharding: a block's parameters (or the root's), flat and sharded.
struct Unit : torch::CustomClassHolder {
  FlatParams fp;        // the parameters are views of fp.flat, in the compute dtype
  torch::Tensor shard;  // this rank's slice: a leaf the optimizer owns (its own memory; the fp32 master)
  Communicator* comm = nullptr;      // the group the unit is sharded over (null: not sharded)
  Communicator* replicas = nullptr;  // hsdp and replicate: the same slice on the other copies (else null)
  Communicator* post_forward = nullptr;  // reshard_after_forward = r: the r ranks a kept slice is gathered over
  bool master = false;
  at::ScalarType reduce_dtype = at::kFloat;
  torch::Tensor kept;   // reshard_after_forward = r: this rank's 1/r of fp.flat, from forward to backward
  bool accumulating = false;  // defer_reduce: fp.grad holds the step's unsharded gradient so far

  std::shared_ptr<PendingCollective> pending;  // a prefetch in flight
  torch::Tensor pending_source;                // and what it sends (the cast shard), alive until it is done

  bool resident() const { return fp.flat.storage().nbytes() > 0; }
  // What this rank contributes to the gather: its shard, cast to the compute dtype.
  torch::Tensor source() const { return master ? shard.detach().to(fp.flat.scalar_type()) : shard.detach(); }
  // Full parameters resident: already (not resharded), the prefetch's, the kept slice's gather, or
  // gathered now.
  void gather() {
    if (pending) {
      pending->wait();
      pending.reset();
      pending_source = torch::Tensor();
      return;
    }
    if (resident()) return;
    allocate_storage(fp.flat);
    torch::NoGradGuard no_grad;
    if (kept.defined()) {
      post_forward->all_gather(fp.flat, kept);
      kept = torch::Tensor();
    } else if (comm) {
      comm->all_gather(fp.flat, source());
    } else {
      fp.flat.copy_(shard.detach());
    }
  }
  // Starts gathering while the caller goes on computing (FSDP's forward and backward prefetch).
  void prefetch() {
    if (pending || resident() || kept.defined() || !comm) return;
    allocate_storage(fp.flat);
    torch::NoGradGuard no_grad;
    pending_source = source();
    pending = comm->all_gather_async(fp.flat, pending_source);
  }
  void release() { release_storage(fp.flat); }
  // After the block's forward (FSDP2's reshard_after_forward): free the gathered parameters, keep them,
  // or keep this rank's 1/r of them for an r-rank gather in backward.
  void reshard_after_forward(const std::string& how) {
    if (how == "false") return;
    if (post_forward && post_forward->world_size() < (comm ? comm->world_size() : 1)) {
      torch::NoGradGuard no_grad;
      const int64_t chunk = fp.flat.numel() / post_forward->world_size();
      kept = fp.flat.narrow(0, post_forward->rank() * chunk, chunk).clone();
    }
    release();
  }
  // The block's parameter gradients -> this rank's slice of their mean over ranks (fp32 with masters).
  torch::Tensor reduce(const std::vector<torch::Tensor>& grads) {
    torch::NoGradGuard no_grad;
    allocate_storage(fp.grad);  // reduce_dtype: the bf16 gradients are converted as they are copied in
    int64_t off = 0;
    for (size_t i = 0; i < fp.params.size(); ++i) {
      const int64_t n = fp.params[i].numel();
      if (grads[i].defined())
        fp.grad.narrow(0, off, n).copy_(grads[i].reshape(-1));
      else
        fp.grad.narrow(0, off, n).zero_();
      off += n;
    }
    fp.grad.narrow(0, off, fp.grad.numel() - off).zero_();
    torch::Tensor out = reduce_scatter_grad(fp.grad);
    release_storage(fp.grad);
    return out;
  }
  // defer_reduce: the block's gradients added into its unsharded gradient (the first micro-batch's copied
  // in, converted to reduce_dtype, as FSDP2's unsharded_accumulated_grad).
  void accumulate(const std::vector<torch::Tensor>& grads) {
    torch::NoGradGuard no_grad;
    if (!accumulating) {
      allocate_storage(fp.grad);
      fp.grad.zero_();
    }
    int64_t off = 0;
    for (size_t i = 0; i < fp.params.size(); ++i) {
      const int64_t n = fp.params[i].numel();
      if (grads[i].defined()) {
        torch::Tensor slot = fp.grad.narrow(0, off, n);
        if (accumulating) slot.add_(grads[i].reshape(-1));
        else slot.copy_(grads[i].reshape(-1));
      }
      off += n;
    }
    accumulating = true;
  }
  // This rank's slice of `full` averaged over every rank: over the shard group, then over the replicas,
  // so that the mean is over the world; in the shard's dtype.
  torch::Tensor reduce_scatter_grad(const torch::Tensor& full) {
    torch::Tensor out = torch::empty({fp.shard}, full.options());
    if (comm) comm->reduce_scatter(out, full, /*average=*/true);
    else out.copy_(full.narrow(0, 0, fp.shard));
    if (replicas) replicas->all_reduce(out, /*average=*/true);
    return out.scalar_type() == shard.scalar_type() ? out : out.to(shard.scalar_type());
  }
};

struct Zero3Call : torch::CustomClassHolder {
  c10::intrusive_ptr<Unit> unit;
  c10::intrusive_ptr<Unit> next_forward, next_backward;  // prefetched while this block computes (or null)
  BlockFn body;
  std::string reshard;  // reshard_after_forward
  bool defer = false;   // ParamPolicy::defer_reduce
  torch::Tensor input, output;  // the block's own graph, kept from forward to backward
};

// Runs a block between a gather and a release. The block's graph is recorded inside forward (grad
// mode on), so its activations are kept exactly as without sharding (or recomputed, when the body is
// checkpointed); backward re-gathers the parameters that graph refers to, takes the gradients and
// reduce-scatters them into the shard's gradient.
struct Zero3BlockFunction : public torch::autograd::Function<Zero3BlockFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& shard, c10::intrusive_ptr<Zero3Call> call) {
    call->unit->gather();
    if (call->next_forward) call->next_forward->prefetch();
    call->input = x.detach().requires_grad_(x.requires_grad());
    {
      torch::AutoGradMode grad_on(true);
      call->output = call->body(call->input);
    }
    call->unit->reshard_after_forward(call->reshard);
    ctx->saved_data["call"] = c10::IValue::make_capsule(call);
    return call->output.detach();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto call = c10::static_intrusive_pointer_cast<Zero3Call>(ctx->saved_data["call"].toCapsule());
    Unit& unit = *call->unit;
    unit.gather();
    if (call->next_backward) call->next_backward->prefetch();
    // What this backward needs: the input's gradient and the shard's in one backward; a split one
    // (pipelining's zero-bubble schedules) asks for the input's first (the block's graph kept, the
    // parameters left gathered), then the shard's, which reduces.
    const bool input_grad = call->input.requires_grad() && ctx->needs_input_grad(0), weights = ctx->needs_input_grad(1);
    std::vector<torch::Tensor> wrt;
    if (weights) wrt = unit.fp.params;
    if (input_grad) wrt.push_back(call->input);
    auto grads = torch::autograd::grad({call->output}, wrt, {grad_out[0]}, /*retain_graph=*/!weights,
                                       /*create_graph=*/false, /*allow_unused=*/true);
    torch::Tensor input_g = input_grad ? grads.back() : torch::Tensor();
    if (!weights) return {input_g, torch::Tensor(), torch::Tensor()};
    call->output = torch::Tensor();
    grads.resize(unit.fp.params.size());
    if (call->defer) {  // kept gathered; reduced after the last micro-batch (Zero3::reduce_gradients)
      unit.accumulate(grads);
      return {input_g, torch::Tensor(), torch::Tensor()};
    }
    unit.release();
    torch::Tensor shard_g = unit.reduce(grads);
    return {input_g, shard_g, torch::Tensor()};
  }
};

// zero3 shards every unit over its dp_shard group (the world, without other dimensions). hsdp (hybrid
// sharding: FSDP's HYBRID_SHARD, FSDP2 on a 2-D mesh, DeepSpeed ZeRO++'s hpZ) shards it over a group of
// dp_shard ranks (one node's by default) and keeps one copy per group: a unit's gradients are
// reduce-scattered within the group, then each slice all-reduced with the same slice of the other
// groups (the dp_replicate group). The gathers stay on the fast links inside a node; across nodes only
// the gradient slices travel, Ψ/dp_shard per rank per step.
class Zero3 : public ParallelStrategy {
 public:
  Zero3(Communicator* world, Communicator* shard, Communicator* replicas, bool prefetch, const ParamPolicy& policy)
      : ParallelStrategy(world), prefetch_(prefetch), policy_(policy), shard_comm_(shard), replica_comm_(replicas) {}
  bool sliced_gradients() const override { return shard_comm_ != nullptr; }
  Communicator* gradient_group() const override { return shard_comm_; }
  int64_t sharding_degree() const override { return shard_comm_ ? shard_comm_->world_size() : 1; }
  std::string sharding_level() const override { return shard_comm_ ? "zero3" : replica_comm_ ? "ddp" : "single"; }

  std::vector<torch::Tensor> setup(ReferenceModel& model, bool broadcast) override {
    model_ = &model;
    post_forward_group();
    std::set<const void*> in_blocks;
    for (torch::nn::Module* b : model.blocks()) {
      units_.push_back(make_unit(b->parameters(), broadcast, /*root=*/false));
      for (const auto& p : units_.back()->fp.params) in_blocks.insert(p.unsafeGetTensorImpl());
    }
    std::vector<torch::Tensor> rest;
    for (const auto& p : model.parameters())
      if (!in_blocks.count(p.unsafeGetTensorImpl())) rest.push_back(p);
    // The root's parameters take their gradients through the normal path into fp.grad's views.
    root_ = make_unit(rest, broadcast, /*root=*/true);
    std::vector<torch::Tensor> owned;
    for (auto* u : all_units()) owned.push_back(u->shard);
    if (comm_) broadcast_buffers(*comm_, model);
    model.set_block_wrapper([this](int64_t index, const BlockFn& body, const torch::Tensor& x) {
      auto call = c10::make_intrusive<Zero3Call>();
      const size_t i = static_cast<size_t>(index);
      call->unit = units_.at(i);
      if (prefetch_) {
        if (i + 1 < units_.size()) call->next_forward = units_[i + 1];
        if (i > 0) call->next_backward = units_[i - 1];
      }
      call->body = body;
      call->reshard = policy_.defer_reduce ? "false" : policy_.reshard_after_forward;
      call->defer = policy_.defer_reduce;
      return Zero3BlockFunction::apply(x, call->unit->shard, call);
    });
    return owned;
  }
  std::vector<Ranges> counted_ranges(const std::vector<bool>& counted) const override {
    const std::set<const void*> keep = counted_parameters(counted);
    std::vector<Ranges> out;
    for (auto* u : all_units()) out.push_back(u->fp.ranges_in_slice(shard_comm_ ? shard_comm_->rank() : 0, keep));
    return out;
  }
  void zero_grad(torch::optim::Optimizer&) override {
    torch::NoGradGuard no_grad;
    for (auto* u : all_units()) u->shard.mutable_grad().zero_();
  }
  void before_forward() override {
    root_->gather();
    allocate_storage(root_->fp.grad);
    torch::NoGradGuard no_grad;
    root_->fp.grad.zero_();
  }
  void reduce_gradients() override {
    // Block gradients were reduce-scattered during backward (deferred: now, after the last micro-batch,
    // the blocks released with them); the root's now (with masters its bf16 gradients are first copied
    // into a reduce_dtype buffer, as FSDP2's reduce-scatter input).
    torch::NoGradGuard no_grad;
    for (auto& u : units_) {
      if (!u->accumulating) continue;
      u->shard.mutable_grad().add_(u->reduce_scatter_grad(u->fp.grad));
      release_storage(u->fp.grad);
      u->accumulating = false;
      u->release();
    }
    const torch::Tensor& g = root_->fp.grad;
    torch::Tensor out = root_->reduce_scatter_grad(g.scalar_type() == policy_.reduce || !policy_.master ? g : g.to(policy_.reduce));
    root_->shard.mutable_grad().copy_(out);
    release_storage(root_->fp.grad);
    root_->release();
  }
  void materialize() override {
    for (auto* u : all_units()) u->gather();
  }
  uint64_t parameter_fingerprint() override {
    uint64_t h = 1469598103934665603ULL;
    for (auto* u : all_units()) {
      const bool resident = u->resident();
      if (!resident) u->gather();
      h = fingerprint(u->fp.flat.narrow(0, 0, u->fp.numel), h);
      if (!resident) u->release();
    }
    return h;
  }
  torch::Tensor full_parameters() override {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> parts;
    for (auto* u : all_units()) {
      const bool resident = u->resident();
      if (!resident) u->gather();
      parts.push_back(u->fp.flat.narrow(0, 0, u->fp.numel).to(torch::kFloat, /*non_blocking=*/false, /*copy=*/true));
      if (!resident) u->release();
    }
    return torch::cat(parts);
  }
  std::vector<torch::Tensor> master_values() override {
    if (!policy_.master) return ParallelStrategy::master_values();
    // Every unit's fp32 shards gathered, then cut into the model's parameters by identity.
    torch::NoGradGuard no_grad;
    std::map<const void*, torch::Tensor> value;
    for (auto* u : all_units()) {
      torch::Tensor full = torch::empty({u->fp.shard * sharding_degree()}, u->shard.options());
      if (shard_comm_) shard_comm_->all_gather(full, u->shard.detach());
      else full.copy_(u->shard.detach());
      int64_t off = 0;
      for (const auto& p : u->fp.params) {
        value[p.unsafeGetTensorImpl()] = full.narrow(0, off, p.numel()).view(p.sizes()).clone();
        off += p.numel();
      }
    }
    std::vector<torch::Tensor> out;
    for (const auto& p : model_->parameters()) out.push_back(value.at(p.unsafeGetTensorImpl()));
    return out;
  }
  ModelStateBytes model_state(const torch::optim::Optimizer& opt, int64_t words) const override {
    ModelStateBytes m = ParallelStrategy::model_state(opt, words);
    // The gathered buffers are released at rest; what the rank holds is its shards and their gradients.
    std::vector<torch::Tensor> shards, grads;
    for (auto* u : all_units()) {
      shards.push_back(u->shard);
      shards.push_back(u->fp.flat);
      grads.push_back(u->shard.grad());
      grads.push_back(u->fp.grad);
    }
    m.params = storage_bytes(shards);
    m.grads = storage_bytes(grads);
    return m;
  }

 private:
  std::vector<Unit*> all_units() const {
    std::vector<Unit*> out;
    for (auto& u : units_) out.push_back(u.get());
    out.push_back(root_.get());
    return out;
  }
  // A unit over `params`: flat in the compute dtype, this rank's shard (rank 0's values everywhere),
  // released until its first gather. With masters the shard keeps the fp32 values the parameters had.
  c10::intrusive_ptr<Unit> make_unit(const std::vector<torch::Tensor>& params, bool broadcast, bool root) {
    auto u = c10::make_intrusive<Unit>();
    const int world = shard_comm_ ? shard_comm_->world_size() : 1, rank = shard_comm_ ? shard_comm_->rank() : 0;
    torch::NoGradGuard no_grad;
    torch::Tensor values = flat_values(params, world, params.front().scalar_type());
    if (broadcast && comm_) comm_->broadcast({values}, 0);
    if (policy_.master) {
      // The block's gradients come back from autograd and are copied into a reduce_dtype buffer; the
      // root's accumulate in .grad, in the compute dtype, and are converted when reduced.
      u->fp.build(params, world, policy_.compute, root ? policy_.compute : policy_.reduce);
    } else {
      u->fp.build(params, world);
    }
    u->shard = values.narrow(0, rank * u->fp.shard, u->fp.shard).clone().requires_grad_(true);
    u->shard.mutable_grad() = torch::zeros_like(u->shard);
    u->comm = shard_comm_;
    u->replicas = replica_comm_;
    u->post_forward = post_forward_.get();
    u->master = policy_.master;
    u->reduce_dtype = policy_.reduce;
    u->release();
    release_storage(u->fp.grad);
    return u;
  }
  // reshard_after_forward = r: the r consecutive ranks of the shard group this rank's kept slices are
  // gathered over in backward (FSDP2's post-forward mesh). r must divide the group.
  void post_forward_group() {
    const std::string& how = policy_.reshard_after_forward;
    if (how == "true" || how == "false" || !shard_comm_) return;
    const int64_t r = std::stoll(how), n = shard_comm_->world_size();
    if (r < 1 || n % r != 0)
      throw UsageError("reshard_after_forward = " + how + " does not divide the " + std::to_string(n) + " ranks of the shard group");
    const int first = static_cast<int>(shard_comm_->rank() / r * r);
    std::vector<int> ranks;
    for (int i = 0; i < r; ++i) ranks.push_back(first + i);
    post_forward_ = shard_comm_->split(ranks, "post-forward-" + std::to_string(first), "intra-node");
  }

  bool prefetch_;
  ParamPolicy policy_;
  Communicator* shard_comm_;    // the dp_shard group (null: units are not sharded)
  Communicator* replica_comm_;  // hsdp and replicate: the dp_replicate group (null for zero3)
  std::unique_ptr<Communicator> post_forward_;
  std::vector<c10::intrusive_ptr<Unit>> units_;
  c10::intrusive_ptr<Unit> root_;
};

}  // namespace

std::unique_ptr<ParallelStrategy> make_fully_shard(Communicator* world, Communicator* shard, Communicator* replicas, bool prefetch,
                                                   const ParamPolicy& policy) {
  ParamPolicy p = policy;
  // FSDP2's reshard_after_forward = r at its ends: 1 keeps everything (false), the group's size frees it (true).
  if (p.reshard_after_forward == "1") p.reshard_after_forward = "false";
  if (shard && p.reshard_after_forward == std::to_string(shard->world_size())) p.reshard_after_forward = "true";
  return std::make_unique<Zero3>(world, shard, replicas, prefetch, p);
}

}  // namespace trainscope::suites::detail
