#include "plan/tape.hpp"

namespace trainscope::plan {

Storage::Storage(Tape* t, int64_t b) : tape(t), bytes(b) { tape->alloc(bytes); }
Storage::~Storage() { tape->release(bytes); }

T Tape::make(int64_t numel, int elem, bool requires_grad) {
  T t;
  t.storage = std::make_shared<Storage>(this, numel * elem);
  t.numel = numel;
  t.elem = elem;
  t.id = requires_grad && grad_enabled ? next_id_++ : -1;
  return t;
}

T Tape::param(int64_t numel, int elem) {
  T t = make(numel, elem, true);
  if (t.id < 0) t.id = next_id_++;
  t.param = true;
  is_param_[t.id] = true;
  return t;
}

Node Tape::node(const std::vector<const T*>& in, const T& out, const std::vector<const T*>& saved, int64_t backward_workspace) {
  Node n;
  for (const T* t : in)
    if (t && t->grad()) n.inputs.emplace_back(t->id, t->bytes());
  n.outputs.push_back(out.id);
  for (const T* t : saved)
    if (t && t->storage) n.saved.push_back(t->storage);
  n.work = backward_workspace;
  return n;
}

T Tape::op(const std::vector<const T*>& in, int64_t out, int elem, const std::vector<const T*>& saved,
           bool save_output, int64_t extra_saved, OpCost cost, int64_t workspace, int64_t backward_workspace) {
  if (recording_cost) ++ops;
  (recording_cost ? forward_costs : recompute_costs).push_back(cost);
  bool wants = false;
  for (const T* t : in)
    if (t && t->grad()) wants = true;
  wants = wants && grad_enabled;
  T o = make(out, elem, wants);
  if (workspace > 0) transient(workspace);
  last_node_ = wants;
  if (!wants) {
    if (extra_saved > 0) transient(extra_saved);
    return o;
  }
  Node n = node(in, o, saved, backward_workspace);
  if (save_output) n.saved.push_back(o.storage);
  if (extra_saved > 0) n.saved.push_back(std::make_shared<Storage>(this, extra_saved));
  nodes_.push_back(std::move(n));
  return o;
}

T Tape::part(const T& base, int64_t numel) {
  T v = base;
  v.numel = numel;
  v.param = false;
  if (base.grad() && grad_enabled) {
    v.id = next_id_++;
    Node n;
    n.inputs.emplace_back(base.id, base.bytes());
    n.outputs.push_back(v.id);
    nodes_.push_back(std::move(n));
  } else {
    v.id = -1;
  }
  return v;
}

T Tape::served(const std::vector<const T*>& in, const T& kept, const std::vector<const T*>& saved, int64_t backward_workspace) {
  T o = kept;
  o.param = false;
  o.id = -1;
  bool wants = false;
  for (const T* t : in)
    if (t && t->grad()) wants = true;
  last_node_ = wants && grad_enabled;
  if (!last_node_) return o;
  o.id = next_id_++;
  nodes_.push_back(node(in, o, saved, backward_workspace));
  return o;
}

T Tape::checkpoint(const std::function<T(Tape&, const T&)>& fn, const T& x, const std::vector<const T*>& extras,
                   const std::vector<const T*>& params, bool op_level) {
  T y;
  std::shared_ptr<SacState> state = op_level ? std::make_shared<SacState>() : nullptr;
  {
    const bool before = grad_enabled;
    grad_enabled = false;  // CheckpointFunction::forward runs the block with grad mode off
    std::shared_ptr<SacState> outer = sac;
    sac = state;
    T inner = fn(*this, x);
    sac = outer;
    grad_enabled = before;
    y = inner;
  }
  if (!grad_enabled) return y;
  y.id = next_id_++;
  Node n;
  if (x.grad()) n.inputs.emplace_back(x.id, x.bytes());
  for (const T* e : extras)
    if (e->grad()) n.inputs.emplace_back(e->id, e->bytes());
  for (const T* p : params) n.inputs.emplace_back(p->id, p->bytes());
  n.outputs.push_back(y.id);
  n.saved.push_back(x.storage);
  for (const T* e : extras) n.saved.push_back(e->storage);
  if (state)  // selective-op's kept outputs live with the checkpoint until its backward
    for (const auto& outputs : state->kept)
      for (const T& k : outputs) n.saved.push_back(k.storage);
  // Backward: the block re-runs with grad on (on the saved input itself: detach() shares its storage),
  // then its own nodes run with the incoming gradient as the seed; the recomputed graph goes with them.
  T x_copy = x;
  std::vector<std::pair<int, int64_t>> params_in;
  for (const T* p : params) params_in.emplace_back(p->id, p->bytes());
  n.recompute = [fn, x_copy, params_in, state](Tape& tape, int out_id) {
    const bool rec = tape.recording_cost;
    tape.recording_cost = false;
    const size_t mark = tape.nodes_.size();
    std::shared_ptr<SacState> outer = tape.sac;
    if (state) {
      state->recompute = true;
      state->mm = 0;
      state->next = 0;
    }
    tape.sac = state;
    T y2 = fn(tape, x_copy);
    tape.sac = outer;
    if (state) state->kept.clear();  // the recomputed graph's nodes hold what they still need
    tape.autocast_cache.clear();  // the recompute's autocast region is the outermost: its exit clears the cache
    tape.recording_cost = rec;
    // The seed is the incoming gradient itself (no copy), which the outer engine holds until this node
    // returns: the recomputed graph borrows it (0 bytes of its own).
    if (tape.grads_.count(out_id) && y2.grad()) tape.grads_[y2.id] = tape.grads_[out_id];
    // torch::autograd::grad returns the block's parameter gradients; the engine then stores each into
    // .grad, cloning it (the returned list still holds it, so AccumulateGrad cannot steal it).
    const bool outer_collect = tape.collect_;
    const int64_t before = tape.collected_;
    tape.collect_ = true;
    tape.run_nodes(mark);
    // CheckpointFunction::backward's local `y` holds the recomputed output until it returns.
    y2 = T();
    tape.collect_ = outer_collect;
    if (!outer_collect) {
      for (const auto& [id, b] : params_in) {
        if (tape.param_grads_.count(id)) tape.transient(b);
        else { tape.alloc(b); tape.param_grads_[id] = b; }
      }
      tape.release(tape.collected_ - before);
      tape.collected_ = before;
    }
  };
  nodes_.push_back(std::move(n));
  return y;
}

T Tape::own_graph(const std::function<T(Tape&, const T&)>& fn, const T& x,
                  const std::function<void(Tape&, const std::function<void()>&)>& bwd) {
  std::vector<Node> outer;
  outer.swap(nodes_);
  T inner_x = x;
  if (x.grad()) inner_x.id = next_id_++;  // x.detach().requires_grad_(): a new leaf on the same storage
  T y = fn(*this, inner_x);
  std::vector<Node> inner;
  inner.swap(nodes_);
  nodes_.swap(outer);
  if (!grad_enabled || !y.grad()) return y;
  const int inner_out = y.id, inner_in = inner_x.id, outer_in = x.id;
  y.id = next_id_++;
  Node n;
  if (x.grad()) n.inputs.emplace_back(x.id, x.bytes());
  n.outputs.push_back(y.id);
  n.inner = std::move(inner);
  n.recompute = [bwd, inner_out, inner_in, outer_in](Tape& tape, int out_id) {
    // Runs after the caller has moved this node's inner graph back onto the tape (see run_nodes).
    bwd(tape, [&tape, inner_out, inner_in, outer_in, out_id] {
      const size_t mark = tape.inner_mark_;
      if (tape.grads_.count(out_id)) tape.grads_[inner_out] = tape.grads_[out_id];  // borrowed, as in checkpoint()
      const bool before = tape.collect_;
      tape.collect_ = true;
      tape.run_nodes(mark);
      tape.collect_ = before;
      auto gi = tape.grads_.find(inner_in);
      if (gi != tape.grads_.end() && outer_in >= 0) {
        tape.grads_[outer_in] = gi->second;  // the input's gradient, handed to the outer graph
        tape.grads_.erase(gi);
      }
    });
  };
  nodes_.push_back(std::move(n));
  return y;
}

void Tape::backward(const T& loss) {
  grads_[loss.id] = std::make_shared<Storage>(this, loss.bytes());  // ones_like(loss): the seed
  run_nodes(0);
  grads_.clear();
}

Tape::Graph Tape::take_graph(size_t mark) {
  Graph g(std::make_move_iterator(nodes_.begin() + static_cast<std::ptrdiff_t>(mark)), std::make_move_iterator(nodes_.end()));
  nodes_.erase(nodes_.begin() + static_cast<std::ptrdiff_t>(mark), nodes_.end());
  return g;
}

std::shared_ptr<Storage> Tape::backward_graph(Graph graph, const T& out, const std::shared_ptr<Storage>& seed, const T& in) {
  const size_t mark = nodes_.size();
  for (Node& n : graph) nodes_.push_back(std::move(n));
  graph.clear();
  // The received gradient is held by the caller's variable until backward returns (torch's
  // autograd::backward with it as the grad_tensors argument).
  grads_[out.id] = seed ? seed : std::make_shared<Storage>(this, out.bytes());
  run_nodes(mark);
  std::shared_ptr<Storage> input_grad;
  if (auto g = grads_.find(in.id); in.grad() && g != grads_.end()) input_grad = g->second;
  grads_.clear();
  return input_grad;
}

void Tape::run_nodes(size_t from) {
  while (nodes_.size() > from) {
    Node n = std::move(nodes_.back());
    nodes_.pop_back();
    bool reached = false;
    for (int o : n.outputs)
      if (grads_.count(o)) reached = true;
    if (!reached) continue;  // no gradient flows here (the node and what it saved go with the graph)
    if (!n.inner.empty()) {
      inner_mark_ = nodes_.size();
      for (auto& in : n.inner) nodes_.push_back(std::move(in));
      n.inner.clear();
      n.recompute(*this, n.outputs[0]);
    } else if (n.recompute) {
      n.recompute(*this, n.outputs[0]);
    } else {
      // Gradients of the inputs: a new buffer, or a temporary added into the existing one; an
      // addition hands its output's gradient on as it is.
      std::shared_ptr<Storage> out_grad;
      if (n.passthrough && grads_.count(n.outputs[0])) out_grad = grads_[n.outputs[0]];
      for (const auto& [id, b] : n.inputs) {
        const bool alias = out_grad && out_grad->bytes == b;
        if (is_param_.count(id) && collect_) {
          alloc(b);
          collected_ += b;
        } else if (is_param_.count(id)) {
          if (param_grads_.count(id)) transient(alias ? 0 : b);
          else { alloc(b); param_grads_[id] = b; }
        } else if (auto g = grads_.find(id); g != grads_.end()) {
          // InputBuffer::accumulate: in place into a buffer of its own, else out of place.
          if (g->second.use_count() > 1) {
            if (!alias) transient(b);
            g->second = std::make_shared<Storage>(this, b);
          } else if (!alias) {
            transient(b);
          }
        } else {
          grads_[id] = alias ? out_grad : std::make_shared<Storage>(this, b);
        }
      }
      // The kernels' scratch, while the output's gradient they read is still held.
      if (n.work > 0) transient(n.work);
      out_grad.reset();
    }
    for (int o : n.outputs) grads_.erase(o);
    // n (its saved storage) is released here
  }
}

int64_t Tape::param_grad_bytes() const {
  int64_t b = 0;
  for (const auto& [id, bytes] : param_grads_) b += bytes;
  return b;
}

void Tape::free_param_grads() {
  for (const auto& [id, b] : param_grads_) release(b);
  param_grads_.clear();
}

}  // namespace trainscope::plan
