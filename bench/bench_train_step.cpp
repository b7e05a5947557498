// Google Benchmark: one training step per model and precision, with every probe off and every probe
// on, and the probes' overhead measured with both settings interleaved (target: at most 2% of the step).
//
//   build/trainscope_bench --benchmark_format=json --benchmark_out=bench.json
//   build/trainscope_bench --benchmark_filter='gpt-tiny' --benchmark_repetitions=5
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <numeric>

#include "probes/device/env.hpp"
#include "probes/step/memory.hpp"
#include "probes/numerics/overflow.hpp"
#include "probes/step/timing.hpp"
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

// The overflow probe with a stopwatch around everything it does (CPU work is synchronous, so this is
// its cost exactly, free of the step-to-step noise that the interleaved comparison has).
class StopwatchOverflowProbe : public probes::OverflowProbe {
 public:
  using OverflowProbe::OverflowProbe;
  double seconds = 0;
  void step_end(const StepInfo& s) override { timed([&] { OverflowProbe::step_end(s); }); }
  void activation(int64_t step, const std::string& b, const at::Tensor& x) override {
    timed([&] { OverflowProbe::activation(step, b, x); });
  }
  void gradient(int64_t step, const std::string& b, const at::Tensor& g) override {
    timed([&] { OverflowProbe::gradient(step, b, g); });
  }

 private:
  template <typename F>
  void timed(F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

// Probe overhead, measured with the two settings interleaved step by step (so drift, thermal state and
// the other core's load hit both equally): counters overhead_pct = (median_on - median_off) / median_off.
// `which`: "issue2" = accounting allocator + timing + memory; "overflow" = the overflow probe alone at
// its default sampling (one step in overflow_every, so its cost is averaged as in a real run).
void probe_overhead(benchmark::State& state, std::string model, std::string precision, std::string which) {
  probes::configure_threads(0);
  const RunConfig c = bench_config(model, precision);
  suites::Trainer trainer(c, "cpu");
  Hooks off, on;
  auto stopwatch = std::make_shared<StopwatchOverflowProbe>(RunConfig{}.overflow_every);
  if (which == "overflow") {
    on.add(stopwatch);
  } else {
    on.add(std::make_shared<probes::TimingProbe>(/*measure_peak=*/false));
    on.add(std::make_shared<probes::MemoryProbe>());
  }
  on.run_begin(trainer.info());
  int64_t step = 0;
  std::vector<double> t_on, t_off;
  auto timed_step = [&](bool probes_on) {
    if (probes_on && which != "overflow") probes::AccountingAllocator::install();
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
  // Each pair of neighbouring steps shares the machine's state: the median of their ratios is the
  // most robust estimate for probes that act on every step.
  std::vector<double> ratios;
  for (size_t i = 0; i < std::min(t_on.size(), t_off.size()); ++i) ratios.push_back(t_on[i] / t_off[i]);
  // The overflow probe works on one step in overflow_every: compare means, which spread that cost (trimmed
  // of the slowest 2%, the scheduler's hiccups, which a sampled step is not); the others act on every
  // step, where the median is the robust choice.
  auto centre = [&](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    if (which != "overflow") return v[v.size() / 2];
    const size_t keep = v.size() - v.size() / 50;
    return std::accumulate(v.begin(), v.begin() + static_cast<long>(keep), 0.0) / static_cast<double>(keep);
  };
  const double m_on = centre(t_on), m_off = centre(t_off);
  state.counters["step_ms_probes_off"] = 1e3 * m_off;
  state.counters["step_ms_probes_on"] = 1e3 * m_on;
  if (which == "overflow") {
    state.counters["overhead_pct"] = m_off > 0 ? 100.0 * (m_on - m_off) / m_off : 0.0;
  } else {
    std::sort(ratios.begin(), ratios.end());
    state.counters["overhead_pct"] = ratios.empty() ? 0.0 : 100.0 * (ratios[ratios.size() / 2] - 1.0);
  }
  if (which == "overflow") {
    const double on_total = std::accumulate(t_on.begin(), t_on.end(), 0.0);
    state.counters["probe_time_pct"] = on_total > 0 ? 100.0 * stopwatch->seconds / on_total : 0.0;
  }
  probes::AccountingAllocator::uninstall();
}

// An SSL method's step against a supervised step on the same encoder and batch, interleaved pair by
// pair as above. Counter cost_vs_supervised = the median ratio; the target for SimCLR is 2.3
// (two views through the encoder, plus the views and the loss), and `within_target` says whether it holds.
void ssl_step_cost(benchmark::State& state, std::string model, std::string method) {
  probes::configure_threads(0);
  probes::AccountingAllocator::uninstall();
  RunConfig c = bench_config(model, "32-true");
  suites::Trainer supervised(c, "cpu");
  c.method = method;
  suites::Trainer ssl(c, "cpu");
  Hooks none;
  int64_t step = 0;
  std::vector<double> t_ssl, t_sup;
  auto timed_step = [&](suites::Trainer& t, std::vector<double>& into) {
    const auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(t.step(step, none));
    into.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  };
  for (int i = 0; i < 3; ++i, ++step) {
    timed_step(ssl, t_ssl);
    timed_step(supervised, t_sup);
  }
  t_ssl.clear();
  t_sup.clear();
  for (auto _ : state) {
    if (step % 2 == 0) {
      timed_step(ssl, t_ssl);
      timed_step(supervised, t_sup);
    } else {
      timed_step(supervised, t_sup);
      timed_step(ssl, t_ssl);
    }
    ++step;
  }
  std::vector<double> ratios;
  for (size_t i = 0; i < t_ssl.size(); ++i) ratios.push_back(t_ssl[i] / t_sup[i]);
  std::sort(ratios.begin(), ratios.end());
  const double ratio = ratios.empty() ? 0.0 : ratios[ratios.size() / 2];
  state.counters["cost_vs_supervised"] = ratio;
  if (method == "simclr") state.counters["within_target"] = ratio <= 2.3 ? 1 : 0;
}

void register_all() {
  for (const char* model : {"cnn-tiny", "vit-tiny"})
    for (const char* method : {"simclr", "byol", "dino", "mae"}) {
      if (std::string(method) == "mae" && std::string(model) != "vit-tiny") continue;
      const std::string name = std::string("ssl_step_cost/") + model + "/" + method;
      benchmark::RegisterBenchmark(name.c_str(), ssl_step_cost, model, method)
          ->Unit(benchmark::kMillisecond)
          ->MinTime(4.0)
          ->UseRealTime();
    }
  for (const char* model : {"mlp", "cnn-tiny", "gpt-tiny"})
    for (const char* precision : {"32-true", "bf16-mixed", "16-mixed", "16-mixed-noscale", "bf16-true"})
      for (bool on : {false, true}) {
        if (on && std::string(precision).rfind("16-mixed", 0) == 0) continue;  // on/off pairs: fp32 and bf16
        const std::string name = std::string("train_step/") + model + "/" + precision + (on ? "/probes_on" : "/probes_off");
        benchmark::RegisterBenchmark(name.c_str(), train_step, model, precision, on)
            ->Unit(benchmark::kMillisecond)
            ->MinTime(2.0)
            ->UseRealTime();
      }
  for (const char* which : {"issue2", "overflow"})
    for (const char* model : {"mlp", "cnn-tiny", "gpt-tiny"})
      for (const char* precision : {"32-true", "bf16-mixed"}) {
        const std::string name = std::string(which == std::string("overflow") ? "overflow_probe_overhead/"
                                                                              : "probe_overhead/") +
                                 model + "/" + precision;
        benchmark::RegisterBenchmark(name.c_str(), probe_overhead, model, precision, which)
            ->Unit(benchmark::kMillisecond)
            ->MinTime(6.0)
            ->UseRealTime();
      }
}

}  // namespace

int main(int argc, char** argv) {
  // Thousands of steps on the easy synthetic data drive losses and gradients towards zero, into fp32
  // denormals that cost the CPU 5-10x per operation: flush them, so that a step's time stays a step's.
  at::globalContext().setFlushDenormal(true);
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
