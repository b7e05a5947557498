#include "suites/ssl/methods.hpp"

#include <cmath>

#include <ATen/CPUGeneratorImpl.h>

#include "core/errors.hpp"
#include "suites/parallel/strategies.hpp"
#include "suites/ssl/augment.hpp"

namespace trainscope::suites::ssl {

namespace F = torch::nn::functional;
namespace nn = torch::nn;

// ---- losses -----------------------------------------------------------------------------------------
torch::Tensor nt_xent(const torch::Tensor& z1, const torch::Tensor& z2, double temperature, const torch::Tensor& all1,
                      const torch::Tensor& all2, int64_t offset) {
  const auto unit = [](const torch::Tensor& z) { return F::normalize(z.to(torch::kFloat), F::NormalizeFuncOptions().dim(1)); };
  const torch::Tensor a1 = unit(z1), a2 = unit(z2);
  const torch::Tensor c1 = all1.defined() ? unit(all1) : a1, c2 = all2.defined() ? unit(all2) : a2;
  const int64_t N = a1.size(0), M = c1.size(0);
  torch::Tensor logits = torch::cat({a1, a2}).mm(torch::cat({c1, c2}).t()) / temperature;  // [2N, 2M]
  const torch::Tensor idx = torch::arange(N, torch::TensorOptions().dtype(torch::kLong).device(logits.device())) + offset;
  const torch::Tensor self = torch::cat({idx, idx + M}), positive = torch::cat({idx + M, idx});
  // An anchor is never its own candidate (TF SimCLR masks it with -1e9 as well).
  logits = logits.scatter(1, self.unsqueeze(1), -1e9);
  return F::cross_entropy(logits, positive);
}

torch::Tensor byol_loss(const torch::Tensor& p, const torch::Tensor& z) {
  return (2 - 2 * F::cosine_similarity(p.to(torch::kFloat), z.to(torch::kFloat).detach(), F::CosineSimilarityFuncOptions().dim(1))).mean();
}

torch::Tensor dino_loss(const std::vector<torch::Tensor>& student, const std::vector<torch::Tensor>& teacher,
                        const torch::Tensor& center, double student_temp, double teacher_temp) {
  torch::Tensor total;
  int64_t terms = 0;
  for (size_t iq = 0; iq < teacher.size(); ++iq) {
    const torch::Tensor t = torch::softmax((teacher[iq].to(torch::kFloat) - center) / teacher_temp, -1).detach();
    for (size_t v = 0; v < student.size(); ++v) {
      if (v == iq) continue;
      const torch::Tensor l = torch::sum(-t * torch::log_softmax(student[v].to(torch::kFloat) / student_temp, -1), -1).mean();
      total = total.defined() ? total + l : l;
      ++terms;
    }
  }
  return total / static_cast<double>(terms);
}

torch::Tensor dino_center_update(const torch::Tensor& center, const torch::Tensor& batch_center, double momentum) {
  return center * momentum + batch_center * (1 - momentum);
}

std::vector<std::pair<std::string, torch::Tensor>> loss_probe(const RunConfig& config) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(config.seed));
  const auto randn = [&](std::initializer_list<int64_t> shape) {
    return torch::randn(shape, gen, torch::TensorOptions().dtype(torch::kFloat)).requires_grad_(true);
  };
  const auto scalar = [](double v) { return torch::tensor(v, torch::kDouble); };
  const auto grad = [](const torch::Tensor& t) { return t.grad().detach().clone(); };
  std::vector<std::pair<std::string, torch::Tensor>> out;
  const int64_t N = 8, D = 16;
  {  // SimCLR: one process, then rank 0 and rank 1 of 2 on the gathered batch (values only)
    const torch::Tensor z1 = randn({N, D}), z2 = randn({N, D});
    const torch::Tensor l = nt_xent(z1, z2, config.ssl_temperature);
    l.backward();
    out.insert(out.end(), {{"simclr.z1", z1.detach()}, {"simclr.z2", z2.detach()}, {"simclr.temperature", scalar(config.ssl_temperature)},
                           {"simclr.loss", l.detach()}, {"simclr.grad_z1", grad(z1)}, {"simclr.grad_z2", grad(z2)}});
    const torch::Tensor o1 = randn({N, D}).detach(), o2 = randn({N, D}).detach();  // rank 1's views
    const torch::Tensor all1 = torch::cat({z1.detach(), o1}), all2 = torch::cat({z2.detach(), o2});
    out.insert(out.end(), {{"simclr.rank1_z1", o1}, {"simclr.rank1_z2", o2},
                           {"simclr.gathered_loss_rank0", nt_xent(z1.detach(), z2.detach(), config.ssl_temperature, all1, all2, 0)},
                           {"simclr.gathered_loss_rank1", nt_xent(o1, o2, config.ssl_temperature, all1, all2, N)}});
  }
  {  // BYOL: both directions summed, as the objective does
    const torch::Tensor p0 = randn({N, D}), p1 = randn({N, D}), z0 = randn({N, D}).detach(), z1 = randn({N, D}).detach();
    const torch::Tensor l = byol_loss(p0, z1) + byol_loss(p1, z0);
    l.backward();
    out.insert(out.end(), {{"byol.p0", p0.detach()}, {"byol.p1", p1.detach()}, {"byol.z0", z0}, {"byol.z1", z1},
                           {"byol.loss", l.detach()}, {"byol.grad_p0", grad(p0)}, {"byol.grad_p1", grad(p1)}});
  }
  {  // DINO: two views each side, 32 prototypes, a centre that is not zero
    const int64_t K = 32;
    const torch::Tensor s0 = randn({N, K}), s1 = randn({N, K});
    const torch::Tensor t0 = randn({N, K}).detach(), t1 = randn({N, K}).detach(), center = 0.1 * randn({1, K}).detach();
    const torch::Tensor l = dino_loss({s0, s1}, {t0, t1}, center, config.dino_student_temp, config.dino_teacher_temp);
    l.backward();
    const torch::Tensor after = dino_center_update(center, torch::cat({t0, t1}).mean(0, /*keepdim=*/true), config.dino_center_momentum);
    out.insert(out.end(), {{"dino.s0", s0.detach()}, {"dino.s1", s1.detach()}, {"dino.t0", t0}, {"dino.t1", t1},
                           {"dino.center", center}, {"dino.student_temp", scalar(config.dino_student_temp)},
                           {"dino.teacher_temp", scalar(config.dino_teacher_temp)},
                           {"dino.center_momentum", scalar(config.dino_center_momentum)}, {"dino.loss", l.detach()},
                           {"dino.grad_s0", grad(s0)}, {"dino.grad_s1", grad(s1)}, {"dino.center_after", after}});
  }
  {  // MAE: 16 patches of 48 values, the config's mask ratio hidden (1 = hidden)
    const int64_t L = 16, P = 48, hidden = static_cast<int64_t>(static_cast<double>(L) * config.mask_ratio);
    const torch::Tensor pred = randn({N, L, P}), target = randn({N, L, P}).detach();
    const torch::Tensor order = torch::rand({N, L}, gen).argsort(/*dim=*/int64_t{1});
    const torch::Tensor mask = (order < hidden).to(torch::kFloat);
    const torch::Tensor l = mae_loss(pred, target, mask, config.norm_pix);
    l.backward();
    out.insert(out.end(), {{"mae.pred", pred.detach()}, {"mae.target", target}, {"mae.mask", mask},
                           {"mae.norm_pix", scalar(config.norm_pix ? 1.0 : 0.0)}, {"mae.loss", l.detach()},
                           {"mae.grad_pred", grad(pred)}});
  }
  return out;
}

torch::Tensor mae_loss(const torch::Tensor& pred, const torch::Tensor& target, const torch::Tensor& mask, bool norm_pix) {
  torch::Tensor t = target.to(torch::kFloat);
  if (norm_pix) {
    const torch::Tensor mean = t.mean(-1, /*keepdim=*/true), var = t.var(-1, /*unbiased=*/true, /*keepdim=*/true);
    t = (t - mean) / torch::sqrt(var + 1e-6);
  }
  const torch::Tensor per_patch = (pred.to(torch::kFloat) - t).pow(2).mean(-1);
  return (per_patch * mask).sum() / mask.sum();
}

double ema_momentum(double base, int64_t step, int64_t total) {
  const double k = static_cast<double>(std::min(step, total)), K = static_cast<double>(std::max<int64_t>(total, 1));
  return 1.0 - (1.0 - base) * (std::cos(M_PI * k / K) + 1.0) / 2.0;
}

namespace {

struct GatherFunction : public torch::autograd::Function<GatherFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor local, Communicator* comm) {
    ctx->saved_data["comm"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(comm));
    ctx->saved_data["rows"] = local.size(0);
    const torch::Tensor flat = local.contiguous().reshape({-1});
    torch::Tensor full = torch::empty({flat.numel() * comm->world_size()}, flat.options());
    comm->all_gather(full, flat);
    std::vector<int64_t> shape = local.sizes().vec();
    shape[0] *= comm->world_size();
    return full.view(shape);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto* comm = reinterpret_cast<Communicator*>(static_cast<intptr_t>(ctx->saved_data["comm"].toInt()));
    const int64_t rows = ctx->saved_data["rows"].toInt();
    // Every rank's loss depends on this rank's rows: their gradient is the sum over the ranks.
    torch::Tensor g = grads[0].contiguous().clone();
    comm->all_reduce(g, /*average=*/false);
    return {g.narrow(0, comm->rank() * rows, rows), torch::Tensor()};
  }
};

// A head: Linear layers with BatchNorm (batch statistics, no running averages: heads are never run in
// eval mode) and ReLU or GELU between them. sync: the statistics are those of the global batch, over
// an all-gather that carries gradients (SyncBatchNorm's arithmetic).
class Head : public nn::Module {
 public:
  Head(const std::vector<int64_t>& dims, bool bn, bool gelu, Communicator* sync_comm)
      : bn_(bn), gelu_(gelu), comm_(sync_comm) {
    for (size_t i = 0; i + 1 < dims.size(); ++i) {
      fc_.push_back(register_module("fc" + std::to_string(i), nn::Linear(dims[i], dims[i + 1])));
      flops_ += 2.0 * static_cast<double>(dims[i]) * dims[i + 1];
      if (bn && i + 2 < dims.size()) {
        gamma_.push_back(register_parameter("bn" + std::to_string(i) + "_weight", torch::ones({dims[i + 1]})));
        beta_.push_back(register_parameter("bn" + std::to_string(i) + "_bias", torch::zeros({dims[i + 1]})));
      }
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < fc_.size(); ++i) {
      x = torch::linear(x, fc_[i]->weight, fc_[i]->bias);
      if (i + 1 == fc_.size()) break;
      if (bn_) {
        const torch::Tensor xf = x.to(torch::kFloat);
        const torch::Tensor stats = comm_ ? gather_with_grad(xf, comm_) : xf;
        const torch::Tensor mean = stats.mean(0), var = stats.var(0, /*unbiased=*/false);
        x = ((xf - mean) / torch::sqrt(var + 1e-5) * gamma_[i] + beta_[i]).to(x.scalar_type());
      }
      x = gelu_ ? torch::gelu(x) : torch::relu(x);
    }
    return x;
  }
  double flops() const { return flops_; }

 private:
  bool bn_, gelu_;
  Communicator* comm_;
  std::vector<nn::Linear> fc_;
  std::vector<torch::Tensor> gamma_, beta_;
  double flops_ = 0;
};

// The teacher of BYOL and DINO: copies of the encoder and heads, moved by EMA, never trained.
struct Teacher {
  std::shared_ptr<ReferenceModel> encoder;
  std::vector<std::shared_ptr<nn::Module>> heads;
  std::vector<torch::Tensor> params() const {
    std::vector<torch::Tensor> out = encoder->parameters();
    for (const auto& h : heads)
      for (const auto& p : h->parameters()) out.push_back(p);
    return out;
  }
};

}  // namespace

torch::Tensor gather_with_grad(const torch::Tensor& local, Communicator* comm) {
  if (!comm || comm->world_size() == 1) return local;
  return GatherFunction::apply(local, comm);
}

SslObjective::SslObjective(std::shared_ptr<ReferenceModel> encoder, const RunConfig& c, Context ctx)
    : encoder_(std::move(encoder)), config_(c), ctx_(ctx) {
  // The classifier is not part of pre-training (it would get no gradient, which DDP refuses).
  encoder_->unregister_module("head");
  register_module("encoder", encoder_);
}

void SslObjective::finish_setup(double flops_per_sample) {
  parameters_ = count_parameters(*this);
  flops_ = flops_per_sample;
}

namespace {

double encoder_forward_flops(const ReferenceModel& e) { return e.training_flops_per_sample() / 3.0; }

Communicator* sync_comm(const RunConfig& c, const Context& ctx) {
  return c.projector_bn == "sync" && ctx.world > 1 ? ctx.comm : nullptr;
}

std::string bn_label(const RunConfig& c, const Context& ctx) {
  return ctx.world == 1 ? "one process" : (c.projector_bn == "sync" ? "synchronised" : "per-rank");
}

// ---- SimCLR -----------------------------------------------------------------------------------------
class SimClr : public SslObjective {
 public:
  SimClr(std::shared_ptr<ReferenceModel> enc, const RunConfig& c, Context ctx) : SslObjective(std::move(enc), c, ctx) {
    projector_ = register_module("projector", std::make_shared<Head>(std::vector<int64_t>{feature_dim(), 512, 128}, true, false,
                                                                     sync_comm(c, ctx)));
    global_ = ctx.world > 1 && c.inject != "local-negatives";
    finish_setup(2 * 3 * (encoder_forward_flops(*encoder_) + projector_->flops()));
  }
  torch::Tensor loss(const Batch& b) override {
    return loss_on_views(make_views(b.input, simclr_view(), simclr_view(), *ctx_.augment));
  }
  torch::Tensor loss_on_views(const torch::Tensor& v) override {
    const auto z = projector_->forward(encoder_->features(v)).chunk(2);
    const int64_t N = z[0].size(0);
    torch::Tensor l;
    int64_t candidates = N;
    if (global_) {
      // Negatives from every rank: each rank's anchors against the global batch.
      const torch::Tensor all1 = gather_with_grad(z[0].to(torch::kFloat), ctx_.comm), all2 = gather_with_grad(z[1].to(torch::kFloat), ctx_.comm);
      l = nt_xent(z[0], z[1], config_.ssl_temperature, all1, all2, ctx_.rank * N);
      candidates = all1.size(0);
    } else {
      l = nt_xent(z[0], z[1], config_.ssl_temperature);
    }
    EmbeddingSample s;
    s.embeddings = z[0].detach();
    s.collapse_loss = std::log(2.0 * candidates - 1);
    sample_ = s;
    effective_ = candidates;
    return l;
  }
  json describe() const override {
    return {{"views", 2}, {"effective_batch", effective_ * 2}, {"negatives_per_anchor", 2 * effective_ - 2},
            {"negatives", ctx_.world == 1 ? "one process" : (global_ ? "global" : "per-rank")},
            {"projector_bn", bn_label(config_, ctx_)}, {"temperature", config_.ssl_temperature}};
  }

 private:
  std::shared_ptr<Head> projector_;
  bool global_ = false;
  int64_t effective_ = 0;
};

// ---- BYOL and DINO: EMA teachers ---------------------------------------------------------------------
class WithTeacher : public SslObjective {
 public:
  using SslObjective::SslObjective;
  void after_step(int64_t applied, int64_t total) override {
    if (!teacher_.encoder) return;
    torch::NoGradGuard no_grad;
    const double tau = ema_momentum(config_.ema_tau, applied, total);
    last_tau_ = tau;
    const auto t = teacher_.params(), s = student_params();
    for (size_t i = 0; i < t.size(); ++i) t[i].mul_(tau).add_(s[i].detach(), 1.0 - tau);
  }
  std::vector<torch::Tensor> teacher_parameters() const { return teacher_.encoder ? teacher_.params() : std::vector<torch::Tensor>{}; }
  double last_tau() const { return last_tau_; }
  std::optional<uint64_t> teacher_fingerprint() override {
    if (!teacher_.encoder) return std::nullopt;
    uint64_t h = 1469598103934665603ULL;
    for (const auto& p : teacher_.params()) h = fingerprint(p, h);
    return h;
  }

 protected:
  // The teacher's counterpart of each parameter, in order.
  virtual std::vector<torch::Tensor> student_params() = 0;
  virtual std::vector<std::shared_ptr<nn::Module>> make_heads() = 0;
  // Built at the first step, after the parallel strategy broadcast rank 0's weights: a copy of them.
  // teacher-drift (a fault) gives ranks other than 0 a teacher of their own random weights, as a
  // teacher deep-copied before the broadcast would have.
  void ensure_teacher(const ModelPreset& preset, const DataShape& shape) {
    if (teacher_.encoder) return;
    torch::NoGradGuard no_grad;
    auto gen = at::detail::getDefaultCPUGenerator();
    torch::Tensor saved;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      saved = gen.get_state();
    }
    const bool drift = config_.inject == "teacher-drift" && ctx_.rank != 0;
    torch::manual_seed(static_cast<uint64_t>(config_.seed + (drift ? 7777 * (ctx_.rank + 1) : 0)));
    teacher_.encoder = make_model(preset, shape);
    teacher_.encoder->unregister_module("head");
    teacher_.heads = make_heads();
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(saved);  // the training's own draws (dropout, data) are not disturbed
    }
    const torch::Tensor like = encoder_->parameters().front();
    teacher_.encoder->to(like.device(), like.scalar_type());
    for (auto& h : teacher_.heads) h->to(like.device(), like.scalar_type());
    const auto t = teacher_.params(), s = student_params();
    if (t.size() != s.size()) throw std::logic_error("teacher and student differ in parameter count");
    if (!drift)
      for (size_t i = 0; i < t.size(); ++i) t[i].copy_(s[i].detach());
    for (auto& p : t) p.set_requires_grad(false);
  }
  Teacher teacher_;
  double last_tau_ = 0;
};

class Byol : public WithTeacher {
 public:
  Byol(std::shared_ptr<ReferenceModel> enc, const RunConfig& c, Context ctx, ModelPreset preset, DataShape shape)
      : WithTeacher(std::move(enc), c, ctx), preset_(std::move(preset)), shape_(shape) {
    projector_ = register_module("projector", projector());
    predictor_ = register_module("predictor", std::make_shared<Head>(std::vector<int64_t>{128, 512, 128}, true, false, sync_comm(c, ctx)));
    const double enc_f = encoder_forward_flops(*encoder_);
    finish_setup(2 * 3 * (enc_f + projector_->flops() + predictor_->flops()) + 2 * (enc_f + projector_->flops()));
  }
  torch::Tensor loss(const Batch& b) override {
    ensure_teacher(preset_, shape_);
    const torch::Tensor v = make_views(b.input, byol_view(0), byol_view(1), *ctx_.augment);
    const torch::Tensor online = projector_->forward(encoder_->features(v));
    const auto p = predictor_->forward(online).chunk(2);
    std::vector<torch::Tensor> z;
    {
      torch::NoGradGuard no_grad;
      auto* head = static_cast<Head*>(teacher_.heads[0].get());
      z = head->forward(teacher_.encoder->features(v)).chunk(2);
    }
    // Symmetrised over the two view orders, summed as in the reference (range [0, 8]).
    const torch::Tensor l = byol_loss(p[0], z[1]) + byol_loss(p[1], z[0]);
    EmbeddingSample s;
    s.embeddings = online.chunk(2)[0].detach();
    sample_ = s;
    return l;
  }
  json describe() const override {
    return {{"views", 2}, {"effective_batch", 2 * config_.batch_size}, {"negatives", nullptr},
            {"projector_bn", bn_label(config_, ctx_)}, {"teacher", "EMA of encoder and projector (parameters only; BN statistics its own)"},
            {"tau_start", config_.ema_tau}, {"tau_end", last_tau_}};
  }

 protected:
  std::shared_ptr<Head> projector() {
    return std::make_shared<Head>(std::vector<int64_t>{encoder_->feature_dim(), 512, 128}, true, false, sync_comm(config_, ctx_));
  }
  std::vector<torch::Tensor> student_params() override {
    std::vector<torch::Tensor> out = encoder_->parameters();
    for (const auto& p : projector_->parameters()) out.push_back(p);
    return out;
  }
  std::vector<std::shared_ptr<nn::Module>> make_heads() override { return {projector()}; }

 private:
  ModelPreset preset_;
  DataShape shape_;
  std::shared_ptr<Head> projector_, predictor_;
};

// DINO's head: an MLP to a bottleneck, L2-normalised, then a weight-normalised linear layer with its
// norm fixed at 1 (weight_g = 1), so its output is a cosine against K prototypes.
class DinoHead : public nn::Module {
 public:
  DinoHead(int64_t in, int64_t prototypes) {
    mlp_ = register_module("mlp", std::make_shared<Head>(std::vector<int64_t>{in, 512, 512, 128}, false, true, nullptr));
    last_ = register_parameter("last_layer", torch::randn({prototypes, 128}) * 0.02);
  }
  torch::Tensor forward(const torch::Tensor& x, bool freeze_last) {
    const torch::Tensor h = F::normalize(mlp_->forward(x).to(torch::kFloat), F::NormalizeFuncOptions().dim(1));
    // Frozen: the prototypes get a zero gradient (every rank still reduces it, as DDP requires).
    const torch::Tensor w = freeze_last ? last_.detach() + 0 * last_ : last_;
    return h.mm(F::normalize(w.to(torch::kFloat), F::NormalizeFuncOptions().dim(1)).t());
  }
  double flops() const { return mlp_->flops() + 2.0 * 128 * last_.size(0); }

 private:
  std::shared_ptr<Head> mlp_;
  torch::Tensor last_;
};

class Dino : public WithTeacher {
 public:
  Dino(std::shared_ptr<ReferenceModel> enc, const RunConfig& c, Context ctx, ModelPreset preset, DataShape shape)
      : WithTeacher(std::move(enc), c, ctx), preset_(std::move(preset)), shape_(shape) {
    head_ = register_module("dino_head", std::make_shared<DinoHead>(feature_dim(), c.dino_prototypes));
    const double enc_f = encoder_forward_flops(*encoder_);
    finish_setup(2 * 3 * (enc_f + head_->flops()) + 2 * (enc_f + head_->flops()));
  }
  torch::Tensor loss(const Batch& b) override {
    return loss_on_views(make_views(b.input, simclr_view(), simclr_view(), *ctx_.augment));
  }
  torch::Tensor loss_on_views(const torch::Tensor& v) override {
    ensure_teacher(preset_, shape_);
    const bool frozen = step_ < config_.dino_freeze_last_steps;
    const auto s = head_->forward(encoder_->features(v), frozen).chunk(2);
    torch::Tensor t_all;
    {
      torch::NoGradGuard no_grad;
      auto* head = static_cast<DinoHead*>(teacher_.heads[0].get());
      t_all = head->forward(teacher_.encoder->features(v), false);
    }
    const auto t = t_all.chunk(2);
    if (!center_.defined()) center_ = torch::zeros({1, t_all.size(1)}, t_all.options());
    const torch::Tensor l = dino_loss({s[0], s[1]}, {t[0], t[1]}, center_, config_.dino_student_temp, config_.dino_teacher_temp);
    EmbeddingSample e;
    e.embeddings = s[0].detach();
    e.collapse_loss = std::log(static_cast<double>(config_.dino_prototypes));
    e.teacher_probs = torch::softmax((t[0] - center_) / config_.dino_teacher_temp, -1);
    e.student_probs = torch::softmax(s[0].detach() / config_.dino_student_temp, -1);
    sample_ = e;
    // The centre moves after the loss, with the teacher outputs of the global batch.
    torch::Tensor batch_center = t_all.mean(0, /*keepdim=*/true).contiguous();
    if (ctx_.comm && ctx_.world > 1) ctx_.comm->all_reduce(batch_center, /*average=*/true);
    center_ = dino_center_update(center_, batch_center, config_.dino_center_momentum);
    ++step_;
    return l;
  }
  ReferenceModel& eval_encoder() override { return teacher_.encoder ? *teacher_.encoder : *encoder_; }
  const torch::Tensor& center() const { return center_; }
  json describe() const override {
    return {{"views", 2}, {"effective_batch", 2 * config_.batch_size}, {"negatives", nullptr},
            {"prototypes", config_.dino_prototypes}, {"teacher", "EMA of encoder and head (parameters only)"},
            {"center", ctx_.world > 1 ? "all-reduced over ranks" : "one process"},
            {"tau_start", config_.ema_tau}, {"tau_end", last_tau_}, {"evaluated", "teacher encoder"}};
  }

 protected:
  std::vector<torch::Tensor> student_params() override {
    std::vector<torch::Tensor> out = encoder_->parameters();
    for (const auto& p : head_->parameters()) out.push_back(p);
    return out;
  }
  std::vector<std::shared_ptr<nn::Module>> make_heads() override {
    return {std::make_shared<DinoHead>(encoder_->feature_dim(), config_.dino_prototypes)};
  }

 private:
  ModelPreset preset_;
  DataShape shape_;
  std::shared_ptr<DinoHead> head_;
  torch::Tensor center_;
};

// ---- MAE ----------------------------------------------------------------------------------------------
class Mae : public SslObjective {
 public:
  Mae(std::shared_ptr<ReferenceModel> enc, const RunConfig& c, Context ctx) : SslObjective(std::move(enc), c, ctx) {
    vit_ = dynamic_cast<PatchEncoder*>(encoder_.get());
    const int64_t L = vit_->patches(), D = vit_->dim(), pp = vit_->patch() * vit_->patch(), Dd = 64;
    keep_ = std::clamp<int64_t>(static_cast<int64_t>(static_cast<double>(L) * (1.0 - c.mask_ratio)), 1, L - 1);
    embed_ = register_module("decoder_embed", nn::Linear(D, Dd));
    mask_token_ = register_parameter("mask_token", torch::randn({1, 1, Dd}) * 0.02);
    pos_ = register_parameter("decoder_pos", torch::randn({1, L, Dd}) * 0.02);
    for (int i = 0; i < 2; ++i) blocks_.push_back(register_module("decoder_block" + std::to_string(i), std::make_shared<TransformerBlock>(Dd, 4, 0.0, /*causal=*/false)));
    norm_ = register_module("decoder_norm", nn::LayerNorm(nn::LayerNormOptions({Dd})));
    pred_ = register_module("decoder_pred", nn::Linear(Dd, pp));
    double decoder = 2.0 * keep_ * D * Dd + 2.0 * L * Dd * pp;
    for (const auto& b : blocks_) decoder += b->forward_flops(L);
    finish_setup(3 * (2.0 * L * pp * D + vit_->encode_flops(keep_) + decoder));
  }
  torch::Tensor loss(const Batch& b) override {
    const torch::Tensor view = make_view(b.input, mae_view(), *ctx_.augment);
    const int64_t B = view.size(0), L = vit_->patches(), D = vit_->dim();
    const torch::Tensor tokens = vit_->embed(view);
    // Per-sample random masking (MAE's random_masking): shuffle by noise, keep the first keep_.
    const torch::Tensor noise = torch::rand({B, L}, *ctx_.augment).to(view.device());
    const torch::Tensor shuffle = torch::argsort(noise, /*dim=*/int64_t{1}), restore = torch::argsort(shuffle, int64_t{1});
    const torch::Tensor kept = shuffle.narrow(1, 0, keep_);
    const torch::Tensor visible = torch::gather(tokens, 1, kept.unsqueeze(-1).expand({B, keep_, D}));
    const torch::Tensor latent = vit_->encode(visible);
    torch::Tensor x = torch::linear(latent, embed_->weight, embed_->bias);
    const int64_t Dd = x.size(2);
    x = torch::cat({x, mask_token_.to(x.scalar_type()).expand({B, L - keep_, Dd})}, 1);
    x = torch::gather(x, 1, restore.unsqueeze(-1).expand({B, L, Dd})) + pos_;
    for (auto& blk : blocks_) x = blk->forward(x);
    const torch::Tensor pred = torch::linear(norm_->forward(x), pred_->weight, pred_->bias);
    torch::Tensor mask = torch::ones({B, L}, view.options().dtype(torch::kFloat));
    mask.narrow(1, 0, keep_).zero_();
    mask = torch::gather(mask, 1, restore);
    const torch::Tensor target = patchify(view, vit_->patch());
    {
      // The loss of predicting zeros: with norm_pix, near-constant patches (a third of Fashion-MNIST's
      // 4x4 patches are all background) are free, so this is the floor a useful decoder must beat.
      torch::NoGradGuard no_grad;
      zero_loss_sum_ += mae_loss(torch::zeros_like(target), target, mask, config_.norm_pix).item<double>();
      ++zero_loss_n_;
    }
    EmbeddingSample s;
    s.embeddings = latent.mean(1).detach();
    sample_ = s;
    return mae_loss(pred, target, mask, config_.norm_pix);
  }
  json describe() const override {
    return {{"views", 1}, {"effective_batch", config_.batch_size}, {"negatives", nullptr},
            {"mask_ratio", config_.mask_ratio}, {"visible_patches", keep_}, {"patches", vit_->patches()},
            {"norm_pix", config_.norm_pix}, {"decoder", "2 blocks, d=64"},
            {"zero_predictor_loss", zero_loss_n_ ? json(zero_loss_sum_ / zero_loss_n_) : json(nullptr)}};
  }

 private:
  PatchEncoder* vit_ = nullptr;
  int64_t keep_ = 1;
  nn::Linear embed_{nullptr}, pred_{nullptr};
  torch::Tensor mask_token_, pos_;
  std::vector<std::shared_ptr<TransformerBlock>> blocks_;
  nn::LayerNorm norm_{nullptr};
  double zero_loss_sum_ = 0;
  int64_t zero_loss_n_ = 0;
};

}  // namespace

std::string unsupported_method(const RunConfig& c, const ModelPreset& preset) {
  if (c.method == "supervised") return "";
  if (preset.language_model()) return c.method + " pre-trains image encoders; " + preset.name + " is a language model";
  if (c.method == "mae" && preset.family != "vit") return "mae masks patches: it needs a vit model, not " + preset.name;
  if ((c.method == "byol" || c.method == "dino") && (c.parallel == "zero3" || c.parallel == "hsdp"))
    return c.method + "'s EMA teacher needs the student's full parameters after every step; " + c.parallel + " holds only shards";
  if (c.inject == "local-negatives" && c.method != "simclr") return "local-negatives is a simclr fault";
  if (c.inject == "teacher-drift" && c.method != "byol" && c.method != "dino") return "teacher-drift needs an EMA teacher (byol, dino)";
  return "";
}

std::shared_ptr<SslObjective> make_objective(const RunConfig& c, std::shared_ptr<ReferenceModel> encoder,
                                             const ModelPreset& preset, const DataShape& shape, Context ctx) {
  if (const std::string why = unsupported_method(c, preset); !why.empty()) throw UsageError(why);
  if (c.method == "simclr") return std::make_shared<SimClr>(std::move(encoder), c, ctx);
  if (c.method == "byol") return std::make_shared<Byol>(std::move(encoder), c, ctx, preset, shape);
  if (c.method == "dino") return std::make_shared<Dino>(std::move(encoder), c, ctx, preset, shape);
  if (c.method == "mae") return std::make_shared<Mae>(std::move(encoder), c, ctx);
  throw UsageError("unknown method '" + c.method + "'");
}

std::vector<std::pair<std::string, torch::Tensor>> step_probe(const RunConfig& config, const ModelPreset& preset,
                                                              const DataShape& shape) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  if (preset.family != "cnn") return out;
  const double lr = 0.1;
  const int64_t total_steps = 10;  // the EMA schedule's length: tau at step 1 of 10
  for (const std::string method : {"simclr", "dino"}) {
    RunConfig c = config;
    c.method = method;
    c.inject = "";
    c.dino_prototypes = 64;
    c.dino_freeze_last_steps = 0;
    torch::manual_seed(static_cast<uint64_t>(c.seed));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(c.seed) + 1);
    Context ctx;
    ctx.augment = &gen;
    ctx.total_steps = total_steps;
    const std::shared_ptr<SslObjective> objective = make_objective(c, make_model(preset, shape), preset, shape, ctx);
    objective->train();
    const std::string key = method + "_step.";
    const torch::Tensor views = torch::randn({8, shape.channels, shape.height, shape.width}, gen);
    const auto named = objective->named_parameters();
    for (const auto& item : named) out.emplace_back(key + "before/" + item.key(), item.value().detach().clone());
    const torch::Tensor loss = objective->loss_on_views(views);
    loss.backward();
    {
      torch::NoGradGuard no_grad;
      for (const auto& item : named) item.value().add_(item.value().grad(), -lr);  // plain SGD
    }
    objective->after_step(1, total_steps);
    out.insert(out.end(), {{key + "views", views}, {key + "lr", torch::tensor(lr, torch::kDouble)}, {key + "loss", loss.detach()}});
    for (const auto& item : named) out.emplace_back(key + "after/" + item.key(), item.value().detach().clone());
    if (const auto* dino = dynamic_cast<const Dino*>(objective.get())) {
      const auto teacher = dino->teacher_parameters();
      for (size_t i = 0; i < teacher.size() && i < named.size(); ++i)
        out.emplace_back(key + "teacher_after/" + named[i].key(), teacher[i].detach().clone());
      out.insert(out.end(), {{key + "center_after", dino->center().detach().clone()},
                             {key + "tau", torch::tensor(dino->last_tau(), torch::kDouble)},
                             {key + "prototypes", torch::tensor(c.dino_prototypes, torch::kLong)}});
    }
  }
  return out;
}

}  // namespace trainscope::suites::ssl
