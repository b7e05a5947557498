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
//   selective   GPT: recompute only the attention core (scores, softmax, dropout, attention x V), which
//               holds the S x S tensors; keep every matmul output (qkv, projections, MLP) and the
//               rest. Models without attention have nothing selective to drop: same as none.
#include <functional>
#include <string>

#include <torch/torch.h>

namespace trainscope::suites {

struct CheckpointPolicy {
  enum class Kind { None, Full, Every, Selective } kind = Kind::None;
  int64_t every = 1;
  bool restore_rng = true;  // false only to show (in tests) that the restore matters
  bool check = false;       // compare each recomputed output with the original

  static CheckpointPolicy parse(const std::string& text);  // UsageError on bad text
  bool checkpoints_block(int64_t index) const {
    return kind == Kind::Full || (kind == Kind::Every && index % every == 0);
  }
};

using BlockFn = std::function<torch::Tensor(const torch::Tensor&)>;

torch::Tensor checkpoint(const BlockFn& fn, const torch::Tensor& x, at::TensorList params, bool restore_rng = true,
                         bool check = false);

// What the determinism check saw in this process: recomputations compared and the largest
// |recomputed - original| over all of them (0 when bit-exact).
struct DeterminismCheck {
  int64_t compared = 0;
  double max_abs_diff = 0;
};
DeterminismCheck checkpoint_determinism();

}  // namespace trainscope::suites
