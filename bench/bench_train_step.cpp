// Google Benchmark: one training step per model and precision, with every probe off and every probe
// on; the difference is the probes' overhead (issue target: at most 2% of the step).
//
//   build/trainscope_bench --benchmark_format=json --benchmark_out=bench.json
//   build/trainscope_bench --benchmark_filter='gpt-tiny' --benchmark_repetitions=5
#include <benchmark/benchmark.h>

#include "probes/env.hpp"
#include "probes/memory.hpp"
#include "probes/timing.hpp"
#include "suites/train.hpp"

using namespace trainscope;

namespace {

RunConfig bench_config(const std::string& model, const std::string& precision) {
  RunConfig c;
  c.model = model;
  c.precision = precision;
  c.data = model == "gpt-tiny" ? "synthetic-tokens" : "synthetic-images";
  c.batch_size = model == "gpt-tiny" ? 32 : 128;
  c.warmup_steps = 0;
  c.steps = 1 << 30;  // the benchmark decides how many
  c.eval = false;
  return c;
}

void train_step(benchmark::State& state, std::string model, std::string precision, bool probes_on) {
  probes::configure_threads(0);
  if (probes_on) probes::AccountingAllocator::install();
  else probes::AccountingAllocator::uninstall();
  const RunConfig c = bench_config(model, precision);
  suites::Trainer trainer(c, "cpu");
  Hooks hooks;
  if (probes_on) {
    hooks.add(std::make_shared<probes::TimingProbe>(/*measure_peak=*/false));
    hooks.add(std::make_shared<probes::MemoryProbe>());
  }
  hooks.run_begin(trainer.info());
  int64_t step = 0;
  for (int i = 0; i < 3; ++i) trainer.step(step++, hooks);  // warm-up: allocator caches, oneDNN primitives
  for (auto _ : state) benchmark::DoNotOptimize(trainer.step(step++, hooks));
  state.counters["samples_per_s"] =
      benchmark::Counter(static_cast<double>(c.batch_size), benchmark::Counter::kIsIterationInvariantRate);
}

void register_all() {
  for (const char* model : {"mlp", "cnn-tiny", "gpt-tiny"})
    for (const char* precision : {"32-true", "bf16-mixed"})
      for (bool on : {false, true}) {
        const std::string name = std::string("train_step/") + model + "/" + precision + (on ? "/probes_on" : "/probes_off");
        benchmark::RegisterBenchmark(name.c_str(), train_step, model, precision, on)
            ->Unit(benchmark::kMillisecond)
            ->MinTime(2.0)
            ->UseRealTime();
      }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
