#include "suites/parallel/tensor_parallel.hpp"

#include <mutex>

#include "suites/parallel/comm.hpp"

namespace trainscope::suites::tensor_parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group travels through autograd's saved data as an address (saved_data holds IValues).
void keep(AutogradContext* ctx, const TensorParallel& tp) {
  ctx->saved_data["group"] = reinterpret_cast<int64_t>(tp.group);
  ctx->saved_data["rank"] = tp.rank;
  ctx->saved_data["degree"] = tp.degree;
}
TensorParallel kept(AutogradContext* ctx) {
  TensorParallel tp;
  tp.group = reinterpret_cast<Communicator*>(ctx->saved_data["group"].toInt());
  tp.rank = ctx->saved_data["rank"].toInt();
  tp.degree = ctx->saved_data["degree"].toInt();
  return tp;
}

torch::Tensor all_reduced(const torch::Tensor& x, const TensorParallel& tp) {
  torch::Tensor out = x.contiguous().clone();
  tp.group->all_reduce(out, /*average=*/false);
  return out;
}

// [B, s, ...] on each rank -> [B, tp x s, ...], the ranks' blocks in rank order along dim 1.
torch::Tensor gather_dim1(const torch::Tensor& x, const TensorParallel& tp) {
  const torch::Tensor shard = x.contiguous();
  torch::Tensor full = torch::empty({tp.degree * shard.numel()}, shard.options());
  tp.group->all_gather(full, shard.reshape({-1}));
  std::vector<int64_t> blocks{tp.degree};
  for (int64_t d : shard.sizes()) blocks.push_back(d);
  std::vector<int64_t> out(shard.sizes().begin(), shard.sizes().end());
  out[1] *= tp.degree;
  return full.view(blocks).transpose(0, 1).reshape(out);
}

// [B, S, ...] summed over ranks, this rank's block of S/tp along dim 1.
torch::Tensor reduce_scatter_dim1(const torch::Tensor& x, const TensorParallel& tp) {
  TORCH_CHECK(x.size(1) % tp.degree == 0, "sequence parallelism: the sequence does not split into tp blocks");
  std::vector<int64_t> split{x.size(0), tp.degree, x.size(1) / tp.degree};
  for (int64_t d = 2; d < x.dim(); ++d) split.push_back(x.size(d));
  const torch::Tensor blocks = x.reshape(split).transpose(0, 1).contiguous();  // scratch the collective may overwrite
  std::vector<int64_t> out(x.sizes().begin(), x.sizes().end());
  out[1] /= tp.degree;
  torch::Tensor shard = torch::empty({blocks.numel() / tp.degree}, x.options());
  tp.group->reduce_scatter(shard, blocks.reshape({-1}), /*average=*/false);
  return shard.view(out);
}

struct Copy : torch::autograd::Function<Copy> {  // f without sequence parallelism
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, TensorParallel tp) {
    keep(ctx, tp);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) { return {all_reduced(g[0], kept(ctx)), {}}; }
};

struct Reduce : torch::autograd::Function<Reduce> {  // g without sequence parallelism
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& x, TensorParallel tp) { return all_reduced(x, tp); }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], {}}; }
};

struct GatherSequence : torch::autograd::Function<GatherSequence> {  // f with sequence parallelism
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, TensorParallel tp) {
    keep(ctx, tp);
    return gather_dim1(x, tp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) { return {reduce_scatter_dim1(g[0], kept(ctx)), {}}; }
};

struct ScatterSequence : torch::autograd::Function<ScatterSequence> {  // g with sequence parallelism
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, TensorParallel tp) {
    keep(ctx, tp);
    return reduce_scatter_dim1(x, tp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) { return {gather_dim1(g[0], kept(ctx)), {}}; }
};

// DTensor's loss_parallel (torch/distributed/tensor/parallel/loss.py: _log_softmax, _nll_loss_forward,
// _nll_loss_and_log_softmax_backward) op for op, so that the same shards give the same bits.
struct VocabCrossEntropy : torch::autograd::Function<VocabCrossEntropy> {
  static constexpr int64_t kIgnore = -100;
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& target, TensorParallel tp) {
    // fp32 at least (fp64 stays fp64), as ReferenceModel::loss takes the logits.
    const torch::Tensor x = logits.to(at::promote_types(logits.scalar_type(), torch::kFloat)).contiguous();
    torch::Tensor x_max = torch::amax(x, 1, /*keepdim=*/true);
    tp.group->all_reduce_max(x_max);
    const torch::Tensor shifted = x - x_max;
    torch::Tensor sumexp = torch::sum(torch::exp(shifted), 1, /*keepdim=*/true);
    tp.group->all_reduce(sumexp, /*average=*/false);
    const torch::Tensor logp = shifted - torch::log(sumexp);
    // The target's log-probability: gathered where this rank holds the target's column, 0 elsewhere, summed.
    const int64_t width = x.size(1), first = tp.rank * width;
    const torch::Tensor safe = torch::where(target != kIgnore, target, 0);
    const torch::Tensor outside = (safe < first).logical_or(safe >= first + width);
    const torch::Tensor local = (safe - first).masked_fill(outside, 0);
    torch::Tensor picked = torch::gather(logp, 1, local.unsqueeze(1)).masked_fill(outside.unsqueeze(1), 0.0);
    tp.group->all_reduce(picked, /*average=*/false);
    torch::Tensor result = torch::where(target != kIgnore, -picked.squeeze(1), 0);
    const torch::Tensor total = (target != kIgnore).sum().to(x);
    ctx->save_for_backward({logp, local, outside, target, total});
    return result.sum() / total;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &logp = saved[0], &local = saved[1], &outside = saved[2], &target = saved[3], &total = saved[4];
    const torch::Tensor go = g[0] / total;
    torch::Tensor grad = torch::zeros_like(logp);
    const torch::Tensor rows = torch::arange(local.size(0), local.options());
    grad.index_put_({rows, local}, outside.to(grad.scalar_type()) - 1.0);
    const torch::Tensor scale = torch::where(target.unsqueeze(1) != kIgnore, go, 0);
    return {(grad + torch::exp(logp)) * scale, {}, {}};
  }
};

// Megatron's sequence-parallel column GEMMs: forward gathers the shard into a temporary, backward gathers
// it again; only the shard and the weights are saved. `biased` (bit i: weight i has a bias) says which
// weights the defined `biases` belong to, in order.
struct RegatheredLinears : torch::autograd::Function<RegatheredLinears> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& shard, at::TensorList weights, at::TensorList biases,
                               int64_t biased, TensorParallel tp) {
    keep(ctx, tp);
    ctx->saved_data["count"] = static_cast<int64_t>(weights.size());
    ctx->saved_data["biased"] = biased;
    std::vector<torch::Tensor> saved{shard};
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx->save_for_backward(saved);
    const torch::Tensor full = gather_dim1(shard, tp);
    variable_list out;
    size_t next_bias = 0;
    for (size_t i = 0; i < weights.size(); ++i)
      out.push_back(torch::linear(full, weights[i], biased >> i & 1 ? biases[next_bias++] : torch::Tensor()));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const TensorParallel tp = kept(ctx);
    const auto saved = ctx->get_saved_variables();
    const int64_t n = ctx->saved_data["count"].toInt(), biased = ctx->saved_data["biased"].toInt();
    const torch::Tensor full = gather_dim1(saved[0], tp);  // the second all-gather
    const torch::Tensor full2d = full.reshape({-1, full.size(-1)});
    torch::Tensor grad_full;
    variable_list weight_grads, bias_grads;
    for (int64_t i = 0; i < n; ++i) {
      const torch::Tensor gi = g[i].reshape({-1, g[i].size(-1)});
      const torch::Tensor gx = gi.mm(saved[1 + i]);
      grad_full = grad_full.defined() ? grad_full + gx : gx;
      weight_grads.push_back(gi.t().mm(full2d));
      if (biased >> i & 1) bias_grads.push_back(gi.sum(0));
    }
    variable_list out{reduce_scatter_dim1(grad_full.view(full.sizes()), tp)};
    out.insert(out.end(), weight_grads.begin(), weight_grads.end());
    out.insert(out.end(), bias_grads.begin(), bias_grads.end());
    out.push_back(torch::Tensor());  // biased
    out.push_back(torch::Tensor());  // tp
    return out;
  }
};

}  // namespace

std::vector<torch::Tensor> column_parallel(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                                           const std::vector<torch::Tensor>& biases, const TensorParallel& tp,
                                           const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>& linear) {
  if (tp.active() && tp.sequence && tp.regather) {
    std::vector<torch::Tensor> defined;  // an undefined tensor cannot be an autograd input
    int64_t biased = 0;
    for (size_t i = 0; i < biases.size() && i < weights.size(); ++i)
      if (biases[i].defined()) defined.push_back(biases[i]), biased |= int64_t{1} << i;
    return RegatheredLinears::apply(x, at::TensorList(weights), at::TensorList(defined), biased, tp);  // TensorList: each a Variable
  }
  const torch::Tensor in = enter(x, tp);
  std::vector<torch::Tensor> out;
  for (size_t i = 0; i < weights.size(); ++i) out.push_back(linear(in, weights[i], i < biases.size() ? biases[i] : torch::Tensor()));
  return out;
}

torch::Tensor shard(const torch::Tensor& full, const Split& split, const TensorParallel& tp) {
  std::vector<torch::Tensor> mine;
  for (const torch::Tensor& group : full.chunk(split.groups, split.dim)) mine.push_back(group.chunk(tp.degree, split.dim)[tp.rank]);
  return torch::cat(mine, split.dim).contiguous().clone();
}

torch::Tensor unshard(const torch::Tensor& local, const Split& split, const TensorParallel& tp) {
  const torch::Tensor x = local.detach().contiguous();
  torch::Tensor full = torch::empty({tp.degree * x.numel()}, x.options());
  tp.group->all_gather(full, x.reshape({-1}));
  std::vector<int64_t> blocks{tp.degree};
  for (int64_t d : x.sizes()) blocks.push_back(d);
  const std::vector<torch::Tensor> ranks = full.view(blocks).unbind(0);
  std::vector<torch::Tensor> whole;  // group by group, each the ranks' blocks of it in rank order
  for (int64_t g = 0; g < split.groups; ++g)
    for (const torch::Tensor& r : ranks) whole.push_back(r.chunk(split.groups, split.dim)[g]);
  return torch::cat(whole, split.dim);
}

namespace {

at::Generator default_generator(const torch::Device& d) { return at::globalContext().defaultGenerator(d); }

}  // namespace

void RngTracker::seed(uint64_t s) {
  seeded_ = true;
  seed_ = s;
  state_ = at::Tensor();
}

void RngTracker::reset() {
  seeded_ = false;
  state_ = at::Tensor();
}

torch::Tensor RngTracker::fork(const torch::Device& device, const std::function<torch::Tensor()>& draw) {
  if (!seeded_) return draw();
  at::Generator gen = default_generator(device);
  at::Tensor outside;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    outside = gen.get_state();
    if (state_.defined()) gen.set_state(state_);
    else gen.set_current_seed(seed_);  // the first draw: the tracker's stream starts at its seed
  }
  torch::Tensor y = draw();
  std::lock_guard<std::mutex> lock(gen.mutex());
  state_ = gen.get_state();
  gen.set_state(outside);
  return y;
}

torch::Tensor RngTracker::dropout(const torch::Tensor& x, double p, bool train) {
  if (!train || p <= 0) return torch::dropout(x, p, train);
  return fork(x.device(), [&] { return torch::dropout(x, p, train); });
}

at::Tensor RngTracker::snapshot() const {
  if (state_.defined()) return state_;
  return torch::tensor({seeded_ ? static_cast<int64_t>(seed_) : int64_t{-1}});
}

RngTracker& rng_tracker() {
  static RngTracker tracker;
  return tracker;
}

torch::Tensor split_dropout(const torch::Tensor& x, double p, bool train, const TensorParallel& tp) {
  return tp.active() ? rng_tracker().dropout(x, p, train) : torch::dropout(x, p, train);
}

torch::Tensor enter(const torch::Tensor& x, const TensorParallel& tp) {
  if (!tp.active()) return x;
  return tp.sequence ? GatherSequence::apply(x, tp) : Copy::apply(x, tp);
}

torch::Tensor leave(const torch::Tensor& partial, const TensorParallel& tp) {
  if (!tp.active()) return partial;
  return tp.sequence ? ScatterSequence::apply(partial, tp) : Reduce::apply(partial, tp);
}

torch::Tensor replicated(const torch::Tensor& weight, const TensorParallel& tp) {
  return tp.active() ? Copy::apply(weight, tp) : weight;
}

torch::Tensor vocab_embedding(const torch::Tensor& tokens, const torch::Tensor& weight_shard, const TensorParallel& tp) {
  if (!tp.active()) return torch::embedding(weight_shard, tokens);
  const int64_t rows = weight_shard.size(0), first = tp.rank * rows;
  const torch::Tensor outside = (tokens < first).logical_or(tokens >= first + rows);
  const torch::Tensor local = (tokens - first).masked_fill(outside, 0);
  return leave(torch::embedding(weight_shard, local).masked_fill(outside.unsqueeze(-1), 0.0), tp);
}

torch::Tensor vocab_cross_entropy(const torch::Tensor& logits_shard, const torch::Tensor& target, const TensorParallel& tp) {
  return VocabCrossEntropy::apply(logits_shard, target, tp);
}

}  // namespace trainscope::suites::tensor_parallel
