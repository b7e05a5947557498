#include "plan/search.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "core/build_info.hpp"
#include "core/errors.hpp"
#include "core/precision.hpp"
#include "core/units.hpp"
#include "plan/step.hpp"

namespace trainscope::plan {

namespace {

double gemm_flops(const std::vector<OpCost>& costs) {
  double f = 0;
  for (const auto& c : costs)
    if (c.m > 0) f += 2.0 * static_cast<double>(c.m) * static_cast<double>(c.n) * static_cast<double>(c.k) * static_cast<double>(c.batch);
  return f;
}

// Among configurations whose predicted speeds are this close, the one teams run is preferred: the
// predictions are not better than a few percent, so a 1% difference is no reason to pick another.
constexpr double kEqualSpeed = 0.99;

// A setting `--set` fixed that is not searched (reduce_dtype, reshard_after_forward, cross_entropy), or its default.
std::string setting(const PlanRequest& r, const std::string& key, const std::string& fallback) {
  const auto f = r.fixed.find(key);
  return f == r.fixed.end() ? fallback : f->second;
}

// Checkpoint policies in the order teams reach for them at equal speed: op-level selective (torchtitan's
// default) before attention-only selective, before every-k and full recomputation.
int checkpoint_preference(const std::string& p) {
  if (p == "none") return 0;
  if (p == "selective-op") return 1;
  if (p == "selective") return 2;
  if (p.rfind("every:", 0) == 0) return 3;
  return 4;
}

// How the reasoning names a layout: "zero3", "zero3 x tp8", "zero3 x tp8 x pp16 (interleaved-1f1b)",
// "zero3 x cp4 (ring) x tp8".
std::string layout_label(const std::string& parallel, int64_t tp, int64_t pp, const std::string& schedule, int64_t cp = 1,
                         const std::string& cp_method = "") {
  std::string out = parallel;
  if (cp > 1) out += " x cp" + std::to_string(cp) + " (" + cp_method + ")";
  if (tp > 1) out += " x tp" + std::to_string(tp);
  if (pp > 1) out += " x pp" + std::to_string(pp) + " (" + schedule + ")";
  return out;
}

// A layout the search tries: the data-parallel shorthand, the degrees, sequence parallelism with tp,
// the pipeline schedule with pp, the attention's method with cp.
struct LayoutChoice {
  std::string parallel;
  ParallelLayout layout;
  bool sequence_parallel = false;
  std::string schedule;   // pp > 1: gpipe | 1f1b | interleaved-1f1b | zb-1p
  int64_t stages_per_rank = 1;  // pp > 1: `--set pp_virtual`, else the schedule's default
  std::string cp_method;  // cp > 1: allgather | ring
  std::string label() const { return layout_label(parallel, layout.tp, layout.pp, schedule, layout.cp, cp_method); }
};
std::string label_of(const json& cand) { return cand["label"]; }

// The grid: every axis, or the one value `--set` fixed.
struct Grid {
  std::vector<std::string> precisions, checkpoints, attentions;
  std::vector<LayoutChoice> layouts;
  std::vector<int64_t> micro;  // for one rank's share of the global batch (tp 1); micro_batches() for tp
};

std::vector<std::string> axis(const PlanRequest& r, const std::string& key, std::vector<std::string> all) {
  if (auto f = r.fixed.find(key); f != r.fixed.end()) return {f->second};
  return all;
}

// Tensor-parallel degrees: 1 and each power of two up to a node's GPUs (its collectives run at every
// layer, so it stays on a node's fast links, as Megatron and torchtitan place it) that divides the ranks
// and the model's heads, FFN and vocabulary (core/layout.hpp: check_layout_fits). `--set tp` fixes one,
// inside a node or not.
std::vector<int64_t> tp_degrees(const PlanRequest& r) {
  if (auto f = r.fixed.find("tp"); f != r.fixed.end()) return {std::stoll(f->second)};
  std::vector<int64_t> out = {1};
  for (int64_t tp = 2; tp <= r.cluster.gpus_per_node && r.cluster.ranks() % tp == 0; tp *= 2) {
    ParallelLayout l;
    l.tp = tp;
    l.dp_shard = r.cluster.ranks() / tp;
    try {
      check_layout_fits(l, r.model);
    } catch (const UsageError&) {
      continue;
    }
    out.push_back(tp);
  }
  return out;
}

// A schedule's stages per rank: `--set pp_virtual`, else the schedule's own (core/pipeline.hpp).
int64_t stages_per_rank(const PlanRequest& r, const std::string& schedule) {
  const auto v = r.fixed.find("pp_virtual");
  return v != r.fixed.end() ? std::stoll(v->second) : pipeline::default_stages_per_rank(schedule);
}

// Pipeline degrees for the ranks tp leaves: 1, and each power of two up to the node count (a stage per
// node or group of nodes: PP crosses nodes, its point-to-point transfers being the least traffic) that
// divides those ranks and leaves each stage a layer (pp_virtual of them, interleaved). `--set pp` fixes one.
std::vector<int64_t> pp_degrees(const PlanRequest& r, int64_t ranks) {
  if (auto f = r.fixed.find("pp"); f != r.fixed.end()) return {std::stoll(f->second)};
  // A fixed schedule with its stages per rank; else the fewest (interleaving joins where it fits).
  const auto fixed = r.fixed.find("pp_schedule");
  const int64_t per_rank = fixed != r.fixed.end() ? stages_per_rank(r, fixed->second) : r.fixed.count("pp_virtual") ? stages_per_rank(r, "") : 1;
  std::vector<int64_t> out = {1};
  for (int64_t pp = 2; pp <= r.cluster.nodes && ranks % pp == 0 && pp * per_rank <= r.model.layers; pp *= 2) out.push_back(pp);
  return out;
}

// Context-parallel degrees for the ranks tp and pp leave: 1, and at sequences longer than 8K tokens (where
// attention's memory and time come to dominate; Llama 3 trained 8K without cp and 128K with cp 16) each
// power of two that divides those ranks and cuts the sequence into 2 x cp equal chunks (core/layout.hpp).
// `--set cp` fixes one.
std::vector<int64_t> cp_degrees(const PlanRequest& r, int64_t ranks) {
  if (auto f = r.fixed.find("cp"); f != r.fixed.end()) return {std::stoll(f->second)};
  std::vector<int64_t> out = {1};
  if (r.model.seq_len <= 8192) return out;
  for (int64_t cp = 2; ranks % cp == 0 && r.model.seq_len % (2 * cp) == 0; cp *= 2) out.push_back(cp);
  return out;
}

// The schedules searched with pp: 1F1B and interleaved 1F1B (two stages per rank) as torchtitan and
// Megatron run them; GPipe (1F1B's bubble, every micro-batch in flight) and zb-1p (I and W half a
// backward each, a time split no GPU run has checked yet) only when `--set pp_schedule` names them;
// `--set pp_virtual` gives the stages per rank (zb-1p interleaved).
std::vector<std::string> pp_schedules(const PlanRequest& r, int64_t pp) {
  if (pp == 1) return {""};
  if (auto f = r.fixed.find("pp_schedule"); f != r.fixed.end()) return {f->second};
  std::vector<std::string> out = {"1f1b"};
  if (r.model.layers >= 2 * pp) out.push_back("interleaved-1f1b");
  return out;
}

// Per tp and pp degree, the data-parallel strategies over the ranks they leave: ddp, zero1/2/3, and
// hsdp (zero3 within a node, replicated across nodes) where there is more than one node; one rank's single.
std::vector<LayoutChoice> layouts(const PlanRequest& r) {
  const int64_t ranks = r.cluster.ranks();
  const bool sp = setting(r, "sequence_parallel", "true") == "true";
  std::vector<LayoutChoice> out;
  std::string indivisible;  // the first degrees found not to divide the ranks: the error when none does
  bool divisible = false, implemented = false;
  for (int64_t tp : tp_degrees(r))
    for (int64_t pp : pp_degrees(r, ranks / std::max<int64_t>(1, tp)))
      for (int64_t cp : cp_degrees(r, ranks / std::max<int64_t>(1, tp * pp))) {
      // A degree `--set` fixed beside searched ones: the searched degrees it does not divide are no candidates.
      if (ranks % (tp * pp * cp) != 0) {
        if (indivisible.empty()) indivisible = "tp=" + std::to_string(tp) + " x pp=" + std::to_string(pp) + " x cp=" + std::to_string(cp);
        continue;
      }
      divisible = true;
      if (cp > 1 && pp > 1) continue;  // not implemented together (core/layout.hpp: layout_unsupported)
      implemented = true;
      const int64_t dp = ranks / (tp * pp * cp), node = r.cluster.gpus_per_node / std::max<int64_t>(1, tp * cp);
      std::vector<std::string> names = {"ddp", "zero1", "zero2", "zero3"};
      // hsdp: a node's ranks shard, the nodes replicate (with pp: when the data-parallel ranks span nodes).
      if (r.cluster.nodes > 1 && (tp * cp == 1 || node > 1) && dp > node && dp % node == 0) names.push_back("hsdp");
      if (dp == 1) names = cp > 1 ? std::vector<std::string>{"ddp", "zero1", "zero2", "zero3"} : std::vector<std::string>{"single"};  // over cp's ranks
      if (auto f = r.fixed.find("parallel"); f != r.fixed.end()) {
        if (std::find(names.begin(), names.end(), f->second) == names.end()) continue;
        names = {f->second};
      }
      std::vector<std::string> methods = {""};
      if (cp > 1) methods = r.fixed.count("cp_method") ? std::vector<std::string>{r.fixed.at("cp_method")} : std::vector<std::string>{"allgather", "ring"};
      for (const auto& p : names)
        for (const auto& schedule : pp_schedules(r, pp))
          for (const auto& method : methods) {
            RunConfig c;
            c.parallel = p;
            c.world_size = ranks;
            c.tp = tp;
            c.pp = pp;
            c.cp = cp;
            c.hsdp_shard_size = p == "hsdp" ? node : 0;
            out.push_back({p, resolve_layout(c), tp > 1 && sp, schedule, pp == 1 ? 1 : stages_per_rank(r, schedule), method});
          }
      }
  if (!divisible) throw UsageError("plan: " + indivisible + " does not divide " + std::to_string(ranks) + " rank(s)");
  if (!implemented) throw UsageError("plan: cp with pp is not implemented in this build yet");
  if (out.empty()) {
    std::string with;
    for (const char* key : {"tp", "pp", "cp"})
      if (r.fixed.count(key)) with += (with.empty() ? " with " : " x ") + std::string(key) + "=" + r.fixed.at(key);
    throw UsageError("plan: parallel=" + r.fixed.at("parallel") + " does not match " + std::to_string(ranks) + " rank(s)" + with);
  }
  return out;
}

// Micro-batches for `seqs` sequences per data-parallel rank: the fixed one, else each power of two
// that divides them.
std::vector<int64_t> micro_batches(const Grid& g, int64_t seqs, bool fixed) {
  if (fixed) return g.micro;
  std::vector<int64_t> out;
  for (int64_t b = 1; b <= seqs; b *= 2)
    if (seqs % b == 0) out.push_back(b);
  return out;
}

Grid grid(const PlanRequest& r, int64_t seqs_per_rank, int64_t global) {
  Grid g;
  std::vector<std::string> precisions;
  for (const auto& t : precision_table()) {
    // 64-true is a reference, not a way to train; 16-mixed without its scaler a mistake; tf32 is a GEMM
    // setting of fp32 storage (the datasheet profiles have no separate rate); fp8 where the device has it.
    if (t.name == "64-true" || t.name == "16-mixed-noscale" || t.name == "tf32") continue;
    if (t.fp8_linear && !r.device.has("fp8")) continue;
    precisions.push_back(t.name);
  }
  g.precisions = axis(r, "precision", precisions);
  g.layouts = layouts(r);
  g.checkpoints = axis(r, "checkpoint", {"none", "selective-op", "selective", "every:8", "every:4", "every:2", "full"});
  g.attentions = axis(r, "attention", {"sdpa", "eager"});
  if (auto f = r.fixed.find("batch_size"); f != r.fixed.end()) {
    g.micro.push_back(std::stoll(f->second));
  } else {
    for (int64_t b = 1; b <= seqs_per_rank; b *= 2)
      if (seqs_per_rank % b == 0) g.micro.push_back(b);
  }
  for (int64_t b : g.micro)
    if (b < 1 || seqs_per_rank % b != 0)
      throw UsageError("plan: micro-batch " + std::to_string(b) + " does not divide the " + std::to_string(seqs_per_rank) +
                       " sequences per rank of the global batch (" + with_thousands(global) + " tokens)");
  return g;
}

// What every candidate shares: the request, the batch and the FLOP counts.
struct Context {
  const PlanRequest& r;
  int64_t seqs_per_rank = 0;
  double usable = 0, fpt_full = 0, fpt_causal = 0, attention_per_token = 0;
};

// Why a configuration does not fit, in words.
std::string misfit(const Context& x, const StepSetup& s, const MemoryPrediction& mp) {
  const double states = static_cast<double>(mp.state.total()), peak = static_cast<double>(mp.peak);
  if (states > x.usable) return "model state " + format_gb(states) + " per rank > " + format_gb(x.usable) + " usable";
  std::string why = "peak " + format_gb(peak) + " per rank (model state " + format_gb(states) + ", activations " +
                    format_gb(static_cast<double>(mp.activations)) + ") > " + format_gb(x.usable) + " usable";
  // Autocast keeps a low-precision copy of every weight from its use to backward (saved by the GEMM,
  // or held by its cast cache under checkpointing): unsharded, whatever the strategy.
  if (s.replay.num.autocast)
    why += "; the activations include autocast's copies of every weight, " +
           format_gb(2.0 * static_cast<double>(param_layout(s.replay).total())) + " unsharded";
  if (s.schedule.ranks > 1) why += " (pp rank " + std::to_string(s.pp_rank) + ")";
  return why;
}

// Memory, and for what fits the time, throughput and MFU, of one configuration into `cand`.
// With pp, the ranks replayed: the first (the embedding and, under 1F1B, the most micro-batches in
// flight), the second (whole stages when the first and last are cut short) and the last (the head and
// the loss). The one with the highest peak decides the memory, the slowest the step.
struct RankPrediction {
  MemoryPrediction memory;
  StepSetup setup;
};
std::vector<RankPrediction> replay_ranks(StepSetup s) {
  std::vector<RankPrediction> out;
  const int64_t p = s.schedule.ranks;
  std::vector<int64_t> which = {0};
  if (p > 2) which.push_back(1);
  if (p > 1) which.push_back(p - 1);
  for (int64_t rank : which) {
    s.set_pp_rank(rank);
    out.push_back({predict_memory(s), s});
  }
  return out;
}

// The data-parallel rank's batch (b x m sequences) cut into the schedule's m micro-batches.
void set_pipeline(StepSetup& s, const LayoutChoice& lc, int64_t m, json& cand) {
  s.schedule = pipeline::make_schedule(lc.schedule, lc.layout.pp, m, lc.stages_per_rank);
  s.replay.batch *= m;
  cand["pipeline"] = {{"schedule", lc.schedule}, {"stages_per_rank", s.schedule.stages_per_rank}, {"microbatches", m}};
}

// The step of the slowest replayed rank.
TimePrediction slowest(const std::vector<RankPrediction>& ranks, const DeviceProfile& d, const Cluster& c, int64_t accumulation, json& cand) {
  TimePrediction out;
  for (const RankPrediction& rp : ranks) {
    TimePrediction t = predict_time(rp.setup, rp.memory, d, c, accumulation);
    if (t.step_s <= out.step_s) continue;
    out = std::move(t);
    if (rp.setup.schedule.ranks > 1) cand["pipeline"]["slowest_rank"] = rp.setup.pp_rank;
  }
  return out;
}

void evaluate(const Context& x, const LayoutChoice& lc, json& cand) {
  const PlanRequest& r = x.r;
  const DeviceProfile& d = r.device;
  const int64_t b = cand["micro_batch"], S = r.model.seq_len, accumulation = cand["accumulation"];
  StepSetup s;
  s.replay.model = r.model;
  s.replay.model.attention = cand["attention"];
  s.replay.model.dropout = 0;
  s.replay.batch = b;
  if (lc.layout.pp > 1) set_pipeline(s, lc, accumulation, cand);
  s.replay.checkpoint = cand["checkpoint"];
  s.replay.cross_entropy = setting(r, "cross_entropy", "eager");
  s.replay.num = numerics_of(cand["precision"], d.gpu, setting(r, "reduce_dtype", "fp32"));
  s.replay.cuda = d.gpu;
  s.replay.tp = lc.layout.tp;
  s.replay.sequence_parallel = lc.sequence_parallel;
  s.replay.cp = lc.layout.cp;
  if (lc.layout.cp > 1) s.replay.cp_method = lc.cp_method;
  s.replay.cp_balance = setting(r, "cp_balance", "true") == "true";
  s.layout = lc.layout;
  s.reshard_after_forward = setting(r, "reshard_after_forward", "true");
  s.resident_data_bytes = 0;
  const std::vector<RankPrediction> ranks = replay_ranks(s);
  const RankPrediction& worst = *std::max_element(ranks.begin(), ranks.end(), [](const auto& a, const auto& b) { return a.memory.peak < b.memory.peak; });
  const MemoryPrediction& mp = worst.memory;
  if (lc.layout.pp > 1) cand["pipeline"]["memory_rank"] = worst.setup.pp_rank;
  const double peak = static_cast<double>(mp.peak);
  json mem = mp.to_json();
  for (const char* k : {"phase_peak_bytes", "baseline_bytes", "data_bytes"}) mem.erase(k);
  mem["peak_transient_bytes"] = std::max(0.0, peak - static_cast<double>(mp.state.total()) - static_cast<double>(mp.activations));
  if (d.gpu) mem["reserved_peak_bytes"] = static_cast<int64_t>(kReservedOverAllocated * peak);
  cand["memory"] = mem;
  cand["fits"] = peak <= x.usable;
  if (peak > x.usable) {
    cand["reason"] = misfit(x, worst.setup, mp);
    return;
  }
  // A data-parallel rank's sequences (tp and pp GPUs share them) in micro-batches of b: accumulated, or
  // the pipeline's micro-batches.
  const TimePrediction tp = slowest(ranks, d, r.cluster, lc.layout.pp > 1 ? 1 : accumulation, cand);
  cand["time"] = tp.to_json();
  const double tokens_per_gpu = static_cast<double>(x.seqs_per_rank * S) / tp.step_s;
  cand["tokens_per_s_per_gpu"] = tokens_per_gpu;
  const PrecisionTraits& t = precision_traits(cand["precision"]);
  const double linear_fraction = 1.0 - x.attention_per_token / x.fpt_full;
  const PeakOf peak_of = [&](const std::string& dt) -> std::optional<double> {
    if (auto it = d.peak_flops.find(dt); it != d.peak_flops.end()) return it->second;
    return std::nullopt;
  };
  if (const auto p = mfu_peak_flops(t, s.replay.num.gemm_dtype, linear_fraction, peak_of)) {
    cand["mfu"] = x.fpt_full * tokens_per_gpu / *p;
    cand["mfu_causal"] = x.fpt_causal * tokens_per_gpu / *p;
    // Hardware FLOPs add the recomputed forward's GEMMs.
    const double recompute_per_token = gemm_flops(mp.recompute_costs) / static_cast<double>(b * S);
    cand["hfu"] = (x.fpt_full + recompute_per_token) * tokens_per_gpu / *p;
    cand["mfu_peak"] = {{"convention", mfu_peak_name(t, s.replay.num.gemm_dtype, linear_fraction)}, {"flops_per_s", *p}};
  }
}

// Why the schedule cannot take `m` micro-batches ("" when it can): several stages per rank run them in groups of pp.
std::string schedule_unfit(const LayoutChoice& lc, int64_t m) {
  if (lc.layout.pp == 1) return "";
  try {
    pipeline::make_schedule(lc.schedule, lc.layout.pp, m, lc.stages_per_rank);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

// Every candidate of the grid, in search order; a micro-batch larger than one that did not fit is
// not replayed (memory grows with it).
json search(const Context& x, const Grid& g, int64_t& searched) {
  json candidates = json::array();
  for (const auto& prec : g.precisions)
    for (const auto& lc : g.layouts)
      for (const auto& ckpt : g.checkpoints)
        for (const auto& attn : g.attentions) {
          std::string too_big;
          const int64_t seqs = x.seqs_per_rank * lc.layout.tp * lc.layout.pp * lc.layout.cp;
          for (int64_t b : micro_batches(g, seqs, x.r.fixed.count("batch_size") > 0)) {
            ++searched;
            json cand = {{"precision", prec},          {"parallel", lc.parallel}, {"layout", lc.layout.to_json()},
                         {"sharding", fold_context(lc.layout).strategy()}, {"checkpoint", ckpt}, {"attention", attn},
                         {"micro_batch", b},            {"accumulation", seqs / b}};
            cand["label"] = lc.label();
            if (lc.layout.tp > 1) cand["sequence_parallel"] = lc.sequence_parallel;
            if (lc.layout.cp > 1) cand["cp_method"] = lc.cp_method;
            if (const std::string& note = precision_traits(prec).caveat; !note.empty()) cand["note"] = note;
            if (!too_big.empty()) {
              cand["fits"] = false;
              cand["reason"] = too_big;
            } else if (const std::string why = schedule_unfit(lc, seqs / b); !why.empty()) {
              cand["fits"] = false;
              cand["reason"] = why;
            } else {
              evaluate(x, lc, cand);
              if (!cand["fits"].get<bool>())
                too_big = "micro-batch " + std::to_string(b) + " already does not fit: " + cand["reason"].get<std::string>();
            }
            candidates.push_back(cand);
          }
        }
  // Fits first, fastest first; then the rest in search order.
  std::stable_sort(candidates.begin(), candidates.end(), [](const json& a, const json& b) {
    if (a["fits"] != b["fits"]) return a["fits"].get<bool>();
    if (!a["fits"].get<bool>()) return false;
    const double ta = a["tokens_per_s_per_gpu"], tb = b["tokens_per_s_per_gpu"];
    if (ta != tb) return ta > tb;
    return a["memory"]["peak_bytes"].get<int64_t>() < b["memory"]["peak_bytes"].get<int64_t>();
  });
  return candidates;
}

// Why whole families do not fit: per (precision, strategy) the reason at its smallest configuration.
json rejected_families(const Grid& g, const json& candidates) {
  json rejected = json::array();
  for (const auto& prec : g.precisions)
    for (const auto& lc : g.layouts) {
      bool any = false;
      std::string reason;
      for (const auto& c : candidates) {
        if (c["precision"] != prec || label_of(c) != lc.label()) continue;
        if (c["fits"].get<bool>()) any = true;
        else if (reason.empty() && c["micro_batch"] == g.micro.front() && c["checkpoint"] == g.checkpoints.back()) reason = c["reason"];
      }
      if (!any)
        rejected.push_back({{"precision", prec}, {"parallel", lc.label()}, {"layout", lc.layout.to_json()},
                            {"reason", reason.empty() ? "no candidate fits" : reason}});
    }
  return rejected;
}

// The recommended candidate: the fastest that fits among the precisions without a caveat (unless the
// precision was fixed); among those within kEqualSpeed of it, the one teams run (core/precision.hpp's
// preference, then checkpoint_preference). Null when nothing fits.
const json* pick(const PlanRequest& r, const json& candidates) {
  const json* best = nullptr;
  for (const auto& c : candidates)
    if (c["fits"].get<bool>() && (r.fixed.count("precision") || !c.contains("note"))) {
      best = &c;
      break;
    }
  if (!best) return candidates.empty() || !candidates[0]["fits"].get<bool>() ? nullptr : &candidates[0];
  const double fastest = (*best)["tokens_per_s_per_gpu"];
  auto rank = [](const json& c) {
    return std::make_pair(precision_traits(c["precision"]).preference, checkpoint_preference(c["checkpoint"]));
  };
  for (const auto& c : candidates) {
    if (!c["fits"].get<bool>() || c["tokens_per_s_per_gpu"].get<double>() < kEqualSpeed * fastest) break;
    if (!r.fixed.count("precision") && c.contains("note")) continue;
    if (rank(c) < rank(*best)) best = &c;
  }
  return best;
}

std::string percent(double ratio) { return std::to_string(static_cast<int>(std::lround(100 * ratio))) + "%"; }

// The recommendation: one line a lead can act on, and the reasoning behind it.
json recommendation(const Context& x, const json& candidates, const json& rejected, int64_t fit) {
  const PlanRequest& r = x.r;
  const ModelShape& m = r.model;
  const DeviceProfile& d = r.device;
  const json* chosen = pick(r, candidates);
  if (!chosen) {
    std::string text = "nothing fits " + m.name + " on " + std::to_string(r.cluster.ranks()) + " x " + d.name + ": ";
    text += rejected.empty() ? "" : rejected[rejected.size() - 1]["reason"].get<std::string>();
    text += "; more GPUs (zero3 divides the model state by the rank count) or a device with more memory";
    return {{"text", text}, {"candidate", nullptr}, {"reasoning", json::array()}};
  }
  const json& best = *chosen;
  char line[700];
  std::snprintf(line, sizeof line,
                "%s on %lld x %s (%lld node%s): %s, %s (%s), checkpoint %s, %s attention, micro-batch %lld x %lld %s: "
                "about %s tokens/s per GPU, %s of %s per GPU",
                m.name.c_str(), static_cast<long long>(r.cluster.ranks()), d.name.c_str(), static_cast<long long>(r.cluster.nodes),
                r.cluster.nodes > 1 ? "s" : "", best["precision"].get<std::string>().c_str(), label_of(best).c_str(),
                best["layout"]["name"].get<std::string>().c_str(), best["checkpoint"].get<std::string>().c_str(),
                best["attention"].get<std::string>().c_str(), static_cast<long long>(best["micro_batch"].get<int64_t>()),
                static_cast<long long>(best["accumulation"].get<int64_t>()),
                best.contains("pipeline") ? "pipeline micro-batches" : "accumulation", format_rate(best["tokens_per_s_per_gpu"].get<double>()).c_str(),
                format_gb(best["memory"]["peak_bytes"].get<double>()).c_str(), format_gb(static_cast<double>(d.memory_bytes)).c_str());
  std::string text = line;
  if (best.contains("mfu")) {
    std::snprintf(line, sizeof line, ", MFU %.0f%% (full attention; %.0f%% causal)", 100 * best["mfu"].get<double>(),
                  100 * best["mfu_causal"].get<double>());
    text += line;
  }
  json why = json::array();
  why.push_back("fastest of the " + std::to_string(fit) + " configurations that fit in " + format_gb(x.usable) + " usable per GPU (" +
                percent(r.headroom) + " headroom)" + (r.fixed.count("precision") ? "" : " among the precisions without a caveat") +
                "; configurations within " + percent(1 - kEqualSpeed) + " of it count as equal, and of those the one teams run is named");
  const json& top = candidates[0];
  if (&best != &top)
    why.push_back(top["precision"].get<std::string>() + " (" + label_of(top) + ", checkpoint " +
                  top["checkpoint"].get<std::string>() + ") would reach " +
                  percent(top["tokens_per_s_per_gpu"].get<double>() / best["tokens_per_s_per_gpu"].get<double>()) + " of this throughput" +
                  (top.contains("note") ? ": " + top["note"].get<std::string>() : ""));
  why.push_back("step " + format_seconds(best["time"]["step_s"]) + ": compute " + format_seconds(best["time"]["compute_s"]) +
                ", exposed communication " + format_seconds(best["time"]["exposed_comm_s"]) + " (" + best["time"]["bound"].get<std::string>() +
                "-bound)");
  // Why its tp: what it divides and what its collectives cost.
  if (const int64_t tp = best["layout"]["tp"]; tp > 1) {
    double tp_s = 0;
    std::string level;
    for (const auto& c : best["time"]["collectives"])
      if (c.value("dimension", "") == "tp") tp_s += c["seconds"].get<double>(), level = c.value("level", "");
    const bool sp = best.value("sequence_parallel", false);
    why.push_back("tp " + std::to_string(tp) + " splits every layer's weights" + (sp ? " and, with sequence parallelism, its activations" : "") +
                  " " + std::to_string(tp) + " ways; its collectives take " + format_seconds(tp_s) + " of the step, exposed, on " + level +
                  " links");
  }
  // Why its cp: the sequence per rank and what its transfers cost, hidden or not.
  if (const int64_t cp = best["layout"]["cp"]; cp > 1) {
    double sent = 0, exposed = 0;
    std::string level;
    for (const auto& c : best["time"]["collectives"])
      if (c.value("dimension", "") == "cp") sent += c["seconds"].get<double>(), exposed += c["exposed_s"].get<double>(), level = c.value("level", "");
    why.push_back("cp " + std::to_string(cp) + " (" + best["cp_method"].get<std::string>() + ") gives each rank " +
                  with_thousands(r.model.seq_len / cp) + " of the " + with_thousands(r.model.seq_len) +
                  " tokens, its activations cut " + std::to_string(cp) + " ways; its key/value transfers take " + format_seconds(sent) +
                  " of the step on " + level + " links, " + format_seconds(exposed) + " of it exposed");
  }
  // Why its pipeline: the stages, the schedule's bubble and the transfers between stages.
  if (const int64_t pp = best["layout"]["pp"]; pp > 1) {
    const json& p = best["time"]["pipeline"];
    why.push_back("pp " + std::to_string(pp) + " cuts the layers into " + std::to_string(pp * p["stages_per_rank"].get<int64_t>()) +
                  " stages (" + std::to_string(p["stages_per_rank"].get<int64_t>()) + " per rank); " + p["schedule"].get<std::string>() +
                  " over " + std::to_string(p["microbatches"].get<int64_t>()) + " micro-batches idles " +
                  percent(best["time"]["bubble_s"].get<double>() / best["time"]["step_s"].get<double>()) + " of the step (" +
                  format_seconds(best["time"]["bubble_s"]) + "), with " + format_bytes(p["p2p_bytes"].get<double>()) + " (" + format_seconds(p["p2p_s"]) + ")" +
                  " per transfer between stages on " + p["level"].get<std::string>() + " links; the first rank holds " +
                  std::to_string(p["in_flight"][0].get<int64_t>()) + " micro-batch stages' activations at once");
  }
  // Each other layout: its best eligible configuration for contrast, or why it does not fit in the
  // recommended precision.
  const bool any_precision = r.fixed.count("precision") > 0;
  std::vector<std::string> seen = {label_of(best)};
  for (const auto& c : candidates) {
    if (!c["fits"].get<bool>() || std::count(seen.begin(), seen.end(), label_of(c))) continue;
    if (!any_precision && c.contains("note")) continue;
    seen.push_back(label_of(c));
    why.push_back("best " + label_of(c) + " (" + c["precision"].get<std::string>() + ", checkpoint " +
                  c["checkpoint"].get<std::string>() + ", micro-batch " + std::to_string(c["micro_batch"].get<int64_t>()) + "): " +
                  percent(c["tokens_per_s_per_gpu"].get<double>() / best["tokens_per_s_per_gpu"].get<double>()) + " of its throughput");
  }
  for (const auto& rj : rejected)
    if (rj["precision"] == best["precision"] && !std::count(seen.begin(), seen.end(), rj["parallel"].get<std::string>()))
      why.push_back(rj["parallel"].get<std::string>() + " does not fit in " + best["precision"].get<std::string>() + ": " +
                    rj["reason"].get<std::string>());
  return {{"text", text}, {"candidate", best}, {"reasoning", why}};
}

}  // namespace

json make_plan(const PlanRequest& r) {
  const auto started = std::chrono::steady_clock::now();
  const ModelShape& m = r.model;
  if (!m.language_model()) throw UsageError("plan: the search plans decoders (gpt, llama); " + m.name + " is a " + m.family);
  const int64_t ranks = r.cluster.ranks(), S = m.seq_len;
  // Global batch: whole sequences per rank per micro-batch step.
  int64_t global = r.global_tokens > 0 ? r.global_tokens : int64_t{1} << 20;
  Context x{r};
  x.seqs_per_rank = std::max<int64_t>(1, global / (S * ranks));
  global = x.seqs_per_rank * S * ranks;
  x.usable = static_cast<double>(r.device.memory_bytes) * (1.0 - r.headroom);
  x.fpt_full = decoder_flops_per_token(m, FlopConvention::Full);
  x.fpt_causal = decoder_flops_per_token(m, FlopConvention::Causal);
  x.attention_per_token = 12.0 * static_cast<double>(m.layers * m.heads * m.head_dim() * S);
  const Grid g = grid(r, x.seqs_per_rank, global);
  int64_t searched = 0;
  const json candidates = search(x, g, searched);
  int64_t fit = 0;
  for (const auto& c : candidates) fit += c["fits"].get<bool>() ? 1 : 0;
  const json rejected = rejected_families(g, candidates);
  const json rec = recommendation(x, candidates, rejected, fit);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  json fixed = json::object();
  for (const auto& [k, v] : r.fixed) fixed[k] = v;
  return {{"schema", "trainscope.plan/1"},
          {"trainscope", {{"version", version()}, {"commit", commit()}}},
          {"created", utc_now()},
          {"request", {{"model", m.to_json()}, {"model_name", m.name}, {"parameters", analytic_decoder_parameters(m)},
                       {"cluster", {{"gpus_per_node", r.cluster.gpus_per_node}, {"nodes", r.cluster.nodes}, {"ranks", ranks}}},
                       {"device", r.device.name}, {"seq_len", S}, {"global_batch_tokens", global},
                       {"sequences_per_rank", x.seqs_per_rank}, {"headroom", r.headroom}, {"usable_bytes", x.usable}, {"fixed", fixed}}},
          {"device", r.device.to_json()},
          {"flops", {{"convention", flop_convention_name(FlopConvention::Full)}, {"per_token", x.fpt_full},
                     {"causal_per_token", x.fpt_causal}}},
          {"searched", searched},
          {"fit", fit},
          {"search_seconds", seconds},
          {"candidates", candidates},
          {"rejected", rejected},
          {"recommendation", rec},
          {"memory_model", "replayed per operator: every tensor the implementation allocates, saves for backward and frees "
                           "(plan/models.cpp), the strategy's buffers and the optimizer's state and temporaries (plan/step.cpp)"},
          {"assumptions", {"CUDA context, cuBLAS/NCCL workspaces and the caching allocator's fragmentation are inside the headroom",
                           "eager attention on a GPU is replayed as on the CPU (bf16 softmax); CUDA autocast keeps it fp32",
                           "gradient accumulation synchronises gradients once per optimizer step (zero3 gathers per micro-batch)",
                           "zero3 inside a pipeline stage gathers and reduce-scatters per micro-batch, as trainscope runs it (torchtitan "
                           "keeps the stage unsharded across micro-batches: more memory, less communication)"}}};
}

json predict_config(const RunConfig& c, const DeviceProfile& device, bool cuda) {
  const StepSetup s = step_setup(c, cuda);
  const MemoryPrediction mp = predict_memory(s);
  json out = {{"memory", mp.to_json()}};
  const double share = device.gpu || device.cores <= 0 ? 1.0 : std::min(1.0, static_cast<double>(device.cores) / static_cast<double>(c.world_size));
  out["time"] = predict_time(s, mp, device, Cluster{c.world_size, 1}, 1, share).to_json();
  return out;
}

}  // namespace trainscope::plan
