#pragma once
// A training step replayed on sizes alone. Tensors are handles over shared storage, so the C++ that
// mirrors a model (plan/models.cpp) frees a temporary exactly where the model's own C++ does: at the
// end of the full expression, or when the last variable or autograd node holding it goes. Autograd
// nodes keep what the operator saves for backward; backward() runs them in reverse order of creation
// as torch's engine does on one device: each allocates its inputs' gradients (accumulating into an
// existing one through a temporary), then frees its outputs' gradients and its saved tensors.
// The live byte count and its peak are the CPU accounting allocator's numbers, predicted.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace trainscope::plan {

class Tape;

// Bytes of storage; freed from the tape's count when the last holder lets go.
struct Storage {
  Tape* tape;
  int64_t bytes;
  Storage(Tape* t, int64_t b);
  ~Storage();
};

// A tensor: its storage, its size (elements x element bytes), and its autograd identity.
struct T {
  std::shared_ptr<Storage> storage;
  int64_t numel = 0;
  int elem = 4;      // bytes per element
  int id = -1;       // autograd identity (gradients are routed by it); -1: no gradient wanted
  bool param = false;
  int64_t bytes() const { return numel * elem; }
  bool grad() const { return id >= 0; }
  explicit operator bool() const { return numel > 0; }
};

// What an operator costs, for the time model: GEMM dimensions (m x k by k x n, `batch` of them), or
// the bytes a memory-bound kernel reads and writes, or the elements a compute-bound elementwise
// kernel (GELU/SiLU, softmax, normalisation, random numbers) processes at its measured rate.
enum class OpKind { Gemm, Memory, Activation, Softmax, Norm, Random };
struct OpCost {
  int64_t m = 0, n = 0, k = 0, batch = 1;
  int64_t bytes = 0;
  OpKind kind = OpKind::Memory;
  int64_t elements = 0;
  int elem = 4;  // element bytes of the elementwise kinds
  bool on_chip = false;  // inside a fused kernel (flash attention's exponentials): no memory traffic of its own
  bool fused_attention = false;  // a GEMM cost standing for SDPA's fused causal kernel: (S, S, Dh) x 2 x heads
  bool conv = false;             // a GEMM cost standing for a convolution (im2col's m x n x k)
};
inline OpCost gemm_cost(int64_t m, int64_t n, int64_t k, int64_t batch = 1) { return OpCost{m, n, k, batch, 0, OpKind::Gemm, 0, 4}; }
// SDPA's fused causal attention over `heads` (batch x heads) of S x S x Dh: as two batched GEMMs
// (scores and output) where the device has no measured attention rate.
inline OpCost attention_cost(int64_t seq, int64_t head_dim, int64_t heads) {
  OpCost c = gemm_cost(seq, seq, head_dim, 2 * heads);
  c.fused_attention = true;
  return c;
}
inline OpCost elementwise_cost(OpKind kind, int64_t elements, int elem) {
  return OpCost{0, 0, 0, 1, elements * elem * 2, kind, elements, elem};
}

struct Node {
  std::vector<std::pair<int, int64_t>> inputs;  // (autograd id, gradient bytes)
  std::vector<int> outputs;
  std::vector<std::shared_ptr<Storage>> saved;
  std::function<void(Tape&, int out_id)> recompute;  // checkpoint nodes: re-run forward + backward
  std::vector<Node> inner;                            // a block run as its own graph (zero3)
  int64_t work = 0;                                   // scratch its backward allocates and frees
  bool passthrough = false;  // an addition: its inputs' gradients are its output's gradient itself
};

struct Phase {
  int64_t peak = 0;
};

class Tape {
 public:
  // ---- accounting -----------------------------------------------------------------------------
  int64_t live() const { return live_; }
  int64_t peak() const { return peak_; }
  void alloc(int64_t b) { live_ += b; if (live_ > peak_) peak_ = live_; if (live_ > phase_peak_) phase_peak_ = live_; }
  void release(int64_t b) { live_ -= b; }
  void reset_phase() { phase_peak_ = live_; }
  void reset_peak() { peak_ = phase_peak_ = live_; }
  int64_t phase_peak() const { return phase_peak_; }
  // A momentary allocation (freed at once): counts towards the peak only.
  void transient(int64_t b) { alloc(b); release(b); }

  // ---- tensors --------------------------------------------------------------------------------
  T make(int64_t numel, int elem, bool requires_grad);
  T param(int64_t numel, int elem);     // a leaf that wants a gradient (its bytes are live from now)
  T data(int64_t numel, int elem) { return make(numel, elem, false); }
  // An operator: `out` elements of `elem` bytes; `saved` are kept for backward (when a gradient is
  // wanted); `extra_saved` bytes are made by the operator and saved with it (LayerNorm's mean and
  // rstd), freed at once when no gradient is wanted.
  T op(const std::vector<const T*>& in, int64_t out, int elem, const std::vector<const T*>& saved,
       bool save_output = false, int64_t extra_saved = 0, OpCost cost = {}, int64_t workspace = 0,
       int64_t backward_workspace = 0);
  // A view over part of `base` (select, slice) that routes its gradient into a gradient of the whole
  // base; views of the same elements (reshape, transpose) are the tensor itself.
  T part(const T& base, int64_t numel);
  // Checkpointing: runs `fn` without recording, keeps `x` and `extras`, and re-runs it in backward.
  // op_level (selective-op): the operators the model marks as saved keep their outputs from the forward
  // (held with x) and serve them to the recomputation (suites/techniques/checkpoint.cpp).
  T checkpoint(const std::function<T(Tape&, const T&)>& fn, const T& x, const std::vector<const T*>& extras,
               const std::vector<const T*>& params, bool op_level = false);

  // The state of the selective-op checkpoint whose block runs now (null outside one).
  struct SacState {
    bool recompute = false;
    int mm = 0;        // unbiased matmuls so far in this pass: every second one is recomputed
    size_t next = 0;   // the next kept output the recomputation is served
    std::vector<std::vector<T>> kept;  // per saved operator, its outputs (attention: out and log-sum-exp)
  };
  std::shared_ptr<SacState> sac;
  // A saved operator in the recomputation: a node with the operator's inputs and saved tensors whose
  // output is the kept tensor (no allocation, no cost: the forward computed it).
  T served(const std::vector<const T*>& in, const T& kept, const std::vector<const T*>& saved, int64_t backward_workspace = 0);

  // A block run as its own graph (zero3's Zero3BlockFunction): `fn` records into a separate graph
  // whose output's gradient seeds it in backward; `bwd(run)` wraps running it (gather, prefetch,
  // reduce-scatter). While it runs, parameter gradients are returned (collected_param_grads()), not
  // accumulated into .grad, as torch::autograd::grad returns them.
  T own_graph(const std::function<T(Tape&, const T&)>& fn, const T& x,
              const std::function<void(Tape&, const std::function<void()>&)>& bwd);
  int64_t collected_param_grads() const { return collected_; }
  void free_collected() { release(collected_); collected_ = 0; }
  // Strategies whose gradient buffers exist before backward (ddp's buckets, zero's flat buffers): the
  // parameter's gradient is accumulated into them (in place) rather than allocated.
  void adopt_param_grad(const T& p) { param_grads_[p.id] = 0; }

  bool grad_enabled = true;
  // Autocast's cast cache: the low-precision copy of each parameter (a leaf that wants a gradient)
  // made once per autocast region and held until the outermost region exits, used or not.
  std::map<int, T> autocast_cache;
  // Wraps each block's forward (zero3 gathers around it), as ReferenceModel::set_block_wrapper does.
  using BlockFn = std::function<T(Tape&, const T&)>;
  std::function<T(size_t index, const BlockFn& body, const T& x)> block_wrapper;

  // ---- backward --------------------------------------------------------------------------------
  void backward(const T& loss);
  // A pipeline's micro-batch graphs (suites/parallel/pipeline.cpp): the nodes recorded since `mark()`
  // set aside until that micro-batch's backward, which runs them from `out` seeded with `seed` (a
  // received gradient; none: a new one, the loss's) and returns the gradient of the leaf `in` (what the
  // stage sends back), or null.
  using Graph = std::vector<Node>;
  size_t mark() const { return nodes_.size(); }
  Graph take_graph(size_t mark);
  std::shared_ptr<Storage> backward_graph(Graph graph, const T& out, const std::shared_ptr<Storage>& seed, const T& in);
  // Parameter gradients (persistent between backward and the next zero_grad).
  int64_t param_grad_bytes() const;
  void free_param_grads();

  // ---- cost ------------------------------------------------------------------------------------
  // An operator's cost that is no allocation of its own (dropout's random draw).
  // The node just recorded (if any) passes its output's gradient to its inputs (AddBackward).
  void mark_passthrough() {
    if (last_node_ && !nodes_.empty()) nodes_.back().passthrough = true;
  }
  void cost(const OpCost& c) { (recording_cost ? forward_costs : recompute_costs).push_back(c); }
  std::vector<OpCost> forward_costs;
  std::vector<OpCost> recompute_costs;  // checkpointing's second forward (in backward)
  int64_t ops = 0;  // forward operators recorded (kernel launches / dispatches)
  bool recording_cost = true;

 private:
  // The autograd node of an operator: its inputs that want gradients, its output, what it saves.
  Node node(const std::vector<const T*>& in, const T& out, const std::vector<const T*>& saved, int64_t backward_workspace);
  void run_nodes(size_t from);
  int next_id_ = 0;
  int64_t live_ = 0, peak_ = 0, phase_peak_ = 0;
  std::vector<Node> nodes_;
  std::map<int, std::shared_ptr<Storage>> grads_;  // non-leaf gradients in flight (aliases share storage)
  std::map<int, int64_t> param_grads_;  // leaf gradients (.grad)
  std::map<int, bool> is_param_;
  bool collect_ = false;
  bool last_node_ = false;  // the last op() recorded a node
  int64_t collected_ = 0;
  size_t inner_mark_ = 0;
};

}  // namespace trainscope::plan
