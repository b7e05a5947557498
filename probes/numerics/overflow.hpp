#pragma once
// Overflow probe: what fp16 does (or would do) to this run.
//
// Per cell: steps with a non-finite loss or gradients, skipped steps, the loss-scale trajectory (every
// change with its step), first overflow step, min/max scale, when the scale settled, and whether it
// collapsed. Per block, sampled every k steps: activation and gradient abs-max and the fraction of
// values beyond fp16's largest finite value (65504; inf and NaN count here) and of non-zero values
// below fp16's smallest normal (6.1e-5, where precision starts to go and flushing to zero follows);
// and the same for fp8's e4m3 and e5m2 at the scale per-tensor amax scaling would give.
// Runs in every precision: in fp32 and bf16 the block statistics say what fp16 and fp8 would do.
#include <map>
#include <vector>

#include "core/hooks.hpp"

namespace trainscope::probes {

inline constexpr double kFp16Max = 65504.0;
inline constexpr double kFp16MinNormal = 6.103515625e-05;  // 2^-14

// {abs-max, fraction beyond fp16's range (inf/NaN included), fraction of non-zeros below its normal
// range} of a tensor, as a 3-element fp32 tensor on the tensor's device (no synchronisation).
at::Tensor fp16_range_stats(const at::Tensor& x);

// fp8's formats: e4m3 (activations and weights) and e5m2 (gradients), as OCP/TransformerEngine use them.
inline constexpr double kE4m3Max = 448.0, kE4m3MinNormal = 0.015625;          // 2^-6
inline constexpr double kE5m2Max = 57344.0, kE5m2MinNormal = 6.103515625e-05;  // 2^-14

// What fp8 would do to a tensor, predicted on any machine, as a 5-element fp32 tensor on its device:
//  0, 1  fraction beyond e4m3's / e5m2's largest value unscaled (inf and NaN included);
//  2, 3  fraction of non-zeros below e4m3's / e5m2's smallest normal at the current-scaling scale
//        (max / amax of this tensor: the amax maps onto the format's largest value);
//  4     fraction beyond the format's range under delayed scaling, whose scale comes from an earlier
//        amax (`earlier_amax`, a 0-dim tensor; undefined: none yet, reported as -1): values above it.
at::Tensor fp8_range_stats(const at::Tensor& x, const at::Tensor& earlier_amax);

class OverflowProbe : public Probe, public BlockObserver {
 public:
  explicit OverflowProbe(int64_t every) : every_(every) {}
  std::string name() const override { return "overflow"; }
  void step_end(const StepInfo& s) override;
  void run_end(const RunEnd&) override;
  json section() const override { return section_; }
  BlockObserver* block_observer() override { return every_ > 0 ? this : nullptr; }

  bool wants(int64_t step) const override { return every_ > 0 && step % every_ == 0; }
  void activation(int64_t step, const std::string& block, const at::Tensor& x) override;
  void gradient(int64_t step, const std::string& block, const at::Tensor& g) override;

 private:
  struct Samples {
    std::vector<at::Tensor> activations, gradients;  // stats tensors, read at run end
    std::vector<at::Tensor> activations_fp8, gradients_fp8;
  };
  int64_t every_;
  std::vector<std::string> block_order_;
  std::map<std::string, Samples> blocks_;
  std::vector<at::Tensor> loss_finite_;  // per step, on the device
  std::vector<std::pair<int64_t, double>> scale_changes_;
  double last_scale_ = 0;
  int64_t steps_ = 0, skipped_ = 0, nonfinite_grad_steps_ = 0;
  int64_t first_overflow_ = -1, last_backoff_ = -1;
  bool scaled_ = false;
  json section_;
};

}  // namespace trainscope::probes
