// The report: atomic write and strict read, summary table, recommendations, the self-supervised summary.
#include <algorithm>
#include <dirent.h>
#include <cmath>
#include <fstream>
#include <iterator>
#include <map>

#include <gtest/gtest.h>

#include "test_support.hpp"

#include "test_paths.hpp"

#include "core/devices.hpp"
#include "core/errors.hpp"
#include "core/precision.hpp"
#include "core/units.hpp"
#include "reports/render/render.hpp"
#include "reports/report.hpp"
#include "report_fixtures.hpp"

using namespace trainscope;
using namespace trainscope::reports;

using trainscope::test::error_of;

namespace {

std::string tmp(const std::string& name) {
  const std::string dir = std::string(test::kScratchDir) + "/report";
  std::system(("mkdir -p " + dir).c_str());
  return dir + "/" + name;
}

json cell(const std::string& model, const std::string& precision, double p50, double loss, double acc) {
  return test::hand_cell(model, precision, p50, loss, acc);
}

json env_with_blas(bool reference) { return test::blas_env(reference); }

}  // namespace

TEST(Report, RoundTripThroughAnAtomicWrite) {
  const json r = make_report(env_with_blas(false), json{{"name", "t"}}, {cell("mlp", "32-true", 0.01, 0.5, 0.8)});
  const std::string path = tmp("report.json");
  write_json_atomic(path, r);
  const json back = read_report(path);
  EXPECT_EQ(back, r);
  EXPECT_EQ(back["schema"], "trainscope.report/1");
  EXPECT_EQ(read_report(tmp("")), r);  // a folder works too
  std::ifstream leftovers(path + ".tmp." + std::to_string(getpid()));
  EXPECT_FALSE(leftovers.good());
}

TEST(Report, CorruptOrForeignReportsAreOneLineErrors) {
  auto write = [](const std::string& name, const std::string& text) {
    std::ofstream(tmp(name)) << text;
    return tmp(name);
  };
  EXPECT_NE(error_of([&] { read_report(write("trunc.json", "{\"schema\": \"trainscope.rep")); }).find("not valid JSON"),
            std::string::npos);
  EXPECT_NE(error_of([&] { read_report(write("other.json", "{\"a\": 1}")); }).find("not a trainscope report"),
            std::string::npos);
  EXPECT_NE(error_of([&] { read_report(write("v9.json", "{\"schema\": \"trainscope.report/9\"}")); })
                .find("not supported"),
            std::string::npos);
  json r = make_report(json::object(), json::object(), {});
  r.erase("cells");
  EXPECT_NE(error_of([&] { read_report(write("nocells.json", r.dump())); }).find("lacks \"cells\""), std::string::npos);
  EXPECT_NE(error_of([&] { read_report(tmp("missing.json")); }).find("cannot read"), std::string::npos);
  json bad_cell = make_report(json::object(), json::object(), {cell("mlp", "32-true", 0.01, 0.5, 0.8)});
  bad_cell["cells"][0]["status"] = 5;
  json bad_created = bad_cell;
  bad_created["created"] = 20261202;
  EXPECT_NE(error_of([&] { read_report(write("badcreated.json", bad_created.dump())); }).find("wrong type"),
            std::string::npos);
  EXPECT_NE(error_of([&] { read_report(write("badcell.json", bad_cell.dump())); }).find("of the right type"),
            std::string::npos);
}

TEST(Report, SummaryShowsSpeedupAgainstTheFp32Sibling) {
  const json r = make_report(env_with_blas(false), json::object(),
                             {cell("mlp", "32-true", 0.010, 0.50, 0.85), cell("mlp", "bf16-mixed", 0.004, 0.501, 0.848)});
  const std::string s = render_summary(r);
  EXPECT_NE(s.find("2.50x"), std::string::npos) << s;
  EXPECT_NE(s.find("1.00x"), std::string::npos) << s;
  EXPECT_NE(s.find("85.0%"), std::string::npos) << s;
  EXPECT_NE(s.find("0.5010"), std::string::npos) << s;
}

// The digest that opens every report: the machine in one line; bf16-mixed at 2.5x fp32 with the same
// loss is the precision decision, with its number and a link to its evidence; the same warning said
// of five cells is one group of five, its headline two lines at most; the evidence as figures with
// units, and no JSON object in report.md.
TEST(Report, SummaryFirstGroupedRecommendationsAndEvidenceForPeople) {
  json env = env_with_blas(false);
  env["cpu"] = {{"model", "AMD EPYC"}, {"logical_cores", 2}};
  env["torch"] = {{"version", "2.11.0"}};
  json r = make_report(env, json::object(), {cell("mlp", "32-true", 0.010, 0.50, 0.85), cell("mlp", "bf16-mixed", 0.004, 0.501, 0.848)});
  EXPECT_EQ(machine_line(r["env"]), "AMD EPYC, 2 cores; no GPU; torch 2.11.0");
  for (int i = 0; i < 5; ++i)
    r["recommendations"].push_back({{"id", "precision.fp16-underflow"}, {"severity", "warn"},
                                    {"text", "cell" + std::to_string(i) + ": 80% of the gradients of fc0 are below fp16's normal range (6.1e-5) "
                                             "unscaled: in fp16 keep the loss scaler, or use bf16; this sentence goes on and on to be "
                                             "longer than two lines of a report so that the headline must be cut short somewhere"},
                                    {"evidence", {{"frac_below_fp16_normal", 0.8}, {"peak_bytes", 1048576}}},
                                    {"cells", {"c" + std::to_string(i)}}});
  const json digest = report_digest(r);
  ASSERT_FALSE(digest["decisions"].empty());
  EXPECT_EQ(digest["decisions"][0]["topic"], "Precision");
  EXPECT_NE(digest["decisions"][0]["text"].get<std::string>().find("2.50x"), std::string::npos) << digest.dump(1);
  const json groups = recommendation_groups(r);
  const auto warn = std::find_if(groups.begin(), groups.end(), [](const json& g) { return g["id"] == "precision.fp16-underflow"; });
  ASSERT_NE(warn, groups.end());
  EXPECT_EQ((*warn)["items"].size(), 5u);
  EXPECT_EQ(groups[0]["severity"], "warn");  // worst first
  const std::string headline = (*warn)["headline"];
  EXPECT_LE(headline.size(), 220u) << headline;
  EXPECT_NE(headline.find("and 4 more like it; cells: c0, c1, c2 and 2 more"), std::string::npos) << headline;
  EXPECT_EQ(headline.find("(6.1e-5)"), std::string::npos) << headline;  // the detail is behind the fold
  const json rows = evidence_rows((*warn)["items"][0]["evidence"]);
  EXPECT_EQ(rows, json::parse(R"([["frac below fp16 normal", "80.00%"], ["peak", "1.0 MiB"]])"));
  const std::string md = render_markdown(r);
  EXPECT_LT(md.find("## Summary"), md.find("## Cells"));
  EXPECT_LT(md.find("## Cells"), md.find("## Environment"));
  EXPECT_EQ(md.find("{\""), std::string::npos) << md;
  EXPECT_NE(md.find("([evidence](#rec-precision-use-bf16-mixed))"), std::string::npos) << md;
  EXPECT_NE(md.find("<a id=\"rec-precision-use-bf16-mixed\"></a>"), std::string::npos) << md;
  const std::string html = render_html(r);
  EXPECT_LT(html.find("id=\"summary\""), html.find("id=\"cells\""));
  EXPECT_NE(html.find("<details><summary>raw JSON</summary>"), std::string::npos);
  const std::string terminal = render_summary(r);
  EXPECT_EQ(terminal.rfind("machine: AMD EPYC", 0), 0u) << terminal;
}

TEST(Recommendations, Bf16RulesCiteTheirNumbers) {
  const json fast = recommend(make_report(env_with_blas(false), json::object(),
                                          {cell("mlp", "32-true", 0.010, 0.50, 0.85),
                                           cell("mlp", "bf16-mixed", 0.004, 0.501, 0.848)}));
  ASSERT_EQ(fast.size(), 1u);
  EXPECT_EQ(fast[0]["id"], "precision.use-bf16-mixed");
  EXPECT_NEAR(fast[0]["evidence"]["speedup"].get<double>(), 2.5, 1e-9);
  EXPECT_EQ(fast[0]["cells"], json({"mlp/32-true", "mlp/bf16-mixed"}));
  EXPECT_NE(fast[0]["text"].get<std::string>().find("2.50x"), std::string::npos);

  const json drift = recommend(make_report(env_with_blas(false), json::object(),
                                           {cell("mlp", "32-true", 0.010, 0.50, 0.85),
                                            cell("mlp", "bf16-mixed", 0.004, 0.70, 0.70)}));
  ASSERT_EQ(drift.size(), 1u);
  EXPECT_EQ(drift[0]["id"], "precision.bf16-drifts");
  EXPECT_EQ(drift[0]["severity"], "warn");

  const json slow = recommend(make_report(env_with_blas(false), json::object(),
                                          {cell("mlp", "32-true", 0.010, 0.50, 0.85),
                                           cell("mlp", "bf16-mixed", 0.0105, 0.50, 0.85)}));
  ASSERT_EQ(slow.size(), 1u);
  EXPECT_EQ(slow[0]["id"], "precision.keep-fp32");
}

TEST(Recommendations, ReferenceBlasAndFailedCells) {
  json bad = cell("mlp", "32-true", 0.01, 0.5, 0.8);
  bad["status"] = "timeout";
  bad["reason"] = "timed out after 5 s";
  const json recs = recommend(make_report(env_with_blas(true), json::object(), {bad}));
  ASSERT_EQ(recs.size(), 2u);
  EXPECT_EQ(recs[0]["id"], "env.reference-blas");
  EXPECT_EQ(recs[1]["id"], "run.cells-failed");
  EXPECT_EQ(recs[1]["severity"], "critical");
  EXPECT_NE(recs[1]["text"].get<std::string>().find("timed out after 5 s"), std::string::npos);
}

TEST(Recommendations, CheckpointingTradeoffAndLeaveOff) {
  auto ckpt_cell = [](const std::string& policy, double peak, double p50) {
    json c = cell("gpt-tiny", "32-true", p50, 1.0, 0.5);
    c["config"]["checkpoint"] = policy;
    c["name"] = "gpt-tiny/" + policy;
    c["metrics"]["memory"]["peak_bytes"] = peak;
    c["metrics"]["memory"]["activation_bytes"] = peak / 2;
    return c;
  };
  const json saves = make_report(env_with_blas(false), json::object(),
                                 {ckpt_cell("none", 100e6, 0.10), ckpt_cell("full", 40e6, 0.13)});
  EXPECT_NEAR(saves["cells"][1]["checkpointing"]["memory_saved_pct"].get<double>(), 60.0, 1e-9);
  EXPECT_NEAR(saves["cells"][1]["checkpointing"]["recompute_overhead_pct"].get<double>(), 30.0, 1e-9);
  ASSERT_EQ(saves["recommendations"].size(), 1u);
  EXPECT_EQ(saves["recommendations"][0]["id"], "checkpoint.tradeoff");
  EXPECT_NE(saves["recommendations"][0]["text"].get<std::string>().find("full: peak memory -60%, step time +30%"),
            std::string::npos);

  const json none_saved = make_report(env_with_blas(false), json::object(),
                                      {ckpt_cell("none", 100e6, 0.10), ckpt_cell("full", 99e6, 0.12)});
  ASSERT_EQ(none_saved["recommendations"].size(), 1u);
  EXPECT_EQ(none_saved["recommendations"][0]["id"], "checkpoint.leave-off");
}

// On 2 nodes: hsdp's communication mostly within a node, zero3's all across; the rule names the
// fastest on these links, each strategy's time per level and the level it waits on most.
TEST(Recommendations, HsdpAgainstZero3AndDdpAcrossNodes) {
  auto across = [](const std::string& strategy, double p50, json levels) {
    return test::across_nodes(cell("gpt-tiny", "32-true", p50, 1.0, 0.5), strategy, std::move(levels));
  };
  auto level = [](double s) { return json{{"comm_time_s", s}, {"exposed_comm_time_s", s}}; };
  const json hsdp = across("hsdp", 0.040, {{"intra-node", {{"comm_time_s", 0.030}, {"exposed_comm_time_s", 0.025}}},
                                           {"inter-node", level(0.020)}});
  const json zero3 = across("zero3", 0.090, {{"inter-node", level(0.070)}});
  const json ddp = across("ddp", 0.050, {{"inter-node", level(0.030)}});
  const json report = make_report(env_with_blas(false), json::object(), {hsdp, zero3, ddp});
  std::string text;
  for (const auto& r : report["recommendations"])
    if (r["id"] == "parallel.across-nodes") text += r["text"].get<std::string>();
  EXPECT_NE(text.find("gpt-tiny at 4 ranks on 2 nodes: hsdp 40.00 ms per step (communication 30.00 ms within a node, "
                      "20.00 ms across nodes; waits most on the links within a node); zero3 90.00 ms per step "
                      "(communication 70.00 ms across nodes; waits most on the links across nodes); ddp 50.00 ms"),
            std::string::npos) << text;
  EXPECT_NE(text.find("hsdp is fastest on these links"), std::string::npos) << text;
  // One node: nothing to compare across.
  json local = hsdp;
  local["nodes"] = json::array({local["nodes"][0]});
  for (const auto& r : make_report(env_with_blas(false), json::object(), {local, zero3})["recommendations"])
    EXPECT_NE(r["id"], "parallel.across-nodes");
}

TEST(Recommendations, ParallelCellsAgainstOneProcessDdpAndTheLink) {
  auto rank_cell = [](const std::string& strategy, int world, double p50, double state, double exposed) {
    return test::rank_cell(strategy, world, p50, state, exposed, 360.0);
  };
  json env = env_with_blas(false);
  env["gpus"] = json::array({{{"name", "NVIDIA H200"}}, {{"name", "NVIDIA H200"}}});
  json ddp = rank_cell("ddp", 2, 0.12, 1600e6, 0.40);
  ddp["metrics"]["rng"] = {{"streams", json::array({{{"name", "augmentation"}, {"class", "should-differ"},
                                                       {"verdict", "violated"}, {"first_violation_step", 10},
                                                       {"ranks", {0, 1}}}})},
                           {"violations", 1}};
  const json report = make_report(env, json::object(),
                                   {cell("gpt-tiny", "32-true", 0.10, 1.0, 0.5), ddp, rank_cell("zero2", 2, 0.13, 700e6, 0.1)});
  const json& p = report["cells"][1]["parallel"];
  EXPECT_NEAR(p["step_time_vs_single_pct"].get<double>(), 20.0, 1e-9);
  EXPECT_NEAR(p["scaling_efficiency"].get<double>(), (128 / 0.12) / (2 * 64 / 0.10), 1e-12);
  EXPECT_NEAR(report["cells"][2]["parallel"]["model_state_vs_ddp_pct"].get<double>(), 100.0 * (700.0 / 1600 - 1), 1e-9);
  std::map<std::string, std::string> by_id;
  for (const auto& r : report["recommendations"]) by_id[r["id"]] += r["text"].get<std::string>() + "\n";
  EXPECT_NE(by_id["parallel.zero-memory"].find("zero2 cuts model-state memory per rank from 1.5 GiB to 667.6 MiB at 2 ranks"),
            std::string::npos) << by_id["parallel.zero-memory"];
  EXPECT_NE(by_id["parallel.exposed-comm"].find("exposed communication is 40% of the step at 2 ranks"), std::string::npos)
      << by_id["parallel.exposed-comm"];
  EXPECT_EQ(by_id["parallel.exposed-comm"].find("zero2"), std::string::npos);  // 10% is under the threshold
  EXPECT_NE(by_id["parallel.scaling"].find("1.67x the throughput of one process"), std::string::npos) << by_id["parallel.scaling"];
  EXPECT_NE(by_id["parallel.busbw-vs-link"].find("busbw 360.0 GB/s, 80% of NVIDIA H200's NVLink 4"), std::string::npos)
      << by_id["parallel.busbw-vs-link"];
  EXPECT_NE(by_id["rng.augmentation"].find("violated from step 10 on ranks 0, 1: the augmentation stream is identical on "
                                           "all ranks: seed it per rank"),
            std::string::npos) << by_id["rng.augmentation"];
}

// ---- Self-supervised summary ----------------------------------------------------------------------
//
// Three cells by hand: a supervised sibling whose scratch runs log (seconds, accuracy) points, and two
// SimCLR cells on the same encoder that differ only in unlabeled_size. Per label seed i the SSL arm is
// max(probe_i, finetune_i), costing pre-training (+ the fine-tune when it won); the scratch arm is the
// best point of scratch_curve[i] within that cost.
//
// A (60000 images, 20 s pre-training):
//   1%:   fine-tune wins on every seed (.66 .67 .65), cost 20 + 1 = 21 s. Scratch within 21 s:
//         seed 0 max(.55 @10, .63 @15, .60 @20) = .63 (not the later .60, not .70 @40), seed 1 .62,
//         seed 2 .61. Deltas .03 .05 .04: mean .04, sd .01, t(0.975, 2) = 4.30265272974946,
//         half-width 4.30265272974946 * .01 / sqrt(3) = .0248413771: CI [.0151586, .0648414] > 0: pays off.
//   10%:  seed 0 probe .80 (>= .78) at 20 s vs scratch .79 @20: +.01; seed 1 fine-tune .80 at 22 s vs
//         .78 @20: +.02; seed 2 probe .81 at 20 s vs .83 @20: -.02. Mean .00333, sd .0208167,
//         half-width .0517111: CI [-.0483778, .0550444] spans 0: inconclusive.
//   100%: fine-tune .88 .87 .89 at 30 s vs scratch .92 @25 each: -.04 -.05 -.03, mean -.04, sd .01:
//         CI [-.0648414, -.0151586] < 0: does not.
//   Label equivalent (scratch's best over its whole curve, mean over seeds: 600 labels .70,
//   6000 .85, 60000 .95333): at 1% SSL reaches .66 <= .70: "<= 1%"; at 10% .80333 lies between
//   .70 and .85: t = .10333 / .15, labels = 600 * 10^t = 2931.4 (4.89%); at 100% .88: t = .03 / .10333,
//   labels = 6000 * 10^t = 11708 (19.5%).
// B (6000 images, 5 s pre-training), 1% only: fine-tune .55 .56 .54 at 6 s; every scratch point took
//   10 s or more, so each seed takes its first point (.55 .56 .54), flagged: deltas 0 0 0, CI [0, 0]:
//   inconclusive. B's linear .80 is under the raw-pixel floor .84 (-4.0 points); B collapsed at step 120.
namespace {

json scratch(const std::vector<std::pair<double, double>>& points) {
  json c = json::array();
  int steps = 0;
  for (const auto& [seconds, accuracy] : points) c.push_back({{"steps", steps += 50}, {"seconds", seconds}, {"accuracy", accuracy}});
  return c;
}

json ssl_section(const std::string& method, int64_t unlabeled, double wall_s, double step_s, double knn, double linear,
                 json label_efficiency) {
  return json{{"method", method},
              {"encoder", "cnn-tiny"},
              {"feature_dim", 32},
              {"unlabeled_size", unlabeled},
              {"pretrain", {{"steps", 600}, {"wall_s", wall_s}, {"step_time_s", step_s}, {"images_per_s", 256 / step_s},
                            {"views", method == "supervised" ? 1 : 2}, {"effective_batch", 256},
                            {"negatives", method == "simclr" ? json("global") : json(nullptr)}, {"projector_bn", nullptr}}},
              {"eval_wall_s", 14.2},
              {"protocol", {{"knn_k", 20}, {"knn_temperature", 0.07}, {"bank", 60000}, {"queries", 10000}, {"probe_epochs", 20},
                            {"finetune_steps", 150}, {"label_seeds", {0, 1, 2}}, {"fractions", {0.01, 0.1, 1.0}}}},
              {"frozen", {{"encoder", {{"knn", knn}, {"linear", linear}}},
                          {"random_encoder", {{"knn", 0.70}, {"linear", 0.75}}},
                          {"raw_pixels", {{"knn", 0.85}, {"linear", 0.84}}}}},
              {"label_efficiency", std::move(label_efficiency)}};
}

json ssl_health(bool collapsed) {
  json samples = json::array();
  for (int step = 0; step <= 120; step += 20)
    samples.push_back({{"step", step}, {"loss", 5.0}, {"embedding_std", collapsed && step == 120 ? 0.002 : 0.08},
                       {"rankme", collapsed && step == 120 ? 1.3 : 60.0 - step / 10.0}, {"teacher_entropy", nullptr}, {"kl", nullptr}});
  return json{{"every", 20}, {"dim", 128}, {"std_reference", 0.0884}, {"collapse_loss", 5.54}, {"samples", samples},
              {"verdict", collapsed ? "collapsed" : "healthy"}, {"collapse_step", collapsed ? json(120) : json(nullptr)},
              {"reason", collapsed ? "normalised-embedding std 0.002 is far below 1/sqrt(128) = 0.088" : ""}};
}

json ssl_cell(const std::string& name, const std::string& method, int64_t unlabeled_config, json ssl, json health) {
  json config = RunConfig{}.to_json();
  config["model"] = "cnn-tiny";
  config["batch_size"] = 256;
  config["method"] = method;
  config["unlabeled_size"] = unlabeled_config;
  json metrics{{"quality", {{"final_loss", 0.3}, {"accuracy", method == "supervised" ? json(0.90) : json(nullptr)},
                            {"loss_curve", json::array()}}},
               {"ssl", std::move(ssl)}};
  if (!health.is_null()) metrics["ssl_health"] = std::move(health);
  return json{{"name", name}, {"config", config}, {"status", "ok"}, {"emulated", false}, {"metrics", metrics}};
}

std::vector<json> ssl_cells() {
  const json sup_rows = json::array(
      {{{"fraction", 0.01}, {"labels", 600},
        {"scratch_curve", {scratch({{10, .55}, {15, .63}, {20, .60}, {40, .70}}), scratch({{10, .56}, {20, .62}, {40, .71}}),
                           scratch({{10, .54}, {20, .61}, {40, .69}})}}},
       {{"fraction", 0.1}, {"labels", 6000},
        {"scratch_curve", {scratch({{10, .70}, {20, .79}, {30, .85}}), scratch({{10, .72}, {20, .78}, {30, .86}}),
                           scratch({{10, .71}, {20, .83}, {30, .84}})}}},
       {{"fraction", 1.0}, {"labels", 60000},
        {"scratch_curve", {scratch({{10, .85}, {25, .92}, {60, .95}}), scratch({{10, .86}, {25, .92}, {60, .96}}),
                           scratch({{10, .84}, {25, .92}, {60, .95}})}}}});
  const json a_rows = json::array(
      {{{"fraction", 0.01}, {"labels", 600}, {"probe", {.60, .62, .61}}, {"finetune", {.66, .67, .65}}, {"finetune_s", {1.0, 1.0, 1.0}}},
       {{"fraction", 0.1}, {"labels", 6000}, {"probe", {.80, .79, .81}}, {"finetune", {.78, .80, .79}}, {"finetune_s", {2.0, 2.0, 2.0}}},
       {{"fraction", 1.0}, {"labels", 60000}, {"probe", {.86, .86, .86}}, {"finetune", {.88, .87, .89}}, {"finetune_s", {10.0, 10.0, 10.0}}}});
  const json b_rows = json::array(
      {{{"fraction", 0.01}, {"labels", 600}, {"probe", {.50, .52, .51}}, {"finetune", {.55, .56, .54}}, {"finetune_s", {1.0, 1.0, 1.0}}}});
  return {ssl_cell("cnn-tiny/supervised", "supervised", 0, ssl_section("supervised", 60000, 6.0, 0.010, 0.88, 0.89, sup_rows), nullptr),
          ssl_cell("cnn-tiny/simclr", "simclr", 0, ssl_section("simclr", 60000, 20.0, 0.030, 0.80, 0.86, a_rows), ssl_health(false)),
          ssl_cell("cnn-tiny/simclr/u6000", "simclr", 6000, ssl_section("simclr", 6000, 5.0, 0.025, 0.74, 0.80, b_rows), ssl_health(true))};
}

json valid_env() {
  return json{{"host", "h"}, {"cpu", {{"model", "cpu"}, {"logical_cores", 2}, {"flags", json::array()}}}, {"memory_bytes", 1 << 30},
              {"os", json::object()}, {"compiler", "c++"}, {"torch", {{"version", "2"}, {"cuda_available", false}}},
              {"blas", {{"name", "OpenBLAS (openmp)"}, {"path", nullptr}, {"reference", false}}},
              {"cuda", {{"toolkit", nullptr}, {"status", "no device"}, {"device_count", 0}, {"devices", json::array()}}},
              {"gpus", json::array()}};
}

json ssl_report(std::vector<json> cells = ssl_cells()) {
  return make_report(valid_env(), json{{"name", "ssl"}, {"base", json::object()}, {"axes", {{"method", {"supervised", "simclr"}}}}},
                     cells);
}

const json& efficiency(const json& report, const std::string& cell, double fraction) {
  for (const auto& e : report["ssl"]["label_efficiency"])
    if (e["cell"] == cell && std::fabs(e["fraction"].get<double>() - fraction) < 1e-12) return e;
  throw std::runtime_error("no label-efficiency row for " + cell);
}

std::map<std::string, std::vector<json>> recs_by_id(const json& report) {
  std::map<std::string, std::vector<json>> by;
  for (const auto& r : report["recommendations"]) by[r["id"]].push_back(r);
  return by;
}

constexpr double kT2 = 4.30265272974946;  // t(0.975, 2 degrees of freedom)

}  // namespace

TEST(Ssl, StudentTQuantileTableAndBeyond) {
  EXPECT_NEAR(student_t975(1), 12.7062047361747, 1e-12);
  EXPECT_NEAR(student_t975(2), kT2, 1e-12);
  EXPECT_NEAR(student_t975(10), 2.22813885198627, 1e-12);
  EXPECT_NEAR(student_t975(20), 2.08596344726586, 1e-4);
  EXPECT_NEAR(student_t975(60), 2.00029782201045, 1e-5);
  EXPECT_TRUE(std::isnan(student_t975(0)));
}

TEST(Ssl, PairsSeedsAndTakesTheBestScratchRunWithinTheCompute) {
  const json r = ssl_report();
  ASSERT_TRUE(r.contains("ssl"));
  const json& one = efficiency(r, "cnn-tiny/simclr", 0.01);
  EXPECT_EQ(one["supervised_cell"], "cnn-tiny/supervised");
  ASSERT_EQ(one["seeds"].size(), 3u);
  const json& s0 = one["seeds"][0];
  EXPECT_EQ(s0["ssl_path"], "finetune");
  EXPECT_NEAR(s0["ssl_cost_s"].get<double>(), 21.0, 1e-12);
  EXPECT_NEAR(s0["scratch_accuracy"].get<double>(), 0.63, 1e-12);  // the best within 21 s, not the last
  EXPECT_EQ(s0["scratch_steps"], 100);
  EXPECT_EQ(s0["scratch_within_compute"], true);
  EXPECT_NEAR(one["seeds"][1]["scratch_accuracy"].get<double>(), 0.62, 1e-12);
  EXPECT_NEAR(one["seeds"][2]["scratch_accuracy"].get<double>(), 0.61, 1e-12);
  const json& ten = efficiency(r, "cnn-tiny/simclr", 0.1);
  EXPECT_EQ(ten["seeds"][0]["ssl_path"], "probe");
  EXPECT_NEAR(ten["seeds"][0]["ssl_cost_s"].get<double>(), 20.0, 1e-12);
  EXPECT_EQ(ten["seeds"][1]["ssl_path"], "finetune");
  EXPECT_NEAR(ten["seeds"][1]["ssl_cost_s"].get<double>(), 22.0, 1e-12);
  EXPECT_NEAR(ten["seeds"][1]["scratch_accuracy"].get<double>(), 0.78, 1e-12);
  EXPECT_NEAR(ten["finetune_s_mean"].get<double>(), 2.0, 1e-12);
  EXPECT_EQ(ten["scratch_outside_compute"], 0);
  // B's 6 s buys no scratch point: each seed is held against the first one, flagged.
  const json& b = efficiency(r, "cnn-tiny/simclr/u6000", 0.01);
  EXPECT_EQ(b["supervised_cell"], "cnn-tiny/supervised");  // by the nearest configuration
  EXPECT_EQ(b["scratch_outside_compute"], 3);
  EXPECT_EQ(b["seeds"][1]["scratch_within_compute"], false);
  EXPECT_NEAR(b["seeds"][1]["scratch_accuracy"].get<double>(), 0.56, 1e-12);
  EXPECT_EQ(b["seeds"][1]["scratch_seconds"], 10.0);
}

TEST(Ssl, DeltaMeanIntervalAndEachVerdict) {
  const json r = ssl_report();
  const double half1 = kT2 * 0.01 / std::sqrt(3.0);
  const json& one = efficiency(r, "cnn-tiny/simclr", 0.01);
  EXPECT_EQ(one["n"], 3);
  EXPECT_NEAR(one["delta_mean"].get<double>(), 0.04, 1e-9);
  EXPECT_NEAR(one["delta_sd"].get<double>(), 0.01, 1e-9);
  EXPECT_NEAR(one["delta_low"].get<double>(), 0.04 - half1, 1e-9);
  EXPECT_NEAR(one["delta_high"].get<double>(), 0.04 + half1, 1e-9);
  EXPECT_EQ(one["verdict"], "pays off");

  const json& ten = efficiency(r, "cnn-tiny/simclr", 0.1);
  const double m = 0.01 / 3, sd = std::sqrt((std::pow(0.01 - m, 2) + std::pow(0.02 - m, 2) + std::pow(-0.02 - m, 2)) / 2);
  EXPECT_NEAR(ten["delta_mean"].get<double>(), m, 1e-9);
  EXPECT_NEAR(ten["delta_low"].get<double>(), m - kT2 * sd / std::sqrt(3.0), 1e-9);
  EXPECT_NEAR(ten["delta_high"].get<double>(), m + kT2 * sd / std::sqrt(3.0), 1e-9);
  EXPECT_NEAR(ten["delta_low"].get<double>(), -0.0483778, 1e-6);
  EXPECT_EQ(ten["verdict"], "inconclusive");

  const json& all = efficiency(r, "cnn-tiny/simclr", 1.0);
  EXPECT_NEAR(all["delta_mean"].get<double>(), -0.04, 1e-9);
  EXPECT_NEAR(all["delta_high"].get<double>(), -0.04 + half1, 1e-9);
  EXPECT_EQ(all["verdict"], "does not");

  const json& b = efficiency(r, "cnn-tiny/simclr/u6000", 0.01);
  EXPECT_NEAR(b["delta_low"].get<double>(), 0.0, 1e-12);
  EXPECT_NEAR(b["delta_high"].get<double>(), 0.0, 1e-12);
  EXPECT_EQ(b["verdict"], "inconclusive");
}

TEST(Ssl, LabelEquivalentInterpolatesInLogLabels) {
  const json r = ssl_report();
  const json& one = efficiency(r, "cnn-tiny/simclr", 0.01)["label_equivalent"];
  EXPECT_EQ(one["bound"], "at_most");
  EXPECT_EQ(one["text"], "<= 1%");
  const json& ten = efficiency(r, "cnn-tiny/simclr", 0.1)["label_equivalent"];
  const double t10 = (0.80 + 0.80 + 0.81) / 3 - 0.70;
  EXPECT_EQ(ten["bound"], "interpolated");
  EXPECT_NEAR(ten["labels"].get<double>(), 600 * std::pow(10.0, t10 / 0.15), 1e-6);
  EXPECT_NEAR(ten["fraction"].get<double>(), 0.01 * std::pow(10.0, t10 / 0.15), 1e-9);
  EXPECT_NEAR(ten["multiplier"].get<double>(), std::pow(10.0, t10 / 0.15) / 10, 1e-9);
  EXPECT_EQ(ten["text"], "4.89%");
  const json& all = efficiency(r, "cnn-tiny/simclr", 1.0)["label_equivalent"];
  const double top = (0.95 + 0.96 + 0.95) / 3;
  EXPECT_NEAR(all["labels"].get<double>(), 6000 * std::pow(10.0, (0.88 - 0.85) / (top - 0.85)), 1e-6);
  EXPECT_NEAR(all["fraction"].get<double>(), 0.1 * std::pow(10.0, (0.88 - 0.85) / (top - 0.85)), 1e-9);
  EXPECT_EQ(all["text"], "19.5%");
  // Above everything the scratch arm reached: no number, a bound.
  std::vector<json> cells = ssl_cells();
  cells[1]["metrics"]["ssl"]["label_efficiency"][2]["finetune"] = {0.97, 0.97, 0.97};
  const json higher = ssl_report(cells);
  const json& above = efficiency(higher, "cnn-tiny/simclr", 1.0)["label_equivalent"];
  EXPECT_EQ(above["bound"], "above");
  EXPECT_TRUE(above["fraction"].is_null());
  EXPECT_EQ(above["text"], "> 100%");
}

TEST(Ssl, RowsHoldEachEncoderAgainstItsFloorsAndSibling) {
  const json r = ssl_report();
  const json& rows = r["ssl"]["rows"];
  ASSERT_EQ(rows.size(), 3u);
  const json& a = rows[1];
  EXPECT_EQ(a["cell"], "cnn-tiny/simclr");
  EXPECT_EQ(a["unlabeled_size"], 60000);
  EXPECT_EQ(a["beats_floors"], true);
  EXPECT_EQ(a["floor"], "raw-pixel");
  EXPECT_NEAR(a["finetune_full"].get<double>(), 0.88, 1e-12);
  EXPECT_NEAR(a["supervised_accuracy"].get<double>(), 0.90, 1e-12);
  EXPECT_NEAR(a["step_cost_vs_supervised"].get<double>(), 3.0, 1e-12);
  EXPECT_EQ(a["health"], "healthy");
  const json& b = rows[2];
  EXPECT_EQ(b["beats_floors"], false);
  EXPECT_TRUE(b["finetune_full"].is_null());
  EXPECT_EQ(b["health"], "collapsed");
  EXPECT_EQ(b["collapse_step"], 120);
  EXPECT_EQ(rows[0]["method"], "supervised");
  EXPECT_TRUE(rows[0]["supervised_cell"].is_null());
  // Different batch sizes: no step-cost ratio (the sibling is still found, by the nearest configuration).
  std::vector<json> cells = ssl_cells();
  cells[0]["config"]["batch_size"] = 128;
  const json other = ssl_report(cells);
  EXPECT_EQ(other["ssl"]["rows"][1]["supervised_cell"], "cnn-tiny/supervised");
  EXPECT_TRUE(other["ssl"]["rows"][1]["step_cost_vs_supervised"].is_null());
  // A sibling without metrics.ssl: its step time comes from its timing.
  cells = ssl_cells();
  cells[0]["metrics"].erase("ssl");
  cells[0]["metrics"]["timing"] = {{"step_time_s", {{"p50", 0.015}}}};
  const json bare = ssl_report(cells);
  EXPECT_EQ(bare["ssl"]["rows"][0]["cell"], "cnn-tiny/simclr");
  EXPECT_NEAR(bare["ssl"]["rows"][0]["step_cost_vs_supervised"].get<double>(), 2.0, 1e-12);
  EXPECT_EQ(efficiency(bare, "cnn-tiny/simclr", 0.01)["verdict"], nullptr);  // no scratch arm

  const json& sizes = r["ssl"]["data_size"];
  ASSERT_EQ(sizes.size(), 1u);
  EXPECT_EQ(sizes[0]["method"], "simclr");
  EXPECT_EQ(sizes[0]["fraction"], 0.01);
  ASSERT_EQ(sizes[0]["rows"].size(), 2u);
  EXPECT_EQ(sizes[0]["rows"][0]["cell"], "cnn-tiny/simclr/u6000");
  EXPECT_EQ(sizes[0]["rows"][0]["unlabeled_size"], 6000);
  EXPECT_NEAR(sizes[0]["rows"][0]["finetune"].get<double>(), 0.55, 1e-12);
  EXPECT_EQ(sizes[0]["rows"][1]["unlabeled_size"], 60000);
  EXPECT_NEAR(sizes[0]["rows"][1]["linear"].get<double>(), 0.86, 1e-12);
}

TEST(Ssl, RecommendationsCiteTheirNumbers) {
  const json r = ssl_report();
  auto by = recs_by_id(r);
  ASSERT_EQ(by["ssl-label-efficiency"].size(), 2u);
  const json& a = by["ssl-label-efficiency"][0];
  EXPECT_EQ(a["severity"], "info");
  EXPECT_EQ(a["cells"], json({"cnn-tiny/simclr", "cnn-tiny/supervised"}));
  EXPECT_EQ(a["text"],
            "simclr on cnn-tiny (cnn-tiny/simclr) pays off at 1% labels (+4.0 points, 95% CI +1.5..+6.5, over 3 label "
            "seeds at 20 s pre-training + 1.0 s fine-tune against the best scratch run within that compute); "
            "inconclusive at 10% (+0.3 points, 95% CI -4.8..+5.5, at 20 s pre-training + 2.0 s fine-tune on 1 of 3 seeds, "
            "a linear probe on the others); does not at 100% (-4.0 points, 95% CI -6.5..-1.5, at 20 s pre-training + "
            "10 s fine-tune)");
  EXPECT_NEAR(a["evidence"]["fractions"][0]["delta_low"].get<double>(), 0.04 - kT2 * 0.01 / std::sqrt(3.0), 1e-9);
  EXPECT_NE(by["ssl-label-efficiency"][1]["text"].get<std::string>().find("even the scratch run's first logged point took longer"),
            std::string::npos);

  ASSERT_EQ(by["ssl-below-floor"].size(), 1u);
  const json& f = by["ssl-below-floor"][0];
  EXPECT_EQ(f["severity"], "warn");
  EXPECT_EQ(f["cells"], json({"cnn-tiny/simclr/u6000"}));
  EXPECT_EQ(f["evidence"]["floor"], "raw-pixel");
  EXPECT_NEAR(f["evidence"]["margin"].get<double>(), -0.04, 1e-12);
  EXPECT_NE(f["text"].get<std::string>().find("reaches 0.800, -4.0 points against the raw-pixel floor (0.840); the "
                                              "random-encoder floor is 0.750"),
            std::string::npos) << f["text"];

  ASSERT_EQ(by["ssl-collapse"].size(), 1u);
  EXPECT_EQ(by["ssl-collapse"][0]["severity"], "critical");
  EXPECT_NE(by["ssl-collapse"][0]["text"].get<std::string>().find(
                "cnn-tiny/simclr/u6000: simclr collapsed at step 120: normalised-embedding std 0.002 is far below"),
            std::string::npos) << by["ssl-collapse"][0]["text"];
  EXPECT_EQ(by["ssl-collapse"][0]["evidence"]["sample"]["rankme"], 1.3);

  ASSERT_EQ(by["ssl-data-size"].size(), 1u);
  EXPECT_EQ(by["ssl-data-size"][0]["text"],
            "pre-training simclr on cnn-tiny on 6000 images reaches 0.800 linear vs 0.860 on 60000; fine-tuned on 1% "
            "of the labels, 0.550 vs 0.660");
  EXPECT_EQ(r["recommendations"].size(), 5u) << r["recommendations"].dump(1);
}

TEST(Ssl, MarkdownHtmlAndSummaryShowTheSection) {
  const json r = ssl_report();
  const std::string md = render_markdown(r);
  EXPECT_NE(md.find("\n## Self-supervised pre-training\n"), std::string::npos) << md;
  EXPECT_NE(md.find("### Frozen encoders against their floors and the supervised sibling"), std::string::npos);
  EXPECT_NE(md.find("| cnn-tiny/simclr | simclr | cnn-tiny | 60000 | 0.800 | 0.860 | 0.880 | 0.700 / 0.750 | 0.850 / 0.840 | "
                    "0.900 | yes | 20 s | 8.5k | 3.00x | healthy |"),
            std::string::npos) << md;
  EXPECT_NE(md.find("| cnn-tiny/simclr | 1% | 600 | 0.660 (fine-tune) | 0.620 | +4.0 [+1.5, +6.5] over 3 | pays off | 21 s | <= 1% |"),
            std::string::npos) << md;
  EXPECT_NE(md.find("| 10% | 6000 | 0.803 (probe/fine-tune) | 0.800 | +0.3 [-4.8, +5.5] over 3 | inconclusive | 21 s | 4.89% |"),
            std::string::npos) << md;
  EXPECT_NE(md.find("does not | 30 s | 19.5% |"), std::string::npos) << md;
  EXPECT_NE(md.find("0.550 (3 beyond the compute)"), std::string::npos) << md;
  EXPECT_NE(md.find("### Unlabeled data size"), std::string::npos);
  EXPECT_NE(md.find("| simclr on cnn-tiny | cnn-tiny/simclr/u6000 | 6000 | 0.800 | 0.740 | 0.550 at 1% | 5.0 s |"),
            std::string::npos) << md;
  EXPECT_NE(md.find("no (raw-pixel)"), std::string::npos);
  EXPECT_NE(md.find("collapsed at step 120"), std::string::npos);

  const std::string html = render_html(r);
  EXPECT_NE(html.find("<h2 id=\"self-supervised-pre-training\">Self-supervised pre-training</h2>"), std::string::npos);
  EXPECT_NE(html.find("<td>+4.0 [+1.5, +6.5] over 3</td>"), std::string::npos);
  std::ifstream chartjs(kChartJsPath);
  if (chartjs.good()) {
    EXPECT_NE(html.find("id=\"ssl-rankme\""), std::string::npos);
  }

  const std::string summary = render_summary(r);
  EXPECT_NE(summary.find("vs scratch: 1% pays off (+4.0 [+1.5, +6.5] points); 10% inconclusive"), std::string::npos) << summary;
}

TEST(Ssl, AReportWithoutSslCellsHasNoSslSection) {
  const json r = make_report(env_with_blas(false), json::object(),
                             {cell("mlp", "32-true", 0.010, 0.50, 0.85), cell("mlp", "bf16-mixed", 0.004, 0.501, 0.848)});
  EXPECT_FALSE(r.contains("ssl"));
  for (const auto& rec : r["recommendations"]) EXPECT_NE(rec["id"].get<std::string>().rfind("ssl-", 0), 0u) << rec["id"];
  EXPECT_EQ(render_markdown(r).find("Self-supervised"), std::string::npos);
  EXPECT_TRUE(ssl_summary(r).is_null());
}

TEST(Ssl, TheReportValidatesAgainstTheSchema) {
  const json r = ssl_report();
  const std::string path = tmp("ssl-report.json");
  write_json_atomic(path, r);
  const std::string source = test::kSourceDir;
  const std::string cmd = "/usr/bin/python3 " + source + "/tests/validate_report.py " + source +
                          "/reports/schema/report.schema.json " + path + " > " + path + ".out 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream out(path + ".out");
  const std::string said((std::istreambuf_iterator<char>(out)), std::istreambuf_iterator<char>());
  EXPECT_EQ(rc, 0) << said;
  // A contract violation is caught: a verdict outside the vocabulary.
  json bad = r;
  bad["cells"][2]["metrics"]["ssl_health"]["verdict"] = "fine";
  write_json_atomic(path, bad);
  EXPECT_NE(std::system(cmd.c_str()), 0);
}

// A cell that starts from the encoder another cell saved pays for that pre-training too: C's 4 s plus
// A's 20 s, so its probe (no fine-tune) costs 24 s and meets scratch's best within 24 s (.63 .62 .61).
TEST(Ssl, ACellStartedFromAnotherCellsEncoderCountsItsPreTraining) {
  std::vector<json> cells = ssl_cells();
  cells[1]["config"]["save_encoder"] = "encoders/simclr.pt";
  json c = ssl_cell("cnn-tiny/simclr/continued", "simclr", 0,
                    ssl_section("simclr", 60000, 4.0, 0.030, 0.81, 0.87,
                                json::array({{{"fraction", 0.01}, {"labels", 600}, {"probe", {.70, .71, .72}}}})),
                    ssl_health(false));
  c["config"]["pretrained"] = "encoders/simclr.pt";
  cells.push_back(c);
  const json r = ssl_report(cells);
  const json& e = efficiency(r, "cnn-tiny/simclr/continued", 0.01);
  EXPECT_EQ(e["pretrained_from"], "cnn-tiny/simclr");
  EXPECT_NEAR(e["upstream_pretrain_wall_s"].get<double>(), 20.0, 1e-12);
  EXPECT_EQ(e["seeds"][0]["ssl_path"], "probe");
  EXPECT_NEAR(e["seeds"][0]["ssl_cost_s"].get<double>(), 24.0, 1e-12);
  EXPECT_NEAR(e["delta_mean"].get<double>(), 0.09, 1e-9);
  EXPECT_EQ(e["supervised_cell"], "cnn-tiny/supervised");
  std::string text;
  for (const auto& rec : r["recommendations"])
    if (rec["id"] == "ssl-label-efficiency" && rec["cells"][0] == "cnn-tiny/simclr/continued") text = rec["text"];
  EXPECT_NE(text.find("at 24 s pre-training (20 s of it in cnn-tiny/simclr, whose encoder it starts from) + a linear probe"),
            std::string::npos) << text;
  // An encoder no cell of the report saved: its pre-training cannot be counted, and the text says so.
  cells.back()["config"]["pretrained"] = "elsewhere.pt";
  const json r2 = ssl_report(cells);
  EXPECT_NEAR(efficiency(r2, "cnn-tiny/simclr/continued", 0.01)["seeds"][0]["ssl_cost_s"].get<double>(), 4.0, 1e-12);
  std::string text2;
  for (const auto& rec : r2["recommendations"])
    if (rec["id"] == "ssl-label-efficiency" && rec["cells"][0] == "cnn-tiny/simclr/continued") text2 = rec["text"];
  EXPECT_NE(text2.find("not counting the pre-training of elsewhere.pt"), std::string::npos) << text2;
}

// ---- the pitfalls section ---------------------------------------------------------------------
namespace {

json with_pitfall(const std::string& kind, json wrong, json fix, json reference = json::array()) {
  return json{{"name", "pitfalls"},
              {"pitfalls", json::array({{{"id", kind}, {"kind", kind}, {"title", "t-" + kind}, {"wrong", wrong},
                                          {"fix", fix}, {"reference", reference}}})}};
}

json rank_peaks(json c, double r0, double r1) {
  c["ranks"] = json::array({{{"rank", 0}, {"peak_bytes", r0}}, {{"rank", 1}, {"peak_bytes", r1}}});
  return c;
}

json checkpointed(const std::string& name, const std::string& policy, int64_t batch, const std::string& status, double p50) {
  json c = cell("gpt-tiny", "32-true", p50, 1.0, 0.0);
  c["name"] = name;
  c["status"] = status;
  c["config"]["parallel"] = "zero3";
  c["config"]["world_size"] = 2;
  c["config"]["checkpoint"] = policy;
  c["config"]["batch_size"] = batch;
  c["config"]["memory_budget"] = "48MiB";
  if (status != "ok") {
    c.erase("metrics");
    c["reason"] = "rank 1 out of memory (world of 2)";
  }
  return c;
}

}  // namespace

TEST(Pitfalls, Fp16RangeNamesTheBlocksAndTheFixAgainstFp32) {
  json fp32 = cell("gpt-tiny", "32-true", 0.030, 3.90, 0.0);
  json nan = cell("gpt-tiny", "16-mixed-noscale", 0.120, NAN, 0.0);
  nan["status"] = "diverged";
  nan["metrics"]["quality"]["final_loss"] = nullptr;
  nan["metrics"]["overflow"] = {{"nonfinite_loss_steps", 10}, {"first_nonfinite_loss_step", 1}, {"first_overflow_step", 0},
                                {"nonfinite_grad_steps", 11}, {"skipped_steps", 0},
                                {"layers", json::array({{{"block", "embed"}, {"activation", {{"frac_beyond_fp16", 0.25}}}, {"gradient", {{"frac_beyond_fp16", 1.0}}}},
                                                        {{"block", "head"}, {"activation", {{"frac_beyond_fp16", 0.0}}}, {"gradient", {{"frac_beyond_fp16", 0.0}}}}})}};
  json bf16 = cell("gpt-tiny", "bf16-mixed", 0.024, 3.91, 0.0);
  json env = env_with_blas(false);
  env["cpu"] = {{"flags", {{"avx512_bf16", true}, {"amx_bf16", false}}}};
  const json r = make_report(env, with_pitfall("fp16-range", {"gpt-tiny/16-mixed-noscale"}, {"gpt-tiny/bf16-mixed"}), {fp32, nan, bf16});
  const json& p = r["pitfalls"][0];
  EXPECT_EQ(p["reproduced"], true) << p.dump(1);
  EXPECT_NE(p["wrong"][0]["summary"].get<std::string>().find("the loss went non-finite at step 1"), std::string::npos);
  EXPECT_NE(p["saw"][0].get<std::string>().find("embed (100%)"), std::string::npos) << p["saw"].dump();
  EXPECT_EQ(p["saw"][0].get<std::string>().find("head"), std::string::npos);  // never left the range
  // 3.91 / 3.90 - 1 = 0.256%: within the 2% match threshold.
  EXPECT_NE(p["fix"][0]["summary"].get<std::string>().find("0.3% from fp32 (matches)"), std::string::npos) << p["fix"].dump();
  EXPECT_NE(p["cost"][0].get<std::string>().find("0.80x of fp32's, 0.20x of the fp16 cell's"), std::string::npos) << p["cost"].dump();
  EXPECT_NE(p["verdict"].get<std::string>().find("use bf16-mixed"), std::string::npos);
  // The same cells on a CPU without bf16 instructions: the fix still matches, and the advice keeps the scaler.
  env["cpu"]["flags"]["avx512_bf16"] = false;
  const json r2 = make_report(env, with_pitfall("fp16-range", {"gpt-tiny/16-mixed-noscale"}, {"gpt-tiny/bf16-mixed"}), {fp32, nan, bf16});
  EXPECT_NE(r2["pitfalls"][0]["verdict"].get<std::string>().find("keep 16-mixed with the loss scaler"), std::string::npos);
  bool cited = false;
  for (const auto& rec : r2["recommendations"]) cited = cited || rec["id"] == "pitfall.fp16-range";
  EXPECT_TRUE(cited);
}

TEST(Pitfalls, MemoryNamesTheCheapestPolicyThatFitsAndItsRecomputeCost) {
  const json none = checkpointed("none/bs192", "none", 192, "oom", 0);
  const json full = rank_peaks(checkpointed("full/bs192", "full", 192, "ok", 0.50), 30e6, 40e6);
  const json every = rank_peaks(checkpointed("every2/bs192", "every:2", 192, "ok", 0.40), 41e6, 35e6);
  const json rn = checkpointed("none/bs32", "none", 32, "ok", 0.10), rf = checkpointed("full/bs32", "full", 32, "ok", 0.13),
             re = checkpointed("every2/bs32", "every:2", 32, "ok", 0.12);
  const json suite = with_pitfall("memory", {"none/bs192"}, {"full/bs192", "every2/bs192"}, {"none/bs32", "full/bs32", "every2/bs32"});
  const json r = make_report(env_with_blas(false), suite, {none, full, every, rn, rf, re});
  const json& p = r["pitfalls"][0];
  EXPECT_EQ(p["reproduced"], true) << p.dump(1);
  // every:2 is the faster fit (0.40 s against 0.50 s); its cost at batch 32: 0.12 / 0.10 - 1 = +20%.
  EXPECT_NE(p["verdict"].get<std::string>().find("the cheapest policy that fits is every:2"), std::string::npos) << p["verdict"];
  EXPECT_NE(p["verdict"].get<std::string>().find("recompute cost +20%"), std::string::npos) << p["verdict"];
  EXPECT_NE(p["fix"][0]["summary"].get<std::string>().find("recompute cost +30%"), std::string::npos);
  // The largest rank's peak: rank 0's 41 MB for every:2.
  EXPECT_NE(p["fix"][1]["summary"].get<std::string>().find(format_bytes(41e6) + " on the largest rank"), std::string::npos)
      << p["fix"][1].dump();
  EXPECT_NE(p["saw"][0].get<std::string>().find("out of memory"), std::string::npos);
  // Nothing fits: not reproduced, and the recommendation says so at warn.
  const json r2 = make_report(env_with_blas(false), suite, {none, checkpointed("full/bs192", "full", 192, "oom", 0),
                                                            checkpointed("every2/bs192", "every:2", 192, "oom", 0), rn, rf, re});
  EXPECT_EQ(r2["pitfalls"][0]["reproduced"], false);
  for (const auto& rec : r2["recommendations"]) {
    if (rec["id"] == "pitfall.memory") {
      EXPECT_EQ(rec["severity"], "warn");
    }
  }
}

TEST(Pitfalls, RngShowsTheConsequenceBesideTheViolatedStreams) {
  auto ddp = [](const std::string& name, const std::string& inject, double loss, json streams, double spread) {
    json c = cell("mlp", "32-true", 0.01, loss, 0.8);
    c["name"] = name;
    c["config"]["inject"] = inject;
    c["config"]["world_size"] = 2;
    c["config"]["batch_size"] = 64;
    c["metrics"]["rng"] = {{"streams", streams}, {"violations", streams.size()},
                           {"parameter_spread", {{"max", spread}, {"final", spread}, {"first_nonzero_step", spread > 0 ? json(0) : json(nullptr)}}}};
    return c;
  };
  const json violated = json::array({{{"name", "data-samples"}, {"class", "should-differ"}, {"verdict", "violated"}, {"first_violation_step", 0}, {"ranks", {0, 1}}, {"detail", "identical on ranks 0, 1"}}});
  const json clean = ddp("clean", "none", 0.50, json::array(), 0.0);
  const json same = ddp("same", "same-data-seed", 0.55, violated, 0.0);
  const json suite = with_pitfall("rng", {"same"}, {"clean"});
  const json rep = make_report(env_with_blas(false), suite, {clean, same});
  const json& p = rep["pitfalls"][0];
  EXPECT_EQ(p["reproduced"], true) << p.dump(1);
  const std::string saw = p["saw"].dump();
  EXPECT_NE(saw.find("data-samples (should-differ, from step 0)"), std::string::npos) << saw;
  EXPECT_NE(saw.find("final loss 0.5500 against the clean run's 0.5000 (+10.0%)"), std::string::npos) << saw;
  EXPECT_NE(saw.find("each global batch of 128 held 64 distinct samples"), std::string::npos) << saw;
  // A fault that no stream caught is not a reproduction.
  const json quiet = ddp("same", "same-data-seed", 0.55, json::array(), 0.0);
  EXPECT_EQ(make_report(env_with_blas(false), suite, {clean, quiet})["pitfalls"][0]["reproduced"], false);
}

TEST(Pitfalls, AMissingCellIsNamedAndTheSectionRenders) {
  const json suite = with_pitfall("rng", {"gone"}, {"clean"});
  json clean = cell("mlp", "32-true", 0.01, 0.5, 0.8);
  clean["name"] = "clean";
  const json r = make_report(env_with_blas(false), suite, {clean});
  const json& p = r["pitfalls"][0];
  EXPECT_EQ(p["reproduced"], false);
  EXPECT_EQ(p["missing"], json::array({"gone"}));
  EXPECT_NE(p["saw"].dump().find("gone: missing"), std::string::npos) << p.dump();
  const std::string md = render_markdown(r);
  EXPECT_NE(md.find("## Pitfalls: classic mistakes reproduced and diagnosed"), std::string::npos);
  EXPECT_NE(md.find("### 1. t-rng (not reproduced)"), std::string::npos) << md;
  EXPECT_NE(render_html(r).find("1. t-rng (not reproduced)"), std::string::npos);
  EXPECT_TRUE(make_report(env_with_blas(false), json{{"name", "x"}}, {clean}).count("pitfalls") == 0);
}

// ---- the committed reports, derived again ------------------------------------------------------------

namespace {

// Every committed report under tests/data.
std::vector<std::string> committed_reports(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    const std::string path = dir + "/" + name;
    if (e->d_type == DT_DIR) {
      for (const auto& p : committed_reports(path)) out.push_back(p);
    } else if (name.size() > 5 && name.substr(name.size() - 5) == ".json") {
      std::ifstream in(path);
      const json j = json::parse(in, nullptr, false);
      if (j.is_object() && j.value("schema", "") == kSchema) out.push_back(path);
    }
  }
  closedir(d);
  return out;
}

}  // namespace

// Every committed report's MFU follows from its raw measurements and core/precision.hpp's table, by
// hand here: FLOP/s = samples/s x FLOPs per sample, over the peak of the dtype the cell's GEMMs ran in
// (measured; the datasheet's beside it) times the ranks. A report left behind when a definition
// changes fails here until `trainscope report DIR --rederive` derives it again.
TEST(Report, CommittedReportsMfuFollowsFromTheirRawFieldsAndTheTable) {
  const auto reports = committed_reports(std::string(trainscope::test::kSourceDir) + "/tests/data");
  ASSERT_GE(reports.size(), 5u);
  int cells = 0;
  for (const auto& path : reports) {
    const json r = read_report(path);
    const json gpus = value_at(r, {"env", "gpus"});
    const std::string gpu = gpus.is_array() && !gpus.empty() ? gpus[0].value("name", "") : "";
    for (const auto& c : r["cells"]) {
      const json t = value_at(c, {"metrics", "timing"});
      if (!t.is_object()) continue;
      ++cells;
      const std::string where = path + ": " + c["name"].get<std::string>();
      ASSERT_TRUE(t.contains("gemm_peaks_flops_per_s")) << where << ": not derived again (trainscope report --rederive)";
      const PrecisionTraits& traits = precision_traits(c["config"]["precision"]);
      const bool cuda = c.value("device", "cpu").rfind("cuda", 0) == 0;
      const std::string dtype = fp16_emulated(traits, cuda, c["config"].value("fp16", "auto")) ? "fp32" : traits.gemm;
      EXPECT_EQ(t["compute_dtype"], dtype) << where;
      const double flops = t["samples_per_s"].get<double>() * t["flops_per_sample"].get<double>();
      const double world = c["config"].value("world_size", 1);
      EXPECT_NEAR(t["flops_per_s"].get<double>(), flops, 1e-9 * flops) << where;
      const json measured = t["gemm_peaks_flops_per_s"].value(dtype, json());
      if (traits.fp8_linear) continue;  // none committed; the fp8 convention is tested in test_config_suite
      if (measured.is_number()) EXPECT_NEAR(t["mfu"].get<double>(), flops / (measured.get<double>() * world), 1e-12) << where;
      else EXPECT_TRUE(t["mfu"].is_null()) << where;
      const DeviceFacts* device = cuda ? find_device(gpu) : nullptr;
      if (device && device->peak_flops.count(dtype))
        EXPECT_NEAR(t["mfu_datasheet"].get<double>(), flops / (device->peak_flops.at(dtype) * world), 1e-12) << where;
      else
        EXPECT_TRUE(t["mfu_datasheet"].is_null()) << where;
    }
  }
  EXPECT_GE(cells, 15);
  // The H200's fp16 cell: its GEMMs ran on fp16 tensor cores (989 TFLOPS dense), not at fp32's 67.
  const json v = read_report(std::string(trainscope::test::kSourceDir) + "/tests/data/h200/validate/report.json");
  for (const auto& c : v["cells"])
    if (c["name"] == "gptsmall-b32-full-16mixed") {
      const json& t = c["metrics"]["timing"];
      EXPECT_EQ(t["compute_dtype"], "fp16");
      EXPECT_NEAR(t["mfu_datasheet"].get<double>(), t["flops_per_s"].get<double>() / 989e12, 1e-12);
      EXPECT_LT(t["mfu_datasheet"].get<double>(), 0.01);
    }
}
