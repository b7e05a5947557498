#pragma once
// Reference models: MLP, ResNet-style CNN, ViT, GPT-style and Llama-3-style decoders, sized by a
// ModelShape (a preset or dimensions given as data).
//
// Each model states its parameter count and its analytic training FLOPs (forward + backward) as
// docs/metrics.md defines them: matmul/conv FLOPs only (2 per multiply-add), times 3 for training; the
// decoders use core/model_shape.hpp's per-token count on the full-attention convention (torchtitan's),
// and say the causal one beside it.
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "core/hooks.hpp"
#include "core/model_shape.hpp"
#include "suites/parallel/context_parallel.hpp"
#include "suites/parallel/tensor_parallel.hpp"
#include "suites/techniques/checkpoint.hpp"

namespace trainscope::suites {

// What the data looks like, so that a model can size its input and output layers.
struct DataShape {
  int64_t channels = 1, height = 28, width = 28, classes = 10;  // images
  int64_t vocab = 0, seq_len = 0;                                // tokens (vocab > 0)
  bool tokens() const { return vocab > 0; }
};

struct Batch {
  torch::Tensor input;   // images [B,C,H,W] float, or tokens [B,S] int64
  torch::Tensor target;  // labels [B] or next tokens [B,S]
};

// A model's shape (core/model_shape.hpp): a preset, or dimensions given as data.
using ModelPreset = trainscope::ModelShape;
using trainscope::model_presets;

const ModelPreset& model_preset(const std::string& name);

// Mean cross-entropy of logits [N, V] against targets [N] in fp32, as cross_entropy = eager | fused
// computes it (ReferenceModel::set_cross_entropy).
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target, const std::string& how);

class ReferenceModel : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;  // logits
  // Cross-entropy of the logits against the batch's targets (per token for sequence models).
  virtual torch::Tensor loss(const Batch& b);
  // How loss() computes it: eager (the logits cast to fp32, log_softmax + nll_loss: autograd keeps the fp32
  // log-probabilities) or fused (one function that keeps the logits and each row's fp32 log-sum-exp and
  // writes their gradient once, in their dtype, as torch.compile's fused cross-entropy does).
  void set_cross_entropy(std::string how) { cross_entropy_ = std::move(how); }
  virtual int64_t analytic_parameters() const = 0;
  virtual double training_flops_per_sample() const = 0;
  virtual int64_t tokens_per_sample() const { return 0; }
  // The same FLOPs on the causal-attention convention (decoders; equal to the above elsewhere).
  virtual double causal_flops_per_sample() const { return training_flops_per_sample(); }
  // The attention kernel that ran ("eager", or SDPA's backend: "math", "flash", "efficient", "cudnn");
  // empty for models without attention or before the first forward.
  virtual std::string attention_backend() const { return ""; }
  virtual bool classifies() const { return tokens_per_sample() == 0; }

  // The encoder's representation before the classifier (image models): [B, feature_dim()].
  virtual torch::Tensor features(const torch::Tensor& x);
  virtual int64_t feature_dim() const { return 0; }
  // Called after every applied optimizer step (1-based count of them, of `total`): EMA teachers.
  virtual void after_step(int64_t /*applied*/, int64_t /*total*/) {}
  // A must-match stream for the RNG/consistency probe beyond the parameters (an EMA teacher's).
  virtual std::optional<uint64_t> teacher_fingerprint() { return std::nullopt; }
  // What the loss of the last step acted on (SSL methods), for the health probe.
  virtual std::optional<EmbeddingSample> last_embeddings() const { return std::nullopt; }

  // Called with every block's output ("fc0", "block3", "head", ...) during forward; the training
  // loop uses it for fp16 emulation and to let probes observe activations and gradients.
  using Boundary = std::function<torch::Tensor(const std::string& block, torch::Tensor x)>;
  virtual void set_boundary(Boundary b) { boundary_ = std::move(b); }

  // Activation checkpointing of the model's blocks (suites/techniques/checkpoint.hpp).
  virtual void set_checkpoint(const CheckpointPolicy& p) { checkpoint_ = p; }
  const CheckpointPolicy& checkpoint_policy() const { return checkpoint_; }
  // Forward FLOPs per sample of each checkpointable block, and of what `selective` recomputes, so
  // that the recomputation's FLOPs (HFU) are analytic too.
  virtual std::vector<double> block_forward_flops() const = 0;
  virtual double selective_forward_flops() const { return 0; }
  // Forward FLOPs per sample that selective-op recomputes (its unsaved matmuls): biased linears, attention
  // and every other unbiased matmul are kept, so a GPT or ViT recomputes none.
  virtual double selective_op_recompute_flops() const { return 0; }
  double recompute_flops_per_sample() const;

  // The modules run_block runs, in order (what zero3 shards as units).
  virtual std::vector<torch::nn::Module*> blocks() = 0;
  // Wraps every block's forward during training (zero3 gathers the block's parameters around it).
  using BlockWrapper = std::function<torch::Tensor(int64_t index, const BlockFn& body, const torch::Tensor& x)>;
  virtual void set_block_wrapper(BlockWrapper w) { block_wrapper_ = std::move(w); }

  // Pipeline stages (suites/parallel/pipeline.hpp): a decoder's layers [first, last), from the tokens
  // (first == 0: the embedding runs first) or the previous stage's hidden states, to the logits (last =
  // the layer count: the final norm and the head run too) or the hidden states. UsageError without layers.
  virtual torch::Tensor forward_layers(const torch::Tensor& in, int64_t first, int64_t last);
  // The loss of logits against a batch's targets (loss() is forward() and then this).
  torch::Tensor loss_of(const torch::Tensor& logits, const Batch& b);
  // Whether parameter `name` takes part in layers [first, last): a block's own, the embedding's with the
  // first layer, the final norm's and the head's after the last (a tied head at both ends).
  virtual bool used_by_layers(const std::string& name, int64_t first, int64_t last) const;
  // The embedding weight a tied head shares ("" when untied): a pipeline's first and last stages both hold it.
  virtual std::string tied_head() const { return ""; }
  // Empties the parameters `keep` rejects (a pipeline rank holds only its stages'); whole_parameter_count()
  // still counts them.
  void drop_parameters(const std::function<bool(const std::string&)>& keep);

  // Tensor parallelism (suites/parallel/tensor_parallel.hpp): keeps this rank's shards of the parameters
  // and runs the layers split; loss() then takes the vocabulary-sharded logits. UsageError for a model
  // without layers to split.
  virtual void set_tensor_parallel(const TensorParallel& tp);
  const TensorParallel& tensor_parallel() const { return tp_; }
  // How a parameter is split across the tp ranks (none: whole on every rank).
  std::optional<tensor_parallel::Split> tensor_parallel_split(const std::string& name) const;
  // Context parallelism (suites/parallel/context_parallel.hpp): the model runs on this rank's tokens
  // (the batch arrives sharded), at their global positions, its attention across the shards. UsageError
  // for a model without a sequence.
  virtual void set_context_parallel(const ContextParallel& cp);
  const ContextParallel& context_parallel() const { return cp_; }
  // The whole model's parameters, whatever this rank holds of them (tp shards counted x tp).
  int64_t whole_parameter_count() const;

 protected:
  // Replaces each named parameter's data with this rank's block of it.
  void shard_parameters(const std::map<std::string, tensor_parallel::Split>& splits, const TensorParallel& tp);
  TensorParallel tp_;
  ContextParallel cp_;
  int64_t dropped_numel_ = 0;  // parameters a pipeline rank emptied (drop_parameters)
  torch::Tensor boundary(const std::string& block, torch::Tensor x) {
    return boundary_ ? boundary_(block, std::move(x)) : x;
  }
  // Runs block `index` (fn over x, with the parameters of `owner`), checkpointed if the policy says so,
  // inside the block wrapper when one is set.
  torch::Tensor run_block(int64_t index, torch::nn::Module& owner, const BlockFn& fn, const torch::Tensor& x) {
    const bool training = is_training() && torch::GradMode::is_enabled();
    BlockFn body = fn;
    if (training && checkpoint_.checkpoints_block(index)) {
      const CheckpointPolicy policy = checkpoint_;
      body = [&owner, fn, policy](const torch::Tensor& in) {
        const std::vector<torch::Tensor> params = owner.parameters();
        return checkpoint(fn, in, params, policy.restore_rng, policy.check, policy.kind == CheckpointPolicy::Kind::SelectiveOp);
      };
    }
    if (training && block_wrapper_) return block_wrapper_(index, body, x);
    return body(x);
  }

 private:
  Boundary boundary_;
  std::string cross_entropy_ = "eager";
  CheckpointPolicy checkpoint_;
  BlockWrapper block_wrapper_;
  std::map<std::string, tensor_parallel::Split> tp_splits_;
};

// The decoders (GPT, Llama): parameters, tokens and FLOPs follow from the shape alone
// (core/model_shape.hpp), on the full-attention convention with the causal one beside it.
class DecoderModel : public ReferenceModel {
 public:
  explicit DecoderModel(ModelPreset p) : p_(std::move(p)) {}
  int64_t analytic_parameters() const override { return analytic_decoder_parameters(p_); }
  int64_t tokens_per_sample() const override { return p_.seq_len; }
  double training_flops_per_sample() const override {
    return decoder_flops_per_token(p_, FlopConvention::Full) * static_cast<double>(p_.seq_len);
  }
  double causal_flops_per_sample() const override {
    return decoder_flops_per_token(p_, FlopConvention::Causal) * static_cast<double>(p_.seq_len);
  }
  bool used_by_layers(const std::string& name, int64_t first, int64_t last) const override;
  torch::Tensor forward(const torch::Tensor& tokens) override { return forward_layers(tokens, 0, p_.layers); }

 protected:
  ModelPreset p_;
};

std::shared_ptr<ReferenceModel> make_model(const ModelPreset& preset, const DataShape& shape);
// The Llama 3 decoder (suites/models/llama.cpp).
std::shared_ptr<ReferenceModel> make_llama(const ModelPreset& preset);

// Which kernel at::scaled_dot_product_attention picks for these arguments ("math", "flash", ...).
std::string sdpa_backend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal,
                         bool enable_gqa);

// A pre-norm transformer block (attention and a 4x MLP, each added to the residual stream): the GPT's
// decoder block (causal, with dropout) and the ViT's encoder block (bidirectional, no dropout). With a
// selective policy the attention core (scores, softmax, dropout) is recomputed in backward.
class TransformerBlock : public torch::nn::Module {
 public:
  TransformerBlock(int64_t d, int64_t heads, double dropout, bool causal, bool sdpa = false);
  torch::Tensor forward(const torch::Tensor& x);  // [B, L, D]
  double forward_flops(int64_t tokens) const;     // per sample
  void set_policy(const CheckpointPolicy& p) { policy_ = p; }
  const std::string& backend() const { return backend_; }
  // GPT under tensor parallelism: this rank's heads of the fused q, k, v projection (3 groups split by
  // heads) and units of fc column-parallel, proj and fc_proj row-parallel with their biases added
  // after the reduction; the norms whole (suites/parallel/tensor_parallel.hpp).
  void set_tensor_parallel(const TensorParallel& tp) { tp_ = tp; }
  // GPT under context parallelism: the attention core across the sequence shards.
  void set_context_parallel(const ContextParallel& cp) { cp_ = cp; }
  // The split of each of the block's parameters (by the name under the block).
  static std::map<std::string, tensor_parallel::Split> tensor_parallel_splits();

 private:
  torch::Tensor norm(torch::nn::LayerNorm ln, const torch::Tensor& x);
  // A row-parallel linear: this rank's partial product, reduced (or reduce-scattered), then the bias.
  torch::Tensor row_parallel(const torch::nn::Linear& layer, const torch::Tensor& x);
  torch::Tensor residual_dropout(const torch::Tensor& x);
  TensorParallel tp_;
  ContextParallel cp_;
  int64_t d_, heads_;
  double dropout_;
  bool causal_, sdpa_;
  std::string backend_;
  CheckpointPolicy policy_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, fc_{nullptr}, fc_proj_{nullptr};
};

// What MAE needs of a ViT: patch tokens, and the blocks run over any subset of them.
class PatchEncoder {
 public:
  virtual ~PatchEncoder() = default;
  virtual torch::Tensor embed(const torch::Tensor& images) = 0;   // [B, L, D]: patches + position
  virtual torch::Tensor encode(const torch::Tensor& tokens) = 0;  // blocks and the final norm
  virtual int64_t patch() const = 0;
  virtual int64_t dim() const = 0;
  virtual int64_t patches() const = 0;
  virtual double encode_flops(int64_t tokens) const = 0;  // forward, per sample
};

// [B, C, H, W] -> [B, L, p*p*C] (row-major patches, as MAE's patchify).
torch::Tensor patchify(const torch::Tensor& images, int64_t p);

// Counts trainable parameters of a module (numel of every parameter).
int64_t count_parameters(const torch::nn::Module& m);

}  // namespace trainscope::suites
