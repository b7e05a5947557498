#pragma once
// Activation checkpointing (LibTorch's C++ API has none).
//
// checkpoint(fn, x, params) runs fn(x) without keeping its intermediate activations and recomputes
// it in backward. The block's parameters are inputs of the autograd function and their gradients are
// returned from backward, so they accumulate through the normal path (DDP's reducer hooks keep
// working) and a block whose input needs no gradient still trains. The CPU and device RNG states are
// stashed in forward and restored for the recomputation, so dropout draws the same masks; autocast's
// state is restored too.
//
// Policies (the `checkpoint` key):
//   none        keep everything
//   full        checkpoint every block (MLP layer, CNN residual block, GPT decoder block)
//   every:k     checkpoint blocks 0, k, 2k, ...
//   selective   GPT and Llama: recompute only the attention core (scores, softmax, dropout, attention x
//               V), which holds the S x S tensors; keep every matmul output (qkv, projections, MLP)
//               and the rest. Models without attention have nothing selective to drop: same as none.
//   selective-op  torchtitan's op-level selective checkpointing (SelectiveAC, its default policy): every
//               block checkpointed, but the outputs of its compute-heavy operators kept in forward and
//               served to the recomputation instead of computed again: attention (the fused kernel's
//               output and log-sum-exp; eager attention's two batched matmuls), every biased linear
//               (addmm), and of the unbiased ones (mm) the odd ones in the block's forward order (the
//               1st, 3rd, ...: Llama's q, v, gate and down projections); norms, RoPE, activations and
//               the rest are recomputed. See sac_linear() below.
#include <functional>
#include <string>

#include <torch/torch.h>

namespace trainscope::suites {

struct CheckpointPolicy {
  enum class Kind { None, Full, Every, Selective, SelectiveOp } kind = Kind::None;
  int64_t every = 1;
  bool restore_rng = true;  // false only to show (in tests) that the restore matters
  bool check = false;       // compare each recomputed output with the original

  static CheckpointPolicy parse(const std::string& text);  // UsageError on bad text
  bool checkpoints_block(int64_t index) const {
    return kind == Kind::Full || kind == Kind::SelectiveOp || (kind == Kind::Every && index % every == 0);
  }
};

using BlockFn = std::function<torch::Tensor(const torch::Tensor&)>;

// op_level: selective-op's checkpoint (the operators below keep and serve their outputs).
torch::Tensor checkpoint(const BlockFn& fn, const torch::Tensor& x, at::TensorList params, bool restore_rng = true,
                         bool check = false, bool op_level = false);

// The operators selective-op sees. Outside an op-level checkpoint each is the plain call; inside one,
// the forward keeps the outputs torchtitan's policy saves and the recomputation gets them back with
// the operator's own backward (the same ATen calls as its autograd node: the same bits).
// x @ w^T + b (suites/techniques/precision.hpp: project): saved when biased (addmm), else every other
// one in the block's order, starting with the first (mm).
torch::Tensor sac_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b);
// torch::matmul of two 4-D tensors with equal batch dimensions (eager attention's bmm): always saved.
torch::Tensor sac_matmul(const torch::Tensor& a, const torch::Tensor& b);
// Fused attention: `plain` is the model's own at::scaled_dot_product_attention call. Saved (output and
// log-sum-exp) where that call runs the flash kernel without dropout, on a CPU or (without grouped
// K/V) a GPU; elsewhere recomputed, as the plain call.
torch::Tensor sac_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal, double scale,
                            bool enable_gqa, double dropout, const std::function<torch::Tensor()>& plain);

// What the determinism check saw in this process: recomputations compared and the largest
// |recomputed - original| over all of them (0 when bit-exact).
struct DeterminismCheck {
  int64_t compared = 0;
  double max_abs_diff = 0;
};
DeterminismCheck checkpoint_determinism();

}  // namespace trainscope::suites
