#include "suites/techniques/checkpoint.hpp"

#include <mutex>

#include "core/compat.hpp"
#include "core/config.hpp"
#include "core/errors.hpp"
#include "suites/models/models.hpp"
#include "suites/techniques/precision.hpp"

namespace trainscope::suites {

CheckpointPolicy CheckpointPolicy::parse(const std::string& text) {
  CheckpointPolicy p;
  std::string kind;
  if (!parse_checkpoint(text, kind, p.every))
    throw UsageError("unknown checkpoint '" + text + "' (allowed: none, full, every:<k>, selective)");
  p.kind = kind == "full"           ? Kind::Full
           : kind == "selective"    ? Kind::Selective
           : kind == "selective-op" ? Kind::SelectiveOp
           : kind == "every"        ? Kind::Every
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

// ---- op-level selective checkpointing --------------------------------------------------------------
// What one op-level checkpoint keeps: the saved operators' outputs in forward order, served back in the
// same order to the recomputation. The mm count restarts with each pass, as torchtitan's counter does.
struct SacState {
  bool recompute = false;
  int mm_count = 0;
  size_t next = 0;
  std::vector<std::vector<torch::Tensor>> kept;  // per saved operator: its outputs (attention: out, lse)
};
thread_local SacState* t_sac = nullptr;

// Sets the thread's op-level state for one pass of a block (forward or recomputation).
class SacPass {
 public:
  SacPass(SacState* s, bool recompute) : prev_(t_sac) {
    if (s) {
      s->recompute = recompute;
      s->mm_count = 0;
      s->next = 0;
    }
    t_sac = s;
  }
  ~SacPass() { t_sac = prev_; }

 private:
  SacState* prev_;
};

// Torchtitan's rule for one linear: biased ones are addmm (always saved); of the unbiased (mm), every
// second is recomputed, counting from 1 in the block's forward order.
bool saves_linear(SacState& s, bool biased) {
  if (biased) return true;
  return ++s.mm_count % 2 == 1;
}

const std::vector<torch::Tensor>& served(SacState& s) {
  if (s.next >= s.kept.size()) throw std::logic_error("selective-op: the recomputation asked for more saved outputs than the forward kept");
  return s.kept[s.next++];
}

struct Kept : torch::CustomClassHolder {
  std::vector<torch::Tensor> outputs;
  bool fp8 = false, causal = false;
  double scale = 1;
};

// aten::mm's backward (FunctionsManual.cpp: mm_mat1_backward, mm_mat2_backward): a column-major operand
// gets its gradient column-major too.
bool column_major(const torch::Tensor& t) { return t.stride(0) == 1 && t.stride(1) == t.size(0); }
torch::Tensor mm_mat1_grad(const torch::Tensor& g, const torch::Tensor& mat1, const torch::Tensor& mat2) {
  return column_major(mat1) ? mat2.mm(g.t()).t() : g.mm(mat2.t());
}
torch::Tensor mm_mat2_grad(const torch::Tensor& g, const torch::Tensor& mat1, const torch::Tensor& mat2) {
  return column_major(mat2) ? g.t().mm(mat1).t() : mat1.t().mm(g);
}

// A matrix product the forward kept, standing for aten::mm (two inputs) or aten::addmm (bias first; a
// TensorList, so that every element is an input of the node):
// forward hands the kept output back, backward is the operator's own (the bias's gradient reduced to
// its shape by the engine, as for addmm). The views around it are the caller's, as aten::linear makes them.
struct ServedMm : public torch::autograd::Function<ServedMm> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList in, c10::intrusive_ptr<Kept> kept) {
    const bool bias = in.size() == 3;
    ctx->save_for_backward({in[bias ? 1 : 0], in[bias ? 2 : 1]});
    ctx->saved_data["bias"] = bias;
    return kept->outputs[0].detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &mat1 = saved[0], &mat2 = saved[1];
    const bool bias = ctx->saved_data["bias"].toBool();
    const size_t m1 = bias ? 1 : 0;
    torch::autograd::variable_list out;
    if (bias) out.push_back(ctx->needs_input_grad(0) ? g[0] : torch::Tensor());
    out.push_back(ctx->needs_input_grad(m1) ? mm_mat1_grad(g[0], mat1, mat2) : torch::Tensor());
    out.push_back(ctx->needs_input_grad(m1 + 1) ? mm_mat2_grad(g[0], mat1, mat2) : torch::Tensor());
    out.push_back(torch::Tensor());  // the kept outputs are no input
    return out;
  }
};

// fp8's linear (suites/techniques/precision.cpp) whose output the forward kept; backward is its own.
struct ServedFp8Linear : public torch::autograd::Function<ServedFp8Linear> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList in, c10::intrusive_ptr<Kept> kept) {
    ctx->save_for_backward({in[0], in[1]});
    ctx->saved_data["bias"] = in.size() == 3;
    return kept->outputs[0].detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &w = saved[1];
    const bool bias = ctx->saved_data["bias"].toBool();
    auto grads = fp8_linear_backward(g[0].reshape({-1, w.size(0)}), x.reshape({-1, w.size(1)}).to(torch::kBFloat16), w, bias);
    torch::autograd::variable_list out = {grads[0].view(x.sizes()), grads[1]};
    if (bias) out.push_back(grads[2]);
    out.push_back(torch::Tensor());
    return out;
  }
};

// A batched matmul (bmm) the forward kept; backward is bmm's.
struct ServedBmm : public torch::autograd::Function<ServedBmm> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& a, const torch::Tensor& b,
                               c10::intrusive_ptr<Kept> kept) {
    ctx->save_for_backward({a, b});
    return kept->outputs[0].detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &a = saved[0], &b = saved[1];
    torch::Tensor ga, gb;
    if (ctx->needs_input_grad(0)) ga = g[0].bmm(b.transpose(1, 2));
    if (ctx->needs_input_grad(1)) gb = a.transpose(1, 2).bmm(g[0]);
    return {ga, gb, torch::Tensor()};
  }
};

// The flash attention kernel whose output and log-sum-exp the forward kept; backward is its own.
struct ServedAttention : public torch::autograd::Function<ServedAttention> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, c10::intrusive_ptr<Kept> kept) {
    ctx->save_for_backward({q, k, v});
    ctx->saved_data["kept"] = c10::IValue::make_capsule(kept);
    return kept->outputs[0].detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list g) {
    const auto saved = ctx->get_saved_variables();
    auto kept = c10::static_intrusive_pointer_cast<Kept>(ctx->saved_data["kept"].toCapsule());
    const auto& o = kept->outputs;
    if (g[0].is_cpu()) {
      auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(g[0], saved[0], saved[1], saved[2], o[0], o[1], 0.0,
                                                                                   kept->causal, std::nullopt, kept->scale);
      return {dq, dk, dv, torch::Tensor()};
    }
    // CUDA flash: outputs 0 out, 1 lse, 2-3 cumulative sequence lengths, 4-5 max lengths, 6-7 Philox seed and offset.
    auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_backward(
        g[0], saved[0], saved[1], saved[2], o[0], o[1], o[2], o[3], o[4].item<int64_t>(), o[5].item<int64_t>(), 0.0, kept->causal,
        o[6], o[7], kept->scale);
    return {dq, dk, dv, torch::Tensor()};
  }
};

// What the recomputation needs besides the saved input: the block, and the RNG and autocast state
// the forward pass ran under.
struct Recompute : torch::CustomClassHolder {
  BlockFn fn;
  bool restore_rng = true, check = false;
  torch::Device device{torch::kCPU};
  at::Tensor cpu_rng, device_rng;
  at::Tensor tp_rng;  // tensor parallelism's model-parallel generator (Megatron's CheckpointFunction keeps it too)
  at::Tensor original;  // the forward output, kept only for the determinism check
  std::unique_ptr<SacState> sac;  // selective-op: the operators' outputs the forward kept
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
      r->tp_rng = tensor_parallel::rng_tracker().state();
    }
    r->autocast = compat::autocast_enabled(x.device().type());
    r->autocast_dtype = compat::autocast_dtype(x.device().type());
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(r);
    ctx->saved_data["params"] = params.vec();  // the same tensors as the block's: no copy
    ctx->save_for_backward({x});
    torch::Tensor y;
    {
      SacPass pass(r->sac.get(), /*recompute=*/false);
      y = r->fn(x);
    }
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
    at::Tensor cpu_now, device_now, tp_now;
    if (r->restore_rng) {
      tp_now = tensor_parallel::rng_tracker().state();
      tensor_parallel::rng_tracker().set_state(r->tp_rng);
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
      SacPass pass(r->sac.get(), /*recompute=*/true);
      y = r->fn(x);
    }
    if (r->restore_rng) {
      tensor_parallel::rng_tracker().set_state(tp_now);
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

    // Gradients for what this backward needs, of the input and the parameters in the order of forward's
    // arguments: all of them in one backward; a split one (pipelining's zero-bubble schedules) asks for
    // the input's first and the parameters' later, each pass recomputing the block.
    const bool want_x = input_grad && ctx->needs_input_grad(0);
    std::vector<torch::Tensor> wrt;
    if (want_x) wrt.push_back(x);
    bool later = false;  // a parameter's gradient is left for a later backward through this node
    for (size_t i = 0; i < params.size(); ++i) {
      if (ctx->needs_input_grad(1 + i)) wrt.push_back(params[i]);
      else later = later || params[i].requires_grad();
    }
    torch::autograd::variable_list grads;
    if (!wrt.empty())
      grads = torch::autograd::grad({y}, wrt, {grad_out[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                    /*allow_unused=*/true);
    // selective-op's kept outputs go after the last backward through this node (this node lives as long
    // as the step's graph does).
    if (r->sac && !later) r->sac->kept.clear();
    torch::autograd::variable_list out;
    size_t at = 0;
    out.push_back(want_x ? grads[at++] : torch::Tensor());
    for (size_t i = 0; i < params.size(); ++i) out.push_back(ctx->needs_input_grad(1 + i) ? grads[at++] : torch::Tensor());
    out.push_back(torch::Tensor());  // the Recompute holder is no tensor
    return out;
  }
};

}  // namespace

torch::Tensor checkpoint(const BlockFn& fn, const torch::Tensor& x, at::TensorList params, bool restore_rng,
                         bool check, bool op_level) {
  auto r = c10::make_intrusive<Recompute>();
  r->fn = fn;
  r->restore_rng = restore_rng;
  r->check = check;
  if (op_level) r->sac = std::make_unique<SacState>();
  return CheckpointFunction::apply(x, params, r);
}

namespace {

// Autocast's casts of an operator's arguments as its wrapper makes them (the weights' from its cache),
// right to left as C++ evaluates the wrapper's arguments: the nodes the plain call would record, in its
// order.
std::vector<torch::Tensor> autocast_args(std::vector<torch::Tensor> args) {
  for (auto it = args.rbegin(); it != args.rend(); ++it) {
    if (!it->defined()) continue;
    const auto dev = it->device().type();
    if (compat::autocast_enabled(dev)) *it = at::autocast::cached_cast(compat::autocast_dtype(dev), *it, dev);
  }
  return args;
}

// Whether aten::linear runs this as one matrix product the served path mirrors: addmm over the input
// flattened to rows (2-D, or contiguous 3-D), or mm over matmul's folded rows (no bias).
bool servable_linear(const torch::Tensor& x, bool biased) {
  if (!biased) return x.dim() >= 2;
  return x.dim() == 2 || (x.dim() == 3 && x.is_contiguous());
}

// aten::linear over a kept output, its views as aten::linear makes them: no bias, matmul's fold
// (w.t(), the input's reshape to rows, mm, _unsafe_view); a bias on 3-D input, _flatten_nd_linear (the
// reshape, w.t(), addmm, view); on 2-D input, addmm.
torch::Tensor served_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, const c10::intrusive_ptr<Kept>& kept) {
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = w.size(0);
  if (!b.defined()) {
    const torch::Tensor wt = w.t();
    const torch::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
    const torch::Tensor y = ServedMm::apply(at::TensorList({x2, wt}), kept);
    return x.dim() == 2 ? y : at::_unsafe_view(y, out_sizes);
  }
  if (x.dim() == 2) {
    const torch::Tensor wt = w.t();
    return ServedMm::apply(at::TensorList({b, x, wt}), kept);
  }
  const torch::Tensor x2 = x.reshape({-1, x.size(-1)});
  const torch::Tensor wt = w.t();
  return ServedMm::apply(at::TensorList({b, x2, wt}), kept).view(out_sizes);
}

}  // namespace

torch::Tensor sac_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  SacState* s = t_sac;
  if (!s) return project(x, w, b);
  const bool fp8 = project_runs_fp8(x, w);
  const bool save = saves_linear(*s, b.defined()) && (fp8 || servable_linear(x, b.defined()));
  if (!s->recompute) {
    torch::Tensor y = project(x, w, b);
    if (save) s->kept.push_back({y.dim() == 2 || fp8 ? y : y.reshape({-1, y.size(-1)})});
    return y;
  }
  if (!save) return project(x, w, b);
  auto kept = c10::make_intrusive<Kept>();
  kept->outputs = served(*s);
  if (fp8) {  // fp8's linear quantises its own arguments
    torch::autograd::variable_list args = {x, w};
    if (b.defined()) args.push_back(b);
    return ServedFp8Linear::apply(at::TensorList(args), kept);
  }
  const auto args = autocast_args({x, w, b});
  return served_linear(args[0], args[1], args[2], kept);
}

torch::Tensor sac_matmul(const torch::Tensor& a, const torch::Tensor& b) {
  SacState* s = t_sac;
  if (!s) return torch::matmul(a, b);
  if (!s->recompute) {
    torch::Tensor y = torch::matmul(a, b);
    s->kept.push_back({y});
    return y;
  }
  // at::matmul's batched path: each operand expanded to the common batch (a no-op here, but a node) and
  // reshaped to 3-D (a copy where it is not contiguous), bmm, the result viewed back.
  const auto args = autocast_args({a, b});
  const torch::Tensor &ac = args[0], &bc = args[1];
  auto out_sizes = ac.sizes().vec();
  out_sizes.back() = bc.size(-1);
  const torch::Tensor a3 = ac.expand(ac.sizes()).reshape({-1, ac.size(-2), ac.size(-1)});
  const torch::Tensor b3 = bc.expand(bc.sizes()).reshape({-1, bc.size(-2), bc.size(-1)});
  auto kept = c10::make_intrusive<Kept>();
  kept->outputs = {served(*s)[0].view({a3.size(0), a3.size(1), b3.size(2)})};
  return at::_unsafe_view(ServedBmm::apply(a3, b3, kept), out_sizes);
}

torch::Tensor sac_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal, double scale,
                            bool enable_gqa, double dropout, const std::function<torch::Tensor()>& plain) {
  SacState* s = t_sac;
  if (!s) return plain();
  if (!s->recompute) {
    // The flash kernel as the plain call runs it: on a CPU (it takes grouped K/V as they are), or on a
    // GPU without grouped K/V (where the call would rearrange them first); without dropout (its Philox
    // state would have to be replayed). Elsewhere the attention is recomputed: an empty entry says so.
    if (dropout > 0 || (q.is_cuda() && enable_gqa) || sdpa_backend(q, k, v, causal, enable_gqa) != "flash") {
      s->kept.push_back({});
      return plain();
    }
    // Autocast casts the plain call's arguments (SDPA is on its lower-precision list); the kernel called
    // directly is not, so its arguments are cast here, as the recomputation's are.
    const auto qkv = autocast_args({q, k, v});
    const torch::Tensor &qc = qkv[0], &kc = qkv[1], &vc = qkv[2];
    if (q.is_cpu()) {
      auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(qc, kc, vc, 0.0, causal, std::nullopt, scale);
      s->kept.push_back({out, lse});
      return out;
    }
    auto r = at::_scaled_dot_product_flash_attention(qc, kc, vc, 0.0, causal, false, scale);
    s->kept.push_back({std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r), torch::tensor(std::get<4>(r).expect_int()),
                       torch::tensor(std::get<5>(r).expect_int()), std::get<6>(r), std::get<7>(r)});
    return std::get<0>(r);
  }
  const std::vector<torch::Tensor>& outputs = served(*s);
  if (outputs.empty()) return plain();
  auto kept = c10::make_intrusive<Kept>();
  kept->outputs = outputs;
  kept->causal = causal;
  kept->scale = scale;
  const auto qkv = autocast_args({q, k, v});
  return ServedAttention::apply(qkv[0], qkv[1], qkv[2], kept);
}

DeterminismCheck checkpoint_determinism() {
  std::lock_guard<std::mutex> lock(g_check_mutex);
  return g_check;
}

}  // namespace trainscope::suites
