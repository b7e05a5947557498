#include "probes/numerics/overflow.hpp"

#include <algorithm>
#include <cmath>

#include <torch/torch.h>

namespace trainscope::probes {

at::Tensor fp16_range_stats(const at::Tensor& x) {
  torch::NoGradGuard no_grad;
  const auto t = x.detach();
  const double n = static_cast<double>(std::max<int64_t>(1, t.numel()));
  if (t.device().is_cpu()) {
    // One pass over the data: the sampled steps are where this probe costs anything.
    const auto c = t.contiguous();
    double absmax = 0, beyond = 0, tiny = 0;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.scalar_type(), "fp16_range_stats", [&] {
      const scalar_t* p = c.data_ptr<scalar_t>();
      // Branch-free so that the compiler vectorises it; NaN fails every comparison, so it counts as
      // out of range and is caught by `nan` for the abs-max.
      float m = 0;
      int64_t over = 0, under = 0, nan = 0;
      for (int64_t i = 0, e = c.numel(); i < e; ++i) {
        const float v = std::fabs(static_cast<float>(p[i]));
        over += !(v <= static_cast<float>(kFp16Max));
        under += (v > 0.0f) & (v < static_cast<float>(kFp16MinNormal));
        nan += v != v;
        m = v > m ? v : m;
      }
      absmax = nan > 0 ? INFINITY : m;
      beyond = static_cast<double>(over);
      tiny = static_cast<double>(under);
    });
    return torch::tensor({absmax, beyond / n, tiny / n}, torch::kFloat);
  }
  // On a GPU: tensor ops, so that nothing waits for the device.
  const auto a = t.abs();
  // NaN compares false everywhere, so count "not within range" rather than "above the maximum".
  const auto out = torch::logical_not(a <= kFp16Max).sum().to(torch::kFloat) / n;
  const auto small = torch::logical_and(a > 0, a < kFp16MinNormal).sum().to(torch::kFloat) / n;
  const auto absmax = t.numel() > 0 ? a.max().to(torch::kFloat) : torch::zeros({}, a.options().dtype(torch::kFloat));
  return torch::stack({absmax, out, small});  // a NaN abs-max is reported as inf at run end
}

at::Tensor fp8_range_stats(const at::Tensor& x, const at::Tensor& earlier_amax) {
  torch::NoGradGuard no_grad;
  const auto a = x.detach().abs().to(torch::kFloat);
  const double n = static_cast<double>(std::max<int64_t>(1, a.numel()));
  auto frac = [n](const at::Tensor& mask) { return mask.sum().to(torch::kFloat) / n; };
  const auto amax = a.numel() > 0 ? a.max() : torch::zeros({}, a.options());
  const auto nonzero = a > 0;
  // Scaled by max / amax, a value v lands below the normal range when v < min_normal * amax / max.
  auto below_at_scale = [&](double max, double min_normal) {
    return frac(torch::logical_and(nonzero, a < amax * (min_normal / max)));
  };
  const auto delayed = earlier_amax.defined() ? frac(torch::logical_not(a <= earlier_amax.to(a.device())))
                                              : torch::full({}, -1.0, a.options());
  return torch::stack({frac(torch::logical_not(a <= kE4m3Max)), frac(torch::logical_not(a <= kE5m2Max)),
                       below_at_scale(kE4m3Max, kE4m3MinNormal), below_at_scale(kE5m2Max, kE5m2MinNormal), delayed});
}

namespace {
// The abs-max of the previous sample of a block: delayed scaling's amax history of length one (at the
// probe's sampling interval, not every step).
at::Tensor earlier_amax(const std::vector<at::Tensor>& fp16_samples) {
  return fp16_samples.empty() ? at::Tensor() : fp16_samples.back().select(0, 0);
}
}  // namespace

void OverflowProbe::activation(int64_t, const std::string& block, const at::Tensor& x) {
  if (!blocks_.count(block)) block_order_.push_back(block);
  Samples& s = blocks_[block];
  s.activations_fp8.push_back(fp8_range_stats(x, earlier_amax(s.activations)));
  s.activations.push_back(fp16_range_stats(x));
}

void OverflowProbe::gradient(int64_t, const std::string& block, const at::Tensor& g) {
  if (!blocks_.count(block)) block_order_.push_back(block);
  Samples& s = blocks_[block];
  s.gradients_fp8.push_back(fp8_range_stats(g, earlier_amax(s.gradients)));
  s.gradients.push_back(fp16_range_stats(g));
}

void OverflowProbe::step_end(const StepInfo& s) {
  if (s.loss.defined()) loss_finite_.push_back(torch::isfinite(s.loss.detach()).all());
  if (s.loss_scale > 0) {
    scaled_ = true;
    if (s.loss_scale != last_scale_) scale_changes_.emplace_back(s.step, s.loss_scale);
    if (last_scale_ > 0 && s.loss_scale < last_scale_) last_backoff_ = s.step - 1;
    last_scale_ = s.loss_scale;
  }
  if (s.grads_nonfinite) {
    ++nonfinite_grad_steps_;
    if (first_overflow_ < 0) first_overflow_ = s.step;
  }
  if (s.skipped) ++skipped_;
  ++steps_;
}

void OverflowProbe::run_end(const RunEnd& e) {
  json j;
  j["steps"] = steps_;
  int64_t nonfinite_loss = 0, first_nonfinite_loss = -1;
  for (size_t i = 0; i < loss_finite_.size(); ++i)
    if (!loss_finite_[i].item<bool>()) {
      ++nonfinite_loss;
      if (first_nonfinite_loss < 0) first_nonfinite_loss = static_cast<int64_t>(i);
    }
  j["nonfinite_loss_steps"] = nonfinite_loss;
  j["first_nonfinite_loss_step"] = first_nonfinite_loss >= 0 ? json(first_nonfinite_loss) : json(nullptr);
  j["nonfinite_grad_steps"] = nonfinite_grad_steps_;
  j["skipped_steps"] = skipped_;
  j["first_overflow_step"] = first_overflow_ >= 0 ? json(first_overflow_) : json(nullptr);
  if (scaled_) {
    json traj = json::array();
    double lo = INFINITY, hi = 0;
    for (const auto& [step, scale] : scale_changes_) {
      traj.push_back({step, scale});
      lo = std::min(lo, scale);
      hi = std::max(hi, scale);
    }
    j["scale_trajectory"] = traj;  // the scale each step used, at every step where it changed
    j["min_scale"] = lo;
    j["max_scale"] = hi;
    j["final_scale"] = last_scale_;
    // Settled: the first step after the last back-off; a scale that never backed off settled at 0.
    j["scale_settled_step"] = last_backoff_ >= 0 ? last_backoff_ + 1 : 0;
    // Collapse: the scale fell to 1 or below, so it no longer lifts small gradients out of underflow.
    j["scale_collapsed"] = lo <= 1.0;
  } else {
    j["scale_trajectory"] = nullptr;
  }

  json layers = json::array();
  json overflow_blocks = json::array(), underflow_blocks = json::array();
  auto summarize = [](const std::vector<at::Tensor>& samples) -> json {
    if (samples.empty()) return nullptr;
    const auto all = torch::stack(samples).to(torch::kCPU);  // [n, 3]
    const auto absmax = torch::nan_to_num(all.select(1, 0), std::numeric_limits<double>::infinity());
    return json{{"absmax", absmax.max().item<double>()},
                {"frac_beyond_fp16", all.select(1, 1).mean().item<double>()},
                {"frac_below_fp16_normal", all.select(1, 2).mean().item<double>()},
                {"samples", samples.size()}};
  };
  auto summarize_fp8 = [](const std::vector<at::Tensor>& samples) -> json {
    if (samples.empty()) return nullptr;
    const auto all = torch::stack(samples).to(torch::kCPU);  // [n, 5]
    const auto delayed = all.select(1, 4);
    const auto have = delayed >= 0;  // the first sample has no earlier amax
    return json{{"frac_beyond_e4m3", all.select(1, 0).mean().item<double>()},
                {"frac_beyond_e5m2", all.select(1, 1).mean().item<double>()},
                {"frac_below_e4m3_normal_at_amax_scale", all.select(1, 2).mean().item<double>()},
                {"frac_below_e5m2_normal_at_amax_scale", all.select(1, 3).mean().item<double>()},
                {"frac_beyond_range_delayed_scaling",
                 have.any().item<bool>() ? json(delayed.masked_select(have).mean().item<double>()) : json(nullptr)}};
  };
  json fp8_blocks = json::array();
  for (const auto& name : block_order_) {
    const Samples& s = blocks_.at(name);
    const json act = summarize(s.activations), grad = summarize(s.gradients);
    json fp8{{"activation", summarize_fp8(s.activations_fp8)}, {"gradient", summarize_fp8(s.gradients_fp8)}};
    layers.push_back({{"block", name}, {"activation", act}, {"gradient", grad}, {"fp8", fp8}});
    // fp8 risk: activations (e4m3) or gradients (e5m2) with >= 1% of non-zeros under the normal range at
    // the amax scale, or any value past the range under delayed scaling.
    auto risky = [](const json& v, const char* below) {
      if (v.is_null()) return false;
      const json& d = v["frac_beyond_range_delayed_scaling"];
      return v[below].get<double>() >= 0.01 || (d.is_number() && d.get<double>() > 0);
    };
    if (risky(fp8["activation"], "frac_below_e4m3_normal_at_amax_scale") ||
        risky(fp8["gradient"], "frac_below_e5m2_normal_at_amax_scale"))
      fp8_blocks.push_back(name);
    auto over = [](const json& v) { return !v.is_null() && v["frac_beyond_fp16"].get<double>() > 0; };
    auto under = [](const json& v) { return !v.is_null() && v["frac_below_fp16_normal"].get<double>() >= 0.01; };
    if (over(act) || over(grad)) overflow_blocks.push_back(name);
    if (under(grad)) underflow_blocks.push_back(name);
  }
  j["sample_every"] = every_;
  j["layers"] = layers;
  j["overflow_blocks"] = overflow_blocks;    // any sampled value beyond fp16's range
  j["underflow_blocks"] = underflow_blocks;  // >= 1% of gradients below fp16's normal range
  j["fp8_risk_blocks"] = fp8_blocks;  // e4m3 activations / e5m2 gradients losing values at amax scaling
  j["thresholds"] = {{"fp16_max", kFp16Max}, {"fp16_min_normal", kFp16MinNormal}, {"underflow_block_frac", 0.01},
                     {"e4m3_max", kE4m3Max}, {"e4m3_min_normal", kE4m3MinNormal}, {"e5m2_max", kE5m2Max},
                     {"e5m2_min_normal", kE5m2MinNormal}};
  section_ = j;
}

}  // namespace trainscope::probes
