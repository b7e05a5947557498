#pragma once
// Suite files: a base configuration plus axes (TOML, comments allowed), expanded into named cells.
//
//   name = "quick"
//   description = "..."
//   repeat = 3                   # runs of each cell, each in its own process (optional; --repeat)
//   [base]                       # any key of core/config.hpp
//   steps = 300
//   [axes]                       # each key: the list of values to sweep, in this order
//   model = ["mlp", "gpt-tiny"]
//   precision = ["32-true", "bf16-mixed"]
//   [when.model.gpt-tiny]        # settings for the cells whose axis `model` is `gpt-tiny`
//   batch_size = 32
//   [frontier]                   # largest batch under a budget, per policy (optional)
//   budget = "48MiB"
//   models = ["gpt-tiny"]
//   [models.my-llama]            # a model of your own, by its dimensions; used by name like a preset
//   family = "llama"             # (core/model_shape.hpp: family, layers, d_model, heads, kv_heads, ffn,
//   layers = 8                   #  seq_len, vocab, tied, rope_*, norm_eps; a cell's own settings win)
//   [[cells]]                    # extra cells beside the matrix: a name and settings over [base]
//   name = "mlp/16-mixed/stress"
//   precision = "16-mixed"
#include <string>
#include <vector>

#include "core/config.hpp"

namespace trainscope::suites {

struct Axis {
  std::string key;
  std::vector<json> values;
};

struct WhenRule {
  std::string key;    // an axis key
  json value;         // the axis value it applies to
  json settings;      // key -> value
};

struct Suite {
  std::string name, description, source;  // source: "built-in" or the file's path
  int repeat = 1;                          // runs of each cell (repetitions carry the between-run noise)
  json base = json::object();
  std::vector<Axis> axes;
  std::vector<WhenRule> when;
  std::vector<std::pair<std::string, json>> extra_cells;  // name, settings over the base
  // [frontier]: search the largest batch under `budget` for each distinct cell configuration (batch
  // size aside) of the listed models (or of the listed cells only); {"budget", "steps", "start",
  // "limit", "models", "cells"}; null: none.
  json frontier;
  // [[pitfalls]]: a mistake reproduced on purpose, each {"id", "kind", "title", "wrong", "fix",
  // "reference"} naming cells of this suite (reports/pitfalls.cpp reads them); kind is one of
  // pitfall_kinds().
  json pitfalls = json::array();
  // [expect]: cell name -> the statuses it is meant to end in (a cell that shows a classic mistake:
  // "diverged", "oom", ...): such an ending is shown, not failed. A pitfall's `wrong` cells are meant
  // to go wrong too (reports::expected_statuses gives them ok, diverged or oom unless [expect] says).
  json expect = json::object();
  // [models.NAME]: name -> the dimension keys of a model of the suite's own.
  json models = json::object();
};

const std::vector<std::string>& pitfall_kinds();

struct Cell {
  std::string name;
  RunConfig config;
};

// Parses TOML text; every error is a UsageError of one line naming the file, the key and the value.
Suite parse_suite(const std::string& text, const std::string& origin);
// A built-in name (suites/catalog/NAME.toml, compiled in) or a path to a .toml file.
Suite load_suite(const std::string& name_or_path);
std::vector<std::string> builtin_suite_names();

// `--set key=value`: replaces the axis of that key (if any) by the single value, else sets the base.
void apply_override(Suite& suite, const std::string& key, const json& value);

// Cartesian product of the axes in declaration order; names join the axis labels with '/'.
// Cells whose name does not match `filter` (a regular expression, searched) are left out.
std::vector<Cell> expand(const Suite& suite, const std::string& filter = "");

json suite_to_json(const Suite& suite);  // the report's "suite" section

}  // namespace trainscope::suites
