#include "core/config.hpp"

#include <cmath>
#include <sstream>

#include "core/errors.hpp"
#include "core/layout.hpp"
#include "core/model_shape.hpp"
#include "core/precision.hpp"
#include "core/units.hpp"

namespace trainscope {
namespace {

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + v[i];
  return out;
}

std::vector<std::string> key_names() {
  std::vector<std::string> names;
  for (const auto& k : config_keys()) names.push_back(k.name);
  return names;
}

std::string describe(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

}  // namespace

const std::vector<KeySpec>& config_keys() {
  static const std::vector<KeySpec> keys = {
      {"model", KeyKind::String, {}, "mlp",
       "reference model: a preset (trainscope list shows them with their sizes) or a model a suite defines by its "
       "dimensions under [models.NAME]"},
      {"family", KeyKind::Choice, {"preset", "gpt", "llama", "vit"}, "preset",
       "a model of your own: its family (gpt, llama or vit); preset: the named preset's"},
      {"layers", KeyKind::Int, {}, 0, "transformer blocks; 0: the preset's", 0},
      {"d_model", KeyKind::Int, {}, 0, "model width D; 0: the preset's", 0},
      {"heads", KeyKind::Int, {}, 0, "attention heads (must divide d_model); 0: the preset's", 0},
      {"kv_heads", KeyKind::Int, {}, 0, "llama: key/value heads of grouped-query attention (must divide heads); 0: the preset's", 0},
      {"ffn", KeyKind::Int, {}, 0, "llama: SwiGLU hidden size; 0: the preset's (gpt and vit use 4 x d_model)", 0},
      {"seq_len", KeyKind::Int, {}, 0, "language models: tokens per sample (vit: the patch size); 0: the preset's", 0},
      {"vocab", KeyKind::Int, {}, 0, "language models: vocabulary size; 0: the preset's", 0},
      {"tied", KeyKind::Choice, {"preset", "true", "false"}, "preset",
       "llama: the LM head is the token embedding's matrix (gpt: always)"},
      {"rope_theta", KeyKind::Float, {}, 0.0, "llama: RoPE base; 0: the preset's (500000)", 0},
      {"rope_factor", KeyKind::Float, {}, 0.0, "llama: Llama 3 RoPE frequency scaling factor (1: none); 0: the preset's", 0},
      {"rope_low_freq_factor", KeyKind::Float, {}, 0.0, "llama: RoPE scaling's low-frequency factor; 0: the preset's (1)", 0},
      {"rope_high_freq_factor", KeyKind::Float, {}, 0.0, "llama: RoPE scaling's high-frequency factor; 0: the preset's (4)", 0},
      {"rope_original_ctx", KeyKind::Int, {}, 0, "llama: RoPE scaling's original context length; 0: the preset's (8192)", 0},
      {"norm_eps", KeyKind::Float, {}, 0.0, "llama: RMSNorm epsilon; 0: the preset's (1e-5)", 0},
      {"attention", KeyKind::Choice, {"auto", "eager", "sdpa"}, "auto",
       "attention of gpt, llama and vit: eager (matmul, mask, softmax, matmul) or sdpa (at::scaled_dot_product_attention: "
       "flash / memory-efficient / cuDNN kernels on CUDA); auto: sdpa on CUDA, and on CPU from seq_len 256 (README)"},
      {"data", KeyKind::Choice, {"auto", "fashion-mnist", "synthetic-images", "synthetic-tokens", "text"},
       "auto", "data source; auto: Fashion-MNIST for image models, synthetic tokens for GPT, text for Llama; text: "
       "English from Debian's fortunes as byte-level tokens (vocab >= 256)"},
      {"precision", KeyKind::Choice, precision_names(), "32-true",
       "numeric precision (Lightning's names, and bf16-master: bf16 weights cast from fp32 masters as FSDP2, DeepSpeed "
       "and Megatron train; core/precision.hpp's table says what each stores and computes in; 16-mixed is emulated on "
       "CPU unless fp16 = autocast; fp8: e4m3 Linear GEMMs through at::_scaled_mm on sm89+)"},
      {"reduce_dtype", KeyKind::Choice, {"fp32", "bf16"}, "fp32",
       "bf16-master: the dtype gradients are reduced across ranks and accumulated in (fp32: FSDP2's "
       "MixedPrecisionPolicy(reduce_dtype=float32); bf16: DeepSpeed's default communication)"},
      {"reshard_after_forward", KeyKind::String, {}, "true",
       "zero3, hsdp: free a block's gathered parameters after its forward and gather them again for backward (true), "
       "keep them until backward (false), or keep a 1/r slice and gather over r ranks in backward (an integer r), as FSDP2's "
       "fully_shard"},
      {"cross_entropy", KeyKind::Choice, {"eager", "fused"}, "eager",
       "the loss: eager (logits cast to fp32, log_softmax + nll_loss; the fp32 log-probabilities kept for backward) "
       "or fused (the logits and each row's fp32 log-sum-exp kept, the gradient written once in the logits' dtype: "
       "what torch.compile makes of torchtitan's loss)"},
      {"fp16", KeyKind::Choice, {"auto", "emulated", "autocast"}, "auto",
       "16-mixed on CPU: emulated (fp16 rounding at block boundaries, fp32 speed) or autocast (real fp16 kernels, "
       "~100x slower without AVX512-FP16); auto: emulated on CPU, real on CUDA"},
      {"fp8_scaling", KeyKind::Choice, {"current", "delayed"}, "current",
       "fp8: per-tensor scale from this step's amax (current) or from the largest of the last 16 steps' (delayed)"},
      {"parallel", KeyKind::Choice, {"single", "ddp", "zero1", "zero2", "zero3", "hsdp"}, "single",
       "data-parallel strategy over the ranks tp x pp x cp leave: single process, DDP (c10d reducer), ZeRO-1/2/3 "
       "(3 = FSDP-style full sharding), hsdp (zero3 within a node, gradients all-reduced across nodes); the shorthand "
       "for the layout's dp_replicate and dp_shard"},
      {"world_size", KeyKind::Int, {}, 1,
       "number of ranks (batch_size is per data-parallel rank); 1 with a layout given: the layout's product", 1},
      {"dp_replicate", KeyKind::Int, {}, 1, "layout: copies of the model state (DDP; HSDP's replicas)", 1},
      {"dp_shard", KeyKind::Int, {}, 1, "layout: ranks one copy of the model state is sharded over (FSDP; zero1/2 by parallel)", 1},
      {"tp", KeyKind::Int, {}, 1, "layout: tensor-parallel ranks each layer is split over", 1},
      {"sequence_parallel", KeyKind::Bool, {}, false,
       "tp: norms and residuals on sequence shards, each all-reduce as a reduce-scatter and an all-gather (Megatron's "
       "sequence parallelism; the gathered input of the column-parallel layers kept for backward, as DTensor keeps it)"},
      {"sp_regather", KeyKind::Bool, {}, false,
       "sequence parallelism: keep only each column-parallel layer's input shard and all-gather it again in backward, as "
       "Megatron does (default: keep the gathered input, as DTensor does)"},
      {"pp", KeyKind::Int, {}, 1, "layout: ranks the layers are split over as pipeline stages", 1},
      {"pp_schedule", KeyKind::Choice, {"gpipe", "1f1b", "interleaved-1f1b", "zb-1p"}, "1f1b",
       "pipeline schedule (core/pipeline.hpp): gpipe, 1f1b, interleaved-1f1b (pp_virtual stages per rank), zb-1p (1f1b with "
       "the backward split into input and weight gradients, torch's ScheduleInterleavedZeroBubble at any pp_virtual)"},
      {"pp_microbatches", KeyKind::Int, {}, 0,
       "micro-batches each data-parallel rank's batch is cut into, their gradients accumulated (also without pp); 0: 2 x pp "
       "with pp, else 1", 0},
      {"pp_virtual", KeyKind::Int, {}, 0, "pipeline stages per rank; 0: 2 for interleaved-1f1b, else 1", 0},
      {"pp_split", KeyKind::String, {}, "",
       "layers of each pipeline stage in stage order, comma-separated (7,8,8,7): one count per stage (pp x pp_virtual), adding "
       "up to the layers; empty: equal cuts, the first and last stages a layer short where the stages do not divide the layers"},
      {"cp", KeyKind::Int, {}, 1, "layout: context-parallel ranks the sequence is split over", 1},
      {"cp_method", KeyKind::Choice, {"allgather", "ring"}, "allgather",
       "cp: keys and values all-gathered for the local queries under a global causal mask (Llama 3), or passed around "
       "a ring with point-to-point, each block merged by its log-sum-exp (ring attention)"},
      {"cp_balance", KeyKind::Bool, {}, true,
       "cp: each rank holds chunks r and 2 cp - 1 - r of the sequence (head-tail), so causal attention's work is even; "
       "false: contiguous shards"},
      {"layout", KeyKind::String, {}, "",
       "the layout's degrees at once: dimensions joined by '-' (dp_shard4-tp2, dp_replicate2-dp_shard2; -zero1 or -zero2 "
       "for a lighter sharding), or single; empty: the degree keys and parallel"},
      {"backend", KeyKind::Choice, {"auto", "gloo", "nccl"}, "auto", "collectives: auto = NCCL on CUDA, Gloo on CPU"},
      {"bucket_mb", KeyKind::Float, {}, 25.0, "ddp: gradient bucket size in MiB", 0},
      {"prefetch", KeyKind::Bool, {}, true, "zero3, hsdp: all-gather the next block's parameters while the current one computes"},
      {"hsdp_shard_size", KeyKind::Int, {}, 0,
       "hsdp: ranks each copy of the model state is sharded over (0: the ranks of one node)", 0},
      {"collective_timeout_s", KeyKind::Float, {}, 60.0,
       "a rank waiting this long in a collective or rendezvous gives up (a peer died or hangs)", 1},
      {"augment", KeyKind::Bool, {}, false, "random horizontal flips of images, drawn per rank"},
      {"rng_every", KeyKind::Int, {}, 10, "multi-rank: fingerprint RNG streams and parameters every k steps", 1},
      {"save_parameters", KeyKind::Bool, {}, false,
       "write every rank's final parameters (full, gathered) next to the cell result, for comparisons"},
      {"parity_dump", KeyKind::Bool, {}, false,
       "write <cell>.parity.pt (initial and final parameters, batches, RNG state, first gradients) for `trainscope parity`"},
      {"initial_parameters", KeyKind::String, {}, "",
       "start from the parameters in this file (torch.save of a name -> tensor dict, or a parity dump); empty: from the seed"},
      {"checkpoint", KeyKind::String, {}, "none",
       "activation checkpointing: none, full, every:<k>, selective (the attention core recomputed), selective-op "
       "(torchtitan's op-level policy: matmul and attention outputs kept, every second matmul and the rest recomputed)"},
      {"checkpoint_check", KeyKind::Bool, {}, false,
       "compare every recomputed block output with the original (determinism check)"},
      {"dropout", KeyKind::Float, {}, 0.0, "dropout probability in the GPT blocks (Llama 3 has none)", 0},
      {"memory_budget", KeyKind::String, {}, "none",
       "refuse allocations past this many bytes (\"64MiB\", \"2GB\"): the cell ends as oom; none: no budget"},
      {"method", KeyKind::Choice, {"supervised", "simclr", "byol", "dino", "mae"}, "supervised",
       "training objective: supervised, or self-supervised pre-training of the model's encoder (simclr, byol, dino; mae "
       "needs a vit model)"},
      {"optimizer", KeyKind::Choice, {"adamw", "sgd"}, "adamw", "optimizer (sgd uses momentum 0.9)"},
      {"lr", KeyKind::Float, {}, 1e-3, "learning rate", 0},
      {"weight_decay", KeyKind::Float, {}, 0.0, "decoupled weight decay", 0},
      {"lr_schedule", KeyKind::Choice, {"constant", "cosine"}, "constant",
       "learning-rate schedule over the applied optimizer steps (skipped steps do not advance it)"},
      {"grad_clip", KeyKind::Float, {}, 0.0, "clip the global gradient norm to this (unscaled); 0: off", 0},
      {"scaler_init", KeyKind::Float, {}, 65536.0, "16-mixed: initial loss scale", 0},
      {"scaler_growth", KeyKind::Float, {}, 2.0, "16-mixed: scale growth factor", 1},
      {"scaler_backoff", KeyKind::Float, {}, 0.5, "16-mixed: scale backoff factor on inf/NaN", 0},
      {"scaler_interval", KeyKind::Int, {}, 2000, "16-mixed: clean steps before the scale grows", 1},
      {"loss_multiplier", KeyKind::Float, {}, 1.0,
       "stress knob: backward runs on loss x this (every gradient scaled), the report keeps the true loss", 0},
      {"overflow_every", KeyKind::Int, {}, 20, "sample per-block fp16 range statistics every k steps; 0: off", 0},
      {"batch_size", KeyKind::Int, {}, 64, "samples per optimizer step", 1},
      {"steps", KeyKind::Int, {}, 100, "measured optimizer steps (after warm-up)", 1},
      {"warmup_steps", KeyKind::Int, {}, 5, "steps run before measuring", 0},
      {"seed", KeyKind::Int, {}, 0, "seed of every generator", 0},
      {"device", KeyKind::String, {}, "auto", "auto, cpu, cuda or cuda:<index>"},
      {"threads", KeyKind::Int, {}, 0, "intra-op CPU threads; 0: one per core", 0},
      {"kind", KeyKind::Choice, {"train", "gemm-peak", "memory-bandwidth", "copy-bandwidth", "collectives"}, "train",
       "what the cell measures: a training run, or the hardware (the GEMM peak per dtype, device memory bandwidth, "
       "host-device copy bandwidth, collectives' busbw per size on world_size ranks)"},
      {"thorough", KeyKind::Bool, {}, false, "gemm-peak: the long shape sweep (minutes per dtype on a GPU)"},
      {"timeline", KeyKind::Bool, {}, false,
       "CUDA: record the GPU timeline with CUPTI (compute/communication overlap, idle time, top kernels)"},
      {"sustain_window_s", KeyKind::Float, {}, 60.0,
       "throughput is also reported per window of this many seconds of the run (a drop flags throttling)", 0.1},
      {"timeout_s", KeyKind::Float, {}, 600.0, "wall-clock limit of the cell's process", 0},
      {"time_budget_s", KeyKind::Float, {}, 0.0,
       "stop measuring after this many seconds of training (the cell records it; its numerics are compared at "
       "the steps it ran); 0: off", 0},
      {"log_every", KeyKind::Int, {}, 0, "loss-curve sampling interval; 0: about 50 points", 0},
      {"trace", KeyKind::Bool, {}, false,
       "write a Chrome Trace Event / Perfetto timeline of each rank (steps, phases, collectives, counters)"},
      {"operator_times", KeyKind::Bool, {}, false,
       "time each kind of operator inside the step (GEMM, attention, activation, ...) on every other measured step: "
       "the planner's calibration (the hardware suite's calibration cells)"},
      {"eval", KeyKind::Bool, {}, true, "evaluate test accuracy after training (classifiers)"},
      {"inject", KeyKind::Choice,
       {"none", "crash", "abort", "hang", "throw", "same-data-seed", "skip-broadcast", "rank-dropout-seed",
        "tp-same-dropout-seed", "local-negatives", "teacher-drift", "slow:<pct>"},
       "none",
       "inject a fault: crash/abort/hang/throw the process (isolation); same-data-seed, skip-broadcast, "
       "rank-dropout-seed break the ranks' RNG and weights, tp-same-dropout-seed gives the tp ranks one "
       "model-parallel dropout seed (the RNG probe must catch them); local-negatives: SimCLR "
       "contrasts against this rank's views only; teacher-drift: BYOL/DINO teachers copied before the weight "
       "broadcast (they differ across ranks); slow:<pct> makes "
       "every step pct percent slower (to measure the comparison gate)"},
      {"inject_rank", KeyKind::Int, {}, -1, "the rank a process fault hits; -1: every rank", -1},
      {"inject_step", KeyKind::Int, {}, 0, "the training step before which a process fault fires", 0},
      // Self-supervised pre-training (suites/ssl) and its evaluation.
      {"unlabeled_size", KeyKind::Int, {}, 0,
       "Fashion-MNIST: the training stream draws from the first N images of a fixed permutation (nested subsets); "
       "0: all 60000", 0},
      {"ssl_temperature", KeyKind::Float, {}, 0.5, "simclr: NT-Xent temperature", 0.001},
      {"ema_tau", KeyKind::Float, {}, 0.99, "byol/dino: the teacher's EMA momentum at step 0, raised to 1 by a cosine", 0},
      {"projector_bn", KeyKind::Choice, {"per-rank", "sync"}, "per-rank",
       "multi-rank: the projection heads' BatchNorm statistics per rank, or over the global batch (synchronised)"},
      {"dino_prototypes", KeyKind::Int, {}, 1024, "dino: output dimension K of the heads", 2},
      {"dino_teacher_temp", KeyKind::Float, {}, 0.04, "dino: teacher softmax temperature", 0.001},
      {"dino_student_temp", KeyKind::Float, {}, 0.1, "dino: student softmax temperature", 0.001},
      {"dino_center_momentum", KeyKind::Float, {}, 0.9, "dino: momentum of the teacher-output centre", 0},
      {"dino_freeze_last_steps", KeyKind::Int, {}, 0, "dino: the heads' last layer stays frozen for this many steps", 0},
      {"mask_ratio", KeyKind::Float, {}, 0.75, "mae: fraction of patches hidden from the encoder", 0},
      {"norm_pix", KeyKind::Bool, {}, true, "mae: targets are per-patch normalised pixels"},
      {"ssl_eval", KeyKind::Choice, {"auto", "full", "frozen", "off"}, "auto",
       "after training: frozen = kNN and linear probe of the encoder's features beside the random-encoder and "
       "raw-pixel floors; full = also fine-tuning (SSL) or from-scratch curves (supervised) on label_fractions x "
       "label_seeds subsets; auto: full for SSL methods, off for supervised"},
      {"label_fractions", KeyKind::String, {}, "0.01,0.1,1",
       "ssl_eval = full: fractions of the labelled training set (comma-separated, in (0, 1])"},
      {"label_seeds", KeyKind::Int, {}, 3, "ssl_eval = full: class-balanced label subsets drawn per fraction", 1},
      {"probe_epochs", KeyKind::Int, {}, 20, "linear probe: epochs of SGD over the frozen features", 1},
      {"finetune_steps", KeyKind::Int, {}, 150, "fine-tuning steps (batch 64) per label subset", 1},
      {"scratch_steps", KeyKind::Int, {}, 1200,
       "supervised, ssl_eval = full: longest from-scratch run per subset (accuracy recorded along the way)", 1},
      {"eval_bank", KeyKind::Int, {}, 0, "kNN bank and probe training set: the first N training images; 0: all", 0},
      {"save_encoder", KeyKind::String, {}, "",
       "write the trained encoder's parameters and buffers to this file (relative: to the run's output folder; {model} "
       "and {method} stand for the cell's)"},
      {"pretrained", KeyKind::String, {}, "",
       "start the encoder from a file written by save_encoder (relative: to the run's output folder)"},
  };
  return keys;
}

const KeySpec& key_spec(const std::string& name) {
  for (const auto& k : config_keys())
    if (k.name == name) return k;
  throw UsageError("unknown key '" + name + "' (allowed: " + join(key_names()) + ")");
}

double slow_percent(const std::string& inject) {
  if (inject.rfind("slow:", 0) != 0) return 0;
  try {
    size_t used = 0;
    const double pct = std::stod(inject.substr(5), &used);
    if (used == inject.size() - 5 && pct > 0 && pct <= 1000) return pct;
  } catch (const std::exception&) {
  }
  return 0;
}

json validate_value(const std::string& key, const json& value) {
  const KeySpec& spec = key_spec(key);
  auto bad = [&](const std::string& want) {
    return UsageError("bad value " + describe(value) + " for '" + key + "': " + want);
  };
  // TOML's booleans for `tied` (true, false) as the choice's words.
  if (key == "tied" && value.is_boolean()) return json(value.get<bool>() ? "true" : "false");
  switch (spec.kind) {
    case KeyKind::Choice: {
      if (value.is_string())
        for (const auto& c : spec.choices)
          if (c == value.get<std::string>()) return value;
      // inject = slow:<pct>: every step made pct percent slower (the comparison gate's known effect).
      if (key == "inject" && value.is_string() && slow_percent(value.get<std::string>()) > 0) return value;
      throw UsageError("unknown " + key + " '" + describe(value) + "' (allowed: " +
                       join(spec.choices) + ")");
    }
    case KeyKind::String: {
      if (!value.is_string()) throw bad("expected a string");
      if (key == "checkpoint") {
        std::string kind;
        int64_t every = 1;
        if (!parse_checkpoint(value.get<std::string>(), kind, every))
          throw UsageError("unknown checkpoint '" + value.get<std::string>() +
                           "' (allowed: none, full, every:<k>, selective, selective-op)");
      }
      if (key == "layout" && !value.get<std::string>().empty()) parse_layout(value.get<std::string>());
      if (key == "reshard_after_forward") {
        const std::string v = value.get<std::string>();
        const bool number = !v.empty() && v.size() < 7 && v.find_first_not_of("0123456789") == std::string::npos && std::stoll(v) >= 1;
        if (v != "true" && v != "false" && !number)
          throw UsageError("bad value '" + v + "' for 'reshard_after_forward': expected true, false or a group size >= 1");
      }
      if (key == "memory_budget") {
        double bytes = 0;
        const std::string v = value.get<std::string>();
        if (v != "none" && !parse_bytes(v, bytes))
          throw UsageError("bad value '" + v + "' for 'memory_budget': expected none or a size such as 512MiB or 2GB");
      }
      if (key == "label_fractions") {
        std::vector<double> f;
        if (!parse_fractions(value.get<std::string>(), f))
          throw UsageError("bad value '" + value.get<std::string>() +
                           "' for 'label_fractions': expected comma-separated fractions in (0, 1], such as 0.01,0.1,1");
      }
      if (key == "model") {
        const std::string m = value.get<std::string>();
        if (m.empty() || m.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789._-") != std::string::npos)
          throw UsageError("bad model name '" + m + "': lower-case letters, digits, '.', '_' and '-'");
      }
      if (key == "device") {
        const std::string d = value.get<std::string>();
        const bool ok = d == "auto" || d == "cpu" || d == "cuda" ||
                        (d.rfind("cuda:", 0) == 0 && d.size() > 5 &&
                         d.find_first_not_of("0123456789", 5) == std::string::npos);
        if (!ok) throw UsageError("unknown device '" + d + "' (allowed: auto, cpu, cuda, cuda:<index>)");
      }
      return value;
    }
    case KeyKind::Int: {
      if (!value.is_number_integer() &&
          !(value.is_number_float() && std::floor(value.get<double>()) == value.get<double>()))
        throw bad("expected an integer");
      const int64_t v = value.is_number_integer() ? value.get<int64_t>()
                                                  : static_cast<int64_t>(value.get<double>());
      if (v < spec.min) throw bad("must be at least " + std::to_string(static_cast<int64_t>(spec.min)));
      return v;
    }
    case KeyKind::Float: {
      if (!value.is_number()) throw bad("expected a number");
      const double v = value.get<double>();
      if (!std::isfinite(v) || v < spec.min) throw bad("must be a finite number >= " + describe(spec.min));
      return v;
    }
    case KeyKind::Bool:
      if (!value.is_boolean()) throw bad("expected true or false");
      return value;
  }
  throw bad("unsupported kind");
}

json parse_value(const std::string& key, const std::string& text) {
  const KeySpec& spec = key_spec(key);
  switch (spec.kind) {
    case KeyKind::Choice:
    case KeyKind::String:
      return validate_value(key, text);
    case KeyKind::Bool:
      if (text == "true" || text == "1") return true;
      if (text == "false" || text == "0") return false;
      throw UsageError("bad value '" + text + "' for '" + key + "': expected true or false");
    case KeyKind::Int:
    case KeyKind::Float: {
      // The whole text must be a number: "32", "1e-3"; "32x" is an error.
      size_t used = 0;
      double v = 0;
      try {
        v = std::stod(text, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != text.size() || text.empty())
        throw UsageError("bad value '" + text + "' for '" + key + "': expected a number");
      return validate_value(key, json(v));  // Int accepts a float with no fraction
    }
  }
  throw UsageError("bad value for '" + key + "'");
}

// Binds every key of config_keys() to its RunConfig field, once, for both directions.
template <typename Config, typename Visit>
static void for_each_field(Config& c, Visit&& v) {
  v("model", c.model);
  v("family", c.family);
  v("layers", c.layers);
  v("d_model", c.d_model);
  v("heads", c.heads);
  v("kv_heads", c.kv_heads);
  v("ffn", c.ffn);
  v("seq_len", c.seq_len);
  v("vocab", c.vocab);
  v("tied", c.tied);
  v("rope_theta", c.rope_theta);
  v("rope_factor", c.rope_factor);
  v("rope_low_freq_factor", c.rope_low_freq_factor);
  v("rope_high_freq_factor", c.rope_high_freq_factor);
  v("rope_original_ctx", c.rope_original_ctx);
  v("norm_eps", c.norm_eps);
  v("attention", c.attention);
  v("data", c.data);
  v("precision", c.precision);
  v("reduce_dtype", c.reduce_dtype);
  v("reshard_after_forward", c.reshard_after_forward);
  v("cross_entropy", c.cross_entropy);
  v("fp16", c.fp16);
  v("fp8_scaling", c.fp8_scaling);
  v("parallel", c.parallel);
  v("world_size", c.world_size);
  v("dp_replicate", c.dp_replicate);
  v("dp_shard", c.dp_shard);
  v("tp", c.tp);
  v("sequence_parallel", c.sequence_parallel);
  v("sp_regather", c.sp_regather);
  v("pp", c.pp);
  v("pp_schedule", c.pp_schedule);
  v("pp_microbatches", c.pp_microbatches);
  v("pp_virtual", c.pp_virtual);
  v("pp_split", c.pp_split);
  v("cp", c.cp);
  v("cp_method", c.cp_method);
  v("cp_balance", c.cp_balance);
  v("layout", c.layout);
  v("backend", c.backend);
  v("bucket_mb", c.bucket_mb);
  v("prefetch", c.prefetch);
  v("hsdp_shard_size", c.hsdp_shard_size);
  v("collective_timeout_s", c.collective_timeout_s);
  v("augment", c.augment);
  v("rng_every", c.rng_every);
  v("save_parameters", c.save_parameters);
  v("parity_dump", c.parity_dump);
  v("initial_parameters", c.initial_parameters);
  v("checkpoint", c.checkpoint);
  v("checkpoint_check", c.checkpoint_check);
  v("dropout", c.dropout);
  v("memory_budget", c.memory_budget);
  v("method", c.method);
  v("optimizer", c.optimizer);
  v("lr", c.lr);
  v("weight_decay", c.weight_decay);
  v("lr_schedule", c.lr_schedule);
  v("grad_clip", c.grad_clip);
  v("scaler_init", c.scaler_init);
  v("scaler_growth", c.scaler_growth);
  v("scaler_backoff", c.scaler_backoff);
  v("scaler_interval", c.scaler_interval);
  v("loss_multiplier", c.loss_multiplier);
  v("overflow_every", c.overflow_every);
  v("batch_size", c.batch_size);
  v("steps", c.steps);
  v("warmup_steps", c.warmup_steps);
  v("seed", c.seed);
  v("device", c.device);
  v("threads", c.threads);
  v("kind", c.kind);
  v("thorough", c.thorough);
  v("timeline", c.timeline);
  v("sustain_window_s", c.sustain_window_s);
  v("timeout_s", c.timeout_s);
  v("trace", c.trace);
  v("operator_times", c.operator_times);
  v("time_budget_s", c.time_budget_s);
  v("log_every", c.log_every);
  v("eval", c.eval);
  v("inject", c.inject);
  v("inject_rank", c.inject_rank);
  v("inject_step", c.inject_step);
  v("unlabeled_size", c.unlabeled_size);
  v("ssl_temperature", c.ssl_temperature);
  v("ema_tau", c.ema_tau);
  v("projector_bn", c.projector_bn);
  v("dino_prototypes", c.dino_prototypes);
  v("dino_teacher_temp", c.dino_teacher_temp);
  v("dino_student_temp", c.dino_student_temp);
  v("dino_center_momentum", c.dino_center_momentum);
  v("dino_freeze_last_steps", c.dino_freeze_last_steps);
  v("mask_ratio", c.mask_ratio);
  v("norm_pix", c.norm_pix);
  v("ssl_eval", c.ssl_eval);
  v("label_fractions", c.label_fractions);
  v("label_seeds", c.label_seeds);
  v("probe_epochs", c.probe_epochs);
  v("finetune_steps", c.finetune_steps);
  v("scratch_steps", c.scratch_steps);
  v("eval_bank", c.eval_bank);
  v("save_encoder", c.save_encoder);
  v("pretrained", c.pretrained);
}

json RunConfig::to_json() const {
  json j = json::object();
  for_each_field(*this, [&](const char* key, const auto& field) { j[key] = field; });
  return j;
}

RunConfig RunConfig::from_json(const json& j) {
  if (!j.is_object()) throw UsageError("a run configuration must be a table of key = value");
  RunConfig c;
  json merged = c.to_json();
  for (auto it = j.begin(); it != j.end(); ++it) merged[it.key()] = validate_value(it.key(), it.value());
  for_each_field(c, [&](const char* key, auto& field) { merged.at(key).get_to(field); });
  const ModelShape model = resolve_model(c);  // an unknown model or inconsistent dimensions: one line, before anything runs
  // A layout given by its degrees sets the world size it needs; one that disagrees with a world size
  // given too, or that the model cannot take, is an error here.
  const bool layout_given = !c.layout.empty() || c.dp_replicate * c.dp_shard * c.tp * c.pp * c.cp > 1;
  if (layout_given && c.parallel == "single" && c.world_size == 1) c.world_size = given_layout(c).world();
  if (layout_given || c.parallel != "single") {
    const ParallelLayout layout = resolve_layout(c);
    check_layout_fits(layout, model);
    if (const std::string why = layout_unsupported(layout); !why.empty()) throw UsageError(why);
    if (c.sequence_parallel && layout.tp == 1) throw UsageError("sequence_parallel = true splits what tp splits; it needs tp > 1");
    if (c.sp_regather && !c.sequence_parallel) throw UsageError("sp_regather = true re-gathers sequence shards; it needs sequence_parallel = true");
    if (c.sp_regather && (!precision_traits(c.precision).autocast.empty() || c.checkpoint == "selective-op"))
      throw UsageError("sp_regather = true runs its GEMMs itself: not under autocast (" + c.precision +
                       ") or selective-op checkpointing in this build");
    // The blocks run LibTorch's CPU flash kernel (suites/parallel/context_parallel.hpp); `auto` on a GPU
    // machine is refused when the first attention runs, on that rank, the cell failed with this line.
    if (layout.cp > 1 && c.device.rfind("cuda", 0) == 0)
      throw UsageError("cp's attention runs LibTorch's CPU flash kernel in this build; its CUDA kernels are not wired yet (device = " +
                       c.device + ")");
    // The ring's blocks and the gathered keys run a flash kernel without dropout of its own.
    if (layout.cp > 1 && c.dropout > 0)
      throw UsageError("cp's attention blocks run without dropout in this build: set dropout = 0 (it is " + std::to_string(c.dropout) + ")");
  } else if (c.sequence_parallel || c.sp_regather) {
    throw UsageError("sequence_parallel = true splits what tp splits; it needs tp > 1");
  }
  const ParallelLayout layout = resolve_layout(c);
  if (layout.pp > 1 || c.pp_microbatches > 1 || c.pp_virtual > 0 || c.pp_schedule != "1f1b" || !c.pp_split.empty()) {
    const pipeline::Schedule s = resolve_pipeline(c, layout, model);
    if (c.method != "supervised" && s.microbatches > 1)
      throw UsageError("pp_microbatches > 1 cuts the batch; " + c.method + "'s loss is over the whole batch");
    if (s.microbatches > 1 && !pipelines_with(layout))
      throw UsageError("pp_microbatches > 1 with other dimensions than tp and dp_shard at zero3 (layout " + layout.name() +
                       ") is not implemented in this build yet");
  }
  if (c.reduce_dtype != "fp32" && precision_traits(c.precision).master.empty())
    throw UsageError("reduce_dtype = " + c.reduce_dtype + " applies to precisions with fp32 masters (bf16-master), not " + c.precision);
  return c;
}

bool parse_checkpoint(const std::string& text, std::string& kind, int64_t& every) {
  every = 1;
  if (text == "none" || text == "full" || text == "selective" || text == "selective-op") {
    kind = text;
    return true;
  }
  const std::string digits = text.rfind("every:", 0) == 0 ? text.substr(6) : "";
  if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) return false;
  every = std::stoll(digits);
  kind = "every";
  return every >= 1;
}

bool parse_fractions(const std::string& text, std::vector<double>& out) {
  out.clear();
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(item, &used);
    } catch (const std::exception&) {
      return false;
    }
    if (used != item.size() || !(v > 0 && v <= 1)) return false;
    out.push_back(v);
  }
  return !out.empty();
}

std::string ssl_eval_mode(const RunConfig& c) {
  if (c.ssl_eval != "auto") return c.ssl_eval;
  return c.method == "supervised" ? "off" : "full";
}

int64_t memory_budget_bytes(const RunConfig& c) {
  double bytes = 0;
  if (c.memory_budget == "none" || !parse_bytes(c.memory_budget, bytes)) return 0;
  return static_cast<int64_t>(bytes);
}

std::string axis_label(const std::string& key, const json& value) {
  const std::string v = describe(value);
  if (key == "model" || key == "precision" || key == "parallel" || key == "method" || key == "data" ||
      key == "optimizer" || key == "device" || key == "attention")
    return v;
  if (key == "batch_size") return "bs" + v;
  if (key == "checkpoint") return "ckpt-" + v;
  if (key == "world_size") return "ws" + v;
  if (key == "layout") return v;
  if (key == "dp_replicate" || key == "dp_shard" || key == "tp" || key == "pp" || key == "cp") return key + v;
  if (key == "steps") return "steps" + v;
  if (key == "seed") return "seed" + v;
  std::ostringstream out;
  out << key << "=" << v;
  return out.str();
}

}  // namespace trainscope
