#include "suites/parallel/pipeline.hpp"

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <set>
#include <stdexcept>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

namespace trainscope::suites {
namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

int64_t bytes_of(const torch::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

using torch::autograd::Node;
using NodeSet = std::set<Node*>;

// The node a tensor's gradient flows into: its grad_fn, or a leaf's gradient accumulator.
std::shared_ptr<Node> node_of(const torch::Tensor& t) {
  return t.grad_fn() ? t.grad_fn() : torch::autograd::impl::grad_accumulator(t);
}

// The graph under a root, reversed: for each node, the nodes whose next edges lead to it (and who owns it).
struct ReverseGraph {
  std::map<Node*, std::vector<Node*>> into;
  std::map<Node*, std::shared_ptr<Node>> owner;
};
ReverseGraph reverse_graph(const std::shared_ptr<Node>& root) {
  ReverseGraph g;
  g.owner[root.get()] = root;
  std::deque<Node*> queue{root.get()};
  while (!queue.empty()) {
    Node* n = queue.front();
    queue.pop_front();
    for (const auto& e : n->next_edges()) {
      if (!e.function) continue;
      g.into[e.function.get()].push_back(n);
      if (g.owner.emplace(e.function.get(), e.function).second) queue.push_back(e.function.get());
    }
  }
  return g;
}

// Walking the reverse edges from `from` towards the root: the nodes passed, and those of `stop` met
// (where the walk ends). torch's pipelining/_backward.py: reverse_closure.
std::pair<NodeSet, NodeSet> reverse_closure(Node* from, const NodeSet& stop, const ReverseGraph& g) {
  NodeSet closure{from}, met;
  std::deque<Node*> queue{from};
  while (!queue.empty()) {
    Node* n = queue.front();
    queue.pop_front();
    const auto it = g.into.find(n);
    if (it == g.into.end()) continue;
    for (Node* up : it->second) {
      if (closure.count(up)) continue;
      if (stop.count(up)) {
        met.insert(up);
        continue;
      }
      closure.insert(up);
      queue.push_back(up);
    }
  }
  return {closure, met};
}

// Leaves joined when their meets overlap (torch's param groups: a checkpointed or sharded block's weights
// all meet its one node): per group, its leaves and its meets (indices).
std::vector<std::pair<std::vector<size_t>, std::set<size_t>>> leaf_groups(const std::vector<std::vector<size_t>>& meets_of) {
  std::vector<size_t> parent(meets_of.size());
  for (size_t i = 0; i < parent.size(); ++i) parent[i] = i;
  const auto find = [&](size_t i) {
    while (parent[i] != i) i = parent[i] = parent[parent[i]];
    return i;
  };
  std::map<size_t, size_t> first_with;  // meet -> the first leaf that has it
  for (size_t l = 0; l < meets_of.size(); ++l)
    for (size_t m : meets_of[l])
      if (auto [it, fresh] = first_with.emplace(m, l); !fresh) parent[find(l)] = find(it->second);
  std::map<size_t, std::pair<std::vector<size_t>, std::set<size_t>>> groups;
  for (size_t l = 0; l < meets_of.size(); ++l) {
    auto& g = groups[find(l)];
    g.first.push_back(l);
    g.second.insert(meets_of[l].begin(), meets_of[l].end());
  }
  std::vector<std::pair<std::vector<size_t>, std::set<size_t>>> out;
  for (auto& [root, g] : groups) out.push_back(std::move(g));
  return out;
}

// Keeps the gradients flowing into a node the first time it runs (zb-1p's I), for W to start from.
struct CaptureGradients : torch::autograd::FunctionPreHook {
  explicit CaptureGradients(std::shared_ptr<std::vector<torch::Tensor>> into) : into(std::move(into)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (into->empty()) *into = grads;
    return grads;
  }
  std::shared_ptr<std::vector<torch::Tensor>> into;
};

}  // namespace

// What a (stage, micro-batch) keeps from its forward to its backward.
struct Pipeline::Slot {
  torch::Tensor input;   // a leaf requiring its gradient (stages after the first), or the tokens
  torch::Tensor output;  // the hidden states sent on, or the loss
  // A split backward (zb-1p) between its I and its W: the root and the gradient it starts from, the nodes
  // where the input's path meets the leaves' (with the gradients I passed into them), and the leaves in
  // groups, each with its meets (indices into `meets`).
  torch::Tensor root, grad_out;
  std::vector<std::pair<std::shared_ptr<Node>, std::shared_ptr<std::vector<torch::Tensor>>>> meets;
  std::vector<std::pair<std::vector<std::shared_ptr<Node>>, std::set<size_t>>> groups;
};

std::vector<Batch> split_microbatches(const Batch& b, int64_t m) {
  std::vector<Batch> out;
  const int64_t n = b.input.size(0) / m;
  for (int64_t i = 0; i < m; ++i) {
    Batch mb = b;
    mb.input = b.input.narrow(0, i * n, n);
    mb.target = b.target.narrow(0, i * n, n);
    out.push_back(mb);
  }
  return out;
}

Pipeline::Pipeline(pipeline::Schedule schedule, Communicator* group, int64_t layers)
    : schedule_(std::move(schedule)), group_(group), layers_(layers), rank_(group ? group->rank() : 0) {
  release_ = pipeline::send_release(schedule_);  // a table that would deadlock fails here, before any rank waits
}

// zb-1p's I: the gradient of the stage's input alone, sent back to the previous stage, or left in its slot
// (`previous`) when this rank holds it. As torch's stage_backward_input: the graph is kept, and the
// gradients flowing into the nodes where a weight's path meets the input's are kept for W, so that W
// runs only the weights' part. Stage 0 has no input to differentiate and leaves everything to its W.
void Pipeline::backward_input(const pipeline::Action& a, Slot& slot, Slot* previous, const Steps& steps, int64_t release, double* waited) {
  const int64_t last = schedule_.stages() - 1;
  if (a.stage == last) {
    slot.root = steps.objective(slot.output);
  } else {
    const int src = static_cast<int>(schedule_.rank_of(a.stage + 1));
    slot.root = slot.output;
    // From the next stage's I on this rank, which left it here (one rank, several stages), else received.
    if (src != rank_) slot.grad_out = receive(torch::empty_like(slot.output), src, tag(a.stage, a.microbatch, true), waited);
  }
  if (a.stage == 0) return;
  const std::vector<torch::autograd::FunctionPreHook*> hooks = capture_meets(slot);
  const std::vector<torch::Tensor> grad_out = slot.grad_out.defined() ? std::vector<torch::Tensor>{slot.grad_out} : std::vector<torch::Tensor>{};
  torch::Tensor g = torch::autograd::grad({slot.root}, {slot.input}, grad_out, /*retain_graph=*/true)[0].contiguous();
  for (size_t i = 0; i < slot.meets.size(); ++i) {  // W runs these nodes again: captured once is enough
    auto& pre = slot.meets[i].first->pre_hooks();
    pre.erase(std::remove_if(pre.begin(), pre.end(), [&](const auto& h) { return h.get() == hooks[i]; }), pre.end());
  }
  if (previous) {
    previous->grad_out = g;
    return;
  }
  const int dst = static_cast<int>(schedule_.rank_of(a.stage - 1));
  sends_.push_back({g, group_->send(g, dst, tag(a.stage - 1, a.microbatch, true)), release});
  stats_.p2p_bytes += bytes_of(g);
}

// Finds where the stage's leaves (the weights, or the shards a sharded block takes its gradient into:
// every gradient accumulator under the root but the input's) meet the input's path, as torch's
// get_param_groups does: walking back from a leaf towards the root, the first nodes that also lead to the
// input. Groups the leaves that share a meet and hooks each meet to keep what I passes into it.
std::vector<torch::autograd::FunctionPreHook*> Pipeline::capture_meets(Slot& slot) const {
  const ReverseGraph g = reverse_graph(node_of(slot.root));
  Node* input = node_of(slot.input).get();
  const NodeSet input_path = reverse_closure(input, {}, g).first;
  std::vector<std::shared_ptr<Node>> leaves;
  std::vector<std::vector<size_t>> meets_of;
  std::map<Node*, size_t> index;
  std::vector<torch::autograd::FunctionPreHook*> hooks;
  for (const auto& [node, owner] : g.owner) {
    if (node == input || !dynamic_cast<torch::autograd::AccumulateGrad*>(node)) continue;
    leaves.push_back(owner);
    std::vector<size_t>& mine = meets_of.emplace_back();
    for (Node* meet : reverse_closure(node, input_path, g).second) {
      auto [it, fresh] = index.emplace(meet, slot.meets.size());
      mine.push_back(it->second);
      if (!fresh) continue;
      auto into = std::make_shared<std::vector<torch::Tensor>>();
      auto hook = std::make_unique<CaptureGradients>(into);
      hooks.push_back(hook.get());
      meet->add_pre_hook(std::move(hook));
      slot.meets.emplace_back(g.owner.at(meet), into);
    }
    // The root leads to the input, so every walk back from a leaf ends at a meet at the latest there;
    // one that does not would leave its gradient out of W.
    if (mine.empty()) throw std::logic_error("pipeline: a weight of this stage never meets its input's path (zb-1p's W would miss it)");
  }
  for (auto& [members, meets] : leaf_groups(meets_of)) {
    auto& group = slot.groups.emplace_back();
    for (size_t l : members) group.first.push_back(leaves[l]);
    group.second = std::move(meets);
  }
  // In the order one backward reaches them (the latest-made node first), the same on every rank: a
  // group's W may hold a collective (sequence parallelism's norm weights sum their gradient over tp),
  // which the tp ranks must issue in one order.
  const auto latest = [&](const std::set<size_t>& meets) {
    uint64_t top = 0;
    for (size_t m : meets) top = std::max(top, slot.meets[m].first->sequence_nr());
    return top;
  };
  std::stable_sort(slot.groups.begin(), slot.groups.end(), [&](const auto& a, const auto& b) { return latest(a.second) > latest(b.second); });
  return hooks;
}

// zb-1p's W: the stage's weight gradients, accumulated into the leaves as one backward does (their
// AccumulateGrad nodes, or a sharded block's reduction). Per group of leaves, from its meets with the
// gradients I passed into them (torch's stage_backward_weight): only the weights' part of the backward,
// the same kernels on the same gradients as one backward; from one group's meets alone, since from every
// meet at once one would pass its gradient into another again. The graph is kept until the slot goes.
// The first stage (no input gradient) runs its whole backward here.
void Pipeline::backward_weight(const pipeline::Action& a, Slot& slot) {
  const std::vector<torch::Tensor> grad_out = slot.grad_out.defined() ? std::vector<torch::Tensor>{slot.grad_out} : std::vector<torch::Tensor>{};
  if (a.stage == 0) {
    torch::autograd::backward({slot.root}, grad_out);
    return;
  }
  for (const auto& [leaves, meets] : slot.groups) {
    torch::autograd::edge_list roots, outputs;
    std::vector<torch::Tensor> flowing;
    for (size_t m : meets) {
      const auto& [node, into] = slot.meets[m];
      for (size_t k = 0; k < into->size(); ++k)
        if ((*into)[k].defined()) roots.emplace_back(node, static_cast<uint32_t>(k)), flowing.push_back((*into)[k]);
    }
    if (roots.empty()) continue;
    for (const auto& leaf : leaves) outputs.emplace_back(leaf, 0);
    torch::autograd::Engine::get_default_engine().execute(roots, flowing, /*keep_graph=*/true, /*create_graph=*/false,
                                                          /*accumulate_grad=*/true, outputs);
  }
}

void Pipeline::complete_sends(int64_t after) {
  std::vector<Send> pending;
  for (Send& s : sends_) {
    if (after >= 0 && s.release != after) {
      pending.push_back(std::move(s));
      continue;
    }
    const double t0 = now_s();
    s.work->wait();
    if (group_->backend() == "gloo") release_on_this_thread(s.work);
    group_->report(CollectiveInfo{"send", bytes_of(s.tensor), 2, now_s() - t0, 0.0, group_->step(), 0.0, "", ""});
  }
  sends_ = std::move(pending);
}

std::pair<int64_t, int64_t> Pipeline::layers_of(int64_t stage) const {
  if (schedule_.cuts.empty()) return pipeline::stage_layers(layers_, schedule_.stages()).at(static_cast<size_t>(stage));
  return schedule_.cuts.at(static_cast<size_t>(stage));
}

std::vector<int64_t> Pipeline::my_stages() const {
  std::vector<int64_t> out;
  for (int64_t s = 0; s < schedule_.stages(); ++s)
    if (holds_stage(s)) out.push_back(s);
  return out;
}

// Distinct per (stage, micro-batch, direction) and the same on both ends of a transfer.
int Pipeline::tag(int64_t stage, int64_t mb, bool backward) const {
  return static_cast<int>((stage * schedule_.microbatches + mb) * 2 + (backward ? 1 : 0));
}

torch::Tensor Pipeline::receive(torch::Tensor into, int src, int tag, double* waited) {
  const double t0 = now_s();
  group_->recv(into, src, tag)->wait();  // gives up after the group's timeout
  const double dt = now_s() - t0;
  *waited += dt;
  stats_.p2p_bytes += bytes_of(into);
  group_->report(CollectiveInfo{"recv", bytes_of(into), 2, dt, dt, group_->step(), 0.0, "", ""});
  return into;
}

torch::Tensor Pipeline::run(const Batch& batch, const Steps& steps) {
  const auto& sched = schedule_;
  const std::vector<Batch> mbs = split_microbatches(batch, sched.microbatches);
  std::map<std::pair<int64_t, int64_t>, Slot> slots;
  stats_ = {};
  torch::Tensor loss_sum;
  int64_t held = 0;
  const int64_t last = sched.stages() - 1;
  const double start = now_s();
  const std::vector<pipeline::Action>& actions = sched.actions.at(static_cast<size_t>(rank_));
  const std::vector<int64_t>& release = release_.at(static_cast<size_t>(rank_));
  for (size_t k = 0; k < actions.size(); ++k) {
    const pipeline::Action& a = actions[k];
    const double t0 = now_s();
    double waited = 0;
    const Batch& mb = mbs.at(static_cast<size_t>(a.microbatch));
    const auto [first_layer, last_layer] = layers_of(a.stage);
    if (a.op == pipeline::Op::Forward) {
      Slot& slot = slots[{a.stage, a.microbatch}];
      if (a.stage == 0) {
        slot.input = mb.input;
      } else {
        const int src = static_cast<int>(sched.rank_of(a.stage - 1));
        torch::Tensor in = src == rank_ ? slots.at({a.stage - 1, a.microbatch}).output.detach()
                                        : receive(steps.boundary_like(mb), src, tag(a.stage, a.microbatch, false), &waited);
        slot.input = in.requires_grad_(true);
      }
      slot.output = steps.forward(slot.input, first_layer, last_layer, mb);
      if (a.stage == last) {
        loss_sum = loss_sum.defined() ? loss_sum + slot.output.detach() : slot.output.detach();
      } else if (const int dst = static_cast<int>(sched.rank_of(a.stage + 1)); dst != rank_) {
        const torch::Tensor like = steps.boundary_like(mb);
        if (slot.output.sizes() != like.sizes() || slot.output.scalar_type() != like.scalar_type())
          throw std::logic_error("pipeline: stage " + std::to_string(a.stage) + "'s output is not the boundary's shape and dtype");
        torch::Tensor out = slot.output.detach().contiguous();
        sends_.push_back({out, group_->send(out, dst, tag(a.stage + 1, a.microbatch, false)), release[k]});
        stats_.p2p_bytes += bytes_of(out);
      }
      stats_.peak_in_flight = std::max(stats_.peak_in_flight, ++held);
    } else if (a.op == pipeline::Op::BackwardInput) {
      const bool local = a.stage > 0 && sched.rank_of(a.stage - 1) == rank_;
      backward_input(a, slots.at({a.stage, a.microbatch}), local ? &slots.at({a.stage - 1, a.microbatch}) : nullptr, steps, release[k], &waited);
    } else if (a.op == pipeline::Op::BackwardWeight) {
      backward_weight(a, slots.at({a.stage, a.microbatch}));
      slots.erase({a.stage, a.microbatch});
      --held;
    } else {
      Slot& slot = slots.at({a.stage, a.microbatch});
      if (a.stage == last) {
        steps.objective(slot.output).backward();
      } else {
        const int src = static_cast<int>(sched.rank_of(a.stage + 1));
        torch::Tensor grad = src == rank_ ? slots.at({a.stage + 1, a.microbatch}).input.grad()
                                          : receive(torch::empty_like(slot.output), src, tag(a.stage, a.microbatch, true), &waited);
        torch::autograd::backward({slot.output}, {grad});
      }
      if (a.stage > 0) {
        if (const int dst = static_cast<int>(sched.rank_of(a.stage - 1)); dst != rank_) {
          torch::Tensor g = slot.input.grad().contiguous();
          sends_.push_back({g, group_->send(g, dst, tag(a.stage - 1, a.microbatch, true)), release[k]});
          stats_.p2p_bytes += bytes_of(g);
        }
      }
      if (a.stage == 0 || sched.rank_of(a.stage - 1) != rank_) slots.erase({a.stage, a.microbatch});
      else slot.output = torch::Tensor();  // the previous stage on this rank still reads this input's gradient
      --held;
    }
    const double t1 = now_s();
    complete_sends(static_cast<int64_t>(k));  // received already: at most the last bytes in transit
    waited += now_s() - t1;
    stats_.wait_s += waited;
    stats_.compute_s += now_s() - t0 - waited;
  }
  // The rest complete once their receivers have them: at the latest when the neighbours end their step
  // (their timeout bounds a neighbour that died).
  complete_sends(-1);
  stats_.span_s = now_s() - start;
  if (!loss_sum.defined()) return loss_sum;
  return loss_sum / static_cast<double>(sched.microbatches);
}

}  // namespace trainscope::suites
