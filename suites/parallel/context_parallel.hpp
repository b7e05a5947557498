#pragma once
// Context parallelism (the layout's cp dimension): each sample's sequence split over the cp ranks, every
// token-local op (embeddings, norms, projections, MLP, loss) on this rank's tokens only, and causal
// attention across the shards by one of two methods (`cp_method`), both as torch's templates
// (_templated_ring_attention(_backward)) compute it: per ring step i, this rank's queries against the keys
// and values of rank (r - i) mod W, each block's output merged into the running one with its log-sum-exp
// (torch's _SDPAMerger: out -= sigmoid(lse_b - lse)(out - out_b), lse -= logsigmoid(lse - lse_b), in fp32
// at least); backward repeats the blocks with the merged output and lse, and each block's key/value
// gradient sum travels the ring from its owner back to it (Liu et al. 2023, Ring Attention). The methods
// differ in how the keys and values arrive:
//   ring       passed on to the next rank with point-to-point while the current block computes (overlapped)
//   allgather  all-gathered at once, forward and again in backward (torch's default rotation,
//              _AllGatherRotater; Llama 3's all-gathered keys and values, Dubey et al. 2024, 3.3.2): no
//              overlap, W blocks of keys and values held at once
// so the two compute the same bits.
// With `cp_balance` (causal models' default) rank r holds chunks r and 2W-1-r of 2W equal chunks
// (head-tail, torch's _HeadTailLoadBalancer and Llama 3's), so that every rank does the same causal
// work; without it, the r-th contiguous W-th, and rank W-1 does W blocks where rank 0 does one.
// The block kernel is LibTorch's CPU flash op (_scaled_dot_product_flash_attention_for_cpu, which
// returns the log-sum-exp, and its backward); grouped-query keys and values travel with their own heads
// and are expanded (HF's repeat_kv) per block, their gradients folded back in fp32 at least.
// `emulate` computes the same blocks, merges and sums in one process for W virtual ranks: the ranks'
// forward and backward are bit for bit its, and torch's templates' (tests/test_context_parallel.cpp).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace trainscope::suites {

class Communicator;

// What a rank's cp attention did (summed until the trainer takes it, once a step): host seconds inside it
// (forward and backward, recomputation included), of them blocked on transfers, the transfers' own
// seconds (posted to done: what the blocks' computation could hide) and the bytes this rank sent.
struct ContextStats {
  double attention_s = 0, wait_s = 0, transfer_s = 0;
  int64_t bytes = 0;
};

struct ContextParallel {
  Communicator* group = nullptr;  // the cp communicator (null with degree 1, or in the emulation)
  int64_t rank = 0, degree = 1;
  std::string method = "allgather";  // allgather | ring
  bool balance = true;
  std::shared_ptr<ContextStats> stats = std::make_shared<ContextStats>();  // shared by the model's blocks
  bool active() const { return degree > 1; }
};

namespace context_parallel {

// The global positions (kLong) of `rank`'s tokens in a sequence of S (a multiple of 2 x degree).
torch::Tensor positions(int64_t S, int64_t rank, int64_t degree, bool balance);
// This rank's tokens of x along `dim` (the whole sequence there).
torch::Tensor shard(const torch::Tensor& x, int64_t dim, const ContextParallel& cp);

// Causal attention (scale) of this rank's queries [B, H, c, Dh] against every cp rank's keys and values
// (this rank's: [B, Hkv, c, Dh], H a multiple of Hkv), by cp.method; differentiable. A collective over
// the cp group, in the same order on every rank.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale,
                        const ContextParallel& cp);

// The same for `degree` virtual ranks in one process: q, k, v hold the whole sequence in order and so
// does the result; differentiable.
torch::Tensor emulate(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale,
                      int64_t degree, const std::string& method, bool balance);

}  // namespace context_parallel
}  // namespace trainscope::suites
