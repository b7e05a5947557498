#include "probes/memory.hpp"

#include <algorithm>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/torch.h>


#ifdef TRAINSCOPE_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace trainscope::probes {
namespace {

std::atomic<int64_t> g_current{0}, g_peak{0}, g_phase_peak{0};
std::atomic<bool> g_installed{false};
std::atomic<int64_t> g_budget{0};
std::atomic<const char*> g_phase{"setup"};

void raise_to(std::atomic<int64_t>& target, int64_t value) {
  int64_t seen = target.load(std::memory_order_relaxed);
  while (value > seen && !target.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

// Each block carries its size in a 64-byte header in front of the data, so the deleter needs no
// lookup; the DataPtr's context is the data pointer itself, which torch's raw_allocate expects.
constexpr size_t kHeader = 64;

void counted_delete(void* data) {
  if (!data) return;
  char* block = static_cast<char*>(data) - kHeader;
  const int64_t bytes = *reinterpret_cast<int64_t*>(block);
  AccountingAllocator::on_free(bytes);
  c10::free_cpu(block);
}

class CountingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const int64_t budget = g_budget.load(std::memory_order_relaxed);
    if (budget > 0) {
      const int64_t live = g_current.load(std::memory_order_relaxed);
      TORCH_CHECK_WITH(OutOfMemoryError, live + static_cast<int64_t>(n) <= budget,
                       "out of memory in ", g_phase.load(), ": asked for ", n, " bytes with ", live,
                       " live, budget ", budget, " bytes");
    }
    char* block = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    *reinterpret_cast<int64_t*>(block) = static_cast<int64_t>(n);
    AccountingAllocator::on_alloc(static_cast<int64_t>(n));
    void* data = block + kHeader;
    return {data, data, &counted_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingCpuAllocator g_allocator;
constexpr uint8_t kPriority = 100;  // above the default allocator's priority (0)

}  // namespace

void AccountingAllocator::on_alloc(int64_t bytes) {
  const int64_t now = g_current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  raise_to(g_peak, now);
  raise_to(g_phase_peak, now);
}
void AccountingAllocator::on_free(int64_t bytes) { g_current.fetch_sub(bytes, std::memory_order_relaxed); }

void AccountingAllocator::install() {
  if (g_installed.exchange(true)) return;
  c10::SetCPUAllocator(&g_allocator, kPriority);
}
void AccountingAllocator::uninstall() {
  if (!g_installed.exchange(false)) return;
  c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), kPriority);
}
void AccountingAllocator::set_budget(int64_t bytes) { g_budget.store(bytes); }
int64_t AccountingAllocator::budget() { return g_budget.load(); }
void AccountingAllocator::set_phase(const char* phase) { g_phase.store(phase); }
const char* AccountingAllocator::phase() { return g_phase.load(); }
bool AccountingAllocator::installed() { return g_installed.load(); }
int64_t AccountingAllocator::current() { return g_current.load(); }
int64_t AccountingAllocator::peak() { return g_peak.load(); }
int64_t AccountingAllocator::phase_peak() { return g_phase_peak.load(); }
void AccountingAllocator::reset_peak() { g_peak.store(g_current.load()); }
void AccountingAllocator::reset_phase_peak() { g_phase_peak.store(g_current.load()); }

void MemoryProbe::run_begin(const RunInfo& info) {
  cuda_ = info.device.rfind("cuda", 0) == 0;
  device_index_ = cuda_ && info.device.size() > 5 ? std::stoi(info.device.substr(5)) : 0;
#ifdef TRAINSCOPE_TORCH_CUDA
  if (cuda_) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(device_index_);
  }
#endif
  baseline_ = live_now();
  if (!cuda_) {
    AccountingAllocator::reset_peak();
    AccountingAllocator::set_budget(budget_);
  }
}

void MemoryProbe::phase_begin() {
#ifdef TRAINSCOPE_TORCH_CUDA
  if (cuda_) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(device_index_);
    return;
  }
#endif
  AccountingAllocator::reset_phase_peak();
}

int64_t MemoryProbe::phase_end() {
#ifdef TRAINSCOPE_TORCH_CUDA
  if (cuda_) {
    // Stat index 0 is the aggregate over small and large pools (StatType::AGGREGATE).
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_index_);
    reserved_peak_ = std::max<int64_t>(reserved_peak_, stats.reserved_bytes[0].peak);
    alloc_retries_ = stats.num_alloc_retries;
    ooms_ = stats.num_ooms;
    const int64_t p = stats.allocated_bytes[0].peak;
    peak_ = std::max(peak_, p);
    return p;
  }
#endif
  const int64_t p = AccountingAllocator::phase_peak();
  peak_ = std::max(peak_, p);
  return p;
}

int64_t MemoryProbe::live_now() const {
#ifdef TRAINSCOPE_TORCH_CUDA
  if (cuda_) return c10::cuda::CUDACachingAllocator::getDeviceStats(device_index_).allocated_bytes[0].current;
#endif
  return AccountingAllocator::current();
}

void MemoryProbe::step_begin(const StepInfo&) {
  AccountingAllocator::set_phase("forward");
  phase_begin();
  step_start_ = live_now();
}
void MemoryProbe::forward_end(const StepInfo&) {
  const int64_t p = phase_end();
  forward_ = std::max(forward_, p);
  activation_ = std::max(activation_, p - step_start_);
  AccountingAllocator::set_phase("backward");
  phase_begin();
}
void MemoryProbe::backward_end(const StepInfo&) {
  backward_ = std::max(backward_, phase_end());
  AccountingAllocator::set_phase("optimizer");
  phase_begin();
}
void MemoryProbe::optimizer_end(const StepInfo&) {
  optimizer_ = std::max(optimizer_, phase_end());
  AccountingAllocator::set_phase("between steps");
}

void MemoryProbe::run_end(const RunEnd& e) {
  AccountingAllocator::set_phase("evaluation");
  AccountingAllocator::set_budget(0);
  model_state_ = e.model_state;
  have_end_ = true;
  if (!cuda_) peak_ = std::max(peak_, AccountingAllocator::peak());
}

json MemoryProbe::section() const {
  json j;
  j["source"] = cuda_ ? "cuda-caching-allocator" : "cpu-accounting-allocator";
  j["peak_bytes"] = peak_;
  j["baseline_bytes"] = baseline_;  // live at run start: data, parameters, anything made before
  j["phase_peak_bytes"] = {{"forward", forward_}, {"backward", backward_}, {"optimizer", optimizer_}};
  // Activation memory: how far the forward pass rises above what was live when its step began
  // (parameters, gradients, optimizer state and the batch), the largest over the measured steps.
  j["activation_bytes"] = activation_;
  if (have_end_) {
    j["model_state_bytes"] = {{"params", model_state_.params},
                              {"grads", model_state_.grads},
                              {"optimizer", model_state_.optimizer}};
    j["model_state_total_bytes"] = model_state_.params + model_state_.grads + model_state_.optimizer;
    j["expected_model_state_bytes"] = model_state_.expected;
    j["expected_model_state_formula"] = model_state_.expected_formula;
    j["model_state_difference_bytes"] =
        model_state_.params + model_state_.grads + model_state_.optimizer - model_state_.expected;
  }
  if (budget_ > 0 && !cuda_) j["budget_bytes"] = budget_;
  if (cuda_) {
    j["reserved_peak_bytes"] = reserved_peak_;
    j["alloc_retries"] = alloc_retries_;
    j["ooms"] = ooms_;
  }
  return j;
}

}  // namespace trainscope::probes
