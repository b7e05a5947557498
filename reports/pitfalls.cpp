// The pitfalls section: each [[pitfalls]] entry of the suite (suites/suite_file.hpp) names the cells
// that make a classic mistake on purpose, the cells that fix it and the cells that measure the fix's
// cost; this reads what their probes measured and writes, per pitfall, what was done wrong, what the
// probes saw, the fix and its measured cost, and whether the run reproduced the mistake at all.
#include <algorithm>
#include <cmath>
#include <map>

#include "core/units.hpp"
#include "reports/report.hpp"

namespace trainscope::reports {
namespace {

// A pointer into the report itself (never into a copy: the callers keep it).
const json* find_cell(const json& report, const std::string& name) {
  if (!report.contains("cells") || !report["cells"].is_array()) return nullptr;
  for (const auto& c : report["cells"])
    if (c.value("name", "") == name) return &c;
  return nullptr;
}

// An object, or an empty one for a null or missing part (so that .value() never throws).
json object_of(const json& j) { return j.is_object() ? j : json::object(); }

double number(const json& j, double fallback = std::nan("")) { return j.is_number() ? j.get<double>() : fallback; }
double p50(const json& c) { return number(value_at(c, {"metrics", "timing", "step_time_s", "p50"})); }
std::string status_of(const json* c) { return c ? c->value("status", "?") : std::string("missing"); }

std::string pct_of(double x, int decimals = 1) { return format_fixed(100.0 * x, decimals) + "%"; }
std::string ratio_text(double a, double b) {
  return std::isfinite(a) && std::isfinite(b) && b > 0 ? format_fixed(a / b, 2) + "x" : std::string("-");
}

// The cells a pitfall names, in order, with a line for each one that is not in the report.
std::vector<const json*> cells_of(const json& report, const json& names, json& missing) {
  std::vector<const json*> out;
  for (const auto& n : names) {
    const json* c = find_cell(report, n.get<std::string>());
    if (!c) missing.push_back(n);
    else out.push_back(c);
  }
  return out;
}

json entry(const json& c, const std::string& summary) {
  return json{{"cell", c["name"]}, {"status", c.value("status", "?")}, {"summary", summary}};
}

// ---- 1. fp16 out of range --------------------------------------------------------------------
// The blocks whose activations or gradients left fp16's range on sampled steps, the worse fraction first.
std::string blocks_beyond_fp16(const json& c) {
  std::vector<std::pair<double, std::string>> blocks;
  for (const auto& l : value_at(c, {"metrics", "overflow", "layers"}).is_array() ? c["metrics"]["overflow"]["layers"] : json::array()) {
    const double a = number(value_at(l, {"activation", "frac_beyond_fp16"}), 0);
    const double g = number(value_at(l, {"gradient", "frac_beyond_fp16"}), 0);
    if (std::max(a, g) > 0) blocks.emplace_back(std::max(a, g), l.value("block", "?"));
  }
  std::stable_sort(blocks.begin(), blocks.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  std::string out;
  for (const auto& [f, b] : blocks) out += (out.empty() ? "" : ", ") + b + " (" + pct_of(f, 0) + ")";
  return out;
}

void fp16_range(const json& report, const json& p, json& s) {
  json missing = json::array();
  const auto wrong = cells_of(report, p["wrong"], missing), fix = cells_of(report, p["fix"], missing);
  s["missing"] = missing;
  bool broke = false, fixed = !fix.empty();
  const json* fp32 = nullptr;
  double fp16_time = std::nan("");
  for (const json* w : wrong) {
    const json ov = object_of(value_at(*w, {"metrics", "overflow"}));
    const json n = object_of(w->value("numerics", json()));
    const std::string precision = value_at(*w, {"config", "precision"}).is_string() ? (*w)["config"]["precision"].get<std::string>() : "?";
    std::string text = precision + ": ";
    const bool nonfinite = w->value("status", "") == "diverged" || number(ov.value("nonfinite_loss_steps", json()), 0) > 0;
    const bool off = n.value("verdict", "") != "matches" && n.contains("verdict");
    if (nonfinite) {
      text += "the loss went non-finite";
      if (ov.value("first_nonfinite_loss_step", json()).is_number())
        text += " at step " + std::to_string(ov["first_nonfinite_loss_step"].get<int64_t>());
    } else if (number(ov.value("skipped_steps", json()), 0) > 0) {
      text += "the loss scaler skipped " + std::to_string(ov["skipped_steps"].get<int64_t>()) + " steps";
      const json& traj = ov.value("scale_trajectory", json());
      if (traj.is_object() && traj.value("final", json()).is_number())
        text += " (the scale ended at 2^" + format_fixed(std::log2(traj["final"].get<double>()), 0) + ")";
    } else {
      text += "trained without a non-finite loss";
    }
    if (n.value("final_loss_rel_diff", json()).is_number())
      text += "; final loss " + pct_of(n["final_loss_rel_diff"].get<double>()) + " from fp32 (" + n.value("verdict", "?") + ")";
    const std::string blocks = blocks_beyond_fp16(*w);
    if (!blocks.empty()) s["saw"].push_back(w->value("name", "?") + ": values beyond fp16's 65504 in " + blocks);
    if (ov.value("first_overflow_step", json()).is_number())
      s["saw"].push_back(w->value("name", "?") + ": first overflow at step " + std::to_string(ov["first_overflow_step"].get<int64_t>()) +
                         ", " + std::to_string(ov.value("nonfinite_grad_steps", int64_t{0})) + " steps with non-finite gradients");
    broke = broke || nonfinite || off;
    s["wrong"].push_back(entry(*w, text));
    if (!fp32) fp32 = fp32_sibling(report, *w);
    if (!std::isfinite(fp16_time)) fp16_time = p50(*w);
  }
  for (const json* f : fix) {
    const json n = object_of(f->value("numerics", json()));
    const bool matches = n.value("verdict", "") == "matches";
    fixed = fixed && matches;
    std::string text = value_at(*f, {"config", "precision"}).is_string() ? (*f)["config"]["precision"].get<std::string>() : "?";
    text += n.value("final_loss_rel_diff", json()).is_number()
                ? ": final loss " + pct_of(n["final_loss_rel_diff"].get<double>()) + " from fp32 (" + n.value("verdict", "?") + ")"
                : ": " + f->value("status", "?") + " (no fp32 sibling to compare with)";
    s["fix"].push_back(entry(*f, text));
    if (!fp32) fp32 = fp32_sibling(report, *f);
    s["cost"].push_back(f->value("name", "?") + ": step " + format_seconds(p50(*f)) + ", " +
                        ratio_text(p50(*f), fp32 ? p50(*fp32) : std::nan("")) + " of fp32's" +
                        (std::isfinite(fp16_time) ? ", " + ratio_text(p50(*f), fp16_time) + " of the fp16 cell's" : std::string()));
  }
  // bf16 where the hardware has it: otherwise it is emulated (its cost above is the emulation's) and
  // fp16 with the scaler remains the choice.
  bool native_bf16 = true;
  std::string device = fix.empty() ? "cpu" : fix.front()->value("device", "cpu");
  const json& env = report.value("env", json::object());
  if (device == "cpu") {
    const json flags = value_at(env, {"cpu", "flags"});
    native_bf16 = flags.is_object() && (flags.value("avx512_bf16", false) || flags.value("amx_bf16", false));
  } else {
    for (const auto& g : env.value("gpus", json::array())) native_bf16 = native_bf16 && g.value("bf16", false);
  }
  s["native_bf16"] = native_bf16;
  s["reproduced"] = broke && fixed && missing.empty();
  if (!native_bf16)
    s["verdict"] = "this " + device + " has no native bf16: bf16-mixed " + std::string(fixed ? "matches fp32 but runs emulated" : "runs emulated") +
                   " here; keep 16-mixed with the loss scaler on this hardware, and remove what overflows (the loss or learning rate)";
  else if (fixed)
    s["verdict"] = "fp16 left its range (65504); bf16-mixed, with fp32's range, matches fp32: use bf16-mixed";
  else
    s["verdict"] = "bf16-mixed did not match fp32 here either: the run overflows beyond precision (look at the loss and learning rate)";
}

// ---- 2. RNG not coordinated across ranks -----------------------------------------------------
void rng(const json& report, const json& p, json& s) {
  json missing = json::array();
  const auto wrong = cells_of(report, p["wrong"], missing), fix = cells_of(report, p["fix"], missing);
  s["missing"] = missing;
  const json* clean = fix.empty() ? nullptr : fix.front();
  const double clean_loss = clean ? number(value_at(*clean, {"metrics", "quality", "final_loss"})) : std::nan("");
  const double clean_acc = clean ? number(value_at(*clean, {"metrics", "quality", "accuracy"})) : std::nan("");
  bool caught = !wrong.empty();
  for (const json* w : wrong) {
    const json r = object_of(value_at(*w, {"metrics", "rng"}));
    std::string violated;
    for (const auto& st : r.value("streams", json::array()))
      if (st.value("verdict", "") == "violated")
        violated += (violated.empty() ? "" : "; ") + st.value("name", "?") + " (" + st.value("class", "?") + ", from step " +
                    std::to_string(st.value("first_violation_step", int64_t{0})) + ")";
    caught = caught && !violated.empty();
    const std::string inject = value_at(*w, {"config", "inject"}).is_string() ? (*w)["config"]["inject"].get<std::string>() : "?";
    s["wrong"].push_back(entry(*w, "inject = " + inject));
    s["saw"].push_back(w->value("name", "?") + ": " + (violated.empty() ? std::string("no stream violated") : "violated " + violated));
    // The consequence, not only the fingerprint.
    const json& spread = r.value("parameter_spread", json());
    std::string consequence;
    if (spread.is_object() && number(spread["max"], 0) > 0)
      consequence = "the ranks' parameters differ by up to " + format_fixed(spread["max"].get<double>(), 6) +
                    " (largest |difference| of one value), still " + format_fixed(number(spread["final"], 0), 6) +
                    " at the last sampled step: the ranks train different models";
    const double loss = number(value_at(*w, {"metrics", "quality", "final_loss"}));
    const double acc = number(value_at(*w, {"metrics", "quality", "accuracy"}));
    if (std::isfinite(loss) && std::isfinite(clean_loss)) {
      consequence += std::string(consequence.empty() ? "" : "; ") + "final loss " + format_fixed(loss, 4) + " against the clean run's " +
                     format_fixed(clean_loss, 4) + " (" + format_signed_pct(100.0 * (loss / clean_loss - 1), 1) + ")";
      if (std::isfinite(acc) && std::isfinite(clean_acc))
        consequence += ", test accuracy " + format_fixed(acc, 4) + " against " + format_fixed(clean_acc, 4);
    }
    if (inject == "same-data-seed") {
      const int64_t world = value_at(*w, {"config", "world_size"}).is_number() ? (*w)["config"]["world_size"].get<int64_t>() : 1;
      const int64_t batch = value_at(*w, {"config", "batch_size"}).is_number() ? (*w)["config"]["batch_size"].get<int64_t>() : 0;
      consequence += std::string(consequence.empty() ? "" : "; ") + "every rank drew the same samples: each global batch of " +
                     std::to_string(batch * world) + " held " + std::to_string(batch) + " distinct samples";
    }
    if (!consequence.empty()) s["saw"].push_back(w->value("name", "?") + ": " + consequence);
  }
  bool clean_ok = clean != nullptr;
  for (const json* f : fix) {
    const json r = object_of(value_at(*f, {"metrics", "rng"}));
    const double spread = number(value_at(r, {"parameter_spread", "max"}), 0);
    clean_ok = clean_ok && r.value("violations", int64_t{1}) == 0 && spread == 0;
    s["fix"].push_back(entry(*f, std::to_string(r.value("violations", int64_t{-1})) + " violations; parameters " +
                                     (spread == 0 ? std::string("identical on every rank") : "apart by " + format_fixed(spread, 6))));
    for (const json* w : wrong)
      s["cost"].push_back(f->value("name", "?") + ": step " + format_seconds(p50(*f)) + " against " + format_seconds(p50(*w)) +
                          " with " + w->value("name", "?") + " (" + ratio_text(p50(*f), p50(*w)) + "): coordinating the RNG costs one broadcast at set-up");
  }
  s["reproduced"] = caught && clean_ok && missing.empty();
  s["verdict"] = caught ? "the RNG probe caught every injected fault and measured its consequence; seed every rank's replicated "
                          "generators alike, broadcast rank 0's weights, and shard the data by rank"
                        : "the RNG probe did not catch every injected fault";
}

// ---- 3. sharding without checkpointing runs out of memory -----------------------------------
void memory(const json& report, const json& p, json& s) {
  json missing = json::array();
  const auto wrong = cells_of(report, p["wrong"], missing), fix = cells_of(report, p["fix"], missing);
  const auto ref = cells_of(report, p["reference"], missing);
  s["missing"] = missing;
  auto policy = [](const json& c) { return value_at(c, {"config", "checkpoint"}).is_string() ? c["config"]["checkpoint"].get<std::string>() : "?"; };
  auto peak = [](const json& c) {  // the largest rank's peak
    double best = number(value_at(c, {"metrics", "memory", "peak_bytes"}), 0);
    for (const auto& r : c.value("ranks", json::array())) best = std::max(best, number(r.value("peak_bytes", json()), 0));
    return best;
  };
  bool oom = !wrong.empty();
  std::string budget = "?";
  for (const json* w : wrong) {
    oom = oom && w->value("status", "") == "oom";
    if (value_at(*w, {"config", "memory_budget"}).is_string()) budget = (*w)["config"]["memory_budget"];
    s["wrong"].push_back(entry(*w, value_at(*w, {"config", "parallel"}).get<std::string>() + " + " + policy(*w) + " at batch " +
                                       std::to_string(value_at(*w, {"config", "batch_size"}).get<int64_t>()) + " under " + budget +
                                       " per rank: " + w->value("status", "?")));
    if (w->value("status", "") == "oom") s["saw"].push_back(w->value("name", "?") + ": " + w->value("reason", "out of memory"));
  }
  // Recompute cost per policy: its step time against `none` at a batch both fit (the reference cells).
  std::map<std::string, double> ref_time;
  for (const json* r : ref) ref_time[policy(*r)] = p50(*r);
  const double none_time = ref_time.count("none") ? ref_time["none"] : std::nan("");
  const json* cheapest = nullptr;
  for (const json* f : fix) {
    const bool ok = f->value("status", "") == "ok";
    const double over = ref_time.count(policy(*f)) ? ref_time[policy(*f)] / none_time - 1 : std::nan("");
    std::string text = policy(*f) + ": " + f->value("status", "?");
    if (ok) text += ", peak " + format_bytes(peak(*f)) + " on the largest rank, step " + format_seconds(p50(*f));
    if (std::isfinite(over)) text += "; recompute cost " + format_signed_pct(100 * over, 0) + " against none at a batch both fit";
    s["fix"].push_back(entry(*f, text));
    if (ok && (!cheapest || p50(*f) < p50(*cheapest))) cheapest = f;
  }
  // The frontier of the same model and strategy: the largest batch per policy, across the ranks.
  if (!wrong.empty() && report.contains("frontier") && report["frontier"].is_array()) {
    const json& w = *wrong.front();
    for (const auto& f : report["frontier"])
      if (f.value("model", "") == value_at(w, {"config", "model"}) && f.value("parallel", "") == value_at(w, {"config", "parallel"}) &&
          f.value("world_size", 1) == value_at(w, {"config", "world_size"}))
        s["saw"].push_back("frontier " + frontier_label(f) + ": largest batch " + std::to_string(f.value("largest_batch", 0)) +
                           " under " + f.value("budget", "?") +
                           (f.value("peak_bytes", json()).is_number()
                                ? " (peak " + format_bytes(f["peak_bytes"].get<double>()) + " on rank " +
                                      std::to_string(f.value("peak_rank", 0)) + ")"
                                : std::string()));
  }
  s["reproduced"] = oom && cheapest != nullptr && missing.empty();
  if (cheapest) {
    const double over = ref_time.count(policy(*cheapest)) ? ref_time[policy(*cheapest)] / none_time - 1 : std::nan("");
    s["verdict"] = "the cheapest policy that fits is " + policy(*cheapest) + " (step " + format_seconds(p50(*cheapest)) +
                   (std::isfinite(over) ? ", recompute cost " + format_signed_pct(100 * over, 0) : std::string()) +
                   "): checkpoint with it rather than cut the batch";
    s["cost"].push_back(cheapest->value("name", "?") + ": peak " + format_bytes(peak(*cheapest)) + ", step " +
                        format_seconds(p50(*cheapest)) +
                        (std::isfinite(over) ? ", " + format_signed_pct(100 * over, 0) + " step time for the recomputation" : std::string()));
  } else {
    s["verdict"] = "no checkpoint policy fitted the budget at this batch";
  }
}

// ---- 4. SSL on little data against a pretrained encoder -------------------------------------
void ssl_data(const json& report, const json& p, json& s) {
  json missing = json::array();
  const auto wrong = cells_of(report, p["wrong"], missing), fix = cells_of(report, p["fix"], missing);
  const auto ref = cells_of(report, p["reference"], missing);
  s["missing"] = missing;
  const json ssl = report.contains("ssl") ? report["ssl"] : ssl_summary(report);
  auto row_of = [&](const json& c) -> json {
    for (const auto& r : ssl.is_object() ? ssl.value("rows", json::array()) : json::array())
      if (r.value("cell", "") == c.value("name", "")) return r;
    return json();
  };
  // Mean accuracy per label fraction and the compute charged for it (the pretrained path is charged
  // the pre-training of the encoder it loaded).
  auto by_fraction = [&](const json& c) {
    std::map<double, json> out;
    for (const auto& e : ssl.is_object() ? ssl.value("label_efficiency", json::array()) : json::array())
      if (e.value("cell", "") == c.value("name", "")) out[e.value("fraction", 0.0)] = e;
    return out;
  };
  auto describe = [&](const json& c) {
    const json r = row_of(c);
    const std::string method = value_at(c, {"config", "method"}).get<std::string>();
    const int64_t unlabeled = value_at(c, {"config", "unlabeled_size"}).is_number() && c["config"]["unlabeled_size"].get<int64_t>() > 0
                                  ? c["config"]["unlabeled_size"].get<int64_t>()
                                  : int64_t{60000};
    const json pretrained = value_at(c, {"config", "pretrained"});
    std::string text = method == "supervised" ? std::string("supervised, with labels")
                       : pretrained.is_string() && !pretrained.get<std::string>().empty()
                           ? "the " + method + " encoder loaded from " + pretrained.get<std::string>()
                           : method + " for " + std::to_string(value_at(c, {"config", "steps"}).get<int64_t>()) + " steps on " +
                                 std::to_string(unlabeled) + " unlabeled images";
    if (r.is_object() && r["linear"].is_number()) {
      text += ": linear probe " + (r["linear"].is_number() ? format_fixed(r["linear"].get<double>(), 3) : std::string("-")) + ", kNN " +
              (r["knn"].is_number() ? format_fixed(r["knn"].get<double>(), 3) : std::string("-"));
    }
    for (const auto& [frac, e] : by_fraction(c))
      if (e["ssl_accuracy_mean"].is_number())
        text += "; " + pct_of(frac, 0) + " labels: " + format_fixed(e["ssl_accuracy_mean"].get<double>(), 3) +
                " (scratch " + (e["scratch_accuracy_mean"].is_number() ? format_fixed(e["scratch_accuracy_mean"].get<double>(), 3) : std::string("-")) +
                ", charged " + (e["ssl_cost_s_mean"].is_number() ? format_seconds(e["ssl_cost_s_mean"].get<double>()) : std::string("-")) + ")";
    return text;
  };
  for (const json* w : wrong) s["wrong"].push_back(entry(*w, describe(*w)));
  for (const json* f : fix) s["fix"].push_back(entry(*f, describe(*f)));
  for (const json* r : ref) s["saw"].push_back(r->value("name", "?") + ": " + describe(*r));
  // Reproduced when the pretrained encoder beats the small-set pre-training at every shared fraction.
  bool better = !wrong.empty() && !fix.empty();
  int compared = 0;
  if (better) {
    const auto a = by_fraction(*wrong.front()), b = by_fraction(*fix.front());
    for (const auto& [frac, e] : a) {
      if (!b.count(frac) || !e["ssl_accuracy_mean"].is_number() || !b.at(frac)["ssl_accuracy_mean"].is_number()) continue;
      ++compared;
      const double d = b.at(frac)["ssl_accuracy_mean"].get<double>() - e["ssl_accuracy_mean"].get<double>();
      better = better && d > 0;
      s["saw"].push_back("at " + pct_of(frac, 0) + " labels the pretrained encoder scores " + (d >= 0 ? "+" : "") +
                         format_fixed(100 * d, 1) + " points against pre-training on the small set");
    }
  }
  for (const json* w : wrong) {
    const double cost = number(value_at(*w, {"metrics", "ssl", "pretrain", "wall_s"}));
    if (std::isfinite(cost)) s["cost"].push_back(w->value("name", "?") + ": " + format_seconds(cost) + " of pre-training on the small set");
  }
  for (const json* r : ref) {
    const double cost = number(value_at(*r, {"metrics", "ssl", "pretrain", "wall_s"}));
    if (std::isfinite(cost) && value_at(*r, {"config", "method"}) != "supervised")
      s["cost"].push_back(r->value("name", "?") + ": " + format_seconds(cost) + " of pre-training on the large set, paid once for every reuse");
  }
  for (const json* f : fix) {
    const double cost = number(value_at(*f, {"metrics", "ssl", "pretrain", "wall_s"}));
    if (std::isfinite(cost)) s["cost"].push_back(f->value("name", "?") + ": " + format_seconds(cost) + " to load it");
  }
  s["reproduced"] = better && compared > 0 && missing.empty();
  s["verdict"] = compared == 0 ? "no label fraction was measured for both paths"
                 : better     ? "an encoder pre-trained on more data does better than pre-training on the small set at every label "
                                "fraction measured: reuse it rather than pre-train on little data"
                              : "the pretrained encoder did not beat pre-training on the small set at every label fraction: at this "
                                "budget the small set is not what limits the encoder";
}

}  // namespace

json expected_statuses(const json& report, const std::string& cell) {
  const json expect = value_at(report, {"suite", "expect"});
  if (expect.is_object() && expect.contains(cell)) return expect[cell];
  const json list = value_at(report, {"suite", "pitfalls"});
  if (list.is_array())
    for (const auto& p : list)
      for (const auto& n : p.value("wrong", json::array()))
        if (n == cell) return json{"ok", "diverged", "oom"};
  return nullptr;
}

bool shown_as_expected(const json& report, const json& cell) {
  const std::string status = cell.value("status", "");
  if (status == "ok" || status == "skipped") return false;
  const json e = expected_statuses(report, cell.value("name", ""));
  return e.is_array() && std::find(e.begin(), e.end(), json(status)) != e.end();
}

bool expectation_missed(const json& report, const json& cell) {
  if (cell.value("status", "") != "ok") return false;
  const json e = expected_statuses(report, cell.value("name", ""));
  return e.is_array() && std::find(e.begin(), e.end(), json("ok")) == e.end();
}

json pitfalls_summary(const json& report) {
  const json& list = value_at(report, {"suite", "pitfalls"});
  if (!list.is_array() || list.empty()) return nullptr;
  json out = json::array();
  for (const auto& p : list) {
    json s{{"id", p["id"]},   {"kind", p["kind"]}, {"title", p["title"]}, {"wrong", json::array()}, {"saw", json::array()},
           {"fix", json::array()}, {"cost", json::array()}, {"reproduced", nullptr}, {"verdict", ""}};
    const std::string kind = p["kind"];
    if (kind == "fp16-range") fp16_range(report, p, s);
    else if (kind == "rng") rng(report, p, s);
    else if (kind == "memory") memory(report, p, s);
    else if (kind == "ssl-data") ssl_data(report, p, s);
    // A cell that did not run (skipped, failed) leaves the pitfall unreproduced, and says which.
    for (const char* part : {"wrong", "fix"})
      for (const auto& n : p[part]) {
        const json* c = find_cell(report, n.get<std::string>());
        const std::string st = status_of(c);
        if (st == "skipped" || st == "missing" || st == "failed" || st == "timeout")
          s["saw"].push_back(n.get<std::string>() + ": " + st + (c && c->contains("reason") ? ": " + (*c)["reason"].get<std::string>() : ""));
      }
    out.push_back(s);
  }
  return out;
}

}  // namespace trainscope::reports
