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

T Tape::op(const std::vector<const T*>& in, int64_t out, int elem, const std::vector<const T*>& saved,
           bool save_output, int64_t extra_saved, OpCost cost) {
  if (recording_cost) ++ops;
  (recording_cost ? forward_costs : recompute_costs).push_back(cost);
  bool wants = false;
  for (const T* t : in)
    if (t && t->grad()) wants = true;
  wants = wants && grad_enabled;
  T o = make(out, elem, wants);
  if (!wants) {
    if (extra_saved > 0) transient(extra_saved);
    return o;
  }
  Node n;
  for (const T* t : in)
    if (t && t->grad()) n.inputs.emplace_back(t->id, t->bytes());
  n.outputs.push_back(o.id);
  for (const T* t : saved)
    if (t && t->storage) n.saved.push_back(t->storage);
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

T Tape::checkpoint(const std::function<T(Tape&, const T&)>& fn, const T& x, const std::vector<const T*>& extras,
                   const std::vector<const T*>& params) {
  T y;
  {
    const bool before = grad_enabled;
    grad_enabled = false;  // CheckpointFunction::forward runs the block with grad mode off
    T inner = fn(*this, x);
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
  // Backward: the block re-runs with grad on (on the saved input itself: detach() shares its storage),
  // then its own nodes run with the incoming gradient as the seed; the recomputed graph goes with them.
  T x_copy = x;
  n.recompute = [fn, x_copy](Tape& tape, int out_id) {
    const bool rec = tape.recording_cost;
    tape.recording_cost = false;
    const size_t mark = tape.nodes_.size();
    T y2 = fn(tape, x_copy);
    tape.recording_cost = rec;
    auto g = tape.grads_.find(out_id);
    if (g != tape.grads_.end() && y2.grad()) {
      tape.grads_[y2.id] = g->second;  // the seed is the incoming gradient itself: no copy
      tape.grads_.erase(g);
    }
    y2 = T();
    tape.run_nodes(mark);
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
      auto g = tape.grads_.find(out_id);
      if (g != tape.grads_.end()) {
        tape.grads_[inner_out] = g->second;
        tape.grads_.erase(g);
      }
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
  alloc(loss.bytes());  // ones_like(loss): the seed
  grads_[loss.id] += loss.bytes();
  run_nodes(0);
  for (auto& [id, b] : grads_) release(b);
  grads_.clear();
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
      // Gradients of the inputs: a new buffer, or a temporary added into the existing one.
      for (const auto& [id, b] : n.inputs) {
        if (is_param_.count(id) && collect_) {
          alloc(b);
          collected_ += b;
        } else if (is_param_.count(id)) {
          if (param_grads_.count(id)) transient(b);
          else { alloc(b); param_grads_[id] = b; }
        } else if (grads_.count(id)) {
          transient(b);
        } else {
          alloc(b);
          grads_[id] = b;
        }
      }
    }
    for (int o : n.outputs) {
      auto g = grads_.find(o);
      if (g != grads_.end()) {
        release(g->second);
        grads_.erase(g);
      }
    }
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
