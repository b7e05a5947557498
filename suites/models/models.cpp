#include "suites/models/models.hpp"

#include <cmath>

#include "core/compat.hpp"
#include "core/errors.hpp"
#include "suites/techniques/precision.hpp"

namespace trainscope::suites {

namespace nn = torch::nn;

const ModelPreset& model_preset(const std::string& name) {
  if (const ModelPreset* p = find_model_preset(name)) return *p;
  throw UsageError("unknown model '" + name + "'");
}

std::string sdpa_backend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal,
                         bool enable_gqa) {
  // The dispatcher's own choice (sdp::SDPBackend), asked with the arguments of the call it precedes, as
  // autocast will cast them (SDPA is on its lower-precision list).
  auto cast = [](const torch::Tensor& t) {
    const auto dev = t.device().type();
    return compat::autocast_enabled(dev) ? t.to(compat::autocast_dtype(dev)) : t;
  };
  const int64_t choice = at::_fused_sdp_choice(cast(q), cast(k), cast(v), {}, 0.0, causal, std::nullopt, enable_gqa);
  switch (choice) {
    case 0: return "math";
    case 1: return "flash";
    case 2: return "efficient";
    case 3: return "cudnn";
    case 4: return "overrideable";
    default: return "none";
  }
}

int64_t count_parameters(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

double ReferenceModel::recompute_flops_per_sample() const {
  double f = 0;
  const auto blocks = block_forward_flops();
  if (checkpoint_.kind == CheckpointPolicy::Kind::SelectiveOp) return selective_op_recompute_flops();
  for (size_t i = 0; i < blocks.size(); ++i)
    if (checkpoint_.checkpoints_block(static_cast<int64_t>(i))) f += blocks[i];
  if (checkpoint_.kind == CheckpointPolicy::Kind::Selective) f += selective_forward_flops();
  return f;
}

namespace {

// Rows of a fused cross-entropy chunk: about 16M logits (64 MiB in fp32) are converted at a time.
int64_t fused_loss_chunk_rows(int64_t rows, int64_t classes) {
  return std::min(rows, std::max<int64_t>(1, kFusedLossChunkElements / classes));
}

// Mean cross-entropy of logits [N, V] (any float dtype) against targets [N], in fp32. Forward keeps the
// logits and each row's log-sum-exp; backward writes d loss / d logits = (softmax - one_hot) g / N into one
// buffer of the logits' dtype. The fp32 work is done a chunk of rows at a time.
struct FusedCrossEntropy : public torch::autograd::Function<FusedCrossEntropy> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& logits,
                               const torch::Tensor& target) {
    const int64_t rows = logits.size(0), step = fused_loss_chunk_rows(rows, logits.size(1));
    torch::Tensor lse = torch::empty({rows}, logits.options().dtype(torch::kFloat));
    for (int64_t a = 0; a < rows; a += step) {
      const int64_t b = std::min(rows, a + step);
      const torch::Tensor x = logits.slice(0, a, b).to(torch::kFloat);  // a view when already fp32
      const torch::Tensor max = x.amax(1, true);
      torch::Tensor e = x - max;
      e.exp_();
      lse.slice(0, a, b).copy_(e.sum(1).log_().add_(max.squeeze(1)));
    }
    const torch::Tensor picked = logits.gather(1, target.unsqueeze(1)).squeeze(1).to(torch::kFloat);
    ctx->save_for_backward({logits, lse, target});
    return (lse - picked).mean();
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &logits = saved[0], &lse = saved[1], &target = saved[2];
    const int64_t rows = logits.size(0), step = fused_loss_chunk_rows(rows, logits.size(1));
    const torch::Tensor scale = grads[0].to(torch::kFloat) / static_cast<double>(rows);
    torch::Tensor grad = torch::empty_like(logits);
    for (int64_t a = 0; a < rows; a += step) {
      const int64_t b = std::min(rows, a + step);
      // Out of place first: with fp32 logits the chunk is the saved tensor itself.
      torch::Tensor p = logits.slice(0, a, b).to(torch::kFloat) - lse.slice(0, a, b).unsqueeze(1);
      p.exp_();
      const torch::Tensor t = target.slice(0, a, b).unsqueeze(1);
      p.scatter_add_(1, t, torch::full(t.sizes(), -1.0, p.options()));
      grad.slice(0, a, b).copy_(p.mul_(scale));
    }
    return {grad, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target, const std::string& how) {
  if (how == "fused") return FusedCrossEntropy::apply(logits, target);
  // Losses in fp32 at least, whatever the compute precision (as autocast does for cross_entropy).
  const auto dtype = at::promote_types(logits.scalar_type(), torch::kFloat);
  return torch::nn::functional::cross_entropy(logits.to(dtype), target);
}

torch::Tensor ReferenceModel::loss(const Batch& b) { return loss_of(forward(b.input), b); }

torch::Tensor ReferenceModel::forward_layers(const torch::Tensor&, int64_t, int64_t) {
  throw UsageError("pp splits a decoder's layers into stages; this model has none");
}

bool ReferenceModel::used_by_layers(const std::string&, int64_t, int64_t) const {
  throw UsageError("pp splits a decoder's layers into stages; this model has none");
}

void ReferenceModel::drop_parameters(const std::function<bool(const std::string&)>& keep) {
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters())
    if (!keep(item.key())) {
      dropped_numel_ += item.value().numel();
      item.value().set_data(torch::empty({0}, item.value().options()));
    }
}

bool DecoderModel::used_by_layers(const std::string& name, int64_t first, int64_t last) const {
  if (name.rfind("block", 0) == 0) {
    const int64_t layer = std::stoll(name.substr(5));
    return first <= layer && layer < last;
  }
  const bool embedding = name.rfind("tok_emb.", 0) == 0 || name.rfind("pos_emb.", 0) == 0 || name.rfind("embed_tokens.", 0) == 0;
  if (embedding && first == 0) return true;
  return last == p_.layers && (!embedding || name == tied_head());  // the final norm, the head
}

torch::Tensor ReferenceModel::loss_of(const torch::Tensor& logits, const Batch& b) {
  if (tp_.active())  // this rank's vocabulary columns: the loss is computed on the shards
    return tensor_parallel::vocab_cross_entropy(logits.reshape({-1, logits.size(-1)}), b.target.reshape({-1}), tp_);
  return cross_entropy(logits.reshape({-1, logits.size(-1)}), b.target.reshape({-1}), cross_entropy_);
}

void ReferenceModel::set_context_parallel(const ContextParallel&) {
  throw UsageError("cp splits a decoder's sequence; this model has none");
}

void ReferenceModel::set_tensor_parallel(const TensorParallel&) {
  throw UsageError("tp splits a decoder's attention heads, MLP and vocabulary; this model has none");
}

std::optional<tensor_parallel::Split> ReferenceModel::tensor_parallel_split(const std::string& name) const {
  const auto it = tp_splits_.find(name);
  if (it == tp_splits_.end()) return std::nullopt;
  return it->second;
}

int64_t ReferenceModel::whole_parameter_count() const {
  int64_t n = dropped_numel_;
  for (const auto& item : named_parameters())
    n += item.value().numel() * (tp_splits_.count(item.key()) ? tp_.degree : 1);
  return n;
}

void ReferenceModel::shard_parameters(const std::map<std::string, tensor_parallel::Split>& splits, const TensorParallel& tp) {
  tp_ = tp;
  tp_splits_ = splits;
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters())
    if (const auto it = splits.find(item.key()); it != splits.end())
      item.value().set_data(tensor_parallel::shard(item.value().detach(), it->second, tp));
}

torch::Tensor ReferenceModel::features(const torch::Tensor&) {
  throw UsageError("this model has no image encoder (self-supervised methods need mlp, cnn or vit models)");
}

torch::Tensor patchify(const torch::Tensor& images, int64_t p) {
  const int64_t B = images.size(0), C = images.size(1), H = images.size(2), W = images.size(3);
  // [B,C,H/p,p,W/p,p] -> [B,H/p,W/p,p,p,C]: MAE's order of the values inside a patch.
  return images.reshape({B, C, H / p, p, W / p, p}).permute({0, 2, 4, 3, 5, 1}).reshape({B, (H / p) * (W / p), p * p * C});
}

namespace {

// aten::linear, as PyTorch's nn.Linear runs it: one addmm over the folded [B*S, D] input. LibTorch's
// C++ nn::Linear runs matmul then `+= bias` for inputs of more than two dimensions, which rounds
// differently (the parity suite caught it: last-bit differences in every gradient).
// In fp8 mode (an Fp8Scope), project() runs the GEMM in e4m3 instead.
// Through the op-level checkpoint's operator (suites/techniques/checkpoint.hpp): project() outside one.
torch::Tensor linear(const nn::Linear& layer, const torch::Tensor& x) { return sac_linear(x, layer->weight, layer->bias); }

// LayerNorm; under sequence parallelism on this rank's tokens: an identity first (as DTensor's
// SequenceParallel wraps the input) and the whole weight and bias, whose gradients the ranks sum.
torch::Tensor layer_norm(nn::LayerNorm ln, const torch::Tensor& x, const TensorParallel& tp) {
  if (!tp.sequence) return ln->forward(x);
  return torch::layer_norm(x.view_as(x), {x.size(-1)}, tensor_parallel::replicated(ln->weight, tp),
                           tensor_parallel::replicated(ln->bias, tp), ln->options.eps());
}

// ---- MLP ------------------------------------------------------------------------------------------
class Mlp : public ReferenceModel {
 public:
  Mlp(const ModelPreset& p, const DataShape& s) {
    int64_t in = s.channels * s.height * s.width;
    for (size_t i = 0; i < p.hidden.size(); ++i) {
      layers_.push_back(register_module("fc" + std::to_string(i), nn::Linear(in, p.hidden[i])));
      dims_.emplace_back(in, p.hidden[i]);
      in = p.hidden[i];
    }
    layers_.push_back(register_module("head", nn::Linear(in, s.classes)));
    dims_.emplace_back(in, s.classes);
  }
  torch::Tensor forward(const torch::Tensor& x) override { return boundary("head", linear(layers_.back(), features(x))); }
  torch::Tensor features(const torch::Tensor& x) override {
    torch::Tensor h = x.flatten(1);
    for (size_t i = 0; i + 1 < layers_.size(); ++i) {
      auto& layer = layers_[i];
      h = run_block(static_cast<int64_t>(i), *layer, [&layer](const torch::Tensor& in) { return torch::relu(linear(layer, in)); }, h);
      h = boundary("fc" + std::to_string(i), h);
    }
    return h;
  }
  int64_t feature_dim() const override { return dims_.back().first; }
  std::vector<torch::nn::Module*> blocks() override {
    std::vector<torch::nn::Module*> out;
    for (size_t i = 0; i + 1 < layers_.size(); ++i) out.push_back(layers_[i].get());
    return out;
  }
  int64_t analytic_parameters() const override {
    int64_t n = 0;
    for (auto [in, out] : dims_) n += in * out + out;
    return n;
  }
  double training_flops_per_sample() const override {
    double macs = 0;
    for (auto [in, out] : dims_) macs += static_cast<double>(in) * out;
    return 6.0 * macs;
  }
  std::vector<double> block_forward_flops() const override {  // the hidden layers; the head is not a block
    std::vector<double> f;
    for (size_t i = 0; i + 1 < dims_.size(); ++i) f.push_back(2.0 * dims_[i].first * dims_[i].second);
    return f;
  }

 private:
  std::vector<nn::Linear> layers_;
  std::vector<std::pair<int64_t, int64_t>> dims_;
};

// ---- ResNet-style CNN -----------------------------------------------------------------------------
// Accumulates conv FLOPs and parameters while the network is built, so both are analytic.
struct ConvLedger {
  double macs = 0;
  int64_t params = 0;
  nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride, int64_t& h, int64_t& w) {
    const int64_t pad = k / 2;
    h = (h + 2 * pad - k) / stride + 1;
    w = (w + 2 * pad - k) / stride + 1;
    macs += static_cast<double>(in) * out * k * k * h * w;
    params += in * out * k * k;
    return nn::Conv2d(nn::Conv2dOptions(in, out, k).stride(stride).padding(pad).bias(false));
  }
  nn::BatchNorm2d bn(int64_t c) {
    params += 2 * c;
    return nn::BatchNorm2d(c);
  }
};

class BasicBlock : public nn::Module {
 public:
  BasicBlock(int64_t in, int64_t out, int64_t stride, int64_t& h, int64_t& w, ConvLedger& led) {
    int64_t h1 = h, w1 = w;
    conv1_ = register_module("conv1", led.conv(in, out, 3, stride, h1, w1));
    bn1_ = register_module("bn1", led.bn(out));
    int64_t h2 = h1, w2 = w1;
    conv2_ = register_module("conv2", led.conv(out, out, 3, 1, h2, w2));
    bn2_ = register_module("bn2", led.bn(out));
    if (stride != 1 || in != out) {
      int64_t hs = h, ws = w;
      shortcut_ = register_module("shortcut", led.conv(in, out, 1, stride, hs, ws));
      shortcut_bn_ = register_module("shortcut_bn", led.bn(out));
    }
    h = h2;
    w = w2;
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = torch::relu(bn1_->forward(conv1_->forward(x)));
    y = bn2_->forward(conv2_->forward(y));
    torch::Tensor s = shortcut_ ? shortcut_bn_->forward(shortcut_->forward(x)) : x;
    return torch::relu(y + s);
  }

 private:
  nn::Conv2d conv1_{nullptr}, conv2_{nullptr}, shortcut_{nullptr};
  nn::BatchNorm2d bn1_{nullptr}, bn2_{nullptr}, shortcut_bn_{nullptr};
};

class Cnn : public ReferenceModel {
 public:
  Cnn(const ModelPreset& p, const DataShape& s) {
    int64_t h = s.height, w = s.width;
    stem_ = register_module("stem", led_.conv(s.channels, p.width, 3, 1, h, w));
    stem_bn_ = register_module("stem_bn", led_.bn(p.width));
    int64_t in = p.width;
    for (size_t stage = 0; stage < p.hidden.size(); ++stage) {
      const int64_t out = p.width << stage;
      for (int64_t b = 0; b < p.hidden[stage]; ++b) {
        const int64_t stride = (stage > 0 && b == 0) ? 2 : 1;
        const double before = led_.macs;
        auto block = std::make_shared<BasicBlock>(in, out, stride, h, w, led_);
        blocks_.push_back(register_module("block" + std::to_string(blocks_.size()), block));
        block_flops_.push_back(2.0 * (led_.macs - before));
        in = out;
      }
    }
    head_ = register_module("head", nn::Linear(in, s.classes));
    head_macs_ = static_cast<double>(in) * s.classes;
    head_params_ = in * s.classes + s.classes;
  }
  torch::Tensor forward(const torch::Tensor& x) override { return boundary("head", head_->forward(features(x))); }
  torch::Tensor features(const torch::Tensor& x) override {
    torch::Tensor h = boundary("stem", torch::relu(stem_bn_->forward(stem_->forward(x))));
    for (size_t i = 0; i < blocks_.size(); ++i) {
      auto& b = blocks_[i];
      h = run_block(static_cast<int64_t>(i), *b, [&b](const torch::Tensor& in) { return b->forward(in); }, h);
      h = boundary("block" + std::to_string(i), h);
    }
    return h.mean({2, 3});
  }
  int64_t feature_dim() const override { return head_->options.in_features(); }
  std::vector<torch::nn::Module*> blocks() override {
    std::vector<torch::nn::Module*> out;
    for (auto& b : blocks_) out.push_back(b.get());
    return out;
  }
  int64_t analytic_parameters() const override { return led_.params + head_params_; }
  double training_flops_per_sample() const override { return 6.0 * (led_.macs + head_macs_); }
  std::vector<double> block_forward_flops() const override { return block_flops_; }

 private:
  ConvLedger led_;
  std::vector<double> block_flops_;
  nn::Conv2d stem_{nullptr};
  nn::BatchNorm2d stem_bn_{nullptr};
  std::vector<std::shared_ptr<BasicBlock>> blocks_;
  nn::Linear head_{nullptr};
  double head_macs_ = 0;
  int64_t head_params_ = 0;
};

// ---- ViT --------------------------------------------------------------------------------------------
// Patches of p x p pixels, a linear patch embedding, learned positions, pre-LN blocks, mean-pooled
// tokens (no CLS token, so that MAE's visible-token encoder and the classifier share one path).
class Vit : public ReferenceModel, public PatchEncoder {
 public:
  Vit(const ModelPreset& p, const DataShape& s) : p_(p), channels_(s.channels) {
    if (s.height % p.seq_len != 0 || s.width % p.seq_len != 0)
      throw UsageError("model '" + p.name + "': patch " + std::to_string(p.seq_len) + " does not divide " +
                       std::to_string(s.height) + "x" + std::to_string(s.width) + " images");
    patches_ = (s.height / p.seq_len) * (s.width / p.seq_len);
    embed_ = register_module("patch_embed", nn::Linear(p.seq_len * p.seq_len * s.channels, p.width));
    pos_ = register_parameter("pos_embed", torch::randn({1, patches_, p.width}) * 0.02);
    for (int64_t i = 0; i < p.layers; ++i)
      blocks_.push_back(register_module("block" + std::to_string(i), std::make_shared<TransformerBlock>(p.width, p.heads, 0.0, /*causal=*/false,
                                                                                  p.attention == "sdpa")));
    norm_ = register_module("norm", nn::LayerNorm(nn::LayerNormOptions({p.width})));
    head_ = register_module("head", nn::Linear(p.width, s.classes));
    classes_ = s.classes;
  }
  torch::Tensor embed(const torch::Tensor& images) override {
    return linear(embed_, patchify(images, p_.seq_len)) + pos_;
  }
  torch::Tensor encode(const torch::Tensor& tokens) override {
    torch::Tensor h = boundary("embed", tokens);
    for (size_t i = 0; i < blocks_.size(); ++i) {
      auto& b = blocks_[i];
      h = run_block(static_cast<int64_t>(i), *b, [&b](const torch::Tensor& in) { return b->forward(in); }, h);
      h = boundary("block" + std::to_string(i), h);
    }
    return norm_->forward(h);
  }
  torch::Tensor features(const torch::Tensor& x) override { return encode(embed(x)).mean(1); }
  torch::Tensor forward(const torch::Tensor& x) override { return boundary("head", linear(head_, features(x))); }
  int64_t feature_dim() const override { return p_.width; }
  int64_t patch() const override { return p_.seq_len; }
  int64_t dim() const override { return p_.width; }
  int64_t patches() const override { return patches_; }
  double encode_flops(int64_t tokens) const override {
    double f = 0;
    for (const auto& b : blocks_) f += b->forward_flops(tokens);
    return f;
  }
  std::vector<torch::nn::Module*> blocks() override {
    std::vector<torch::nn::Module*> out;
    for (auto& b : blocks_) out.push_back(b.get());
    return out;
  }
  std::string attention_backend() const override { return blocks_.empty() ? "" : blocks_[0]->backend(); }
  int64_t analytic_parameters() const override {
    const int64_t D = p_.width, pp = p_.seq_len * p_.seq_len * channels_;
    return pp * D + D + patches_ * D + p_.layers * (12 * D * D + 13 * D) + 2 * D + D * classes_ + classes_;
  }
  double training_flops_per_sample() const override {
    const double embed = 2.0 * patches_ * p_.seq_len * p_.seq_len * channels_ * p_.width;
    return 3.0 * (embed + encode_flops(patches_) + 2.0 * p_.width * classes_);
  }
  std::vector<double> block_forward_flops() const override {
    std::vector<double> f;
    for (const auto& b : blocks_) f.push_back(b->forward_flops(patches_));
    return f;
  }

 private:
  ModelPreset p_;
  int64_t channels_, patches_ = 0, classes_ = 0;
  nn::Linear embed_{nullptr}, head_{nullptr};
  torch::Tensor pos_;
  std::vector<std::shared_ptr<TransformerBlock>> blocks_;
  nn::LayerNorm norm_{nullptr};
};

// ---- GPT-style decoder ----------------------------------------------------------------------------
class Gpt : public DecoderModel {
 public:
  Gpt(const ModelPreset& p, const DataShape&) : DecoderModel(p) {
    tok_ = register_module("tok_emb", nn::Embedding(p.vocab, p.width));
    pos_ = register_module("pos_emb", nn::Embedding(p.seq_len, p.width));
    for (int64_t i = 0; i < p.layers; ++i)
      blocks_.push_back(register_module("block" + std::to_string(i),
                                        std::make_shared<TransformerBlock>(p.width, p.heads, p.dropout, /*causal=*/true,
                                                                           p.attention == "sdpa")));
    ln_f_ = register_module("ln_f", nn::LayerNorm(nn::LayerNormOptions({p.width})));
    for (auto& param : parameters()) {
      // GPT-2's initialisation: N(0, 0.02) for weights, zero biases (LayerNorm keeps ones/zeros).
      if (param.dim() >= 2) torch::nn::init::normal_(param, 0.0, 0.02);
    }
  }
  torch::Tensor forward_layers(const torch::Tensor& in, int64_t first, int64_t last) override {
    torch::Tensor h = first == 0 ? boundary("embed", embed(in)) : in;
    for (int64_t i = first; i < last; ++i) {
      auto& b = blocks_[static_cast<size_t>(i)];
      h = run_block(i, *b, [&b](const torch::Tensor& x) { return b->forward(x); }, h);
      h = boundary("block" + std::to_string(i), h);
    }
    if (last < p_.layers) return h;
    // The LM head is tied to the token embedding (GPT-2), so gpt-125m has GPT-2 small's 124M; under tp
    // it is this rank's vocabulary rows (column-parallel), with the loss on the shards.
    if (!tp_.active()) return boundary("head", torch::linear(ln_f_->forward(h), tok_->weight));
    const torch::Tensor normed = layer_norm(ln_f_, h, tp_);
    const auto plain = [](const torch::Tensor& in, const torch::Tensor& w, const torch::Tensor&) { return torch::linear(in, w); };
    return boundary("head", tensor_parallel::column_parallel(normed, {tok_->weight}, {}, tp_, plain)[0]);
  }
  std::string tied_head() const override { return "tok_emb.weight"; }
  void set_context_parallel(const ContextParallel& cp) override {
    cp_ = cp;
    for (auto& b : blocks_) b->set_context_parallel(cp);
  }
  // Vocabulary-parallel token embedding, column-parallel blocks, the tied head on the vocabulary shard.
  void set_tensor_parallel(const TensorParallel& tp) override {
    std::map<std::string, tensor_parallel::Split> splits{{"tok_emb.weight", 0}};
    for (size_t i = 0; i < blocks_.size(); ++i) {
      blocks_[i]->set_tensor_parallel(tp);
      for (const auto& [name, split] : TransformerBlock::tensor_parallel_splits()) splits["block" + std::to_string(i) + "." + name] = split;
    }
    shard_parameters(splits, tp);
  }
  std::vector<torch::nn::Module*> blocks() override {
    std::vector<torch::nn::Module*> out;
    for (auto& b : blocks_) out.push_back(b.get());
    return out;
  }
  std::string attention_backend() const override { return blocks_.empty() ? "" : blocks_[0]->backend(); }
  void set_checkpoint(const CheckpointPolicy& p) override {
    ReferenceModel::set_checkpoint(p);
    for (auto& b : blocks_) b->set_policy(p);
  }
  // Per block and sample: the weight matmuls (2 x 12·D² per token) and the attention core (QK^T and
  // AV: 4·D·S per token, the full-attention convention of the FLOPs formula).
  std::vector<double> block_forward_flops() const override {
    const double D = static_cast<double>(p_.width), S = static_cast<double>(p_.seq_len);
    return std::vector<double>(static_cast<size_t>(p_.layers), (2.0 * 12 * D * D + 4.0 * D * S) * S);
  }
  double selective_forward_flops() const override {
    return p_.layers * 4.0 * static_cast<double>(p_.width) * p_.seq_len * p_.seq_len;
  }

 private:
  // Tokens plus learned positions; under tp the vocabulary-parallel lookup (summed over the tp ranks,
  // or reduce-scattered to this rank's sequence shard) plus the positions of this rank's tokens, whose
  // table is whole on every rank (its gradient summed over the shards that used its rows).
  // Under cp the positions are the global ones of this rank's tokens.
  torch::Tensor embed(const torch::Tensor& tokens) {
    const int64_t S = tokens.size(1);
    const auto longs = torch::TensorOptions().dtype(torch::kLong).device(tokens.device());
    const torch::Tensor pos = cp_.active() ? context_parallel::positions(S * cp_.degree, cp_.rank, cp_.degree, cp_.balance).to(tokens.device())
                                           : torch::arange(S, longs);
    if (!tp_.active()) return tok_->forward(tokens) + pos_->forward(pos).unsqueeze(0);
    const torch::Tensor h = tensor_parallel::vocab_embedding(tokens, tok_->weight, tp_);
    const torch::Tensor mine = tp_.sequence ? pos.narrow(0, tp_.rank * h.size(1), h.size(1)) : pos;
    const torch::Tensor table = tp_.sequence ? tensor_parallel::replicated(pos_->weight, tp_) : pos_->weight;
    return h + torch::embedding(table, mine).unsqueeze(0);
  }

  nn::Embedding tok_{nullptr}, pos_{nullptr};
  std::vector<std::shared_ptr<TransformerBlock>> blocks_;
  nn::LayerNorm ln_f_{nullptr};
};

}  // namespace

TransformerBlock::TransformerBlock(int64_t d, int64_t heads, double dropout, bool causal, bool sdpa)
    : d_(d), heads_(heads), dropout_(dropout), causal_(causal), sdpa_(sdpa) {
  ln1_ = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({d})));
  qkv_ = register_module("qkv", nn::Linear(d, 3 * d));
  proj_ = register_module("proj", nn::Linear(d, d));
  ln2_ = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({d})));
  fc_ = register_module("fc", nn::Linear(d, 4 * d));
  fc_proj_ = register_module("fc_proj", nn::Linear(4 * d, d));
}

// x stays fp32 (the residual stream): LayerNorm is always fed fp32, as autocast's fp32 list wants.
// Dropout at p = 0 returns its input without drawing, so the ViT's calls cost nothing. Under tensor
// parallelism x is [B, S, D] on every tp rank, or its sequence shard; the heads are this rank's.
torch::Tensor TransformerBlock::forward(const torch::Tensor& x) {
  const auto project = [](const torch::Tensor& in, const torch::Tensor& w, const torch::Tensor& b) { return sac_linear(in, w, b); };
  const auto qkv = tensor_parallel::column_parallel(norm(ln1_, x), {qkv_->weight}, {qkv_->bias}, tp_, project)[0];
  const int64_t B = qkv.size(0), S = qkv.size(1), H = heads_ / tp_.degree, Dh = d_ / heads_, D = H * Dh;
  // The attention core: the S x S scores, softmax and dropout live only in here (this rank's heads:
  // their dropout draws from the model-parallel generator under tp).
  auto core = [this, B, S, H, D, Dh](const torch::Tensor& packed) {
    auto heads = packed.view({B, S, 3, H, Dh}).permute({2, 0, 3, 1, 4});
    auto q = heads[0], k = heads[1], v = heads[2];  // [B,H,S,Dh]
    if (cp_.active()) {  // this rank's queries against every cp rank's keys and values (no dropout: refused)
      backend_ = "cp-" + cp_.method;
      return context_parallel::attention(q, k, v, 1.0 / std::sqrt(static_cast<double>(Dh)), cp_).transpose(1, 2).reshape({B, S, D});
    }
    if (sdpa_) {
      // One fused call: no S x S tensor is kept where the kernel avoids it (flash, memory-efficient).
      if (backend_.empty()) backend_ = sdpa_backend(q, k, v, causal_, false);
      const double p = is_training() ? dropout_ : 0.0, scale = 1.0 / std::sqrt(static_cast<double>(Dh));
      const std::function<torch::Tensor()> fused = [&] { return at::scaled_dot_product_attention(q, k, v, {}, p, causal_, scale); };
      // The kernel's own dropout draws from the tracker's generator under tp.
      const bool forked = tp_.active() && p > 0;
      return sac_attention(q, k, v, causal_, scale, false, p,
                           [&] { return forked ? tensor_parallel::rng_tracker().fork(q.device(), fused) : fused(); })
          .transpose(1, 2)
          .reshape({B, S, D});
    }
    backend_ = "eager";
    auto scores = sac_matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(Dh));
    // The mask lives to the end of the core, as PyTorch's reference keeps it (the activation bytes
    // are compared with it to the byte).
    torch::Tensor causal;
    if (causal_) causal = torch::ones({S, S}, torch::TensorOptions().dtype(torch::kBool).device(packed.device())).triu(1);
    auto att = torch::softmax(causal_ ? scores.masked_fill(causal, -std::numeric_limits<float>::infinity()) : scores, -1);
    att = tensor_parallel::split_dropout(att, dropout_, is_training(), tp_);
    return sac_matmul(att, v).transpose(1, 2).reshape({B, S, D});
  };
  const bool recompute_core = policy_.kind == CheckpointPolicy::Kind::Selective && is_training() && torch::GradMode::is_enabled();
  auto y = recompute_core ? checkpoint(core, qkv, {}, policy_.restore_rng, policy_.check) : core(qkv);
  auto h = x + residual_dropout(row_parallel(proj_, y));
  auto m = row_parallel(fc_proj_, torch::gelu(tensor_parallel::column_parallel(norm(ln2_, h), {fc_->weight}, {fc_->bias}, tp_, project)[0]));
  return h + residual_dropout(m);
}

torch::Tensor TransformerBlock::norm(nn::LayerNorm ln, const torch::Tensor& x) { return layer_norm(std::move(ln), x, tp_); }

torch::Tensor TransformerBlock::row_parallel(const nn::Linear& layer, const torch::Tensor& x) {
  if (!tp_.active()) return linear(layer, x);
  const torch::Tensor reduced = tensor_parallel::leave(sac_linear(x, layer->weight, {}), tp_);
  return reduced + (tp_.sequence ? tensor_parallel::replicated(layer->bias, tp_) : layer->bias);
}

// Whole on every tp rank: the default generator, alike on every rank; on sequence shards: the tracker's.
torch::Tensor TransformerBlock::residual_dropout(const torch::Tensor& x) {
  return tp_.sequence ? tensor_parallel::split_dropout(x, dropout_, is_training(), tp_) : torch::dropout(x, dropout_, is_training());
}

std::map<std::string, tensor_parallel::Split> TransformerBlock::tensor_parallel_splits() {
  return {{"qkv.weight", {0, 3}}, {"qkv.bias", {0, 3}}, {"fc.weight", 0}, {"fc.bias", 0}, {"proj.weight", 1}, {"fc_proj.weight", 1}};
}

double TransformerBlock::forward_flops(int64_t tokens) const {
  const double D = static_cast<double>(d_), L = static_cast<double>(tokens);
  return 2.0 * 12 * D * D * L + 4.0 * L * L * D;  // weight matmuls, then QK^T and AV
}

std::shared_ptr<ReferenceModel> make_model(const ModelPreset& preset, const DataShape& shape) {
  if (!preset.language_model() && shape.tokens())
    throw UsageError("model '" + preset.name + "' needs image data (fashion-mnist or synthetic-images)");
  if (preset.family == "llama") {
    if (!shape.tokens() || shape.vocab > preset.vocab || shape.seq_len != preset.seq_len)
      throw UsageError("model '" + preset.name + "' needs token data (data = text or synthetic-tokens)");
    return make_llama(preset);
  }
  if (preset.family == "mlp") return std::make_shared<Mlp>(preset, shape);
  if (preset.family == "cnn") return std::make_shared<Cnn>(preset, shape);
  if (preset.family == "vit") return std::make_shared<Vit>(preset, shape);
  if (preset.family == "gpt") {
    if (!shape.tokens() || shape.vocab > preset.vocab || shape.seq_len != preset.seq_len)
      throw UsageError("model '" + preset.name + "' needs token data (data = synthetic-tokens or text)");
    return std::make_shared<Gpt>(preset, shape);
  }
  throw UsageError("unknown model family '" + preset.family + "'");
}

}  // namespace trainscope::suites
