// Google Benchmark: one training step per model and precision, with every probe off and every probe
// on, and the probes' overhead measured with both settings interleaved (target: at most 2% of the step).
//
//   build/trainscope_bench --benchmark_format=json --benchmark_out=bench.json
//   build/trainscope_bench --benchmark_filter='gpt-tiny' --benchmark_repetitions=5
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>

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

// Probe overhead, measured with the two settings interleaved step by step (so drift, thermal state and
// the other core's load hit both equally): counters overhead_pct = (median_on - median_off) / median_off.
void probe_overhead(benchmark::State& state, std::string model, std::string precision) {
  probes::configure_threads(0);
  const RunConfig c = bench_config(model, precision);
  suites::Trainer trainer(c, "cpu");
  Hooks off, on;
  on.add(std::make_shared<probes::TimingProbe>(/*measure_peak=*/false));
  on.add(std::make_shared<probes::MemoryProbe>());
  on.run_begin(trainer.info());
  int64_t step = 0;
  std::vector<double> t_on, t_off;
  auto timed_step = [&](bool probes_on) {
    if (probes_on) probes::AccountingAllocator::install();
    else probes::AccountingAllocator::uninstall();
    const auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(trainer.step(step++, probes_on ? on : off));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    (probes_on ? t_on : t_off).push_back(s);
  };
  for (int i = 0; i < 4; ++i) timed_step(i % 2 == 0);
  t_on.clear();
  t_off.clear();
  for (auto _ : state) {
    const bool first_on = t_on.size() % 2 == 0;  // alternate which setting goes first
    timed_step(first_on);
    timed_step(!first_on);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  const double m_on = median(t_on), m_off = median(t_off);
  state.counters["step_ms_probes_off"] = 1e3 * m_off;
  state.counters["step_ms_probes_on"] = 1e3 * m_on;
  state.counters["overhead_pct"] = m_off > 0 ? 100.0 * (m_on - m_off) / m_off : 0.0;
  probes::AccountingAllocator::uninstall();
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
  for (const char* model : {"mlp", "cnn-tiny", "gpt-tiny"})
    for (const char* precision : {"32-true", "bf16-mixed"})
      benchmark::RegisterBenchmark((std::string("probe_overhead/") + model + "/" + precision).c_str(), probe_overhead,
                                   model, precision)
          ->Unit(benchmark::kMillisecond)
          ->MinTime(6.0)
          ->UseRealTime();
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
