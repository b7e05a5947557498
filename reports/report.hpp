#pragma once
// The JSON report (docs/architecture.md's contract, schema in reports/schema/report.schema.json): assembling,
// atomic writing, strict reading, the terminal summary and the recommendations.
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/config.hpp"

namespace trainscope::reports {

inline constexpr const char* kSchema = "trainscope.report/1";

// A complete report from its parts; recommendations are derived here from the cells and env.
json make_report(const json& env, const json& suite, const std::vector<json>& cells, const json& frontier = nullptr);

// Every cell's derived timing fields (MFU and its peaks) derived again from its raw measurements with this
// version's definitions (core/precision.hpp: derive_mfu), and the recommendations with them. A report
// older than the raw fields keeps the peak it measured, as measured in the dtype it named. `hardware`: a
// hardware suite's report of the same machine (or null), whose measured GEMM peaks fill a dtype a cell
// did not measure itself (said in its peak_source).
json rederive_report(json report, const json& hardware = nullptr);

// Writes to a temporary file in the same folder, flushes it, then renames: readers never see half a file.
void write_json_atomic(const std::string& path, const json& j);
// Reads any JSON file; UsageError naming the file on a missing file or bad JSON.
json read_json_file(const std::string& path);
// Reads report.json (a path to it or its folder) and checks the schema tag and the required
// sections; UsageError on anything else.
json read_report(const std::string& path_or_dir);

// The cell whose configuration equals this one's but for `key` = `value`, if the report has it.
const json* sibling(const json& report, const json& cell, const std::string& key, const json& value);
// The same with several keys changed: {"parallel": "single", "world_size": 1}.
const json* sibling(const json& report, const json& cell, const json& changes);
// The cell of the same configuration in 32-true (for speed-ups and numerics).
inline const json* fp32_sibling(const json& report, const json& cell) {
  return sibling(report, cell, "precision", "32-true");
}

// A frontier entry's (or a configuration's) name: model/precision[/parallel/wsN]/ckpt-policy.
inline std::string frontier_label(const json& f) {
  const int world = f.value("world_size", 1);
  return f.value("model", "?") + "/" + f.value("precision", "?") +
         (world > 1 ? "/" + f.value("parallel", "?") + "/ws" + std::to_string(world) : std::string()) + "/ckpt-" +
         f.value("checkpoint", "?");
}

// What a checkpointing policy bought against `none` at the same configuration: peak and activation
// memory saved (%), recompute overhead (% of step time), MFU and HFU. Null without a comparable pair.
json compare_checkpointing(const json& cell, const json& none);

// A multi-rank cell against one process at the same per-rank batch (step time, scaling efficiency)
// and against DDP at the same world size (model-state memory and step time), with its exposed
// communication and RNG violations. Null for a cell that did not finish.
json compare_parallel(const json& cell, const json* single, const json* ddp);

// Numerics of a cell against its 32-true sibling: relative final-loss difference, the largest
// relative deviation along the loss curve, and a verdict matches | drifts | diverged, with the
// thresholds. Null when there is no comparable sibling.
json compare_numerics(const json& cell, const json& fp32);
inline constexpr double kMatchFinalLoss = 0.02;  // relative
inline constexpr double kMatchCurve = 0.10;      // relative, at any logged step

// The self-supervised summary (null when no cell has metrics.ssl): {"confidence", "rows": one per
// cell with metrics.ssl against its floors and supervised sibling, "label_efficiency": per SSL cell and
// label fraction, pre-training against the best scratch run within the same compute (paired by label
// seed, mean delta with a Student t interval), "data_size": SSL cells that differ only in unlabeled_size}.
json ssl_summary(const json& report);
// The pitfalls section (null when the suite has no [[pitfalls]]): per pitfall {"id", "kind", "title",
// "wrong", "fix": [{"cell", "status", "summary"}], "saw", "cost": [text], "reproduced", "verdict"}.
json pitfalls_summary(const json& report);
// The statuses a cell is meant to end in, from the suite's [expect] table, else ["ok", "diverged",
// "oom"] for a [[pitfalls]] `wrong` cell (made to go wrong on purpose); null for any other cell.
json expected_statuses(const json& report, const std::string& cell);
// A cell that did not end ok in a way its suite expects: shown, not failed (it fails neither the run
// nor its exit code; a pitfall's reports it as its finding).
bool shown_as_expected(const json& report, const json& cell);
// A cell its suite expects to fail ("ok" not among its statuses) that ended ok: a finding.
bool expectation_missed(const json& report, const json& cell);
// simclr | byol | dino | mae.
bool is_ssl_method(const std::string& method);
// The two-sided 95% Student t quantile for `df` degrees of freedom (NaN below 1).
double student_t975(int64_t df);

// The terminal table: cell, status, step p50, throughput, peak memory, loss/accuracy, speed-up.
std::string render_summary(const json& report);

// The number at `path` inside `j`, or NaN when a key is missing or the value is not a number.
double number_at(const json& j, std::initializer_list<const char*> path);
// The value at `path` inside `j`, or null when a key is missing.
json value_at(const json& j, std::initializer_list<const char*> path);

// Rules over the report, each citing the numbers it rests on: recommendation_rules() walked in order,
// their findings in one array ({"id", "severity", "text", "evidence", "cells"} each).
json recommend(const json& report);

// What a recommendation rule walks: the report once, each cell, each group of cells that differ only
// in their checkpointing policy ([{"name", "config", "checkpointing"}], in the order of their
// configurations), or each model of the memory frontier ({"model": label, "entries": [...]}).
enum class RuleScope { report, cell, checkpoint_group, frontier_model };

// One recommendation rule. `id`: the id its findings carry; a part in angle brackets stands for what a
// finding names there ("rng.<stream>": "rng.augmentation"). `when`: the condition it speaks on, and
// `evidence`: the measured fields it cites, in words. `apply` appends its findings on one subject of its
// scope (the report itself for RuleScope::report). Rules next to each other with the same non-empty
// `pass` (and scope) take each subject through all of them in turn, so that one subject's findings stay
// together (a cell's three parallel findings, then the next cell's).
struct Rule {
  std::string id;
  std::string when;
  std::string evidence;
  RuleScope scope = RuleScope::report;
  std::string pass;
  void (*apply)(const json& report, const json& subject, json& out) = nullptr;
};
// Every rule, in the order recommend() walks them.
const std::vector<Rule>& recommendation_rules();

// The comm probe's rows (op, bytes, count, time_s, algbw_gbps, busbw_gbps) reduced to each op's row at
// its largest size, by op name: where busbw comes nearest the link.
std::map<std::string, json> largest_per_op(const json& collectives);

// A cell's parity section's checks counted by verdict: {"exact", "within", "design", "differs"}.
struct ParityCounts {
  int exact = 0, within = 0, design = 0, differs = 0;
};
ParityCounts parity_counts(const json& parity);

}  // namespace trainscope::reports
