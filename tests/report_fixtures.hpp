#pragma once
// Report cells and environments written by hand: what the report and recommendation tests build on.
#include <string>

#include "core/config.hpp"
#include "reports/report.hpp"

namespace trainscope::test {

// An ok cell with a step time, a loss and an accuracy (64 samples a step).
inline nlohmann::json hand_cell(const std::string& model, const std::string& precision, double p50, double loss, double acc) {
  nlohmann::json config = RunConfig{}.to_json();
  config["model"] = model;
  config["precision"] = precision;
  return {{"name", model + "/" + precision},
          {"config", config},
          {"status", "ok"},
          {"reason", ""},
          {"emulated", false},
          {"metrics",
           {{"timing", {{"step_time_s", {{"p50", p50}}}, {"samples_per_s", 64 / p50}, {"tokens_per_s", nullptr}}},
            {"memory", {{"peak_bytes", 1 << 20}}},
            {"quality", {{"final_loss", loss}, {"accuracy", acc}}}}}};
}

// The environment's BLAS: a reference (netlib) one or OpenBLAS.
inline nlohmann::json blas_env(bool reference) {
  return {{"blas", {{"name", reference ? "reference BLAS (netlib)" : "OpenBLAS (openmp)"},
                    {"path", "/usr/lib/x/libblas.so.3"},
                    {"reference", reference}}}};
}

// A gpt-tiny cell of `strategy` on `world` NCCL ranks: its model state, the exposed share of its step's
// communication, and one all-reduce at `busbw_gbps`.
inline nlohmann::json rank_cell(const std::string& strategy, int world, double p50, double state, double exposed,
                                double busbw_gbps = 120.0) {
  nlohmann::json c = hand_cell("gpt-tiny", "32-true", p50, 1.0, 0.5);
  c["config"]["parallel"] = strategy;
  c["config"]["world_size"] = world;
  c["name"] = "gpt-tiny/" + strategy + "/ws" + std::to_string(world);
  c["backend"] = "nccl";
  c["metrics"]["timing"]["samples_per_s"] = world * 64 / p50;
  c["metrics"]["memory"]["model_state_total_bytes"] = state;
  c["metrics"]["memory"]["expected_model_state_bytes"] = state;
  c["metrics"]["comm"] = {{"collectives", nlohmann::json::array({{{"op", "all-reduce"}, {"bytes", 64 << 20}, {"count", 10},
                                                                  {"time_s", 0.01}, {"algbw_gbps", 6.7}, {"busbw_gbps", busbw_gbps}}})},
                          {"comm_time_s", 0.05}, {"exposed_comm_time_s", exposed * p50}, {"overlap", 0.2},
                          {"exposed_fraction_of_step", exposed}};
  return c;
}

// A gpt-tiny cell of `strategy` on 4 ranks over 2 nodes, with its communication per level.
inline nlohmann::json across_nodes(const nlohmann::json& base, const std::string& strategy, nlohmann::json levels) {
  nlohmann::json c = base;
  c["config"]["parallel"] = strategy;
  c["config"]["world_size"] = 4;
  c["name"] = "gpt-tiny/" + strategy + "/ws4";
  c["nodes"] = nlohmann::json::array({{{"node", 0}, {"host", "node0"}, {"ranks", {0, 1}}}, {{"node", 1}, {"host", "node1"}, {"ranks", {2, 3}}}});
  c["metrics"]["comm"] = {{"collectives", nlohmann::json::array()}, {"comm_time_s", 0.05}, {"exposed_comm_time_s", 0.05},
                          {"overlap", 0.0}, {"levels", std::move(levels)}};
  return c;
}

}  // namespace trainscope::test
