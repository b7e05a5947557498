#pragma once
// Views of 28x28 grey images for the self-supervised methods, drawn from the rank's augmentation
// generator (the one the RNG probe fingerprints), batched: one affine grid per image.
//
// What acts on grey images: random resized crop, horizontal flip, brightness and contrast,
// solarisation. Saturation, hue and grey-scale conversion are identities on one channel, and a blur
// of a 28-pixel image erases the texture that tells a shirt from a pullover; they are left out.
#include <ATen/core/Generator.h>
#include <torch/torch.h>

namespace trainscope::suites::ssl {

struct ViewRecipe {
  double crop_min = 0.2, crop_max = 1.0;  // area fraction kept by the random resized crop
  double flip = 0.5;                      // probability of a horizontal flip
  double jitter = 0.8;                    // probability of brightness/contrast jitter
  double brightness = 0.4, contrast = 0.4;  // factors drawn in [1 - x, 1 + x]
  double solarize = 0.0;                  // probability of inverting pixels above 0.5
};

// SimCLR's (and DINO's global crops) recipe; BYOL's second view adds solarisation (p 0.2); MAE crops
// and flips only.
ViewRecipe simclr_view();
ViewRecipe byol_view(int which);
ViewRecipe mae_view();

// `images` are normalised ([B,1,H,W], Fashion-MNIST's mean and std); so is the view.
torch::Tensor make_view(const torch::Tensor& images, const ViewRecipe& recipe, at::Generator& gen);
// Two views of every image, [2B, ...] (view a's first), drawn in one pass over the doubled batch when
// the recipes differ in solarisation only (one grid_sample instead of two).
torch::Tensor make_views(const torch::Tensor& images, const ViewRecipe& a, const ViewRecipe& b, at::Generator& gen);

}  // namespace trainscope::suites::ssl
