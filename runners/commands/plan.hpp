#pragma once
#include <string>
#include <utility>
#include <vector>

namespace trainscope::runners {

struct PlanArgs {
  std::string model = "llama3-8b";
  int64_t gpus_per_node = 8, nodes = 1;
  std::string device = "H100-SXM";
  // Results folders (or report.json files) of `run --suite hardware`: one, or several whose cells add
  // up (this machine's GEMM and memory cells, and the collectives cell run on the cluster's nodes).
  std::vector<std::string> hardware;
  int64_t seq = 0;                  // 0: the model's
  std::string global_batch;         // tokens per optimizer step (e.g. 1M, 4194304); empty: the plan's default
  std::string headroom = "10%";
  std::vector<std::pair<std::string, std::string>> sets;  // fixed axes and model dimensions
  std::string format = "text";      // text | md | json
  std::string out;                  // also write plan.json, plan.md, plan.html here
  std::string check;                // a results folder: predict its cells and compare
  bool into_report = false;         // with check: store the comparison in the folder's report
};

int plan_command(const PlanArgs& a);

}  // namespace trainscope::runners
