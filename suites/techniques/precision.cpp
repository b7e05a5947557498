#include "suites/techniques/precision.hpp"

#include <algorithm>
#include <deque>
#include <map>

#include <cmath>


namespace trainscope::suites {

at::ScalarType scalar_type(const std::string& dtype) {
  if (dtype == "fp64") return at::kDouble;
  if (dtype == "bf16") return at::kBFloat16;
  if (dtype == "fp16") return at::kHalf;
  if (dtype == "fp8") return at::kFloat8_e4m3fn;
  return at::kFloat;  // fp32, tf32 (a GEMM mode of fp32 storage)
}

PrecisionMode precision_mode(const std::string& precision, const std::string& device, const std::string& fp16,
                             const std::string& reduce) {
  const PrecisionTraits& t = precision_traits(precision);
  const bool cuda = device.rfind("cuda", 0) == 0;
  PrecisionMode m;
  m.name = precision;
  m.param_dtype = scalar_type(t.params);
  m.master = !t.master.empty();
  m.reduce_dtype = scalar_type(m.master ? reduce : t.reduce);
  m.fp16 = t.fp16;
  m.scaler = t.loss_scaler;
  m.emulated = fp16_emulated(t, cuda, fp16);
  m.autocast = !t.autocast.empty() && !m.emulated;
  if (!t.autocast.empty()) m.autocast_dtype = scalar_type(t.autocast);
  m.fp8 = t.fp8_linear;
  return m;
}

namespace {

constexpr double kE4m3Max = 448.0;
constexpr size_t kAmaxHistory = 16;

// The amax history of each tensor that passes through fp8, keyed by the layer's weight (input and
// weight have a history each). Lives as long as the process: a cell is one process.
struct Fp8State {
  bool enabled = false, delayed = false;
  std::map<const void*, std::deque<double>> history;
  int64_t fp8_layers = 0, bf16_layers = 0;
};
Fp8State& fp8_state() {
  static Fp8State s;
  return s;
}

// The scale that maps the (current or remembered) amax onto e4m3's largest value. Delayed scaling
// reads the amax on the host, as the history must: one sync per tensor, the price of the option.
torch::Tensor fp8_scale(const torch::Tensor& x, const void* key, int slot) {
  const torch::Tensor amax = x.abs().max().to(torch::kFloat).clamp_min(1e-12);
  Fp8State& st = fp8_state();
  if (!st.delayed) return (kE4m3Max / amax).reshape({});
  auto& h = st.history[static_cast<const char*>(key) + slot];
  const double now = amax.item<double>();
  const double past = h.empty() ? now : *std::max_element(h.begin(), h.end());
  h.push_back(now);
  if (h.size() > kAmaxHistory) h.pop_front();
  return torch::full({}, kE4m3Max / past, x.options().dtype(torch::kFloat));
}

struct Fp8Linear : public torch::autograd::Function<Fp8Linear> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& b) {
    const int64_t K = w.size(1), N = w.size(0);
    const torch::Tensor x2 = x.reshape({-1, K}).contiguous();
    const torch::Tensor sx = fp8_scale(x2, w.unsafeGetTensorImpl(), 0), sw = fp8_scale(w, w.unsafeGetTensorImpl(), 1);
    // Saturate rather than overflow: delayed scaling can meet a value above the remembered amax.
    auto quantise = [](const torch::Tensor& t, const torch::Tensor& s) {
      return (t.to(torch::kFloat) * s).clamp(-kE4m3Max, kE4m3Max).to(torch::kFloat8_e4m3fn);
    };
    const torch::Tensor x8 = quantise(x2, sx), w8 = quantise(w, sw);
    // _scaled_mm wants the second operand column-major: w8 is [N, K] row-major, so w8.t() is.
    std::optional<torch::Tensor> bias;
    if (b.defined()) bias = b.to(torch::kBFloat16);
    torch::Tensor y = at::_scaled_mm(x8, w8.t(), sx.reciprocal(), sw.reciprocal(), bias, std::nullopt, torch::kBFloat16);
    ctx->save_for_backward({x2.to(torch::kBFloat16), w});
    ctx->saved_data["has_bias"] = b.defined();
    auto sizes = x.sizes().vec();
    sizes.back() = N;
    return y.view(sizes);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& w = saved[1];
    auto grads = fp8_linear_backward(g[0].reshape({-1, w.size(0)}), saved[0], w, ctx->saved_data["has_bias"].toBool());
    auto gx_sizes = g[0].sizes().vec();
    gx_sizes.back() = w.size(1);
    return {grads[0].view(gx_sizes), grads[1], grads[2]};
  }
};

struct RoundFp16 : public torch::autograd::Function<RoundFp16> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) {
    return x.to(at::kHalf).to(x.scalar_type());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    return {g[0].to(at::kHalf).to(g[0].scalar_type())};
  }
};

}  // namespace

Fp8Scope::Fp8Scope(bool enabled, bool delayed) {
  fp8_state().enabled = enabled;
  fp8_state().delayed = delayed;
}
Fp8Scope::~Fp8Scope() { fp8_state().enabled = false; }

std::vector<torch::Tensor> fp8_linear_backward(const torch::Tensor& g, const torch::Tensor& x2, const torch::Tensor& w, bool bias) {
  const torch::Tensor g2 = g.to(torch::kBFloat16), wb = w.to(torch::kBFloat16);
  return {torch::mm(g2, wb), torch::mm(g2.t(), x2).to(w.scalar_type()), bias ? g2.sum(0).to(w.scalar_type()) : torch::Tensor()};
}

bool project_runs_fp8(const torch::Tensor& x, const torch::Tensor& w) {
  return fp8_state().enabled && x.is_cuda() && w.size(0) % 16 == 0 && w.size(1) % 16 == 0;
}

torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  Fp8State& st = fp8_state();
  if (!st.enabled || !x.is_cuda()) return torch::linear(x, w, b);
  if (w.size(0) % 16 != 0 || w.size(1) % 16 != 0) {
    ++st.bf16_layers;
    return torch::linear(x, w, b);
  }
  ++st.fp8_layers;
  return Fp8Linear::apply(x, w, b.defined() ? b : torch::Tensor());
}

std::pair<int64_t, int64_t> fp8_layer_counts() { return {fp8_state().fp8_layers, fp8_state().bf16_layers}; }

torch::Tensor round_through_fp16(const torch::Tensor& x) { return RoundFp16::apply(x); }

void Fp16WeightRounding::round() {
  torch::NoGradGuard no_grad;
  if (masters_.empty())
    for (const auto& p : params_) masters_.push_back(torch::empty_like(p));
  for (size_t i = 0; i < params_.size(); ++i) {
    masters_[i].copy_(params_[i]);
    params_[i].copy_(params_[i].to(at::kHalf));
  }
}

void Fp16WeightRounding::restore() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].copy_(masters_[i]);
    auto& g = params_[i].mutable_grad();
    if (g.defined()) g.copy_(g.to(at::kHalf));
  }
}

GradScaler::GradScaler(ScalerOptions o, torch::Device device) : o_(o) {
  auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(device);
  scale_ = torch::full({1}, o.init_scale, f32);
  tracker_ = torch::zeros({1}, torch::TensorOptions().dtype(torch::kInt).device(device));
  found_inf_ = torch::zeros({1}, f32);
}

bool GradScaler::unscale(const std::vector<torch::Tensor>& params) {
  torch::NoGradGuard no_grad;
  found_inf_.zero_();
  const auto inv_scale = scale_.to(torch::kDouble).reciprocal().to(torch::kFloat);
  std::vector<torch::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  // PyTorch's own kernels (CPU and CUDA): multiply by the fp32 reciprocal, flag any inf/NaN.
  at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf_, inv_scale);
  if (reduce_found_inf) reduce_found_inf(found_inf_);
  return found_inf_.item<float>() > 0;
}

void GradScaler::update(bool found_inf) {
  found_inf_.fill_(found_inf ? 1.0 : 0.0);
  at::_amp_update_scale_(scale_, tracker_, found_inf_, o_.growth_factor, o_.backoff_factor,
                         static_cast<int64_t>(o_.growth_interval));
}

double scheduled_lr(const std::string& schedule, double base_lr, int64_t applied_step, int64_t total_steps) {
  if (schedule != "cosine" || total_steps <= 0) return base_lr;
  const double progress = std::min(1.0, static_cast<double>(applied_step) / static_cast<double>(total_steps));
  return base_lr * 0.5 * (1.0 + std::cos(M_PI * progress));
}

}  // namespace trainscope::suites
