#include "suites/train.hpp"

#include <cmath>

#include "core/compat.hpp"
#include "core/errors.hpp"

#ifdef TRAINSCOPE_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace trainscope::suites {
namespace {

int64_t tensor_bytes(const torch::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

}  // namespace

std::string resolve_device(const std::string& requested) {
  if (requested == "auto") return torch::cuda::is_available() ? "cuda:0" : "cpu";
  if (requested == "cuda") return "cuda:0";
  return requested;
}

std::string unsupported_reason(const RunConfig& c, const std::string& device) {
  const bool cuda = device.rfind("cuda", 0) == 0;
  if (cuda) {
    const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
    const int64_t index = std::stoll(device.substr(5));
    if (count == 0) return "no CUDA device visible to LibTorch on this machine";
    if (index >= count) return device + " requested but LibTorch sees " + std::to_string(count) + " GPU(s)";
  }
  if (c.precision == "tf32" && !cuda)
    return "tf32 needs a CUDA GPU (Ampere or newer); this cell runs on " + device;
#ifdef TRAINSCOPE_TORCH_CUDA
  if (cuda && (c.precision == "tf32" || c.precision.rfind("bf16", 0) == 0)) {
    const auto* props = at::cuda::getDeviceProperties(static_cast<int>(std::stoll(device.substr(5))));
    if (props->major < 8)
      return c.precision + " needs compute capability 8.0 or newer; " + props->name + " has " +
             std::to_string(props->major) + "." + std::to_string(props->minor);
  }
#endif
  const ModelPreset& m = model_preset(c.model);
  if (c.checkpoint == "selective" && m.family != "gpt")
    return "selective checkpointing recomputes the attention core; " + m.name + " has no attention (it would equal none)";
  const std::string data = resolve_data(c.data, m);
  if (m.family == "gpt" && data != "synthetic-tokens") return "model " + m.name + " needs token data, not " + data;
  if (m.family != "gpt" && data == "synthetic-tokens") return "model " + m.name + " needs image data, not " + data;
  if (data == "fashion-mnist" && !fashion_mnist_available())
    return "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)";
  return "";
}

Trainer::Trainer(const RunConfig& config, const std::string& device)
    : config_(config), device_(device), preset_(model_preset(config.model)),
      mode_(precision_mode(config.precision, device)) {
  preset_.dropout = config.dropout;
  torch::manual_seed(static_cast<uint64_t>(config.seed));
  // 32-true is strict fp32; tf32 lets cuBLAS and cuDNN use TF32 tensor cores.
  at::globalContext().setAllowTF32CuBLAS(config.precision == "tf32");
  at::globalContext().setAllowTF32CuDNN(config.precision == "tf32");

  data_ = make_data(config.data, preset_, config.seed);
  model_ = make_model(preset_, data_->shape());
  model_->to(device_, mode_.param_dtype);
  CheckpointPolicy policy = CheckpointPolicy::parse(config.checkpoint);
  policy.check = config.checkpoint_check;
  model_->set_checkpoint(policy);
  model_->set_boundary([this](const std::string& block, torch::Tensor x) { return boundary(block, std::move(x)); });
  if (mode_.emulated) weight_rounding_ = std::make_unique<Fp16WeightRounding>(model_->parameters());
  if (mode_.scaler)
    scaler_ = std::make_unique<GradScaler>(
        ScalerOptions{config.scaler_init, config.scaler_growth, config.scaler_backoff, config.scaler_interval},
        device_);
  if (config.optimizer == "sgd")
    optimizer_ = std::make_unique<torch::optim::SGD>(
        model_->parameters(), torch::optim::SGDOptions(config.lr).momentum(0.9).weight_decay(config.weight_decay));
  else
    optimizer_ = std::make_unique<torch::optim::AdamW>(
        model_->parameters(), torch::optim::AdamWOptions(config.lr).weight_decay(config.weight_decay));
}

RunInfo Trainer::info() const {
  RunInfo r;
  r.config = &config_;
  r.device = device_.str();
  r.model_name = preset_.name;
  r.parameters = count_parameters(*model_);
  r.flops_per_sample = model_->training_flops_per_sample();
  r.tokens_per_sample = model_->tokens_per_sample();
  r.recompute_flops_per_sample = model_->recompute_flops_per_sample();
  return r;
}

// Every block output passes here: probes observe it (on their sampled steps) and, in fp16 emulation,
// it is rounded through fp16 (its gradient too, on the way back).
torch::Tensor Trainer::boundary(const std::string& block, torch::Tensor x) {
  torch::Tensor y = mode_.emulated ? round_through_fp16(x) : x;
  if (current_step_ < 0) return y;
  for (BlockObserver* obs : observers_) {
    if (!obs->wants(current_step_)) continue;
    obs->activation(current_step_, block, x.detach());
    if (y.requires_grad()) {
      // The gradient arriving at the block output, before any fp16 rounding of it.
      const int64_t step = current_step_;
      y.register_hook([obs, block, step](torch::Tensor g) { obs->gradient(step, block, g); });
    }
  }
  return y;
}

void Trainer::set_lr(double lr) {
  for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
}

torch::Tensor Trainer::step(int64_t step, Hooks& hooks) {
  StepInfo si;
  si.step = step;
  si.measured = step >= config_.warmup_steps;
  si.samples = config_.batch_size;
  Batch batch = data_->train_batch(step, config_.batch_size);  // data time is not part of the step
  batch.input = batch.input.to(device_, /*non_blocking=*/true);
  if (batch.input.is_floating_point()) batch.input = batch.input.to(mode_.param_dtype);
  batch.target = batch.target.to(device_, /*non_blocking=*/true);
  observers_ = hooks.block_observers();
  current_step_ = step;

  hooks.step_begin(si);
  optimizer_->zero_grad();
  if (weight_rounding_) weight_rounding_->round();
  torch::Tensor loss;
  {
    compat::AutocastGuard autocast(device_.type(), mode_.autocast_dtype, mode_.autocast);
    loss = model_->loss(batch);
  }
  hooks.forward_end(si);
  torch::Tensor objective = config_.loss_multiplier != 1.0 ? loss * config_.loss_multiplier : loss;
  if (scaler_) {
    si.loss_scale = scaler_->current_scale();
    objective = scaler_->scale(objective);
  }
  objective.backward();
  if (weight_rounding_) weight_rounding_->restore();
  hooks.backward_end(si);

  const auto params = model_->parameters();
  if (scaler_) {
    si.grads_nonfinite = scaler_->unscale(params);
  } else if (mode_.fp16) {
    // No scaler: nothing stops the step, but the probe still learns whether the gradients were finite.
    torch::NoGradGuard no_grad;
    bool bad = false;
    for (const auto& p : params)
      if (p.grad().defined()) bad = bad || !torch::isfinite(p.grad()).all().item<bool>();
    si.grads_nonfinite = bad;
  }
  if (config_.grad_clip > 0) torch::nn::utils::clip_grad_norm_(params, config_.grad_clip);  // unscaled
  si.skipped = scaler_ && si.grads_nonfinite;
  if (!si.skipped) {
    optimizer_->step();
    ++applied_steps_;
    set_lr(scheduled_lr(config_.lr_schedule, config_.lr, applied_steps_, config_.warmup_steps + config_.steps));
  }
  if (scaler_) scaler_->update(si.grads_nonfinite);
  hooks.optimizer_end(si);
  si.loss = loss.detach();
  hooks.step_end(si);
  current_step_ = -1;
  return si.loss;
}

std::optional<double> Trainer::evaluate() {
  if (!model_->classifies()) return std::nullopt;
  Batch test = data_->test_set();
  if (!test.input.defined()) return std::nullopt;
  torch::NoGradGuard no_grad;
  model_->eval();
  int64_t correct = 0;
  const int64_t n = test.input.size(0), chunk = 1000;
  for (int64_t i = 0; i < n; i += chunk) {
    auto x = test.input.slice(0, i, std::min(n, i + chunk)).to(device_, mode_.param_dtype);
    auto y = test.target.slice(0, i, std::min(n, i + chunk)).to(device_);
    compat::AutocastGuard autocast(device_.type(), mode_.autocast_dtype, mode_.autocast);
    correct += model_->forward(x).argmax(-1).eq(y).sum().item<int64_t>();
  }
  model_->train();
  return static_cast<double>(correct) / static_cast<double>(n);
}

ModelStateBytes Trainer::model_state() const {
  ModelStateBytes m;
  int64_t numel = 0;
  for (const auto& p : model_->parameters()) {
    m.params += tensor_bytes(p);
    m.grads += tensor_bytes(p.grad());
    numel += p.numel();
  }
  for (const auto& [key, state] : optimizer_->state()) {
    if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(state.get()))
      m.optimizer += tensor_bytes(a->exp_avg()) + tensor_bytes(a->exp_avg_sq()) + tensor_bytes(a->max_exp_avg_sq());
    else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(state.get()))
      m.optimizer += tensor_bytes(s->momentum_buffer());
  }
  // Parameters and gradients in the parameter dtype (fp32, or bf16 for bf16-true); AdamW keeps two
  // moments of that dtype, SGD with momentum one buffer.
  const int64_t optimizer_words = config_.optimizer == "sgd" ? 1 : 2;
  m.expected = numel * static_cast<int64_t>(c10::elementSize(mode_.param_dtype)) * (2 + optimizer_words);
  return m;
}

TrainOutcome train(Trainer& trainer, const RunConfig& config, Hooks& hooks, RunInfo info) {
  TrainOutcome out;
  const int64_t total = config.warmup_steps + config.steps;
  const int64_t log_every = config.log_every > 0 ? config.log_every : std::max<int64_t>(1, total / 50);
  std::vector<double> tail;  // losses of the last steps, for final_loss
  int64_t nonfinite_run = 0;
  // The first step whose loss was not finite, tracked on the device so that no step has to wait.
  torch::Tensor first_bad;

  hooks.run_begin(info);
  for (int64_t s = 0; s < total; ++s) {
    torch::Tensor loss = trainer.step(s, hooks);
    out.steps_run = s + 1;
    {
      torch::NoGradGuard no_grad;
      if (!first_bad.defined()) first_bad = torch::full({}, -1, loss.options().dtype(torch::kLong));
      first_bad = torch::where(torch::logical_and(first_bad < 0, torch::logical_not(torch::isfinite(loss))),
                               torch::full({}, s, first_bad.options()), first_bad);
    }
    // Read the loss (a device sync on GPU) only at log points, in the last 10 steps, and while it is
    // non-finite, so that the loop stays asynchronous otherwise.
    const bool in_tail = s >= total - 10;
    if (s % log_every != 0 && !in_tail && nonfinite_run == 0 && s != total - 1) continue;
    const double v = loss.item<double>();
    if (s % log_every == 0 || s == total - 1) out.loss_curve.emplace_back(s, v);
    if (in_tail) tail.push_back(v);
    if (!std::isfinite(v)) {
      if (!out.first_nonfinite_step) out.first_nonfinite_step = first_bad.item<int64_t>();
      if (++nonfinite_run >= 10) {
        out.status = "diverged";
        out.reason = "loss non-finite since step " + std::to_string(*out.first_nonfinite_step);
        break;
      }
    } else {
      nonfinite_run = 0;
    }
  }
  hooks.run_end(RunEnd{out.steps_run, trainer.model_state()});
  double sum = 0;
  for (double v : tail) sum += v;
  out.final_loss = tail.empty() ? std::nan("") : sum / static_cast<double>(tail.size());
  if (out.status == "ok" && !std::isfinite(out.final_loss)) {
    out.status = "diverged";
    out.reason = "final loss is not finite";
  }
  if (out.status == "ok" && config.eval) out.accuracy = trainer.evaluate();
  return out;
}

}  // namespace trainscope::suites
