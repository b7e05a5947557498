#include "probes/step/timing.hpp"

#include <algorithm>
#include <chrono>

#include <torch/torch.h>

#include "core/devices.hpp"
#include "core/precision.hpp"
#include "core/model_shape.hpp"
#include "core/stats.hpp"

#ifdef TRAINSCOPE_TORCH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#endif

namespace trainscope::probes {
namespace {

class HostClock : public StepClock {
 public:
  void mark(int point) override { now_[static_cast<size_t>(point)] = std::chrono::steady_clock::now(); }
  void finish_step() override {
    auto secs = [&](size_t from, size_t to) { return std::chrono::duration<double>(now_[to] - now_[from]).count(); };
    steps_.push_back({secs(0, 1), secs(1, 2), secs(2, 3), secs(0, 4)});
  }
  std::vector<std::array<double, 4>> resolve() override { return steps_; }
  std::string kind() const override { return "host-steady-clock"; }

 private:
  std::array<std::chrono::steady_clock::time_point, 5> now_{};
  std::vector<std::array<double, 4>> steps_;
};

#ifdef TRAINSCOPE_TORCH_CUDA
// Events recorded on the current CUDA stream; elapsed times are read after the run.
class CudaEventClock : public StepClock {
 public:
  void mark(int point) override {
    if (point == 0) steps_.emplace_back();
    auto& ev = steps_.back()[static_cast<size_t>(point)];
    ev = std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault);
    ev->record();
  }
  void finish_step() override {}
  std::vector<std::array<double, 4>> resolve() override {
    std::vector<std::array<double, 4>> out;
    for (auto& e : steps_) {
      e[4]->synchronize();
      std::array<double, 4> d{};
      for (size_t i = 0; i < 3; ++i) d[i] = e[i]->elapsed_time(*e[i + 1]) / 1e3;
      d[3] = e[0]->elapsed_time(*e[4]) / 1e3;
      out.push_back(d);
    }
    return out;
  }
  std::string kind() const override { return "cuda-events"; }

 private:
  std::vector<std::array<std::unique_ptr<at::cuda::CUDAEvent>, 5>> steps_;
};
#endif

double nan_if_zero(double v) { return v > 0 ? v : std::nan(""); }

}  // namespace

std::unique_ptr<StepClock> make_step_clock(const std::string& device) {
#ifdef TRAINSCOPE_TORCH_CUDA
  if (device.rfind("cuda", 0) == 0) return std::make_unique<CudaEventClock>();
#endif
  return std::make_unique<HostClock>();
}

double measure_gemm_peak(const std::string& device, const std::string& dtype, int repeats) {
  const bool cuda = device.rfind("cuda", 0) == 0;
  const int64_t n = cuda ? 8192 : 1024;
  const auto scalar = dtype == "bf16" ? torch::kBFloat16 : dtype == "fp16" ? torch::kHalf : dtype == "fp64" ? torch::kDouble : torch::kFloat;
  auto& ctx = at::globalContext();
  const bool tf32_before = ctx.allowTF32CuBLAS();
  ctx.setAllowTF32CuBLAS(dtype == "tf32");
  torch::NoGradGuard no_grad;
  auto opts = torch::TensorOptions().dtype(scalar).device(device);
  auto a = torch::randn({n, n}, opts), b = torch::randn({n, n}, opts), c = torch::empty({n, n}, opts);
  const bool fp8 = dtype == "fp8" && cuda;  // e4m3 through _scaled_mm (fp8 cells run on sm89+ only)
  const auto one = torch::ones({}, opts.dtype(torch::kFloat));
  if (fp8) {
    a = a.to(torch::kFloat8_e4m3fn);
    b = b.to(torch::kFloat8_e4m3fn).t().contiguous().t();  // column-major, as _scaled_mm wants
  }
  auto sync = [&] {
    if (cuda) torch::cuda::synchronize();
  };
  double best = 0;
  for (int r = 0; r <= repeats; ++r) {  // the first run warms up and is not counted
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    if (fp8) at::_scaled_mm(a, b, one, one, std::nullopt, std::nullopt, torch::kBFloat16);
    else torch::mm_out(c, a, b);
    sync();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::max(best, 2.0 * n * n * n / s);
  }
  ctx.setAllowTF32CuBLAS(tf32_before);
  return best;
}

void TimingProbe::run_begin(const RunInfo& info) {
  info_ = info;
  samples_per_step_ = info.config ? info.config->batch_size : 0;
  clock_ = make_step_clock(info.device);
  if (measure_peak_ && info.config && !info.compute_dtype.empty()) {
    // The peaks MFU's convention divides by (core/precision.hpp): the GEMMs' dtype, and for fp8 the
    // attention's too.
    const PrecisionTraits& t = precision_traits(info.config->precision);
    std::vector<std::string> dtypes = {info.compute_dtype};
    if (t.fp8_linear && info.compute_dtype == "fp8") dtypes.push_back(t.attention);
    for (const auto& d : dtypes) gemm_peaks_[d] = measure_gemm_peak(info.device, d);
    peak_source_ = "measured " + info.compute_dtype + " GEMM on this device";
  }
}

json throughput_windows(const std::vector<double>& ends, int64_t samples_per_step, double window_s) {
  json windows = json::array();
  if (ends.size() < 2 || window_s <= 0) return json{{"window_s", window_s}, {"windows", windows}, {"drop", nullptr}};
  // A window starts at the end of a step and holds the steps that end within window_s after it.
  size_t first = 0;
  for (size_t i = 1; i < ends.size(); ++i) {
    if (ends[i] - ends[first] < window_s) continue;
    const double span = ends[i] - ends[first];
    const double steps = static_cast<double>(i - first);
    windows.push_back({{"start_s", ends[first] - ends[0]}, {"samples_per_s", steps * samples_per_step / span},
                       {"steps", i - first}});
    first = i;
  }
  json drop = nullptr;
  if (windows.size() >= 2) {
    const double a = windows.front()["samples_per_s"], b = windows.back()["samples_per_s"];
    drop = a > 0 ? json(1.0 - b / a) : json(nullptr);
  }
  return json{{"window_s", window_s}, {"windows", windows}, {"drop", drop}};
}

void TimingProbe::step_end(const StepInfo& s) {
  if (!s.measured) return;
  if (info_.cp_ranks > 1) context_.push_back(s.context);
  step_ends_.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count());
  clock_->mark(4);
  clock_->finish_step();
}

void TimingProbe::run_end(const RunEnd&) {
  if (clock_) steps_ = clock_->resolve();
}

// This rank's pipeline: the bubble it measured (idle over compute, the median over the measured steps)
// and its peak of micro-batch stages in flight, each beside the schedule's replay on equal costs.
json TimingProbe::pipeline_section() const {
  std::vector<double> bubble, wait, span;
  int64_t peak = 0, bytes = 0;
  for (const auto& p : pipeline_) {
    bubble.push_back(p.compute_s > 0 ? (p.span_s - p.compute_s) / p.compute_s : 0.0);
    wait.push_back(p.wait_s);
    span.push_back(p.span_s);
    peak = std::max(peak, p.peak_in_flight);
    bytes = p.p2p_bytes;
  }
  const auto median = [](const std::vector<double>& v) { return v.empty() ? json(nullptr) : json(summarize(v).p50); };
  return {{"schedule", info_.pipeline_schedule},
          {"ranks", info_.pipeline_ranks},
          {"stages_per_rank", info_.pipeline_stages_per_rank},
          {"microbatches", info_.pipeline_microbatches},
          {"rank", info_.rank},
          {"bubble", {{"measured", median(bubble)}, {"formula", info_.pipeline_bubble_formula}}},
          {"in_flight_microbatches", {{"measured", pipeline_.empty() ? json(nullptr) : json(peak)}, {"formula", info_.pipeline_in_flight_formula}}},
          {"wait_s", median(wait)},
          {"span_s", median(span)},
          {"p2p_bytes_per_step", bytes},
          {"actions", info_.pipeline_actions}};
}

// This rank's context-parallel attention: its time, the transfers' time and how much of it the blocks'
// computation hid (1 - blocked / transfer; the all-gather blocks, so it hides none), the bytes it sent,
// and each rank's causal query-key pairs with and without balancing (imbalance: the largest over the mean).
json TimingProbe::context_section() const {
  std::vector<double> attention, wait, transfer;
  int64_t bytes = 0;
  for (const auto& c : context_) {
    attention.push_back(c.attention_s);
    wait.push_back(c.wait_s);
    transfer.push_back(c.transfer_s);
    bytes = c.bytes;
  }
  const auto median = [](const std::vector<double>& v) { return v.empty() ? 0.0 : summarize(v).p50; };
  const auto imbalance = [](const std::vector<double>& pairs) {
    double top = 0, sum = 0;
    for (double p : pairs) top = std::max(top, p), sum += p;
    return sum > 0 ? top * static_cast<double>(pairs.size()) / sum : 0.0;
  };
  const double t = median(transfer);
  return {{"method", info_.cp_method},
          {"balance", info_.cp_balance},
          {"ranks", info_.cp_ranks},
          {"rank", info_.cp_rank},
          {"attention_s", median(attention)},
          {"transfer_s", t},
          {"exposed_s", median(wait)},
          {"hidden_fraction", t > 0 ? std::max(0.0, 1.0 - median(wait) / t) : 0.0},
          {"bytes_sent_per_step", bytes},
          {"pairs_per_rank", {{"balanced", info_.cp_pairs_balanced}, {"contiguous", info_.cp_pairs_contiguous}}},
          {"imbalance", {{"balanced", imbalance(info_.cp_pairs_balanced)}, {"contiguous", imbalance(info_.cp_pairs_contiguous)}}}};
}

json TimingProbe::section() const {
  std::vector<double> step, fwd, bwd, opt;
  for (const auto& d : steps_) {
    fwd.push_back(d[0]);
    bwd.push_back(d[1]);
    opt.push_back(d[2]);
    step.push_back(d[3]);
  }
  const Summary st = summarize(step);
  json j;
  j["step_time_s"] = to_json(st);
  j["phase_time_s"] = {{"forward", to_json(summarize(fwd))},
                       {"backward", to_json(summarize(bwd))},
                       {"optimizer", to_json(summarize(opt))}};
  // Every measured step, so that a comparison can test distributions and not only percentiles.
  j["samples_s"] = {{"step", step}, {"forward", fwd}, {"backward", bwd}, {"optimizer", opt}};
  j["clock"] = clock_ ? clock_->kind() : "none";
  if (!info_.pipeline_schedule.empty()) j["pipeline"] = pipeline_section();
  if (info_.cp_ranks > 1) j["context_parallel"] = context_section();
  // Global throughput: every data-parallel rank steps in lockstep on its own slice of the global batch,
  // which the model-parallel ranks of that slice share (each device's share: 1/model_parallel of it).
  // FLOP/s are global too; MFU divides by the peak of all the devices (the per-device peak x ranks).
  const double world = static_cast<double>(std::max<int64_t>(info_.world_size, 1));
  const double share = static_cast<double>(samples_per_step_) / static_cast<double>(std::max<int64_t>(info_.model_parallel, 1));
  const double per_device = st.count > 0 && st.mean > 0 ? share / st.mean : std::nan("");
  const double samples_per_s = per_device * world;
  j["samples_per_s"] = samples_per_s;
  j["samples_per_s_per_device"] = per_device;
  j["tokens_per_s"] = info_.tokens_per_sample > 0 ? json(samples_per_s * info_.tokens_per_sample) : json(nullptr);
  // The raw measurements; MFU and its peaks derive from them (core/precision.hpp: derive_mfu), so that a
  // stored report can be derived again under later definitions.
  j["flops_per_sample"] = info_.flops_per_sample;
  j["attention_flops_per_sample"] = info_.attention_flops_per_sample;
  j["recompute_flops_per_sample"] = info_.recompute_flops_per_sample;
  json peaks = json::object();
  for (const auto& [d, v] : gemm_peaks_) peaks[d] = nan_if_zero(v);
  j["gemm_peaks_flops_per_s"] = peaks;
  j["peak_source"] = gemm_peaks_.empty() ? json(nullptr) : json(peak_source_);
  if (!info_.flops_convention.empty()) {
    // MFU is on the full-attention convention; the causal count (Megatron-Bridge's) stands beside it.
    j["flops_convention"] = info_.flops_convention;
    j["causal"] = {{"convention", flop_convention_name(FlopConvention::Causal)}, {"flops_per_sample", info_.causal_flops_per_sample}};
  }
  if (info_.config)
    derive_mfu(j, precision_traits(info_.config->precision), info_.compute_dtype, device_name(info_.device), info_.world_size);
  j["throughput_over_run"] =
      throughput_windows(step_ends_, samples_per_step_, info_.config ? info_.config->sustain_window_s : 60.0);
  return j;
}

}  // namespace trainscope::probes
