#include "core/model_shape.hpp"

#include <algorithm>

#include "core/errors.hpp"

namespace trainscope {
namespace {

ModelShape image(const std::string& name, const std::string& family, std::vector<int64_t> hidden, int64_t width,
                 const std::string& summary) {
  ModelShape s;
  s.name = name;
  s.family = family;
  s.hidden = std::move(hidden);
  s.width = width;
  s.summary = summary;
  return s;
}

ModelShape vit(const std::string& name, int64_t d, int64_t layers, int64_t heads, int64_t patch, const std::string& summary) {
  ModelShape s = image(name, "vit", {}, d, summary);
  s.layers = layers;
  s.heads = s.kv_heads = heads;
  s.ffn = 4 * d;
  s.seq_len = patch;
  return s;
}

ModelShape gpt(const std::string& name, int64_t d, int64_t layers, int64_t heads, int64_t seq, int64_t vocab,
               const std::string& summary) {
  ModelShape s = vit(name, d, layers, heads, seq, summary);
  s.family = "gpt";
  s.vocab = vocab;
  s.tied = true;  // GPT-2's head is its token embedding
  return s;
}

// Llama 3: RoPE base 500000, RMSNorm eps 1e-5, the llama3 frequency scaling over an original context of
// 8192 with low/high frequency factors 1 and 4 (factor 8 for 3.1, 32 for 3.2's 1B/3B).
ModelShape llama(const std::string& name, int64_t d, int64_t layers, int64_t heads, int64_t kv_heads, int64_t ffn,
                 int64_t seq, int64_t vocab, bool tied, double rope_factor, const std::string& summary) {
  ModelShape s = image(name, "llama", {}, d, summary);
  s.layers = layers;
  s.heads = heads;
  s.kv_heads = kv_heads;
  s.ffn = ffn;
  s.seq_len = seq;
  s.vocab = vocab;
  s.tied = tied;
  s.rope_theta = 500000.0;
  s.rope_factor = rope_factor;
  s.rope_low_freq_factor = 1.0;
  s.rope_high_freq_factor = 4.0;
  s.rope_original_ctx = 8192;
  s.norm_eps = 1e-5;
  return s;
}

bool is_transformer(const std::string& family) { return family == "gpt" || family == "llama" || family == "vit"; }

}  // namespace

const std::vector<ModelShape>& model_presets() {
  static const std::vector<ModelShape> presets = {
      image("mlp-tiny", "mlp", {64}, 0, "MLP, one hidden layer of 64 (CI)"),
      image("mlp", "mlp", {512, 256}, 0, "MLP 512-256"),
      image("mlp-large", "mlp", {4096, 4096, 4096, 4096}, 0, "MLP 4x4096 (GPU)"),
      image("cnn-tiny", "cnn", {1, 1}, 8, "ResNet-style, 2 stages of 1 block, width 8 (CI)"),
      image("cnn-small", "cnn", {1, 1, 1}, 16, "ResNet-style, 3 stages of 1 block, width 16 (SSL encoder)"),
      image("cnn", "cnn", {2, 2, 2}, 32, "ResNet-style, 3 stages of 2 blocks, width 32"),
      image("resnet18", "cnn", {2, 2, 2, 2}, 64, "ResNet-18 layout, width 64 (GPU)"),
      vit("vit-tiny", 64, 2, 4, 7, "ViT, patch 7 (16 tokens), d=64, 2 blocks, 4 heads (CI, SSL encoder)"),
      vit("vit-small", 96, 4, 4, 4, "ViT, patch 4 (49 tokens), d=96, 4 blocks, 4 heads"),
      gpt("gpt-tiny", 64, 2, 4, 64, 256, "GPT, 2 layers, d=64, 4 heads, seq 64 (CI)"),
      gpt("gpt-small", 256, 4, 4, 128, 1024, "GPT, 4 layers, d=256, seq 128"),
      gpt("gpt-125m", 768, 12, 12, 1024, 50304, "GPT-2 small shape, 124M (GPU)"),
      gpt("gpt-1b", 2048, 24, 16, 2048, 50304, "GPT, 24 layers, d=2048, 16 heads, seq 2048, 1.3B (GPU)"),
      // Sized for a 2-core CPU: byte-level text (vocab 256), untied heads like the published 8B/70B.
      llama("llama-tiny", 64, 2, 4, 2, 192, 64, 256, false, 8.0, "Llama 3 style, 2 layers, d=64, 4 heads / 2 KV, seq 64 (CI)"),
      llama("llama-small", 256, 4, 8, 2, 768, 256, 256, false, 8.0, "Llama 3 style, 4 layers, d=256, 8 heads / 2 KV, seq 256"),
      // The published shapes (Hugging Face config.json of Llama 3.2 1B, Llama 3.1 8B and 70B), at the
      // training sequence torchtitan uses (8192; the configs allow 131072).
      llama("llama3-1b", 2048, 16, 32, 8, 8192, 8192, 128256, true, 32.0, "Llama 3.2 1B, tied head (GPU, planning)"),
      llama("llama3-8b", 4096, 32, 32, 8, 14336, 8192, 128256, false, 8.0, "Llama 3.1 8B (GPU, planning)"),
      llama("llama3-70b", 8192, 80, 64, 8, 28672, 8192, 128256, false, 8.0, "Llama 3.1 70B (planning)"),
      llama("llama3-405b", 16384, 126, 128, 8, 53248, 8192, 128256, false, 8.0, "Llama 3.1 405B (planning)"),
  };
  return presets;
}

const ModelShape* find_model_preset(const std::string& name) {
  for (const auto& p : model_presets())
    if (p.name == name) return &p;
  return nullptr;
}

const std::vector<std::string>& model_dimension_keys() {
  static const std::vector<std::string> keys{"family",     "layers",      "d_model",     "heads",
                                             "kv_heads",   "ffn",         "seq_len",     "vocab",
                                             "tied",       "rope_theta",  "rope_factor", "rope_low_freq_factor",
                                             "rope_high_freq_factor", "rope_original_ctx", "norm_eps"};
  return keys;
}

json ModelShape::to_json() const {
  json j{{"family", family}};
  if (!hidden.empty()) j["hidden"] = hidden;
  if (family == "mlp") return j;
  if (family == "cnn") {
    j["width"] = width;
    return j;
  }
  j["layers"] = layers;
  j["d_model"] = width;
  j["heads"] = heads;
  j["kv_heads"] = kv_heads;
  j["head_dim"] = head_dim();
  j["ffn"] = ffn;
  j[family == "vit" ? "patch" : "seq_len"] = seq_len;
  if (language_model()) {
    j["vocab"] = vocab;
    j["tied"] = tied;
  }
  if (family == "llama") {
    j["rope"] = {{"theta", rope_theta},
                 {"factor", rope_factor},
                 {"low_freq_factor", rope_low_freq_factor},
                 {"high_freq_factor", rope_high_freq_factor},
                 {"original_context", rope_original_ctx}};
    j["norm_eps"] = norm_eps;
  }
  j["attention"] = attention;
  return j;
}

ModelShape resolve_model(const RunConfig& c) {
  ModelShape s;
  const ModelShape* preset = find_model_preset(c.model);
  if (preset) {
    s = *preset;
    if (c.family != "preset" && c.family != s.family)
      throw UsageError("model '" + c.model + "' is a " + s.family + " preset; family = " + c.family +
                       " defines a model of your own under a name of its own (a suite's [models.NAME])");
  } else {
    if (c.family == "preset") {
      std::string names;
      for (const auto& p : model_presets()) names += (names.empty() ? "" : ", ") + p.name;
      throw UsageError("unknown model '" + c.model + "' (presets: " + names +
                       "; or define it by its dimensions in a suite's [models." + c.model + "] table)");
    }
    s.name = c.model;
    s.family = c.family;
    if (!is_transformer(s.family))
      throw UsageError("model '" + c.model + "': family " + s.family +
                       " has no dimensions to give (models of your own are gpt, llama or vit)");
    s.summary = "defined by the suite";
    if (s.family == "gpt") s.tied = true;
    if (s.family == "llama") {
      s.rope_theta = 500000.0;
      s.rope_original_ctx = 8192;
    }
  }
  // The dimension keys: 0 (or "preset") keeps the preset's value.
  const bool dims_given = c.layers || c.d_model || c.heads || c.kv_heads || c.ffn || c.seq_len || c.vocab ||
                          c.tied != "preset" || c.rope_theta || c.rope_factor || c.rope_low_freq_factor ||
                          c.rope_high_freq_factor || c.rope_original_ctx || c.norm_eps;
  const std::string what = "model '" + s.name + "'";
  if (!is_transformer(s.family)) {
    if (dims_given)
      throw UsageError(what + " (" + s.family + ") takes no dimension keys (layers, d_model, heads, ...: gpt, llama and vit)");
    return s;
  }
  if (c.layers) s.layers = c.layers;
  if (c.d_model) s.width = c.d_model;
  if (c.heads) {
    // A new head count on a preset whose K/V heads were its heads keeps them equal (no GQA added).
    if (s.kv_heads == s.heads) s.kv_heads = c.heads;
    s.heads = c.heads;
  }
  if (c.kv_heads) s.kv_heads = c.kv_heads;
  if (c.d_model && s.family != "llama") s.ffn = 4 * c.d_model;
  if (c.ffn) s.ffn = c.ffn;
  if (c.seq_len) s.seq_len = c.seq_len;
  if (c.vocab) s.vocab = c.vocab;
  if (c.tied != "preset") s.tied = c.tied == "true";
  if (c.rope_theta) s.rope_theta = c.rope_theta;
  if (c.rope_factor) s.rope_factor = c.rope_factor;
  if (c.rope_low_freq_factor) s.rope_low_freq_factor = c.rope_low_freq_factor;
  if (c.rope_high_freq_factor) s.rope_high_freq_factor = c.rope_high_freq_factor;
  if (c.rope_original_ctx) s.rope_original_ctx = c.rope_original_ctx;
  if (c.norm_eps) s.norm_eps = c.norm_eps;
  if (s.kv_heads == 0) s.kv_heads = s.heads;

  // Consistency, before anything is built.
  auto need = [&](int64_t v, const char* key) {
    if (v < 1) throw UsageError(what + ": " + key + " must be given (a positive integer)");
  };
  need(s.layers, "layers");
  need(s.width, "d_model");
  need(s.heads, "heads");
  need(s.seq_len, s.family == "vit" ? "seq_len (the patch size)" : "seq_len");
  if (s.family != "vit") need(s.vocab, "vocab");
  if (s.family == "llama") need(s.ffn, "ffn");
  if (s.width % s.heads != 0)
    throw UsageError(what + ": d_model " + std::to_string(s.width) + " is not divisible by heads " + std::to_string(s.heads));
  if (s.heads % s.kv_heads != 0)
    throw UsageError(what + ": heads " + std::to_string(s.heads) + " is not divisible by kv_heads " +
                     std::to_string(s.kv_heads));
  if (s.family != "llama") {
    if (s.kv_heads != s.heads) throw UsageError(what + ": kv_heads (grouped-query attention) is a llama dimension");
    if (s.ffn != 4 * s.width) throw UsageError(what + ": ffn is a llama dimension (" + s.family + " blocks use 4 x d_model)");
    if (s.family == "gpt" && !s.tied) throw UsageError(what + ": a gpt's head is always its token embedding (tied)");
    if (c.tied != "preset" && s.family == "vit") throw UsageError(what + ": tied is a language-model dimension");
    if (c.rope_theta || c.rope_factor || c.rope_low_freq_factor || c.rope_high_freq_factor || c.rope_original_ctx ||
        c.norm_eps)
      throw UsageError(what + ": rope_* and norm_eps are llama dimensions");
  } else {
    if (s.head_dim() % 2 != 0)
      throw UsageError(what + ": RoPE rotates pairs, head_dim " + std::to_string(s.head_dim()) + " must be even");
    if (s.rope_theta <= 0) throw UsageError(what + ": rope_theta must be positive");
    if (s.rope_factor < 1) throw UsageError(what + ": rope_factor must be at least 1 (1: no frequency scaling)");
    if (s.rope_factor > 1 && !(s.rope_high_freq_factor > s.rope_low_freq_factor && s.rope_original_ctx > 0))
      throw UsageError(what + ": rope scaling needs rope_high_freq_factor > rope_low_freq_factor and rope_original_ctx");
  }
  return s;
}

int64_t analytic_decoder_parameters(const ModelShape& s) {
  const int64_t D = s.width, L = s.layers, V = s.vocab;
  if (s.family == "gpt")  // token + position embeddings, blocks (qkv, proj, 4x MLP with biases, 2 LayerNorms), ln_f
    return (V + s.seq_len) * D + L * (12 * D * D + 13 * D) + 2 * D;
  if (s.family == "llama") {
    const int64_t Dh = s.head_dim(), q = s.heads * Dh, kv = s.kv_heads * Dh;
    const int64_t block = D * q + 2 * D * kv + q * D + 3 * D * s.ffn + 2 * D;  // q, k, v, o, gate/up/down, 2 RMSNorms
    return V * D + L * block + D + (s.tied ? 0 : V * D);
  }
  return 0;
}

const char* flop_convention_name(FlopConvention c) {
  return c == FlopConvention::Full ? "full-attention (torchtitan: 6N + 12·L·H·Dh·S)"
                                   : "causal (Megatron-Bridge: 6N + 6·L·H·Dh·S)";
}

double decoder_flops_per_token(const ModelShape& s, FlopConvention c) {
  const int64_t D = s.width;
  int64_t n = analytic_decoder_parameters(s) - s.vocab * D;  // the embedding is a lookup
  if (s.family == "gpt") n -= s.seq_len * D;                 // so are the learned positions
  if (s.tied) n += s.vocab * D;                               // the head's matmul uses the same matrix
  const double attention = 6.0 * s.layers * s.heads * s.head_dim() * s.seq_len;
  return 6.0 * static_cast<double>(n) + (c == FlopConvention::Full ? 2.0 : 1.0) * attention;
}

std::string resolve_attention(const std::string& requested, const std::string& device, int64_t seq_len) {
  if (requested != "auto") return requested;
  // CUDA: SDPA reaches the flash / memory-efficient / cuDNN kernels, which never materialise the S x S
  // scores. CPU (the llama suite on 2 cores, three runs, docs/models.md): step times are within
  // the noise at seq 64 and 256; SDPA keeps 13% fewer activation bytes at seq 64 and 29% fewer at 256.
  // SDPA from 256, where the saving is large; eager below keeps the GPT presets' CPU numbers comparable
  // with earlier runs.
  if (device.rfind("cuda", 0) == 0) return "sdpa";
  return seq_len >= 256 ? "sdpa" : "eager";
}

}  // namespace trainscope
