#pragma once
// `trainscope compare BASE NEW`: the CI gate. Cells are matched by name and configuration; per cell and
// metric a verdict with the statistic it rests on; the environment difference first; renderers for
// the terminal, Markdown (pull-request comments) and JSON. The rules are in docs/ci.md; the thresholds
// are CompareOptions.
#include <string>

#include "core/config.hpp"

namespace trainscope::reports {

struct CompareOptions {
  double min_effect = 0.05;       // relative change below which a time is "same"
  double alpha = 0.05;            // one-sided Mann-Whitney U
  double sample_effect_factor = 2;  // without >= 3 repetitions a side, min_effect x this (within-run samples only)
  double memory_tolerance = 0.01;  // relative increase of a peak that is a regression
  double loss_tolerance = 0.02;    // relative final-loss increase that is a regression
  double accuracy_tolerance = 0.01;  // absolute accuracy drop that is a regression
  bool exact_loss = false;         // deterministic runs: every step's loss must be identical
};

// The comparison as JSON: {"env_diff": [...], "cells": [{"name", "verdict", "regression", "metrics":
// [{"metric", "verdict", "regression", "base", "new", "change", ...}]}], "recommendations": {"appeared",
// "disappeared"}, "regressions": n, "summary": {...}}.
json compare_reports(const json& base, const json& next, const CompareOptions& o = {});

// Renderers of compare_reports' result. `colour`: ANSI colours (a terminal).
std::string render_compare_text(const json& comparison, bool colour);
std::string render_compare_markdown(const json& comparison);

// Bencher Metric Format ({"<cell>": {"latency": {"value", "lower_value", "upper_value"}, ...}}) of a
// report's ok cells: step time in nanoseconds, throughput in samples/s, peak memory in bytes.
json export_bmf(const json& report);

}  // namespace trainscope::reports
