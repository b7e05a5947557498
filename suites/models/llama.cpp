// The Llama 3 decoder, op for op as Hugging Face's LlamaForCausalLM (transformers 5.25,
// models/llama/modeling_llama.py) runs it, so that the same weights and tokens give the same bits in
// fp32, forward and backward (tests/parity checks it): RMSNorm normalised in fp32 and cast back before
// the weight multiply; RoPE in the rotate-half layout with Llama 3's frequency scaling; grouped-query
// attention (eager: repeat_kv, an additive mask of the dtype's lowest value, fp32 softmax; sdpa:
// at::scaled_dot_product_attention with is_causal and enable_gqa); SwiGLU; no biases; an optional
// tied head; cross-entropy on fp32 logits (ReferenceModel::loss).
//
// Parameter names follow HF's with `model.layers.<i>.` as `block<i>.` and the attention and MLP
// projections flat in the block (block0.q_proj.weight, block0.gate_proj.weight, embed_tokens.weight,
// norm.weight, lm_head.weight), so a dump maps onto HF's state dict by name.
#include <cmath>
#include <limits>

#include "suites/models/models.hpp"
#include "suites/techniques/precision.hpp"

namespace trainscope::suites {
namespace {

namespace nn = torch::nn;

// Every projection goes through the op-level checkpoint's operator (project() outside one).
torch::Tensor linear(const nn::Linear& layer, const torch::Tensor& x) { return sac_linear(x, layer->weight, layer->bias); }
torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) { return sac_linear(x, w, b); }

nn::Linear no_bias(int64_t in, int64_t out) { return nn::Linear(nn::LinearOptions(in, out).bias(false)); }

class RmsNormImpl : public nn::Module {
 public:
  RmsNormImpl(int64_t d, double eps) : eps_(eps) { weight = register_parameter("weight", torch::ones({d})); }
  torch::Tensor forward(const torch::Tensor& x, const TensorParallel& tp = {}) {
    // On sequence shards each rank's tokens give part of the weight's gradient (summed over the ranks),
    // and the input passes an identity first, as DTensor's SequenceParallel wraps it: the two gradients
    // inside the norm add up before the residual's joins them.
    const torch::Tensor in = tp.sequence ? x.view_as(x) : x;
    const torch::Tensor w = tp.sequence ? tensor_parallel::replicated(weight, tp) : weight;
    const auto input_dtype = in.scalar_type();
    torch::Tensor h = in.to(torch::kFloat);
    const torch::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
    h = h * torch::rsqrt(variance + eps_);
    return w * h.to(input_dtype);
  }
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RmsNorm);

// inv_freq exactly as HF computes it (modeling_rope_utils.py): the same ops on the same dtypes, where
// Python's `a / t` is t.reciprocal() * a and `1 - t` is rsub. Kept in fp32 whatever the parameters'
// dtype (as Meta's reference; HF's model.to(bf16) would round it to bf16 too).
torch::Tensor rope_inverse_frequencies(const ModelPreset& p) {
  const int64_t dim = p.head_dim();
  torch::Tensor inv = torch::pow(p.rope_theta, torch::arange(0, dim, 2, torch::kLong).to(torch::kFloat) / dim)
                          .reciprocal() * 1.0;
  if (p.rope_factor <= 1.0) return inv;  // rope_type "default"
  const double factor = p.rope_factor, low = p.rope_low_freq_factor, high = p.rope_high_freq_factor;
  const double old_ctx = static_cast<double>(p.rope_original_ctx);
  const double low_freq_wavelen = old_ctx / low, high_freq_wavelen = old_ctx / high;
  const torch::Tensor wavelen = inv.reciprocal() * (2 * M_PI);
  torch::Tensor inv_llama = torch::where(wavelen > low_freq_wavelen, inv / factor, inv);
  const torch::Tensor smooth = (wavelen.reciprocal() * old_ctx - low) / (high - low);
  const torch::Tensor smoothed = torch::rsub(smooth, 1) * inv_llama / factor + smooth * inv_llama;
  const torch::Tensor is_medium = (wavelen < high_freq_wavelen).logical_not() * (wavelen > low_freq_wavelen).logical_not();
  return torch::where(is_medium, smoothed, inv_llama);
}

torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  const torch::Tensor x1 = x.slice(-1, 0, half), x2 = x.slice(-1, half);
  return torch::cat({-x2, x1}, -1);
}

// (b, kv, s, d) -> (b, kv * n_rep, s, d), as HF's repeat_kv (expand, then reshape).
torch::Tensor repeat_kv(const torch::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const int64_t b = x.size(0), kv = x.size(1), s = x.size(2), d = x.size(3);
  return x.unsqueeze(2).expand({b, kv, n_rep, s, d}).reshape({b, kv * n_rep, s, d});
}

torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const torch::Tensor x_cos = x * cos.unsqueeze(1);
  return x_cos + rotate_half(x) * sin.unsqueeze(1);
}

// HF's LlamaRotaryEmbedding.forward: the cos and sin tables [1, S, Dh] in the hidden states' dtype (its
// temporaries freed on return, as in Python).
std::pair<torch::Tensor, torch::Tensor> rope_tables(const torch::Tensor& inv_freq, int64_t S, at::ScalarType dtype,
                                                    const torch::Device& device) {
  const torch::Tensor positions = (torch::arange(S, torch::TensorOptions().dtype(torch::kLong).device(device)) + 0).unsqueeze(0);
  const torch::Tensor freqs = positions.unsqueeze(-1).to(torch::kFloat) * inv_freq.to(device, torch::kFloat);
  const torch::Tensor emb = torch::cat({freqs, freqs}, -1);
  return {(emb.cos() * 1.0).to(dtype), (emb.sin() * 1.0).to(dtype)};
}

// HF's eager_mask: 0 where a token may look, the dtype's lowest value above the diagonal.
torch::Tensor causal_additive_mask(int64_t S, at::ScalarType dtype, const torch::Device& device, double lowest) {
  const auto opts = torch::TensorOptions().device(device);
  const torch::Tensor allowed = torch::ones({S, S}, opts.dtype(torch::kBool)).tril();
  return torch::where(allowed, torch::zeros({}, opts.dtype(dtype)), at::Scalar(lowest)).view({1, 1, S, S});
}

class LlamaBlock : public nn::Module {
 public:
  explicit LlamaBlock(const ModelPreset& p)
      : heads_(p.heads), kv_heads_(p.kv_heads), head_dim_(p.head_dim()), sdpa_(p.attention == "sdpa") {
    const int64_t D = p.width, q = p.heads * head_dim_, kv = p.kv_heads * head_dim_;
    input_layernorm_ = register_module("input_layernorm", RmsNorm(D, p.norm_eps));
    q_proj_ = register_module("q_proj", no_bias(D, q));
    k_proj_ = register_module("k_proj", no_bias(D, kv));
    v_proj_ = register_module("v_proj", no_bias(D, kv));
    o_proj_ = register_module("o_proj", no_bias(q, D));
    post_attention_layernorm_ = register_module("post_attention_layernorm", RmsNorm(D, p.norm_eps));
    gate_proj_ = register_module("gate_proj", no_bias(D, p.ffn));
    up_proj_ = register_module("up_proj", no_bias(D, p.ffn));
    down_proj_ = register_module("down_proj", no_bias(p.ffn, D));
  }

  // cos, sin: [1, S, Dh]; mask: the eager path's additive causal mask (undefined for sdpa).
  // Under tensor parallelism x is [B, S, D] on every rank, or its sequence shard [B, S / tp, D]; the
  // projections hold this rank's heads and MLP units (tensor_parallel.hpp).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& mask) {
    const torch::Tensor residual = x;
    // The norm's output is held to the block's end (the design difference docs/parity.md measures).
    const torch::Tensor normed = input_layernorm_->forward(x, tp_);
    const std::vector<torch::Tensor> qkv =
        tensor_parallel::column_parallel(normed, {q_proj_->weight, kv_weight(k_proj_), kv_weight(v_proj_)}, {}, tp_, project);
    const int64_t B = qkv[0].size(0), S = qkv[0].size(1);
    const torch::Tensor q = qkv[0].view({B, S, -1, head_dim_}).transpose(1, 2);
    const torch::Tensor k = qkv[1].view({B, S, -1, head_dim_}).transpose(1, 2);
    const torch::Tensor v = qkv[2].view({B, S, -1, head_dim_}).transpose(1, 2);
    // (q * cos) + (rotate_half(q) * sin), in HF's order; the products die with the sum, as Python's do.
    const torch::Tensor q_embed = apply_rotary(q, cos, sin);
    const torch::Tensor k_embed = apply_rotary(k, cos, sin);

    // The attention core: under `selective` it is recomputed in backward (q is its input, k and v its
    // differentiable extras), so its S x S tensors (eager) or the kernel's saved state are not kept.
    const double scaling = std::pow(static_cast<double>(head_dim_), -0.5);
    const int64_t n_rep = (heads_ / tp_.degree) / (kv_split() ? kv_heads_ / tp_.degree : 1);
    const bool sdpa = sdpa_;
    std::string* backend = &backend_;
    const ContextParallel* cp = &cp_;
    auto core = [k_embed, v, mask, scaling, n_rep, sdpa, backend, cp, B, S](const torch::Tensor& query) {
      torch::Tensor out;
      if (cp->active()) {  // this rank's queries against every cp rank's keys and values
        *backend = "cp-" + cp->method;
        out = context_parallel::attention(query, k_embed, v, scaling, *cp);
      } else if (sdpa) {
        if (backend->empty()) *backend = sdpa_backend(query, k_embed, v, true, n_rep > 1);
        out = sac_attention(query, k_embed, v, /*causal=*/true, scaling, /*enable_gqa=*/n_rep > 1, 0.0, [&] {
          return at::scaled_dot_product_attention(query, k_embed, v, {}, 0.0, /*is_causal=*/true, scaling, /*enable_gqa=*/n_rep > 1);
        });
        out = out.reshape({out.size(0), -1, S, v.size(-1)});
      } else {
        *backend = "eager";
        const torch::Tensor key_states = repeat_kv(k_embed, n_rep);
        const torch::Tensor value_states = repeat_kv(v, n_rep);
        torch::Tensor w = sac_matmul(query, key_states.transpose(2, 3)) * scaling;
        w = w + mask;
        w = torch::softmax(w, -1, torch::kFloat).to(query.scalar_type());
        out = sac_matmul(w, value_states);
      }
      return out.transpose(1, 2).contiguous().reshape({B, S, -1}).contiguous();
    };
    const bool recompute = policy_.kind == CheckpointPolicy::Kind::Selective && is_training() && torch::GradMode::is_enabled();
    const torch::Tensor attn = recompute ? checkpoint(core, q_embed, {k_embed, v}, policy_.restore_rng, policy_.check)
                                         : core(q_embed);
    const torch::Tensor h = residual + tensor_parallel::leave(linear(o_proj_, attn), tp_);
    // HF's order, SiLU before the up projection (the activations' peak is compared to the byte), unless
    // one node computes both (Megatron's re-gathering).
    const torch::Tensor normed2 = post_attention_layernorm_->forward(h, tp_);
    if (tp_.active() && tp_.sequence && tp_.regather) {
      const auto gate_up = tensor_parallel::column_parallel(normed2, {gate_proj_->weight, up_proj_->weight}, {}, tp_, project);
      return h + tensor_parallel::leave(linear(down_proj_, torch::silu(gate_up[0]) * gate_up[1]), tp_);
    }
    const torch::Tensor in = tensor_parallel::enter(normed2, tp_);
    const torch::Tensor gate = torch::silu(linear(gate_proj_, in));
    return h + tensor_parallel::leave(linear(down_proj_, gate * linear(up_proj_, in)), tp_);
  }
  void set_policy(const CheckpointPolicy& p) { policy_ = p; }
  void set_tensor_parallel(const TensorParallel& tp) { tp_ = tp; }
  void set_context_parallel(const ContextParallel& cp) { cp_ = cp; }
  // Key/value heads split over the tp ranks when tp divides them; otherwise each rank keeps the
  // projections whole and uses the one head its query heads read (Megatron replicates them so).
  bool kv_split() const { return kv_heads_ % tp_.degree == 0; }
  const std::string& backend() const { return backend_; }

 private:
  // This rank's key/value weight: its shard, or the one head its query heads read of the whole weight.
  torch::Tensor kv_weight(const nn::Linear& layer) const {
    if (kv_split()) return layer->weight;
    const int64_t head = tp_.rank / (tp_.degree / kv_heads_);
    return tensor_parallel::replicated(layer->weight, tp_).narrow(0, head * head_dim_, head_dim_);
  }
  int64_t heads_, kv_heads_, head_dim_;
  bool sdpa_;
  std::string backend_;
  CheckpointPolicy policy_;
  TensorParallel tp_;
  ContextParallel cp_;
  RmsNorm input_layernorm_{nullptr}, post_attention_layernorm_{nullptr};
  nn::Linear q_proj_{nullptr}, k_proj_{nullptr}, v_proj_{nullptr}, o_proj_{nullptr};
  nn::Linear gate_proj_{nullptr}, up_proj_{nullptr}, down_proj_{nullptr};
};

class Llama : public DecoderModel {
 public:
  explicit Llama(const ModelPreset& p) : DecoderModel(p), inv_freq_(rope_inverse_frequencies(p)) {
    embed_tokens_ = register_module("embed_tokens", nn::Embedding(p.vocab, p.width));
    for (int64_t i = 0; i < p.layers; ++i)
      blocks_.push_back(register_module("block" + std::to_string(i), std::make_shared<LlamaBlock>(p)));
    norm_ = register_module("norm", RmsNorm(p.width, p.norm_eps));
    if (!p.tied) lm_head_ = register_module("lm_head", no_bias(p.width, p.vocab));
    // HF's _init_weights: normal(0, 0.02) for every Linear and Embedding weight, RMSNorm weights 1.
    torch::NoGradGuard no_grad;
    for (auto& param : parameters())
      if (param.dim() >= 2) torch::nn::init::normal_(param, 0.0, 0.02);
  }

  torch::Tensor forward_layers(const torch::Tensor& in, int64_t first, int64_t last) override {
    // The tokens, or a stage's hidden states: with sequence parallelism each tp rank's S / tp of them.
    const int64_t S = first > 0 && tp_.active() && tp_.sequence ? in.size(1) * tp_.degree : in.size(1);
    torch::Tensor h = first == 0 ? boundary("embed", tensor_parallel::vocab_embedding(in, embed_tokens_->weight, tp_)) : in;
    // RoPE at the tokens' global positions: a cp shard takes its rows of the whole sequence's tables
    // (computed whole, as the vectorised cos and sin round the same input alike only in the same place).
    const auto tables = rope_tables(inv_freq_, S * cp_.degree, h.scalar_type(), in.device());
    const torch::Tensor cos = context_parallel::shard(tables.first, 1, cp_), sin = context_parallel::shard(tables.second, 1, cp_);
    torch::Tensor mask;  // eager only
    if (p_.attention != "sdpa" && !cp_.active()) mask = causal_additive_mask(S, h.scalar_type(), in.device(), lowest_of(h.scalar_type()));
    for (int64_t i = first; i < last; ++i) {
      auto& b = blocks_[static_cast<size_t>(i)];
      h = run_block(i, *b, [&b, cos, sin, mask](const torch::Tensor& x) { return b->forward(x, cos, sin, mask); }, h);
      h = boundary("block" + std::to_string(i), h);
    }
    if (last < p_.layers) return h;
    const torch::Tensor head = p_.tied ? embed_tokens_->weight : lm_head_->weight;
    const auto plain = [](const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor&) { return torch::linear(x, w); };
    return boundary("head", tensor_parallel::column_parallel(norm_->forward(h, tp_), {head}, {}, tp_,
                                                             p_.tied ? std::function(plain) : std::function(project))[0]);
  }

  std::string tied_head() const override { return p_.tied ? "embed_tokens.weight" : ""; }
  void set_context_parallel(const ContextParallel& cp) override {
    cp_ = cp;
    for (auto& b : blocks_) b->set_context_parallel(cp);
  }
  // Column-parallel: q, k and v (by heads), gate, up, and the head and the embedding (by vocabulary);
  // row-parallel: o and down. Norms stay whole.
  void set_tensor_parallel(const TensorParallel& tp) override {
    std::map<std::string, tensor_parallel::Split> dims{{"embed_tokens.weight", 0}};
    if (!p_.tied) dims["lm_head.weight"] = 0;
    for (size_t i = 0; i < blocks_.size(); ++i) {
      blocks_[i]->set_tensor_parallel(tp);
      const std::string b = "block" + std::to_string(i) + ".";
      for (const char* col : {"q_proj", "gate_proj", "up_proj"}) dims[b + col + ".weight"] = 0;
      if (blocks_[i]->kv_split())
        for (const char* col : {"k_proj", "v_proj"}) dims[b + col + ".weight"] = 0;
      for (const char* row : {"o_proj", "down_proj"}) dims[b + row + ".weight"] = 1;
    }
    shard_parameters(dims, tp);
  }

  std::vector<torch::nn::Module*> blocks() override {
    std::vector<torch::nn::Module*> out;
    for (auto& b : blocks_) out.push_back(b.get());
    return out;
  }
  void set_checkpoint(const CheckpointPolicy& p) override {
    ReferenceModel::set_checkpoint(p);
    for (auto& b : blocks_) b->set_policy(p);
  }
  std::string attention_backend() const override { return blocks_.empty() ? "" : blocks_[0]->backend(); }
  // Per block and sample: the weight matmuls (q, k, v, o, gate, up, down) and the full S x S attention
  // core (QK^T and AV, 4·H·Dh·S per token), the convention of training_flops_per_sample.
  std::vector<double> block_forward_flops() const override {
    const double D = static_cast<double>(p_.width), S = static_cast<double>(p_.seq_len);
    const double q = static_cast<double>(p_.heads * p_.head_dim()), kv = static_cast<double>(p_.kv_heads * p_.head_dim());
    const double weights = 2.0 * (D * q + 2 * D * kv + q * D + 3 * D * static_cast<double>(p_.ffn));
    return std::vector<double>(static_cast<size_t>(p_.layers), (weights + 4.0 * q * S) * S);
  }
  double selective_forward_flops() const override {
    return p_.layers * 4.0 * static_cast<double>(p_.heads * p_.head_dim()) * p_.seq_len * p_.seq_len;
  }
  // selective-op recomputes the k, o and up projections (the even mm's); attention and q, v, gate and
  // down are served from the forward.
  double selective_op_recompute_flops() const override {
    const double D = static_cast<double>(p_.width), q = static_cast<double>(p_.heads * p_.head_dim());
    const double kv = static_cast<double>(p_.kv_heads * p_.head_dim()), F = static_cast<double>(p_.ffn);
    return p_.layers * 2.0 * (D * kv + q * D + D * F) * static_cast<double>(p_.seq_len);
  }

 private:
  static double lowest_of(at::ScalarType t) {
    if (t == torch::kBFloat16) return static_cast<double>(std::numeric_limits<c10::BFloat16>::lowest());
    if (t == torch::kHalf) return static_cast<double>(std::numeric_limits<c10::Half>::lowest());
    if (t == torch::kDouble) return std::numeric_limits<double>::lowest();
    return std::numeric_limits<float>::lowest();
  }
  torch::Tensor inv_freq_;
  nn::Embedding embed_tokens_{nullptr};
  std::vector<std::shared_ptr<LlamaBlock>> blocks_;
  RmsNorm norm_{nullptr};
  nn::Linear lm_head_{nullptr};
};

}  // namespace

std::shared_ptr<ReferenceModel> make_llama(const ModelPreset& preset) { return std::make_shared<Llama>(preset); }

}  // namespace trainscope::suites
