#include "probes/step/operators.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include <ATen/record_function.h>

#include "core/stats.hpp"

namespace trainscope::probes {
namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Kinds whose self time is a kernel's, by operator name (ATen's; the backward kernels beside their
// forward ones). Anything else a leaf operator does is memory-bound work (copies, casts, adds,
// products, masks, reductions, the optimizer's passes).
const std::unordered_map<std::string, std::string>& kernel_kinds() {
  static const std::unordered_map<std::string, std::string> k{
      {"mm", "gemm"}, {"addmm", "gemm"}, {"bmm", "gemm"}, {"baddbmm", "gemm"}, {"addbmm", "gemm"},
      {"_addmm_activation", "gemm"}, {"_scaled_mm", "gemm"},
      {"mkldnn_convolution", "conv"}, {"convolution_backward", "conv"}, {"_slow_conv2d_forward", "conv"},
      {"_slow_conv2d_backward", "conv"}, {"cudnn_convolution", "conv"},
      {"gelu", "activation"}, {"gelu_backward", "activation"}, {"silu", "activation"}, {"silu_backward", "activation"},
      {"relu", "activation"}, {"relu_", "activation"}, {"threshold_backward", "activation"}, {"tanh", "activation"},
      {"tanh_backward", "activation"},
      {"_softmax", "softmax"}, {"_log_softmax", "softmax"}, {"_softmax_backward_data", "softmax"},
      {"_log_softmax_backward_data", "softmax"}, {"nll_loss_forward", "softmax"}, {"nll_loss_backward", "softmax"},
      {"native_layer_norm", "norm"}, {"native_layer_norm_backward", "norm"}, {"native_batch_norm", "norm"},
      {"native_batch_norm_backward", "norm"}, {"_native_batch_norm_legit", "norm"},
      {"_native_batch_norm_legit_no_training", "norm"}, {"_fused_rms_norm", "norm"}, {"_fused_rms_norm_backward", "norm"},
      {"bernoulli_", "random"}, {"uniform_", "random"}, {"normal_", "random"}, {"native_dropout", "random"},
  };
  return k;
}

// Operators whose own time is dispatch: views, metadata, allocation, and the composite operators
// whose work is done by the operators they call (linear by addmm, matmul by bmm and copies, ...).
const std::unordered_set<std::string>& dispatch_only() {
  static const std::unordered_set<std::string> k{
      "empty", "empty_strided", "empty_like", "resize_", "view", "_unsafe_view", "reshape", "_reshape_alias", "t",
      "transpose", "permute", "expand", "expand_as", "as_strided", "slice", "select", "unsqueeze", "squeeze", "detach",
      "alias", "lift_fresh", "unbind", "split", "split_with_sizes", "chunk", "narrow", "view_as", "contiguous", "to",
      "item", "_local_scalar_dense", "set_", "requires_grad_", "flatten", "unflatten", "result_type",
      "linear", "matmul", "layer_norm", "rms_norm", "batch_norm", "_batch_norm_impl_index",
      "_batch_norm_impl_index_backward", "conv2d", "convolution", "_convolution", "dropout", "softmax", "log_softmax",
      "cross_entropy_loss", "nll_loss", "nll_loss_nd", "scaled_dot_product_attention", "embedding", "_to_copy", "clone",
      "einsum", "zeros", "zeros_like", "ones_like", "full", "new_empty", "new_zeros", "new_empty_strided", "type_as",
      "_has_compatible_shallow_copy_type"};
  return k;
}

// The process's one set of accumulators (one cell per process): kind index per phase.
struct Accumulators {
  std::mutex mu;
  std::array<std::vector<double>, 3> self_s;
  std::array<std::vector<double>, 3> calls;
  Accumulators() {
    for (auto& v : self_s) v.assign(operator_kinds().size(), 0.0);
    for (auto& v : calls) v.assign(operator_kinds().size(), 0.0);
  }
};
Accumulators& acc() {
  static Accumulators a;
  return a;
}
std::atomic<int> g_phase{-1};  // 0 forward, 1 backward, 2 optimizer; -1: not recording

struct Frame {
  double start = 0, child = 0;
  int inherited = -1;  // inside a convolution or fused attention: their kind, whatever the operator
};
thread_local std::vector<Frame> t_stack;

size_t kind_index(const std::string& kind) {
  const auto& k = operator_kinds();
  return static_cast<size_t>(std::find(k.begin(), k.end(), kind) - k.begin());
}

std::string op_name(const at::RecordFunction& fn) {
  const std::string name = fn.name();
  return name.rfind("aten::", 0) == 0 ? name : "";  // autograd nodes and the engine's wrappers: ""
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (g_phase.load(std::memory_order_relaxed) < 0) return nullptr;
  Frame f{now_s(), 0.0, -1};
  if (!t_stack.empty() && t_stack.back().inherited >= 0) {
    f.inherited = t_stack.back().inherited;
  } else {
    // The operators a convolution or a fused attention kernel calls (im2col's mm on the slow path,
    // the math attention's bmm) are that kernel's time.
    const std::string name = op_name(fn);
    const std::string kind = name.empty() ? "dispatch" : operator_kind(name);
    if (kind == "conv" || kind == "attention") f.inherited = static_cast<int>(kind_index(kind));
  }
  t_stack.push_back(f);
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  const int phase = g_phase.load(std::memory_order_relaxed);
  if (t_stack.empty() || phase < 0) return;
  const double end = now_s();
  const Frame f = t_stack.back();
  t_stack.pop_back();
  if (!t_stack.empty()) t_stack.back().child += end - f.start;
  size_t kind = 0;
  if (f.inherited >= 0) {
    kind = static_cast<size_t>(f.inherited);
  } else {
    const std::string name = op_name(fn);
    kind = kind_index(name.empty() ? "dispatch" : operator_kind(name));
  }
  auto& a = acc();
  std::lock_guard<std::mutex> lock(a.mu);
  a.self_s[static_cast<size_t>(phase)][kind] += std::max(0.0, end - f.start - f.child);
  a.calls[static_cast<size_t>(phase)][kind] += 1;
}

}  // namespace

const std::vector<std::string>& operator_kinds() {
  static const std::vector<std::string> k{"gemm", "conv", "attention", "activation", "softmax",
                                          "norm", "random", "memory",    "dispatch"};
  return k;
}

std::string operator_kind(const std::string& name) {
  const std::string op = name.rfind("aten::", 0) == 0 ? name.substr(6) : name;
  if (auto it = kernel_kinds().find(op); it != kernel_kinds().end()) return it->second;
  if (op.rfind("_scaled_dot_product_", 0) == 0) return "attention";  // the fused kernels and their backward
  if (dispatch_only().count(op)) return "dispatch";
  return "memory";
}

OperatorTimeProbe::OperatorTimeProbe() {
  {  // one probe at a time records: a new one starts from zero
    auto& a = acc();
    std::lock_guard<std::mutex> lock(a.mu);
    for (auto& v : a.self_s) std::fill(v.begin(), v.end(), 0.0);
    for (auto& v : a.calls) std::fill(v.begin(), v.end(), 0.0);
  }
  handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&on_start, &on_end)
                                      .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}

OperatorTimeProbe::~OperatorTimeProbe() {
  g_phase = -1;
  at::removeCallback(handle_);
}

void OperatorTimeProbe::phase(const StepInfo& s, int next) {
  const double t = now_s();
  if (s.measured && next > 0) {
    const size_t p = static_cast<size_t>(next - 1);
    if (profiled_) profiled_walls_[p] += t - mark_;
    else current_[p] = t - mark_;
  }
  mark_ = t;
  g_phase = s.measured && profiled_ && next < 3 ? next : -1;
}

void OperatorTimeProbe::step_begin(const StepInfo& s) {
  // Every other measured step runs the callbacks.
  profiled_ = s.measured && s.step % 2 == 1;
  phase(s, 0);
}
void OperatorTimeProbe::forward_end(const StepInfo& s) { phase(s, 1); }
void OperatorTimeProbe::backward_end(const StepInfo& s) { phase(s, 2); }
void OperatorTimeProbe::optimizer_end(const StepInfo& s) { phase(s, 3); }
void OperatorTimeProbe::step_end(const StepInfo& s) {
  g_phase = -1;
  if (!s.measured) return;
  if (profiled_) ++profiled_steps_;
  else walls_.push_back(current_);
}

json OperatorTimeProbe::section() const {
  static const char* phases[] = {"forward", "backward", "optimizer"};
  json j{{"method", "self time per operator kind (RecordFunction) on every other measured step; phase wall times "
                    "(host clock) on the steps in between"},
         {"profiled_steps", profiled_steps_},
         {"unprofiled_steps", walls_.size()}};
  auto& a = acc();
  std::lock_guard<std::mutex> lock(a.mu);
  for (size_t p = 0; p < 3; ++p) {
    std::vector<double> w;
    for (const auto& s : walls_) w.push_back(s[p]);
    j["phase_wall_s"][phases[p]] = w.empty() ? json() : json(summarize(w).p50);
    // The profiled steps' own walls, per step: their operators ran inside them, one at a time on this
    // thread, so the self times of a phase add up to at most its wall here (by construction).
    j["profiled_phase_wall_s"][phases[p]] = profiled_walls_[p] / static_cast<double>(std::max<int64_t>(1, profiled_steps_));
    for (size_t k = 0; k < operator_kinds().size(); ++k) {
      const double n = static_cast<double>(std::max<int64_t>(1, profiled_steps_));
      j["self_s"][phases[p]][operator_kinds()[k]] = a.self_s[p][k] / n;
      j["calls"][phases[p]][operator_kinds()[k]] = a.calls[p][k] / n;
    }
  }
  return j;
}

}  // namespace trainscope::probes
