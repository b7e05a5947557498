#pragma once
#include <string>
#include <vector>

namespace trainscope::runners {

// `trainscope history PATH...`: the post-merge view. Reports (files, results folders, or folders
// searched for report.json) ordered by their creation time; per cell a series of one metric, with the
// change points E-divisive means finds (core/stats.hpp), each with the medians before and after.
struct HistoryArgs {
  std::vector<std::string> paths;
  std::string metric = "step_time";  // step_time | throughput | peak_memory
  std::string filter;                // regular expression on cell names
  std::string min_effect = "5%";     // a change point whose medians differ less is not flagged
  double alpha = 0.01;               // the permutation test's level
  std::string format = "text";       // text | md | json
};

int history_command(const HistoryArgs& a);

}  // namespace trainscope::runners
