#include "plan/step.hpp"

#include <algorithm>
#include <filesystem>
#include <map>
#include <numeric>

#include "core/errors.hpp"

namespace trainscope::plan {

namespace {

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

void StepSetup::set_pp_rank(int64_t rank) {
  pp_rank = rank;
  replay.held.clear();
  if (schedule.ranks == 1) return;
  const auto cuts = schedule.cuts.empty() ? pipeline::stage_layers(replay.model.layers, schedule.stages()) : schedule.cuts;  // Pipeline::layers_of
  for (int64_t stage = rank; stage < schedule.stages(); stage += schedule.ranks) replay.held.push_back(cuts.at(static_cast<size_t>(stage)));
}

StepSetup step_setup(const RunConfig& c, bool cuda) {
  StepSetup s;
  s.replay.model = resolve_model(c);
  s.replay.model.dropout = c.dropout;
  s.replay.model.attention = resolve_attention(c.attention, cuda ? "cuda" : "cpu", s.replay.model.seq_len);
  s.replay.batch = c.batch_size;
  s.replay.checkpoint = c.checkpoint;
  s.replay.cross_entropy = c.cross_entropy;
  s.replay.num = numerics_of(c.precision, cuda, c.reduce_dtype);
  s.replay.cuda = cuda;
  s.layout = resolve_layout(c);
  s.replay.tp = s.layout.tp;
  s.replay.sequence_parallel = c.sequence_parallel;
  s.replay.cp = s.layout.cp;
  s.replay.cp_method = c.cp_method;
  s.replay.cp_balance = c.cp_balance;
  if (c.sp_regather) throw UsageError("sp_regather: the planner replays the gathered input kept for backward (DTensor's), not Megatron's re-gathering");
  s.schedule = resolve_pipeline(c, s.layout, s.replay.model);
  s.set_pp_rank(0);
  if (s.layout.shard_by_host) {  // hsdp by node, planned on one node: zero3 over its ranks (a check reads the run's)
    s.layout.shard_by_host = false;
  }
  s.optimizer = c.optimizer;
  s.weight_decay = c.weight_decay;
  s.prefetch = c.prefetch;
  s.reshard_after_forward = c.reshard_after_forward;
  s.bucket_mb = c.bucket_mb;
  s.grad_clip = c.grad_clip > 0;
  std::string data = c.data;
  if (data == "auto") data = s.replay.model.family == "llama" ? "text" : s.replay.model.family == "gpt" ? "synthetic-tokens" : "fashion-mnist";
  s.data = data;
  s.resident_data_bytes = cuda ? 0 : resident_data_bytes(data, s.replay);
  return s;
}

namespace {

// One rank's training steps on the tape: the strategy's set-up, then two steps (the first creates the
// optimizer's state), each phase's peak taken as the memory probe takes it. Each method mirrors the
// code it names.
class StepReplay {
 public:
  explicit StepReplay(const StepSetup& s)
      : s_(s), r_(s.replay), layout_(param_layout(r_)), pe_(r_.num.param), oe_(r_.num.optimizer_bytes()), W_(s.data_parallel()),
        N_(s.sharding()) {
    const std::string st = s.strategy();
    units_ = s.units();
    if (units_ && st != "zero3" && st != "hsdp") N_ = 1;  // units without a shard group
    sharded_ = units_ && N_ > 1;
    kept_ = units_ && s.reduce_deferred();
  }
  MemoryPrediction run();

 private:
  void setup();
  void step(int index);
  void zero_grad();
  void inputs();
  void gather_root();
  void forward(bool record);
  void backward(bool record);
  // A (stage, micro-batch) of the pipeline: its received input, its output, its graph until backward.
  struct Slot {
    T input, output;
    Tape::Graph graph;
    std::shared_ptr<Storage> seed;  // zb-1p: the received gradient, from I to W
  };
  void pipeline_run(bool record);
  std::shared_ptr<Storage> stage_forward(int64_t stage, Slot& slot, Replay& micro, bool timed);
  std::shared_ptr<Storage> stage_backward(int64_t stage, Slot& slot, bool timed);
  std::shared_ptr<Storage> stage_backward_input(int64_t stage, Slot& slot);
  void reduce_gradients();
  void optimizer();
  void set_model_state();
  // Full sharding's block wrapper: Zero3BlockFunction (suites/parallel/fully_shard.cpp).
  T unit_block(size_t i, const Tape::BlockFn& body, const T& x);
  T kept_unit_block(size_t i, const Tape::BlockFn& body, const T& x);
  void gather_kept(size_t u);
  int64_t unit_bytes(size_t u) const { return padded(unit_numel_[u]) * pe_; }  // a unit's gathered flat buffer
  int64_t shard_numel(size_t u) const { return padded(unit_numel_[u]) / N_; }
  int64_t padded(int64_t n) const { return (n + N_ - 1) / N_ * N_; }
  // All-gathering a shard with masters casts it first: a temporary of the compute dtype (one shard).
  int64_t cast_source(size_t u) const { return r_.num.master && sharded_ ? shard_numel(u) * pe_ : 0; }

  const StepSetup& s_;
  const Replay& r_;
  const ParamLayout layout_;
  const int pe_, oe_;  // compute parameter and optimizer element bytes
  const int64_t W_;
  int64_t N_;
  bool units_ = false, sharded_ = false;
  bool kept_ = false;  // blocks gathered once per step, gradients reduced after the last micro-batch
  std::vector<bool> gathered_, accumulating_;  // kept_: per unit, this step
  Tape t_;
  MemoryPrediction out_;
  std::vector<T> params_, opt_state_, buffers_;
  T loss_;
  std::pair<T, T> batch_;  // the step's input and target, held until its optimizer step
  std::vector<int64_t> numels_, unit_numel_;  // parameters in layout order (root first); units: root, then blocks
  T flat_, flat_grad_, bucket_grads_, accumulator_, fp16_masters_;
  std::vector<T> owned_;  // the optimizer's shards and their gradients (persistent)
  int64_t opt_numel_ = 0, largest_opt_ = 0, total_ = 0;
  int64_t fwd_ = 0, bwd_ = 0, optim_ = 0;
};

void StepReplay::setup() {
  for (int64_t b : layout_.buffers) buffers_.push_back(t_.data(b, 1));  // BatchNorm statistics, held
  numels_ = layout_.root;
  for (const auto& b : layout_.blocks) numels_.insert(numels_.end(), b.begin(), b.end());
  total_ = layout_.total();
  for (int64_t n : numels_) params_.push_back(t_.param(n, pe_));
  const std::string st = s_.strategy();
  const bool z12 = st == "zero1" || st == "zero2";
  if (units_) {
    // make_unit: each unit flat and sharded, its fp32 master (or the parameters' own dtype) slice and
    // that slice's gradient kept; the flat buffers released until gathered.
    unit_numel_.push_back(std::accumulate(layout_.root.begin(), layout_.root.end(), int64_t{0}));
    for (const auto& b : layout_.blocks) unit_numel_.push_back(std::accumulate(b.begin(), b.end(), int64_t{0}));
    t_.release(total_ * pe_);
    const int se = r_.num.master ? r_.num.master : pe_;
    for (size_t u = 0; u < unit_numel_.size(); ++u) {
      owned_.push_back(t_.data(shard_numel(u), se));
      owned_.push_back(t_.data(shard_numel(u), se));
      opt_numel_ += shard_numel(u);
      largest_opt_ = std::max(largest_opt_, shard_numel(u));
    }
    for (size_t i = 0; i < layout_.root.size(); ++i) t_.adopt_param_grad(params_[i]);
  } else if (st == "single" || st == "ddp") {
    opt_numel_ = total_;
    for (int64_t n : numels_) largest_opt_ = std::max(largest_opt_, n);
    if (st == "ddp") {
      bucket_grads_ = t_.data(total_, pe_);  // gradient_as_bucket_view: the gradients are the buckets
      for (const T& p : params_) t_.adopt_param_grad(p);
    }
  } else if (z12) {
    // FlatParams: the parameters become views of one flat buffer padded to the world size.
    const int64_t flat = (total_ + W_ - 1) / W_ * W_;
    t_.release(total_ * pe_);
    flat_ = t_.data(flat, pe_);
    flat_grad_ = t_.data(flat, pe_);
    opt_numel_ = largest_opt_ = flat / W_;
    if (r_.num.master) {  // MasterZero12: the fp32 slice and its gradient; zero1's full gradient buffer
      owned_.push_back(t_.data(opt_numel_, oe_));
      if (st == "zero1") accumulator_ = t_.data(flat, r_.num.reduce);
      if (!accumulator_ || r_.num.reduce != oe_) owned_.push_back(t_.data(opt_numel_, oe_));  // else a view of it
      t_.release(flat_grad_.bytes());  // allocated by zero_grad
    } else if (st == "zero1") {
      bucket_grads_ = t_.data(total_, pe_);  // the reducer's own buckets (not views of the gradients)
    } else {
      owned_.push_back(t_.data(opt_numel_, pe_));
      t_.release(flat_grad_.bytes());  // released until zero_grad
    }
    for (const T& p : params_) t_.adopt_param_grad(p);
  } else {
    throw UsageError("unknown parallel strategy '" + st + "'");
  }
}

void StepReplay::zero_grad() {
  const std::string st = s_.strategy();
  if (st == "single" && !units_) t_.free_param_grads();
  if (st == "zero2" || (r_.num.master && (st == "zero1" || st == "zero2"))) t_.alloc(flat_grad_.bytes());
  if (r_.num.fp16_emulated) {  // Fp16WeightRounding::round: fp32 masters, each parameter through fp16
    if (!fp16_masters_) fp16_masters_ = t_.data(total_, 4);
    t_.transient(*std::max_element(numels_.begin(), numels_.end()) * 2);
  }
}

T StepReplay::unit_block(size_t i, const Tape::BlockFn& body, const T& x) {
  // Zero3BlockFunction: gather the block, prefetch the next, run the block's own graph, reshard; in
  // backward gather again (prefetching the previous), reduce-scatter. A prefetched buffer is counted by
  // the block that prefetched it while that block runs, then again by its own gather (the same memory);
  // a prefetch's cast source (with masters) lives until that gather.
  const size_t u = i + 1, blocks = layout_.blocks.size();
  const int64_t bytes = unit_bytes(u), shard = shard_numel(u);
  const std::string how = s_.reshard_after_forward;
  const int64_t r = how == "true" || how == "false" || !sharded_ ? 0 : std::stoll(how);
  const bool keep_all = how == "false" || r == 1, keep_slice = r > 1 && r < N_;
  const bool prefetch = s_.prefetch && sharded_;
  // A kept buffer or slice is not prefetched in backward (Unit::prefetch).
  const bool prefetch_bwd = prefetch && !keep_all && !keep_slice;
  const int64_t next_fwd = prefetch && i + 1 < blocks ? unit_bytes(u + 1) + cast_source(u + 1) : 0;
  const int64_t next_bwd = prefetch_bwd && i > 0 ? unit_bytes(u - 1) + cast_source(u - 1) : 0;
  const bool prefetched_fwd = prefetch && i > 0, prefetched_bwd = prefetch_bwd && i + 1 < blocks;
  const int gelem = r_.num.master ? r_.num.reduce : pe_, se = r_.num.master ? r_.num.master : pe_;
  t_.alloc(bytes);
  if (prefetched_fwd) t_.release(cast_source(u));  // the prefetch's cast source goes once it arrived
  else t_.transient(cast_source(u));
  if (next_fwd) t_.alloc(next_fwd);
  T y = t_.own_graph(body, x, [=, this](Tape& tape, const std::function<void()>& run) {
    if (keep_slice) {
      tape.alloc(bytes);  // gathered from the kept slices, which then go
      tape.release(bytes / r);
    } else if (!keep_all) {
      tape.alloc(bytes);
      if (prefetched_bwd) tape.release(cast_source(u));
      else tape.transient(cast_source(u));
    }
    if (next_bwd) tape.alloc(next_bwd);
    run();
    tape.release(bytes);
    // Unit::reduce: the reduce_dtype buffer, the slice out (converted to the shard's dtype: a second
    // slice, the first gone), the buffer released; the slice accumulated into the shard's gradient goes,
    // then the gradients torch::autograd::grad returned.
    const int64_t buffer = padded(unit_numel_[u]) * gelem;
    tape.alloc(buffer);
    tape.alloc(shard * gelem);
    if (gelem != se) tape.alloc(shard * se), tape.release(shard * gelem);
    tape.release(buffer);
    tape.release(shard * (gelem != se ? se : gelem));
    tape.free_collected();
    if (next_bwd) tape.release(next_bwd - cast_source(u - 1));  // counted again by that block's gather
  });
  // After the forward: free the flat buffer, keep it, or keep a 1/r slice of it.
  if (keep_slice) t_.alloc(bytes / r);
  if (!keep_all) t_.release(bytes);
  if (next_fwd) t_.release(next_fwd - cast_source(u + 1));  // counted again by the next block's gather
  return y;
}

// The step's batch (Trainer::rank_batch), held until its optimizer step.
void StepReplay::inputs() {
  const int64_t W = W_;
  T input, target;
  if (r_.model.language_model()) {
    input = t_.data(W * r_.batch * r_.model.seq_len, 8);
    target = t_.data(W * r_.batch * r_.model.seq_len, 8);
  } else {
    input = t_.data(W * r_.batch * r_.channels * r_.height * r_.width, 4);
    target = t_.data(W * r_.batch, 8);
    if (pe_ != 4) input = t_.data(r_.batch * r_.channels * r_.height * r_.width, pe_);  // .to(param dtype)
  }
  batch_ = {input, target};
}

void StepReplay::gather_root() {
  if (!units_) return;
  // before_forward: the root unit gathered for the step, its gradient buffer allocated
  t_.alloc(unit_bytes(0));
  t_.transient(cast_source(0));
  t_.alloc(unit_bytes(0));
  gathered_.assign(unit_numel_.size(), false);
  accumulating_.assign(unit_numel_.size(), false);
}

void StepReplay::gather_kept(size_t u) {
  if (gathered_[u]) return;
  gathered_[u] = true;
  t_.alloc(unit_bytes(u));
  t_.transient(cast_source(u));
}

// Zero3BlockFunction with defer_reduce (suites/parallel/fully_shard.cpp): the block gathered at its first
// forward of the step (with prefetch, the next one with it) and kept; in backward its gradients, as
// torch::autograd::grad returns them, added into the unit's unsharded reduce_dtype gradient, allocated
// at its first backward.
T StepReplay::kept_unit_block(size_t i, const Tape::BlockFn& body, const T& x) {
  const size_t u = i + 1;
  gather_kept(u);
  if (s_.prefetch && sharded_ && u + 1 < unit_numel_.size()) gather_kept(u + 1);
  const int64_t accumulator = padded(unit_numel_[u]) * (r_.num.master ? r_.num.reduce : pe_);
  return t_.own_graph(body, x, [this, u, accumulator](Tape& tape, const std::function<void()>& run) {
    run();
    if (!accumulating_[u]) {
      accumulating_[u] = true;
      tape.alloc(accumulator);
    }
    tape.free_collected();
  });
}

void StepReplay::forward(bool record) {
  inputs();
  const auto& [input, target] = batch_;
  t_.reset_phase();
  zero_grad();
  gather_root();
  const int64_t start = t_.live();
  if (units_) t_.block_wrapper = [this](size_t i, const Tape::BlockFn& body, const T& x) { return unit_block(i, body, x); };
  loss_ = forward_loss(t_, r_, params_, input, target);
  t_.block_wrapper = nullptr;
  t_.autocast_cache.clear();  // the step's autocast region exits with the forward
  if (record) {
    out_.forward_costs = t_.forward_costs;
    out_.forward_ops = t_.ops;
  }
  t_.forward_costs.clear();
  t_.recompute_costs.clear();
  t_.ops = 0;
  fwd_ = std::max(fwd_, t_.phase_peak());
  out_.activations = std::max(out_.activations, t_.phase_peak() - start);
}

// Trainer::run_pipeline (suites/parallel/pipeline.cpp): this rank's actions in order on micro-batches
// of batch / m; each (stage, micro-batch) keeps its received input and its graph until its backward,
// each tensor sent is held until the schedule shows it received (core/pipeline.hpp: send_release). The
// memory probe's forward phase spans the whole run. The time model takes micro-batch 0's operators.
void StepReplay::pipeline_run(bool record) {
  const pipeline::Schedule& sched = s_.schedule;
  const auto rank = static_cast<size_t>(s_.pp_rank);
  inputs();
  t_.reset_phase();
  zero_grad();
  gather_root();
  const int64_t start = t_.live();
  if (units_)
    t_.block_wrapper = [this](size_t i, const Tape::BlockFn& body, const T& x) {
      return kept_ ? kept_unit_block(i, body, x) : unit_block(i, body, x);
    };
  Replay micro = r_;
  micro.batch = r_.batch / sched.microbatches;
  std::map<std::pair<int64_t, int64_t>, Slot> slots;
  std::vector<std::pair<int64_t, std::shared_ptr<Storage>>> sent;  // (released after action, buffer)
  const std::vector<int64_t> release = pipeline::send_release(sched).at(rank);
  const std::vector<pipeline::Action>& actions = sched.actions.at(rank);
  for (size_t k = 0; k < actions.size(); ++k) {
    const pipeline::Action& a = actions[k];
    Slot& slot = slots[{a.stage, a.microbatch}];
    const bool timed = record && a.microbatch == 0;
    std::shared_ptr<Storage> sends;
    if (a.op == pipeline::Op::Forward) sends = stage_forward(a.stage, slot, micro, timed);
    else if (a.op == pipeline::Op::BackwardInput) sends = stage_backward_input(a.stage, slot);
    else sends = stage_backward(a.stage, slot, timed);
    if (a.op == pipeline::Op::BackwardWeight) sends.reset();  // its input's gradient went with I
    if (a.op == pipeline::Op::Backward || a.op == pipeline::Op::BackwardWeight) slots.erase({a.stage, a.microbatch});
    if (release[k] >= 0 && sends) sent.emplace_back(release[k], std::move(sends));
    sent.erase(std::remove_if(sent.begin(), sent.end(), [k](const auto& x) { return x.first == static_cast<int64_t>(k); }), sent.end());
  }
  sent.clear();
  t_.block_wrapper = nullptr;
  fwd_ = std::max(fwd_, t_.phase_peak());
  out_.activations = std::max(out_.activations, t_.phase_peak() - start);
}

// A stage's forward of a micro-batch: from the tokens (stage 0) or a received hidden state ([b, S, D] in
// the parameters' dtype; S / tp of it per rank with sequence parallelism), its graph set aside; returns
// what it sends on (its output; the last stage sends nothing).
std::shared_ptr<Storage> StepReplay::stage_forward(int64_t stage, Slot& slot, Replay& micro, bool timed) {
  const pipeline::Schedule& sched = s_.schedule;
  const auto cuts = sched.cuts.empty() ? pipeline::stage_layers(r_.model.layers, sched.stages()) : sched.cuts;
  const int64_t boundary = micro.batch * r_.model.seq_len * r_.model.width / (r_.tp > 1 && r_.sequence_parallel ? r_.tp : 1);
  if (stage > 0) slot.input = t_.make(boundary, pe_, true);  // received: a leaf that wants its gradient
  const bool last = stage + 1 == sched.stages();
  micro.first_layer = cuts.at(static_cast<size_t>(stage)).first;
  micro.last_layer = last ? -1 : cuts.at(static_cast<size_t>(stage)).second;
  const size_t mark = t_.mark();
  slot.output = forward_loss(t_, micro, params_, slot.input ? slot.input : batch_.first, batch_.second);
  t_.autocast_cache.clear();  // each micro-batch's forward is an autocast region of its own
  slot.graph = t_.take_graph(mark);
  if (timed) {
    out_.forward_costs.insert(out_.forward_costs.end(), t_.forward_costs.begin(), t_.forward_costs.end());
    out_.forward_ops += t_.ops;
  }
  t_.forward_costs.clear();
  t_.ops = 0;
  return last ? nullptr : slot.output.storage;
}

// zb-1p's I (Pipeline::backward_input): the output's gradient received and kept for W, the input's
// gradient made and sent back; the graph kept whole until W, replayed as a whole backward (the runtime's
// W runs only the weights' part: an upper bound on its transients, within 1.7% on the zb-1p cells).
std::shared_ptr<Storage> StepReplay::stage_backward_input(int64_t stage, Slot& slot) {
  if (stage + 1 < s_.schedule.stages()) slot.seed = t_.data(slot.output.numel, slot.output.elem).storage;
  if (stage == 0) return nullptr;
  return t_.data(slot.input.numel, slot.input.elem).storage;
}

// Its backward: from the loss (the last stage) or the received gradient of its output; returns its
// input's gradient, which it sends back (stage 0: none).
std::shared_ptr<Storage> StepReplay::stage_backward(int64_t stage, Slot& slot, bool timed) {
  const bool last = stage + 1 == s_.schedule.stages();
  std::shared_ptr<Storage> seed = slot.seed ? std::move(slot.seed) : last ? nullptr : t_.data(slot.output.numel, slot.output.elem).storage;  // received
  std::shared_ptr<Storage> grad = t_.backward_graph(std::move(slot.graph), slot.output, seed, slot.input);
  if (timed) out_.recompute_costs.insert(out_.recompute_costs.end(), t_.recompute_costs.begin(), t_.recompute_costs.end());
  t_.recompute_costs.clear();
  return grad;
}

void StepReplay::backward(bool record) {
  const std::string st = s_.strategy();
  t_.reset_phase();
  T scaled = r_.num.scaler ? t_.data(1, 4) : T();
  t_.backward(loss_);
  loss_ = T();
  scaled = T();
  if (record) out_.recompute_costs = t_.recompute_costs;
  reduce_gradients();
}

// Strategy::reduce_gradients after the backward(s).
void StepReplay::reduce_gradients() {
  const std::string st = s_.strategy();
  if (kept_) {  // Zero3::reduce_gradients: each block's gradient reduce-scattered into its slice (converted to
                // the shard's dtype), then its unsharded gradient and its gathered parameters released
    const int gelem = r_.num.master ? r_.num.reduce : pe_, se = r_.num.master ? r_.num.master : pe_;
    for (size_t u = 1; u < unit_numel_.size(); ++u) {
      if (!accumulating_[u]) continue;
      t_.alloc(shard_numel(u) * gelem);
      if (gelem != se) t_.transient(shard_numel(u) * se);
      t_.release(shard_numel(u) * gelem + padded(unit_numel_[u]) * gelem + unit_bytes(u));
      accumulating_[u] = gathered_[u] = false;
    }
  }
  if (r_.num.master && (st == "zero1" || st == "zero2")) {
    // MasterZero12::reduce_gradients: zero2 converts into a reduce_dtype copy (in place when the
    // gradients already are in it; zero1 into its buffer), frees the bf16 gradients, reduce-scatters
    // into a slice that is copied into the fp32 gradient.
    const int64_t flat = flat_grad_.numel;
    const bool in_place = st == "zero2" && r_.num.reduce == pe_;
    if (st == "zero2" && !in_place) t_.alloc(flat * r_.num.reduce);
    if (!in_place) t_.release(flat_grad_.bytes());
    t_.transient(opt_numel_ * r_.num.reduce);
    t_.release(in_place ? flat_grad_.bytes() : st == "zero2" ? flat * r_.num.reduce : 0);
  } else if (st == "zero2") {  // the shard's gradient copied from the flat buffer, which is released
    t_.release(flat_grad_.bytes());
  }
  if (units_) {
    // reduce_gradients: the root's gradients (converted to reduce_dtype with masters), its slice, then
    // its flat buffer and gradient buffer released.
    const int64_t root = padded(unit_numel_[0]);
    const int gelem = r_.num.master ? r_.num.reduce : pe_;
    if (gelem != pe_) t_.alloc(root * gelem);
    t_.transient(shard_numel(0) * gelem + (r_.num.master && gelem != 4 ? shard_numel(0) * 4 : 0));
    if (gelem != pe_) t_.release(root * gelem);
    t_.release(2 * unit_bytes(0));
  }
  bwd_ = std::max(bwd_, t_.phase_peak());
}

void StepReplay::optimizer() {
  t_.reset_phase();
  // The optimizer's step over its tensors (the parameters, or this rank's shards).
  if (r_.num.fp16_emulated && !r_.num.scaler) t_.transient(*std::max_element(numels_.begin(), numels_.end()));  // isfinite(grad)
  const int64_t words = s_.optimizer == "sgd" ? 1 : 2;
  // AdamW: (exp_avg_sq.sqrt() / c).add_(eps), two temporaries of the parameter; SGD: weight decay's add.
  const int64_t temp = (s_.optimizer == "sgd" ? (s_.weight_decay != 0 ? 1 : 0) : 2) * largest_opt_ * oe_;
  if (opt_state_.empty()) {
    // State is created parameter by parameter inside the first step, next to the step's temporaries.
    t_.transient(opt_numel_ * words * oe_ + temp);
    opt_state_.push_back(t_.data(opt_numel_ * words, oe_));
  } else {
    t_.transient(temp);
  }
  // MasterZero12::after_step: the slice cast to bf16, all-gathered into the copy.
  if (r_.num.master && !units_) t_.transient(opt_numel_ * pe_);
  optim_ = std::max(optim_, t_.phase_peak());
  batch_ = {};
}

void StepReplay::set_model_state() {
  // Model state as the strategy counts it at the end of a step.
  const std::string st = s_.strategy();
  const int64_t words = s_.optimizer == "sgd" ? 1 : 2;
  ModelState& m = out_.state;
  m.optimizer = opt_numel_ * words * oe_;
  if (units_) {
    const int se = r_.num.master ? r_.num.master : pe_;
    m.params = m.grads = opt_numel_ * se;
  } else if (st == "single" || st == "ddp") {
    m.params = m.grads = total_ * pe_;
  } else if (r_.num.master) {
    m.params = flat_.bytes() + opt_numel_ * oe_;
    m.grads = (accumulator_ && r_.num.reduce == oe_ ? 0 : opt_numel_ * oe_) + (accumulator_ ? accumulator_.bytes() : 0);
  } else {
    m.params = flat_.bytes();
    m.grads = st == "zero1" ? flat_.bytes() : opt_numel_ * pe_;
  }
}

void StepReplay::step(int index) {
  if (s_.pipelined()) {
    pipeline_run(index == 1);
    t_.reset_phase();
    reduce_gradients();
  } else {
    forward(index == 1);
    backward(index == 1);
  }
  optimizer();
}

MemoryPrediction StepReplay::run() {
  const T resident = t_.data(s_.resident_data_bytes, 1);  // held for the whole replay, as the data source is
  out_.data = s_.resident_data_bytes;
  setup();
  out_.baseline = t_.live();
  // The memory probe's peak starts here (run_begin): building the full model before sharding it is
  // set-up, not training.
  t_.reset_peak();
  // Allocated by the first step's GEMMs and kept: inside the probe's peak, not its baseline.
  if (r_.persistent_workspace > 0) t_.alloc(r_.persistent_workspace);
  for (int i = 0; i < 2; ++i) step(i);
  out_.forward = fwd_;
  out_.backward = bwd_;
  out_.optimizer = optim_;
  out_.peak = t_.peak();
  set_model_state();
  return out_;
}

}  // namespace

MemoryPrediction predict_memory(const StepSetup& s) {
  if (const std::string why = replay_unsupported(s.replay); !why.empty()) throw UsageError(why);
  return StepReplay(s).run();
}

}  // namespace trainscope::plan
