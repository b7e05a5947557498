#pragma once
// `trainscope run`: expand the suite, run each cell in its own process, write the report as it grows.
#include <string>
#include <utility>
#include <vector>

namespace trainscope::runners {

struct RunOptions {
  std::string suite = "quick";
  std::string device;  // "" keeps the suite's value
  std::string out;     // "" -> results/<UTC timestamp>
  std::vector<std::pair<std::string, std::string>> sets;  // --steps etc. become sets too
  std::string filter;
  bool resume = false;
  std::string memory_budget;  // --memory-budget: every cell, and the frontier's budget
  bool frontier = false;      // --frontier: search the largest batch even if the suite has no [frontier]
  int nproc = 1;              // --nproc: local ranks a cell may use (an external launcher overrides)
  int repeat = 0;             // --repeat: runs of each cell (0 keeps the suite's `repeat`)
};

// `trainscope trace DIR`: merges each cell's rank timelines into DIR/traces/<cell>.json.
int trace_command(const std::string& dir);

// Returns 0 when every cell is ok or skipped, 1 otherwise; the report is written either way.
int run_suite(const RunOptions& options);

}  // namespace trainscope::runners
