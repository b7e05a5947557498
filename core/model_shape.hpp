#pragma once
// Model shapes as data: the presets, the dimensions a suite or `--set` may override, and what follows
// from the dimensions alone (parameter count, FLOPs per token), without building or allocating a
// model. The planner and `trainscope list` read shapes through here; suites/models builds them.
#include <cstdint>
#include <string>
#include <vector>

#include "core/config.hpp"

namespace trainscope {

struct ModelShape {
  std::string name, family;  // family: mlp | cnn | vit | gpt | llama
  std::vector<int64_t> hidden;  // mlp: hidden widths; cnn: blocks per stage
  int64_t width = 0;            // cnn: stem channels; vit, gpt, llama: model dim D (d_model)
  int64_t layers = 0, heads = 0, seq_len = 0, vocab = 0;  // vit: seq_len is the patch size
  int64_t kv_heads = 0;  // llama: grouped-query attention's K/V heads (gpt, vit: = heads)
  int64_t ffn = 0;       // llama: SwiGLU hidden size (gpt, vit: 4 D)
  bool tied = false;     // the LM head is the token embedding (gpt: always)
  // llama: RoPE base and Llama 3's frequency scaling (factor 1: none), RMSNorm's epsilon.
  double rope_theta = 0, rope_factor = 1, rope_low_freq_factor = 1, rope_high_freq_factor = 4;
  int64_t rope_original_ctx = 0;
  double norm_eps = 1e-5;
  double dropout = 0.0;
  std::string attention = "eager";  // eager | sdpa (resolved; the `attention` key may say auto)
  std::string summary;

  int64_t head_dim() const { return heads > 0 ? width / heads : 0; }
  bool language_model() const { return family == "gpt" || family == "llama"; }
  json to_json() const;  // the dimensions, as a report's cell.model.shape
};

const std::vector<ModelShape>& model_presets();
const ModelShape* find_model_preset(const std::string& name);  // nullptr when none

// The configuration keys that give or override a model's dimensions (`family`, `layers`, `d_model`, ...).
const std::vector<std::string>& model_dimension_keys();

// The cell's model: the preset named by c.model with c's dimension keys applied, or, for a name that
// is no preset, the shape the dimension keys give (a suite's [models.NAME] puts them in the cell).
// UsageError, one line, on an unknown model or family and on inconsistent dimensions.
ModelShape resolve_model(const RunConfig& c);

// Parameters counted from the dimensions (gpt, llama; 0 for the image families, whose count depends on
// the data's shape and is counted on the built model).
int64_t analytic_decoder_parameters(const ModelShape& s);

// Training FLOPs per token of a decoder (forward + backward, 2 per multiply-add, x3 for training):
//   full   6·N + 12·L·H·Dh·S   (torchtitan's convention: the whole S x S attention)
//   causal 6·N +  6·L·H·Dh·S   (Megatron-Bridge's: the causal half)
// N: every parameter that multiplies a token's activations, i.e. all of them less the token embedding
// (a lookup) and GPT's learned positions, plus the LM head's matrix also when it is the tied embedding.
enum class FlopConvention { Full, Causal };
const char* flop_convention_name(FlopConvention c);
double decoder_flops_per_token(const ModelShape& s, FlopConvention c);

// `attention = auto` resolved on a device ("cpu", "cuda:0") for a model of seq_len tokens: see
// model_shape.cpp for the measurement behind it.
std::string resolve_attention(const std::string& requested, const std::string& device, int64_t seq_len);

// cross_entropy = fused converts the logits to fp32 this many at a time (whole rows; 64 MiB in fp32), so
// its scratch stays bounded whatever the vocabulary and batch (the model's loss and the planner's replay).
inline constexpr int64_t kFusedLossChunkElements = int64_t{1} << 24;

}  // namespace trainscope
