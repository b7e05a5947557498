#include "suites/techniques/checkpoint.hpp"

#include <mutex>

#include "core/compat.hpp"
#include "core/config.hpp"
#include "core/errors.hpp"

namespace trainscope::suites {

CheckpointPolicy CheckpointPolicy::parse(const std::string& text) {
  CheckpointPolicy p;
  std::string kind;
  if (!parse_checkpoint(text, kind, p.every))
    throw UsageError("unknown checkpoint '" + text + "' (allowed: none, full, every:<k>, selective)");
  p.kind = kind == "full"        ? Kind::Full
           : kind == "selective" ? Kind::Selective
           : kind == "every"     ? Kind::Every
                                 : Kind::None;
  return p;
}

namespace {

std::mutex g_check_mutex;
DeterminismCheck g_check;

at::Generator generator_for(const torch::Device& d) { return at::globalContext().defaultGenerator(d); }

at::Tensor rng_state(const torch::Device& d) {
  auto gen = generator_for(d);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(const torch::Device& d, const at::Tensor& state) {
  auto gen = generator_for(d);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// What the recomputation needs besides the saved input: the block, and the RNG and autocast state
// the forward pass ran under.
struct Recompute : torch::CustomClassHolder {
  BlockFn fn;
  bool restore_rng = true, check = false;
  torch::Device device{torch::kCPU};
  at::Tensor cpu_rng, device_rng;
  at::Tensor original;  // the forward output, kept only for the determinism check
  bool autocast = false;
  at::ScalarType autocast_dtype = at::kBFloat16;
};

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // Runs with grad mode off (Function::apply guarantees it): nothing inside the block is saved.
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, at::TensorList params,
                               c10::intrusive_ptr<Recompute> r) {
    r->device = x.device();
    if (r->restore_rng) {
      r->cpu_rng = rng_state(torch::kCPU);
      if (!x.device().is_cpu()) r->device_rng = rng_state(x.device());
    }
    r->autocast = compat::autocast_enabled(x.device().type());
    r->autocast_dtype = compat::autocast_dtype(x.device().type());
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(r);
    ctx->saved_data["params"] = params.vec();  // the same tensors as the block's: no copy
    ctx->save_for_backward({x});
    torch::Tensor y = r->fn(x);
    if (r->check) r->original = y.detach().clone();
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto r = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    const std::vector<torch::Tensor> params = ctx->saved_data["params"].toTensorVector();
    const torch::Tensor saved = ctx->get_saved_variables()[0];
    const bool input_grad = saved.requires_grad();
    torch::Tensor x = saved.detach().requires_grad_(input_grad);

    // Re-run the block under the RNG and autocast state of the forward pass, then put the RNG back.
    at::Tensor cpu_now, device_now;
    if (r->restore_rng) {
      cpu_now = rng_state(torch::kCPU);
      set_rng_state(torch::kCPU, r->cpu_rng);
      if (r->device_rng.defined()) {
        device_now = rng_state(r->device);
        set_rng_state(r->device, r->device_rng);
      }
    }
    torch::Tensor y;
    {
      torch::AutoGradMode grad_on(true);
      compat::AutocastGuard autocast(r->device.type(), r->autocast_dtype, r->autocast);
      y = r->fn(x);
    }
    if (r->restore_rng) {
      set_rng_state(torch::kCPU, cpu_now);
      if (device_now.defined()) set_rng_state(r->device, device_now);
    }
    if (r->check) {
      const double diff = (y.detach() - r->original).abs().max().item<double>();
      std::lock_guard<std::mutex> lock(g_check_mutex);
      ++g_check.compared;
      g_check.max_abs_diff = std::max(g_check.max_abs_diff, diff);
      r->original = torch::Tensor();
    }

    // Gradients for the input (if wanted) and every parameter, in the order of forward's arguments.
    std::vector<torch::Tensor> wrt;
    if (input_grad) wrt.push_back(x);
    for (const auto& p : params) wrt.push_back(p);
    torch::autograd::variable_list grads;
    if (!wrt.empty())
      grads = torch::autograd::grad({y}, wrt, {grad_out[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                    /*allow_unused=*/true);
    torch::autograd::variable_list out;
    size_t at = 0;
    out.push_back(input_grad ? grads[at++] : torch::Tensor());
    for (size_t i = 0; i < params.size(); ++i) out.push_back(grads[at++]);
    out.push_back(torch::Tensor());  // the Recompute holder is no tensor
    return out;
  }
};

}  // namespace

torch::Tensor checkpoint(const BlockFn& fn, const torch::Tensor& x, at::TensorList params, bool restore_rng,
                         bool check) {
  auto r = c10::make_intrusive<Recompute>();
  r->fn = fn;
  r->restore_rng = restore_rng;
  r->check = check;
  return CheckpointFunction::apply(x, params, r);
}

DeterminismCheck checkpoint_determinism() {
  std::lock_guard<std::mutex> lock(g_check_mutex);
  return g_check;
}

}  // namespace trainscope::suites
