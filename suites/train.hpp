#pragma once
// The training loop: one step reads top to bottom (batch, forward under the precision's autocast,
// backward, optimizer), calling the hooks of core/hooks.hpp at fixed points.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/hooks.hpp"
#include "suites/parallel/comm.hpp"
#include "suites/models/data.hpp"
#include "suites/models/models.hpp"
#include "suites/parallel/pipeline.hpp"
#include "suites/parallel/strategies.hpp"
#include "suites/techniques/precision.hpp"
#include "suites/ssl/methods.hpp"

namespace trainscope::suites {

struct TrainOutcome {
  std::string status = "ok";  // ok | diverged
  std::string reason;
  int64_t steps_run = 0;
  double final_loss = 0;                 // mean of the last (up to) 10 steps' losses
  std::optional<double> accuracy;        // held-out accuracy for classifiers
  std::vector<std::pair<int64_t, double>> loss_curve;
  std::vector<double> step_losses;       // every step's loss (mean over ranks), warm-up included
  std::optional<int64_t> first_nonfinite_step;
  bool budget_stopped = false;           // time_budget_s ran out before the last step
};


// Resolves "auto" to cuda when LibTorch sees a GPU, else cpu; "cuda" means "cuda:0".
std::string resolve_device(const std::string& requested);
// Why a config cannot run here ("" when it can): tf32 without CUDA, cuda without a device, ...
std::string unsupported_reason(const RunConfig& c, const std::string& device);
// Why a resolved device ("cpu", "cuda:i") is not there ("" when it is).
std::string device_unavailable(const std::string& device);

// What a PyTorch-side reference (tests/parity) needs to replay a run: the weights it started from,
// every global batch, the CPU generator before the first forward (dropout masks), step 0's
// gradients, the loss-scale pattern and the dtype each block's output had. Kept when parity_dump is on
// (the batches stay in memory, so a parity cell's peak_bytes include them; its activation bytes and
// model-state bytes, which are what parity compares, do not).
struct ParityRecord {
  std::vector<std::pair<std::string, torch::Tensor>> initial, first_grads;
  std::vector<torch::Tensor> inputs, targets;
  torch::Tensor rng_state;
  std::vector<double> scales;
  std::vector<bool> found_inf;
  std::vector<std::pair<std::string, std::string>> block_dtypes;
};

// Loads a name -> tensor file written by Python's torch.save (or a parity dump: its "initial") into
// the model's parameters; UsageError on a missing name or a shape that differs.
// skip_prefix: parameters whose name starts with it may be absent from the file (a classifier head
// that a saved encoder has not got).
void load_parameters(torch::nn::Module& model, const std::string& path, const std::string& skip_prefix = "");
// Writes the module's parameters and buffers as a name -> tensor dict (torch.load reads it).
void save_parameters(const torch::nn::Module& module, const std::string& path);

class Trainer {
 public:
  // comm: the rank's communicator (null for a single process). Each data-parallel rank trains on its
  // slice of the global batch (dp x batch_size samples; the tp ranks of one slice share it), so N ranks
  // see what one process would.
  Trainer(const RunConfig& config, const std::string& device, Communicator* comm = nullptr);
  RunInfo info() const;
  // One optimizer step (batch `step` of the data stream); returns the loss tensor (not synchronised).
  torch::Tensor step(int64_t step, Hooks& hooks);
  // Held-out accuracy, or nullopt when the model or data has none.
  std::optional<double> evaluate();
  ModelStateBytes model_state() const;
  // Makes the full parameters resident (a collective under zero3: every rank calls it) and returns them.
  std::vector<torch::Tensor> full_parameters();
  // What the run trained, by name, on the host: the parameters, or with masters (bf16-master) the fp32
  // masters the optimizer stepped. A collective every rank calls.
  std::vector<std::pair<std::string, torch::Tensor>> final_parameters();
  // Each element averaged over the ranks (the values themselves for a single process); a sync point,
  // which the loop reaches only at log points.
  std::vector<double> global_mean(const torch::Tensor& values);
  ParallelStrategy& strategy() { return *strategy_; }
  // The layout's communicators (its layout with hsdp's node size settled).
  const Mesh& mesh() const { return *mesh_; }
  int rank() const { return rank_; }
  ReferenceModel& model() { return *model_; }
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  const PrecisionMode& mode() const { return mode_; }
  GradScaler* scaler() { return scaler_.get(); }
  int64_t applied_steps() const { return applied_steps_; }
  const ParityRecord* parity() const { return parity_.get(); }
  // The self-supervised objective wrapping the encoder (null for supervised cells).
  ssl::SslObjective* objective() { return objective_.get(); }
  // The encoder evaluation reads: an SSL method's eval encoder, or the model itself.
  ReferenceModel& encoder() { return objective_ ? objective_->eval_encoder() : *model_; }
  DataSource& data() { return *data_; }
  const ModelPreset& preset() const { return preset_; }

 private:
  torch::Tensor boundary(const std::string& block, torch::Tensor x);
  void set_lr(double lr);
  Batch rank_batch(int64_t step, torch::Tensor* flips);
  void fingerprints(int64_t step, const Batch& batch, const torch::Tensor& flips, Hooks& hooks);
  uint64_t parameter_fingerprint();
  std::vector<std::pair<std::string, torch::Tensor>> local_parameters();  // this rank's, tp shards as they are
  // One step's forward and backward over the whole batch; its loss.
  torch::Tensor forward_backward(const Batch& batch, StepInfo& si, Hooks& hooks);
  // pp: this rank's stages' parameters kept, the others emptied; the tied head's pair of ranks.
  void setup_pipeline();
  // The micro-batches' forwards and backwards as the pipeline schedule runs them; the mean loss on every rank.
  torch::Tensor run_pipeline(const Batch& batch, StepInfo& si, Hooks& hooks);
  // The global gradient-norm clip; under tp or pp each rank counts its parameters once across the group.
  void clip_gradients();

  RunConfig config_;
  torch::Device device_;
  ModelPreset preset_;
  PrecisionMode mode_;
  std::unique_ptr<DataSource> data_;
  std::shared_ptr<ReferenceModel> model_;
  std::shared_ptr<ssl::SslObjective> objective_;  // model_ itself, for SSL methods
  std::unique_ptr<Mesh> mesh_;
  std::unique_ptr<ParallelStrategy> strategy_;
  std::vector<torch::Tensor> opt_params_;  // what the optimizer owns: the parameters, or this rank's shards
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  int rank_ = 0, world_ = 1;
  int64_t dp_rank_ = 0, dp_size_ = 1;  // this rank's slice of the global batch: its data-parallel coordinate
  at::Generator augment_gen_;
  std::unique_ptr<GradScaler> scaler_;
  std::unique_ptr<Fp16WeightRounding> weight_rounding_;
  std::vector<BlockObserver*> observers_;  // set per step from the hooks
  int64_t current_step_ = -1;              // -1 outside training steps (evaluation)
  int64_t applied_steps_ = 0;              // optimizer steps taken (skipped ones not counted)
  std::unique_ptr<ParityRecord> parity_;   // parity_dump only
  std::unique_ptr<Pipeline> pipeline_;     // pp > 1, or micro-batches whose gradients accumulate
  int64_t pp_rank_ = 0;
  std::unique_ptr<Communicator> tied_group_;  // pp: the first and last stages' ranks, which both hold a tied head
  std::map<std::string, std::vector<int64_t>> pp_shapes_;  // pp: every parameter's shape before the other stages' were dropped
  std::vector<std::pair<std::string, torch::Tensor>> join_stages(std::vector<std::pair<std::string, torch::Tensor>> local);
};

// Runs warm-up + measured steps with the hooks, then evaluates. A loss that turns non-finite and
// stays so for 10 steps ends the run as `diverged`; `time_budget_s` may end the measured steps early.
TrainOutcome train(Trainer& trainer, const RunConfig& config, Hooks& hooks, RunInfo info);

}  // namespace trainscope::suites
