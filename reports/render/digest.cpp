// What a reader needs first: the machine in one line, the decisions the run supports, what went
// wrong; recommendations grouped so that one said for many cells is said once; evidence as rows of
// figures with their units instead of JSON.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include "core/units.hpp"
#include "reports/render/render.hpp"
#include "reports/report.hpp"

namespace trainscope::reports {
namespace {

// The topic of a recommendation id: "precision.use-bf16-mixed" -> "precision", "ssl-collapse" -> "ssl".
std::string topic_of(const std::string& id) { return id.substr(0, id.find_first_of(".-")); }

// The decisions a run supports, in the order a lead asks them, with their labels.
const std::vector<std::pair<std::string, std::string>>& decision_topics() {
  static const std::vector<std::pair<std::string, std::string>> t = {
      {"precision", "Precision"}, {"parallel", "Strategy"}, {"checkpoint", "Checkpointing"},
      {"ssl", "SSL or a pretrained encoder"}, {"plan", "Plan"}, {"hardware", "Hardware"}};
  return t;
}

int severity_rank(const std::string& s) { return s == "critical" ? 0 : s == "warn" ? 1 : 2; }

std::string humanize(std::string key) {
  for (const char* suffix : {"_per_s", "_bytes", "_s"}) {
    const std::string sf = suffix;
    if (key.size() > sf.size() && key.compare(key.size() - sf.size(), sf.size(), sf) == 0) {
      key.resize(key.size() - sf.size());
      if (sf == "_per_s") key += " per second";
      break;
    }
  }
  std::replace(key.begin(), key.end(), '_', ' ');
  return key;
}

bool ends_with(const std::string& s, const std::string& e) { return s.size() >= e.size() && s.compare(s.size() - e.size(), e.size(), e) == 0; }

// A number in the unit its key names (the nearest key up the tree that names one).
std::string number_text(double v, const std::string& unit_key) {
  if (ends_with(unit_key, "_per_s") || ends_with(unit_key, "per_s")) return format_rate(v) + "/s";
  if (ends_with(unit_key, "_s") || unit_key == "seconds") return format_seconds(v);
  if (unit_key.find("bytes") != std::string::npos) return format_bytes(v);
  if (unit_key.find("frac") != std::string::npos || unit_key.find("rel_diff") != std::string::npos ||
      unit_key.find("share") != std::string::npos || ends_with(unit_key, "_pct_of_peak"))
    return format_fixed(100 * v, 2) + "%";
  if (ends_with(unit_key, "_pct")) return format_fixed(v, 1) + "%";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return std::to_string(static_cast<long long>(v));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

std::string value_text(const json& v, const std::string& unit_key) {
  if (v.is_null()) return "-";
  if (v.is_boolean()) return v.get<bool>() ? "yes" : "no";
  if (v.is_number()) return number_text(v.get<double>(), unit_key);
  if (v.is_string()) return v.get<std::string>();
  if (v.is_array()) {
    std::string out;
    const size_t n = v.size();
    for (size_t i = 0; i < n; ++i) {
      if (n > 6 && i == 3) {
        out += ", ... (" + std::to_string(n) + " values)";
        i = n - 2;
        continue;
      }
      out += (i ? ", " : "") + value_text(v[i], unit_key);
    }
    return out.empty() ? "none" : out;
  }
  std::string out;
  for (auto it = v.begin(); it != v.end(); ++it) {
    const bool names_unit = ends_with(it.key(), "_s") || it.key().find("bytes") != std::string::npos || it.key().find("frac") != std::string::npos ||
                            ends_with(it.key(), "_pct") || it.key().find("share") != std::string::npos;
    out += (out.empty() ? "" : "; ") + humanize(it.key()) + " " + value_text(it.value(), names_unit ? it.key() : unit_key);
  }
  return out;
}

std::string cells_text(const json& cells, size_t most = 4) {
  std::string out;
  for (size_t i = 0; i < cells.size() && i < most; ++i) out += (i ? ", " : "") + cells[i].get<std::string>();
  if (cells.size() > most) out += " and " + std::to_string(cells.size() - most) + " more";
  return out;
}

std::string slug(const std::string& s) {
  std::string out = "rec-";
  for (char c : s) out += std::isalnum(static_cast<unsigned char>(c)) ? static_cast<char>(std::tolower(static_cast<unsigned char>(c))) : '-';
  return out;
}

}  // namespace

std::string short_text(const std::string& text) {
  // Parenthetical detail goes behind the fold; what is left is the sentence with its key number.
  std::string out;
  int depth = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '(') {
      if (depth++ == 0 && !out.empty() && out.back() == ' ') out.pop_back();
      continue;
    }
    if (c == ')' && depth > 0) {
      --depth;
      continue;
    }
    if (depth == 0) out += c;
  }
  if (depth != 0) out = text;  // unbalanced: leave it as written
  if (out.size() > 200) {
    out.resize(out.rfind(' ', 197));
    out += " ...";
  }
  return out;
}

std::string heading_anchor(const std::string& title) {
  std::string out;
  for (char c : title) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (std::isalnum(u) || c == '-' || c == '_') out += static_cast<char>(std::tolower(u));
    else if (c == ' ') out += '-';
  }
  return out;
}

std::string machine_line(const json& env) {
  std::string cpu = value_at(env, {"cpu", "model"}).is_string() ? env["cpu"]["model"].get<std::string>() : "unknown CPU";
  if (value_at(env, {"cpu", "logical_cores"}).is_number()) cpu += ", " + std::to_string(env["cpu"]["logical_cores"].get<int>()) + " cores";
  if (env.value("memory_bytes", json()).is_number()) cpu += ", " + format_bytes(env["memory_bytes"].get<double>());
  std::map<std::string, int> gpus;
  for (const auto& g : env.value("gpus", json::array())) ++gpus[g.value("name", std::string("?"))];
  std::string gpu;
  for (const auto& [name, n] : gpus) gpu += (gpu.empty() ? "" : ", ") + (n > 1 ? std::to_string(n) + " x " : "") + name;
  if (gpu.empty()) gpu = "no GPU";
  std::string sw = "torch " + (value_at(env, {"torch", "version"}).is_string() ? env["torch"]["version"].get<std::string>() : "?");
  if (value_at(env, {"torch", "cpu_capability"}).is_string()) sw += " (" + env["torch"]["cpu_capability"].get<std::string>() + ")";
  if (value_at(env, {"cuda", "runtime_version"}).is_number()) {
    const int v = env["cuda"]["runtime_version"].get<int>();
    sw += ", CUDA " + std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
  }
  return cpu + "; " + gpu + "; " + sw;
}

std::string nodes_line(const json& report) {
  // The first cell that ran on more than one host: every multi-rank cell of a launch shares its nodes.
  for (const auto& c : report.value("cells", json::array())) {
    const json nodes = c.value("nodes", json::array());
    if (!nodes.is_array() || nodes.size() < 2) continue;
    std::string line = std::to_string(nodes.size()) + " nodes";
    if (value_at(report, {"env", "launch", "source"}).is_string()) line += " (" + report["env"]["launch"]["source"].get<std::string>() + ")";
    line += ":";
    for (size_t i = 0; i < nodes.size(); ++i) {
      line += std::string(i ? "," : "") + " " + nodes[i].value("host", std::string("?")) + " (rank";
      const json& ranks = nodes[i]["ranks"];
      line += ranks.size() > 1 ? "s " : " ";
      for (size_t r = 0; r < ranks.size(); ++r) line += (r ? ", " : "") + std::to_string(ranks[r].get<int64_t>());
      line += ")";
    }
    return line;
  }
  return "";
}

json evidence_rows(const json& evidence) {
  json rows = json::array();
  if (!evidence.is_object()) return rows;
  for (auto it = evidence.begin(); it != evidence.end(); ++it) {
    if (it.key() == "thresholds") continue;  // the rule's constants, in the docs; the raw JSON keeps them
    rows.push_back({humanize(it.key()), value_text(it.value(), it.key())});
  }
  return rows;
}

json recommendation_groups(const json& report) {
  json groups = json::array();
  std::map<std::string, size_t> index;
  std::set<std::string> anchors;
  for (const auto& r : report.value("recommendations", json::array())) {
    const std::string id = r.value("id", "?"), severity = r.value("severity", "info");
    const std::string key = id + "|" + severity;
    if (!index.count(key)) {
      std::string anchor = slug(id);
      for (int k = 2; anchors.count(anchor); ++k) anchor = slug(id) + "-" + std::to_string(k);
      anchors.insert(anchor);
      index[key] = groups.size();
      groups.push_back({{"id", id}, {"severity", severity}, {"topic", topic_of(id)}, {"anchor", anchor}, {"cells", json::array()}, {"items", json::array()}});
    }
    json& g = groups[index[key]];
    g["items"].push_back({{"text", r.value("text", "")}, {"evidence", r.value("evidence", json::object())}, {"cells", r.value("cells", json::array())}});
    for (const auto& c : r.value("cells", json::array()))
      if (std::find(g["cells"].begin(), g["cells"].end(), c) == g["cells"].end()) g["cells"].push_back(c);
  }
  // The headline: the first item's sentence and, for a group, how many more and where; two lines of
  // about 110 characters at most.
  constexpr size_t kTwoLines = 220;
  for (auto& g : groups) {
    std::string headline = short_text(g["items"][0]["text"].get<std::string>());
    const size_t n = g["items"].size();
    const std::string more = n > 1 ? " (and " + std::to_string(n - 1) + " more like it; cells: " + cells_text(g["cells"], 3) + ")" : "";
    if (headline.size() + more.size() > kTwoLines && kTwoLines > more.size() + 40) {
      const size_t cut = headline.rfind(' ', kTwoLines - more.size() - 4);
      headline = headline.substr(0, cut == std::string::npos ? kTwoLines - more.size() - 4 : cut) + " ...";
    }
    g["headline"] = headline + more;
  }
  std::stable_sort(groups.begin(), groups.end(), [](const json& a, const json& b) {
    return severity_rank(a["severity"]) < severity_rank(b["severity"]);
  });
  return groups;
}

json report_digest(const json& report) {
  json d{{"machine", machine_line(report.value("env", json::object()))}, {"decisions", json::array()}, {"problems", json::array()}};
  if (const std::string nodes = nodes_line(report); !nodes.empty()) d["nodes"] = nodes;
  const json groups = recommendation_groups(report);
  for (const auto& [topic, label] : decision_topics())
    for (const auto& g : groups)
      if (g["topic"] == topic && g["severity"] == "info") {
        // A decision made per model (a few items) keeps each model's number; a kind said of many
        // cells is one line.
        if (g["items"].size() <= 3)
          for (const auto& item : g["items"])
            d["decisions"].push_back({{"topic", label}, {"text", short_text(item["text"].get<std::string>())}, {"anchor", g["anchor"]}});
        else
          d["decisions"].push_back({{"topic", label}, {"text", g["headline"]}, {"anchor", g["anchor"]}});
      }
  for (const auto& g : groups)
    if (g["severity"] != "info") d["problems"].push_back({{"severity", g["severity"]}, {"text", g["headline"]}, {"anchor", g["anchor"]}});
  const json pitfalls = report.contains("pitfalls") ? report["pitfalls"] : pitfalls_summary(report);
  if (pitfalls.is_array())
    for (const auto& p : pitfalls)
      d["problems"].push_back({{"severity", "shown"},
                               {"text", "pitfall " + std::string(p.value("reproduced", json()) == json(true) ? "reproduced" : "not reproduced") +
                                            ": " + p.value("title", std::string("?"))},
                               {"anchor", heading_anchor(kPitfallsSection)}});
  for (const auto& c : report["cells"])
    if (shown_as_expected(report, c) && !(pitfalls.is_array() && !pitfalls.empty()))
      d["problems"].push_back({{"severity", "shown"},
                               {"text", c["name"].get<std::string>() + " ended " + c["status"].get<std::string>() + ", as its suite expects (a mistake shown on purpose)"},
                               {"anchor", nullptr}});
  int ok = 0, other = 0;
  for (const auto& c : report["cells"]) (c.value("status", "") == "ok" ? ok : other) += 1;
  d["cells_ok"] = ok;
  d["cells_other"] = other;
  return d;
}

}  // namespace trainscope::reports
