// The recommendation rules, one at a time: for every rule of recommendation_rules() a minimal report on
// which it fires (its id, severity, the numbers it cites and its words) and a near miss on which it
// stays quiet; the table itself (every rule covered here, passes together); the device facts and the
// precision modes the rules read from core/.
#include <algorithm>
#include <cmath>
#include <functional>
#include <ostream>
#include <set>

#include <gtest/gtest.h>

#include "core/config.hpp"
#include "core/devices.hpp"
#include "reports/report.hpp"
#include "report_fixtures.hpp"

using namespace trainscope;
using namespace trainscope::reports;

namespace {

// ---- Reports by hand ------------------------------------------------------------------------------

// A cell of batch 16 (the rules that read the batch see one).
json cell(const std::string& model, const std::string& precision, double p50, double loss, double acc) {
  json c = test::hand_cell(model, precision, p50, loss, acc);
  c["config"]["batch_size"] = 16;
  return c;
}

json env(bool reference_blas = false) { return test::blas_env(reference_blas); }

// A report as read from disk, with only the sections a rule reads (no derived comparisons).
json hand_report(std::vector<json> cells, json environment = env(), json suite = json::object()) {
  return json{{"schema", kSchema}, {"env", environment}, {"suite", suite}, {"cells", cells}};
}

// A report with an SSL summary section of these parts.
json ssl_report(json rows, json efficiency, json data_size, std::vector<json> cells = {}) {
  json r = hand_report(std::move(cells));
  r["ssl"] = {{"confidence", 0.95}, {"rows", rows}, {"label_efficiency", efficiency}, {"data_size", data_size}};
  return r;
}

json bf16_pair(const std::string& mode, double p50, double loss, double acc) {
  return make_report(env(), json::object(), {cell("mlp", "32-true", 0.010, 0.50, 0.85), cell("mlp", mode, p50, loss, acc)});
}

json rank_cell(const std::string& strategy, int world, double p50, double state, double exposed) {
  json c = test::rank_cell(strategy, world, p50, state, exposed);
  c["config"]["batch_size"] = 16;
  return c;
}
json single() { return cell("gpt-tiny", "32-true", 0.10, 1.0, 0.5); }

json gpus_env(const std::string& gpu, int count) {
  json e = env();
  e["gpus"] = json::array();
  for (int i = 0; i < count; ++i) e["gpus"].push_back({{"name", gpu}});
  return e;
}

json ckpt_cell(const std::string& policy, double peak, double p50) {
  json c = cell("gpt-tiny", "32-true", p50, 1.0, 0.5);
  c["config"]["checkpoint"] = policy;
  c["name"] = "gpt-tiny/" + policy;
  c["metrics"]["memory"]["peak_bytes"] = peak;
  return c;
}
json checkpointing_report(double full_peak) {
  return make_report(env(), json::object(), {ckpt_cell("none", 100e6, 0.10), ckpt_cell("full", full_peak, 0.12)});
}

json frontier_report(int64_t full_batch) {
  json r = hand_report({});
  auto entry = [](const char* policy, int64_t batch, double rate) {
    return json{{"model", "gpt-tiny"}, {"precision", "32-true"}, {"checkpoint", policy}, {"largest_batch", batch},
                {"samples_per_s", rate}, {"budget", "48MiB"}};
  };
  r["frontier"] = json::array({entry("none", 8, 400.0), entry("full", full_batch, 300.0)});
  return r;
}

json across(const std::string& strategy, double p50, json levels) {
  return test::across_nodes(cell("gpt-tiny", "32-true", p50, 1.0, 0.5), strategy, std::move(levels));
}
json level(double s, double exposed) { return json{{"comm_time_s", s}, {"exposed_comm_time_s", exposed}}; }
json hsdp_on_two_nodes() {
  return across("hsdp", 0.040, {{"intra-node", level(0.030, 0.025)}, {"inter-node", level(0.020, 0.020)}});
}

// A hardware-suite cell: its name, device and metrics.hardware (and timing) as given.
json hardware_cell(const std::string& name, const std::string& device, json hardware, json timing = json::object()) {
  return json{{"name", name}, {"status", "ok"}, {"device_name", device}, {"config", RunConfig{}.to_json()},
              {"metrics", {{"hardware", hardware}, {"timing", timing}}}};
}
json gemm_row(const std::string& dtype, json fraction, json sheet, double achieved) {
  return json{{"dtype", dtype}, {"achievable_flops_per_s", achieved}, {"best_shape", {2048, 2048, 13312}},
              {"datasheet_flops_per_s", sheet}, {"fraction_of_datasheet", fraction}};
}
json gemm_of(double frac, double sheet) { return gemm_row("bf16", frac, sheet, frac * sheet); }
json attention_shape(int64_t seq, int64_t head_dim, const std::string& backend, double forward, double backward) {
  return json{{"seq", seq}, {"head_dim", head_dim}, {"backend", backend}, {"forward_flops_per_s", forward},
              {"backward_flops_per_s", backward}};
}
json levels_row(const char* name, int64_t bytes, double busbw) {
  return json{{"level", name}, {"group_size", 2}, {"op", "all-reduce"}, {"bytes", bytes}, {"time_s", 0.01},
              {"algbw_gbps", busbw}, {"busbw_gbps", busbw}};
}
json collectives_cell(json rows) {
  return hardware_cell("collectives", "NVIDIA H200",
                       {{"collectives", {{"backend", "gloo"}, {"world_size", 4}, {"levels", {{"nodes", 2}, {"rows", rows}}}}}});
}
json throttle_report(double drop) {
  return hand_report({hardware_cell("sustained", "NVIDIA H200", json::object(),
                                    {{"throughput_over_run", {{"window_s", 60.0}, {"drop", drop}, {"windows", {1000.0, 940.0}}}}})});
}

json efficiency_row(double fraction, const std::string& verdict, double mean, double low, double high) {
  return json{{"cell", "ssl/simclr"}, {"method", "simclr"}, {"encoder", "cnn-small"}, {"supervised_cell", "ssl/supervised"},
              {"fraction", fraction}, {"labels", 600}, {"n", 3}, {"ssl_accuracy_mean", 0.66}, {"scratch_accuracy_mean", 0.62},
              {"delta_mean", mean}, {"delta_low", low}, {"delta_high", high}, {"verdict", verdict},
              {"pretrain_wall_s", 20.0}, {"pretrained_from", nullptr}, {"pretrained", nullptr},
              {"upstream_pretrain_wall_s", nullptr}, {"finetune_s_mean", 1.0}, {"ssl_cost_s_mean", 21.0},
              {"scratch_outside_compute", 0}, {"label_equivalent", nullptr},
              {"seeds", json::array({{{"delta", 0.03}, {"ssl_path", "finetune"}}, {{"delta", 0.05}, {"ssl_path", "finetune"}},
                                     {{"delta", 0.04}, {"ssl_path", "probe"}}})}};
}
json floor_row(const std::string& method, bool beats) {
  return json{{"cell", "ssl/" + method}, {"method", method}, {"encoder", "cnn-small"}, {"beats_floors", beats},
              {"floor", "raw-pixel"}, {"linear", 0.80}, {"floor_linear", 0.84}, {"raw_pixels_linear", 0.84},
              {"random_encoder_linear", 0.30}};
}
json collapse_report(const std::string& verdict) {
  json c = cell("cnn-small", "32-true", 0.05, 1.0, 0.5);
  c["name"] = "ssl/byol";
  c["config"]["method"] = "byol";
  c["metrics"]["ssl_health"] = {{"verdict", verdict}, {"collapse_step", 120}, {"reason", "feature std 0.001 under 1% of its reference"},
                                {"std_reference", 0.5}, {"collapse_loss", 0.2},
                                {"samples", json::array({{{"step", 100}, {"std", 0.4}}, {{"step", 120}, {"std", 0.001}}})}};
  return ssl_report(json::array(), json::array(), json::array(), {c});
}
json data_size_report(std::vector<std::pair<int64_t, double>> sizes) {
  json rows = json::array();
  for (const auto& [n, linear] : sizes)
    rows.push_back({{"cell", "ssl/u" + std::to_string(n)}, {"unlabeled_size", n}, {"linear", linear}, {"finetune", linear - 0.1}});
  return ssl_report(json::array(), json::array(),
                    json::array({{{"method", "simclr"}, {"encoder", "cnn-small"}, {"fraction", 0.01}, {"rows", rows}}}));
}

json pitfall(const std::string& kind, const std::string& title, bool reproduced, const std::string& verdict) {
  return json{{"id", kind + "-1"}, {"kind", kind}, {"title", title},
              {"wrong", json::array({{{"cell", kind + "/wrong"}, {"status", "ok"}, {"summary", ""}}})},
              {"fix", json::array({{{"cell", kind + "/fix"}, {"status", "ok"}, {"summary", ""}}})},
              {"saw", json::array()}, {"cost", json::array()}, {"reproduced", reproduced}, {"verdict", verdict}};
}

// ---- Findings -------------------------------------------------------------------------------------

// Whether a finding's id is one a rule writes ("rng.<stream>" writes "rng.augmentation").
bool id_of_rule(const std::string& rule, const std::string& id) {
  const size_t open = rule.find('<');
  if (open == std::string::npos) return id == rule;
  return id.size() > open && id.compare(0, open, rule, 0, open) == 0;
}

std::vector<json> findings_of(const json& recs, const std::string& rule) {
  std::vector<json> out;
  for (const auto& r : recs)
    if (id_of_rule(rule, r["id"])) out.push_back(r);
  return out;
}

std::string text_of(const json& finding) { return finding["text"].get<std::string>(); }
bool says(const json& finding, const std::string& phrase) { return text_of(finding).find(phrase) != std::string::npos; }
// The number at `at` (a JSON pointer, "/speedup") in a finding's evidence.
double number(const json& finding, const std::string& at) { return finding["evidence"].at(json::json_pointer(at)).get<double>(); }

// ---- One case per rule ----------------------------------------------------------------------------

struct RuleCase {
  std::string name;                                   // the test's name
  std::string rule;                                   // the rule's id in recommendation_rules()
  std::function<json()> fires;                        // a minimal report on which it speaks
  std::function<void(const std::vector<json>&)> check;  // its findings there: id, severity, numbers, words
  std::function<json()> quiet;                        // a near miss, on which it says nothing
  std::string instead;                                // what the near miss gets instead ("": nothing to check)
};

#define PHRASE(finding, phrase) EXPECT_TRUE(says(finding, phrase)) << text_of(finding)

std::vector<RuleCase> run_cases() {
  return {
      {"reference_blas", "env.reference-blas", [] { return hand_report({}, env(true)); },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "warn");
         EXPECT_EQ(f[0]["evidence"]["blas"]["path"], "/usr/lib/x/libblas.so.3");
         PHRASE(f[0], "torch calls the reference BLAS (/usr/lib/x/libblas.so.3): fp32 timings are ~20x too slow");
       },
       [] { return hand_report({}, env(false)); }, ""},
      {"cells_failed", "run.cells-failed",
       [] {
         json late = cell("mlp", "32-true", 0.01, 0.5, 0.8), big = cell("mlp", "bf16-mixed", 0.01, 0.5, 0.8);
         late["status"] = "timeout";
         late["reason"] = "timed out after 5 s";
         big["status"] = "oom";
         big["reason"] = "out of memory at batch 64";
         return hand_report({late, big});
       },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "critical");
         EXPECT_EQ(f[0]["evidence"]["count"], 2);
         EXPECT_EQ(f[0]["cells"], json({"mlp/32-true", "mlp/bf16-mixed"}));
         PHRASE(f[0], "2 cell(s) did not finish: mlp/32-true: timeout (timed out after 5 s); mlp/bf16-mixed: oom");
       },
       [] {  // the suite expects the timeout: shown, not failed
         json late = cell("mlp", "32-true", 0.01, 0.5, 0.8);
         late["status"] = "timeout";
         late["reason"] = "timed out after 5 s";
         return hand_report({late}, env(), {{"expect", {{"mlp/32-true", json::array({"timeout"})}}}});
       },
       ""},
      {"expected_failure_missing", "run.expected-failure-missing",
       [] {
         return hand_report({cell("mlp", "16-mixed-noscale", 0.01, 0.5, 0.8)}, env(),
                            {{"expect", {{"mlp/16-mixed-noscale", {"diverged", "oom"}}}}});
       },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "warn");
         EXPECT_EQ(f[0]["evidence"]["expected"], json({"diverged", "oom"}));
         PHRASE(f[0], "mlp/16-mixed-noscale was expected to end diverged or oom but ended ok");
       },
       [] {
         json c = cell("mlp", "16-mixed-noscale", 0.01, 0.5, 0.8);
         c["status"] = "diverged";
         return hand_report({c}, env(), {{"expect", {{"mlp/16-mixed-noscale", {"diverged", "oom"}}}}});
       },
       ""},
  };
}

std::vector<RuleCase> precision_cases() {
  return {
      {"use_bf16", "precision.use-<precision>", [] { return bf16_pair("bf16-mixed", 0.009, 0.5005, 0.848); },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["id"], "precision.use-bf16-mixed");
         EXPECT_EQ(f[0]["severity"], "info");
         EXPECT_NEAR(number(f[0], "/speedup"), 0.010 / 0.009, 1e-12);
         EXPECT_DOUBLE_EQ(number(f[0], "/thresholds/faster"), 1.10);
         EXPECT_EQ(f[0]["cells"], json({"mlp/32-true", "mlp/bf16-mixed"}));
         EXPECT_EQ(text_of(f[0]), "mlp: bf16-mixed runs here at 1.11x the speed of fp32 (final loss 0.1% from fp32, "
                                  "accuracy 84.8% vs 85.0%): use it");
       },
       [] { return bf16_pair("bf16-mixed", 0.0092, 0.5005, 0.848); }, "precision.keep-fp32"},  // 1.087x
      {"bf16_drifts", "precision.bf16-drifts", [] { return bf16_pair("bf16-mixed", 0.005, 0.511, 0.835); },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "warn");
         EXPECT_NEAR(number(f[0], "/final_loss_rel_diff"), 0.022, 1e-9);
         EXPECT_DOUBLE_EQ(number(f[0], "/accuracy/bf16-mixed"), 0.835);
         EXPECT_EQ(text_of(f[0]), "mlp: bf16-mixed drifts from fp32 (final loss 2.2% from fp32, accuracy 83.5% vs 85.0%) "
                                  "at 2.00x the speed: check the numerics before switching");
       },
       // The loss 2.2% apart, the accuracy within a point: it agrees.
       [] { return bf16_pair("bf16-mixed", 0.005, 0.511, 0.845); }, "precision.use-bf16-mixed"},
      {"keep_fp32", "precision.keep-fp32", [] { return bf16_pair("bf16-mixed", 0.0095, 0.50, 0.85); },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "info");
         EXPECT_NEAR(number(f[0], "/speedup"), 0.010 / 0.0095, 1e-12);
         PHRASE(f[0], "mlp: bf16-mixed matches fp32 (final loss 0.0% from fp32, accuracy 85.0% vs 85.0%) but is only 1.05x");
       },
       [] { return bf16_pair("bf16-mixed", 0.00905, 0.50, 0.85); }, "precision.use-bf16-mixed"},  // 1.105x
      {"fp16_loss_scaling", "precision.fp16-loss-scaling",
       [] {
         auto scaled = [](const std::string& model, int64_t skipped, bool collapsed) {
           json c = cell(model, "16-mixed", 0.02, 3.0, 0.0);
           c["metrics"]["overflow"] = {{"scale_trajectory", json::array({{0, 65536.0}, {40, 32768.0}})}, {"skipped_steps", skipped},
                                       {"steps", 100}, {"final_scale", 32768.0}, {"min_scale", collapsed ? 1.0 : 16384.0},
                                       {"scale_settled_step", 40}, {"first_overflow_step", 5}, {"scale_collapsed", collapsed}};
           return c;
         };
         return hand_report({scaled("gpt-tiny", 3, false), scaled("mlp", 9, true)});
       },
       [](const std::vector<json>& f) {
         ASSERT_EQ(f.size(), 2u);
         EXPECT_EQ(f[0]["severity"], "info");
         EXPECT_EQ(f[0]["evidence"]["skipped_steps"], 3);
         EXPECT_DOUBLE_EQ(number(f[0], "/final_scale"), 32768.0);
         EXPECT_EQ(text_of(f[0]), "gpt-tiny/16-mixed: 16-mixed skipped 3 of 100 steps; the loss scale settled at 2^15 after 40 "
                                  "steps (first overflow at step 5)");
         EXPECT_EQ(f[1]["severity"], "warn");
         PHRASE(f[1], "; the scale fell to 2^0: gradients overflow fp16 even unscaled, prefer bf16");
       },
       [] {
         json c = cell("gpt-tiny", "16-mixed", 0.02, 3.0, 0.0);
         c["metrics"]["overflow"] = {{"scale_trajectory", json::array({{0, 65536.0}})}, {"skipped_steps", 0}, {"steps", 100},
                                     {"final_scale", 65536.0}, {"min_scale", 65536.0}, {"scale_settled_step", 0},
                                     {"first_overflow_step", nullptr}, {"scale_collapsed", false}};
         return hand_report({c});
       },
       ""},
      {"fp16_noscale_diverged", "precision.fp16-noscale-diverged",
       [] {
         json c = cell("gpt-tiny", "16-mixed-noscale", 0.02, 3.0, 0.0);
         c["status"] = "diverged";
         c["metrics"]["quality"]["first_nonfinite_step"] = 7;
         c["metrics"]["overflow"] = {{"overflow_blocks", json::array({"fc1", "fc2"})}, {"first_overflow_step", 6}};
         return hand_report({c});
       },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "critical");
         EXPECT_EQ(f[0]["evidence"]["first_nonfinite_step"], 7);
         EXPECT_EQ(f[0]["evidence"]["first_overflow_step"], 6);
         EXPECT_EQ(text_of(f[0]), "gpt-tiny/16-mixed-noscale: fp16 without loss scaling diverged at step 7; values of fc1, fc2 "
                                  "exceeded fp16's range (65504): use 16-mixed with the scaler, or bf16");
       },
       [] { return hand_report({cell("gpt-tiny", "16-mixed-noscale", 0.02, 3.0, 0.0)}); }, ""},  // it trained
      {"fp16_underflow", "precision.fp16-underflow",
       [] {
         auto underflowing = [](const std::string& precision, double frac) {
           json c = cell("gpt-tiny", precision, 0.02, 3.0, 0.0);
           c["metrics"]["overflow"] = {{"layers", json::array({{{"block", "fc0"}, {"gradient", {{"frac_below_fp16_normal", frac / 2}}}},
                                                              {{"block", "fc1"}, {"gradient", {{"frac_below_fp16_normal", frac}}}}})}};
           return c;
         };
         return hand_report({underflowing("32-true", 0.3), underflowing("16-mixed-noscale", 0.4)});  // once per model
       },
       [](const std::vector<json>& f) {
         ASSERT_EQ(f.size(), 1u);
         EXPECT_EQ(f[0]["severity"], "warn");
         EXPECT_EQ(f[0]["evidence"]["block"], "fc1");
         EXPECT_DOUBLE_EQ(number(f[0], "/frac_below_fp16_normal"), 0.3);
         EXPECT_DOUBLE_EQ(number(f[0], "/threshold"), 0.01);
         PHRASE(f[0], "gpt-tiny: 30.0% of the gradients of fc1 are below fp16's normal range (6.1e-5) unscaled");
       },
       [] {  // 0.99% of fc1's gradients: under the 1% threshold
         json c = cell("gpt-tiny", "32-true", 0.02, 3.0, 0.0);
         c["metrics"]["overflow"] = {{"layers", json::array({{{"block", "fc1"}, {"gradient", {{"frac_below_fp16_normal", 0.0099}}}}})}};
         return hand_report({c});
       },
       ""},
      {"precision_drifts", "precision.drifts",
       [] {
         return make_report(env(), json::object(), {cell("mlp", "32-true", 0.01, 3.0, 0.5), cell("mlp", "tf32", 0.005, 3.3, 0.5)});
       },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "warn");
         EXPECT_NEAR(number(f[0], "/final_loss_rel_diff"), 0.1, 1e-9);
         EXPECT_EQ(f[0]["cells"], json({"mlp/tf32", "mlp/32-true"}));
         EXPECT_EQ(text_of(f[0]), "mlp/tf32: final loss 10.0% from fp32, largest deviation 0.0% along the curve");
       },
       [] {  // 1.7% apart: within the 2%
         return make_report(env(), json::object(), {cell("mlp", "32-true", 0.01, 3.0, 0.5), cell("mlp", "tf32", 0.005, 3.05, 0.5)});
       },
       ""},
      {"no_bf16", "precision.no-bf16",
       [] {
         json a = cell("mlp", "bf16-mixed", 0.01, 0.5, 0.8), b = cell("mlp", "bf16-true", 0.01, 0.5, 0.8);
         for (json* c : {&a, &b}) {
           (*c)["status"] = "skipped";
           (*c)["reason"] = "bf16 needs compute capability 8.0 (this GPU: 7.5)";
         }
         return hand_report({a, b});  // said once
       },
       [](const std::vector<json>& f) {
         ASSERT_EQ(f.size(), 1u);
         EXPECT_EQ(f[0]["severity"], "info");
         EXPECT_EQ(f[0]["cells"], json::array({"mlp/bf16-mixed"}));
         EXPECT_EQ(text_of(f[0]), "this GPU has no bf16 (bf16 needs compute capability 8.0 (this GPU: 7.5)): 16-mixed with the "
                                  "loss scaler is the fast option");
       },
       [] {  // fp8 skipped for the compute capability says nothing of bf16
         json c = cell("mlp", "fp8", 0.01, 0.5, 0.8);
         c["status"] = "skipped";
         c["reason"] = "fp8 needs compute capability 8.9 (this GPU: 8.0)";
         return hand_report({c});
       },
       ""},
  };
}

std::vector<RuleCase> checkpoint_cases() {
  return {
      {"checkpoint_leave_off", "checkpoint.leave-off", [] { return checkpointing_report(96e6); },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "info");
         EXPECT_NEAR(number(f[0], "/full/memory_saved_pct"), 4.0, 1e-9);
         EXPECT_EQ(f[0]["cells"], json({"gpt-tiny/full", "gpt-tiny/none"}));
         EXPECT_EQ(text_of(f[0]), "gpt-tiny at batch 16: no policy lowers peak memory by 5% or more (full: peak memory -4%, step "
                                  "time +20%); the peak is not activations: leave checkpointing off");
       },
       [] { return checkpointing_report(94e6); }, "checkpoint.tradeoff"},  // 6% saved
      {"checkpoint_tradeoff", "checkpoint.tradeoff", [] { return checkpointing_report(40e6); },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "info");
         EXPECT_NEAR(number(f[0], "/full/memory_saved_pct"), 60.0, 1e-9);
         EXPECT_NEAR(number(f[0], "/full/recompute_overhead_pct"), 20.0, 1e-9);
         EXPECT_EQ(text_of(f[0]), "gpt-tiny at batch 16, against no checkpointing: full: peak memory -60%, step time +20%");
       },
       [] { return checkpointing_report(96e6); }, "checkpoint.leave-off"},  // 4% saved
      {"checkpoint_frontier", "checkpoint.frontier", [] { return frontier_report(32); },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "info");
         EXPECT_EQ(f[0]["evidence"]["full"]["largest_batch"], 32);
         EXPECT_EQ(f[0]["evidence"]["none"]["largest_batch"], 8);
         EXPECT_EQ(f[0]["evidence"]["budget"], "48MiB");
         EXPECT_EQ(text_of(f[0]), "gpt-tiny/32-true: under 48MiB, full fits batch 32 where none fits 8 (300 vs 400 samples/s at "
                                  "the frontier)");
       },
       [] { return frontier_report(8); }, "checkpoint.leave-off"},  // the same batch as none
      {"frontier_leave_off", "checkpoint.leave-off", [] { return frontier_report(8); },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "info");
         EXPECT_EQ(f[0]["evidence"]["full"]["largest_batch"], 8);
         EXPECT_EQ(f[0]["cells"], json::array());
         EXPECT_EQ(text_of(f[0]), "gpt-tiny/32-true: under 48MiB no policy fits a larger batch than none (8): memory is to spare, "
                                  "leave checkpointing off");
       },
       [] { return frontier_report(9); }, "checkpoint.frontier"},  // one more than none
  };
}

std::vector<RuleCase> parallel_cases() {
  return {
      {"zero_memory", "parallel.zero-memory",
       [] {
         return make_report(env(), json::object(),
                            {single(), rank_cell("ddp", 2, 0.12, 1600e6, 0.1), rank_cell("zero2", 2, 0.13, 700e6, 0.1)});
       },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "info");
         EXPECT_DOUBLE_EQ(number(f[0], "/model_state_bytes"), 700e6);
         EXPECT_DOUBLE_EQ(number(f[0], "/ddp_model_state_bytes"), 1600e6);
         EXPECT_EQ(f[0]["cells"], json({"gpt-tiny/zero2/ws2", "gpt-tiny/ddp/ws2"}));
         EXPECT_EQ(text_of(f[0]), "gpt-tiny: zero2 cuts model-state memory per rank from 1.5 GiB to 667.6 MiB at 2 ranks "
                                  "(expected 667.6 MiB) for +8% step time against ddp");
       },
       [] { return make_report(env(), json::object(), {single(), rank_cell("zero2", 2, 0.13, 700e6, 0.1)}); }, ""},  // no ddp
      {"exposed_comm", "parallel.exposed-comm",
       [] {
         json zero3 = rank_cell("zero3", 2, 0.15, 500e6, 0.5);
         zero3["config"]["prefetch"] = false;
         json cp = rank_cell("ddp", 2, 0.15, 500e6, 0.4);  // cp 2: its gradients averaged as ddp's
         cp["name"] = "gpt-tiny/cp2";
         cp["layout"]["name"] = "cp2";
         cp["metrics"]["timing"]["context_parallel"] = {{"method", "allgather"}, {"hidden_fraction", 0.0}};
         return make_report(env(), json::object(), {single(), rank_cell("ddp", 2, 0.12, 1600e6, 0.26), zero3, cp});
       },
       [](const std::vector<json>& f) {
         ASSERT_EQ(f.size(), 3u);
         EXPECT_EQ(f[2]["evidence"]["cp_method"], "allgather");
         EXPECT_EQ(text_of(f[2]), "gpt-tiny/cp2: exposed communication is 40% of the step at 2 ranks, cp's allgather hiding 0% of "
                                  "its transfers: the all-gather waits whole; cp_method = ring overlaps the transfers with the blocks");
         EXPECT_EQ(f[0]["severity"], "warn");
         EXPECT_DOUBLE_EQ(number(f[0], "/exposed_comm_fraction"), 0.26);
         EXPECT_DOUBLE_EQ(number(f[0], "/threshold"), 0.25);
         EXPECT_EQ(text_of(f[0]), "gpt-tiny/ddp: exposed communication is 26% of the step at 2 ranks (overlap 20%): larger "
                                  "buckets (bucket_mb) cut per-bucket latency; more overlap needs the last buckets to be small");
         PHRASE(f[1], "gpt-tiny/zero3: exposed communication is 50% of the step at 2 ranks (overlap 20%): turn prefetch on");
       },
       [] { return make_report(env(), json::object(), {single(), rank_cell("ddp", 2, 0.12, 1600e6, 0.25)}); }, ""},  // 25%
      {"ddp_scaling", "parallel.scaling",
       [] {
         return make_report(env(), json::object(),
                            {single(), rank_cell("ddp", 2, 0.12, 1600e6, 0.1), rank_cell("ddp", 4, 0.25, 1600e6, 0.1)});
       },
       [](const std::vector<json>& f) {
         ASSERT_EQ(f.size(), 2u);
         EXPECT_EQ(f[0]["severity"], "info");
         EXPECT_NEAR(number(f[0], "/scaling_efficiency"), 0.10 / 0.12, 1e-12);
         EXPECT_EQ(f[0]["cells"], json({"gpt-tiny/ddp/ws2", "gpt-tiny/32-true"}));
         EXPECT_EQ(text_of(f[0]), "gpt-tiny/ddp at 2 ranks: 1.67x the throughput of one process at the same per-rank batch "
                                  "(scaling efficiency 83%)");
         EXPECT_EQ(f[1]["severity"], "warn");  // 40%: under half
         PHRASE(f[1], "gpt-tiny/ddp at 4 ranks: 1.60x the throughput of one process at the same per-rank batch (scaling efficiency 40%)");
       },
       // zero2 against one process: scaling is ddp's finding
       [] { return make_report(env(), json::object(), {single(), rank_cell("zero2", 2, 0.12, 700e6, 0.1)}); }, ""},
      {"across_nodes", "parallel.across-nodes",
       [] { return make_report(env(), json::object(), {hsdp_on_two_nodes(), across("zero3", 0.090, {{"inter-node", level(0.07, 0.07)}})}); },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "info");
         EXPECT_DOUBLE_EQ(number(f[0], "/hsdp/step_time_s"), 0.040);
         EXPECT_DOUBLE_EQ(number(f[0], "/hsdp/intra-node_exposed_comm_time_s"), 0.025);
         EXPECT_DOUBLE_EQ(number(f[0], "/zero3/inter-node_comm_time_s"), 0.070);
         EXPECT_EQ(f[0]["cells"], json({"gpt-tiny/hsdp/ws4", "gpt-tiny/zero3/ws4"}));
         EXPECT_EQ(text_of(f[0]), "gpt-tiny at 4 ranks on 2 nodes: hsdp 40.00 ms per step (communication 30.00 ms within a node, "
                                  "20.00 ms across nodes; waits most on the links within a node); zero3 90.00 ms per step "
                                  "(communication 70.00 ms across nodes; waits most on the links across nodes). hsdp is fastest "
                                  "on these links: its gathers stay inside a node and only the gradient slices cross");
       },
       [] {  // zero3 did not finish: nothing to hold hsdp against
         json zero3 = across("zero3", 0.090, json::object());
         zero3["status"] = "failed";
         zero3.erase("metrics");
         return make_report(env(), json::object(), {hsdp_on_two_nodes(), zero3});
       },
       "run.cells-failed"},
      {"busbw_vs_link", "parallel.busbw-vs-link",
       [] { return make_report(gpus_env("NVIDIA A100-SXM4-80GB", 2), json::object(), {rank_cell("ddp", 2, 0.12, 1600e6, 0.1)}); },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "warn");  // 40% of the link
         EXPECT_DOUBLE_EQ(number(f[0], "/busbw_gbps"), 120.0);
         EXPECT_DOUBLE_EQ(number(f[0], "/link_gbps"), 300.0);
         EXPECT_EQ(f[0]["evidence"]["gpu"], "NVIDIA A100-SXM4-80GB");
         EXPECT_EQ(text_of(f[0]), "gpt-tiny/ddp/ws2: all-reduce of 64.0 MiB reaches busbw 120.0 GB/s, 40% of NVIDIA "
                                  "A100-SXM4-80GB's NVLink 3 (600 GB/s both ways) per-direction 300 GB/s (small messages are "
                                  "latency-bound; for large ones check NCCL's topology)");
       },
       // A GPU the device table does not know: no link to hold busbw against.
       [] { return make_report(gpus_env("NVIDIA GeForce RTX 3090", 2), json::object(), {rank_cell("ddp", 2, 0.12, 1600e6, 0.1)}); },
       ""},
      {"rng_streams", "rng.<stream>",
       [] {
         json c = rank_cell("ddp", 2, 0.12, 1600e6, 0.1);
         c["metrics"]["rng"] = {{"streams", json::array({{{"name", "data-samples"}, {"class", "should-differ"}, {"verdict", "violated"},
                                                          {"first_violation_step", 0}, {"ranks", {0, 1}}},
                                                         {{"name", "dropout-masks"}, {"class", "should-match"}, {"verdict", "ok"},
                                                          {"first_violation_step", nullptr}, {"ranks", json::array()}},
                                                         {{"name", "my-stream"}, {"class", "should-match"}, {"verdict", "violated"},
                                                          {"first_violation_step", 3}, {"ranks", json::array({1})}, {"detail", "differs on rank 1"}}})},
                                {"violations", 2}};
         return hand_report({c});
       },
       [](const std::vector<json>& f) {
         ASSERT_EQ(f.size(), 2u);
         EXPECT_EQ(f[0]["id"], "rng.data-samples");
         EXPECT_EQ(f[0]["severity"], "critical");
         EXPECT_EQ(f[0]["evidence"]["first_violation_step"], 0);
         EXPECT_EQ(text_of(f[0]), "gpt-tiny/ddp/ws2: should-differ stream 'data-samples' violated from step 0 on ranks 0, 1: every "
                                  "rank trains on the same samples (no diversity across ranks): shard the data by rank");
         EXPECT_EQ(f[1]["id"], "rng.my-stream");  // a stream without a known fix: its own detail
         PHRASE(f[1], "'my-stream' violated from step 3 on ranks 1: differs on rank 1");
       },
       [] {
         json c = rank_cell("ddp", 2, 0.12, 1600e6, 0.1);
         c["metrics"]["rng"] = {{"streams", json::array({{{"name", "data-samples"}, {"class", "should-differ"}, {"verdict", "ok"},
                                                          {"first_violation_step", nullptr}, {"ranks", json::array()}}})},
                                {"violations", 0}};
         return hand_report({c});
       },
       ""},
  };
}

std::vector<RuleCase> hardware_cases() {
  return {
      {"gemm_vs_datasheet", "hardware.gemm.<dtype>",
       [] {
         return hand_report({hardware_cell("gemm", "NVIDIA A100-SXM4-80GB", {{"gemm", json::array({gemm_of(0.70, 312e12)})}}),
                             hardware_cell("gemm40", "NVIDIA A100-SXM4-40GB", {{"gemm", json::array({gemm_of(0.77, 312e12)})}}),
                             hardware_cell("cpu", "AMD EPYC 7763",
                                           {{"gemm", json::array({gemm_row("fp32", nullptr, nullptr, 1.5e12)})}})});
       },
       [](const std::vector<json>& f) {
         ASSERT_EQ(f.size(), 3u);
         EXPECT_EQ(f[0]["id"], "hardware.gemm.bf16");
         EXPECT_EQ(f[0]["severity"], "warn");  // 16.9 points under mamf-finder's 86.9%
         EXPECT_DOUBLE_EQ(number(f[0], "/published_fraction"), 0.869);
         EXPECT_DOUBLE_EQ(number(f[0], "/fraction_of_datasheet"), 0.70);
         EXPECT_EQ(text_of(f[0]), "bf16 GEMM reaches 70.0% of the datasheet (218.4 of 312.0 TFLOPS, shape [2048,2048,13312]); "
                                  "mamf-finder reports 86.9% on this device: 16.9 points short (clocks, power limit, or a slow "
                                  "library)");
         EXPECT_EQ(f[1]["severity"], "info");  // 9.9 points under: within the 10
         EXPECT_FALSE(says(f[1], "points short")) << text_of(f[1]);
         EXPECT_EQ(f[2]["id"], "hardware.gemm.fp32");
         EXPECT_EQ(text_of(f[2]), "fp32 GEMM reaches 1.50 TFLOPS at best (shape [2048,2048,13312]); no datasheet for 'AMD EPYC "
                                  "7763': nothing to hold it against");
       },
       [] {  // the dtype this device lacks: skipped, nothing measured
         return hand_report({hardware_cell("gemm", "NVIDIA A100-SXM4-80GB",
                                           {{"gemm", json::array({{{"dtype", "fp8"}, {"skipped", "fp8 GEMMs need compute capability 8.9"},
                                                                   {"achievable_flops_per_s", nullptr}}})}})});
       },
       ""},
      {"attention_rate", "hardware.attention.<dtype>",
       [] {
         json gpu = gemm_of(0.70, 989e12), cpu = gemm_row("fp32", nullptr, nullptr, 1.5e12);
         gpu["attention"] = json::array({attention_shape(1024, 64, "flash", 1e14, 5e13), attention_shape(4096, 128, "flash", 4.5e14, 3.1e14)});
         cpu["attention"] = json::array({attention_shape(256, 64, "math", 5e10, 2e10)});
         return hand_report({hardware_cell("gemm", "NVIDIA H200", {{"gemm", json::array({gpu})}}),
                             hardware_cell("cpu", "AMD EPYC 7763", {{"gemm", json::array({cpu})}})});
       },
       [](const std::vector<json>& f) {
         ASSERT_EQ(f.size(), 2u);
         EXPECT_EQ(f[0]["id"], "hardware.attention.bf16");
         EXPECT_EQ(f[0]["severity"], "info");
         EXPECT_DOUBLE_EQ(number(f[0], "/forward_flops_per_s"), 4.5e14);
         EXPECT_EQ(f[0]["evidence"]["shape"]["seq"], 4096);  // the largest shape, the last
         EXPECT_EQ(text_of(f[0]), "bf16 fused attention (SDPA, flash kernel, causal, seq 4096, head dim 128): 450 TFLOPS forward, "
                                  "310 backward (46% and 31% of the datasheet)");
         EXPECT_EQ(text_of(f[1]), "fp32 fused attention (SDPA, math kernel, causal, seq 256, head dim 64): 50 GFLOPS forward, 20 "
                                  "backward");
       },
       [] {
         json gpu = gemm_of(0.70, 989e12);
         gpu["attention"] = json::array();
         return hand_report({hardware_cell("gemm", "NVIDIA H200", {{"gemm", json::array({gpu})}})});
       },
       ""},
      {"collective_levels", "hardware.collectives.levels",
       [] {
         return hand_report({collectives_cell({levels_row("intra-node", 1 << 20, 0.2), levels_row("intra-node", 16 << 20, 0.36),
                                               levels_row("inter-node", 1 << 20, 0.05), levels_row("inter-node", 16 << 20, 0.06)})});
       },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "info");
         EXPECT_DOUBLE_EQ(number(f[0], "/intra_node_busbw_gbps"), 0.36);
         EXPECT_DOUBLE_EQ(number(f[0], "/inter_node_busbw_gbps"), 0.06);
         EXPECT_NEAR(number(f[0], "/ratio"), 6.0, 1e-9);
         PHRASE(f[0], "all-reduce bus bandwidth 0.060 GB/s across nodes against 0.360 GB/s within a node (16.0 MiB): 6.0x slower");
       },
       [] { return hand_report({collectives_cell({levels_row("intra-node", 16 << 20, 0.36)})}); }, ""},  // one node
      {"memory_bandwidth", "hardware.memory",
       [] {
         return hand_report(
             {hardware_cell("mem", "NVIDIA A100-SXM4-80GB",
                            {{"memory", {{"bandwidth_gbps", 1600.0}, {"datasheet_gbps", 2039.0}, {"fraction_of_datasheet", 0.785}}}}),
              hardware_cell("cpu-mem", "AMD EPYC 7763", {{"memory", {{"bandwidth_gbps", 12.3}, {"fraction_of_datasheet", nullptr}}}})});
       },
       [](const std::vector<json>& f) {
         ASSERT_EQ(f.size(), 2u);
         EXPECT_EQ(f[0]["severity"], "warn");  // under 80%
         EXPECT_DOUBLE_EQ(number(f[0], "/fraction_of_datasheet"), 0.785);
         EXPECT_DOUBLE_EQ(number(f[0], "/threshold"), 0.80);
         EXPECT_EQ(text_of(f[0]), "device memory copies at 1600 GB/s, 78.5% of the datasheet's 2039 GB/s");
         EXPECT_EQ(f[1]["severity"], "info");
         EXPECT_EQ(text_of(f[1]), "memory copies at 12.3 GB/s (read + write); no datasheet for 'AMD EPYC 7763'");
       },
       [] {  // the copy was not measured
         return hand_report({hardware_cell("mem", "NVIDIA A100-SXM4-80GB", {{"memory", {{"bandwidth_gbps", nullptr}}}})});
       },
       ""},
      {"throttling", "hardware.throttling", [] { return throttle_report(0.06); },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "warn");
         EXPECT_DOUBLE_EQ(number(f[0], "/drop"), 0.06);
         EXPECT_DOUBLE_EQ(number(f[0], "/threshold"), 0.05);
         EXPECT_EQ(text_of(f[0]), "throughput fell 6.0% from the first to the last 60 s window of the run: clock or power "
                                  "throttling (or a noisy neighbour)");
       },
       [] { return throttle_report(0.05); }, ""},  // 5%: not more than the threshold
  };
}

std::vector<RuleCase> ssl_cases() {
  return {
      {"ssl_label_efficiency", "ssl-label-efficiency",
       [] {
         return ssl_report(json::array(), json::array({efficiency_row(0.01, "pays off", 0.04, 0.015, 0.065),
                                                       efficiency_row(0.1, "inconclusive", 0.0033, -0.048, 0.055)}),
                           json::array());
       },
       [](const std::vector<json>& f) {
         ASSERT_EQ(f.size(), 1u);  // one per SSL cell, its fractions in one sentence
         EXPECT_EQ(f[0]["severity"], "info");
         EXPECT_EQ(f[0]["evidence"]["fractions"].size(), 2u);
         EXPECT_DOUBLE_EQ(number(f[0], "/fractions/0/delta_mean"), 0.04);
         EXPECT_DOUBLE_EQ(number(f[0], "/confidence"), 0.95);
         EXPECT_EQ(f[0]["cells"], json({"ssl/simclr", "ssl/supervised"}));
         EXPECT_EQ(text_of(f[0]), "simclr on cnn-small (ssl/simclr) pays off at 1% labels (+4.0 points, 95% CI +1.5..+6.5, over 3 "
                                  "label seeds at 20 s pre-training + 1.0 s fine-tune on 2 of 3 seeds, a linear probe on the "
                                  "others against the best scratch run within that compute); inconclusive at 10% (+0.3 points, "
                                  "95% CI -4.8..+5.5, at 20 s pre-training + 1.0 s fine-tune on 2 of 3 seeds, a linear probe on "
                                  "the others)");
       },
       // SSL rows against their floors, but no label-efficiency comparison
       [] { return ssl_report(json::array({floor_row("simclr", true)}), json::array(), json::array()); }, ""},
      {"ssl_below_floor", "ssl-below-floor",
       [] { return ssl_report(json::array({floor_row("simclr", false)}), json::array(), json::array()); },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "warn");
         EXPECT_NEAR(number(f[0], "/margin"), -0.04, 1e-12);
         EXPECT_DOUBLE_EQ(number(f[0], "/floor_linear"), 0.84);
         EXPECT_EQ(text_of(f[0]), "ssl/simclr: simclr on cnn-small: a linear probe on its frozen features reaches 0.800, -4.0 "
                                  "points against the raw-pixel floor (0.840); the random-encoder floor is 0.300: the pre-trained "
                                  "features separate the classes less well than the pixels themselves");
       },
       // a supervised encoder under its floor is not an SSL finding; the SSL one beats its floors
       [] { return ssl_report(json::array({floor_row("simclr", true), floor_row("supervised", false)}), json::array(), json::array()); },
       ""},
      {"ssl_collapse", "ssl-collapse", [] { return collapse_report("collapsed"); },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "critical");
         EXPECT_EQ(f[0]["evidence"]["collapse_step"], 120);
         EXPECT_DOUBLE_EQ(number(f[0], "/sample/std"), 0.001);  // the sample at the collapse
         EXPECT_EQ(text_of(f[0]), "ssl/byol: byol collapsed at step 120: feature std 0.001 under 1% of its reference; its features "
                                  "and accuracies are not to be trusted");
       },
       [] { return collapse_report("healthy"); }, ""},
      {"ssl_data_size", "ssl-data-size", [] { return data_size_report({{6000, 0.70}, {20000, 0.75}, {60000, 0.80}}); },
       [](const std::vector<json>& f) {
         EXPECT_EQ(f[0]["severity"], "info");
         EXPECT_EQ(f[0]["evidence"]["rows"].size(), 3u);
         EXPECT_EQ(f[0]["cells"], json({"ssl/u6000", "ssl/u20000", "ssl/u60000"}));
         EXPECT_EQ(text_of(f[0]), "pre-training simclr on cnn-small on 6000 images reaches 0.700 linear vs 0.800 on 60000 (20000: "
                                  "0.750); fine-tuned on 1% of the labels, 0.600 vs 0.700");
       },
       [] { return data_size_report({{6000, 0.70}}); }, ""},  // one size: no axis
      {"pitfalls", "pitfall.<kind>",
       [] {
         json r = hand_report({});
         r["pitfalls"] = json::array({pitfall("fp16-range", "fp16 without a scaler", true, "16-mixed with the scaler trains"),
                                      pitfall("rng", "one seed on every rank", false, "no difference seen")});
         return r;
       },
       [](const std::vector<json>& f) {
         ASSERT_EQ(f.size(), 2u);
         EXPECT_EQ(f[0]["id"], "pitfall.fp16-range");
         EXPECT_EQ(f[0]["severity"], "info");
         EXPECT_EQ(f[0]["evidence"]["reproduced"], true);
         EXPECT_EQ(f[0]["cells"], json({"fp16-range/wrong", "fp16-range/fix"}));
         EXPECT_EQ(text_of(f[0]), "fp16 without a scaler: 16-mixed with the scaler trains");
         EXPECT_EQ(f[1]["severity"], "warn");  // not reproduced
         EXPECT_EQ(text_of(f[1]), "one seed on every rank (not reproduced): no difference seen");
       },
       [] {
         json r = hand_report({});
         r["pitfalls"] = json::array();
         return r;
       },
       ""},
  };
}

const std::vector<RuleCase>& cases() {
  static const std::vector<RuleCase> all = [] {
    std::vector<RuleCase> out;
    for (auto part : {run_cases, precision_cases, checkpoint_cases, parallel_cases, hardware_cases, ssl_cases})
      for (auto& c : part()) out.push_back(std::move(c));
    return out;
  }();
  return all;
}

}  // namespace

// Every rule speaks on its minimal report, and every finding there is one some rule of the table writes.
// (One test over the table: a process per rule spent more starting than checking.)
TEST(Rules, EachFiresOnItsCase) {
  const auto& rules = recommendation_rules();
  for (const RuleCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const json recs = recommend(c.fires());
    const std::vector<json> found = findings_of(recs, c.rule);
    if (found.empty()) {
      ADD_FAILURE() << c.rule << " did not fire: " << recs.dump(1);
      continue;
    }
    for (const auto& f : found) {
      EXPECT_TRUE(id_of_rule(c.rule, f["id"])) << f["id"];
      EXPECT_TRUE(f["evidence"].is_object()) << f.dump();
      EXPECT_TRUE(f["cells"].is_array()) << f.dump();
    }
    c.check(found);
    for (const auto& r : recs)
      EXPECT_TRUE(std::any_of(rules.begin(), rules.end(), [&](const Rule& rule) { return id_of_rule(rule.id, r["id"]); }))
          << r["id"] << " is written by no rule of the table";
  }
}

// The near miss: each rule says nothing (and, where the case names one, another rule speaks instead).
TEST(Rules, EachStaysQuietOnItsNearMiss) {
  for (const RuleCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const json recs = recommend(c.quiet());
    EXPECT_TRUE(findings_of(recs, c.rule).empty()) << recs.dump(1);
    if (!c.instead.empty()) {
      EXPECT_FALSE(findings_of(recs, c.instead).empty()) << recs.dump(1);
    }
  }
}

// Every rule of the table has its pair of cases above, and no case tests a rule the table lacks: a new
// rule fails here until it has both. (checkpoint.leave-off is two rules: the groups' and the frontier's.)
TEST(RecommendationRules, EveryRuleHasAFiringAndAQuietCase) {
  std::vector<std::string> table, covered;
  for (const auto& r : recommendation_rules()) table.push_back(r.id);
  for (const auto& c : cases()) covered.push_back(c.rule);
  std::sort(table.begin(), table.end());
  std::sort(covered.begin(), covered.end());
  EXPECT_EQ(table, covered);
  EXPECT_EQ(recommendation_rules().size(), 31u);
}

// Each rule says when it speaks and what it cites; the rules of one pass stand together on one scope.
TEST(RecommendationRules, TheTableIsWellFormed) {
  const auto& rules = recommendation_rules();
  std::set<std::string> passes_closed;
  for (size_t i = 0; i < rules.size(); ++i) {
    const Rule& r = rules[i];
    EXPECT_FALSE(r.id.empty());
    EXPECT_EQ(r.id.find(' '), std::string::npos) << r.id;
    EXPECT_GT(r.when.size(), 10u) << r.id;
    EXPECT_GT(r.evidence.size(), 10u) << r.id;
    EXPECT_TRUE(r.apply != nullptr) << r.id;
    if (r.pass.empty()) continue;
    EXPECT_FALSE(passes_closed.count(r.pass)) << r.id << ": pass '" << r.pass << "' is split";
    if (i + 1 < rules.size() && rules[i + 1].pass == r.pass)
      EXPECT_EQ(rules[i + 1].scope, r.scope) << r.id;
    else
      passes_closed.insert(r.pass);
  }
  EXPECT_EQ(rules.front().id, "env.reference-blas");
  EXPECT_EQ(rules.back().id, "pitfall.<kind>");
}

// A pass takes each cell through all its rules before the next cell: ddp's exposed communication and
// scaling, then zero2's memory and exposed communication (the order reports have always had).
TEST(RecommendationRules, APassKeepsEachCellsFindingsTogether) {
  const json report = make_report(env(), json::object(),
                                  {single(), rank_cell("ddp", 2, 0.12, 1600e6, 0.40), rank_cell("zero2", 2, 0.13, 700e6, 0.30)});
  std::vector<std::string> parallel;
  for (const auto& r : recommend(report))
    if (r["id"].get<std::string>().rfind("parallel.", 0) == 0)
      parallel.push_back(r["id"].get<std::string>() + " " + r["cells"][0].get<std::string>());
  EXPECT_EQ(parallel, (std::vector<std::string>{"parallel.exposed-comm gpt-tiny/ddp/ws2", "parallel.scaling gpt-tiny/ddp/ws2",
                                                "parallel.zero-memory gpt-tiny/zero2/ws2",
                                                "parallel.exposed-comm gpt-tiny/zero2/ws2"}));
  EXPECT_EQ(report["recommendations"], recommend(report));
}

// bf16-mixed's finding, word for word and key for key, as reports have always had it.
TEST(RecommendationRules, Bf16MixedAgainstFp32IsUnchanged) {
  const json recs = recommend(bf16_pair("bf16-mixed", 0.004, 0.501, 0.848));
  ASSERT_EQ(recs.size(), 1u);
  EXPECT_EQ(recs[0]["id"], "precision.use-bf16-mixed");
  EXPECT_EQ(text_of(recs[0]), "mlp: bf16-mixed runs here at 2.50x the speed of fp32 (final loss 0.2% from fp32, accuracy 84.8% "
                              "vs 85.0%): use it");
  std::vector<std::string> keys, times;
  for (auto it = recs[0]["evidence"].begin(); it != recs[0]["evidence"].end(); ++it) keys.push_back(it.key());
  for (auto it = recs[0]["evidence"]["step_time_p50_s"].begin(); it != recs[0]["evidence"]["step_time_p50_s"].end(); ++it)
    times.push_back(it.key());
  EXPECT_EQ(keys, (std::vector<std::string>{"step_time_p50_s", "speedup", "final_loss", "final_loss_rel_diff", "thresholds", "accuracy"}));
  EXPECT_EQ(times, (std::vector<std::string>{"32-true", "bf16-mixed"}));
}

// bf16-master (bf16 weights cast from fp32 masters) is held against its 32-true sibling as bf16-mixed
// is, under its own name; its drift is said once, by the bf16 rule. bf16-true (no fp32 copy) is not.
TEST(RecommendationRules, Bf16MasterIsHeldAgainstItsFp32SiblingLikeBf16Mixed) {
  const json fast = recommend(bf16_pair("bf16-master", 0.005, 0.5005, 0.85));
  ASSERT_EQ(fast.size(), 1u) << fast.dump(1);
  EXPECT_EQ(fast[0]["id"], "precision.use-bf16-master");
  EXPECT_EQ(text_of(fast[0]), "mlp: bf16-master runs here at 2.00x the speed of fp32 (final loss 0.1% from fp32, accuracy 85.0% "
                              "vs 85.0%): use it");
  EXPECT_DOUBLE_EQ(number(fast[0], "/step_time_p50_s/bf16-master"), 0.005);
  EXPECT_EQ(fast[0]["cells"], json({"mlp/32-true", "mlp/bf16-master"}));

  const json drifting = recommend(bf16_pair("bf16-master", 0.005, 0.60, 0.70));
  ASSERT_EQ(drifting.size(), 1u) << drifting.dump(1);  // not precision.drifts as well
  EXPECT_EQ(drifting[0]["id"], "precision.bf16-drifts");
  PHRASE(drifting[0], "mlp: bf16-master drifts from fp32 (final loss 20.0% from fp32");

  const json slow = recommend(bf16_pair("bf16-master", 0.0095, 0.50, 0.85));
  ASSERT_EQ(slow.size(), 1u);
  EXPECT_EQ(slow[0]["id"], "precision.keep-fp32");
  PHRASE(slow[0], "mlp: bf16-master matches fp32");

  const json pure = recommend(bf16_pair("bf16-true", 0.005, 0.60, 0.70));
  ASSERT_EQ(pure.size(), 1u) << pure.dump(1);
  EXPECT_EQ(pure[0]["id"], "precision.drifts");
}

// The link and the published GEMM fraction are core/devices.hpp's, for every device it knows by a
// driver's name.
TEST(RecommendationRules, DeviceFactsComeFromTheDeviceTable) {
  int links = 0, fractions = 0;
  for (const auto& d : device_table()) {
    for (const auto& name : d.driver_names) {
      if (d.link_bytes_per_s > 0) {
        const json recs = recommend(make_report(gpus_env(name, 2), json::object(), {rank_cell("ddp", 2, 0.12, 1600e6, 0.1)}));
        const auto found = findings_of(recs, "parallel.busbw-vs-link");
        ASSERT_EQ(found.size(), 1u) << name;
        EXPECT_DOUBLE_EQ(number(found[0], "/link_gbps"), d.link_bytes_per_s / 1e9) << name;
        EXPECT_TRUE(says(found[0], name + "'s " + d.link + " per-direction")) << text_of(found[0]);
        ++links;
      }
      const auto bf16 = d.published_gemm_fraction.find("bf16");
      if (bf16 == d.published_gemm_fraction.end()) continue;
      const json recs = recommend(hand_report({hardware_cell("gemm", name, {{"gemm", json::array({gemm_of(0.5, 1e15)})}})}));
      const auto found = findings_of(recs, "hardware.gemm.<dtype>");
      ASSERT_EQ(found.size(), 1u) << name;
      EXPECT_DOUBLE_EQ(number(found[0], "/published_fraction"), bf16->second) << name;
      ++fractions;
    }
  }
  EXPECT_GE(links, 4);  // H100, H200, two A100s at least
  EXPECT_GE(fractions, 4);
}

// A tp cell's exposed communication names tp's share of it and tp's remedy, not the buckets' or prefetch's.
TEST(Rules, ExposedCommunicationUnderTpNamesTpsShare) {
  json tp = rank_cell("single", 2, 0.12, 800e6, 0.6);
  tp["layout"] = {{"name", "tp2"}, {"tp", 2}};
  tp["metrics"]["comm"]["exposed_comm_time_s"] = 0.04;
  tp["metrics"]["comm"]["dimensions"] = {{"tp", {{"comm_time_s", 0.04}, {"exposed_comm_time_s", 0.03}, {"bytes", 1e6}}}};
  const std::vector<json> f = findings_of(recommend(make_report(env(), json::object(), {single(), tp})), "parallel.exposed-comm");
  ASSERT_EQ(f.size(), 1u);
  EXPECT_DOUBLE_EQ(number(f[0], "/tp_exposed_comm_time_s"), 0.03);
  const std::string text = text_of(f[0]);
  EXPECT_NE(text.find("gpt-tiny/tp2: exposed communication is 60% of the step"), std::string::npos) << text;
  EXPECT_NE(text.find("75% of it tp's"), std::string::npos) << text;  // 0.03 of 0.04 s exposed
  EXPECT_EQ(text.find("bucket"), std::string::npos) << text;
}

// A pipeline cell's waits are its bubble: the finding gives the measured bubble beside the schedule's and
// the pipeline's remedies, not the buckets'.
TEST(Rules, ExposedCommunicationUnderPpIsTheBubble) {
  json pp = rank_cell("single", 2, 0.12, 800e6, 0.6);
  pp["layout"] = {{"name", "pp2"}, {"pp", 2}};
  pp["metrics"]["timing"]["pipeline"] = {{"schedule", "1f1b"}, {"ranks", 2}, {"stages_per_rank", 1}, {"microbatches", 4}, {"rank", 0},
                                         {"bubble", {{"measured", 0.5}, {"formula", 0.25}}},
                                         {"in_flight_microbatches", {{"measured", 2}, {"formula", 2}}}};
  const std::vector<json> f = findings_of(recommend(make_report(env(), json::object(), {single(), pp})), "parallel.exposed-comm");
  ASSERT_EQ(f.size(), 1u);
  EXPECT_DOUBLE_EQ(number(f[0], "/bubble_formula"), 0.25);
  const std::string text = text_of(f[0]);
  EXPECT_NE(text.find("gpt-tiny/pp2: the step waits 60% of its time"), std::string::npos) << text;
  EXPECT_NE(text.find("bubble 50% measured on rank 0, 25% by the schedule"), std::string::npos) << text;
  EXPECT_EQ(text.find("bucket"), std::string::npos) << text;
}
