#pragma once
// The run configuration of one cell, and the vocabulary of its keys and allowed values.
//
// Every key a suite file, `--set` or a report may use is declared once in config_keys(); parsing is
// strict so that a misspelt key or value is an error naming what is allowed, never a silent default.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace trainscope {

using json = nlohmann::ordered_json;

enum class KeyKind { String, Choice, Int, Float, Bool };

struct KeySpec {
  std::string name;
  KeyKind kind;
  std::vector<std::string> choices;  // for Choice
  json default_value;
  std::string help;
  double min = 0;  // lower bound for Int and Float
};

// All configuration keys, in the order reports print them.
const std::vector<KeySpec>& config_keys();
const KeySpec& key_spec(const std::string& name);  // UsageError on an unknown key

// Checks (and for numbers, normalises) one value; UsageError names the key and the allowed values.
json validate_value(const std::string& key, const json& value);
// Parses the text of `--set key=value` according to the key's kind.
json parse_value(const std::string& key, const std::string& text);

struct RunConfig {
  std::string kind = "train";  // train | gemm-peak | memory-bandwidth | copy-bandwidth | collectives
  bool thorough = false;       // gemm-peak: the long sweep
  bool timeline = false;       // CUDA: the CUPTI timeline probe
  double sustain_window_s = 60.0;
  std::string model = "mlp";  // a preset, or a model the dimension keys below define (core/model_shape.hpp)
  // The model's dimensions: 0 (or "preset") keeps the preset's; a suite's [models.NAME] sets them all.
  std::string family = "preset";
  int64_t layers = 0, d_model = 0, heads = 0, kv_heads = 0, ffn = 0, seq_len = 0, vocab = 0;
  std::string tied = "preset";
  double rope_theta = 0, rope_factor = 0, rope_low_freq_factor = 0, rope_high_freq_factor = 0;
  int64_t rope_original_ctx = 0;
  double norm_eps = 0;
  std::string attention = "auto";  // eager | sdpa | auto (core/model_shape.hpp: resolve_attention)
  std::string data = "auto";  // auto: the model's natural data (see suites/models/data.hpp)
  std::string precision = "32-true";  // a row of core/precision.hpp's table
  std::string reduce_dtype = "fp32";  // bf16-master: the dtype gradients are reduced and accumulated in
  std::string reshard_after_forward = "true";  // zero3/hsdp: true, false, or a group size (FSDP2's)
  std::string cross_entropy = "eager";  // eager | fused (ReferenceModel::set_cross_entropy)
  std::string fp16 = "auto";  // 16-mixed on CPU: emulated | autocast (auto: emulated on CPU)
  std::string fp8_scaling = "current";  // fp8: current | delayed (amax history)
  std::string parallel = "single";  // the data-parallel shorthand (core/layout.hpp)
  int64_t world_size = 1;  // ranks; batch_size is per rank, the global batch is world_size x batch_size
  // The parallel layout's degrees (core/layout.hpp), or all of them at once as `layout` ("dp_shard2-tp2").
  int64_t dp_replicate = 1, dp_shard = 1, tp = 1, pp = 1, cp = 1;
  bool sequence_parallel = false;  // tp: Megatron's sequence parallelism
  bool sp_regather = false;        // sequence parallelism: re-gather the column-parallel inputs in backward (Megatron)
  // Pipeline (core/pipeline.hpp): the schedule, the micro-batches each data-parallel rank's batch is cut
  // into (also without pp: gradient accumulation) and the stages per rank; 0: the schedule's default.
  std::string pp_schedule = "1f1b";
  int64_t pp_microbatches = 0, pp_virtual = 0;
  std::string pp_split;  // layers per stage, "7,8,8,7" (empty: stage_layers' cuts)
  // Context parallelism (suites/parallel/context_parallel.hpp): how attention crosses the sequence shards,
  // and whether the shards are head-tail balanced.
  std::string cp_method = "allgather";
  bool cp_balance = true;
  std::string layout;
  std::string backend = "auto";
  double bucket_mb = 25.0;
  bool prefetch = true;
  int64_t hsdp_shard_size = 0;
  double collective_timeout_s = 60.0;
  bool augment = false;
  int64_t rng_every = 10;
  bool save_parameters = false;
  bool parity_dump = false;  // write what a PyTorch-side reference needs to replay the run (tests/parity)
  std::string initial_parameters;  // a name -> tensor file (torch.save) to start from; "": the seed's weights
  std::string checkpoint = "none";
  bool checkpoint_check = false;
  double dropout = 0.0;
  std::string memory_budget = "none";
  std::string method = "supervised";
  std::string optimizer = "adamw";
  double lr = 1e-3;
  double weight_decay = 0.0;
  std::string lr_schedule = "constant";
  double grad_clip = 0.0;
  double scaler_init = 65536.0, scaler_growth = 2.0, scaler_backoff = 0.5;
  int64_t scaler_interval = 2000;
  double loss_multiplier = 1.0;
  int64_t overflow_every = 20;
  int64_t batch_size = 64;
  int64_t steps = 100;
  int64_t warmup_steps = 5;
  int64_t seed = 0;
  std::string device = "auto";
  int64_t threads = 0;  // 0: one per core
  double timeout_s = 600;
  bool trace = false;  // per-rank timeline files (probes/trace/trace.hpp)
  bool operator_times = false;  // self time per operator kind in the step (probes/step/operators.hpp)
  double time_budget_s = 0;  // 0: run every step; else stop the measured steps after this much training
  int64_t log_every = 0;  // 0: about 50 points on the loss curve
  bool eval = true;
  std::string inject = "none";  // fault injection: process faults and RNG faults (see config_keys())
  int64_t inject_rank = -1;
  int64_t inject_step = 0;
  // Self-supervised pre-training and its evaluation (suites/ssl; config_keys() says what each means).
  int64_t unlabeled_size = 0;
  double ssl_temperature = 0.5, ema_tau = 0.99;
  std::string projector_bn = "per-rank";
  int64_t dino_prototypes = 1024;
  double dino_teacher_temp = 0.04, dino_student_temp = 0.1, dino_center_momentum = 0.9;
  int64_t dino_freeze_last_steps = 0;
  double mask_ratio = 0.75;
  bool norm_pix = true;
  std::string ssl_eval = "auto";
  std::string label_fractions = "0.01,0.1,1";
  int64_t label_seeds = 3, probe_epochs = 20, finetune_steps = 150, scratch_steps = 1200, eval_bank = 0;
  std::string save_encoder, pretrained;

  json to_json() const;
  // Strict: unknown keys and bad values raise UsageError. Missing keys keep their defaults.
  static RunConfig from_json(const json& j);
};

// The checkpoint policy grammar: none | full | selective | selective-op | every:<k> with k >= 1. False on
// anything else; `every` gets k (1 for the other policies).
bool parse_checkpoint(const std::string& text, std::string& kind, int64_t& every);

// "0.01,0.1,1" -> {0.01, 0.1, 1}; false unless every item is a number in (0, 1].
bool parse_fractions(const std::string& text, std::vector<double>& out);
// ssl_eval with auto resolved: full for SSL methods, off for supervised.
std::string ssl_eval_mode(const RunConfig& c);

// The percentage of `inject = slow:<pct>` (0 for anything else).
double slow_percent(const std::string& inject);

// The budget in bytes (0: none).
int64_t memory_budget_bytes(const RunConfig& c);

// Short label of an axis value inside a cell name: "bs32" for batch_size 32, "ckpt-full", ...
std::string axis_label(const std::string& key, const json& value);

}  // namespace trainscope
