#include "suites/train.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <ATen/CPUGeneratorImpl.h>

#include "core/compat.hpp"
#include "core/errors.hpp"
#include "core/layout.hpp"
#include "core/stats.hpp"

#ifdef TRAINSCOPE_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace trainscope::suites {
std::string resolve_device(const std::string& requested) {
  if (requested == "auto") return torch::cuda::is_available() ? "cuda:0" : "cpu";
  if (requested == "cuda") return "cuda:0";
  return requested;
}

std::string device_unavailable(const std::string& device) {
  if (device.rfind("cuda", 0) != 0) return "";
  const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
  const int64_t index = device.size() > 5 ? std::stoll(device.substr(5)) : 0;
  if (count == 0) return "no CUDA device visible to LibTorch on this machine";
  if (index >= count) return device + " requested but LibTorch sees " + std::to_string(count) + " GPU(s)";
  return "";
}

std::string unsupported_reason(const RunConfig& c, const std::string& device) {
  const bool cuda = device.rfind("cuda", 0) == 0;
  if (const std::string why = device_unavailable(device); !why.empty()) return why;
  if (c.kind == "collectives") {
    if (c.world_size < 2) return "collectives need world_size >= 2";
    if (c.backend == "nccl" && !cuda) return "nccl needs CUDA devices; this cell runs on " + device;
    if (cuda && c.world_size > static_cast<int64_t>(torch::cuda::device_count()))
      return "needs " + std::to_string(c.world_size) + " GPUs on this machine; LibTorch sees " +
             std::to_string(torch::cuda::device_count());
    return "";
  }
  if (c.kind != "train") {
    if (c.world_size > 1) return c.kind + " measures one device; world_size " + std::to_string(c.world_size) + " is for training cells";
    if (c.kind == "copy-bandwidth" && !cuda) return "host-device copies need a GPU; this cell runs on " + device;
    return "";
  }
  // The layout: its degrees multiply to the world size (RunConfig::from_json refused the rest), and this
  // build implements its dimensions.
  const ParallelLayout layout = resolve_layout(c);
  if (!layout.shard_by_host && layout.world() != c.world_size)
    return "parallel=single runs one process; world_size " + std::to_string(c.world_size) + " needs ddp, zero1/2/3 or a layout";
  if (c.parallel != "single" && c.world_size < 2) return c.parallel + " needs world_size >= 2";
  if (const std::string why = layout_unsupported(layout); !why.empty()) return why;
  const std::string level = layout.strategy();
  if (c.world_size > 1) {
    if (c.backend == "nccl" && !cuda) return "nccl needs CUDA devices; this cell runs on " + device;
    if (cuda && c.world_size > static_cast<int64_t>(torch::cuda::device_count()))
      return "needs " + std::to_string(c.world_size) + " GPUs on this machine for its local ranks; LibTorch sees " +
             std::to_string(torch::cuda::device_count());
    if ((level == "zero3" || level == "hsdp") && precision_mode(c.precision, device, c.fp16).emulated)
      return "fp16 emulation rounds the whole model's weights each step; " + level + " holds only shards of them";
  }
  const PrecisionTraits& traits = precision_traits(c.precision);
  if (traits.cuda_only && !cuda) {
    if (traits.fp8_linear)
      return c.precision + " needs a CUDA GPU of compute capability " + std::to_string(traits.min_compute_capability / 10) + "." +
             std::to_string(traits.min_compute_capability % 10) + " or newer (at::_scaled_mm); on " + device +
             " the overflow probe's fp8 range statistics predict what fp8 would do";
    return c.precision + " needs a CUDA GPU (compute capability " + std::to_string(traits.min_compute_capability / 10) +
           ".x or newer); this cell runs on " + device;
  }
#ifdef TRAINSCOPE_TORCH_CUDA
  if (cuda) {
    const auto* props = at::cuda::getDeviceProperties(static_cast<int>(std::stoll(device.substr(5))));
    if (props->major * 10 + props->minor < traits.min_compute_capability)
      return c.precision + " needs compute capability " + std::to_string(traits.min_compute_capability / 10) + "." +
             std::to_string(traits.min_compute_capability % 10) + " or newer; " + props->name + " has " +
             std::to_string(props->major) + "." + std::to_string(props->minor);
  }
#endif
  const ModelPreset m = resolve_model(c);
  if (const std::string why = ssl::unsupported_method(c, m); !why.empty()) return why;
  if (c.checkpoint == "selective" && !m.language_model())
    return "selective checkpointing recomputes a decoder's attention core; " + m.name + " is no gpt or llama (it would equal none)";
  if (c.checkpoint == "selective-op" && !m.language_model() && m.family != "vit")
    return "selective-op keeps a transformer block's matmul and attention outputs; " + m.name + " has no transformer blocks";
  if (c.attention != "auto" && m.family != "gpt" && m.family != "llama" && m.family != "vit")
    return "attention = " + c.attention + " applies to gpt, llama and vit; " + m.name + " has no attention";
  if (m.family == "llama" && c.dropout > 0) return "Llama 3 has no dropout (dropout = " + std::to_string(c.dropout) + ")";
  const std::string data = resolve_data(c.data, m);
  const bool token_data = data == "synthetic-tokens" || data == "text";
  if (m.language_model() && !token_data) return "model " + m.name + " needs token data, not " + data;
  if (!m.language_model() && token_data) return "model " + m.name + " needs image data, not " + data;
  if (data == "text" && !text_available())
    return "data 'text' needs Debian's fortunes in " + text_dir() + " (apt-get install fortunes)";
  if (data == "fashion-mnist" && !fashion_mnist_available())
    return "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)";
  return "";
}

void save_parameters(const torch::nn::Module& module, const std::string& path) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::TensorType::get());
  for (const auto& item : module.named_parameters()) d.insert(item.key(), item.value().detach().to(torch::kCPU).clone());
  for (const auto& item : module.named_buffers()) d.insert(item.key(), item.value().detach().to(torch::kCPU).clone());
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(d));
  const std::string tmp = path + ".tmp";
  if (const auto dir = std::filesystem::path(path).parent_path(); !dir.empty()) std::filesystem::create_directories(dir);
  {
    std::ofstream out(tmp, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) throw std::runtime_error("save_encoder: cannot write '" + path + "'");
  }
  std::filesystem::rename(tmp, path);
}

void load_parameters(torch::nn::Module& model, const std::string& path, const std::string& skip_prefix) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("initial_parameters: cannot read '" + path + "'");
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  c10::IValue loaded;
  try {
    loaded = torch::pickle_load(bytes);
  } catch (const std::exception& e) {
    throw UsageError("initial_parameters: '" + path + "' is not a torch.save file: " +
                     std::string(e.what()).substr(0, std::string(e.what()).find('\n')));
  }
  if (!loaded.isGenericDict()) throw UsageError("initial_parameters: '" + path + "' holds no name -> tensor dict");
  c10::impl::GenericDict dict = loaded.toGenericDict();
  if (dict.contains("initial") && dict.at("initial").isGenericDict()) dict = dict.at("initial").toGenericDict();
  torch::NoGradGuard no_grad;
  auto named = model.named_parameters();
  for (const auto& item : model.named_buffers()) named.insert(item.key(), item.value());
  for (auto& item : named) {
    const std::string& name = item.key();
    torch::Tensor& param = item.value();
    const bool buffer = !model.named_parameters().contains(name);
    if (!dict.contains(name) || !dict.at(name).isTensor()) {
      // Buffers (BatchNorm statistics) are optional: a parity dump holds parameters only.
      if (buffer || (!skip_prefix.empty() && name.rfind(skip_prefix, 0) == 0)) continue;
      throw UsageError("initial_parameters: '" + path + "' has no tensor '" + name + "'");
    }
    const torch::Tensor t = dict.at(name).toTensor();
    if (t.sizes() != param.sizes())
      throw UsageError("initial_parameters: '" + name + "' has shape " + c10::str(t.sizes()) + " in '" + path +
                       "', the model's is " + c10::str(param.sizes()));
    param.copy_(t);
  }
}

Trainer::Trainer(const RunConfig& config, const std::string& device, Communicator* comm)
    : config_(config), device_(device), preset_(resolve_model(config)),
      mode_(precision_mode(config.precision, device, config.fp16, config.reduce_dtype)), rank_(comm ? comm->rank() : 0),
      world_(comm ? comm->world_size() : 1) {
  preset_.dropout = config.dropout;
  preset_.attention = resolve_attention(config.attention, device, preset_.seq_len);
  // Every rank draws the same initial weights from the same seed, and rank 0's are broadcast anyway.
  // skip-broadcast (a fault) seeds each rank differently and leaves the broadcast out.
  const bool skip_broadcast = config.inject == "skip-broadcast";
  torch::manual_seed(static_cast<uint64_t>(config.seed + (skip_broadcast ? 1000003 * rank_ : 0)));
  // 32-true is strict fp32; tf32 lets cuBLAS and cuDNN use TF32 tensor cores.
  const bool tf32 = precision_traits(config.precision).gemm == "tf32";
  at::globalContext().setAllowTF32CuBLAS(tf32);
  at::globalContext().setAllowTF32CuDNN(tf32);

  data_ = make_data(config.data, preset_, config.seed, config.unlabeled_size);
  model_ = make_model(preset_, data_->shape());
  if (!config.pretrained.empty()) load_parameters(*model_, config.pretrained, "head.");
  if (config.method != "supervised") {
    // The method wraps the encoder: its loss builds the views, its after_step moves the teacher.
    ssl::Context ctx{&augment_gen_, comm, rank_, world_, config.warmup_steps + config.steps};
    objective_ = ssl::make_objective(config, model_, preset_, data_->shape(), ctx);
    model_ = objective_;
  }
  // With masters (bf16-master) the model is built in the masters' dtype and the strategy makes the
  // compute copies: the masters start from the fp32 initialisation, not from its rounding.
  model_->to(device_, mode_.master ? at::kFloat : mode_.param_dtype);
  if (!config.initial_parameters.empty()) load_parameters(*model_, config.initial_parameters);
  if (config.parity_dump && rank_ == 0) {
    // Before the strategy shards anything; rank 0's weights are what the broadcast gives every rank.
    parity_ = std::make_unique<ParityRecord>();
    for (const auto& item : model_->named_parameters()) parity_->initial.emplace_back(item.key(), item.value().detach().to(torch::kCPU).clone());
  }
  if (skip_broadcast) torch::manual_seed(static_cast<uint64_t>(config.seed));  // only the weights differ
  CheckpointPolicy policy = CheckpointPolicy::parse(config.checkpoint);
  policy.check = config.checkpoint_check;
  model_->set_checkpoint(policy);
  model_->set_cross_entropy(config.cross_entropy);
  model_->set_boundary([this](const std::string& block, torch::Tensor x) { return boundary(block, std::move(x)); });
  const ParallelLayout layout = resolve_layout(config);
  mesh_ = std::make_unique<Mesh>(layout.world() > 1 || layout.shard_by_host ? comm : nullptr, layout);
  dp_size_ = mesh_->layout().dp();
  dp_rank_ = mesh_->coordinate("dp_replicate") * mesh_->layout().dp_shard + mesh_->coordinate("dp_shard");
  if (mesh_->layout().tp > 1) {
    // Every rank built the whole model from one seed; it keeps its shards (TP-invariant initialisation).
    TensorParallel tp;
    tp.group = mesh_->group("tp");
    tp.rank = mesh_->coordinate("tp");
    tp.degree = mesh_->layout().tp;
    tp.sequence = config.sequence_parallel;
    tp.regather = config.sp_regather;
    model_->set_tensor_parallel(tp);
    // Megatron's model-parallel generator, seed + 2718 + tp rank (tensor_parallel/random.py:
    // model_parallel_cuda_manual_seed) on a pipeline stage's seed, seed + 100 x pp rank (_set_random_seed);
    // tp-same-dropout-seed (a fault) leaves the tp rank out.
    const int64_t offset = config.inject == "tp-same-dropout-seed" ? 0 : tp.rank;
    tensor_parallel::rng_tracker().seed(static_cast<uint64_t>(config.seed + 100 * mesh_->coordinate("pp") + 2718 + offset));
  } else {
    tensor_parallel::rng_tracker().reset();
  }
  if (mesh_->layout().cp > 1) {
    // The cp ranks of one data-parallel rank share its samples, each with its shard of the sequence.
    ContextParallel cp;
    cp.group = mesh_->group("cp");
    cp.rank = mesh_->coordinate("cp");
    cp.degree = mesh_->layout().cp;
    cp.method = config.cp_method;
    cp.balance = config.cp_balance;
    model_->set_context_parallel(cp);
  }
  setup_pipeline();
  ParamPolicy params;
  params.master = mode_.master;
  params.compute = mode_.param_dtype;
  params.reduce = mode_.reduce_dtype;
  params.reshard_after_forward = config.reshard_after_forward;
  // FSDP2 as torch.distributed.pipelining runs it, where there are data-parallel ranks to reduce over.
  params.defer_reduce = mesh_->layout().pp > 1 && mesh_->layout().dp() > 1;
  strategy_ = make_strategy(*mesh_, config.bucket_mb, config.prefetch, params);
  opt_params_ = strategy_->setup(*model_, !skip_broadcast);
  if (mode_.emulated) weight_rounding_ = std::make_unique<Fp16WeightRounding>(model_->parameters());
  if (mode_.scaler) {
    scaler_ = std::make_unique<GradScaler>(
        ScalerOptions{config.scaler_init, config.scaler_growth, config.scaler_backoff, config.scaler_interval},
        device_);
    // One rank's overflow skips the step on every rank (docs/precision.md: the flag's MAX across ranks).
    if (comm) scaler_->reduce_found_inf = [comm](torch::Tensor& found) { comm->all_reduce_max(found); };
  }
  if (config.optimizer == "sgd")
    optimizer_ = std::make_unique<torch::optim::SGD>(
        opt_params_, torch::optim::SGDOptions(config.lr).momentum(0.9).weight_decay(config.weight_decay));
  else
    optimizer_ = std::make_unique<torch::optim::AdamW>(
        opt_params_, torch::optim::AdamWOptions(config.lr).weight_decay(config.weight_decay));
  // The replicated model draws its dropout masks from the global generator, equal on every rank;
  // rank-dropout-seed (a fault) seeds it per rank. Augmentations draw from a per-rank generator
  // (same-data-seed, a fault: one seed for all).
  if (config.inject == "rank-dropout-seed") torch::manual_seed(static_cast<uint64_t>(config.seed + 7919 * (rank_ + 1)));
  // A pipeline's stages draw their dropout masks from seeds of their own (Megatron's _set_random_seed:
  // seed + 100 x pipeline rank), not the same masks on every stage.
  if (mesh_->layout().pp > 1) torch::manual_seed(static_cast<uint64_t>(config.seed + 100 * pp_rank_));
  const int64_t aug_rank = config.inject == "same-data-seed" ? 0 : rank_ + 1;
  augment_gen_ = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(config.seed * 1000003 + aug_rank));
}

RunInfo Trainer::info() const {
  RunInfo r;
  r.config = &config_;
  r.device = device_.str();
  r.model_name = preset_.name;
  r.parameters = model_->whole_parameter_count();
  r.flops_per_sample = model_->training_flops_per_sample();
  r.causal_flops_per_sample = model_->causal_flops_per_sample();
  if (preset_.language_model()) r.flops_convention = flop_convention_name(FlopConvention::Full);
  r.tokens_per_sample = model_->tokens_per_sample();
  r.attention_flops_per_sample = 3 * model_->selective_forward_flops();  // the attention core, forward + backward
  r.compute_dtype = compute_dtype(precision_traits(config_.precision), device_.is_cuda(), config_.fp16);
  r.recompute_flops_per_sample = model_->recompute_flops_per_sample();
  r.rank = rank_;
  r.world_size = world_;
  r.model_parallel = mesh_->layout().tp * mesh_->layout().pp * mesh_->layout().cp;
  if (Communicator* c = strategy_->comm()) r.collectives = c->implementation();
  if (pipeline_) {
    const pipeline::Schedule& s = pipeline_->schedule();
    const pipeline::Replay replay = pipeline::replay(s, {});
    r.pipeline_schedule = s.name;
    r.pipeline_ranks = s.ranks;
    r.pipeline_stages_per_rank = s.stages_per_rank;
    r.pipeline_microbatches = s.microbatches;
    r.pipeline_bubble_formula = replay.bubble();
    r.pipeline_in_flight_formula = replay.peak_in_flight.at(static_cast<size_t>(pp_rank_));
    r.pipeline_actions = pipeline::format_actions(s.actions.at(static_cast<size_t>(pp_rank_)));
  }
  if (const ContextParallel& cp = model_->context_parallel(); cp.active()) {
    r.cp_method = cp.method;
    r.cp_balance = cp.balance;
    r.cp_ranks = cp.degree;
    r.cp_rank = cp.rank;
    r.cp_pairs_balanced = context_parallel_pairs(preset_.seq_len, cp.degree, true);
    r.cp_pairs_contiguous = context_parallel_pairs(preset_.seq_len, cp.degree, false);
  }
  return r;
}

// Every block output passes here: probes observe it (on their sampled steps) and, in fp16 emulation,
// it is rounded through fp16 (its gradient too, on the way back).
torch::Tensor Trainer::boundary(const std::string& block, torch::Tensor x) {
  torch::Tensor y = mode_.emulated ? round_through_fp16(x) : x;
  if (current_step_ < 0) return y;
  if (parity_ && current_step_ == 0) parity_->block_dtypes.emplace_back(block, c10::toString(x.scalar_type()));
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

// This rank's slice of the global batch (every rank's slice is the same under same-data-seed), with
// random horizontal flips when `augment` is on (`flips` gets the draws).
Batch Trainer::rank_batch(int64_t step, torch::Tensor* flips) {
  const int64_t B = config_.batch_size;
  Batch b = data_->train_batch(step, B * dp_size_);
  if (parity_) {
    parity_->inputs.push_back(b.input.to(torch::kCPU).clone());
    parity_->targets.push_back(b.target.to(torch::kCPU).clone());
  }
  if (dp_size_ > 1) {
    const int64_t slice = config_.inject == "same-data-seed" ? 0 : dp_rank_;
    b.input = b.input.narrow(0, slice * B, B);
    b.target = b.target.narrow(0, slice * B, B);
  }
  if (const ContextParallel& cp = model_->context_parallel(); cp.active()) {
    b.input = context_parallel::shard(b.input, 1, cp);
    b.target = context_parallel::shard(b.target, 1, cp);
  }
  if (config_.augment && b.input.dim() == 4) {
    *flips = torch::rand({B}, augment_gen_) < 0.5;
    b.input = torch::where(flips->view({B, 1, 1, 1}), b.input.flip({3}), b.input);
  }
  return b;
}

// What the RNG-divergence probe compares across ranks, taken before the forward pass: the
// parameters (after the previous step's synchronisation), the generators the replicated model draws
// from, and what this rank's data stream produced.
void Trainer::fingerprints(int64_t step, const Batch& batch, const torch::Tensor& flips, Hooks& hooks) {
  // A pipeline's ranks hold different stages and draw dropout from their own seeds: each must-match
  // stream is compared among the ranks of one pipeline rank.
  const std::string stage = mesh_->layout().pp > 1 ? " (pipeline rank " + std::to_string(pp_rank_) + ")" : "";
  auto emit = [&](const char* stream, const char* cls, uint64_t v) {
    hooks.fingerprint(Fingerprint{std::string(stream) + (std::string(cls) == "must-match" ? stage : ""), cls, step, v});
  };
  emit(step == 0 ? "initial-weights" : "parameters", "must-match", parameter_fingerprint());
  if (strategy_->comm()) hooks.parameter_spread(step, strategy_->parameter_spread());
  at::Tensor cpu_state;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    cpu_state = gen.get_state();
  }
  emit("cpu-generator", "must-match", fingerprint(cpu_state));
  if (device_.is_cuda()) {
    auto gen = at::globalContext().defaultGenerator(device_);
    std::lock_guard<std::mutex> lock(gen.mutex());
    emit("cuda-generator", "must-match", fingerprint(gen.get_state()));
  } else if (preset_.dropout > 0) {
    // The first 4096 dropout-mask elements this step's forward will draw (from a copy of the generator).
    auto copy = at::make_generator<at::CPUGeneratorImpl>();
    copy.set_state(cpu_state);
    emit("dropout-masks", "must-match", fingerprint(torch::empty({4096}).bernoulli_(1.0 - preset_.dropout, copy)));
  }
  // The model-parallel generator: different on the tp ranks of one data-parallel rank, the same on the
  // data-parallel ranks of one tp coordinate (each stream compared among the ranks that report it).
  if (const TensorParallel& tp = model_->tensor_parallel(); tp.active()) {
    const uint64_t v = fingerprint(tensor_parallel::rng_tracker().snapshot());
    hooks.fingerprint(Fingerprint{"tp-dropout-generator (the tp ranks of data-parallel rank " + std::to_string(dp_rank_) + ")" + stage,
                                  "should-differ", step, v});
    if (dp_size_ > 1)
      hooks.fingerprint(Fingerprint{"tp-dropout-generator (the data-parallel ranks of tp rank " + std::to_string(tp.rank) + ")" + stage,
                                    "must-match", step, v});
  }
  // EMA teachers are never reduced: only their identical updates keep them equal on every rank.
  if (const auto teacher = model_->teacher_fingerprint()) emit("teacher-parameters", "must-match", *teacher);
  if (objective_) {
    // SSL views are drawn inside the loss from the rank's augmentation generator: its state stands for them.
    std::lock_guard<std::mutex> lock(augment_gen_.mutex());
    emit("augmentation", "should-differ", fingerprint(augment_gen_.get_state()));
  }
  // The tp and pp ranks of one data-parallel slice share its samples by design: each model-parallel
  // coordinate's ranks are told apart (the value is keyed on it), so that only data-parallel ranks
  // seeing the same data collide.
  const int64_t shared = model_->tensor_parallel().rank + mesh_->layout().tp * pp_rank_;
  emit("data-samples", "should-differ", fingerprint(batch.target, fingerprint(batch.input, 1469598103934665603ULL + shared)));
  if (flips.defined()) emit("augmentation", "should-differ", fingerprint(flips));
}

torch::Tensor Trainer::forward_backward(const Batch& batch, StepInfo& si, Hooks& hooks) {
  torch::Tensor loss;
  {
    compat::AutocastGuard autocast(device_.type(), mode_.autocast_dtype, mode_.autocast);
    Fp8Scope fp8(mode_.fp8, config_.fp8_scaling == "delayed");
    loss = model_->loss(batch);
  }
  hooks.forward_end(si);
  if (hooks.wants_embeddings(si.step))
    if (auto sample = model_->last_embeddings()) {
      sample->step = si.step;
      sample->loss = loss.detach().item<double>();  // a sync, on sampled steps only
      hooks.embeddings(*sample);
    }
  torch::Tensor objective = config_.loss_multiplier != 1.0 ? loss * config_.loss_multiplier : loss;
  if (scaler_) {
    si.loss_scale = scaler_->current_scale();
    objective = scaler_->scale(objective);
  }
  strategy_->before_backward();
  objective.backward();
  return loss;
}

torch::Tensor Trainer::step(int64_t step, Hooks& hooks) {
  StepInfo si;
  si.step = step;
  si.measured = step >= config_.warmup_steps;
  si.samples = config_.batch_size;
  if (Communicator* c = mesh_->world()) c->set_step(step);  // every group of the mesh reports at its step
  torch::Tensor flips;
  Batch batch = rank_batch(step, &flips);  // data time is not part of the step
  if (hooks.wants_fingerprints(step)) {
    // The probe's own collectives (zero3 gathers its shards to fingerprint them) are not the step's
    // communication: they are recorded as outside the steps.
    if (Communicator* c = mesh_->world()) c->set_step(-1);
    fingerprints(step, batch, flips, hooks);
    if (Communicator* c = mesh_->world()) c->set_step(step);
  }
  batch.input = batch.input.to(device_, /*non_blocking=*/true);
  if (batch.input.is_floating_point()) batch.input = batch.input.to(mode_.param_dtype);
  batch.target = batch.target.to(device_, /*non_blocking=*/true);
  observers_ = hooks.block_observers();
  current_step_ = step;
  si.instrumented = hooks.wants_embeddings(step) ||
                    std::any_of(observers_.begin(), observers_.end(), [step](BlockObserver* o) { return o->wants(step); });

  if (parity_ && step == 0) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    parity_->rng_state = gen.get_state();
  }
  hooks.step_begin(si);
  strategy_->zero_grad(*optimizer_);
  if (weight_rounding_) weight_rounding_->round();
  strategy_->before_forward();
  // Forward and backward: the whole batch at once, or its micro-batches as the pipeline schedule runs them.
  torch::Tensor loss = pipeline_ ? run_pipeline(batch, si, hooks) : forward_backward(batch, si, hooks);
  // fp16 emulation: masters back and gradients rounded to fp16 before they are reduced across ranks,
  // as fp16 gradients would be (zero2 frees the full gradients once reduced).
  if (weight_rounding_) weight_rounding_->restore();
  strategy_->reduce_gradients();
  hooks.backward_end(si);
  if (parity_ && step == 0 && !strategy_->comm() && !mode_.master)
    for (const auto& item : model_->named_parameters())
      if (item.value().grad().defined())
        parity_->first_grads.emplace_back(item.key(), item.value().grad().detach().to(torch::kCPU).clone());

  if (scaler_) {
    si.grads_nonfinite = scaler_->unscale(opt_params_);
  } else if (mode_.fp16) {
    // No scaler: nothing stops the step, but the probe still learns whether the gradients were finite.
    torch::NoGradGuard no_grad;
    bool bad = false;
    for (const auto& p : opt_params_)
      if (p.grad().defined()) bad = bad || !torch::isfinite(p.grad()).all().item<bool>();
    si.grads_nonfinite = bad;
  }
  if (config_.grad_clip > 0) clip_gradients();  // unscaled
  si.skipped = scaler_ && si.grads_nonfinite;
  if (!si.skipped) {
    optimizer_->step();
    strategy_->after_step();
    ++applied_steps_;
    model_->after_step(applied_steps_, config_.warmup_steps + config_.steps);
    set_lr(scheduled_lr(config_.lr_schedule, config_.lr, applied_steps_, config_.warmup_steps + config_.steps));
  }
  if (parity_ && scaler_) {
    parity_->scales.push_back(si.loss_scale);
    parity_->found_inf.push_back(si.grads_nonfinite);
  }
  if (scaler_) scaler_->update(si.grads_nonfinite);
  hooks.optimizer_end(si);
  if (const ContextParallel& cp = model_->context_parallel(); cp.active()) {
    const ContextStats& st = *cp.stats;
    si.context = {st.attention_s, st.wait_s, st.transfer_s, st.bytes};
    *cp.stats = {};
  }
  si.loss = loss.detach();
  hooks.step_end(si);
  current_step_ = -1;
  if (Communicator* c = strategy_->comm()) c->flush();  // the step's bucket collectives, once the device clock has them
  if (Communicator* c = mesh_->world()) c->set_step(-1);
  return si.loss;
}

std::vector<double> Trainer::global_mean(const torch::Tensor& values) {
  torch::Tensor t = values.detach().to(torch::kCPU, torch::kDouble).contiguous().reshape({-1});
  if (Communicator* c = strategy_->comm()) c->all_reduce(t, /*average=*/true, /*record=*/false);
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

std::vector<torch::Tensor> Trainer::full_parameters() {
  strategy_->materialize();
  return model_->parameters();
}

std::vector<std::pair<std::string, torch::Tensor>> Trainer::local_parameters() {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  const auto named = model_->named_parameters();
  if (mode_.master) {  // the fp32 masters the optimizer stepped, not their bf16 casts
    const std::vector<torch::Tensor> masters = strategy_->master_values();
    for (size_t i = 0; i < named.size(); ++i) out.emplace_back(named[i].key(), masters.at(i).to(torch::kCPU));
    return out;
  }
  strategy_->materialize();
  for (const auto& item : named) out.emplace_back(item.key(), item.value().detach().to(torch::kCPU).clone());
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> Trainer::final_parameters() {
  std::vector<std::pair<std::string, torch::Tensor>> out = local_parameters();
  if (!pp_shapes_.empty()) out = join_stages(std::move(out));
  const TensorParallel& tp = model_->tensor_parallel();
  if (!tp.active()) return out;
  for (auto& [name, t] : out)  // the tp ranks' shards joined (a collective over the tp group)
    if (const auto split = model_->tensor_parallel_split(name)) t = tensor_parallel::unshard(t, *split, tp);
  return out;
}

// Under pp each parameter from the rank of the first stage that holds it, broadcast over the pp group
// (a collective: every pp rank joins), so that every rank has the whole model.
std::vector<std::pair<std::string, torch::Tensor>> Trainer::join_stages(std::vector<std::pair<std::string, torch::Tensor>> local) {
  const pipeline::Schedule& s = pipeline_->schedule();
  if (Communicator* c = mesh_->world()) c->set_step(-1);  // not the steps' communication
  for (auto& [name, t] : local) {
    int64_t stage = 0;
    while (stage < s.stages()) {
      const auto [first, last] = pipeline_->layers_of(stage);
      if (model_->used_by_layers(name, first, last)) break;
      ++stage;
    }
    const auto root = static_cast<int>(s.rank_of(stage));
    torch::Tensor full = root == pp_rank_ ? t : torch::empty(pp_shapes_.at(name), t.options());
    mesh_->group("pp")->broadcast({full}, root);
    t = full;
  }
  return local;
}

// Under tp the split parameters count on every tp rank, the whole ones (the same gradient on each) on
// tp rank 0 only; under pp each stage's on its rank, a tied head on the first stage's.
void Trainer::clip_gradients() {
  const TensorParallel& tp = model_->tensor_parallel();
  Communicator* pp = mesh_->group("pp");
  std::vector<bool> counted;
  for (const auto& item : model_->named_parameters()) {
    if (!tp.active() && !pp) break;
    const bool mine = !tp.active() || tp.rank == 0 || model_->tensor_parallel_split(item.key());
    counted.push_back(mine && (!pp || item.key() != model_->tied_head() || pp_rank_ == 0));
  }
  std::vector<Communicator*> across;
  if (tp.active()) across.push_back(tp.group);
  if (pp) across.push_back(pp);
  strategy_->clip_grad_norm(opt_params_, config_.grad_clip, counted, across);
}

void Trainer::setup_pipeline() {
  const pipeline::Schedule schedule = resolve_pipeline(config_, mesh_->layout(), preset_);
  if (mesh_->layout().pp == 1 && schedule.microbatches == 1) return;
  pipeline_ = std::make_unique<Pipeline>(schedule, mesh_->group("pp"), preset_.layers);
  if (mesh_->layout().pp == 1) return;
  pp_rank_ = mesh_->coordinate("pp");
  const std::vector<int64_t> mine = pipeline_->my_stages();
  for (const auto& item : model_->named_parameters()) pp_shapes_[item.key()] = item.value().sizes().vec();
  model_->drop_parameters([&](const std::string& name) {
    return std::any_of(mine.begin(), mine.end(), [&](int64_t stage) {
      const auto [first, last] = pipeline_->layers_of(stage);
      return model_->used_by_layers(name, first, last);
    });
  });
  // A tied head is the embedding's weight on the first stage's rank and the head's on the last one's:
  // their gradients are added after the step's backwards (Megatron's embedding group), so that both
  // copies take the same step.
  const int64_t first = schedule.rank_of(0), last = pipeline_->last_stage_rank();
  if (!model_->tied_head().empty() && (pp_rank_ == first || pp_rank_ == last)) {
    const std::vector<int> members = mesh_->members("pp");
    const int a = members.at(static_cast<size_t>(first)), b = members.at(static_cast<size_t>(last));
    tied_group_ = mesh_->world()->split({a, b}, "pp-tied-head-" + std::to_string(a));  // one per pipeline
  }
}

torch::Tensor Trainer::run_pipeline(const Batch& batch, StepInfo& si, Hooks& hooks) {
  const int64_t m = pipeline_->schedule().microbatches;
  const bool staged = mesh_->layout().pp > 1;
  Pipeline::Steps steps;
  steps.forward = [&](const torch::Tensor& in, int64_t first, int64_t last, const Batch& mb) {
    compat::AutocastGuard autocast(device_.type(), mode_.autocast_dtype, mode_.autocast);
    Fp8Scope fp8(mode_.fp8, config_.fp8_scaling == "delayed");
    if (!staged) return model_->loss(mb);
    const torch::Tensor out = model_->forward_layers(in, first, last);
    return last == preset_.layers ? model_->loss_of(out, mb) : out;
  };
  // Each micro-batch's loss is the mean over its tokens: 1/m of it makes the accumulated gradient the
  // whole batch's mean.
  steps.objective = [&](const torch::Tensor& loss) {
    const torch::Tensor share = loss * (config_.loss_multiplier / static_cast<double>(m));
    return scaler_ ? scaler_->scale(share) : share;
  };
  // The hidden states between stages: [b, S, D], each tp rank's S / tp of it with sequence parallelism.
  const int64_t shards = config_.sequence_parallel ? mesh_->layout().tp : 1;
  steps.boundary_like = [&, shards](const Batch& mb) {
    return torch::empty({mb.input.size(0), mb.input.size(1) / shards, preset_.width},
                        torch::TensorOptions().device(device_).dtype(mode_.param_dtype));
  };
  if (scaler_) si.loss_scale = scaler_->current_scale();
  strategy_->before_backward();
  torch::Tensor loss = pipeline_->run(batch, steps);
  const PipelineStats& st = pipeline_->stats();
  si.pipeline = {st.span_s, st.compute_s, st.wait_s, st.peak_in_flight, st.p2p_bytes};
  hooks.forward_end(si);
  if (tied_group_) {
    torch::NoGradGuard no_grad;
    for (auto& item : model_->named_parameters())
      if (item.key() == model_->tied_head() && item.value().grad().defined()) tied_group_->all_reduce(item.value().mutable_grad(), /*average=*/false);
  }
  if (!staged) return loss;
  // The last stage's mean loss, on every rank of the pipeline (for the log; not the step's communication).
  const bool holds_loss = pp_rank_ == pipeline_->last_stage_rank();
  torch::Tensor shared = holds_loss ? loss.detach().to(torch::kDouble).reshape({1}) : torch::zeros({1}, torch::TensorOptions().device(device_).dtype(torch::kDouble));
  mesh_->group("pp")->all_reduce(shared, /*average=*/false, /*record=*/false);
  return holds_loss ? loss : shared[0];
}

// The strategy's fingerprint of this rank's parameters; under tensor parallelism the tp ranks' ones
// chained in tp order, so that every rank holding the same shards of the same model gives one value.
uint64_t Trainer::parameter_fingerprint() {
  const uint64_t mine = strategy_->parameter_fingerprint();
  const TensorParallel& tp = model_->tensor_parallel();
  if (!tp.active()) return mine;
  torch::Tensor all = torch::zeros({tp.degree}, torch::kLong);
  all[tp.rank] = static_cast<int64_t>(mine);
  tp.group->all_reduce(all, /*average=*/false, /*record=*/false);
  return fingerprint(all);
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
  // AdamW keeps two moments per parameter, SGD with momentum one buffer (core/precision.hpp's accounting).
  const int words = config_.optimizer == "sgd" ? 1 : 2;
  ModelStateBytes m = strategy_->model_state(*optimizer_, words);
  int64_t numel = 0;
  for (const auto& p : model_->parameters()) numel += p.numel();
  const ExpectedModelState e = expected_model_state(precision_traits(config_.precision), strategy_->sharding_level(), numel,
                                                    strategy_->sharding_degree(), words, config_.reduce_dtype);
  m.expected = e.bytes;
  m.expected_formula = e.formula;
  return m;
}

TrainOutcome train(Trainer& trainer, const RunConfig& config, Hooks& hooks, RunInfo info) {
  TrainOutcome out;
  const int64_t total = config.warmup_steps + config.steps;
  const int64_t log_every = config.log_every > 0 ? config.log_every : std::max<int64_t>(1, total / 50);
  // A budget stops the measured steps early, never before 10 of them (enough for the step-time
  // statistics), and only at a log point, where every rank has the same (averaged) clock.
  const int64_t min_measured = std::min<int64_t>(10, config.steps);
  int64_t nonfinite_run = 0;
  // Every step's loss, kept on the device so that no step has to wait; read once at the end.
  torch::Tensor history;
  // The first step whose loss was not finite, tracked on the device too.
  torch::Tensor first_bad;
  hooks.run_begin(info);  // probes set up (the GEMM peak is measured here): not part of the budget
  const auto started = std::chrono::steady_clock::now();
  for (int64_t s = 0; s < total; ++s) {
    torch::Tensor loss = trainer.step(s, hooks);
    out.steps_run = s + 1;
    {
      torch::NoGradGuard no_grad;
      if (!history.defined()) {
        history = torch::full({total}, std::nan(""), loss.options().dtype(torch::kDouble));
        first_bad = torch::full({}, -1, loss.options().dtype(torch::kLong));
      }
      history.select(0, s).copy_(loss.detach());
      first_bad = torch::where(torch::logical_and(first_bad < 0, torch::logical_not(torch::isfinite(loss))),
                               torch::full({}, s, first_bad.options()), first_bad);
    }
    // Read the loss (a device sync on GPU) only at log points and while it is non-finite, so that the
    // loop stays asynchronous otherwise.
    if (s % log_every != 0 && nonfinite_run == 0 && s != total - 1) continue;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    const std::vector<double> g = trainer.global_mean(torch::stack({loss.detach().to(torch::kDouble).reshape({}),
                                                                    torch::full({}, elapsed, loss.options().dtype(torch::kDouble))}));
    const double v = g[0];  // every rank decides on the same numbers
    const bool logged = s % log_every == 0 || s == total - 1;
    if (logged) out.loss_curve.emplace_back(s, v);
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
    if (config.time_budget_s > 0 && g[1] > config.time_budget_s && s + 1 - config.warmup_steps >= min_measured &&
        s != total - 1) {
      out.budget_stopped = true;
      if (!logged) out.loss_curve.emplace_back(s, v);
      break;
    }
  }
  hooks.run_end(RunEnd{out.steps_run, trainer.model_state()});
  trainer.full_parameters();  // zero3 gathers here, on every rank, whatever the outcome
  if (history.defined()) out.step_losses = trainer.global_mean(history.narrow(0, 0, out.steps_run));
  out.final_loss = final_loss_of(out.step_losses, out.steps_run);
  if (out.status == "ok" && !std::isfinite(out.final_loss)) {
    out.status = "diverged";
    out.reason = "final loss is not finite";
  }
  if (out.status == "ok" && config.eval && trainer.rank() == 0) out.accuracy = trainer.evaluate();
  return out;
}

}  // namespace trainscope::suites
