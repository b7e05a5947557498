#include "probes/step/memory.hpp"

#include <algorithm>

#include <torch/torch.h>

#ifdef TRAINSCOPE_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace trainscope::probes {

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
    freed_elsewhere_ = AccountingAllocator::freed_elsewhere();
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
  step_phase_[0] = p;
  forward_ = std::max(forward_, p);
  activation_ = std::max(activation_, p - step_start_);
  AccountingAllocator::set_phase("backward");
  phase_begin();
}
void MemoryProbe::backward_end(const StepInfo&) {
  step_phase_[1] = phase_end();
  backward_ = std::max(backward_, step_phase_[1]);
  AccountingAllocator::set_phase("optimizer");
  phase_begin();
}
void MemoryProbe::optimizer_end(const StepInfo& s) {
  step_phase_[2] = phase_end();
  optimizer_ = std::max(optimizer_, step_phase_[2]);
  if (!s.instrumented) {
    plain_seen_ = true;
    for (int i = 0; i < 3; ++i) plain_phase_[i] = std::max(plain_phase_[i], step_phase_[i]);
  }
  AccountingAllocator::set_phase("between steps");
}

void MemoryProbe::run_end(const RunEnd& e) {
  AccountingAllocator::set_phase("evaluation");
  AccountingAllocator::set_budget(0);
  model_state_ = e.model_state;
  have_end_ = true;
  if (!cuda_) {
    peak_ = std::max(peak_, AccountingAllocator::peak());
    freed_elsewhere_ = AccountingAllocator::freed_elsewhere() - freed_elsewhere_;
  }
}

json MemoryProbe::section() const {
  json j;
  j["source"] = cuda_ ? "cuda-caching-allocator" : "cpu-accounting-allocator";
  j["peak_bytes"] = peak_;
  j["baseline_bytes"] = baseline_;  // live at run start: data, parameters, anything made before
  j["phase_peak_bytes"] = {{"forward", forward_}, {"backward", backward_}, {"optimizer", optimizer_}};
  // The training step alone: the phase peaks over the steps in which no sampling probe (per-block
  // statistics, embeddings) ran, whose own temporaries would otherwise count (null: every step was sampled).
  if (plain_seen_) {
    j["step_peak_bytes"] = std::max({plain_phase_[0], plain_phase_[1], plain_phase_[2]});
    j["step_phase_peak_bytes"] = {{"forward", plain_phase_[0]}, {"backward", plain_phase_[1]}, {"optimizer", plain_phase_[2]}};
  } else {
    j["step_peak_bytes"] = nullptr;
  }
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
  // How far the CPU counts above depend on thread timing: storage freed on another thread than the one
  // that allocated it during the training steps (0 when every collective's tensors die on the training
  // thread, as trainscope's own do).
  if (!cuda_ && have_end_) j["freed_off_thread_bytes"] = freed_elsewhere_;
  if (cuda_) {
    j["reserved_peak_bytes"] = reserved_peak_;
    j["alloc_retries"] = alloc_retries_;
    j["ooms"] = ooms_;
  }
  return j;
}

}  // namespace trainscope::probes
