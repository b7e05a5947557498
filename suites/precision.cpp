#include "suites/precision.hpp"

#include <cmath>

#include "core/errors.hpp"

namespace trainscope::suites {

PrecisionMode precision_mode(const std::string& precision, const std::string& device, const std::string& fp16) {
  const bool cuda = device.rfind("cuda", 0) == 0;
  PrecisionMode m;
  m.name = precision;
  if (precision == "32-true" || precision == "tf32") return m;
  if (precision == "64-true") {
    m.param_dtype = at::kDouble;
  } else if (precision == "bf16-mixed") {
    m.autocast = true;
    m.autocast_dtype = at::kBFloat16;
  } else if (precision == "16-mixed" || precision == "16-mixed-noscale") {
    m.fp16 = true;
    m.scaler = precision == "16-mixed";
    // CPU fp16 GEMMs without AVX512-FP16 run ~100x slower than fp32, so by default the CPU computes
    // in fp32 and rounds through fp16 where fp16 autocast would hold fp16 values; `fp16 = autocast`
    // runs the real kernels (the emulation is tested against them).
    m.emulated = !cuda && fp16 != "autocast";
    m.autocast = !m.emulated;
    m.autocast_dtype = at::kHalf;
  } else if (precision == "bf16-true") {
    m.param_dtype = at::kBFloat16;
  } else {
    throw UsageError("unknown precision '" + precision + "'");
  }
  return m;
}

namespace {

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
