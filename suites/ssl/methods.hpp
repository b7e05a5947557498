#pragma once
// Self-supervised objectives (the `method` axis): SimCLR, BYOL, DINO, MAE.
//
// Each is a ReferenceModel wrapping the cell's encoder (its classifier removed) and the method's
// heads, so the training loop stays one loop: Trainer::step calls loss(batch), which builds the views
// from the rank's augmentation generator and returns the objective, and after_step(), which moves an
// EMA teacher. The parallel strategies see the encoder and the heads as one module; a teacher is not
// a submodule (it is never trained, reduced or sharded). Conventions follow the reference code
// (google-research/simclr, deepmind byol, facebookresearch dino and mae; see docs/ssl.md), and every
// deviation is named where it is made.
#include <memory>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/errors.hpp"
#include "suites/parallel/comm.hpp"
#include "suites/models/models.hpp"

namespace trainscope::suites::ssl {

// ---- losses (unit-tested against hand-computed values) -------------------------------------------
// NT-Xent over 2N anchors (z1, z2: this rank's two views, [N, d]), averaged over the anchors and so
// over both directions (lightly's convention; TF SimCLR sums the two, twice this). The candidates are
// all1/all2 ([M, d], every rank's views, this rank's at rows offset..offset+N; defaults: z1/z2), so
// negatives come from the global batch. At collapse (all embeddings equal) the loss is ln(2M - 1).
torch::Tensor nt_xent(const torch::Tensor& z1, const torch::Tensor& z2, double temperature,
                      const torch::Tensor& all1 = {}, const torch::Tensor& all2 = {}, int64_t offset = 0);
// BYOL's regression loss 2 - 2 cos(p, z), averaged over the batch (z is the target: detached).
torch::Tensor byol_loss(const torch::Tensor& p, const torch::Tensor& z);
// DINO: cross-entropy of the centred, sharpened teacher distribution against the student's, over every
// pair of different views, averaged over the pairs and the batch.
torch::Tensor dino_loss(const std::vector<torch::Tensor>& student, const std::vector<torch::Tensor>& teacher,
                        const torch::Tensor& center, double student_temp, double teacher_temp);
// MAE: mean squared error per patch, averaged over the masked patches only (mask 1 = hidden);
// norm_pix standardises each target patch by its own mean and (unbiased) variance first.
torch::Tensor mae_loss(const torch::Tensor& pred, const torch::Tensor& target, const torch::Tensor& mask, bool norm_pix);
// DINO's centre after a step: the EMA of the teacher outputs' mean over the global batch (batch_center,
// already averaged over the ranks).
torch::Tensor dino_center_update(const torch::Tensor& center, const torch::Tensor& batch_center, double momentum);
// The four objectives on fixed tensors drawn from the config's seed, for `trainscope parity` (the
// Python side recomputes them with lightly on the same tensors): per method its inputs, the loss as
// the objective computes it, the gradients of the loss with respect to the trained inputs, and the
// settings it used; NT-Xent also as 2 ranks see it on a gathered batch, DINO also the centre after the
// step. Names are "<method>.<what>".
std::vector<std::pair<std::string, torch::Tensor>> loss_probe(const RunConfig& config);
// One whole SimCLR step and one DINO step on fixed views, for `trainscope parity` (the Python side
// runs the same step with lightly's loss): a fresh encoder of the cell's preset and data shape with
// the method's heads, 2N = 8 views drawn from the seed, the loss, plain SGD (lr 0.1), and for DINO the
// EMA teacher and the centre after the step. Per method "<method>_step.<what>": views, lr, loss, the
// parameters before and after ("before/<name>", "after/<name>"), DINO's teacher after the step (named
// as the student's parameter it follows), its centre and tau. DINO uses 64 prototypes here (not the
// config's) so that the reference can bound its difference through the whole Jacobian. Empty for
// encoders the Python mirror does not have (only cnn presets).
std::vector<std::pair<std::string, torch::Tensor>> step_probe(const RunConfig& config, const ModelPreset& preset,
                                                              const DataShape& shape);
// BYOL's target schedule: tau_k = 1 - (1 - base)(cos(pi k / K) + 1) / 2, from base at k = 0 to 1 at K.
double ema_momentum(double base, int64_t step, int64_t total);

// All-gather along dim 0 in rank order, whose backward sums the gradient over the ranks and returns
// this rank's slice (so that a loss over the gathered batch trains every rank's encoder exactly).
torch::Tensor gather_with_grad(const torch::Tensor& local, Communicator* comm);

// What a method needs from the trainer.
struct Context {
  at::Generator* augment = nullptr;  // the rank's augmentation generator
  Communicator* comm = nullptr;      // null for one process
  int rank = 0, world = 1;
  int64_t total_steps = 1;           // warm-up + measured: the EMA schedule's length
};

class SslObjective : public ReferenceModel {
 public:
  bool classifies() const override { return false; }
  torch::Tensor forward(const torch::Tensor& x) override { return encoder_->features(x); }
  torch::Tensor features(const torch::Tensor& x) override { return encoder_->features(x); }
  int64_t feature_dim() const override { return encoder_->feature_dim(); }
  int64_t analytic_parameters() const override { return parameters_; }
  double training_flops_per_sample() const override { return flops_; }
  std::vector<double> block_forward_flops() const override { return encoder_->block_forward_flops(); }
  std::vector<torch::nn::Module*> blocks() override { return encoder_->blocks(); }
  void set_boundary(Boundary b) override { encoder_->set_boundary(std::move(b)); }
  void set_block_wrapper(BlockWrapper w) override { encoder_->set_block_wrapper(std::move(w)); }
  void set_checkpoint(const CheckpointPolicy& p) override {
    ReferenceModel::set_checkpoint(p);
    encoder_->set_checkpoint(p);
  }
  std::optional<EmbeddingSample> last_embeddings() const override { return sample_; }

  ReferenceModel& encoder() { return *encoder_; }
  // The encoder that evaluation reads: DINO's teacher (as the DINO paper evaluates), else the trained one.
  virtual ReferenceModel& eval_encoder() { return *encoder_; }
  // How the method trained: views, the effective batch of its loss, where negatives came from, BN.
  virtual json describe() const = 0;
  // The objective on views already made ([2N, ...]: the first view of each sample, then the second),
  // for the two-view methods with a step probe (SimCLR, DINO); loss() makes the views, then calls it.
  virtual torch::Tensor loss_on_views(const torch::Tensor& /*views*/) {
    throw UsageError("this method has no two-view step to probe");
  }

 protected:
  SslObjective(std::shared_ptr<ReferenceModel> encoder, const RunConfig& c, Context ctx);
  void finish_setup(double flops_per_sample);  // after the heads are registered
  std::shared_ptr<ReferenceModel> encoder_;
  RunConfig config_;
  Context ctx_;
  int64_t parameters_ = 0;
  double flops_ = 0;
  std::optional<EmbeddingSample> sample_;
  int64_t step_ = 0;  // forward passes run (the step, for the health sample)
};

// The method's model around `encoder` (which loses its classifier). UsageError for a combination that
// cannot run (MAE without a ViT encoder).
std::shared_ptr<SslObjective> make_objective(const RunConfig& c, std::shared_ptr<ReferenceModel> encoder,
                                             const ModelPreset& preset, const DataShape& shape, Context ctx);

// Why a configuration's method cannot run ("" when it can).
std::string unsupported_method(const RunConfig& c, const ModelPreset& preset);

}  // namespace trainscope::suites::ssl
