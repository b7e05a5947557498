#include "reports/report.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <sys/stat.h>

#include "core/build_info.hpp"
#include "core/errors.hpp"
#include "core/precision.hpp"
#include "core/stats.hpp"
#include "core/units.hpp"

namespace trainscope::reports {

double number_at(const json& j, std::initializer_list<const char*> path) {
  const json* at = &j;
  for (const char* k : path) {
    if (!at->is_object() || !at->contains(k)) return std::nan("");
    at = &(*at)[k];
  }
  return at->is_number() ? at->get<double>() : std::nan("");
}

json value_at(const json& j, std::initializer_list<const char*> path) {
  const json* at = &j;
  for (const char* k : path) {
    if (!at->is_object() || !at->contains(k)) return nullptr;
    at = &(*at)[k];
  }
  return *at;
}

json compare_numerics(const json& cell, const json& fp32) {
  if (fp32.value("status", "") != "ok" || !fp32.contains("metrics")) return nullptr;
  const std::string status = cell.value("status", "");
  if (status != "ok" && status != "diverged") return nullptr;
  json n{{"reference", fp32["name"]},
         {"thresholds", {{"final_loss_rel", kMatchFinalLoss}, {"curve_rel", kMatchCurve}}}};
  const json& q = cell.contains("metrics") ? cell["metrics"].value("quality", json::object()) : json::object();
  const json& q32 = fp32["metrics"]["quality"];
  const double l32 = q32.value("final_loss", std::nan(""));
  const double l = q.contains("final_loss") && q["final_loss"].is_number() ? q["final_loss"].get<double>() : std::nan("");
  if (status == "diverged" || !std::isfinite(l)) {
    n["verdict"] = "diverged";
    n["final_loss_rel_diff"] = nullptr;
    n["max_curve_rel_dev"] = nullptr;
    return n;
  }
  // A cell that a time budget stopped early is compared at the steps it ran: the reference's loss
  // over the same last 10 steps, and the curves where both have a point.
  double lc = l, lr = l32;
  const int64_t k = cell.value("steps_run", int64_t{0}), k32 = fp32.value("steps_run", int64_t{0});
  if (k > 0 && k32 > 0 && k != k32 && q.contains("step_losses") && q32.contains("step_losses")) {
    auto losses = [](const json& a) {
      std::vector<double> v;
      for (const auto& x : a) v.push_back(x.is_number() ? x.get<double>() : std::nan(""));
      return v;
    };
    const int64_t common = std::min(k, k32);
    lc = final_loss_of(losses(q["step_losses"]), common);
    lr = final_loss_of(losses(q32["step_losses"]), common);
    n["compared_at_step"] = common;
  }
  n["final_loss"] = lc;
  n["reference_final_loss"] = lr;
  const double final_rel = std::fabs(lc - lr) / std::max(1e-12, std::fabs(lr));
  // The curves log the same steps (same config but precision); compare where both have a value.
  std::map<int64_t, double> ref;
  for (const auto& p : q32.value("loss_curve", json::array()))
    if (p[1].is_number()) ref[p[0].get<int64_t>()] = p[1].get<double>();
  double max_dev = 0;
  for (const auto& p : q.value("loss_curve", json::array())) {
    const auto it = ref.find(p[0].get<int64_t>());
    if (it == ref.end()) continue;
    const double v = p[1].is_number() ? p[1].get<double>() : INFINITY;
    max_dev = std::max(max_dev, std::fabs(v - it->second) / std::max(1e-12, std::fabs(it->second)));
  }
  n["final_loss_rel_diff"] = final_rel;
  n["max_curve_rel_dev"] = max_dev;
  n["verdict"] = final_rel <= kMatchFinalLoss && max_dev <= kMatchCurve ? "matches" : "drifts";
  return n;
}

json compare_checkpointing(const json& cell, const json& none) {
  if (cell.value("status", "") != "ok" || none.value("status", "") != "ok") return nullptr;
  const json& m = cell["metrics"];
  const json& m0 = none["metrics"];
  const double peak = m["memory"]["peak_bytes"], peak0 = m0["memory"]["peak_bytes"];
  const double act = m["memory"].value("activation_bytes", 0.0), act0 = m0["memory"].value("activation_bytes", 0.0);
  const double t = m["timing"]["step_time_s"]["p50"], t0 = m0["timing"]["step_time_s"]["p50"];
  return json{{"reference", none["name"]},
              {"memory_saved_pct", peak0 > 0 ? json(100.0 * (1.0 - peak / peak0)) : json(nullptr)},
              {"activation_saved_pct", act0 > 0 ? json(100.0 * (1.0 - act / act0)) : json(nullptr)},
              {"recompute_overhead_pct", t0 > 0 ? json(100.0 * (t / t0 - 1.0)) : json(nullptr)},
              {"mfu", m["timing"].value("mfu", json())},
              {"hfu", m["timing"].value("hfu", json())}};
}

json compare_parallel(const json& cell, const json* single, const json* ddp) {
  if (cell.value("status", "") != "ok" || !cell.contains("metrics")) return nullptr;
  const json& m = cell["metrics"];
  const double world = cell["config"].value("world_size", 1);
  json p{{"world_size", world}, {"reference", single ? (*single)["name"] : json(nullptr)}};
  const double t = number_at(m, {"timing", "step_time_s", "p50"});
  const double rate = number_at(m, {"timing", "samples_per_s"});
  p["step_time_vs_single_pct"] = nullptr;
  p["scaling_efficiency"] = nullptr;
  if (single && (*single)["status"] == "ok") {
    const double t1 = number_at(*single, {"metrics", "timing", "step_time_s", "p50"});
    const double rate1 = number_at(*single, {"metrics", "timing", "samples_per_s"});
    if (t > 0 && t1 > 0) p["step_time_vs_single_pct"] = 100.0 * (t / t1 - 1.0);
    // Global throughput against N independent copies of the single process.
    if (rate > 0 && rate1 > 0) p["scaling_efficiency"] = rate / (world * rate1);
  }
  const double state = number_at(m, {"memory", "model_state_total_bytes"});
  p["model_state_bytes"] = std::isfinite(state) ? json(state) : json(nullptr);
  p["expected_model_state_bytes"] = m.contains("memory") ? m["memory"].value("expected_model_state_bytes", json()) : json();
  p["model_state_vs_ddp_pct"] = nullptr;
  p["step_time_vs_ddp_pct"] = nullptr;
  if (ddp && (*ddp)["status"] == "ok" && &cell != ddp) {
    const double state0 = number_at(*ddp, {"metrics", "memory", "model_state_total_bytes"});
    const double t0 = number_at(*ddp, {"metrics", "timing", "step_time_s", "p50"});
    if (state0 > 0 && std::isfinite(state)) p["model_state_vs_ddp_pct"] = 100.0 * (state / state0 - 1.0);
    if (t0 > 0 && t > 0) p["step_time_vs_ddp_pct"] = 100.0 * (t / t0 - 1.0);
  }
  p["exposed_comm_fraction"] = m.contains("comm") ? m["comm"].value("exposed_fraction_of_step", json()) : json();
  p["overlap"] = m.contains("comm") ? m["comm"].value("overlap", json()) : json();
  p["rng_violations"] = m.contains("rng") ? m["rng"].value("violations", json()) : json();
  return p;
}

json make_report(const json& env, const json& suite, const std::vector<json>& cells_in, const json& frontier) {
  json r;
  r["cells"] = cells_in;
  for (auto& c : r["cells"]) {
    if (!c.contains("config")) continue;
    if (c["config"].value("precision", "") != "32-true")
      if (const json* base = fp32_sibling(r, c)) {
        const json n = compare_numerics(c, *base);
        if (!n.is_null()) c["numerics"] = n;
      }
    // fp8's verdict is against the mode it replaces: bf16-mixed on the same model.
    if (c["config"].value("precision", "") == "fp8")
      if (const json* bf16 = sibling(r, c, "precision", "bf16-mixed")) {
        const json n = compare_numerics(c, *bf16);
        if (!n.is_null()) c["numerics_vs_bf16"] = n;
      }
    if (c["config"].value("world_size", 1) > 1 && c["config"].value("kind", "train") == "train") {
        const json p = compare_parallel(c, sibling(r, c, {{"parallel", "single"}, {"world_size", 1}}),
                                        sibling(r, c, {{"parallel", "ddp"}}));
        if (!p.is_null()) c["parallel"] = p;
      }
    if (c["config"].value("checkpoint", "none") != "none")
      if (const json* none = sibling(r, c, "checkpoint", "none")) {
        const json k = compare_checkpointing(c, *none);
        if (!k.is_null()) c["checkpointing"] = k;
      }
  }
  const json cells = r["cells"];
  r = json();
  r["schema"] = kSchema;
  r["trainscope"] = {{"version", version()}, {"commit", commit()}};
  r["created"] = utc_now();
  r["env"] = env;
  r["suite"] = suite;
  r["cells"] = cells;
  if (!frontier.is_null()) r["frontier"] = frontier;
  // Before the recommendations, which read it.
  const json ssl = ssl_summary(r);
  if (!ssl.is_null()) r["ssl"] = ssl;
  const json pitfalls = pitfalls_summary(r);
  if (!pitfalls.is_null()) r["pitfalls"] = pitfalls;
  r["recommendations"] = recommend(r);
  return r;
}

namespace {

// The measured GEMM peaks of a hardware suite's report: dtype -> achievable FLOP/s.
std::map<std::string, double> hardware_peaks(const json& hardware) {
  std::map<std::string, double> out;
  if (!hardware.is_object()) return out;
  for (const auto& c : hardware.value("cells", json::array()))
    for (const auto& g : value_at(c, {"metrics", "hardware", "gemm"}).is_array() ? c["metrics"]["hardware"]["gemm"] : json::array())
      if (g.value("achievable_flops_per_s", json()).is_number()) out[g["dtype"]] = g["achievable_flops_per_s"];
  return out;
}

// The attention core's training FLOPs per sample of a decoder cell, from its shape (reports older
// than the raw field): 12·L·H·Dh·S per token, S tokens.
double attention_flops(const json& cell) {
  const json s = value_at(cell, {"model", "shape"});
  if (!s.is_object() || (s.value("family", "") != "gpt" && s.value("family", "") != "llama")) return 0;
  const double S = s.value("seq_len", 0.0);
  return 12.0 * s.value("layers", 0.0) * s.value("heads", 0.0) * s.value("head_dim", 0.0) * S * S;
}

}  // namespace

json rederive_report(json report, const json& hardware) {
  const std::map<std::string, double> measured = hardware_peaks(hardware);
  const json gpus = value_at(report, {"env", "gpus"});
  const std::string gpu = gpus.is_array() && !gpus.empty() && gpus[0].is_object() ? gpus[0].value("name", "") : "";
  for (auto& c : report["cells"]) {
    json* timing = c.contains("metrics") && c["metrics"].contains("timing") ? &c["metrics"]["timing"] : nullptr;
    if (!timing || !c.contains("config")) continue;
    const RunConfig cfg = RunConfig::from_json(c["config"]);
    const bool cuda = c.value("device", "cpu").rfind("cuda", 0) == 0;
    const PrecisionTraits& t = precision_traits(cfg.precision);
    const std::string dtype = compute_dtype(t, cuda, cfg.fp16);
    json& tm = *timing;
    if (!tm.contains("gemm_peaks_flops_per_s")) {
      // Before the raw fields: the peak it measured, in the dtype it names (reports before that field
      // measured bf16 for bf16-mixed, fp8, tf32 and fp64 for their modes, else fp32).
      tm["gemm_peaks_flops_per_s"] = json::object();
      const std::string p = cfg.precision;
      const std::string measured_dtype = tm.value("compute_dtype", p == "bf16-mixed" ? "bf16" : p == "fp8" ? "fp8" : p == "tf32" ? "tf32"
                                                                      : p == "64-true"  ? "fp64" : "fp32");
      if (tm.value("peak_flops_per_s", json()).is_number()) tm["gemm_peaks_flops_per_s"][measured_dtype] = tm["peak_flops_per_s"];
    }
    if (!tm.contains("attention_flops_per_sample")) tm["attention_flops_per_sample"] = attention_flops(c);
    std::vector<std::string> needed = {dtype};
    if (t.fp8_linear && dtype == "fp8") needed.push_back(t.attention);
    for (const auto& d : needed)
      if (!tm["gemm_peaks_flops_per_s"].contains(d) && measured.count(d)) {
        tm["gemm_peaks_flops_per_s"][d] = measured.at(d);
        tm["peak_source"] = "measured " + d + " GEMM on this device, by the hardware suite (" + hardware.value("source", std::string("its report")) + ")";
      }
    derive_mfu(tm, t, dtype, cuda ? gpu : std::string(), cfg.world_size);
  }
  report["recommendations"] = recommend(report);
  return report;
}

void write_json_atomic(const std::string& path, const json& j) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  const std::string text = j.dump(2) + "\n";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("cannot write " + tmp);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n <= 0) {
      ::close(fd);
      ::unlink(tmp.c_str());
      throw std::runtime_error("write failed: " + tmp);
    }
    done += static_cast<size_t>(n);
  }
  ::fsync(fd);
  ::close(fd);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    throw std::runtime_error("cannot rename " + tmp + " to " + path);
  }
}

json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw UsageError("cannot read " + path);
  std::stringstream text;
  text << in.rdbuf();
  try {
    return json::parse(text.str());
  } catch (const json::parse_error& e) {
    throw UsageError(path + ": not valid JSON (byte " + std::to_string(e.byte) + ")");
  }
}

json read_report(const std::string& path_or_dir) {
  struct stat st {};
  std::string path = path_or_dir;
  if (stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) path += "/report.json";
  json r = read_json_file(path);
  if (!r.is_object() || !r.contains("schema") || !r["schema"].is_string())
    throw UsageError(path + ": not a trainscope report (no \"schema\")");
  const std::string schema = r["schema"];
  if (schema != kSchema)
    throw UsageError(path + ": report schema '" + schema + "' is not supported (this build reads " + kSchema + ")");
  for (const char* key : {"trainscope", "created", "env", "suite", "cells", "recommendations"})
    if (!r.contains(key)) throw UsageError(path + ": report lacks \"" + key + "\"");
  if (!r["cells"].is_array()) throw UsageError(path + ": \"cells\" is not a list");
  if (!r["created"].is_string() || !r["trainscope"].is_object() || !r["suite"].is_object() || !r["env"].is_object())
    throw UsageError(path + ": \"created\", \"trainscope\", \"suite\" or \"env\" has the wrong type");
  for (const auto& c : r["cells"])
    if (!c.is_object() || !c.contains("name") || !c["name"].is_string() || !c.contains("status") ||
        !c["status"].is_string() || !c.contains("config") || !c["config"].is_object())
      throw UsageError(path + ": a cell lacks a name, a status or a config of the right type");
  if (!r["recommendations"].is_array()) throw UsageError(path + ": \"recommendations\" is not a list");
  return r;
}

const json* sibling(const json& report, const json& cell, const std::string& key, const json& value) {
  return sibling(report, cell, json{{key, value}});
}

const json* sibling(const json& report, const json& cell, const json& changes) {
  if (!cell.contains("config")) return nullptr;
  json want = cell["config"];
  for (auto it = changes.begin(); it != changes.end(); ++it) want[it.key()] = it.value();
  for (const auto& c : report["cells"])
    if (c.contains("config") && c["config"] == want) return &c;
  return nullptr;
}

std::map<std::string, json> largest_per_op(const json& collectives) {
  std::map<std::string, json> largest;
  for (const auto& r : collectives.is_array() ? collectives : json::array()) {
    const std::string op = r.value("op", "");
    if (!largest.count(op) || r.value("bytes", 0) > largest[op].value("bytes", 0)) largest[op] = r;
  }
  return largest;
}

ParityCounts parity_counts(const json& parity) {
  ParityCounts n;
  for (const auto& k : parity.value("checks", json::array())) {
    const std::string v = k.value("verdict", "");
    (v == "exact" ? n.exact : v == "within" ? n.within : v == "design-difference" ? n.design : n.differs) += 1;
  }
  return n;
}

}  // namespace trainscope::reports
