#include "suites/parallel/pipeline.hpp"

#include <algorithm>
#include <chrono>
#include <map>
#include <stdexcept>

namespace trainscope::suites {
namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

int64_t bytes_of(const torch::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

}  // namespace

// What a (stage, micro-batch) keeps from its forward to its backward.
struct Pipeline::Slot {
  torch::Tensor input;   // a leaf requiring its gradient (stages after the first), or the tokens
  torch::Tensor output;  // the hidden states sent on, or the loss
  // A split backward (zb-1p) between its I and its W: where the weights' backward starts from.
  torch::Tensor root, grad_out;
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

// zb-1p's I: the gradient of the stage's input alone (the graph kept for W), sent back to the previous
// stage; stage 0 has no input to differentiate and leaves everything to its W.
void Pipeline::backward_input(const pipeline::Action& a, Slot& slot, const Steps& steps, int64_t release, double* waited) {
  const int64_t last = schedule_.stages() - 1;
  if (a.stage == last) {
    slot.root = steps.objective(slot.output);
  } else {
    const int src = static_cast<int>(schedule_.rank_of(a.stage + 1));
    slot.root = slot.output;
    slot.grad_out = receive(torch::empty_like(slot.output), src, tag(a.stage, a.microbatch, true), waited);
  }
  if (a.stage == 0) return;
  const std::vector<torch::Tensor> grad_out = slot.grad_out.defined() ? std::vector<torch::Tensor>{slot.grad_out} : std::vector<torch::Tensor>{};
  torch::Tensor g = torch::autograd::grad({slot.root}, {slot.input}, grad_out, /*retain_graph=*/true)[0].contiguous();
  const int dst = static_cast<int>(schedule_.rank_of(a.stage - 1));
  sends_.push_back({g, group_->send(g, dst, tag(a.stage - 1, a.microbatch, true)), release});
  stats_.p2p_bytes += bytes_of(g);
}

// zb-1p's W: the stage's weight gradients from the kept graph, added into .grad as AccumulateGrad does
// (the first taken as it is, the later ones added in place). The graph is walked a second time (torch's
// pipelining captures the intermediate gradients instead): the same values, a second backward's time.
void Pipeline::backward_weight(const pipeline::Action& a, Slot& slot, const Steps& steps) {
  const auto [first, last] = layers_of(a.stage);
  std::vector<torch::Tensor> weights;
  for (const torch::Tensor& p : steps.weights(first, last))
    if (p.requires_grad() && p.numel() > 0) weights.push_back(p);
  const std::vector<torch::Tensor> grad_out = slot.grad_out.defined() ? std::vector<torch::Tensor>{slot.grad_out} : std::vector<torch::Tensor>{};
  const auto grads = torch::autograd::grad({slot.root}, weights, grad_out, /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (!grads[i].defined()) continue;
    torch::Tensor& g = weights[i].mutable_grad();
    if (g.defined()) g.add_(grads[i]);
    else g = grads[i].is_view() ? grads[i].clone() : grads[i];  // AccumulateGrad clones what it cannot steal
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
      backward_input(a, slots.at({a.stage, a.microbatch}), steps, release[k], &waited);
    } else if (a.op == pipeline::Op::BackwardWeight) {
      backward_weight(a, slots.at({a.stage, a.microbatch}), steps);
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
