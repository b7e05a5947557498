#pragma once
#include <string>
#include <utility>
#include <vector>

namespace trainscope::runners {

// `trainscope ab`: the pre-merge gate. Both builds' cells run interleaved on this runner in ABBA
// blocks, each slot a fresh process; per block and cell the log ratio of the better process per
// side; the effect is the Hodges-Lehmann estimate over blocks, the test the one-sided exact Wilcoxon
// signed-rank, Holm over cells; verdicts regression | pass | inconclusive.
struct AbArgs {
  std::string base, fresh;  // the two trainscope binaries (the same one twice: an A/A run)
  std::string suite = "gate";
  std::string filter;
  int blocks = 6, max_blocks = 10;
  int per_side = 2;  // processes per side per block and cell; each side keeps its fastest step
  std::string min_effect = "5%";
  double alpha = 0.05;
  std::vector<std::pair<std::string, std::string>> base_sets, new_sets;
  std::string out;
  std::string format = "text";  // text | md | json
  int nproc = 2;
};

int ab_command(const AbArgs& a);

}  // namespace trainscope::runners
