#pragma once
// Running the real `trainscope` binary from tests: shell commands, scratch files, leftover processes.
#include <dirent.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "test_paths.hpp"

#include "core/config.hpp"

namespace trainscope::test {

struct Result {
  int code;
  std::string out;
};

inline std::string bin() { return trainscope::test::kBinary; }
inline std::string source_dir() { return trainscope::test::kSourceDir; }
inline std::string tmp(const std::string& name) {
  const std::string dir = std::string(trainscope::test::kScratchDir) + "/cli";
  std::system(("mkdir -p " + dir).c_str());
  return dir + "/" + name;
}

// Runs a shell command, capturing stdout and stderr together.
inline Result sh(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

inline Result ts(const std::string& args) { return sh(bin() + " " + args); }

// The hardware suite's report on this machine (its qualification cells, the collectives on 2 ranks and the
// planner's calibration cells, time-budgeted), run once per build of the binary and read by the tests
// that need one (the suite's own test, the planner's check): about 45 s each time otherwise. The run's
// exit status is kept beside it, so every reader asserts the run itself.
inline Result shared_hardware_report(std::string& out) {
  out = tmp("hardware");
  const std::string status = out + "/exit-status";
  if (sh("test " + out + "/report.json -nt " + bin() + " && test -f " + status).code == 0) {
    int code = -1;
    std::ifstream(status) >> code;
    return {code, "(the report of an earlier test with this binary: " + out + ")"};
  }
  sh("rm -rf " + out);
  const Result r = ts("run --suite hardware --nproc 2 --out " + out + " --set time_budget_s=6 --set sustain_window_s=1");
  std::ofstream(status) << r.code;
  return r;
}

inline json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

inline std::string write(const std::string& name, const std::string& text) {
  std::ofstream(tmp(name)) << text;
  return tmp(name);
}

inline int lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

// A results folder's report.html in headless Chromium, from disk, with the network off: how many
// charts the page expects and drew with data, and its script errors (read from <body>'s data
// attributes, where the page writes them); a screenshot at a laptop's width beside it (report.png).
// `ran` is false without Chromium or Chart.js (a machine without them skips the check).
struct BrowserCheck {
  bool ran = false;
  std::string expected, drawn, errors, dom;
};
inline BrowserCheck browser_check(const std::string& dir) {
  BrowserCheck b;
  if (sh("command -v chromium").code != 0 || !std::ifstream("/usr/share/javascript/chart.js/chart.min.js").good()) return b;
  const std::string flags = "--headless --no-sandbox --disable-gpu --no-proxy-server --host-resolver-rules='MAP * ~NOTFOUND' "
                            "--virtual-time-budget=10000 ";
  const Result dom = sh("chromium " + flags + "--dump-dom file://" + dir + "/report.html 2>/dev/null");
  b.ran = dom.code == 0;
  b.dom = dom.out;
  const auto body = dom.out.find("<body");
  if (body == std::string::npos) return b;
  const std::string tag = dom.out.substr(body, dom.out.find('>', body) - body);
  auto attr = [&](const std::string& name) {
    const auto at = tag.find(name + "=\"");
    return at == std::string::npos ? std::string("?") : tag.substr(at + name.size() + 2, tag.find('"', at + name.size() + 2) - at - name.size() - 2);
  };
  b.expected = attr("data-charts-expected");
  b.drawn = attr("data-charts-drawn");
  b.errors = attr("data-errors");
  sh("rm -f " + dir + "/report.png; chromium " + flags + "--window-size=1366,3000 --screenshot=" + dir + "/report.png file://" + dir +
     "/report.html > /dev/null 2>&1");
  return b;
}

// The checks every built-in suite's report passes: every chart drawn with data, no script error, no
// raw JSON object in report.md, and the summary first in both.
inline void expect_reports_for_people(const std::string& dir) {
  std::ifstream f(dir + "/report.md");
  const std::string md((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(md.find("{\""), std::string::npos) << dir << ": raw JSON in report.md";
  const auto summary = md.find("## Summary"), cells = md.find("## Cells");
  EXPECT_NE(summary, std::string::npos) << dir;
  EXPECT_LT(summary, cells) << dir << ": the summary comes first";
  const BrowserCheck b = browser_check(dir);
  if (!b.ran) return;
  EXPECT_NE(b.expected, "0") << dir << ": no chart";
  EXPECT_EQ(b.drawn, b.expected) << dir;
  EXPECT_EQ(b.errors, "") << dir;
  EXPECT_LT(b.dom.find("id=\"summary\""), b.dom.find("id=\"cells\"")) << dir;
  std::ifstream shot(dir + "/report.png", std::ios::binary);
  std::string magic(8, '\0');
  shot.read(&magic[0], 8);
  EXPECT_EQ(magic.substr(1, 3), "PNG") << dir;
}

// Processes whose command line mentions `needle` (a leftover cell would).
inline int processes_mentioning(const std::string& needle) {
  int found = 0;
  DIR* d = opendir("/proc");
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    std::ifstream f(std::string("/proc/") + e->d_name + "/cmdline");
    std::string cmd((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (cmd.find(needle) != std::string::npos && cmd.find("_cell") != std::string::npos) ++found;
  }
  closedir(d);
  return found;
}


// `trainscope run` on a suite given as TOML text, into a fresh scratch folder `name`; the report is
// null when none was written.
struct SuiteRun {
  Result result;
  std::string out;
  json report;
};
inline SuiteRun run_suite_text(const std::string& name, const std::string& toml, const std::string& args = "") {
  const std::string suite = write(name + ".toml", toml);
  const std::string out = tmp(name);
  sh("rm -rf " + out);
  SuiteRun r{ts("run --suite " + suite + " --out " + out + " " + args), out, nullptr};
  std::ifstream in(out + "/report.json");
  if (in) r.report = json::parse(in);
  return r;
}

// The report's cell of that name (a test failure when there is none).
inline json cell_named(const json& report, const std::string& name) {
  for (const auto& c : report["cells"])
    if (c["name"] == name) return c;
  ADD_FAILURE() << "no cell " << name;
  return json::object();
}

// One RNG/consistency stream of a multi-rank cell (empty when the probe has none of that name).
inline json rng_stream(const json& cell, const std::string& name) {
  for (const auto& s : cell["metrics"]["rng"]["streams"])
    if (s["name"] == name) return s;
  return json::object();
}

// Validates a report against the JSON Schema with Debian's python3-jsonschema.
inline Result validate_report(const std::string& report_path) {
  return sh("/usr/bin/python3 " + source_dir() + "/tests/validate_report.py " + source_dir() +
            "/reports/schema/report.schema.json " + report_path);
}

}  // namespace trainscope::test
