#include "suites/ssl/augment.hpp"

#include <cmath>

#include "suites/models/data.hpp"

namespace trainscope::suites::ssl {

ViewRecipe simclr_view() { return {}; }

ViewRecipe byol_view(int which) {
  ViewRecipe r;
  r.solarize = which == 0 ? 0.0 : 0.2;
  return r;
}

ViewRecipe mae_view() {
  ViewRecipe r;
  r.jitter = 0.0;
  return r;
}

namespace {

// The views of `images` under `r`, with a per-image solarisation probability (`solarize`, [B]).
torch::Tensor render(const torch::Tensor& images, const ViewRecipe& r, const torch::Tensor& solarize, at::Generator& gen) {
  torch::NoGradGuard no_grad;
  const int64_t B = images.size(0);
  const auto cpu = torch::TensorOptions().dtype(torch::kFloat);
  // Every draw for the batch at once, on the CPU generator: [B, 8] uniforms.
  const torch::Tensor u = torch::rand({B, 8}, gen, cpu);
  const torch::Tensor area = r.crop_min + (r.crop_max - r.crop_min) * u.select(1, 0);
  const double log_lo = std::log(3.0 / 4.0), log_hi = std::log(4.0 / 3.0);
  const torch::Tensor aspect = torch::exp(log_lo + (log_hi - log_lo) * u.select(1, 1));
  // Crop width and height as fractions of the side; the centre keeps the crop inside the image.
  const torch::Tensor w = torch::sqrt(area * aspect).clamp_max(1.0), h = torch::sqrt(area / aspect).clamp_max(1.0);
  const torch::Tensor cx = (1 - w) * (2 * u.select(1, 2) - 1), cy = (1 - h) * (2 * u.select(1, 3) - 1);
  const torch::Tensor sign = torch::where(u.select(1, 4) < r.flip, -torch::ones_like(w), torch::ones_like(w));
  const torch::Tensor zero = torch::zeros_like(w);
  const torch::Tensor theta = torch::stack({torch::stack({w * sign, zero, cx}, 1), torch::stack({zero, h, cy}, 1)}, 1);

  // In pixel space [0, 1], where the background is 0 and solarisation's threshold means something.
  torch::Tensor px = images.to(torch::kFloat) * kPixelStd + kPixelMean;
  const auto grid = torch::nn::functional::affine_grid(theta.to(px.device()), px.sizes().vec(), /*align_corners=*/false);
  px = torch::nn::functional::grid_sample(
      px, grid, torch::nn::functional::GridSampleFuncOptions().mode(torch::kBilinear).padding_mode(torch::kZeros).align_corners(false));
  const auto per_image = [&](const torch::Tensor& v) { return v.to(px.device()).view({B, 1, 1, 1}); };
  if (r.jitter > 0) {
    const torch::Tensor on = per_image((u.select(1, 5) < r.jitter).to(torch::kFloat));
    const torch::Tensor b = per_image(1 + r.brightness * (2 * u.select(1, 6) - 1));
    const torch::Tensor c = per_image(1 + r.contrast * (2 * u.select(1, 7) - 1));
    torch::Tensor jittered = (px * b).clamp(0, 1);
    const torch::Tensor mean = jittered.mean({1, 2, 3}, /*keepdim=*/true);
    jittered = ((jittered - mean) * c + mean).clamp(0, 1);
    px = on * jittered + (1 - on) * px;
  }
  if (solarize.max().item<double>() > 0) {
    const torch::Tensor on = per_image(torch::rand({B}, gen, cpu) < solarize);
    px = torch::where(torch::logical_and(on, px >= 0.5), 1 - px, px);
  }
  return ((px - kPixelMean) / kPixelStd).to(images.scalar_type());
}

}  // namespace

torch::Tensor make_view(const torch::Tensor& images, const ViewRecipe& r, at::Generator& gen) {
  return render(images, r, torch::full({images.size(0)}, r.solarize), gen);
}

torch::Tensor make_views(const torch::Tensor& images, const ViewRecipe& a, const ViewRecipe& b, at::Generator& gen) {
  const bool same = a.crop_min == b.crop_min && a.crop_max == b.crop_max && a.flip == b.flip && a.jitter == b.jitter &&
                    a.brightness == b.brightness && a.contrast == b.contrast;
  if (!same) return torch::cat({make_view(images, a, gen), make_view(images, b, gen)});
  const int64_t B = images.size(0);
  return render(torch::cat({images, images}), a, torch::cat({torch::full({B}, a.solarize), torch::full({B}, b.solarize)}), gen);
}

}  // namespace trainscope::suites::ssl
