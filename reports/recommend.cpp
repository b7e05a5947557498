// Recommendations: rules over a report, one record each in the table at the end of this file, which
// recommend() walks in order. A rule says when it speaks and which measured numbers it cites; each of
// its findings cites those numbers and the cells they rest on.
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <set>

#include "core/devices.hpp"
#include "core/precision.hpp"
#include "core/units.hpp"
#include "reports/report.hpp"

namespace trainscope::reports {
namespace {

json rec(const std::string& id, const std::string& severity, const std::string& text, json evidence,
         json cells) {
  return json{{"id", id}, {"severity", severity}, {"text", text}, {"evidence", std::move(evidence)},
              {"cells", std::move(cells)}};
}

// The mode a cell ran in (core/precision.hpp); nullptr for a name the table does not know.
const PrecisionTraits* traits_of(const json& cell) {
  const std::string name = cell.contains("config") ? cell["config"].value("precision", "") : "";
  for (const auto& t : precision_table())
    if (t.name == name) return &t;
  return nullptr;
}

// bf16 compute over fp32 weights: bf16 autocast over fp32 parameters (bf16-mixed), or bf16 weights cast
// from fp32 masters (bf16-master). The modes the bf16 rules hold against their 32-true sibling.
bool bf16_over_fp32_weights(const PrecisionTraits* t) {
  return t && t->gemm == "bf16" && (t->params == "fp32" || t->master == "fp32");
}

// The thresholds the precision rules use, written into their evidence.
constexpr double kFaster = 1.10;  // at least 10% faster to recommend switching
constexpr double kAccuracyTolerance = 0.01;
constexpr double kUnderflow = 0.01;  // a block with 1% of its gradients under fp16's normal range

// ---- The run ------------------------------------------------------------------------------------

void reference_blas(const json& report, const json&, json& out) {
  const json& env = report["env"];
  if (env.contains("blas") && env["blas"].value("reference", false))
    out.push_back(rec("env.reference-blas", "warn",
                      "torch calls the reference BLAS (" + env["blas"].value("path", std::string("?")) +
                          "): fp32 timings are ~20x too slow and fp32-vs-bf16 ratios are meaningless; "
                          "install libopenblas0-openmp",
                      {{"blas", env["blas"]}}, json::array()));
}

void cells_failed(const json& report, const json&, json& out) {
  json broken = json::array();
  std::string reasons;
  for (const auto& c : report["cells"]) {
    const std::string s = c["status"];
    if ((s == "failed" || s == "timeout" || s == "oom") && !shown_as_expected(report, c)) {
      broken.push_back(c["name"]);
      reasons += (reasons.empty() ? "" : "; ") + c["name"].get<std::string>() + ": " + s +
                 (c.contains("reason") ? " (" + c["reason"].get<std::string>() + ")" : "");
    }
  }
  if (!broken.empty())
    out.push_back(rec("run.cells-failed", "critical",
                      std::to_string(broken.size()) + " cell(s) did not finish: " + reasons,
                      {{"count", broken.size()}}, broken));
}

// A cell the suite expects to go wrong (a classic mistake shown on purpose) that ended ok: the
// demonstration no longer demonstrates, which someone should look at.
void expected_failure_missing(const json& report, const json& c, json& out) {
  if (!expectation_missed(report, c)) return;
  const json expected = expected_statuses(report, c["name"]);
  std::string statuses;
  for (const auto& st : expected) statuses += (statuses.empty() ? "" : " or ") + st.get<std::string>();
  out.push_back(rec("run.expected-failure-missing", "warn",
                    c["name"].get<std::string>() + " was expected to end " + statuses +
                        " but ended ok: the mistake it shows was not reproduced here",
                    {{"expected", expected}, {"status", "ok"}}, json::array({c["name"]})));
}

// ---- Precision ----------------------------------------------------------------------------------

// A bf16 cell (bf16_over_fp32_weights) against its 32-true sibling: speed and numerical agreement.
struct Bf16Comparison {
  std::string mode, model, quality;  // quality: the agreement in words
  double speedup = 0;
  bool matches = false;
  json evidence, cells;
};

// The comparison's evidence and its agreement in words.
void describe_agreement(const json& c, bool budgeted, bool acc_known, double loss_diff, double a16, double a32,
                        Bf16Comparison& k) {
  if (acc_known) k.evidence["accuracy"] = {{"32-true", a32}, {k.mode, a16}};
  k.quality = "final loss " + format_fixed(100 * loss_diff, 1) + "% from fp32";
  if (budgeted) {
    k.quality += " at step " + std::to_string(c["numerics"]["compared_at_step"].get<int64_t>()) +
                 ", where the time budget stopped one of them";
    k.evidence["compared_at_step"] = c["numerics"]["compared_at_step"];
  }
  if (acc_known) k.quality += ", accuracy " + format_fixed(100 * a16, 1) + "% vs " + format_fixed(100 * a32, 1) + "%";
}

std::optional<Bf16Comparison> compare_bf16(const json& report, const json& c) {
  if (!bf16_over_fp32_weights(traits_of(c)) || c["status"] != "ok") return std::nullopt;
  const json* base = fp32_sibling(report, c);
  if (!base || (*base)["status"] != "ok") return std::nullopt;
  const double t16 = number_at(c, {"metrics", "timing", "step_time_s", "p50"});
  const double t32 = number_at(*base, {"metrics", "timing", "step_time_s", "p50"});
  double l16 = number_at(c, {"metrics", "quality", "final_loss"});
  double l32 = number_at(*base, {"metrics", "quality", "final_loss"});
  const double a16 = number_at(c, {"metrics", "quality", "accuracy"});
  const double a32 = number_at(*base, {"metrics", "quality", "accuracy"});
  // A time budget stopped one of the two early: losses at the steps both ran (numerics), and no
  // accuracy comparison (one was trained for fewer steps).
  const bool budgeted = c.contains("numerics") && c["numerics"].contains("compared_at_step");
  if (budgeted) {
    l16 = number_at(c, {"numerics", "final_loss"});
    l32 = number_at(c, {"numerics", "reference_final_loss"});
  }
  if (!(t16 > 0 && t32 > 0 && std::isfinite(l16) && std::isfinite(l32))) return std::nullopt;
  Bf16Comparison k;
  k.mode = c["config"]["precision"];
  k.model = c["config"].value("model", "?");
  k.speedup = t32 / t16;
  const double loss_diff = std::fabs(l16 - l32) / std::max(1e-12, std::fabs(l32));
  const bool acc_known = !budgeted && std::isfinite(a16) && std::isfinite(a32);
  k.matches = loss_diff <= kMatchFinalLoss || (acc_known && std::fabs(a16 - a32) <= kAccuracyTolerance);
  k.evidence = {{"step_time_p50_s", {{"32-true", t32}, {k.mode, t16}}},
                {"speedup", k.speedup},
                {"final_loss", {{"32-true", l32}, {k.mode, l16}}},
                {"final_loss_rel_diff", loss_diff},
                {"thresholds", {{"faster", kFaster}, {"loss_rel", kMatchFinalLoss}, {"accuracy_abs", kAccuracyTolerance}}}};
  k.cells = {base->at("name"), c["name"]};
  describe_agreement(c, budgeted, acc_known, loss_diff, a16, a32, k);
  return k;
}

void use_bf16(const json& report, const json& c, json& out) {
  const auto k = compare_bf16(report, c);
  if (k && k->speedup >= kFaster && k->matches)
    out.push_back(rec("precision.use-" + k->mode, "info",
                      k->model + ": " + k->mode + " runs here at " + format_fixed(k->speedup, 2) + "x the speed of fp32 (" +
                          k->quality + "): use it",
                      k->evidence, k->cells));
}

void bf16_drifts(const json& report, const json& c, json& out) {
  const auto k = compare_bf16(report, c);
  if (k && !k->matches)
    out.push_back(rec("precision.bf16-drifts", "warn",
                      k->model + ": " + k->mode + " drifts from fp32 (" + k->quality + ") at " + format_fixed(k->speedup, 2) +
                          "x the speed: check the numerics before switching",
                      k->evidence, k->cells));
}

void keep_fp32(const json& report, const json& c, json& out) {
  const auto k = compare_bf16(report, c);
  if (k && k->matches && !(k->speedup >= kFaster))
    out.push_back(rec("precision.keep-fp32", "info",
                      k->model + ": " + k->mode + " matches fp32 (" + k->quality + ") but is only " +
                          format_fixed(k->speedup, 2) + "x its speed here: no gain from switching on this device",
                      k->evidence, k->cells));
}

// fp16 with the scaler: how often it skipped and where the scale settled.
void fp16_loss_scaling(const json&, const json& c, json& out) {
  const PrecisionTraits* t = traits_of(c);
  if (!t || !t->fp16 || !t->loss_scaler || !c.contains("metrics")) return;
  const json& o = c["metrics"].value("overflow", json::object());
  if (o.empty() || o["scale_trajectory"].is_null()) return;
  const int64_t skipped = o.value("skipped_steps", 0), steps = o.value("steps", 0);
  const double final_scale = o.value("final_scale", 0.0), min_scale = o.value("min_scale", 0.0);
  const bool collapsed = o.value("scale_collapsed", false);
  if (skipped == 0 && !collapsed) return;
  std::string text = c["name"].get<std::string>() + ": " + t->name + " skipped " + std::to_string(skipped) + " of " +
                     std::to_string(steps) + " steps; the loss scale settled at 2^" + format_fixed(std::log2(final_scale), 0) +
                     " after " + std::to_string(o.value("scale_settled_step", 0)) + " steps";
  if (!o["first_overflow_step"].is_null())
    text += " (first overflow at step " + std::to_string(o["first_overflow_step"].get<int64_t>()) + ")";
  if (collapsed) text += "; the scale fell to 2^" + format_fixed(std::log2(min_scale), 0) +
                         ": gradients overflow fp16 even unscaled, prefer bf16";
  out.push_back(rec("precision.fp16-loss-scaling", collapsed ? "warn" : "info", text,
                    {{"skipped_steps", skipped}, {"steps", steps}, {"final_scale", final_scale},
                     {"min_scale", min_scale}, {"scale_settled_step", o["scale_settled_step"]},
                     {"first_overflow_step", o["first_overflow_step"]}, {"scale_collapsed", collapsed}},
                    {c["name"]}));
}

// fp16 without a scaler that blew up, with the blocks that left fp16's range.
void fp16_noscale_diverged(const json&, const json& c, json& out) {
  const PrecisionTraits* t = traits_of(c);
  if (!t || !t->fp16 || t->loss_scaler || c["status"] != "diverged") return;
  const json o = c.contains("metrics") ? c["metrics"].value("overflow", json::object()) : json::object();
  std::string blocks;
  for (const auto& b : o.value("overflow_blocks", json::array())) blocks += (blocks.empty() ? "" : ", ") + b.get<std::string>();
  const json first = c.contains("metrics") ? c["metrics"]["quality"].value("first_nonfinite_step", json()) : json();
  std::string text = c["name"].get<std::string>() + ": fp16 without loss scaling diverged";
  if (first.is_number()) text += " at step " + std::to_string(first.get<int64_t>());
  if (!blocks.empty()) text += "; values of " + blocks + " exceeded fp16's range (65504)";
  text += ": use 16-mixed with the scaler, or bf16";
  out.push_back(rec("precision.fp16-noscale-diverged", "critical", text,
                    {{"first_nonfinite_step", first}, {"overflow_blocks", o.value("overflow_blocks", json::array())},
                     {"first_overflow_step", o.value("first_overflow_step", json())}},
                    {c["name"]}));
}

// The block with the largest share of gradients under fp16's normal range; 0 and "" when none has any.
std::pair<double, std::string> worst_underflow(const json& overflow) {
  std::pair<double, std::string> worst{0.0, ""};
  for (const auto& l : overflow.value("layers", json::array()))
    if (l["gradient"].is_object() && l["gradient"]["frac_below_fp16_normal"].get<double>() > worst.first)
      worst = {l["gradient"]["frac_below_fp16_normal"].get<double>(), l["block"].get<std::string>()};
  return worst;
}

// Gradients that fp16 cannot represent without scaling, read from cells whose gradients no loss scaler
// touched and were computed in fp32 (32-true) or fp16 (16-mixed-noscale); once per model.
void fp16_underflow(const json& report, const json&, json& out) {
  std::set<std::string> models_seen;
  for (const auto& c : report["cells"]) {
    const PrecisionTraits* t = traits_of(c);
    if (!t || t->loss_scaler || (t->gemm != "fp32" && !t->fp16) || c["status"] != "ok" || !c.contains("metrics")) continue;
    if (c["config"].value("loss_multiplier", 1.0) != 1.0) continue;
    const std::string model = c["config"].value("model", "?");
    if (models_seen.count(model)) continue;
    const auto [frac, worst] = worst_underflow(c["metrics"].value("overflow", json::object()));
    if (frac < kUnderflow) continue;
    models_seen.insert(model);
    out.push_back(rec("precision.fp16-underflow", "warn",
                      model + ": " + format_fixed(100 * frac, 1) + "% of the gradients of " + worst +
                          " are below fp16's normal range (6.1e-5) unscaled: in fp16 keep the loss scaler, or use bf16",
                      {{"block", worst}, {"frac_below_fp16_normal", frac}, {"threshold", kUnderflow}}, {c["name"]}));
  }
}

// Any other mode whose numerics drift from fp32 (the bf16 modes have the rules above).
void precision_drifts(const json&, const json& c, json& out) {
  if (!c.contains("numerics") || bf16_over_fp32_weights(traits_of(c))) return;
  if (c["numerics"].value("verdict", "") != "drifts") return;
  const json& n = c["numerics"];
  out.push_back(rec("precision.drifts", "warn",
                    c["name"].get<std::string>() + ": final loss " +
                        format_fixed(100 * n["final_loss_rel_diff"].get<double>(), 1) + "% from fp32, largest deviation " +
                        format_fixed(100 * n["max_curve_rel_dev"].get<double>(), 1) + "% along the curve",
                    n, {c["name"], n["reference"]}));
}

// A GPU without bf16: the fast option is fp16 with the scaler. Said once, of the first such cell.
void no_bf16(const json& report, const json&, json& out) {
  for (const auto& c : report["cells"]) {
    const PrecisionTraits* t = traits_of(c);
    if (c["status"] != "skipped" || !t || t->gemm != "bf16") continue;
    if (c.value("reason", "").find("compute capability") == std::string::npos) continue;
    out.push_back(rec("precision.no-bf16", "info",
                      "this GPU has no bf16 (" + c["reason"].get<std::string>() +
                          "): 16-mixed with the loss scaler is the fast option",
                      {{"reason", c["reason"]}}, {c["name"]}));
    break;
  }
}

// ---- Checkpointing ------------------------------------------------------------------------------

constexpr double kWorthCheckpointing = 5.0;  // % of peak memory a policy must save

// Cells with a checkpointing comparison grouped by their configuration less the policy, in the order
// of the configurations' JSON: per group [{"name", "config", "checkpointing"}].
json checkpoint_groups(const json& report) {
  std::map<std::string, json> by_config;
  for (const auto& c : report["cells"])
    if (c.contains("checkpointing")) {
      json key = c["config"];
      key.erase("checkpoint");
      by_config[key.dump()].push_back(json{{"name", c["name"]}, {"config", c["config"]}, {"checkpointing", c["checkpointing"]}});
    }
  json groups = json::array();
  for (auto& [key, group] : by_config) groups.push_back(std::move(group));
  return groups;
}

// A group's policies against none in words ("" when none compares), evidence and cells, and the best
// saving among them.
struct CheckpointingSummary {
  std::string text, where;  // where: "gpt-tiny at batch 8"
  json evidence = json::object(), cells = json::array();
  double best_saving = -1e9;
};

CheckpointingSummary summarize_checkpointing(const json& group) {
  CheckpointingSummary s;
  for (const auto& c : group) {
    const json& k = c["checkpointing"];
    if (!k["memory_saved_pct"].is_number() || !k["recompute_overhead_pct"].is_number()) continue;
    const std::string policy = c["config"]["checkpoint"];
    s.text += (s.text.empty() ? "" : "; ") + policy + ": peak memory " + format_signed_pct(-k["memory_saved_pct"].get<double>()) +
              ", step time " + format_signed_pct(k["recompute_overhead_pct"].get<double>());
    s.evidence[policy] = k;
    s.best_saving = std::max(s.best_saving, k["memory_saved_pct"].get<double>());
    s.cells.push_back(c["name"]);
    if (s.cells.size() == 1) s.cells.push_back(k["reference"]);
  }
  const json& cfg = group.front()["config"];
  s.where = cfg.value("model", "?") + " at batch " + std::to_string(cfg.value("batch_size", 0));
  return s;
}

// The peak is not made of activations: recomputing them buys nothing.
void checkpoint_leave_off(const json&, const json& group, json& out) {
  const CheckpointingSummary s = summarize_checkpointing(group);
  if (s.text.empty() || !(s.best_saving < kWorthCheckpointing)) return;
  out.push_back(rec("checkpoint.leave-off", "info",
                    s.where + ": no policy lowers peak memory by 5% or more (" + s.text +
                        "); the peak is not activations: leave checkpointing off",
                    s.evidence, s.cells));
}

void checkpoint_tradeoff(const json&, const json& group, json& out) {
  const CheckpointingSummary s = summarize_checkpointing(group);
  if (s.text.empty() || s.best_saving < kWorthCheckpointing) return;
  out.push_back(rec("checkpoint.tradeoff", "info", s.where + ", against no checkpointing: " + s.text, s.evidence, s.cells));
}

// The frontier's entries by model and precision (and strategy at several ranks), in the order of
// those labels: per model {"model": label, "entries": [...]}.
json frontier_models(const json& report) {
  if (!report.contains("frontier") || !report["frontier"].is_array()) return json::array();
  std::map<std::string, json> by_model;
  for (const auto& f : report["frontier"]) {
    const int world = f.value("world_size", 1);
    by_model[f["model"].get<std::string>() + "/" + f["precision"].get<std::string>() +
             (world > 1 ? "/" + f.value("parallel", "?") + " at " + std::to_string(world) + " ranks" : std::string())]
        .push_back(f);
  }
  json models = json::array();
  for (auto& [model, entries] : by_model) models.push_back(json{{"model", model}, {"entries", std::move(entries)}});
  return models;
}

// A model's entry without checkpointing and the entry that fits the largest batch, with every
// policy's largest batch and rate as evidence; nullopt without an entry for `none`.
struct FrontierPair {
  json none, best, evidence = json::object();
};

std::optional<FrontierPair> frontier_pair(const json& model) {
  const json* none = nullptr;
  const json* best = nullptr;
  for (const auto& f : model["entries"]) {
    if (f["checkpoint"] == "none") none = &f;
    if (!best || f["largest_batch"].get<int64_t>() > (*best)["largest_batch"].get<int64_t>()) best = &f;
  }
  if (!none || !best) return std::nullopt;
  FrontierPair p{*none, *best};
  for (const auto& f : model["entries"])
    p.evidence[f["checkpoint"].get<std::string>()] = {{"largest_batch", f["largest_batch"]}, {"samples_per_s", f["samples_per_s"]}};
  p.evidence["budget"] = p.none["budget"];
  return p;
}

void checkpoint_frontier(const json&, const json& model, json& out) {
  const auto p = frontier_pair(model);
  if (!p) return;
  const int64_t b0 = p->none["largest_batch"], b = p->best["largest_batch"];
  if (!(b > b0)) return;
  std::string text = model["model"].get<std::string>() + ": under " + p->none["budget"].get<std::string>() + ", " +
                     p->best["checkpoint"].get<std::string>() + " fits batch " + std::to_string(b) + " where none fits " +
                     std::to_string(b0);
  if (p->best["samples_per_s"].is_number() && p->none["samples_per_s"].is_number())
    text += " (" + format_rate(p->best["samples_per_s"].get<double>()) + " vs " +
            format_rate(p->none["samples_per_s"].get<double>()) + " samples/s at the frontier)";
  out.push_back(rec("checkpoint.frontier", "info", text, p->evidence, json::array()));
}

void frontier_leave_off(const json&, const json& model, json& out) {
  const auto p = frontier_pair(model);
  if (!p) return;
  const int64_t b0 = p->none["largest_batch"], b = p->best["largest_batch"];
  if (b > b0) return;
  out.push_back(rec("checkpoint.leave-off", "info",
                    model["model"].get<std::string>() + ": under " + p->none["budget"].get<std::string>() +
                        " no policy fits a larger batch than none (" + std::to_string(b0) +
                        "): memory is to spare, leave checkpointing off",
                    p->evidence, json::array()));
}

// ---- Parallel strategies ------------------------------------------------------------------------

constexpr double kExposedWarn = 0.25;  // exposed communication above this share of the step
constexpr double kScalingWarn = 0.5;   // ddp below half of linear scaling
constexpr double kLinkWarn = 0.5;      // an all-reduce below half of the link's rate

bool parallel_ok(const json& c) { return c.contains("parallel") && c["status"] == "ok"; }
std::string at_ranks(const json& cfg) { return " at " + std::to_string(cfg.value("world_size", 0)) + " ranks"; }

// Memory against DDP: what sharding cut, and at what step time.
void zero_memory(const json& report, const json& c, json& out) {
  if (!parallel_ok(c)) return;
  const json& p = c["parallel"];
  const json& cfg = c["config"];
  const std::string strategy = cfg.value("parallel", "?"), model = cfg.value("model", "?");
  if ((strategy.rfind("zero", 0) != 0 && strategy != "hsdp") || !p["model_state_vs_ddp_pct"].is_number()) return;
  const json* ddp = sibling(report, c, "parallel", "ddp");
  if (!ddp) return;
  const double state = p["model_state_bytes"], state0 = number_at(*ddp, {"metrics", "memory", "model_state_total_bytes"});
  std::string text = model + ": " + strategy + " cuts model-state memory per rank from " + format_bytes(state0) + " to " +
                     format_bytes(state) + at_ranks(cfg) + " (expected " +
                     format_bytes(p["expected_model_state_bytes"].get<double>()) + ")";
  if (p["step_time_vs_ddp_pct"].is_number())
    text += " for " + format_signed_pct(p["step_time_vs_ddp_pct"].get<double>()) + " step time against ddp";
  out.push_back(rec("parallel.zero-memory", "info", text,
                    {{"model_state_bytes", state}, {"ddp_model_state_bytes", state0},
                     {"expected_model_state_bytes", p["expected_model_state_bytes"]},
                     {"step_time_vs_ddp_pct", p["step_time_vs_ddp_pct"]}},
                    {c["name"], (*ddp)["name"]}));
}

void exposed_comm(const json&, const json& c, json& out) {
  if (!parallel_ok(c)) return;
  const json& p = c["parallel"];
  const json& cfg = c["config"];
  const std::string strategy = cfg.value("parallel", "?"), model = cfg.value("model", "?");
  if (!p["exposed_comm_fraction"].is_number() || !(p["exposed_comm_fraction"].get<double>() > kExposedWarn)) return;
  const double f = p["exposed_comm_fraction"];
  const json pipeline = value_at(c, {"metrics", "timing", "pipeline"});
  if (pipeline.is_object()) {
    // A pipeline's waits for its neighbouring stages are its bubble, and the stages' unequal costs.
    const json bubble = pipeline["bubble"];
    out.push_back(rec("parallel.exposed-comm", "warn",
                      model + "/" + c["layout"].value("name", strategy) + ": the step waits " + format_fixed(100 * f, 0) +
                          "% of its time" + at_ranks(cfg) + ", on its neighbouring stages (" + pipeline.value("schedule", "?") + ", " +
                          std::to_string(pipeline.value("microbatches", 0)) + " micro-batches: bubble " +
                          (bubble["measured"].is_number() ? format_fixed(100 * bubble["measured"].get<double>(), 0) + "%" : std::string("-")) +
                          " measured on rank " + std::to_string(pipeline.value("rank", 0)) + ", " +
                          format_fixed(100 * bubble.value("formula", 0.0), 0) +
                          "% by the schedule on equal stages): more micro-batches (pp_microbatches) or interleaved-1f1b shrink the "
                          "schedule's part; the rest is stages of unequal cost (the embedding on the first, the head and the loss on the last)",
                      {{"exposed_comm_fraction", f}, {"bubble_measured", bubble["measured"]}, {"bubble_formula", bubble["formula"]},
                       {"threshold", kExposedWarn}},
                      {c["name"]}));
    return;
  }
  const json cp = value_at(c, {"metrics", "timing", "context_parallel"});
  if (cp.is_object()) {
    // Context parallelism: the ring hides its transfers behind the blocks only when a rank's block
    // computes longer than its keys and values travel; the all-gather hides none.
    const bool ring = cp.value("method", "") == "ring";
    out.push_back(rec("parallel.exposed-comm", "warn",
                      model + "/" + c["layout"].value("name", strategy) + ": exposed communication is " + format_fixed(100 * f, 0) +
                          "% of the step" + at_ranks(cfg) + ", cp's " + cp.value("method", std::string("?")) + " hiding " +
                          format_fixed(100 * cp.value("hidden_fraction", 0.0), 0) + "% of its transfers: " +
                          (ring ? "each rank's tokens compute too briefly to cover its keys' and values' transfer; fewer cp ranks "
                                  "(more tokens each) or a faster link"
                                : "the all-gather waits whole; cp_method = ring overlaps the transfers with the blocks"),
                      {{"exposed_comm_fraction", f}, {"cp_hidden_fraction", cp["hidden_fraction"]}, {"cp_method", cp["method"]},
                       {"threshold", kExposedWarn}},
                      {c["name"]}));
    return;
  }
  const json tp_comm = value_at(c, {"metrics", "comm", "dimensions", "tp"});
  if (tp_comm.is_object()) {
    // Tensor parallelism's collectives wait for the GEMM before them: on the critical path by design.
    const double share = tp_comm.value("exposed_comm_time_s", 0.0) / std::max(1e-12, number_at(c, {"metrics", "comm", "exposed_comm_time_s"}));
    out.push_back(rec("parallel.exposed-comm", "warn",
                      model + "/" + c["layout"].value("name", strategy) + ": exposed communication is " + format_fixed(100 * f, 0) +
                          "% of the step" + at_ranks(cfg) + ", " + format_fixed(100 * share, 0) +
                          "% of it tp's (each row-parallel layer's all-reduce, or sequence parallelism's reduce-scatter and "
                          "all-gather, waits for its GEMM): keep tp inside a node's fastest links, or trade tp for dp_shard where "
                          "the memory allows",
                      {{"exposed_comm_fraction", f}, {"overlap", p["overlap"]}, {"tp_exposed_comm_time_s", tp_comm["exposed_comm_time_s"]},
                       {"threshold", kExposedWarn}},
                      {c["name"]}));
    return;
  }
  const std::string remedy = strategy == "zero3" || strategy == "hsdp"
                                 ? (cfg.value("prefetch", true)
                                        ? "prefetch is on: fewer, larger units (whole stages) or a faster link"
                                        : "turn prefetch on, so the next block's all-gather runs during this one")
                                 : "larger buckets (bucket_mb) cut per-bucket latency; more overlap needs the last buckets to be small" +
                                       std::string(strategy == "ddp" ? "" : " (the all-gather after the step cannot overlap)");
  out.push_back(rec("parallel.exposed-comm", "warn",
                    model + "/" + strategy + ": exposed communication is " + format_fixed(100 * f, 0) + "% of the step" +
                        at_ranks(cfg) + " (overlap " +
                        (p["overlap"].is_number() ? format_fixed(100 * p["overlap"].get<double>(), 0) + "%" : std::string("-")) +
                        "): " + remedy,
                    {{"exposed_comm_fraction", f}, {"overlap", p["overlap"]}, {"threshold", kExposedWarn}}, {c["name"]}));
}

void ddp_scaling(const json&, const json& c, json& out) {
  if (!parallel_ok(c)) return;
  const json& p = c["parallel"];
  const json& cfg = c["config"];
  const std::string strategy = cfg.value("parallel", "?"), model = cfg.value("model", "?");
  if (strategy != "ddp" || !p["scaling_efficiency"].is_number()) return;
  const double efficiency = p["scaling_efficiency"];
  out.push_back(rec("parallel.scaling", efficiency < kScalingWarn ? "warn" : "info",
                    model + "/" + strategy + at_ranks(cfg) + ": " + format_fixed(efficiency * cfg.value("world_size", 1.0), 2) +
                        "x the throughput of one process at the same per-rank batch (scaling efficiency " +
                        format_fixed(100 * efficiency, 0) + "%)",
                    {{"scaling_efficiency", p["scaling_efficiency"]}, {"step_time_vs_single_pct", p["step_time_vs_single_pct"]}},
                    {c["name"], p["reference"]}));
}

// One strategy's step across nodes in words: its time per step and its communication per level, and
// the level it waits on most; its numbers into `ev`. "" when its step time is unknown.
std::string step_on_levels(const json& x, json& ev) {
  const double t = number_at(x, {"metrics", "timing", "step_time_s", "p50"});
  if (!std::isfinite(t) || t <= 0) return "";
  const json levels = x["metrics"].value("comm", json::object()).value("levels", json::object());
  std::string by_level, bound;
  double most = 0;
  ev = {{"step_time_s", t}};
  for (const char* level : {"intra-node", "inter-node"}) {
    if (!levels.contains(level)) continue;
    const std::string where = std::string(level) == "intra-node" ? "within a node" : "across nodes";
    const double s = levels[level].value("comm_time_s", 0.0), exposed = levels[level].value("exposed_comm_time_s", 0.0);
    by_level += (by_level.empty() ? "" : ", ") + format_seconds(s) + " " + where;
    ev[level + std::string("_comm_time_s")] = s;
    ev[level + std::string("_exposed_comm_time_s")] = exposed;
    // The level the step waits on most bounds it, as far as communication does.
    if (exposed > most) most = exposed, bound = where;
  }
  return x["config"]["parallel"].get<std::string>() + " " + format_seconds(t) + " per step" +
         (by_level.empty() ? "" : " (communication " + by_level + (bound.empty() ? "" : "; waits most on the links " + bound) + ")");
}

// Across nodes: hsdp against zero3 and ddp on the same cell, on the links this run measured. zero3 and
// ddp run every collective over the whole world (across the nodes), hsdp only its gradient slices.
void across_nodes(const json& report, const json& c, json& out) {
  if (c["status"] != "ok" || c["config"].value("parallel", "") != "hsdp" || c.value("nodes", json::array()).size() < 2) return;
  std::vector<const json*> cells = {&c};
  for (const char* other : {"zero3", "ddp"})
    if (const json* o = sibling(report, c, "parallel", other); o && (*o)["status"] == "ok") cells.push_back(o);
  if (cells.size() < 2) return;
  const json* fastest = nullptr;
  std::string parts;
  json evidence = json::object(), names = json::array();
  for (const json* x : cells) {
    json ev;
    const std::string part = step_on_levels(*x, ev);
    if (part.empty()) continue;
    const double t = ev["step_time_s"];
    if (!fastest || t < number_at(*fastest, {"metrics", "timing", "step_time_s", "p50"})) fastest = x;
    parts += (parts.empty() ? "" : "; ") + part;
    evidence[(*x)["config"]["parallel"].get<std::string>()] = ev;
    names.push_back((*x)["name"]);
  }
  if (!fastest) return;
  const json& cfg = c["config"];
  const std::string fast = (*fastest)["config"]["parallel"];
  const std::string text = cfg.value("model", "?") + " at " + std::to_string(cfg.value("world_size", 0)) + " ranks on " +
                           std::to_string(c["nodes"].size()) + " nodes: " + parts + ". " + fast + " is fastest on these links" +
                           (fast == "hsdp" ? ": its gathers stay inside a node and only the gradient slices cross" :
                            fast == "ddp" ? ": the model state fits unsharded and one all-reduce per bucket beats sharding's traffic" :
                            ": the link across nodes is fast enough for full sharding's gathers");
  out.push_back(rec("parallel.across-nodes", "info", text, evidence, names));
}

// busbw against the GPUs' link within a node, where core/devices.hpp knows the device by the driver's
// name (per direction; nccl-tests' busbw approaches it for large messages within one node).
void busbw_vs_link(const json& report, const json& c, json& out) {
  const json gpus = report["env"].value("gpus", json::array());
  const std::string gpu = gpus.is_array() && !gpus.empty() && gpus[0].is_object() ? gpus[0].value("name", "") : "";
  const DeviceFacts* device = gpu.empty() ? nullptr : find_device(gpu);
  if (!device || device->link_bytes_per_s <= 0 || c["status"] != "ok" || c.value("backend", "") != "nccl" ||
      !c.contains("metrics") || !c["metrics"].contains("comm") ||
      c["config"].value("world_size", 1) > static_cast<int64_t>(gpus.size()))
    return;
  const json& comm = c["metrics"]["comm"];
  if (!comm.contains("collectives") || !comm["collectives"].is_array()) return;
  const json* largest = nullptr;  // the largest all-reduce: the best chance at the link's rate
  for (const auto& k : comm["collectives"])
    if (k["op"] == "all-reduce" && (!largest || k["bytes"].get<double>() > (*largest)["bytes"].get<double>())) largest = &k;
  if (!largest) return;
  const double link_gbps = device->link_bytes_per_s / 1e9;
  const double busbw = (*largest)["busbw_gbps"], share = busbw / link_gbps;
  out.push_back(rec("parallel.busbw-vs-link", share < kLinkWarn ? "warn" : "info",
                    c["name"].get<std::string>() + ": all-reduce of " + format_bytes((*largest)["bytes"].get<double>()) +
                        " reaches busbw " + format_fixed(busbw, 1) + " GB/s, " + format_fixed(100 * share, 0) + "% of " + gpu +
                        "'s " + device->link + " per-direction " + format_fixed(link_gbps, 0) + " GB/s" +
                        (share < kLinkWarn ? " (small messages are latency-bound; for large ones check NCCL's topology)" : ""),
                    {{"busbw_gbps", busbw}, {"link_gbps", link_gbps}, {"bytes", (*largest)["bytes"]}, {"gpu", gpu}},
                    {c["name"]}));
}

// RNG streams: what each violation means and what fixes it.
void rng_streams(const json&, const json& c, json& out) {
  static const std::map<std::string, std::string> kFix = {
      {"initial-weights", "ranks start from different weights: broadcast rank 0's parameters before training"},
      {"parameters", "parameters drift apart across ranks: their gradients or updates are not synchronised"},
      {"cpu-generator", "the model's generator differs across ranks: seed it identically on every rank and draw "
                        "per-rank randomness (data, augmentation) from generators of their own"},
      {"cuda-generator", "the GPU generator differs across ranks: seed it identically on every rank"},
      {"dropout-masks", "dropout masks differ across ranks where the replicated model needs them equal: seed the "
                        "model's generator identically on every rank"},
      {"data-samples", "every rank trains on the same samples (no diversity across ranks): shard the data by rank"},
      {"augmentation", "the augmentation stream is identical on all ranks: seed it per rank"}};
  if (!c.contains("metrics") || !c["metrics"].contains("rng")) return;
  for (const auto& st : c["metrics"]["rng"].value("streams", json::array())) {
    if (st["verdict"] != "violated") continue;
    const std::string name = st["name"];
    std::string ranks;
    for (const auto& r : st["ranks"]) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r.get<int>());
    const auto fix = kFix.find(name);
    out.push_back(rec("rng." + name, "critical",
                      c["name"].get<std::string>() + ": " + st["class"].get<std::string>() + " stream '" + name +
                          "' violated from step " + std::to_string(st["first_violation_step"].get<int64_t>()) + " on ranks " +
                          ranks + ": " + (fix != kFix.end() ? fix->second : st.value("detail", "")),
                      st, {c["name"]}));
  }
}

// ---- The hardware suite: what falls short of the datasheet and by how much, and a throughput that
// falls during a sustained run ---------------------------------------------------------------------

constexpr double kShortfall = 0.10;    // 10 points under the published fraction: warn
constexpr double kMemoryShort = 0.80;  // a copy reaching under 80% of the datasheet's bandwidth: warn
constexpr double kThrottleDrop = 0.05;

bool hardware_ok(const json& c) { return c.value("status", "") == "ok"; }

// What mamf-finder measured on this kind of device in `dtype` (core/devices.hpp's
// published_gemm_fraction): the fraction of the datasheet a healthy one reaches; 0 when unknown.
double published_fraction(const std::string& device, const std::string& dtype) {
  const DeviceFacts* d = find_device(device);
  if (!d) return 0.0;
  const auto it = d->published_gemm_fraction.find(dtype);
  return it == d->published_gemm_fraction.end() ? 0.0 : it->second;
}

json gemm_without_datasheet(const json& g, const std::string& device, const json& cell) {
  const std::string dtype = g["dtype"];
  const double achieved = g["achievable_flops_per_s"];
  return rec("hardware.gemm." + dtype, "info",
             dtype + " GEMM reaches " + format_fixed(achieved / 1e12, 2) + " TFLOPS at best (shape " + g["best_shape"].dump() +
                 "); no datasheet for '" + device + "': nothing to hold it against",
             {{"achievable_flops_per_s", achieved}, {"best_shape", g["best_shape"]}}, {cell["name"]});
}

void gemm_vs_datasheet(const json&, const json& c, json& out) {
  if (!hardware_ok(c)) return;
  const std::string device = c.value("device_name", "");
  const json gemm = value_at(c, {"metrics", "hardware", "gemm"});
  for (const auto& g : gemm.is_array() ? gemm : json::array()) {
    if (g.contains("skipped") || !g["achievable_flops_per_s"].is_number()) continue;
    if (!g["fraction_of_datasheet"].is_number()) {
      out.push_back(gemm_without_datasheet(g, device, c));
      continue;
    }
    const std::string dtype = g["dtype"];
    const double achieved = g["achievable_flops_per_s"];
    const double frac = g["fraction_of_datasheet"], published = published_fraction(device, dtype);
    std::string text = dtype + " GEMM reaches " + format_fixed(100 * frac, 1) + "% of the datasheet (" +
                       format_fixed(achieved / 1e12, 1) + " of " +
                       format_fixed(g["datasheet_flops_per_s"].get<double>() / 1e12, 1) + " TFLOPS, shape " +
                       g["best_shape"].dump() + ")";
    std::string severity = "info";
    if (published > 0) {
      text += "; mamf-finder reports " + format_fixed(100 * published, 1) + "% on this device";
      if (frac < published - kShortfall) {
        severity = "warn";
        text += ": " + format_fixed(100 * (published - frac), 1) + " points short (clocks, power limit, or a slow library)";
      }
    }
    out.push_back(rec("hardware.gemm." + dtype, severity, text,
                      {{"fraction_of_datasheet", frac}, {"published_fraction", published > 0 ? json(published) : json(nullptr)},
                       {"achievable_flops_per_s", achieved}, {"datasheet_flops_per_s", g["datasheet_flops_per_s"]},
                       {"shortfall_points", kShortfall}},
                      {c["name"]}));
  }
}

// SDPA's fused attention (GPU): its rate at the largest shape measured, the one nearest training's.
void attention_rate(const json&, const json& c, json& out) {
  if (!hardware_ok(c)) return;
  const json gemm = value_at(c, {"metrics", "hardware", "gemm"});
  for (const auto& g : gemm.is_array() ? gemm : json::array()) {
    const json att = g.value("attention", json::array());
    if (!att.is_array() || att.empty() || !att.back()["forward_flops_per_s"].is_number()) continue;
    const json& a = att.back();
    const double f = a["forward_flops_per_s"], b = a["backward_flops_per_s"];
    // A CPU's attention runs at GFLOP/s: the unit follows the rate, so that it never prints as 0.
    const bool giga = f < 1e12;
    const double unit = giga ? 1e9 : 1e12;
    std::string text = g["dtype"].get<std::string>() + " fused attention (SDPA, " + a.value("backend", std::string("?")) +
                       " kernel, causal, seq " + std::to_string(a["seq"].get<int64_t>()) + ", head dim " +
                       std::to_string(a["head_dim"].get<int64_t>()) + "): " + format_fixed(f / unit, 0) +
                       (giga ? " GFLOPS forward, " : " TFLOPS forward, ") + format_fixed(b / unit, 0) + " backward";
    if (g["datasheet_flops_per_s"].is_number())
      text += " (" + format_fixed(100 * f / g["datasheet_flops_per_s"].get<double>(), 0) + "% and " +
              format_fixed(100 * b / g["datasheet_flops_per_s"].get<double>(), 0) + "% of the datasheet)";
    out.push_back(rec("hardware.attention." + g["dtype"].get<std::string>(), "info", text,
                      {{"forward_flops_per_s", f}, {"backward_flops_per_s", b}, {"shape", a}}, {c["name"]}));
  }
}

// A cluster's two levels: the all-reduce's bus bandwidth at the largest size within a node and across.
void collective_levels(const json&, const json& c, json& out) {
  if (!hardware_ok(c)) return;
  const json levels = value_at(c, {"metrics", "hardware", "collectives", "levels", "rows"});
  if (!levels.is_array() || levels.empty()) return;
  std::map<std::string, json> best;  // level -> its largest all-reduce row
  for (const auto& r : levels)
    if (r.value("op", "") == "all-reduce" && (!best.count(r["level"]) || r["bytes"] > best[r["level"]]["bytes"])) best[r["level"]] = r;
  if (!best.count("intra-node") || !best.count("inter-node")) return;
  const double intra = best["intra-node"]["busbw_gbps"], inter = best["inter-node"]["busbw_gbps"];
  const double ratio = inter > 0 ? intra / inter : 0;
  std::string text = "all-reduce bus bandwidth " + format_fixed(inter, 3) + " GB/s across nodes against " +
                     format_fixed(intra, 3) + " GB/s within a node (" + format_bytes(best["inter-node"]["bytes"].get<double>()) + ")";
  if (ratio >= 2)
    text += ": " + format_fixed(ratio, 1) + "x slower, so collectives over every rank are bound by the link between the nodes; " +
            "sharding within a node and reducing across nodes (hybrid sharding) keeps the heavy traffic inside";
  out.push_back(rec("hardware.collectives.levels", "info", text,
                    {{"intra_node_busbw_gbps", intra}, {"inter_node_busbw_gbps", inter}, {"ratio", ratio}}, {c["name"]}));
}

void memory_bandwidth(const json&, const json& c, json& out) {
  if (!hardware_ok(c)) return;
  const json mem = value_at(c, {"metrics", "hardware", "memory"});
  if (!mem.is_object() || !mem["bandwidth_gbps"].is_number()) return;
  const double bw = mem["bandwidth_gbps"];
  if (!mem["fraction_of_datasheet"].is_number()) {
    out.push_back(rec("hardware.memory", "info",
                      "memory copies at " + format_fixed(bw, 1) + " GB/s (read + write); no datasheet for '" +
                          c.value("device_name", "") + "'",
                      {{"bandwidth_gbps", bw}}, {c["name"]}));
    return;
  }
  const double frac = mem["fraction_of_datasheet"];
  out.push_back(rec("hardware.memory", frac < kMemoryShort ? "warn" : "info",
                    "device memory copies at " + format_fixed(bw, 0) + " GB/s, " + format_fixed(100 * frac, 1) +
                        "% of the datasheet's " + format_fixed(mem["datasheet_gbps"].get<double>(), 0) + " GB/s",
                    {{"bandwidth_gbps", bw}, {"fraction_of_datasheet", frac}, {"threshold", kMemoryShort}}, {c["name"]}));
}

void throttling(const json&, const json& c, json& out) {
  if (!hardware_ok(c)) return;
  const json drop = value_at(c, {"metrics", "timing", "throughput_over_run", "drop"});
  if (!drop.is_number() || !(drop.get<double>() > kThrottleDrop)) return;
  const json& w = c["metrics"]["timing"]["throughput_over_run"];
  out.push_back(rec("hardware.throttling", "warn",
                    "throughput fell " + format_fixed(100 * drop.get<double>(), 1) + "% from the first to the last " +
                        format_fixed(w["window_s"].get<double>(), 0) +
                        " s window of the run: clock or power throttling (or a noisy neighbour)",
                    {{"drop", drop}, {"threshold", kThrottleDrop}, {"windows", w["windows"]}}, {c["name"]}));
}

// ---- The self-supervised suite: what pre-training bought against training from scratch at equal
// compute, encoders that do not beat their floors, collapse, and the data-size axis ------------------

std::string points(double delta) { return (delta >= 0 ? "+" : "-") + format_fixed(std::fabs(100 * delta), 1); }
std::string acc3(const json& v) { return v.is_number() ? format_fixed(v.get<double>(), 3) : "-"; }
std::string secs(double s) { return format_fixed(s, s >= 10 ? 0 : s >= 1 ? 1 : 2) + " s"; }
std::string fraction_pct(const json& f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g%%", 100 * f.get<double>());
  return buf;
}
std::string count_text(const json& v) {
  return v.is_number() ? std::to_string(static_cast<int64_t>(std::llround(v.get<double>()))) : "?";
}

// The report's SSL summary (computed when a report predates the section); null without SSL cells.
json ssl_of(const json& report) { return report.contains("ssl") ? report["ssl"] : ssl_summary(report); }

// One label fraction's row of the evidence.
json efficiency_fraction(const json& x) {
  return {{"fraction", x["fraction"]}, {"labels", x["labels"]}, {"n", x["n"]},
          {"ssl_accuracy_mean", x["ssl_accuracy_mean"]}, {"scratch_accuracy_mean", x["scratch_accuracy_mean"]},
          {"delta_mean", x["delta_mean"]}, {"delta_low", x["delta_low"]}, {"delta_high", x["delta_high"]},
          {"verdict", x["verdict"]}, {"pretrain_wall_s", x["pretrain_wall_s"]},
          {"pretrained_from", x["pretrained_from"]}, {"upstream_pretrain_wall_s", x["upstream_pretrain_wall_s"]},
          {"finetune_s_mean", x["finetune_s_mean"]}, {"ssl_cost_s_mean", x["ssl_cost_s_mean"]},
          {"scratch_outside_compute", x["scratch_outside_compute"]},
          {"label_equivalent", x["label_equivalent"]}};
}

// The compute one label fraction's SSL arm cost, in words: pre-training (and where it came from) plus a
// fine-tune or a linear probe.
std::string efficiency_cost(const json& x, bool first) {
  int tuned = 0, paired = 0;
  for (const auto& sd : x["seeds"])
    if (sd["delta"].is_number()) ++paired, tuned += sd["ssl_path"] == "finetune";
  std::string clause = std::string(first ? " at " : ", at ") +
                       (x["pretrain_wall_s"].is_number() ? secs(x["pretrain_wall_s"]) : std::string("?")) + " pre-training";
  if (first && x["pretrained_from"].is_string())
    clause += " (" + (x["upstream_pretrain_wall_s"].is_number() ? secs(x["upstream_pretrain_wall_s"]) : std::string("?")) +
              " of it in " + x["pretrained_from"].get<std::string>() + ", whose encoder it starts from)";
  else if (first && x["pretrained"].is_string())
    clause += " (not counting the pre-training of " + x["pretrained"].get<std::string>() + ": no cell of this report saved it)";
  clause += " + ";
  if (tuned == 0) return clause + "a linear probe";
  clause += secs(x["finetune_s_mean"].get<double>()) + " fine-tune";
  if (tuned < paired) clause += " on " + std::to_string(tuned) + " of " + std::to_string(paired) + " seeds, a linear probe on the others";
  return clause;
}

// One label fraction's verdict in words; the first of a cell also names the seeds and the comparison.
std::string efficiency_clause(const json& x, bool first) {
  const int64_t n = x["n"];
  std::string clause = x["verdict"].get<std::string>() + " at " + fraction_pct(x["fraction"]) + (first ? " labels" : "") + " (" +
                       points(x["delta_mean"].get<double>()) + " points";
  if (x["delta_low"].is_number())
    clause += ", 95% CI " + points(x["delta_low"].get<double>()) + ".." + points(x["delta_high"].get<double>());
  else
    clause += ", one label seed: no interval";
  if (first) clause += ", over " + std::to_string(n) + " label seed" + (n == 1 ? "" : "s");
  clause += efficiency_cost(x, first);
  if (first) clause += " against the best scratch run within that compute";
  const int flagged = x["scratch_outside_compute"];
  if (flagged > 0)
    clause += "; on " + std::to_string(flagged) + " seed" + (flagged == 1 ? "" : "s") + " even the scratch run's first logged point took longer";
  return clause + ")";
}

void ssl_label_efficiency(const json& report, const json&, json& out) {
  const json ssl = ssl_of(report);
  if (!ssl.is_object()) return;
  std::vector<std::string> order;
  std::map<std::string, std::vector<const json*>> by_cell;
  const json efficiency = ssl.value("label_efficiency", json::array());  // by_cell points into it
  for (const auto& e : efficiency) {
    const std::string cell = e["cell"];
    if (!by_cell.count(cell)) order.push_back(cell);
    by_cell[cell].push_back(&e);
  }
  for (const auto& cell : order) {
    const json& head = *by_cell[cell].front();
    std::string clauses;
    json fractions = json::array();
    for (const json* e : by_cell[cell]) {
      fractions.push_back(efficiency_fraction(*e));
      if ((*e)["verdict"].is_string() && (*e)["fraction"].is_number())
        clauses += (clauses.empty() ? "" : "; ") + efficiency_clause(*e, clauses.empty());
    }
    const std::string who = head["method"].get<std::string>() + " on " + head["encoder"].get<std::string>() + " (" + cell + ")";
    const std::string text = clauses.empty() ? who + ": no supervised sibling with scratch runs on the same label subsets: "
                                                     "label efficiency against training from scratch not measured"
                                             : who + " " + clauses;
    json cells = {cell};
    if (head["supervised_cell"].is_string()) cells.push_back(head["supervised_cell"]);
    out.push_back(rec("ssl-label-efficiency", "info", text,
                      {{"supervised_cell", head["supervised_cell"]},
                       {"confidence", ssl.value("confidence", 0.95)},
                       {"cost", "pre-training wall time, plus the fine-tune's where fine-tuning gave the better "
                                "accuracy; a linear probe on frozen features is not counted (negligible next to pre-training)"},
                       {"fractions", fractions}},
                      cells));
  }
}

void ssl_below_floor(const json& report, const json&, json& out) {
  const json ssl = ssl_of(report);
  if (!ssl.is_object()) return;
  for (const auto& r : ssl.value("rows", json::array())) {
    if (!is_ssl_method(r.value("method", "")) || r["beats_floors"] != false) continue;
    const std::string floor = r["floor"];
    const std::string other = floor == "raw-pixel" ? "random-encoder" : "raw-pixel";
    const json& other_linear = r[other == "raw-pixel" ? "raw_pixels_linear" : "random_encoder_linear"];
    std::string text = r["cell"].get<std::string>() + ": " + r["method"].get<std::string>() + " on " +
                       r["encoder"].get<std::string>() + ": a linear probe on its frozen features reaches " + acc3(r["linear"]) +
                       ", " + points(r["linear"].get<double>() - r["floor_linear"].get<double>()) + " points against the " +
                       floor + " floor (" + acc3(r["floor_linear"]) + ")";
    if (other_linear.is_number()) text += "; the " + other + " floor is " + acc3(other_linear);
    text += floor == "raw-pixel" ? ": the pre-trained features separate the classes less well than the pixels themselves"
                                 : ": pre-training left the encoder no better than its random initialisation";
    out.push_back(rec("ssl-below-floor", "warn", text,
                      {{"linear", r["linear"]}, {"floor", floor}, {"floor_linear", r["floor_linear"]},
                       {"margin", r["linear"].get<double>() - r["floor_linear"].get<double>()},
                       {"random_encoder_linear", r["random_encoder_linear"]}, {"raw_pixels_linear", r["raw_pixels_linear"]}},
                      {r["cell"]}));
  }
}

void ssl_collapse(const json& report, const json&, json& out) {
  if (!ssl_of(report).is_object()) return;
  for (const auto& c : report["cells"]) {
    const json h = value_at(c, {"metrics", "ssl_health"});
    if (!h.is_object() || h.value("verdict", "") != "collapsed") continue;
    const json step = h.value("collapse_step", json());
    json at = nullptr;  // the health sample at the collapse (the last one when the step is unknown)
    for (const auto& sm : h.value("samples", json::array()))
      if (!step.is_number() || (sm.value("step", json()) == step)) at = sm;
    const std::string reason = h.value("reason", json()).is_string() ? h["reason"].get<std::string>() : "";
    out.push_back(rec("ssl-collapse", "critical",
                      c["name"].get<std::string>() + ": " + c["config"].value("method", "?") + " collapsed" +
                          (step.is_number() ? " at step " + std::to_string(step.get<int64_t>()) : std::string()) +
                          (reason.empty() ? "" : ": " + reason) + "; its features and accuracies are not to be trusted",
                      {{"collapse_step", step}, {"reason", h.value("reason", json())}, {"std_reference", h.value("std_reference", json())},
                       {"collapse_loss", h.value("collapse_loss", json())}, {"sample", at}},
                      {c["name"]}));
  }
}

void ssl_data_size(const json& report, const json&, json& out) {
  const json ssl = ssl_of(report);
  if (!ssl.is_object()) return;
  for (const auto& g : ssl.value("data_size", json::array())) {
    const json& rows = g["rows"];
    if (rows.size() < 2) continue;
    const json &small = rows.front(), &large = rows.back();
    std::string text = "pre-training " + g["method"].get<std::string>() + " on " + g["encoder"].get<std::string>() + " on " +
                       count_text(small["unlabeled_size"]) + " images reaches " + acc3(small["linear"]) + " linear vs " +
                       acc3(large["linear"]) + " on " + count_text(large["unlabeled_size"]);
    std::string middle;
    for (size_t i = 1; i + 1 < rows.size(); ++i)
      middle += (middle.empty() ? "" : ", ") + count_text(rows[i]["unlabeled_size"]) + ": " + acc3(rows[i]["linear"]);
    if (!middle.empty()) text += " (" + middle + ")";
    if (g["fraction"].is_number() && small["finetune"].is_number() && large["finetune"].is_number())
      text += "; fine-tuned on " + fraction_pct(g["fraction"]) + " of the labels, " + acc3(small["finetune"]) + " vs " +
              acc3(large["finetune"]);
    json cells = json::array();
    for (const auto& r : rows) cells.push_back(r["cell"]);
    out.push_back(rec("ssl-data-size", "info", text, g, cells));
  }
}

// ---- Pitfalls -----------------------------------------------------------------------------------

// Each pitfall of the suite: its verdict, at warn when the run did not reproduce it.
void pitfalls(const json& report, const json&, json& out) {
  for (const auto& p : report.value("pitfalls", json::array())) {
    json cells = json::array();
    for (const char* part : {"wrong", "fix"})
      for (const auto& e : p[part]) cells.push_back(e["cell"]);
    const bool reproduced = p["reproduced"].is_boolean() && p["reproduced"].get<bool>();
    out.push_back(rec("pitfall." + p["kind"].get<std::string>(), reproduced ? "info" : "warn",
                      p.value("title", p["id"].get<std::string>()) + (reproduced ? ": " : " (not reproduced): ") + p.value("verdict", ""),
                      {{"id", p["id"]}, {"reproduced", p["reproduced"]}}, cells));
  }
}

// ---- The walk -----------------------------------------------------------------------------------

// The subjects of a scope, in the order its rules take them; `groups` holds those made for the walk.
std::vector<const json*> subjects(const json& report, RuleScope scope, json& groups) {
  std::vector<const json*> out;
  if (scope == RuleScope::report) return {&report};
  if (scope == RuleScope::cell) {
    for (const auto& c : report["cells"]) out.push_back(&c);
    return out;
  }
  groups = scope == RuleScope::checkpoint_group ? checkpoint_groups(report) : frontier_models(report);
  for (const auto& g : groups) out.push_back(&g);
  return out;
}

// ---- The table: the rules in the order recommend() walks them (and their findings come out) ----

// The run as a whole, then precision: bf16 against fp32, fp16 and its scaler, drift.
std::vector<Rule> run_and_precision_rules() {
  using S = RuleScope;
  return {
      {"env.reference-blas", "torch calls the reference (netlib) BLAS", "env.blas: the library and its path",
       S::report, "", reference_blas},
      {"run.cells-failed", "a cell failed, timed out or ran out of memory where its suite did not expect it",
       "each such cell's status and reason; their count", S::report, "", cells_failed},
      {"run.expected-failure-missing", "a cell its suite expects to go wrong (a mistake shown on purpose) ended ok",
       "the statuses the suite expects, the status it ended in", S::cell, "", expected_failure_missing},
      {"precision.use-<precision>",
       "a bf16-mixed or bf16-master cell runs at 1.10x its 32-true sibling's speed or more and agrees with it (final "
       "loss within 2% relative, or accuracy within 1 point)",
       "step time p50 of both, speed-up, final loss of both (at the step both reached when a time budget stopped one) and "
       "its relative difference, accuracy of both, the thresholds",
       S::cell, "bf16 against 32-true", use_bf16},
      {"precision.bf16-drifts",
       "a bf16-mixed or bf16-master cell disagrees with its 32-true sibling (final loss more than 2% relative apart and "
       "accuracy more than 1 point apart or unknown)",
       "as precision.use-<precision>", S::cell, "bf16 against 32-true", bf16_drifts},
      {"precision.keep-fp32",
       "a bf16-mixed or bf16-master cell agrees with its 32-true sibling but runs at under 1.10x its speed",
       "as precision.use-<precision>", S::cell, "bf16 against 32-true", keep_fp32},
      {"precision.fp16-loss-scaling",
       "a cell in fp16 with the loss scaler skipped steps (info) or its scale collapsed (warn)",
       "skipped steps of steps, final and lowest scale, the step the scale settled at, the first overflow step, collapse",
       S::cell, "", fp16_loss_scaling},
      {"precision.fp16-noscale-diverged", "a cell in fp16 without the loss scaler diverged",
       "the first non-finite step, the blocks whose values left fp16's range, the first overflow step", S::cell, "",
       fp16_noscale_diverged},
      {"precision.fp16-underflow",
       "1% or more of a block's unscaled gradients (a 32-true or 16-mixed-noscale cell, loss multiplier 1) lie under "
       "fp16's normal range; once per model",
       "the block, its share of gradients under 6.1e-5, the threshold", S::report, "", fp16_underflow},
      {"precision.drifts",
       "a cell's numerics against its 32-true sibling say drifts (modes other than bf16-mixed and bf16-master)",
       "the numerics section: final-loss relative difference, largest deviation along the curve, the reference cell",
       S::cell, "", precision_drifts},
  };
}

// Checkpointing and the frontier, the parallel strategies and their RNG streams, and a GPU
// without bf16.
std::vector<Rule> memory_and_parallel_rules() {
  using S = RuleScope;
  return {
      {"checkpoint.leave-off",
       "no checkpointing policy lowers peak memory by 5% or more against none at the same configuration",
       "per policy: peak memory saved and recompute overhead (% against none)", S::checkpoint_group, "checkpointing",
       checkpoint_leave_off},
      {"checkpoint.tradeoff", "a checkpointing policy lowers peak memory by 5% or more against none at the same configuration",
       "per policy: peak memory saved and recompute overhead (% against none)", S::checkpoint_group, "checkpointing",
       checkpoint_tradeoff},
      {"checkpoint.frontier", "on the memory frontier a policy fits a larger batch than none under the budget",
       "per policy: the largest batch that fits and its samples/s; the budget", S::frontier_model, "frontier",
       checkpoint_frontier},
      {"checkpoint.leave-off", "on the memory frontier no policy fits a larger batch than none under the budget",
       "per policy: the largest batch that fits and its samples/s; the budget", S::frontier_model, "frontier",
       frontier_leave_off},
      {"parallel.zero-memory", "a zero or hsdp cell with its ddp sibling's model-state memory to compare",
       "model-state bytes per rank, ddp's and the expected; step time against ddp (%)", S::cell, "parallel", zero_memory},
      {"parallel.exposed-comm", "exposed communication is above 25% of a parallel cell's step",
       "the exposed fraction of the step, the overlap, the threshold", S::cell, "parallel", exposed_comm},
      {"parallel.scaling",
       "a ddp cell with one process at the same per-rank batch to compare (warn under 50% scaling efficiency)",
       "scaling efficiency, step time against one process (%)", S::cell, "parallel", ddp_scaling},
      {"parallel.across-nodes", "an hsdp cell on 2 nodes or more with a zero3 or ddp sibling that finished",
       "per strategy: step time p50, communication and exposed communication per level", S::cell, "", across_nodes},
      {"parallel.busbw-vs-link",
       "an NCCL cell within one node on a GPU whose link core/devices.hpp knows (warn under 50% of the link)",
       "busbw of the largest all-reduce and its size; the link's per-direction GB/s (core/devices.hpp); the GPU",
       S::cell, "", busbw_vs_link},
      {"rng.<stream>", "an RNG stream check says violated", "the stream's check: its class, first violating step, ranks",
       S::cell, "", rng_streams},
      {"precision.no-bf16", "a bf16 cell was skipped for the GPU's compute capability; said once",
       "the skip reason", S::report, "", no_bf16},
  };
}

// The hardware suite, the self-supervised suite, the pitfalls.
std::vector<Rule> hardware_ssl_and_pitfall_rules() {
  using S = RuleScope;
  return {
      {"hardware.gemm.<dtype>",
       "the hardware suite measured a GEMM dtype (warn more than 10 points under mamf-finder's published fraction for the "
       "device, core/devices.hpp)",
       "achievable FLOP/s, fraction of the datasheet and its FLOP/s, the published fraction, the threshold", S::cell,
       "hardware", gemm_vs_datasheet},
      {"hardware.attention.<dtype>", "the hardware suite measured fused attention (SDPA) in a dtype",
       "forward and backward FLOP/s at the largest shape measured, the shape", S::cell, "hardware", attention_rate},
      {"hardware.collectives.levels", "the all-reduce's bus bandwidth was measured both within a node and across nodes",
       "busbw within and across nodes at each level's largest size, their ratio", S::cell, "hardware", collective_levels},
      {"hardware.memory", "the device memory's copy bandwidth was measured (warn under 80% of the datasheet)",
       "bandwidth (GB/s), fraction of the datasheet, the threshold", S::cell, "hardware", memory_bandwidth},
      {"hardware.throttling", "throughput fell by more than 5% from the first to the last window of a sustained run",
       "the drop, the threshold, the windows", S::cell, "hardware", throttling},
      {"ssl-label-efficiency", "an SSL cell has label-efficiency rows (pre-training against scratch at equal compute)",
       "per label fraction: SSL and scratch accuracy, the mean delta with its 95% interval, the verdict, pre-training "
       "and fine-tune time",
       S::report, "", ssl_label_efficiency},
      {"ssl-below-floor", "an SSL encoder's linear probe does not beat its floor (raw pixels or a random encoder)",
       "linear accuracy, the floor and its accuracy, the margin, both floors", S::report, "", ssl_below_floor},
      {"ssl-collapse", "an SSL cell's health check says collapsed",
       "the collapse step, the reason, the std reference, the loss at the collapse, the health sample there", S::report,
       "", ssl_collapse},
      {"ssl-data-size", "two SSL cells or more differ only in their unlabeled set's size",
       "linear (and fine-tuned) accuracy per unlabeled set size", S::report, "", ssl_data_size},
      {"pitfall.<kind>", "the suite shows a pitfall (warn when the run did not reproduce it)",
       "the pitfall's id, whether it was reproduced, its wrong and fix cells", S::report, "", pitfalls},
  };
}

}  // namespace

const std::vector<Rule>& recommendation_rules() {
  static const std::vector<Rule> rules = [] {
    std::vector<Rule> all;
    for (auto part : {run_and_precision_rules, memory_and_parallel_rules, hardware_ssl_and_pitfall_rules})
      for (auto& rule : part()) all.push_back(std::move(rule));
    return all;
  }();
  return rules;
}

json recommend(const json& report) {
  json out = json::array();
  const std::vector<Rule>& rules = recommendation_rules();
  for (size_t i = 0; i < rules.size();) {
    size_t end = i + 1;  // [i, end): one pass
    while (end < rules.size() && !rules[i].pass.empty() && rules[end].pass == rules[i].pass) ++end;
    json groups;
    for (const json* subject : subjects(report, rules[i].scope, groups))
      for (size_t k = i; k < end; ++k) rules[k].apply(report, *subject, out);
    i = end;
  }
  return out;
}

}  // namespace trainscope::reports
