#pragma once
// Precision techniques: each mode as core/precision.hpp's table defines it, made concrete on a device;
// fp16 emulation on CPU; fp8 linear layers; dynamic loss scaling.
//
// CPU fp16 GEMMs are ~100x slower than fp32 without AVX512-FP16, so on CPU the two 16-mixed modes are
// emulated by default (`fp16 = autocast` runs the real CPU kernels instead): activations at
// every block boundary, the weights for the forward pass, and gradients (of block outputs on the way
// back, and of the parameters) are rounded through fp16, so values beyond +-65504 become inf and values
// below fp16's smallest subnormal flush to zero, as they would on a GPU.
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "core/precision.hpp"

namespace trainscope::suites {

// A named dtype of core/precision.hpp as LibTorch's scalar type.
at::ScalarType scalar_type(const std::string& dtype);

struct PrecisionMode {
  std::string name;
  bool autocast = false;
  at::ScalarType autocast_dtype = at::kBFloat16;
  at::ScalarType param_dtype = at::kFloat;   // the parameters the forward pass computes with
  bool master = false;     // the optimizer steps fp32 masters; the strategy casts them to param_dtype
  at::ScalarType reduce_dtype = at::kFloat;  // gradients reduced and accumulated in (with masters)
  bool fp16 = false;       // one of the 16-mixed modes
  bool scaler = false;     // dynamic loss scaling
  bool emulated = false;   // fp16 rounded in software (CPU)
  bool fp8 = false;        // Linear GEMMs in e4m3 through at::_scaled_mm (CUDA sm89+), bf16 autocast elsewhere
};

// The mode a precision name means on a device ("cpu" or "cuda:i"); fp16 is the `fp16` key (auto,
// emulated, autocast: how 16-mixed runs on a CPU); reduce is the `reduce_dtype` key (masters only).
PrecisionMode precision_mode(const std::string& precision, const std::string& device, const std::string& fp16 = "auto",
                             const std::string& reduce = "fp32");

// x -> fp16 -> fp32 in forward, and the same for the incoming gradient in backward.
torch::Tensor round_through_fp16(const torch::Tensor& x);

// fp8 training (precision = fp8): inside an Fp8Scope the models' Linear layers run their forward GEMM
// in e4m3 through at::_scaled_mm, inputs and weights scaled per tensor so that the amax maps to e4m3's
// 448 (current scaling: this step's amax; delayed: the largest of the last 16 steps'), the product
// in bf16; the backward GEMMs run in bf16 (a straight-through estimator of the quantisation). Layers
// whose dimensions are not multiples of 16 (as _scaled_mm requires) stay in bf16.
class Fp8Scope {
 public:
  explicit Fp8Scope(bool enabled, bool delayed);
  ~Fp8Scope();
  Fp8Scope(const Fp8Scope&) = delete;
  Fp8Scope& operator=(const Fp8Scope&) = delete;
};
// x @ w^T + b: in fp8 inside an enabled Fp8Scope, else aten::linear.
torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b);
// Whether project(x, w, ...) runs in fp8 here (an enabled Fp8Scope, CUDA, dimensions multiples of 16).
bool project_runs_fp8(const torch::Tensor& x, const torch::Tensor& w);
// The backward of an fp8 linear: bf16 GEMMs on the incoming gradient, the input `x2` ([rows, K], bf16)
// and the weight (a straight-through estimator of the quantisation): {dx [rows, K], dw, db}.
std::vector<torch::Tensor> fp8_linear_backward(const torch::Tensor& g2, const torch::Tensor& x2, const torch::Tensor& w, bool bias);
// Linear calls that ran in fp8 / stayed in bf16 since the process started (the cell's `fp8` section).
std::pair<int64_t, int64_t> fp8_layer_counts();

// Rounds the parameters through fp16 for one forward/backward pass and puts the fp32 master values
// back afterwards (what fp16 autocast's cast-on-use does to the weights).
class Fp16WeightRounding {
 public:
  explicit Fp16WeightRounding(std::vector<torch::Tensor> params) : params_(std::move(params)) {}
  void round();    // before forward: keep masters, round the live weights
  void restore();  // after backward: masters back; gradients rounded through fp16
 private:
  std::vector<torch::Tensor> params_, masters_;
};

struct ScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

// Dynamic loss scaling with PyTorch's GradScaler semantics: scale the loss, unscale the gradients,
// skip the optimizer step when any gradient is inf/NaN and back off; grow after `growth_interval`
// consecutive clean steps. Runs PyTorch's own AMP kernels (_amp_foreach_non_finite_check_and_unscale_,
// _amp_update_scale_), which LibTorch 2.4+ has for CPU and CUDA.
class GradScaler {
 public:
  explicit GradScaler(ScalerOptions o = {}, torch::Device device = torch::kCPU);
  torch::Tensor scale(const torch::Tensor& loss) const { return loss * scale_; }
  // Unscales every defined gradient in place and reports whether any is inf or NaN. The flag goes
  // through `reduce_found_inf` first (a MAX all-reduce across ranks once training is distributed).
  bool unscale(const std::vector<torch::Tensor>& params);
  // Applies the result of this step: back off (and reset the clean-step count) or count towards growth.
  void update(bool found_inf);
  double current_scale() const { return scale_.item<double>(); }
  int64_t growth_tracker() const { return tracker_.item<int64_t>(); }
  std::function<void(torch::Tensor& found_inf)> reduce_found_inf;

 private:
  ScalerOptions o_;
  torch::Tensor scale_, tracker_, found_inf_;
};

// The learning rate of `applied_step` (optimizer steps actually taken; skipped steps do not count).
double scheduled_lr(const std::string& schedule, double base_lr, int64_t applied_step, int64_t total_steps);

}  // namespace trainscope::suites
