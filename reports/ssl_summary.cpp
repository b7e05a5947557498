// The self-supervised suite's summary: each encoder beside its floors and its supervised sibling,
// pre-training against training from scratch at equal compute and equal labels, and the data-size axis.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "core/errors.hpp"
#include "reports/report.hpp"

namespace trainscope::reports {

double student_t975(int64_t df) {
  // The two-sided 95% Student t quantile (t at 0.975) for 1..10 degrees of freedom; beyond, the
  // Cornish-Fisher expansion around the normal quantile (error under 1e-4 there).
  static const double table[] = {12.7062047361747, 4.30265272974946, 3.18244630528371, 2.77644510519779,
                                 2.57058183563631, 2.44691185114497, 2.36462425159278, 2.30600413520417,
                                 2.2621571627982,  2.22813885198627};
  if (df < 1) return std::numeric_limits<double>::quiet_NaN();
  if (df <= 10) return table[df - 1];
  const double z = 1.959963984540054, n = static_cast<double>(df);
  const double z3 = z * z * z, z5 = z3 * z * z, z7 = z5 * z * z;
  return z + (z3 + z) / (4 * n) + (5 * z5 + 16 * z3 + 3 * z) / (96 * n * n) +
         (3 * z7 + 19 * z5 + 17 * z3 - 15 * z) / (384 * n * n * n);
}

bool is_ssl_method(const std::string& method) {
  return method == "simclr" || method == "byol" || method == "dino" || method == "mae";
}

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Lookups that never insert and never throw on a missing key or a null.
const json& member(const json& j, const char* key) {
  static const json null_value;
  if (!j.is_object()) return null_value;
  const auto it = j.find(key);
  return it == j.end() ? null_value : *it;
}
const json& list(const json& j, const char* key) {
  static const json empty = json::array();
  const json& v = member(j, key);
  return v.is_array() ? v : empty;
}
std::string text(const json& j, const char* key, const std::string& fallback) {
  const json& v = member(j, key);
  return v.is_string() ? v.get<std::string>() : fallback;
}
double num(const json& v) { return v.is_number() ? v.get<double>() : kNaN; }
double num_at(const json& arr, size_t i) { return i < arr.size() ? num(arr[i]) : kNaN; }
json or_null(double x) { return std::isfinite(x) ? json(x) : json(nullptr); }

double mean_finite(const json& values) {
  double sum = 0;
  int n = 0;
  for (const auto& v : values.is_array() ? values : json::array())
    if (v.is_number() && std::isfinite(v.get<double>())) sum += v.get<double>(), ++n;
  return n ? sum / n : kNaN;
}

const json& ssl_of(const json& cell) { return member(member(cell, "metrics"), "ssl"); }

const json* fraction_row(const json& ssl, double fraction) {
  for (const auto& r : list(ssl, "label_efficiency"))
    if (std::fabs(num(member(r, "fraction")) - fraction) < 1e-9) return &r;
  return nullptr;
}

bool at_default(const std::string& key, const json& value) {
  try {
    return key_spec(key).default_value == value;
  } catch (const UsageError&) {
    return false;
  }
}

// The supervised cell an SSL cell is held against: the exact sibling when the suite has it, else the
// supervised cell on the same encoder whose configuration is nearest (a key of its at the default,
// as SSL-only keys are in a supervised cell, counts little).
const json* supervised_sibling(const json& report, const json& cell) {
  if (const json* s = sibling(report, cell, json{{"method", "supervised"}})) return s;
  const json& cfg = member(cell, "config");
  const json* best = nullptr;
  double best_score = INFINITY;
  for (const auto& c : list(report, "cells")) {
    const json& k = member(c, "config");
    if (&c == &cell || text(k, "method", "") != "supervised" || text(k, "model", "") != text(cfg, "model", "?")) continue;
    double score = ssl_of(c).is_object() ? 0 : 1e6;
    std::set<std::string> keys;
    for (auto it = cfg.begin(); it != cfg.end(); ++it) keys.insert(it.key());
    for (auto it = k.begin(); it != k.end(); ++it) keys.insert(it.key());
    for (const auto& key : keys)
      if (key != "method" && member(cfg, key.c_str()) != member(k, key.c_str()))
        score += at_default(key, member(k, key.c_str())) ? 1 : 100;
    if (score < best_score) best = &c, best_score = score;
  }
  return best;
}

json summary_row(const json& report, const json& c) {
  const json& s = ssl_of(c);
  const json& cfg = member(c, "config");
  const std::string method = text(s, "method", text(cfg, "method", "?"));
  const bool ssl = is_ssl_method(method);
  const json* sib = ssl ? supervised_sibling(report, c) : nullptr;
  const double linear = number_at(s, {"frozen", "encoder", "linear"});
  const double random_linear = number_at(s, {"frozen", "random_encoder", "linear"});
  const double raw_linear = number_at(s, {"frozen", "raw_pixels", "linear"});
  // The higher floor is the one to beat; a missing floor leaves the other.
  double floor = kNaN;
  std::string floor_name;
  if (std::isfinite(raw_linear)) floor = raw_linear, floor_name = "raw-pixel";
  if (std::isfinite(random_linear) && !(random_linear <= floor)) floor = random_linear, floor_name = "random-encoder";
  const json* full = fraction_row(s, 1.0);
  double step_cost = kNaN;
  if (sib) {
    const double t = number_at(s, {"pretrain", "step_time_s"});
    double t0 = number_at(ssl_of(*sib), {"pretrain", "step_time_s"});
    // A sibling without metrics.ssl (its evaluation off): the same number from its timing.
    if (!std::isfinite(t0)) t0 = number_at(*sib, {"metrics", "timing", "step_time_s", "p50"});
    const json& b = member(cfg, "batch_size");
    if (t > 0 && t0 > 0 && b.is_number() && b == member(member(*sib, "config"), "batch_size")) step_cost = t / t0;
  }
  const json& health = member(member(c, "metrics"), "ssl_health");
  // A supervised cell is its own reference.
  const double supervised_accuracy = !ssl ? number_at(c, {"metrics", "quality", "accuracy"})
                                     : sib  ? number_at(*sib, {"metrics", "quality", "accuracy"})
                                            : kNaN;
  return json{{"cell", c["name"]},
              {"status", member(c, "status")},
              {"method", method},
              {"encoder", text(s, "encoder", text(cfg, "model", "?"))},
              {"unlabeled_size", member(s, "unlabeled_size")},
              {"pretrained", text(cfg, "pretrained", "").empty() ? json(nullptr) : json(cfg["pretrained"])},
              {"knn", or_null(number_at(s, {"frozen", "encoder", "knn"}))},
              {"linear", or_null(linear)},
              {"finetune_full", or_null(full ? mean_finite(member(*full, "finetune")) : kNaN)},
              {"random_encoder_knn", or_null(number_at(s, {"frozen", "random_encoder", "knn"}))},
              {"random_encoder_linear", or_null(random_linear)},
              {"raw_pixels_knn", or_null(number_at(s, {"frozen", "raw_pixels", "knn"}))},
              {"raw_pixels_linear", or_null(raw_linear)},
              {"floor", floor_name.empty() ? json(nullptr) : json(floor_name)},
              {"floor_linear", or_null(floor)},
              {"beats_floors", std::isfinite(linear) && std::isfinite(floor) ? json(linear > floor) : json(nullptr)},
              {"supervised_cell", sib ? (*sib)["name"] : json(nullptr)},
              {"supervised_accuracy", or_null(supervised_accuracy)},
              {"pretrain_wall_s", or_null(number_at(s, {"pretrain", "wall_s"}))},
              {"images_per_s", or_null(number_at(s, {"pretrain", "images_per_s"}))},
              {"step_cost_vs_supervised", or_null(step_cost)},
              {"health", health.is_object() ? member(health, "verdict") : json(nullptr)},
              {"collapse_step", health.is_object() ? member(health, "collapse_step") : json(nullptr)}};
}

// The scratch arm per fraction: each seed's best accuracy over its whole curve, averaged over seeds.
struct ArmPoint {
  double fraction, labels, accuracy;
};
std::vector<ArmPoint> scratch_arm(const json& sibling_ssl) {
  std::vector<ArmPoint> arm;
  for (const auto& r : list(sibling_ssl, "label_efficiency")) {
    double sum = 0;
    int n = 0;
    for (const auto& curve : list(r, "scratch_curve")) {
      double best = kNaN;
      for (const auto& p : curve.is_array() ? curve : json::array())
        if (std::isfinite(num(member(p, "accuracy"))) && !(num(p["accuracy"]) <= best)) best = num(p["accuracy"]);
      if (std::isfinite(best)) sum += best, ++n;
    }
    if (n && std::isfinite(num(member(r, "fraction")))) arm.push_back({num(r["fraction"]), num(member(r, "labels")), sum / n});
  }
  std::sort(arm.begin(), arm.end(), [](const ArmPoint& a, const ArmPoint& b) { return a.fraction < b.fraction; });
  return arm;
}

std::string percent(double fraction, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*g%%", digits, 100 * fraction);
  return buf;
}

// Where the scratch arm reaches `target`: linear in log(labels) between the measured fractions.
json label_equivalent(const std::vector<ArmPoint>& arm, double target, double fraction, double labels) {
  if (arm.empty() || !std::isfinite(target)) return nullptr;
  auto out = [&](double f, double l, const std::string& bound, const std::string& text) {
    const bool have_labels = std::isfinite(l) && l > 0 && std::isfinite(labels) && labels > 0;
    return json{{"fraction", or_null(f)},
                {"labels", or_null(l)},
                {"bound", bound},
                {"multiplier", or_null(have_labels ? l / labels : f / fraction)},
                {"text", text}};
  };
  if (arm[0].accuracy >= target)
    return out(arm[0].fraction, arm[0].labels, "at_most", "<= " + percent(arm[0].fraction, 6));
  for (size_t i = 1; i < arm.size(); ++i) {
    const ArmPoint &a = arm[i - 1], &b = arm[i];
    if (b.accuracy < target) continue;
    const double t = (target - a.accuracy) / (b.accuracy - a.accuracy);
    double f, l = kNaN;
    if (a.labels > 0 && b.labels > 0) {
      l = std::exp(std::log(a.labels) + t * (std::log(b.labels) - std::log(a.labels)));
      f = a.fraction * l / a.labels;
    } else {
      f = std::exp(std::log(a.fraction) + t * (std::log(b.fraction) - std::log(a.fraction)));
    }
    return out(f, l, "interpolated", percent(f, 3));
  }
  return json{{"fraction", nullptr}, {"labels", nullptr}, {"bound", "above"}, {"multiplier", nullptr},
              {"text", "> " + percent(arm.back().fraction, 6)}};
}

// The cell that saved the encoder this one started from (config.pretrained = its save_encoder).
const json* upstream_of(const json& report, const json& cell) {
  const std::string from = text(member(cell, "config"), "pretrained", "");
  if (from.empty()) return nullptr;
  for (const auto& c : list(report, "cells"))
    if (&c != &cell && text(member(c, "config"), "save_encoder", "") == from) return &c;
  // The same file named by another path (both are relative to the run's output folder by default).
  auto file = [](const std::string& p) { return p.substr(p.find_last_of('/') == std::string::npos ? 0 : p.find_last_of('/') + 1); };
  for (const auto& c : list(report, "cells")) {
    // The file the cell wrote ({model}/{method} expanded), else the name its configuration gave.
    const json saved_as = value_at(c, {"metrics", "ssl", "saved_encoder"});
    const std::string saved = saved_as.is_string() ? saved_as.get<std::string>() : text(member(c, "config"), "save_encoder", "");
    if (&c != &cell && !saved.empty() && file(saved) == file(from)) return &c;
  }
  return nullptr;
}

// One label subset: the SSL path's accuracy and what it cost (the probe or the fine-tune, whichever
// scored higher; a tie goes to the probe, the cheaper path) against the scratch run on the same subset
// at its best within that compute. `curve`: that scratch run's logged points (null: none).
json seed_entry(const json& seed, double probe, double finetune, double finetune_s, double pretrain, const json* curve) {
  json e{{"seed", seed}};
  if (!std::isfinite(probe) && !std::isfinite(finetune)) {
    e.update(json{{"ssl_accuracy", nullptr}, {"ssl_path", nullptr}, {"ssl_cost_s", nullptr}, {"scratch_accuracy", nullptr},
                  {"scratch_steps", nullptr}, {"scratch_seconds", nullptr}, {"scratch_within_compute", nullptr}, {"delta", nullptr}});
    return e;
  }
  const bool use_probe = !std::isfinite(finetune) || (std::isfinite(probe) && probe >= finetune);
  const double acc = use_probe ? probe : finetune;
  const double cost = use_probe ? pretrain : pretrain + finetune_s;
  const json* best = nullptr;
  bool within = true;
  if (curve && std::isfinite(cost)) {
    for (const auto& pt : *curve)
      if (num(member(pt, "seconds")) <= cost && std::isfinite(num(member(pt, "accuracy"))) &&
          (!best || num(pt["accuracy"]) > num((*best)["accuracy"])))
        best = &pt;
    // Even the scratch run's first logged point cost more: compare with it, and say so.
    if (!best) best = &(*curve)[0], within = false;
  }
  const double scratch = best ? num(member(*best, "accuracy")) : kNaN;
  e.update(json{{"ssl_accuracy", acc},
                {"ssl_path", use_probe ? "probe" : "finetune"},
                {"ssl_cost_s", or_null(cost)},
                {"scratch_accuracy", or_null(scratch)},
                {"scratch_steps", best ? member(*best, "steps") : json(nullptr)},
                {"scratch_seconds", best ? member(*best, "seconds") : json(nullptr)},
                {"scratch_within_compute", best ? json(within) : json(nullptr)},
                {"delta", or_null(acc - scratch)}});
  return e;
}

double mean_of(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? kNaN : sum / v.size();
}

// The deltas' mean with its 95% Student-t interval, and the verdict it gives: pays off (the interval
// above 0), does not (below), inconclusive (across it, or one seed: no interval to judge by).
json delta_interval(const std::vector<double>& deltas) {
  const size_t n = deltas.size();
  const double m = mean_of(deltas);
  double sd = kNaN, t = kNaN, low = kNaN, high = kNaN;
  if (n >= 2) {
    double ss = 0;
    for (double d : deltas) ss += (d - m) * (d - m);
    sd = std::sqrt(ss / (n - 1));
    t = student_t975(static_cast<int64_t>(n) - 1);
    low = m - t * sd / std::sqrt(static_cast<double>(n));
    high = m + t * sd / std::sqrt(static_cast<double>(n));
  }
  json verdict = nullptr;
  if (n >= 2) verdict = low > 0 ? "pays off" : high < 0 ? "does not" : "inconclusive";
  else if (n == 1) verdict = "inconclusive";
  return {{"n", n},
          {"delta_mean", or_null(m)},
          {"delta_sd", or_null(sd)},
          {"t", or_null(t)},
          {"delta_low", or_null(low)},
          {"delta_high", or_null(high)},
          {"verdict", verdict}};
}

json efficiency_rows(const json& report, const json& c) {
  json rows = json::array();
  const json& s = ssl_of(c);
  const json* sib = supervised_sibling(report, c);
  const json& sib_ssl = sib ? ssl_of(*sib) : member(json(), "");
  const std::vector<ArmPoint> arm = scratch_arm(sib_ssl);
  const json& seeds = list(member(s, "protocol"), "label_seeds");
  const json& sib_seeds = list(member(sib_ssl, "protocol"), "label_seeds");
  // Started from another cell's encoder: that pre-training is part of this path's cost.
  const json* up = upstream_of(report, c);
  const double upstream = up ? number_at(ssl_of(*up), {"pretrain", "wall_s"}) : 0.0;
  const double pretrain = number_at(s, {"pretrain", "wall_s"}) + upstream;
  for (const auto& r : list(s, "label_efficiency")) {
    const double fraction = num(member(r, "fraction"));
    const json& probe = list(r, "probe");
    const json& finetune = list(r, "finetune");
    const json& finetune_s = list(r, "finetune_s");
    const json* srow = sib ? fraction_row(sib_ssl, fraction) : nullptr;
    const json& curves = srow ? list(*srow, "scratch_curve") : list(json(), "");
    json per_seed = json::array();
    std::vector<double> deltas, accs, costs, tunes, scratch_accs;
    int flagged = 0;
    for (size_t i = 0; i < std::max(probe.size(), finetune.size()); ++i) {
      const json seed = i < seeds.size() ? seeds[i] : json(i);
      // The scratch run on the same label subset: the seed of the same value, else the same position.
      size_t j = i;
      for (size_t k = 0; k < sib_seeds.size(); ++k)
        if (sib_seeds[k] == seed) j = k;
      const bool has_curve = j < curves.size() && curves[j].is_array() && !curves[j].empty();
      const json e =
          seed_entry(seed, num_at(probe, i), num_at(finetune, i), num_at(finetune_s, i), pretrain, has_curve ? &curves[j] : nullptr);
      per_seed.push_back(e);
      if (e["ssl_accuracy"].is_null()) continue;
      accs.push_back(e["ssl_accuracy"]);
      if (e["ssl_cost_s"].is_number()) costs.push_back(e["ssl_cost_s"]);
      if (e["ssl_path"] == "finetune" && std::isfinite(num_at(finetune_s, i))) tunes.push_back(num_at(finetune_s, i));
      if (e["delta"].is_number()) deltas.push_back(e["delta"]);
      if (e["scratch_accuracy"].is_number()) scratch_accs.push_back(e["scratch_accuracy"]);
      if (e["scratch_within_compute"] == false) ++flagged;
    }
    const double acc_mean = mean_of(accs);
    json row = {{"cell", c["name"]},
                {"method", text(s, "method", "?")},
                {"encoder", text(s, "encoder", "?")},
                {"supervised_cell", sib ? (*sib)["name"] : json(nullptr)},
                {"fraction", member(r, "fraction")},
                {"labels", member(r, "labels")},
                {"seeds", per_seed},
                {"ssl_accuracy_mean", or_null(acc_mean)},
                {"scratch_accuracy_mean", or_null(mean_of(scratch_accs))},
                {"pretrain_wall_s", or_null(pretrain)},
                {"pretrained", text(member(c, "config"), "pretrained", "").empty() ? json(nullptr) : c["config"]["pretrained"]},
                {"pretrained_from", up ? (*up)["name"] : json(nullptr)},
                {"upstream_pretrain_wall_s", up ? or_null(upstream) : json(nullptr)},
                {"finetune_s_mean", or_null(mean_of(tunes))},
                {"ssl_cost_s_mean", or_null(mean_of(costs))},
                {"scratch_outside_compute", flagged},
                {"label_equivalent", label_equivalent(arm, acc_mean, fraction, num(member(r, "labels")))}};
    row.update(delta_interval(deltas));
    rows.push_back(row);
  }
  return rows;
}

// SSL cells that differ only in how much unlabeled data pre-training drew from.
json data_size_groups(const json& report) {
  std::map<std::string, std::vector<const json*>> groups;
  std::vector<std::string> order;
  for (const auto& c : list(report, "cells")) {
    if (!ssl_of(c).is_object() || !is_ssl_method(text(ssl_of(c), "method", "")) || !member(c, "config").is_object()) continue;
    json key = c["config"];
    key.erase("unlabeled_size");
    key.erase("save_encoder");
    if (!groups.count(key.dump())) order.push_back(key.dump());
    groups[key.dump()].push_back(&c);
  }
  json out = json::array();
  for (const auto& key : order) {
    auto& g = groups[key];
    auto size = [](const json* c) {
      const double n = num(member(ssl_of(*c), "unlabeled_size"));
      return std::isfinite(n) ? n : INFINITY;
    };
    std::set<double> sizes;
    for (const json* c : g) sizes.insert(size(c));
    if (sizes.size() < 2) continue;
    std::stable_sort(g.begin(), g.end(), [&](const json* a, const json* b) { return size(a) < size(b); });
    double smallest = INFINITY;
    for (const json* c : g)
      for (const auto& r : list(ssl_of(*c), "label_efficiency"))
        if (std::isfinite(num(member(r, "fraction")))) smallest = std::min(smallest, num(r["fraction"]));
    json rows = json::array();
    for (const json* c : g) {
      const json& s = ssl_of(*c);
      const json* r = std::isfinite(smallest) ? fraction_row(s, smallest) : nullptr;
      rows.push_back({{"cell", (*c)["name"]},
                      {"unlabeled_size", member(s, "unlabeled_size")},
                      {"linear", or_null(number_at(s, {"frozen", "encoder", "linear"}))},
                      {"knn", or_null(number_at(s, {"frozen", "encoder", "knn"}))},
                      {"finetune", or_null(r ? mean_finite(member(*r, "finetune")) : kNaN)},
                      {"pretrain_wall_s", or_null(number_at(s, {"pretrain", "wall_s"}))}});
    }
    out.push_back({{"method", text(ssl_of(*g[0]), "method", "?")},
                   {"encoder", text(ssl_of(*g[0]), "encoder", "?")},
                   {"fraction", or_null(std::isfinite(smallest) ? smallest : kNaN)},
                   {"rows", rows}});
  }
  return out;
}

}  // namespace

json ssl_summary(const json& report) {
  json rows = json::array(), efficiency = json::array();
  for (const auto& c : list(report, "cells")) {
    if (!ssl_of(c).is_object()) continue;
    rows.push_back(summary_row(report, c));
    if (is_ssl_method(text(ssl_of(c), "method", "")))
      for (auto& r : efficiency_rows(report, c)) efficiency.push_back(std::move(r));
  }
  if (rows.empty()) return nullptr;
  return json{{"confidence", 0.95}, {"rows", rows}, {"label_efficiency", efficiency}, {"data_size", data_size_groups(report)}};
}

}  // namespace trainscope::reports
