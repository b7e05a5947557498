#include "plan/step.hpp"

#include <algorithm>
#include <filesystem>
#include <numeric>

#include "core/errors.hpp"

namespace trainscope::plan {

namespace {

int64_t padded(int64_t numel, int64_t world) { return (numel + world - 1) / world * world; }

std::string text_directory() {
  const char* env = std::getenv("TRAINSCOPE_TEXT_DIR");
  return env && *env ? env : "/usr/share/games/fortunes";
}

}  // namespace

int64_t resident_data_bytes(const std::string& data, const Replay& r) {
  if (data == "fashion-mnist") return (60000 + 10000) * (28 * 28 + 8);  // uint8 images, int64 labels
  if (data == "synthetic-images") return r.classes * r.channels * r.height * r.width * 4;
  if (data == "text") {
    // Every plain fortune file (no extension), as data.cpp reads them.
    int64_t bytes = 0;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(text_directory(), ec))
      if (e.is_regular_file() && !e.path().has_extension()) bytes += static_cast<int64_t>(e.file_size());
    return bytes;
  }
  return 0;
}

json MemoryPrediction::to_json() const {
  return {{"peak_bytes", peak},
          {"phase_peak_bytes", {{"forward", forward}, {"backward", backward}, {"optimizer", optimizer}}},
          {"baseline_bytes", baseline},
          {"activation_bytes", activations},
          {"data_bytes", data},
          {"model_state_bytes", {{"params", state.params}, {"grads", state.grads}, {"optimizer", state.optimizer}}},
          {"model_state_total_bytes", state.total()}};
}

StepSetup step_setup(const RunConfig& c, bool cuda) {
  StepSetup s;
  s.replay.model = resolve_model(c);
  s.replay.model.dropout = c.dropout;
  s.replay.model.attention = resolve_attention(c.attention, cuda ? "cuda" : "cpu", s.replay.model.seq_len);
  s.replay.batch = c.batch_size;
  s.replay.checkpoint = c.checkpoint;
  s.replay.num = numerics_of(c.precision, cuda);
  s.replay.cuda = cuda;
  s.strategy = c.world_size > 1 ? c.parallel : "single";
  s.world = c.world_size;
  s.shard = c.hsdp_shard_size;
  s.optimizer = c.optimizer;
  s.weight_decay = c.weight_decay;
  s.prefetch = c.prefetch;
  s.bucket_mb = c.bucket_mb;
  s.grad_clip = c.grad_clip > 0;
  std::string data = c.data;
  if (data == "auto") data = s.replay.model.family == "llama" ? "text" : s.replay.model.family == "gpt" ? "synthetic-tokens" : "fashion-mnist";
  s.data = data;
  s.resident_data_bytes = cuda ? 0 : resident_data_bytes(data, s.replay);
  return s;
}

MemoryPrediction predict_memory(const StepSetup& s) {
  const Replay& r = s.replay;
  if (const std::string why = replay_unsupported(r.model); !why.empty()) throw UsageError(why);
  const ParamLayout layout = param_layout(r);
  const int pe = r.num.param;
  const int64_t W = s.world;
  // hsdp holds what zero3 holds over its shard group (N ranks); the all-reduce across the groups is in
  // place.
  const bool z3 = s.strategy == "zero3" || s.strategy == "hsdp", z12 = s.strategy == "zero1" || s.strategy == "zero2";
  const int64_t N = s.sharding();
  Tape t;
  MemoryPrediction out;

  const T resident = t.data(s.resident_data_bytes, 1);  // held for the whole replay, as the data source is
  out.data = s.resident_data_bytes;
  std::vector<T> bufs;
  for (int64_t b : layout.buffers) bufs.push_back(t.data(b, 1));

  // ---- parameters and the strategy's buffers (setup) -----------------------------------------
  // Parameters in layout order: root first, then each block's.
  std::vector<int64_t> numels = layout.root;
  std::vector<std::pair<size_t, size_t>> block_range;  // per block, [begin, end) in numels
  for (const auto& b : layout.blocks) {
    block_range.emplace_back(numels.size(), numels.size() + b.size());
    numels.insert(numels.end(), b.begin(), b.end());
  }
  const int64_t total = layout.total();
  std::vector<T> params;
  T flat, flat_grad, bucket_grads;
  std::vector<T> owned_grads;  // zero: the optimizer's shard gradients (persistent)
  int64_t opt_numel = 0, largest_opt = 0;
  std::vector<int64_t> unit_numel;  // zero3: root, then blocks
  if (z3) {
    unit_numel.push_back(std::accumulate(layout.root.begin(), layout.root.end(), int64_t{0}));
    for (const auto& b : layout.blocks) unit_numel.push_back(std::accumulate(b.begin(), b.end(), int64_t{0}));
  }
  // Parameter handles (their storage: the tensors themselves, or views of a flat buffer).
  for (int64_t n : numels) params.push_back(t.param(n, pe));
  if (s.strategy == "single" || s.strategy == "ddp") {
    opt_numel = total;
    for (int64_t n : numels) largest_opt = std::max(largest_opt, n);
    if (s.strategy == "ddp") {
      bucket_grads = t.data(total, pe);  // gradient_as_bucket_view: the gradients are the buckets
      for (const T& p : params) t.adopt_param_grad(p);
    }
  } else if (z12) {
    // FlatParams: the parameters become views of one flat buffer padded to the world size.
    t.release(total * pe);
    flat = t.data(padded(total, W), pe);
    flat_grad = t.data(padded(total, W), pe);
    opt_numel = largest_opt = padded(total, W) / W;
    if (s.strategy == "zero1") {
      bucket_grads = t.data(total, pe);  // the reducer's own buckets (not views of the gradients)
    } else {
      owned_grads.push_back(t.data(opt_numel, pe));
      t.release(flat_grad.bytes());  // released until zero_grad
    }
    for (const T& p : params) t.adopt_param_grad(p);
  } else if (z3) {
    t.release(total * pe);  // flattened per unit, then released: each rank keeps shards
    for (int64_t u : unit_numel) {
      const int64_t shard = padded(u, N) / N;
      owned_grads.push_back(t.data(shard, pe));  // shard (its own memory)
      owned_grads.push_back(t.data(shard, pe));  // its gradient: zeros_like
      opt_numel += shard;
      largest_opt = std::max(largest_opt, shard);
    }
    for (size_t i = 0; i < layout.root.size(); ++i) t.adopt_param_grad(params[i]);
  } else {
    throw UsageError("unknown parallel strategy '" + s.strategy + "'");
  }
  out.baseline = t.live();
  // The memory probe's peak starts here (run_begin): building the full model before sharding it is
  // set-up, not training.
  t.reset_peak();
  // Allocated by the first step's GEMMs and kept: inside the probe's peak, not its baseline.
  if (s.replay.persistent_workspace > 0) t.alloc(s.replay.persistent_workspace);

  T fp16_masters;
  std::vector<T> opt_state;
  int64_t fwd = 0, bwd = 0, optim = 0;
  for (int step = 0; step < 2; ++step) {
    // The batch: the global batch drawn, each rank's slice a view of it.
    T input, target;
    const bool tokens = r.model.language_model();
    if (tokens) {
      input = t.data(W * r.batch * r.model.seq_len, 8);
      target = t.data(W * r.batch * r.model.seq_len, 8);
    } else {
      input = t.data(W * r.batch * r.channels * r.height * r.width, 4);
      target = t.data(W * r.batch, 8);
      if (pe != 4) input = t.data(r.batch * r.channels * r.height * r.width, pe);  // .to(param dtype)
    }
    t.reset_phase();
    // zero_grad
    if (s.strategy == "single") t.free_param_grads();
    if (s.strategy == "zero2") t.alloc(flat_grad.bytes());
    if (r.num.fp16_emulated) {  // Fp16WeightRounding::round: fp32 masters, each parameter through fp16
      if (!fp16_masters) fp16_masters = t.data(total, 4);
      int64_t largest = 0;
      for (int64_t n : numels) largest = std::max(largest, n);
      t.transient(largest * 2);
    }
    int64_t gathered = 0;
    if (z3) {  // before_forward: the root unit gathered for the step, its gradient buffer allocated
      t.alloc(padded(unit_numel[0], N) * pe * 2);
      gathered += padded(unit_numel[0], N) * pe * 2;
    }
    const int64_t start = t.live();
    T loss;
    {
      if (z3) {
        // Zero3BlockFunction: gather the block (and prefetch the next) around its forward, keep its
        // graph, release; in backward gather again (prefetching the previous), reduce-scatter.
        t.block_wrapper = [&t, &unit_numel, N, pe, prefetch = s.prefetch](size_t i, const std::function<T(Tape&, const T&)>& body,
                                                              const T& x) -> T {
          const int64_t blocks = static_cast<int64_t>(unit_numel.size()) - 1;
          const int64_t bytes = padded(unit_numel[i + 1], N) * pe;
          const int64_t next_fwd = prefetch && static_cast<int64_t>(i) + 1 < blocks ? padded(unit_numel[i + 2], N) * pe : 0;
          const int64_t next_bwd = prefetch && i > 0 ? padded(unit_numel[i], N) * pe : 0;
          t.alloc(bytes);  // gather (or the prefetch that already holds it)
          if (next_fwd) t.alloc(next_fwd);
          T y = t.own_graph(body, x, [bytes, next_bwd, N, pe](Tape& tape, const std::function<void()>& run) {
            tape.alloc(bytes);
            if (next_bwd) tape.alloc(next_bwd);
            run();
            tape.release(bytes);
            // Unit::reduce: the flat gradient, the shard out, then the returned gradients go.
            tape.alloc(bytes);
            tape.transient(bytes / N);
            tape.release(bytes);
            tape.free_collected();
            if (next_bwd) tape.release(next_bwd);  // counted again by that block's gather
          });
          t.release(bytes);
          if (next_fwd) t.release(next_fwd);  // counted again by the next block's gather
          return y;
        };
      }
      loss = forward_loss(t, r, params, input, target);
      t.block_wrapper = nullptr;
      t.autocast_cache.clear();  // the step's autocast region exits with the forward
      if (step == 1) {
        out.forward_costs = t.forward_costs;
        out.forward_ops = t.ops;
      }
      t.forward_costs.clear();
      t.recompute_costs.clear();
      t.ops = 0;
    }
    fwd = std::max(fwd, t.phase_peak());
    out.activations = std::max(out.activations, t.phase_peak() - start);
    t.reset_phase();
    T scaled = r.num.scaler ? t.data(1, 4) : T();
    t.backward(loss);
    loss = T();
    scaled = T();
    if (step == 1) out.recompute_costs = t.recompute_costs;
    if (s.strategy == "zero2") {  // the shard's gradient copied from the flat buffer, which is released
      t.release(flat_grad.bytes());
    }
    if (z3) t.release(gathered);  // the root's gradient reduce-scattered, its flat buffer released
    bwd = std::max(bwd, t.phase_peak());
    t.reset_phase();
    // The optimizer's step over its tensors (the parameters, or this rank's shards).
    if (r.num.fp16_emulated && !r.num.scaler) {
      int64_t largest = 0;
      for (int64_t n : numels) largest = std::max(largest, n);
      t.transient(largest);  // isfinite(grad): a bool per element
    }
    const int64_t words = s.optimizer == "sgd" ? 1 : 2;
    if (opt_state.empty()) {
      // State is created parameter by parameter inside the first step, next to the step's temporaries.
      const int64_t temp = (s.optimizer == "sgd" ? (s.weight_decay != 0 ? 1 : 0) : 2) * largest_opt * pe;
      t.transient(opt_numel * words * pe + temp);
      opt_state.push_back(t.data(opt_numel * words, pe));
    } else {
      // AdamW: (exp_avg_sq.sqrt() / c).add_(eps), two temporaries of the parameter; SGD: weight decay's add.
      t.transient((s.optimizer == "sgd" ? (s.weight_decay != 0 ? 1 : 0) : 2) * largest_opt * pe);
    }
    optim = std::max(optim, t.phase_peak());
    input = T();
    target = T();
  }
  out.forward = fwd;
  out.backward = bwd;
  out.optimizer = optim;
  out.peak = t.peak();
  // Model state as the strategy counts it at the end of a step.
  const int64_t words = s.optimizer == "sgd" ? 1 : 2;
  out.state.optimizer = opt_numel * words * pe;
  if (s.strategy == "single" || s.strategy == "ddp") {
    out.state.params = total * pe;
    out.state.grads = total * pe;
  } else if (z12) {
    out.state.params = padded(total, W) * pe;
    out.state.grads = s.strategy == "zero1" ? padded(total, W) * pe : opt_numel * pe;
  } else {
    out.state.params = opt_numel * pe;
    out.state.grads = opt_numel * pe;
  }
  return out;
}

}  // namespace trainscope::plan
