#include "suites/suite_file.hpp"

#include <algorithm>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include <toml++/toml.h>

#include "core/build_info.hpp"
#include "core/errors.hpp"
#include "core/model_shape.hpp"

namespace trainscope::suites {
namespace {

json to_json_value(const toml::node& n, const std::string& where) {
  if (auto v = n.as_string()) return v->get();
  if (auto v = n.as_integer()) return v->get();
  if (auto v = n.as_floating_point()) return v->get();
  if (auto v = n.as_boolean()) return v->get();
  throw UsageError(where + ": expected a string, number or boolean");
}

// toml++ keeps tables sorted by key; the suite's order is the order in the file.
std::vector<std::pair<std::string, const toml::node*>> in_file_order(const toml::table& t) {
  std::vector<std::pair<std::string, const toml::node*>> out;
  for (const auto& [k, v] : t) out.emplace_back(std::string(k.str()), &v);
  std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    const auto& sa = a.second->source().begin;
    const auto& sb = b.second->source().begin;
    return sa.line != sb.line ? sa.line < sb.line : sa.column < sb.column;
  });
  return out;
}

const toml::table& as_table(const toml::node& n, const std::string& where) {
  if (auto t = n.as_table()) return *t;
  throw UsageError(where + ": expected a table");
}

json settings_table(const toml::table& t, const std::string& where) {
  json out = json::object();
  for (const auto& [k, v] : in_file_order(t)) {
    const std::string at = where + "." + k;
    try {
      out[k] = validate_value(k, to_json_value(*v, at));
    } catch (const UsageError& e) {
      throw UsageError(at + ": " + e.what());
    }
  }
  return out;
}

std::string join_names(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

}  // namespace

const std::vector<std::string>& pitfall_kinds() {
  static const std::vector<std::string> kinds{"fp16-range", "rng", "memory", "ssl-data"};
  return kinds;
}

namespace {
// A list of cell names (a pitfall's wrong, fix and reference cells; the frontier's cells).
json cell_names(const toml::node& v, const std::string& where) {
  const toml::array* arr = v.as_array();
  if (!arr) throw UsageError(where + ": expected a list of cell names");
  json names = json::array();
  for (const auto& n : *arr) {
    if (!n.is_string()) throw UsageError(where + ": expected a list of cell names");
    names.push_back(n.as_string()->get());
  }
  return names;
}

json parse_pitfall(const toml::table& t, const std::string& at) {
  json p{{"id", ""}, {"kind", ""}, {"title", ""}, {"wrong", json::array()}, {"fix", json::array()},
         {"reference", json::array()}};
  for (const auto& [k, v] : in_file_order(t)) {
    const std::string where = at + "." + k;
    if (k == "id" || k == "kind" || k == "title") {
      if (!v->is_string()) throw UsageError(where + ": expected a string");
      p[k] = v->as_string()->get();
    } else if (k == "wrong" || k == "fix" || k == "reference") {
      p[k] = cell_names(*v, where);
    } else {
      throw UsageError(where + ": unknown key (allowed: id, kind, title, wrong, fix, reference)");
    }
  }
  if (p["id"].get<std::string>().empty()) throw UsageError(at + ": a pitfall needs an id");
  const auto& kinds = pitfall_kinds();
  if (std::find(kinds.begin(), kinds.end(), p["kind"].get<std::string>()) == kinds.end()) {
    std::string allowed;
    for (const auto& k : kinds) allowed += (allowed.empty() ? "" : ", ") + k;
    throw UsageError(at + ".kind: unknown pitfall kind '" + p["kind"].get<std::string>() + "' (allowed: " + allowed + ")");
  }
  if (p["wrong"].empty() || p["fix"].empty()) throw UsageError(at + ": a pitfall needs 'wrong' and 'fix' cells");
  return p;
}

// [axes]: each axis a non-empty list of valid values, in file order.
void parse_axes(Suite& s, const toml::node& node, const std::string& where) {
  for (const auto& [axis, values] : in_file_order(as_table(node, where))) {
    const std::string at = where + "." + axis;
    const toml::array* arr = values->as_array();
    if (!arr || arr->empty()) throw UsageError(at + ": expected a non-empty list of values");
    Axis a{axis, {}};
    for (const auto& v : *arr) {
      try {
        a.values.push_back(validate_value(axis, to_json_value(v, at)));
      } catch (const UsageError& e) {
        throw UsageError(at + ": " + e.what());
      }
    }
    s.axes.push_back(std::move(a));
  }
}

// [when.AXIS.VALUE]: settings for the cells where an axis has that value.
void parse_when(Suite& s, const toml::node& node, const std::string& where) {
  for (const auto& [axis, per_value] : in_file_order(as_table(node, where))) {
    const std::string at = where + "." + axis;
    auto it = std::find_if(s.axes.begin(), s.axes.end(), [&](const Axis& a) { return a.key == axis; });
    if (it == s.axes.end()) throw UsageError(at + ": '" + axis + "' is not an axis of this suite");
    for (const auto& [value, settings] : in_file_order(as_table(*per_value, at))) {
      const json v = validate_value(axis, parse_value(axis, value));
      if (std::find(it->values.begin(), it->values.end(), v) == it->values.end())
        throw UsageError(at + "." + value + ": '" + value + "' is not a value of axis " + axis);
      s.when.push_back({axis, v, settings_table(as_table(*settings, at + "." + value), at + "." + value)});
    }
  }
}

// [frontier]: the largest-batch search under a budget, for some models or cells.
json parse_frontier(const toml::node& node, const std::string& where) {
  const toml::table& t = as_table(node, where);
  json f{{"budget", "none"}, {"steps", 3}, {"start", 8}, {"limit", 4096}, {"models", json::array()}, {"cells", json::array()}};
  for (const auto& [k, v] : in_file_order(t)) {
    const std::string at = where + "." + k;
    if (k == "budget") f[k] = validate_value("memory_budget", to_json_value(*v, at));
    else if (k == "steps" || k == "start" || k == "limit") {
      if (!v->is_integer() || v->as_integer()->get() < 1) throw UsageError(at + ": expected a positive integer");
      f[k] = v->as_integer()->get();
    } else if (k == "models") {
      const toml::array* arr = v->as_array();
      if (!arr) throw UsageError(at + ": expected a list of models");
      for (const auto& m : *arr) f[k].push_back(validate_value("model", to_json_value(m, at)));
    } else if (k == "cells") {
      f[k] = cell_names(*v, at);
    } else {
      throw UsageError(at + ": unknown key (allowed: budget, steps, start, limit, models, cells)");
    }
  }
  return f;
}

// [[cells]]: named cells beside the axes' product, each with its own settings.
void parse_cells(Suite& s, const toml::node& node, const std::string& where) {
  const toml::array* arr = node.as_array();
  if (!arr || !arr->is_array_of_tables()) throw UsageError(where + ": expected [[cells]] tables");
  for (size_t i = 0; i < arr->size(); ++i) {
    const std::string at = where + "[" + std::to_string(i) + "]";
    toml::table t = *arr->get(i)->as_table();
    const auto* n = t.get_as<std::string>("name");
    if (!n || n->get().empty()) throw UsageError(at + ": a cell needs a name");
    const std::string cell_name = n->get();
    t.erase("name");
    s.extra_cells.emplace_back(cell_name, settings_table(t, at));
  }
}

// [models.NAME]: a model of the suite's own, by family and dimensions.
void parse_models(Suite& s, const toml::node& node, const std::string& where) {
  const auto& dims = model_dimension_keys();
  for (const auto& [name, table] : in_file_order(as_table(node, where))) {
    const std::string at = where + "." + name;
    validate_value("model", name);
    if (find_model_preset(name)) throw UsageError(at + ": '" + name + "' is a preset's name; give your model a name of its own");
    const json def = settings_table(as_table(*table, at), at);
    for (auto it = def.begin(); it != def.end(); ++it)
      if (std::find(dims.begin(), dims.end(), it.key()) == dims.end())
        throw UsageError(at + "." + it.key() + ": not a model dimension (allowed: " + join_names(dims) + ")");
    if (!def.contains("family") || def["family"] == "preset")
      throw UsageError(at + ": a model of your own needs its family (gpt, llama or vit)");
    s.models[name] = def;
  }
}

// [expect]: a cell's expected status (or statuses).
void parse_expect(Suite& s, const toml::node& node, const std::string& where) {
  const toml::table* t = node.as_table();
  if (!t) throw UsageError(where + ": expected a table of cell name = status (or a list of statuses)");
  for (const auto& [cell, v] : *t) {
    const std::string at = where + "." + std::string(cell.str());
    json statuses = json::array();
    if (v.is_string()) statuses.push_back(v.as_string()->get());
    else if (const toml::array* arr = v.as_array())
      for (const auto& x : *arr) statuses.push_back(x.is_string() ? json(x.as_string()->get()) : json(nullptr));
    for (const auto& st : statuses)
      if (!st.is_string() || !std::set<std::string>{"ok", "diverged", "oom", "failed", "timeout"}.count(st.get<std::string>()))
        throw UsageError(at + ": expected a status or a list of them (diverged, oom, failed, timeout, ok)");
    if (statuses.empty()) throw UsageError(at + ": expected a status or a list of them (diverged, oom, failed, timeout, ok)");
    s.expect[std::string(cell.str())] = statuses;
  }
}

// Every cell's configuration (models and their dimensions included) is checked now, and a pitfall's or
// an expectation's cell that is none of the suite's is a typo: both caught before anything runs.
void check_cell_names(const Suite& s, const std::string& origin) {
  const std::vector<Cell> cells = expand(s);
  for (size_t i = 0; i < s.pitfalls.size(); ++i)
    for (const char* part : {"wrong", "fix", "reference"})
      for (const auto& n : s.pitfalls[i][part])
        if (std::none_of(cells.begin(), cells.end(), [&](const Cell& c) { return c.name == n.get<std::string>(); }))
          throw UsageError(origin + ": pitfalls[" + std::to_string(i) + "]." + part + ": no cell named '" +
                           n.get<std::string>() + "'");
  for (auto it = s.expect.begin(); it != s.expect.end(); ++it)
    if (std::none_of(cells.begin(), cells.end(), [&](const Cell& c) { return c.name == it.key(); }))
      throw UsageError(origin + ": expect: no cell named '" + it.key() + "'");
}

}  // namespace

Suite parse_suite(const std::string& text, const std::string& origin) {
  toml::table doc;
  try {
    doc = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    const auto& at = e.source().begin;
    throw UsageError(origin + ":" + std::to_string(at.line) + ":" + std::to_string(at.column) + ": " +
                     std::string(e.description()));
  }
  Suite s;
  s.source = origin;
  for (const auto& [key, node] : in_file_order(doc)) {
    const std::string where = origin + ": " + key;
    if (key == "name" || key == "description") {
      if (!node->is_string()) throw UsageError(where + ": expected a string");
      (key == "name" ? s.name : s.description) = node->as_string()->get();
    } else if (key == "repeat") {
      if (!node->is_integer() || node->as_integer()->get() < 1 || node->as_integer()->get() > 100)
        throw UsageError(where + ": expected an integer from 1 to 100");
      s.repeat = static_cast<int>(node->as_integer()->get());
    } else if (key == "base") {
      s.base = settings_table(as_table(*node, where), where);
    } else if (key == "axes") {
      parse_axes(s, *node, where);
    } else if (key == "when") {
      parse_when(s, *node, where);
    } else if (key == "frontier") {
      s.frontier = parse_frontier(*node, where);
    } else if (key == "cells") {
      parse_cells(s, *node, where);
    } else if (key == "models") {
      parse_models(s, *node, where);
    } else if (key == "pitfalls") {
      const toml::array* arr = node->as_array();
      if (!arr || !arr->is_array_of_tables()) throw UsageError(where + ": expected [[pitfalls]] tables");
      for (size_t i = 0; i < arr->size(); ++i)
        s.pitfalls.push_back(parse_pitfall(*arr->get(i)->as_table(), where + "[" + std::to_string(i) + "]"));
    } else if (key == "expect") {
      parse_expect(s, *node, where);
    } else {
      throw UsageError(where +
                       ": unknown key (allowed: name, description, repeat, base, axes, when, models, cells, frontier, pitfalls, expect)");
    }
  }
  if (s.name.empty()) throw UsageError(origin + ": missing 'name'");
  check_cell_names(s, origin);
  return s;
}

std::vector<std::string> builtin_suite_names() {
  std::vector<std::string> names;
  for (const auto& [n, text] : builtin_suites()) names.push_back(n);
  return names;
}

Suite load_suite(const std::string& name_or_path) {
  for (const auto& [n, text] : builtin_suites())
    if (n == name_or_path) {
      Suite s = parse_suite(text, "suites/catalog/" + n + ".toml");
      s.source = "built-in";
      return s;
    }
  std::ifstream in(name_or_path);
  if (!in)
    throw UsageError("unknown suite '" + name_or_path + "' (built-in: " + join_names(builtin_suite_names()) +
                     "; or a path to a .toml file)");
  std::stringstream text;
  text << in.rdbuf();
  return parse_suite(text.str(), name_or_path);
}

void apply_override(Suite& suite, const std::string& key, const json& value) {
  const json v = validate_value(key, value);
  auto it = std::find_if(suite.axes.begin(), suite.axes.end(), [&](const Axis& a) { return a.key == key; });
  if (it != suite.axes.end()) it->values = {v};
  // An override beats `when` rules too: drop their settings of this key.
  for (auto& w : suite.when) w.settings.erase(key);
  for (auto& [name, settings] : suite.extra_cells) settings.erase(key);
  suite.base[key] = v;
}

namespace {
// A model of the suite's own: its dimensions, under whatever the cell sets itself.
void define_model(const Suite& suite, json& cfg) {
  if (!cfg.contains("model") || !cfg["model"].is_string()) return;
  const std::string name = cfg["model"].get<std::string>();
  if (!suite.models.contains(name)) return;
  const json& def = suite.models[name];
  for (auto it = def.begin(); it != def.end(); ++it)
    if (!cfg.contains(it.key())) cfg[it.key()] = it.value();
}

RunConfig cell_config(const Suite& suite, json cfg, const std::string& name) {
  define_model(suite, cfg);
  try {
    return RunConfig::from_json(cfg);
  } catch (const UsageError& e) {
    throw UsageError(suite.source + ": cell " + name + ": " + e.what());
  }
}
}  // namespace

std::vector<Cell> expand(const Suite& suite, const std::string& filter) {
  std::regex re;
  try {
    re = std::regex(filter.empty() ? ".*" : filter);
  } catch (const std::regex_error& e) {
    throw UsageError("bad --filter '" + filter + "': " + e.what());
  }
  std::vector<Cell> cells;
  std::vector<size_t> at(suite.axes.size(), 0);
  // Without axes the base is a cell of its own, unless the suite lists its cells: then it is only
  // what those cells start from.
  const bool base_is_a_cell = !suite.axes.empty() || suite.extra_cells.empty();
  while (base_is_a_cell) {
    json cfg = suite.base;
    std::string name;
    for (size_t i = 0; i < suite.axes.size(); ++i) {
      const Axis& a = suite.axes[i];
      cfg[a.key] = a.values[at[i]];
      name += (name.empty() ? "" : "/") + axis_label(a.key, a.values[at[i]]);
    }
    for (const auto& w : suite.when)
      if (cfg.contains(w.key) && cfg[w.key] == w.value)
        for (auto it = w.settings.begin(); it != w.settings.end(); ++it) cfg[it.key()] = it.value();
    if (name.empty()) name = suite.name;
    if (std::regex_search(name, re)) cells.push_back({name, cell_config(suite, cfg, name)});
    // Odometer: the last axis varies fastest.
    size_t i = suite.axes.size();
    while (i > 0 && ++at[i - 1] == suite.axes[i - 1].values.size()) at[--i] = 0;
    if (i == 0) break;
  }
  for (const auto& [name, settings] : suite.extra_cells) {
    json cfg = suite.base;
    for (auto it = settings.begin(); it != settings.end(); ++it) cfg[it.key()] = it.value();
    if (std::regex_search(name, re)) cells.push_back({name, cell_config(suite, cfg, name)});
  }
  return cells;
}

json suite_to_json(const Suite& suite) {
  json axes = json::object();
  for (const auto& a : suite.axes) axes[a.key] = a.values;
  json when = json::array();
  for (const auto& w : suite.when) when.push_back({{"axis", w.key}, {"value", w.value}, {"settings", w.settings}});
  json extra = json::array();
  for (const auto& [name, settings] : suite.extra_cells) extra.push_back({{"name", name}, {"settings", settings}});
  json j{{"name", suite.name}, {"description", suite.description}, {"source", suite.source}, {"repeat", suite.repeat},
         {"base", suite.base}, {"axes", axes}, {"when", when}, {"cells", extra}, {"frontier", suite.frontier}};
  if (!suite.pitfalls.empty()) j["pitfalls"] = suite.pitfalls;
  if (!suite.models.empty()) j["models"] = suite.models;
  if (!suite.expect.empty()) j["expect"] = suite.expect;
  return j;
}

}  // namespace trainscope::suites
