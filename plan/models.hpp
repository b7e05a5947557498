#pragma once
// The reference models' forward passes replayed on a Tape: the same operators in the same order with
// the same temporaries and the same saved tensors as suites/models (each function names the code it
// mirrors), so that the tape's live bytes are the accounting allocator's. Torch-free.
#include <map>
#include <string>

#include "core/model_shape.hpp"
#include "plan/curve.hpp"
#include "plan/tape.hpp"

namespace trainscope::plan {

// How a precision mode stores and computes on a device: core/precision.hpp's row, in bytes.
struct Numerics {
  std::string precision = "32-true";
  int param = 4;          // bytes of the parameters the forward computes with (and, without masters, of the optimizer state)
  int master = 0;         // bytes of the optimizer's master copy (0: none; bf16-master: 4)
  int reduce = 4;         // bytes gradients are reduced in (masters only)
  bool autocast = false;  // autocast to `low` for GEMMs
  int low = 2;
  bool fp16_emulated = false;  // CPU 16-mixed: fp32 compute rounded through fp16 at block boundaries
  bool scaler = false;
  bool fp8 = false;
  std::string gemm_dtype = "fp32";  // the dtype the GEMMs run in (for the time model's peak)
  int optimizer_bytes() const { return master ? master : param; }
};
// Any precision of the table on a CPU or a CUDA device; reduce_dtype for the modes with masters.
Numerics numerics_of(const std::string& precision, bool cuda, const std::string& reduce_dtype = "fp32");

// What the replay needs of a cell besides the model: batch per rank, image shape, checkpointing.
struct Replay {
  ModelShape model;
  int64_t batch = 1;
  int64_t channels = 1, height = 28, width = 28, classes = 10;  // image data
  std::string checkpoint = "none";                                // none | full | every:k | selective
  std::string cross_entropy = "eager";                            // eager | fused (ReferenceModel::loss)
  // Tensor parallelism (suites/parallel/tensor_parallel.hpp, GPT and Llama): this rank's shard of every split
  // layer, the vocabulary-parallel embedding, head and loss; with sequence parallelism the norms and
  // residuals on S / tp of the tokens.
  int64_t tp = 1;
  bool sequence_parallel = false;
  // Context parallelism (suites/parallel/context_parallel.hpp, decoders): this rank's S / cp tokens
  // through every token-local operator, attention across the shards by cp_method (ring | allgather) on
  // head-tail (cp_balance) or contiguous shards.
  int64_t cp = 1;
  std::string cp_method = "allgather";
  bool cp_balance = true;
  int64_t local_seq() const { return model.seq_len / cp; }
  // Pipeline parallelism (suites/parallel/pipeline.cpp, decoders): the layers of this rank's stages
  // ([first, last) each; empty: every layer), whose parameters it keeps (the others' are dropped: empty),
  // and the layers one forward runs, from the embedding (first 0) or a received hidden state, to a
  // hidden state sent on or, at the last layer (-1), the loss.
  std::vector<std::pair<int64_t, int64_t>> held;
  int64_t first_layer = 0, last_layer = -1;
  bool holds(int64_t layer) const;
  int64_t held_layers() const;
  Numerics num;
  bool cuda = false;
  // Bytes a GEMM allocates beyond its product by its inner dimension, per element size (2: bf16/fp16,
  // 4: fp32), as the hardware suite measured them on this CPU (oneDNN's scratchpad); none: zero.
  std::map<int, Curve> gemm_workspace;
  int64_t persistent_workspace = 0;  // GPU: cuBLAS workspaces kept from the first GEMMs on (measured)
  ConvScratch conv_workspace;  // CPU: oneDNN's scratch over the output's bytes, per measured shape
  double batch_norm_backward_ratio = 0;  // CPU: batch norm's backward temporary over its input's bytes
};

// The model's parameters, in module order, grouped by block (zero3's units): element counts.
struct ParamLayout {
  std::vector<std::vector<int64_t>> blocks;  // per block, each parameter's numel
  std::vector<int64_t> root;                 // outside blocks (embeddings, head, norms, stem)
  std::vector<int64_t> buffers;              // non-parameter state (BatchNorm running statistics), bytes
  int64_t total() const;
  int64_t largest() const;
};
ParamLayout param_layout(const Replay& r);

// Families the replay covers (an empty string) or why not; with the replay, the layouts too.
std::string replay_unsupported(const ModelShape& m);
std::string replay_unsupported(const Replay& r);

// Context parallelism's attention over one layer for `batch` sequences on this rank (Replay::cp > 1):
// the busiest rank's causal query-key pairs (core/layout.hpp: context_parallel_pairs) as the fused
// causal kernel's cost over sqrt(2 pairs) tokens.
OpCost cp_attention_layer_cost(const Replay& r, int64_t batch);

// Runs forward + loss; returns the loss (or, for a pipeline stage before the last, its hidden states).
// `params` are the model's parameters in param_layout order, made by the caller (strategies shard them);
// `input` is the received hidden state when the forward starts after the embedding.
T forward_loss(Tape& tape, const Replay& r, const std::vector<T>& params, const T& input, const T& target);

}  // namespace trainscope::plan
