#include "runners/cell.hpp"

#include <csignal>
#include <cstdlib>
#include <thread>

#include "core/errors.hpp"
#include "probes/env.hpp"
#include "probes/gpu.hpp"
#include "probes/memory.hpp"
#include "probes/overflow.hpp"
#include "probes/timing.hpp"
#include "reports/report.hpp"
#include "suites/train.hpp"

#ifdef TRAINSCOPE_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace trainscope::runners {
namespace {

// Faults for testing the isolation (config key `inject`).
void inject_fault(const std::string& kind) {
  if (kind == "crash") std::raise(SIGSEGV);
  if (kind == "abort") std::abort();
  if (kind == "throw") throw std::runtime_error("injected exception");
  if (kind == "hang")
    while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
}

// On a GPU the budget caps the caching allocator (a fraction of the device's memory); without one the
// device's own memory is the budget.
void limit_device_memory(const std::string& device, int64_t budget) {
#ifdef TRAINSCOPE_TORCH_CUDA
  if (budget > 0 && device.rfind("cuda", 0) == 0) {
    const int index = std::stoi(device.substr(5));
    const double total = static_cast<double>(at::cuda::getDeviceProperties(index)->totalGlobalMem);
    c10::cuda::CUDACachingAllocator::setMemoryFraction(std::min(1.0, static_cast<double>(budget) / total), index);
  }
#else
  (void)device;
  (void)budget;
#endif
}

json quality_section(const suites::TrainOutcome& o) {
  json curve = json::array();
  for (const auto& [step, loss] : o.loss_curve) curve.push_back({step, loss});
  json q{{"final_loss", o.final_loss}, {"loss_curve", curve}};
  q["accuracy"] = o.accuracy ? json(*o.accuracy) : json(nullptr);
  q["first_nonfinite_step"] = o.first_nonfinite_step ? json(*o.first_nonfinite_step) : json(nullptr);
  return q;
}

}  // namespace

json cell_without_metrics(const std::string& name, const json& config, const std::string& device,
                          const std::string& status, const std::string& reason) {
  return json{{"name", name}, {"config", config},  {"device", device},
              {"status", status}, {"reason", reason}, {"emulated", false}};
}

int cell_main(const std::string& spec_path, const std::string& result_path) {
  // First, before any tensor exists, so that every byte of tensor storage is counted.
  probes::AccountingAllocator::install();
  const json spec = reports::read_json_file(spec_path);
  const std::string name = spec.at("name");
  const std::string device = spec.at("device");
  const RunConfig config = RunConfig::from_json(spec.at("config"));
  try {
    limit_device_memory(device, memory_budget_bytes(config));
    inject_fault(config.inject);
    const int threads = probes::configure_threads(config.threads);
    suites::Trainer trainer(config, device);

    auto timing = std::make_shared<probes::TimingProbe>();
    auto memory = std::make_shared<probes::MemoryProbe>(device == "cpu" ? memory_budget_bytes(config) : 0);
    Hooks hooks;
    hooks.add(timing);  // first: its GEMM-peak measurement must happen before memory's baseline
    hooks.add(memory);
    hooks.add(std::make_shared<probes::OverflowProbe>(config.overflow_every));
    if (device.rfind("cuda", 0) == 0)
      if (auto nvtx = probes::make_nvtx_probe()) hooks.add(nvtx);

    const RunInfo info = trainer.info();
    const suites::TrainOutcome outcome = suites::train(trainer, config, hooks, info);

    json cell = cell_without_metrics(name, config.to_json(), device, outcome.status, outcome.reason);
    cell["emulated"] = trainer.mode().emulated;
    if (config.checkpoint_check) {
      const auto d = suites::checkpoint_determinism();
      cell["checkpoint_determinism"] = {{"compared", d.compared}, {"max_abs_diff", d.max_abs_diff}};
    }
    cell["threads"] = threads;
    cell["model"] = {{"preset", info.model_name},
                     {"parameters", info.parameters},
                     {"analytic_parameters", trainer.model().analytic_parameters()},
                     {"training_flops_per_sample", info.flops_per_sample},
                     {"tokens_per_sample", info.tokens_per_sample}};
    cell["data"] = suites::resolve_data(config.data, suites::model_preset(config.model));
    cell["steps_run"] = outcome.steps_run;
    json metrics = json::object();
    for (const auto& p : hooks.probes())
      if (p->name() != "nvtx") metrics[p->name()] = p->section();
    metrics["quality"] = quality_section(outcome);
    cell["metrics"] = metrics;
    reports::write_json_atomic(result_path, cell);
    return 0;
  } catch (const c10::OutOfMemoryError& e) {
    const std::string what = e.what();
    json cell = cell_without_metrics(name, config.to_json(), device, "oom", what.substr(0, what.find('\n')));
    cell["oom_phase"] = probes::AccountingAllocator::phase();
    reports::write_json_atomic(result_path, cell);
    std::fprintf(stderr, "cell %s: %s\n", name.c_str(), what.c_str());
    return 0;
  } catch (const std::exception& e) {
    // torch's messages carry a backtrace after the first line; the report keeps the first line.
    const std::string what = e.what();
    const std::string reason = what.substr(0, what.find('\n'));
    reports::write_json_atomic(result_path, cell_without_metrics(name, config.to_json(), device, "failed", reason));
    std::fprintf(stderr, "cell %s failed: %s\n", name.c_str(), what.c_str());
    return 1;
  }
}

}  // namespace trainscope::runners
