// The report: atomic write and strict read, summary table, recommendations.
#include <fstream>
#include <map>

#include <gtest/gtest.h>

#include "test_support.hpp"

#include "test_paths.hpp"

#include "core/errors.hpp"
#include "reports/report.hpp"

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
  json config = RunConfig{}.to_json();
  config["model"] = model;
  config["precision"] = precision;
  return json{{"name", model + "/" + precision},
              {"config", config},
              {"status", "ok"},
              {"reason", ""},
              {"emulated", false},
              {"metrics",
               {{"timing", {{"step_time_s", {{"p50", p50}}}, {"samples_per_s", 64 / p50}, {"tokens_per_s", nullptr}}},
                {"memory", {{"peak_bytes", 1 << 20}}},
                {"quality", {{"final_loss", loss}, {"accuracy", acc}}}}}};
}

json env_with_blas(bool reference) {
  return json{{"blas", {{"name", reference ? "reference BLAS (netlib)" : "OpenBLAS (openmp)"},
                        {"path", "/usr/lib/x/libblas.so.3"},
                        {"reference", reference}}}};
}

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

TEST(Recommendations, ParallelCellsAgainstOneProcessDdpAndTheLink) {
  auto rank_cell = [](const std::string& strategy, int world, double p50, double state, double exposed) {
    json c = cell("gpt-tiny", "32-true", p50, 1.0, 0.5);
    c["config"]["parallel"] = strategy;
    c["config"]["world_size"] = world;
    c["name"] = "gpt-tiny/" + strategy + "/ws" + std::to_string(world);
    c["backend"] = "nccl";
    c["metrics"]["timing"]["samples_per_s"] = world * 64 / p50;
    c["metrics"]["memory"]["model_state_total_bytes"] = state;
    c["metrics"]["memory"]["expected_model_state_bytes"] = state;
    c["metrics"]["comm"] = {{"collectives", json::array({{{"op", "all-reduce"}, {"bytes", 64 << 20}, {"count", 10},
                                                          {"time_s", 0.01}, {"algbw_gbps", 6.7}, {"busbw_gbps", 360.0}}})},
                            {"comm_time_s", 0.05}, {"exposed_comm_time_s", exposed * p50}, {"overlap", 0.2},
                            {"exposed_fraction_of_step", exposed}};
    return c;
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
