#pragma once
// The precision modes as one table: what each mode stores, computes in, reduces in, and divides MFU
// by. This is the only place a precision name becomes a dtype: the training loop
// (suites/techniques/precision.cpp), the parallel strategies, the probes, the planner and the
// recommendations all read it. Torch-free: dtypes are named ("fp64", "fp32", "tf32", "bf16", "fp16",
// "fp8"); suites/techniques/precision.cpp turns a name into an at::ScalarType.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/config.hpp"

namespace trainscope {

struct PrecisionTraits {
  std::string name;
  std::string summary;  // one line: `trainscope list`, docs/precision.md
  // ---- storage (per parameter) ----
  std::string params;           // the parameters the forward pass computes with
  std::string master;           // the optimizer's own copy ("": it steps `params` themselves)
  std::string grads;            // what backward produces
  std::string reduce;           // gradients are reduced and accumulated in this (bf16-master: reduce_dtype)
  std::string optimizer_state;  // Adam's moments, SGD's momentum
  // ---- compute, where the mode runs for real (a GPU; see compute_dtype() for a CPU) ----
  std::string gemm;       // the linear layers' GEMMs
  std::string attention;  // the attention kernels
  std::string norms;      // the arithmetic inside norms, softmax and the loss (ATen upcasts bf16 inside)
  std::string autocast;   // autocast's dtype over `params` ("": no autocast)
  bool loss_scaler = false;  // dynamic loss scaling (GradScaler semantics)
  bool fp16 = false;         // the 16-mixed family: emulated on a CPU unless `fp16 = autocast`
  bool fp8_linear = false;   // linear layers in e4m3 (at::_scaled_mm), the rest in `autocast`
  // ---- where it runs ----
  bool cuda_only = false;
  int min_compute_capability = 0;  // 80: bf16 and tf32 tensor cores; 89: fp8
  // ---- what the planner and the recommendations say of it ----
  std::string caveat;  // why it is ranked but not recommended unless asked for ("": recommendable)
  int preference = 9;  // among configurations of equal speed, the one teams run: lower first
};

// Every mode, in the order `trainscope list` prints them.
const std::vector<PrecisionTraits>& precision_table();
std::vector<std::string> precision_names();
// UsageError naming the modes when `name` is none of them.
const PrecisionTraits& precision_traits(const std::string& name);

// Bytes per element of a named dtype (fp64 8, fp32 and tf32 4, bf16 and fp16 2, fp8 1).
int dtype_bytes(const std::string& dtype);

// The dtype a mode's GEMMs run in on a device: 16-mixed on a CPU is emulated in fp32 unless the `fp16`
// key says autocast.
std::string compute_dtype(const PrecisionTraits& t, bool cuda, const std::string& fp16 = "auto");
bool fp16_emulated(const PrecisionTraits& t, bool cuda, const std::string& fp16 = "auto");

// The peak MFU divides by (FLOP/s), the one convention of every report, plan and recommendation:
// the peak of the dtype the GEMMs run in; for fp8, the time the step's FLOPs would take at peak, the
// linear layers' share (`linear_fraction` of the model FLOPs) at the fp8 peak and the rest (attention)
// at the bf16 peak. `peak_of(dtype)` gives a device's peak; nullopt when one it needs is unknown.
using PeakOf = std::function<std::optional<double>(const std::string& dtype)>;
std::optional<double> mfu_peak_flops(const PrecisionTraits& t, const std::string& gemm_dtype, double linear_fraction,
                                     const PeakOf& peak_of);
// The convention in words, for reports ("bf16 dense peak", "fp8 peak for the linear layers' 93%, bf16 ...").
std::string mfu_peak_name(const PrecisionTraits& t, const std::string& gemm_dtype, double linear_fraction);

// A timing section's MFU fields derived from its raw ones with this version's definitions (the timing
// probe writes them so; `trainscope report DIR --rederive` rewrites a stored report's):
//   raw      samples_per_s (global), flops_per_sample, causal.flops_per_sample, recompute_flops_per_sample,
//            attention_flops_per_sample, gemm_peaks_flops_per_s {dtype: measured FLOP/s}, peak_source
//   derived  compute_dtype, flops_per_s, peak_flops_per_s, mfu, causal.flops_per_s and .mfu, hfu, mfu_peak,
//            datasheet_peak_flops_per_s, mfu_datasheet
// `gemm_dtype`: compute_dtype() of the cell; `device_name`: the driver's (datasheet lookup); `world`: ranks.
void derive_mfu(json& timing, const PrecisionTraits& t, const std::string& gemm_dtype, const std::string& device_name,
                int64_t world);

// Model-state bytes one rank holds at rest (after a step), per parameter, for a data-parallel sharding
// level over N ranks: the ZeRO paper's accounting (Ψ parameters; P bytes per parameter and per
// gradient, K of optimizer state), and with a master copy as FSDP2, DeepSpeed and Megatron keep it:
//   level   no master (P, K)        bf16 compute copy from fp32 masters (reduce fp32)
//   single  (2P+K)Ψ                 16Ψ   (fp32 master, fp32 grad, Adam; the bf16 copy lives per step)
//   ddp     (2P+K)Ψ                 16Ψ   (FSDP2's replicate: the bf16 copy is cast per unit and freed)
//   zero1   2PΨ + KΨ/N              6Ψ + 12Ψ/N   (Megatron's distributed optimizer: the slice's
//                                                gradient is its part of the full fp32 buffer; reduced
//                                                in bf16, 4Ψ + 16Ψ/N: a bf16 buffer, an fp32 gradient)
//   zero2   PΨ + (P+K)Ψ/N           2Ψ + 16Ψ/N
//   zero3   (2P+K)Ψ/N               16Ψ/N  (FSDP2's MixedPrecisionPolicy: fp32 shards)
// (with SGD's one momentum word instead of Adam's two, 12 and 8 become 8 and 4.)
struct ExpectedModelState {
  int64_t bytes = 0;
  std::string formula;
};
// `reduce`: the reduce_dtype of a mode with masters ("" : the table's).
ExpectedModelState expected_model_state(const PrecisionTraits& t, const std::string& level, int64_t psi, int64_t N,
                                        int optimizer_words, const std::string& reduce = "");

}  // namespace trainscope
