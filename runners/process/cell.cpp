#include "runners/process/cell.hpp"

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "core/devices.hpp"
#include "core/errors.hpp"
#include "probes/device/env.hpp"
#include "probes/device/gpu.hpp"
#include "probes/distributed/comm.hpp"
#include "probes/distributed/rng.hpp"
#include "probes/numerics/overflow.hpp"
#include "probes/ssl/health.hpp"
#include "probes/step/memory.hpp"
#include "probes/step/operators.hpp"
#include "probes/step/timing.hpp"
#include "probes/trace/trace.hpp"
#include "reports/report.hpp"
#include "runners/process/launch.hpp"
#include "suites/parallel/comm.hpp"
#include "suites/hardware/measure.hpp"
#include "suites/ssl/evaluate.hpp"
#include "suites/ssl/methods.hpp"
#include "suites/train.hpp"

#ifdef TRAINSCOPE_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace trainscope::runners {
namespace {

// What a CPU GEMM allocates through torch's allocator besides its product (oneDNN's scratchpad for
// packing the low-precision operands; none in fp32 here): bytes beyond the output at the operator's
// peak, by the inner dimension k (m = 512, n = 64). The planner adds it to each GEMM of that dtype.
json gemm_workspace(const std::string& dtype) {
  json out = json::array();
  const auto t = dtype == "bf16" ? torch::kBFloat16 : dtype == "fp16" ? torch::kHalf : torch::kFloat;
  torch::NoGradGuard no_grad;
  for (int64_t k : {64, 256, 1024, 4096}) {
    const torch::Tensor a = torch::randn({512, k}, torch::TensorOptions().dtype(t)), w = torch::randn({64, k}, torch::TensorOptions().dtype(t));
    torch::mm(a, w.t());  // warm-up: the first call may allocate what later calls reuse
    const int64_t before = probes::AccountingAllocator::current();
    probes::AccountingAllocator::reset_peak();
    const torch::Tensor y = torch::mm(a, w.t());
    const int64_t extra = probes::AccountingAllocator::peak() - before - y.numel() * static_cast<int64_t>(y.element_size());
    out.push_back({{"k", k}, {"bytes", std::max<int64_t>(0, extra)}});
  }
  return out;
}

// What a CPU convolution (oneDNN's, fp32) allocates through torch's allocator beyond its results: the
// reorders of its operands into blocked layouts. Forward: bytes beyond the output at the operator's
// peak; backward: beyond the input's and weight's gradients. Per shape (channels, kernel, stride), with
// the bytes of its input and output: the planner scales a convolution's output bytes by the ratios of
// the measured shape of its kernel and stride nearest its channels (the reorders follow oneDNN's 8- or
// 16-channel blocks; a strided 1x1 one gathers its input first). The shapes span the CPU models': stems
// from 1 and 3 channels, widths 8 to 64, 3x3 convolutions at stride 1 and 2, 1x1 shortcuts at stride 2.
json conv_workspace() {
  json out = json::array();
  struct Shape {
    int64_t c, k, hw, kernel, stride;
  };
  const std::vector<Shape> shapes{{1, 8, 28, 3, 1},   {8, 8, 28, 3, 1},  {8, 16, 14, 3, 1}, {16, 16, 14, 3, 1},
                                  {16, 32, 7, 3, 1},  {32, 32, 7, 3, 1}, {3, 16, 32, 3, 1}, {16, 16, 32, 3, 1},
                                  {64, 64, 8, 3, 1},  {8, 16, 28, 3, 2}, {16, 32, 14, 3, 2}, {8, 16, 28, 1, 2},
                                  {16, 32, 14, 1, 2}, {32, 64, 16, 1, 2}};
  for (const auto& [c, k, hw, kernel, stride] : shapes) {
    const auto o = torch::TensorOptions().dtype(torch::kFloat);
    // A stem (1-3 channels: images) has no input gradient to compute; every other convolution has.
    const bool stem = c <= 3;
    const int64_t pad = kernel / 2;
    const torch::Tensor x = torch::randn({32, c, hw, hw}, o).requires_grad_(!stem),
                        w = torch::randn({k, c, kernel, kernel}, o).requires_grad_();
    torch::conv2d(x, w, {}, stride, pad).sum().backward();  // warm-up: oneDNN's primitive cache
    if (!stem) x.mutable_grad() = torch::Tensor();
    w.mutable_grad() = torch::Tensor();
    int64_t before = probes::AccountingAllocator::current();
    probes::AccountingAllocator::reset_peak();
    const torch::Tensor y = torch::conv2d(x, w, {}, stride, pad);
    const int64_t out_bytes = y.numel() * 4, in_bytes = x.numel() * 4;
    const int64_t forward = probes::AccountingAllocator::peak() - before - out_bytes;
    const torch::Tensor g = torch::ones_like(y);
    before = probes::AccountingAllocator::current();
    probes::AccountingAllocator::reset_peak();
    y.backward(g);
    const int64_t backward = probes::AccountingAllocator::peak() - before - (stem ? 0 : in_bytes) - w.numel() * 4;
    out.push_back({{"in_channels", c}, {"out_channels", k}, {"kernel", kernel}, {"stride", stride}, {"input_gradient", !stem},
                   {"input_bytes", in_bytes}, {"output_bytes", out_bytes}, {"forward_bytes", std::max<int64_t>(0, forward)},
                   {"backward_bytes", std::max<int64_t>(0, backward)}});
  }
  return out;
}

// What a CPU batch norm's backward (training mode) allocates beyond its input's gradient: a temporary
// the size of its input, on these shapes. The planner scales it by each batch norm's input bytes.
json batch_norm_workspace() {
  json out = json::array();
  for (const auto& [c, hw] : std::vector<std::pair<int64_t, int64_t>>{{8, 28}, {16, 14}, {64, 8}}) {
    torch::nn::BatchNorm2d bn(c);
    const torch::Tensor x = torch::randn({32, c, hw, hw}).requires_grad_();
    const torch::Tensor y = bn->forward(x), g = torch::ones_like(y);
    const int64_t before = probes::AccountingAllocator::current();
    probes::AccountingAllocator::reset_peak();
    y.backward(g);
    const int64_t in_bytes = x.numel() * 4, params = 2 * c * 4;
    out.push_back({{"channels", c}, {"input_bytes", in_bytes},
                   {"backward_bytes", std::max<int64_t>(0, probes::AccountingAllocator::peak() - before - in_bytes - params)}});
  }
  return out;
}

#ifdef TRAINSCOPE_TORCH_CUDA
// What the first GEMMs of a process leave allocated on a GPU: cuBLAS's and cuBLASLt's workspaces, one
// per handle and stream, which PyTorch takes from its caching allocator and keeps; the main thread's
// handle (forward) and the autograd thread's (backward) each get theirs. Measured with a Linear's
// forward and backward in fp32 and bf16 before any other GEMM of the cell's process; the planner adds
// it to every GPU cell's peak.
int64_t cuda_gemm_workspace(const std::string& device) {
  const c10::DeviceIndex index = torch::Device(device).index() < 0 ? 0 : torch::Device(device).index();
  const auto allocated = [index] { return c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[0].current; };
  std::vector<torch::Tensor> keep;
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    const auto o = torch::TensorOptions().dtype(dtype).device(device);
    keep.push_back(torch::randn({256, 512}, o));
    keep.push_back(torch::randn({512, 512}, o).requires_grad_(true));
    keep.push_back(torch::randn({512}, o).requires_grad_(true));
  }
  torch::cuda::synchronize();
  const int64_t before = allocated();
  for (size_t i = 0; i < keep.size(); i += 3) {
    torch::nn::functional::linear(keep[i], keep[i + 1], keep[i + 2]).sum().backward();
    keep[i + 1].mutable_grad() = torch::Tensor();
    keep[i + 2].mutable_grad() = torch::Tensor();
  }
  torch::cuda::synchronize();
  return std::max<int64_t>(0, allocated() - before);
}
#endif

// Process faults for testing the isolation (config keys `inject`, `inject_rank`, `inject_step`): they
// fire before training step `inject_step` on the chosen rank (every rank for -1).
class FaultProbe : public Probe {
 public:
  FaultProbe(const RunConfig& c, int rank) : kind_(c.inject), step_(c.inject_step), slow_(slow_percent(c.inject) / 100) {
    armed_ = c.inject_rank < 0 || c.inject_rank == rank;
  }
  std::string name() const override { return "fault"; }
  void step_begin(const StepInfo& s) override {
    began_ = std::chrono::steady_clock::now();
    if (!armed_ || s.step != step_) return;
    if (kind_ == "crash") std::raise(SIGSEGV);
    if (kind_ == "abort") std::abort();
    if (kind_ == "throw") throw std::runtime_error("injected exception");
    if (kind_ == "hang")
      while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  // slow:<pct>: the step busy-waits pct percent of what it took so far (every step, every rank), as
  // compute would (a sleep's wake-up latency would add its own delay on short steps).
  void optimizer_end(const StepInfo&) override {
    if (slow_ <= 0 || !armed_) return;
    const auto until = std::chrono::steady_clock::now() + (std::chrono::steady_clock::now() - began_) * slow_;
    while (std::chrono::steady_clock::now() < until) {
    }
  }
  json section() const override { return nullptr; }

 private:
  std::string kind_;
  int64_t step_;
  double slow_ = 0;
  bool armed_ = false;
  std::chrono::steady_clock::time_point began_{};
};

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
  json q{{"final_loss", o.final_loss}, {"loss_curve", curve}, {"step_losses", o.step_losses}};
  q["accuracy"] = o.accuracy ? json(*o.accuracy) : json(nullptr);
  q["first_nonfinite_step"] = o.first_nonfinite_step ? json(*o.first_nonfinite_step) : json(nullptr);
  return q;
}

}  // namespace

namespace {
// A cell's (or rank's) result path without its .json: the stem its other files share.
std::string result_stem(const std::string& result_path) {
  return result_path.size() > 5 && result_path.substr(result_path.size() - 5) == ".json"
             ? result_path.substr(0, result_path.size() - 5)
             : result_path;
}
}  // namespace

std::string trace_path(const std::string& result_path) { return result_stem(result_path) + ".trace.json"; }

std::string parameters_path(const std::string& result_path) { return result_stem(result_path) + ".params.pt"; }
std::string parity_dump_path(const std::string& result_path) { return result_stem(result_path) + ".parity.pt"; }

namespace {
c10::impl::GenericDict named_dict(const std::vector<std::pair<std::string, torch::Tensor>>& named) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, t] : named) d.insert(name, t);
  return d;
}

// In Python's torch.save format (torch.load reads it with weights_only=True).
void write_parity_dump(const std::string& path, const suites::ParityRecord& rec,
                       const std::vector<std::pair<std::string, torch::Tensor>>& final_params,
                       const std::vector<double>& step_losses,
                       const std::vector<std::pair<std::string, torch::Tensor>>& ssl_losses) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  if (!ssl_losses.empty()) d.insert("ssl_losses", named_dict(ssl_losses));
  d.insert("initial", named_dict(rec.initial));
  d.insert("final", named_dict(final_params));
  d.insert("first_grads", named_dict(rec.first_grads));
  d.insert("inputs", torch::stack(rec.inputs));
  d.insert("targets", torch::stack(rec.targets));
  d.insert("rng_state", rec.rng_state);
  d.insert("step_losses", torch::tensor(step_losses, torch::kDouble));
  d.insert("scales", torch::tensor(rec.scales, torch::kDouble));
  std::vector<int64_t> inf(rec.found_inf.begin(), rec.found_inf.end());
  d.insert("found_inf", torch::tensor(inf, torch::kLong));
  c10::Dict<std::string, std::string> dtypes;
  for (const auto& [block, dtype] : rec.block_dtypes) dtypes.insert(block, dtype);
  d.insert("block_dtypes", dtypes);
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(d));
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) throw std::runtime_error("cannot write " + tmp);
  }
  std::filesystem::rename(tmp, path);
}
}  // namespace

json cell_without_metrics(const std::string& name, const json& config, const std::string& device,
                          const std::string& status, const std::string& reason) {
  return json{{"name", name}, {"config", config},  {"device", device},
              {"status", status}, {"reason", reason}, {"emulated", false}};
}

json merge_ranks(const std::vector<json>& cells) {
  json merged = cells.at(0);
  json ranks = json::array();
  std::vector<json> rng;
  double slowest = -1, fastest = -1;
  int64_t slow_rank = 0;
  for (size_t r = 0; r < cells.size(); ++r) {
    const json m = cells[r].value("metrics", json::object());
    const json p50 = reports::value_at(m, {"timing", "step_time_s", "p50"});
    ranks.push_back({{"rank", r},
                     {"status", cells[r].value("status", "failed")},
                     {"step_time_p50_s", p50},
                     {"samples_per_s_per_device", reports::value_at(m, {"timing", "samples_per_s_per_device"})},
                     {"peak_bytes", reports::value_at(m, {"memory", "peak_bytes"})},
                     {"model_state_bytes", reports::value_at(m, {"memory", "model_state_total_bytes"})},
                     {"model_state_parts", reports::value_at(m, {"memory", "model_state_bytes"})},
                     {"comm_time_s", reports::value_at(m, {"comm", "comm_time_s"})},
                     {"exposed_comm_time_s", reports::value_at(m, {"comm", "exposed_comm_time_s"})}});
    if (p50.is_number()) {
      if (p50.get<double>() > slowest) slowest = p50.get<double>(), slow_rank = static_cast<int64_t>(r);
      if (fastest < 0 || p50.get<double>() < fastest) fastest = p50.get<double>();
    }
    rng.push_back(reports::value_at(m, {"rng"}));
    // A rank that ended otherwise (a divergence only it saw) decides the cell's status.
    if (merged["status"] == "ok" && cells[r].value("status", "ok") != "ok") {
      merged["status"] = cells[r]["status"];
      merged["reason"] = "rank " + std::to_string(r) + ": " + cells[r].value("reason", "");
    }
  }
  // Nodes: the ranks grouped by the host they ran on, in rank order (node 0 holds rank 0). Launchers
  // disagree on a node index (torchrun's GROUP_RANK, SLURM_NODEID, none under Open MPI, whose
  // NODE_RANK is a rank within the node), the host name is what every launch shares.
  json nodes = json::array();
  for (size_t r = 0; r < cells.size(); ++r) {
    const std::string host = cells[r].value("host", "");
    size_t node = 0;
    while (node < nodes.size() && nodes[node]["host"] != host) ++node;
    if (node == nodes.size()) nodes.push_back({{"node", node}, {"host", host}, {"ranks", json::array()}});
    nodes[node]["ranks"].push_back(r);
    ranks[r]["host"] = host;
    ranks[r]["node"] = node;
  }
  merged["ranks"] = ranks;
  merged["nodes"] = nodes;
  merged["slowest_rank"] = slowest >= 0 ? json(slow_rank) : json(nullptr);
  merged["rank_step_time_spread"] = fastest > 0 ? json(slowest / fastest - 1) : json(nullptr);
  if (merged.contains("metrics") && merged["metrics"].contains("rng")) {
    json verdicts = probes::compare_rng(rng);
    verdicts["every"] = merged["metrics"]["rng"].value("every", json(nullptr));
    merged["metrics"]["rng"] = verdicts;
  }
  return merged;
}

namespace {
// Every rank writes its own result; rank 0's is the merge of all of them, which reach it through the store.
void write_result(const std::string& result_path, suites::Communicator* comm, const CellRank& rk, json cell) {
  cell["host"] = host_name();  // which machine this rank ran on: merge_ranks groups the ranks into nodes by it
  if (comm && rk.rank != 0) {
    comm->store_set("result/" + std::to_string(rk.rank), cell.dump());
  } else if (comm) {
    std::vector<json> cells{cell};
    for (int r = 1; r < rk.world; ++r) cells.push_back(json::parse(comm->store_get("result/" + std::to_string(r))));
    cell = merge_ranks(cells);
  }
  reports::write_json_atomic(result_path, cell);
}
}  // namespace

// metrics.ssl: how the encoder was (pre-)trained, then, on rank 0 of a finished run, how it scores
// (suites/ssl/evaluate.hpp), timed apart from training. save_encoder writes it first.
static json ssl_section(suites::Trainer& trainer, const RunConfig& config, const json& metrics, const suites::TrainOutcome& outcome,
                 double train_wall_s, const std::string& device, const std::string& floors_cache) {
  json pretrain = {{"steps", outcome.steps_run},
                   {"wall_s", train_wall_s},
                   {"step_time_s", reports::value_at(metrics, {"timing", "step_time_s", "p50"})},
                   {"images_per_s", reports::value_at(metrics, {"timing", "samples_per_s"})}};
  if (auto* objective = trainer.objective())
    pretrain.update(objective->describe());
  else
    pretrain["views"] = 1;
  json ssl = {{"method", config.method},
              {"encoder", config.model},
              {"feature_dim", trainer.encoder().feature_dim()},
              {"unlabeled_size", trainer.data().train_size()},
              {"pretrained", config.pretrained.empty() ? json(nullptr) : json(std::filesystem::path(config.pretrained).filename().string())},
              {"pretrain", pretrain}};
  if (trainer.rank() != 0 || outcome.status != "ok") return ssl;
  if (!config.save_encoder.empty()) {
    suites::save_parameters(trainer.encoder(), config.save_encoder);
    ssl["saved_encoder"] = std::filesystem::path(config.save_encoder).filename().string();
  }
  suites::ssl::EvalSetup setup{config, trainer.preset(), trainer.data().shape(), device, floors_cache, train_wall_s};
  const json eval = suites::ssl::evaluate(trainer.encoder(), trainer.data(), setup);
  if (eval.is_object()) ssl.update(eval);
  return ssl;
}

namespace {

// The hardware itself (`kind` other than train): one measurement, no training loop.
json hardware_cell(const std::string& name, const RunConfig& config, const std::string& device, int threads, Hooks& hooks,
                   suites::Communicator* comm, const CellRank& rk) {
  json cell = cell_without_metrics(name, config.to_json(), device, "ok", "");
  cell["threads"] = threads;
  cell["device_name"] = device_name(device);
  json metrics;
  if (config.kind == "gemm-peak") {
    metrics["hardware"]["gemm"] = json::array();
#ifdef TRAINSCOPE_TORCH_CUDA
    if (device != "cpu") metrics["hardware"]["gemm_workspace_bytes"] = cuda_gemm_workspace(device);
#endif
    for (const auto& dtype : suites::peak_dtypes(device)) {
      json g = suites::gemm_peak(device, dtype, config.thorough);
      if (!g.contains("skipped") && device == "cpu") g["workspace"] = gemm_workspace(dtype);
      metrics["hardware"]["gemm"].push_back(g);
    }
    if (device == "cpu") {
      metrics["hardware"]["conv_workspace"] = conv_workspace();
      metrics["hardware"]["batch_norm_workspace"] = batch_norm_workspace();
    }
  } else if (config.kind == "memory-bandwidth") {
    metrics["hardware"]["memory"] = suites::memory_bandwidth(device);
  } else if (config.kind == "copy-bandwidth") {
    metrics["hardware"]["copy"] = suites::copy_bandwidth(device);
  } else {  // collectives: world_size >= 2, so the communicator and its probe exist
    RunInfo info;
    info.config = &config;
    info.device = device;
    info.rank = rk.rank;
    info.world_size = rk.world;
    info.collectives = comm->implementation();
    hooks.run_begin(info);
    const json levels = suites::collectives_sweep(*comm, device, static_cast<int>(config.warmup_steps), static_cast<int>(config.steps));
    for (const auto& p : hooks.probes())
      if (p->name() == "comm") metrics["comm"] = p->section();
    metrics["hardware"]["collectives"] = {{"backend", comm->backend()}, {"world_size", rk.world}};
    if (!levels.is_null()) metrics["hardware"]["collectives"]["levels"] = levels;
    cell["rank"] = rk.rank;
    cell["world_size"] = rk.world;
  }
  cell["metrics"] = metrics;
  return cell;
}

// A training cell's configuration as its process runs it: save_encoder and pretrained name files of the
// run ({model} and {method} standing for the cell's), relative paths inside its output folder.
RunConfig run_config_of(const RunConfig& config, const std::string& result_path) {
  const std::filesystem::path run_dir = std::filesystem::path(result_path).parent_path().parent_path();
  RunConfig run_config = config;
  const auto in_run_dir = [&](std::string& p) {
    for (const auto& [field, value] : {std::pair<std::string, std::string>{"{model}", config.model}, {"{method}", config.method}})
      for (size_t at = p.find(field); at != std::string::npos; at = p.find(field)) p.replace(at, field.size(), value);
    if (!p.empty() && std::filesystem::path(p).is_relative()) p = (run_dir / p).string();
  };
  in_run_dir(run_config.save_encoder);
  in_run_dir(run_config.pretrained);
  if (!run_config.pretrained.empty() && !std::filesystem::exists(run_config.pretrained))
    throw UsageError("pretrained: no encoder at '" + run_config.pretrained +
                     "' (the cell that saves it, with save_encoder, must run first in the same output folder)");
  return run_config;
}

// The probes of a training cell, in the order they see each hook.
void add_training_probes(Hooks& hooks, const RunConfig& config, const std::string& device, suites::Trainer& trainer,
                         suites::Communicator* comm, int rank) {
  hooks.add(std::make_shared<probes::TimingProbe>());  // before memory: its GEMM-peak measurement comes before memory's baseline
  hooks.add(std::make_shared<probes::MemoryProbe>(device == "cpu" ? memory_budget_bytes(config) : 0));
  hooks.add(std::make_shared<probes::OverflowProbe>(config.overflow_every));
  if (comm) hooks.add(std::make_shared<probes::RngProbe>(config.rng_every));
  if (config.inject != "none") hooks.add(std::make_shared<FaultProbe>(config, rank));
  if (device.rfind("cuda", 0) == 0)
    if (auto nvtx = probes::make_nvtx_probe()) hooks.add(nvtx);
  if (config.timeline) hooks.add(probes::make_timeline_probe());
  if (config.operator_times) hooks.add(std::make_shared<probes::OperatorTimeProbe>());
  if (trainer.objective()) {
    const int64_t total = config.warmup_steps + config.steps;
    hooks.add(std::make_shared<probes::SslHealthProbe>(config.log_every > 0 ? config.log_every : std::max<int64_t>(1, total / 50)));
  }
}

// What a finished training cell says of itself, besides its probes' sections.
json training_cell(const std::string& name, const RunConfig& config, const std::string& device, int threads, suites::Trainer& trainer,
                   const RunInfo& info, const suites::TrainOutcome& outcome, suites::Communicator* comm, const CellRank& rk) {
  json cell = cell_without_metrics(name, config.to_json(), device, outcome.status, outcome.reason);
  cell["emulated"] = trainer.mode().emulated;
  if (trainer.mode().fp8) {
    const auto [fp8, bf16] = suites::fp8_layer_counts();
    cell["fp8"] = {{"linear_calls_fp8", fp8}, {"linear_calls_bf16", bf16}, {"scaling", config.fp8_scaling}};
  }
  if (config.checkpoint_check) {
    const auto d = suites::checkpoint_determinism();
    cell["checkpoint_determinism"] = {{"compared", d.compared}, {"max_abs_diff", d.max_abs_diff}};
  }
  cell["threads"] = threads;
  cell["model"] = {{"preset", info.model_name},
                   {"parameters", info.parameters},
                   {"analytic_parameters", trainer.model().analytic_parameters()},
                   {"training_flops_per_sample", info.flops_per_sample},
                   {"tokens_per_sample", info.tokens_per_sample},
                   {"shape", trainer.preset().to_json()}};
  if (!info.flops_convention.empty()) {
    cell["model"]["flops_convention"] = info.flops_convention;
    cell["model"]["causal_flops_per_sample"] = info.causal_flops_per_sample;
  }
  if (const std::string b = trainer.model().attention_backend(); !b.empty()) cell["model"]["attention_backend"] = b;
  cell["data"] = suites::resolve_data(config.data, trainer.preset());
  cell["steps_run"] = outcome.steps_run;
  if (config.time_budget_s > 0)
    cell["time_budget"] = {{"budget_s", config.time_budget_s},
                           {"steps_planned", config.warmup_steps + config.steps},
                           {"steps_run", outcome.steps_run},
                           {"stopped_early", outcome.budget_stopped}};
  if (comm) {
    cell["rank"] = rk.rank;
    cell["world_size"] = rk.world;
    cell["backend"] = comm->backend();
  }
  cell["layout"] = trainer.mesh().layout().to_json();
  cell["layout"]["sharding"] = trainer.strategy().sharding_level();
  return cell;
}

// The probes' sections, with the device timeline's view of the communication where there is one.
json metrics_of(const Hooks& hooks, const suites::TrainOutcome& outcome) {
  json metrics = json::object();
  for (const auto& p : hooks.probes())
    if (p->name() != "nvtx" && p->name() != "fault") metrics[p->name()] = p->section();
  metrics["quality"] = quality_section(outcome);
  if (metrics.contains("comm") && metrics.contains("timeline") && metrics["timeline"].value("available", false)) {
    // On a GPU the device's timeline says what the step waited for; the host's view stays beside it.
    json& c = metrics["comm"];
    c["host_view"] = {{"exposed_comm_time_s", c["exposed_comm_time_s"]}, {"overlap", c["overlap"]}};
    c["exposed_comm_time_s"] = metrics["timeline"]["exposed_communication_s"];
    c["overlap"] = metrics["timeline"]["overlap"];
    c["overlap_source"] = "device timeline (CUPTI)";
  }
  return metrics;
}

// save_parameters and parity_dump: a collective under zero3 and with masters (every rank takes part).
void write_parameters(suites::Trainer& trainer, const RunConfig& config, const suites::TrainOutcome& outcome,
                      const std::string& result_path, json& cell) {
  if (config.save_parameters) {
    std::vector<torch::Tensor> params;
    for (const auto& [name, p] : trainer.final_parameters()) params.push_back(p.to(torch::kFloat));
    torch::save(params, parameters_path(result_path));
  }
  if (!config.parity_dump) return;
  std::vector<std::pair<std::string, torch::Tensor>> final_params = trainer.final_parameters();
  const suites::ParityRecord* rec = trainer.parity();
  if (!rec) return;
  // An SSL cell also carries its objectives on fixed tensors and one SimCLR and one DINO step on
  // fixed views, for the lightly rows.
  decltype(final_params) ssl_probes;
  if (trainer.objective()) {
    ssl_probes = suites::ssl::loss_probe(config);
    for (auto& item : suites::ssl::step_probe(config, trainer.preset(), trainer.data().shape())) ssl_probes.push_back(std::move(item));
  }
  write_parity_dump(parity_dump_path(result_path), *rec, final_params, outcome.step_losses, ssl_probes);
  cell["parity_dump"] = std::filesystem::path(parity_dump_path(result_path)).filename().string();
}

// A training cell from set-up to its result file.
void train_cell(const std::string& name, const RunConfig& config, const std::string& device, int threads, Hooks& hooks,
                suites::Communicator* comm, const CellRank& rk, const std::string& result_path) {
  const RunConfig run_config = run_config_of(config, result_path);
  suites::Trainer trainer(run_config, device, comm);
  add_training_probes(hooks, config, device, trainer, comm, rk.rank);
  const RunInfo info = trainer.info();
  const auto train_started = std::chrono::steady_clock::now();
  const suites::TrainOutcome outcome = suites::train(trainer, config, hooks, info);
  const double train_wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - train_started).count();
  json cell = training_cell(name, config, device, threads, trainer, info, outcome, comm, rk);
  json metrics = metrics_of(hooks, outcome);
  if (trainer.objective() || ssl_eval_mode(config) != "off") {
    const std::filesystem::path run_dir = std::filesystem::path(result_path).parent_path().parent_path();
    metrics["ssl"] = ssl_section(trainer, run_config, metrics, outcome, train_wall_s, device, (run_dir / "ssl-raw-pixel-floor.json").string());
  }
  cell["metrics"] = metrics;
  write_parameters(trainer, config, outcome, result_path, cell);
  write_result(result_path, comm, rk, cell);
}

}  // namespace

int cell_main(const std::string& spec_path, const std::string& result_path, const CellRank& rk) {
  // First, before any tensor exists, so that every byte of tensor storage is counted.
  probes::AccountingAllocator::install();
  const json spec = reports::read_json_file(spec_path);
  const std::string name = spec.at("name");
  std::string device = spec.at("device");
  const RunConfig config = RunConfig::from_json(spec.at("config"));
  // Each local rank on its own GPU.
  if (rk.world > 1 && device.rfind("cuda", 0) == 0) device = "cuda:" + std::to_string(rk.local_rank);
  try {
    limit_device_memory(device, memory_budget_bytes(config));
    // Ranks sharing this machine share its cores.
    int64_t want_threads = config.threads;
    if (want_threads == 0 && rk.local_world > 1)
      want_threads = std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()) / rk.local_world);
    const int threads = probes::configure_threads(want_threads);
    Hooks hooks;
    // First, so that the timeline has the set-up collectives too.
    if (config.trace) hooks.add(std::make_shared<probes::TraceProbe>(trace_path(result_path), rk.rank));
    std::unique_ptr<suites::Communicator> comm;
    if (rk.world > 1) {
      const bool cuda = device.rfind("cuda", 0) == 0;
      const std::string backend = config.backend == "auto" ? (cuda ? "nccl" : "gloo") : config.backend;
      comm = std::make_unique<suites::Communicator>(
          suites::Rendezvous{rk.store_host, rk.store_port, rk.prefix, rk.rank, rk.world, rk.local_world < rk.world}, backend,
          torch::Device(device), config.collective_timeout_s);
      comm->set_observer([&hooks](const CollectiveInfo& c) { hooks.collective(c); });
      hooks.add(std::make_shared<probes::CommProbe>());  // before the trainer: it sees the initial broadcast
    }
    if (config.kind != "train") write_result(result_path, comm.get(), rk, hardware_cell(name, config, device, threads, hooks, comm.get(), rk));
    else train_cell(name, config, device, threads, hooks, comm.get(), rk, result_path);
    return 0;
  } catch (const c10::OutOfMemoryError& e) {
    const std::string what = e.what();
    json cell = cell_without_metrics(name, config.to_json(), device, "oom", what.substr(0, what.find('\n')));
    cell["oom_phase"] = probes::AccountingAllocator::phase();
    if (rk.world > 1) cell["rank"] = rk.rank;
    reports::write_json_atomic(result_path, cell);
    std::fprintf(stderr, "cell %s: %s\n", name.c_str(), what.c_str());
    // Alone, an oom is a result; among ranks the others would wait for this one in a collective, so
    // the exit code tells the launcher to stop them now.
    return rk.world > 1 ? kRankOom : 0;
  } catch (const std::exception& e) {
    // torch's messages carry a backtrace after the first line; the report keeps the first line.
    const std::string what = e.what();
    const std::string reason = what.substr(0, what.find('\n'));
    json cell = cell_without_metrics(name, config.to_json(), device, "failed", reason);
    // Among ranks, the one that failed first is the cause; the others fail on the broken connection.
    cell["failed_at"] = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    reports::write_json_atomic(result_path, cell);
    std::fprintf(stderr, "cell %s failed: %s\n", name.c_str(), what.c_str());
    return 1;
  }
}

}  // namespace trainscope::runners
