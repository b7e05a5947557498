// The planner's speed: the whole search for a published shape on a datasheet cluster (the issue's
// target: at least 1,000 configurations in under a second), and one replay.
#include <benchmark/benchmark.h>

#include "core/model_shape.hpp"
#include "plan/search.hpp"
#include "plan/step.hpp"

namespace {

using namespace trainscope;

void BM_PlanSearch(benchmark::State& state, const char* model, int64_t gpus, int64_t nodes) {
  plan::PlanRequest r;
  r.model = *find_model_preset(model);
  r.cluster = plan::Cluster{gpus, nodes};
  r.device = plan::datasheet_profile("H100-SXM");
  int64_t searched = 0;
  for (auto _ : state) {
    const json p = plan::make_plan(r);
    searched = p["searched"].get<int64_t>();
    benchmark::DoNotOptimize(searched);
  }
  state.counters["configurations"] = static_cast<double>(searched);
  state.counters["configurations_per_s"] = benchmark::Counter(static_cast<double>(searched), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK_CAPTURE(BM_PlanSearch, llama3_8b_8xH100, "llama3-8b", 8, 1)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_PlanSearch, llama3_70b_64xH100, "llama3-70b", 8, 8)->Unit(benchmark::kMillisecond);

void BM_Replay(benchmark::State& state) {
  RunConfig c;
  c.model = "llama3-8b";
  c.precision = "bf16-mixed";
  c.parallel = "zero3";
  c.world_size = 8;
  c.batch_size = 2;
  c.checkpoint = "selective";
  const plan::StepSetup s = plan::step_setup(c, true);
  for (auto _ : state) benchmark::DoNotOptimize(plan::predict_memory(s).peak);
}
BENCHMARK(BM_Replay)->Unit(benchmark::kMillisecond);

}  // namespace
