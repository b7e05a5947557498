#include "plan/time.hpp"

#include <algorithm>
#include <map>
#include <numeric>

namespace trainscope::plan {

namespace {

int64_t padded(int64_t numel, int64_t world) { return (numel + world - 1) / world * world; }

struct Pass {
  double forward = 0, backward = 0;
  size_t ops = 0;
  std::map<std::string, std::pair<double, double>> by_kind;  // kind -> (forward, backward) seconds
};

const char* kind_name(OpKind k) {
  switch (k) {
    case OpKind::Activation: return "activation";
    case OpKind::Softmax: return "softmax";
    case OpKind::Norm: return "norm";
    case OpKind::Random: return "random";
    default: return "memory";
  }
}

// Forward and backward seconds of a pass's operators: a GEMM's backward is two GEMMs of its size
// (input and weight gradients); a memory-bound operator's backward moves about twice its bytes; the
// compute-bound elementwise kinds at their measured backward rates (dropout's backward: a product);
// SDPA's fused attention at its measured forward and backward rates where the device has them.
Pass cost_of(const std::vector<OpCost>& costs, const DeviceProfile& d, const std::string& dtype) {
  Pass p;
  // A measured fused-attention rate already holds the kernel's exponentials (on-chip elementwise).
  const bool fused = d.attention.count(dtype) > 0;
  for (const OpCost& c : costs) {
    if (fused && c.on_chip) continue;
    if (c.kind == OpKind::Gemm && c.fused_attention && fused) {
      const auto [f, b] = d.attention_seconds(dtype, static_cast<double>(c.batch / 2), static_cast<double>(c.m), static_cast<double>(c.k));
      p.forward += f;
      p.backward += b;
      p.by_kind["attention"].first += f;
      p.by_kind["attention"].second += b;
    } else if (c.kind == OpKind::Gemm) {
      const double s = d.gemm_seconds(dtype, static_cast<double>(c.m), static_cast<double>(c.n), static_cast<double>(c.k),
                                      static_cast<double>(c.batch));
      p.forward += s;
      p.backward += 2 * s;
      p.by_kind[c.conv ? "conv" : "gemm"].first += s;
      p.by_kind[c.conv ? "conv" : "gemm"].second += 2 * s;
    } else if (c.kind == OpKind::Memory) {
      const double s = d.memory_seconds(static_cast<double>(c.bytes));
      p.forward += s;
      p.backward += 2 * s;
      p.by_kind["memory"].first += s;
      p.by_kind["memory"].second += 2 * s;
    } else {
      const double e = static_cast<double>(c.elements);
      const double f = d.elementwise_seconds(kind_name(c.kind), e, c.elem, false, c.on_chip);
      const double b = c.kind == OpKind::Random ? d.memory_seconds(3 * e * c.elem)
                                                : d.elementwise_seconds(kind_name(c.kind), e, c.elem, true, c.on_chip);
      p.forward += f;
      p.backward += b;
      p.by_kind[kind_name(c.kind)].first += f;
      p.by_kind[kind_name(c.kind)].second += b;
    }
    if (c.kind != OpKind::Random) ++p.ops;
  }
  return p;
}

// The in-step calibration of this dtype, if the profile has one (a CPU's hardware report with
// calibration cells; fp32's for a dtype it did not calibrate).
const DeviceProfile::InStep* in_step_of(const DeviceProfile& d, const std::string& dtype) {
  if (auto it = d.in_step.find(dtype); it != d.in_step.end()) return &it->second;
  if (auto it = d.in_step.find("fp32"); it != d.in_step.end()) return &it->second;
  return nullptr;
}

// Each kind's kernel time as the calibration cells' steps ran that kind, over the profile's rates.
void calibrate(Pass& p, const DeviceProfile::InStep& cal) {
  p.forward = p.backward = 0;
  for (auto& [kind, fb] : p.by_kind) {
    const auto it = cal.factor.find(kind);
    fb.first *= it != cal.factor.end() ? it->second.first : cal.kernels_forward;
    fb.second *= it != cal.factor.end() ? it->second.second : cal.kernels_backward;
    p.forward += fb.first;
    p.backward += fb.second;
  }
}

// Blocks whose forward runs again in backward (and with it their collectives): full, selective-op and
// every:k recompute the whole block; selective only the attention core, which communicates nothing.
int64_t recomputed_blocks(const std::string& policy, int64_t layers) {
  if (policy == "full" || policy == "selective-op") return layers;
  if (policy.rfind("every:", 0) == 0) return layers == 0 ? 0 : (layers - 1) / std::stoll(policy.substr(6)) + 1;
  return 0;
}

// Tensor parallelism's collectives over the tp group (suites/parallel/tensor_parallel.cpp), per
// micro-batch of N tokens with activations of e bytes, L blocks: without sequence parallelism an
// all-reduce after each row-parallel layer (2 per block) and the embedding's in forward, one per
// Copy in backward (2 per block, the head's); with it each becomes an all-gather and a reduce-scatter of
// the same bytes (4L + 2 of each per micro-batch). The loss adds three all-reduces of a value per row.
// Each sits between two dependent operators: exposed (Megatron's and torchtitan's asynchronous TP, which
// overlaps them with the GEMMs, is not modelled).
void tensor_parallel_collectives(TimePrediction& t, const StepSetup& s, const DeviceProfile& d, const Cluster& c, int64_t accumulation) {
  const Replay& r = s.replay;
  const int64_t tp = r.tp, L = r.held_layers(), again = recomputed_blocks(r.checkpoint, L);
  const bool inter = tp > c.gpus_per_node;
  const int64_t batch = s.pipelined() ? r.batch / s.schedule.microbatches : r.batch;  // one micro-batch's
  const double e = r.num.autocast ? r.num.low : r.num.param, tokens = static_cast<double>(batch * r.model.seq_len);
  const double bytes = tokens * static_cast<double>(r.model.width) * e, micro = static_cast<double>(accumulation);
  auto add = [&](const std::string& op, double size, double calls) {
    const double sec = d.collective_seconds(op, size, tp, inter) * calls;
    t.comm_s += sec;
    t.exposed_comm_s += sec;
    t.collectives.push_back({{"op", op}, {"dimension", "tp"}, {"bytes", size}, {"calls", calls}, {"seconds", sec}, {"exposed_s", sec},
                             {"level", inter ? "inter-node" : "intra-node"}});
  };
  const double per_micro = static_cast<double>(4 * L + 2 + 2 * again);
  if (r.sequence_parallel) {
    add("all-gather", bytes, per_micro * micro);
    add("reduce-scatter", bytes, per_micro * micro);
  } else {
    add("all-reduce", bytes, per_micro * micro);
  }
  add("all-reduce", tokens * 4, 3 * micro);
  t.overlap_rule += std::string(t.overlap_rule.empty() ? "" : "; ") +
                    "tensor parallelism's collectives sit between dependent operators (exposed)";
}

// Context parallelism's transfers over the cp group (suites/parallel/context_parallel.cpp), per
// micro-batch and attention layer on W ranks of c tokens, K = this rank's keys and values (2 B Hkv c Dh
// e bytes), G = their gradients' sums (the accumulation dtype): forward, W - 1 transfers of K; backward,
// W - 1 of K and W of G (the last to its owner); a checkpointed layer's recomputation repeats the
// forward's. The ring posts K before each block and waits after it: a transfer is exposed by what
// outlasts the block (1 / W of the layer's attention, forward or backward); G is waited for right after
// it is posted (exposed). The all-gather's K arrives in one blocking collective, forward and backward
// (exposed). The group spans tp x cp consecutive ranks: inside a node or across nodes.
void context_parallel_collectives(TimePrediction& t, const StepSetup& s, const DeviceProfile& d, const Cluster& c,
                                  const std::string& dtype, int64_t accumulation) {
  const Replay& r = s.replay;
  const ModelShape& m = r.model;
  const int64_t W = r.cp, L = r.held_layers(), again = recomputed_blocks(r.checkpoint, L);
  const bool inter = W * r.tp > c.gpus_per_node && c.nodes > 1;
  const int64_t batch = s.pipelined() ? r.batch / s.schedule.microbatches : r.batch;
  const int64_t Hkv = m.kv_heads % r.tp == 0 ? m.kv_heads / r.tp : 1, Dh = m.head_dim(), cl = r.local_seq();
  const double e = r.num.autocast ? r.num.low : r.num.param, a = std::max(4.0, e);
  const double kv = 2.0 * static_cast<double>(batch * Hkv * cl * Dh) * e, g = kv / e * a;
  const double kv_s = d.collective_seconds("all-gather", 2 * kv, 2, inter), g_s = d.collective_seconds("all-gather", 2 * g, 2, inter);
  // This rank's attention per layer (plan/models.hpp: cp_attention_layer_cost), forward and backward.
  const OpCost cost = cp_attention_layer_cost(r, batch);
  double f_attn = 0, b_attn = 0;
  if (d.attention.count(dtype)) {
    std::tie(f_attn, b_attn) = d.attention_seconds(dtype, static_cast<double>(cost.batch / 2), static_cast<double>(cost.m), static_cast<double>(cost.k));
  } else {
    f_attn = d.gemm_seconds(dtype, static_cast<double>(cost.m), static_cast<double>(cost.n), static_cast<double>(cost.k), static_cast<double>(cost.batch));
    b_attn = 2 * f_attn;
  }
  const double forwards = static_cast<double>((L + again) * accumulation), backwards = static_cast<double>(L * accumulation);
  double sent_s = 0, exposed_s = 0;
  if (r.cp_method == "ring") {
    sent_s = forwards * (W - 1) * kv_s + backwards * ((W - 1) * kv_s + W * g_s);
    exposed_s = forwards * (W - 1) * std::max(0.0, kv_s - f_attn / W) + backwards * ((W - 1) * std::max(0.0, kv_s - b_attn / W) + W * g_s);
  } else {
    const double gather = d.collective_seconds("all-gather", kv * W, W, inter);
    sent_s = (forwards + backwards) * gather + backwards * W * g_s;
    exposed_s = sent_s;
  }
  t.comm_s += sent_s;
  t.exposed_comm_s += exposed_s;
  t.collectives.push_back({{"op", r.cp_method == "ring" ? "send" : "all-gather"}, {"dimension", "cp"}, {"bytes", kv},
                           {"seconds", sent_s}, {"exposed_s", exposed_s}, {"level", inter ? "inter-node" : "intra-node"},
                           {"attention_s_per_layer", {{"forward", f_attn}, {"backward", b_attn}}}});
  t.overlap_rule += std::string(t.overlap_rule.empty() ? "" : "; ") +
                    (r.cp_method == "ring" ? "cp's ring hides each key/value transfer under one block (1/cp of the layer's attention); "
                                             "the gradient sums are exposed"
                                           : "cp's all-gathers and gradient sums are exposed");
}

// The pipeline's idle time: the schedule replayed (core/pipeline.hpp) with each stage's forward and
// backward of one micro-batch taking this rank's share per stage (its compute with its exposed
// tensor-parallel collectives), and each boundary tensor ([b, S, D] in the parameters' dtype, S / tp
// with sequence parallelism) a point-to-point transfer (an all-gather of two ranks: latency + bytes /
// bandwidth), across nodes when a pipeline neighbour is on another node (pp outermost: world / pp ranks
// apart). What the busiest rank waits beyond its compute is the bubble; interleaving shrinks it.
void pipeline_bubble(TimePrediction& t, const StepSetup& s, const DeviceProfile& d, const Cluster& c, double tp_exposed) {
  const pipeline::Schedule& sched = s.schedule;
  const double m = static_cast<double>(sched.microbatches), v = static_cast<double>(sched.stages_per_rank);
  const double fwd = t.forward_s / v, bwd = (t.backward_s + t.recompute_s) / v;  // one micro-batch of one stage
  const double share = fwd + bwd > 0 ? tp_exposed / m / v / (fwd + bwd) : 0;
  const Replay& r = s.replay;
  const int64_t shards = r.tp > 1 && r.sequence_parallel ? r.tp : 1;  // sequence parallelism: each tp rank sends its S / tp
  const double bytes = static_cast<double>(r.batch / sched.microbatches * r.model.seq_len * r.model.width / shards * r.num.param);
  const bool inter = c.nodes > 1 && c.ranks() / s.layout.pp >= c.gpus_per_node;
  const double p2p = d.collective_seconds("all-gather", 2 * bytes, 2, inter);
  // A split backward (zb-1p) takes half in I and half in W: each a GEMM of the forward's size.
  const double b = bwd * (1 + share);
  const pipeline::Replay run = pipeline::replay(sched, {fwd * (1 + share), b / 2, b / 2, p2p});
  t.bubble_s = run.makespan - run.busy;
  t.pipeline = {{"schedule", sched.name}, {"ranks", sched.ranks}, {"stages_per_rank", sched.stages_per_rank},
                {"microbatches", sched.microbatches}, {"bubble_s", t.bubble_s}, {"bubble_fraction", run.bubble()},
                {"p2p_bytes", bytes}, {"p2p_s", p2p}, {"level", inter ? "inter-node" : "intra-node"},
                {"in_flight", run.peak_in_flight}};
}

// What the step's compute and data-parallel parts read of the parameters and the strategy.
struct DataParallel {
  ParamLayout layout;  // the parameters as tensors: the root's, then each block's
  int64_t total = 0, W = 1, pe = 0, gelem = 0, unit_group = 1;  // W data-parallel ranks; gelem: a gradient's bytes as reduced
  std::string st;
  bool master = false, units = false;
};

DataParallel data_parallel_of(const StepSetup& s) {
  DataParallel z;
  z.layout = param_layout(s.replay);
  z.total = z.layout.total();
  z.W = s.data_parallel();
  z.pe = s.replay.num.param;
  z.st = s.strategy();
  z.master = s.replay.num.master > 0;
  z.units = s.units();
  z.unit_group = z.st == "zero3" || z.st == "hsdp" ? s.sharding() : 1;
  z.gelem = z.master ? s.replay.num.reduce : z.pe;
  return z;
}

int64_t sum_of(const std::vector<int64_t>& numels) { return std::accumulate(numels.begin(), numels.end(), int64_t{0}); }

// The optimizer: LibTorch's AdamW makes ~9 kernels and ~23 element accesses per parameter element
// (decay, both moments, sqrt, division, the update); SGD with momentum ~3 and ~8. Its tensors: every
// parameter (single, ddp), each unit's shard (zero3, hsdp, a unit per block), or one flat shard (zero1,
// zero2). Returns {seconds, of which the host's dispatch}, before the CPU share and calibration.
std::pair<double, double> optimizer_seconds(const StepSetup& s, const DeviceProfile& d, const DataParallel& z) {
  std::vector<int64_t> tensors;
  if (!z.units && (z.st == "single" || z.st == "ddp")) {
    tensors = z.layout.root;
    for (const auto& b : z.layout.blocks) tensors.insert(tensors.end(), b.begin(), b.end());
  } else if (z.units) {
    const int64_t N = z.unit_group;
    tensors.push_back(padded(sum_of(z.layout.root), N) / N);
    for (const auto& b : z.layout.blocks) tensors.push_back(padded(sum_of(b), N) / N);
  } else {
    tensors.push_back(padded(z.total, z.W) / z.W);
  }
  const bool sgd = s.optimizer == "sgd";
  const int64_t oe = s.replay.num.optimizer_bytes();
  double seconds = 0, host = 0;
  for (int64_t n : tensors) {
    if (n == 0) continue;  // another pipeline stage's (emptied, no gradient: the optimizer skips it)
    host += (sgd ? 3 : 9) * d.op_overhead_s;
    seconds += (sgd ? 3 : 9) * d.op_overhead_s + d.memory_seconds(static_cast<double>((sgd ? 8 : 23) * n * oe));
  }
  return {seconds, host};
}

// Forward, backward, recompute and the optimizer, and how they add up to the step's compute: the host's
// dispatch (per operator, backward node and optimizer kernel) and the kernels themselves. A CPU runs
// them one after the other. On a GPU they run concurrently, the host queueing kernels ahead of the
// device, so the step takes the longer of the two (the H200 check, docs/plan.md: the device part within
// 5% of the timeline's busy time on gpt-125m and llama3-1b).
void compute_time(TimePrediction& t, const StepSetup& s, const MemoryPrediction& m, const DeviceProfile& d, const DataParallel& z,
                  const std::string& dtype, int64_t accumulation, double cpu_share) {
  const double slow = 1.0 / std::max(1e-9, cpu_share);
  Pass f = cost_of(m.forward_costs, d, dtype);
  Pass r = cost_of(m.recompute_costs, d, dtype);
  const DeviceProfile::InStep* cal = in_step_of(d, dtype);
  if (cal) {
    calibrate(f, *cal);
    calibrate(r, *cal);
    t.in_step = cal->cells.empty() ? "" : "calibrated in-step on " + std::to_string(cal->cells.size()) + " hardware-suite cells";
  }
  const double op_s = cal ? cal->op_s : d.op_overhead_s, node_s = cal ? cal->node_s : d.backward_node_s;
  for (const auto& [k, fb] : f.by_kind) t.breakdown[k] = {{"forward_s", fb.first * slow}, {"backward_s", fb.second * slow}};
  t.breakdown["per_operator"] = {{"forward_s", f.ops * op_s * slow}, {"backward_s", f.ops * node_s * slow}, {"operators", f.ops}};
  t.forward_s = (f.forward + f.ops * op_s) * slow;
  t.backward_s = (f.backward + f.ops * node_s) * slow;
  t.recompute_s = (r.forward + r.ops * (op_s + node_s)) * slow;
  const auto [optimizer_s, optimizer_host] = optimizer_seconds(s, d, z);
  t.optimizer_s = optimizer_s * slow * (cal ? cal->optimizer : 1.0);
  const double micro = t.forward_s + t.backward_s + t.recompute_s;
  t.host_s = (static_cast<double>(accumulation * (f.ops + r.ops)) * (op_s + node_s) + optimizer_host) * slow;
  t.device_s = accumulation * micro + t.optimizer_s - t.host_s;
  t.compute_s = d.gpu ? std::max(t.host_s, t.device_s) : t.host_s + t.device_s;
}

// One collective over the W data-parallel ranks, once per step, with nothing to hide it: all of it exposed.
void add_exposed_collective(TimePrediction& t, const DeviceProfile& d, const DataParallel& z, bool inter, const std::string& op,
                            double bytes) {
  const double sec = d.collective_seconds(op, bytes, z.W, inter);
  t.comm_s += sec;
  t.exposed_comm_s += sec;
  t.collectives.push_back({{"op", op}, {"bytes", bytes}, {"calls", 1.0}, {"seconds", sec}, {"exposed_s", sec}});
}

// MasterZero12: one reduce-scatter of the whole gradient in reduce_dtype after backward, one all-gather
// of the bf16 copy after the step: nothing left to hide either.
void master_zero12_collectives(TimePrediction& t, const DeviceProfile& d, const DataParallel& z, bool inter) {
  const double flat = static_cast<double>(padded(z.total, z.W));
  add_exposed_collective(t, d, z, inter, "reduce-scatter", flat * static_cast<double>(z.gelem));
  add_exposed_collective(t, d, z, inter, "all-gather", flat * static_cast<double>(z.pe));
  t.overlap_rule = "the gradients reduce-scattered after backward and the parameters all-gathered after the step: exposed";
}

// ddp, zero1, zero2: buckets as c10d's compute_bucket_assignment_by_size makes them: whole parameters in
// order, a bucket closed once it reaches its limit (1 MiB for the first, bucket_mb after), reduced as
// backward produces them: hidden behind the rest of backward, except what outlasts it and the last
// bucket, which starts at its end. zero1/zero2 all-gather the parameters after the step.
void bucketed_collectives(TimePrediction& t, const StepSetup& s, const DeviceProfile& d, const DataParallel& z, bool inter) {
  const double cap = std::max(1.0, s.bucket_mb * 1024 * 1024), first = std::min(cap, 1024.0 * 1024);
  std::vector<double> buckets;
  double open = 0;
  auto add_param = [&](int64_t numel) {
    open += static_cast<double>(numel * z.pe);
    if (open >= (buckets.empty() ? first : cap)) {
      buckets.push_back(open);
      open = 0;
    }
  };
  for (int64_t n : z.layout.root) add_param(n);
  for (const auto& b : z.layout.blocks)
    for (int64_t n : b) add_param(n);
  if (open > 0) buckets.push_back(open);
  const std::string op = z.st == "zero2" ? "reduce-scatter" : "all-reduce";
  double sum = 0, last = 0;
  for (double b : buckets) {
    last = d.collective_seconds(op, b, z.W, inter);
    sum += last;
  }
  const double exposed = std::max(last, sum - t.backward_s);
  t.comm_s += sum;
  t.exposed_comm_s += exposed;
  t.collectives.push_back({{"op", op}, {"bytes", static_cast<double>(z.total * z.pe)}, {"calls", buckets.size()}, {"seconds", sum},
                           {"exposed_s", exposed}});
  if (z.st != "ddp") {
    const double flat = static_cast<double>(padded(z.total, z.W) * z.pe);
    add_exposed_collective(t, d, z, inter, "all-gather", flat);  // after the step: nothing hides it
  }
  t.overlap_rule = "gradient buckets reduced during backward (exposed: what outlasts backward, at least the last bucket)" +
                   std::string(z.st == "ddp" ? "" : "; the parameter all-gather after the step is exposed");
}

// zero3 and hsdp, a unit per block: each block gathered before its forward and again before its
// backward, its gradients reduce-scattered after; with prefetch the next block's gather runs under the
// current block's compute. hsdp runs these within its shard group of N ranks (inside a node when N fits
// one: the fast links), then all-reduces each gradient slice across the W/N groups, synchronously.
void sharded_unit_collectives(TimePrediction& t, const StepSetup& s, const DeviceProfile& d, const Cluster& c, const DataParallel& z,
                              int64_t accumulation) {
  const bool inter = c.nodes > 1;
  const int64_t N = z.unit_group, R = z.W / std::max<int64_t>(N, 1), pe = z.pe;
  const bool shard_inter = N * s.replay.tp > c.gpus_per_node && c.nodes > 1;  // tp innermost: N x tp GPUs
  double ar_total = 0, ar_bytes = 0;
  auto replicas = [&](int64_t unit_bytes, double calls) {
    if (R < 2) return;
    const double slice = static_cast<double>(unit_bytes / N / pe * z.gelem);
    ar_total += d.collective_seconds("all-reduce", slice, R, inter) * calls;
    ar_bytes += slice * calls;
  };
  std::vector<size_t> held;  // this rank's blocks (under pp the other stages' are empty)
  for (size_t i = 0; i < z.layout.blocks.size(); ++i)
    if (sum_of(z.layout.blocks[i]) > 0) held.push_back(i);
  const size_t blocks = held.size();
  const double per_block_fwd = blocks ? (t.forward_s / static_cast<double>(blocks)) : 0;
  const double per_block_bwd = blocks ? ((t.backward_s + t.recompute_s) / static_cast<double>(blocks)) : 0;
  const double root = static_cast<double>(padded(sum_of(z.layout.root), N) * pe);
  const double root_ag = d.collective_seconds("all-gather", root, N, shard_inter);
  const double root_rs = d.collective_seconds("reduce-scatter", root / pe * z.gelem, N, shard_inter);
  // reshard_after_forward: false keeps the gathered block until its backward (no second gather); r
  // gathers it again over r ranks from the slices kept. Inside a pipeline stage each block is gathered
  // once and reduce-scattered once per step (StepSetup::reduce_deferred).
  const std::string& how = s.reshard_after_forward;
  const bool kept = s.reduce_deferred();
  const int64_t r = kept ? 1 : how == "true" || how == "false" ? (how == "true" ? N : 1) : std::stoll(how);
  const double per_step = kept ? 1.0 : static_cast<double>(accumulation);
  replicas(static_cast<int64_t>(root), 1);
  double ag_total = root_ag, ag_exposed = root_ag, rs_total = 0;
  for (size_t i = 0; i < blocks; ++i) {
    const double bytes = static_cast<double>(padded(sum_of(z.layout.blocks[held[i]]), N) * pe);
    const double ag = d.collective_seconds("all-gather", bytes, N, shard_inter);
    const double ag_back = r >= N ? ag : r == 1 ? 0 : d.collective_seconds("all-gather", bytes, r, false);
    const double rs = d.collective_seconds("reduce-scatter", bytes / pe * z.gelem, N, shard_inter);
    replicas(static_cast<int64_t>(bytes), per_step);
    ag_total += (ag + ag_back) * per_step;
    rs_total += rs * per_step;
    const bool first_f = i == 0, first_b = i + 1 == blocks;
    const double ef = s.prefetch && !first_f ? std::max(0.0, ag - per_block_fwd) : ag;
    // A kept block or slice is not prefetched in backward (suites/parallel/fully_shard.cpp).
    const double eb = s.prefetch && !first_b && r >= N ? std::max(0.0, ag_back - per_block_bwd) : ag_back;
    ag_exposed += (ef + eb) * per_step;
  }
  t.comm_s += ag_total + rs_total + root_rs + ar_total;
  t.exposed_comm_s += ag_exposed + rs_total + root_rs + ar_total;
  if (ar_total > 0) {
    t.collectives.push_back({{"op", "all-reduce"}, {"bytes", ar_bytes}, {"seconds", ar_total}, {"exposed_s", ar_total},
                             {"level", inter ? "inter-node" : "intra-node"}});
    t.inter_comm_s = inter ? ar_total : 0;
  }
  t.collectives.push_back({{"op", "all-gather"}, {"seconds", ag_total}, {"exposed_s", ag_exposed}});
  t.collectives.push_back({{"op", "reduce-scatter"}, {"seconds", rs_total + root_rs}, {"exposed_s", rs_total + root_rs}});
  if (c.nodes > 1)  // which links the shard group's collectives cross
    for (size_t k = t.collectives.size() - 2; k < t.collectives.size(); ++k) t.collectives[k]["level"] = shard_inter ? "inter-node" : "intra-node";
  t.overlap_rule = s.prefetch ? "each block's all-gather prefetched under the previous block's compute (exposed: what outlasts it, "
                                "and the first); reduce-scatters are synchronous (exposed)"
                              : "no prefetch: every all-gather and reduce-scatter is exposed";
  if (R > 1) t.overlap_rule += "; the gradient slices' all-reduce across the shard groups is synchronous (exposed)";
}

// The data-parallel dimension's collectives, by strategy (single: none).
void data_parallel_collectives(TimePrediction& t, const StepSetup& s, const DeviceProfile& d, const Cluster& c, const DataParallel& z,
                               int64_t accumulation) {
  if (z.W <= 1 || z.st == "single") return;
  const bool inter = c.nodes > 1;
  if (z.master && (z.st == "zero1" || z.st == "zero2"))
    master_zero12_collectives(t, d, z, inter);
  else if (!z.units && (z.st == "ddp" || z.st == "zero1" || z.st == "zero2"))
    bucketed_collectives(t, s, d, z, inter);
  else if (z.units)
    sharded_unit_collectives(t, s, d, c, z, accumulation);
}

}  // namespace

json TimePrediction::to_json() const {
  return {{"forward_s", forward_s},   {"backward_s", backward_s}, {"recompute_s", recompute_s},
          {"optimizer_s", optimizer_s}, {"compute_s", compute_s}, {"host_s", host_s}, {"device_s", device_s}, {"comm_s", comm_s},
          {"exposed_comm_s", exposed_comm_s}, {"step_s", step_s}, {"bound", bound},
          {"collectives", collectives}, {"overlap_rule", overlap_rule}, {"breakdown", breakdown},
          {"in_step", in_step.empty() ? json() : json(in_step)}, {"bubble_s", bubble_s}, {"pipeline", pipeline}};
}

TimePrediction predict_time(const StepSetup& s, const MemoryPrediction& m, const DeviceProfile& d, const Cluster& c,
                            int64_t accumulation, double cpu_share) {
  TimePrediction t;
  if (s.pipelined()) accumulation *= s.schedule.microbatches;  // the replay recorded one micro-batch of this rank's stages
  const std::string dtype = d.has(s.replay.num.gemm_dtype) ? s.replay.num.gemm_dtype : "fp32";
  const DataParallel z = data_parallel_of(s);
  compute_time(t, s, m, d, z, dtype, accumulation, cpu_share);
  data_parallel_collectives(t, s, d, c, z, accumulation);
  const double before_tp = t.exposed_comm_s;
  if (s.replay.tp > 1) tensor_parallel_collectives(t, s, d, c, accumulation);
  if (s.replay.cp > 1) context_parallel_collectives(t, s, d, c, dtype, accumulation);
  if (s.schedule.ranks > 1) pipeline_bubble(t, s, d, c, t.exposed_comm_s - before_tp);
  t.step_s = t.compute_s + t.exposed_comm_s + t.bubble_s;
  // hsdp crosses nodes only with its gradient slices: it is bound by the level holding most of its
  // exposed communication.
  const bool inter = c.nodes > 1;
  const bool inter_bound = inter && (z.st != "hsdp" || t.inter_comm_s > t.exposed_comm_s - t.inter_comm_s);
  t.bound = t.exposed_comm_s > t.compute_s ? (inter_bound ? "inter-node communication" : "intra-node communication")
            : d.gpu && t.host_s > t.device_s ? "host dispatch"
                                             : "compute";
  return t;
}

}  // namespace trainscope::plan
