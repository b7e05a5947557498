#include "core/precision.hpp"

#include <algorithm>
#include <cmath>

#include "core/devices.hpp"
#include "core/errors.hpp"

namespace trainscope {

const std::vector<PrecisionTraits>& precision_table() {
  //  name, summary,
  //  params, master, grads, reduce, optimizer state,
  //  gemm, attention, norms, autocast, scaler, fp16, fp8, cuda only, min cc, caveat, preference
  static const std::vector<PrecisionTraits> t = {
      {"32-true", "fp32 everywhere, TF32 off",
       "fp32", "", "fp32", "fp32", "fp32",
       "fp32", "fp32", "fp32", "", false, false, false, false, 0, "", 3},
      {"tf32", "fp32 storage, TF32 tensor-core GEMMs and convolutions (CUDA, Ampere or newer)",
       "fp32", "", "fp32", "fp32", "fp32",
       "tf32", "tf32", "fp32", "", false, false, false, true, 80, "", 2},
      {"bf16-mixed", "fp32 weights, bf16 autocast (its cast of every weight is cached until backward)",
       "fp32", "", "fp32", "fp32", "fp32",
       "bf16", "bf16", "fp32", "bf16", false, false, false, false, 80, "", 1},
      {"bf16-master",
       "bf16 weights cast from fp32 masters, bf16 forward and backward without autocast, gradients reduced in "
       "reduce_dtype, the optimizer on the masters (FSDP2's MixedPrecisionPolicy, DeepSpeed's and Megatron's bf16)",
       "bf16", "fp32", "bf16", "fp32", "fp32",
       "bf16", "bf16", "fp32", "", false, false, false, false, 80, "", 0},
      {"16-mixed", "fp32 weights, fp16 autocast, dynamic loss scaling (emulated on a CPU)",
       "fp32", "", "fp32", "fp32", "fp32",
       "fp16", "fp16", "fp32", "fp16", true, true, false, false, 70,
       "fp16 needs the dynamic loss scaler; bf16 needs none at the same speed", 5},
      {"16-mixed-noscale", "16-mixed without the loss scaler: the classic mistake, kept to show what it does",
       "fp32", "", "fp32", "fp32", "fp32",
       "fp16", "fp16", "fp32", "fp16", false, true, false, false, 70,
       "fp16 without a loss scaler loses small gradients and overflows large ones", 8},
      {"bf16-true", "parameters, activations, gradients and optimizer state in bf16",
       "bf16", "", "bf16", "bf16", "bf16",
       "bf16", "bf16", "bf16", "", false, false, false, false, 80,
       "bf16 weights and optimizer state, no fp32 master copy: updates below bf16's resolution are lost", 6},
      {"64-true", "fp64 everywhere: a reference for the others' rounding, not a training mode",
       "fp64", "", "fp64", "fp64", "fp64",
       "fp64", "fp64", "fp64", "", false, false, false, false, 0, "fp64: a numerical reference, not a training mode", 9},
      {"fp8", "e4m3 GEMMs in the linear layers (at::_scaled_mm, sm89+), bf16 autocast for the rest",
       "fp32", "", "fp32", "fp32", "fp32",
       "fp8", "bf16", "fp32", "bf16", false, false, true, true, 89,
       "e4m3 GEMMs in the linear layers: check the loss against bf16 before relying on it", 4},
  };
  return t;
}

std::vector<std::string> precision_names() {
  std::vector<std::string> out;
  for (const auto& p : precision_table()) out.push_back(p.name);
  return out;
}

const PrecisionTraits& precision_traits(const std::string& name) {
  for (const auto& p : precision_table())
    if (p.name == name) return p;
  std::string known;
  for (const auto& n : precision_names()) known += (known.empty() ? "" : ", ") + n;
  throw UsageError("unknown precision '" + name + "' (allowed: " + known + ")");
}

int dtype_bytes(const std::string& dtype) {
  if (dtype == "fp64") return 8;
  if (dtype == "fp32" || dtype == "tf32") return 4;
  if (dtype == "bf16" || dtype == "fp16") return 2;
  if (dtype == "fp8") return 1;
  throw UsageError("unknown dtype '" + dtype + "' (fp64, fp32, tf32, bf16, fp16, fp8)");
}

bool fp16_emulated(const PrecisionTraits& t, bool cuda, const std::string& fp16) {
  // CPU fp16 GEMMs without AVX512-FP16 run ~100x slower than fp32: a CPU computes in fp32 and rounds
  // through fp16 where fp16 autocast would hold fp16 values, unless asked for the real kernels.
  return t.fp16 && !cuda && fp16 != "autocast";
}

std::string compute_dtype(const PrecisionTraits& t, bool cuda, const std::string& fp16) {
  return fp16_emulated(t, cuda, fp16) ? "fp32" : t.gemm;
}

std::optional<double> mfu_peak_flops(const PrecisionTraits& t, const std::string& gemm_dtype, double linear_fraction,
                                     const PeakOf& peak_of) {
  if (gemm_dtype != "fp8" || !t.fp8_linear) return peak_of(gemm_dtype);
  const auto fp8 = peak_of("fp8"), rest = peak_of(t.attention);
  if (!fp8 || !rest || *fp8 <= 0 || *rest <= 0) return std::nullopt;
  const double f = std::clamp(linear_fraction, 0.0, 1.0);
  return 1.0 / (f / *fp8 + (1.0 - f) / *rest);  // FLOPs over the seconds they take at peak
}

std::string mfu_peak_name(const PrecisionTraits& t, const std::string& gemm_dtype, double linear_fraction) {
  if (gemm_dtype != "fp8" || !t.fp8_linear) return gemm_dtype + " peak";
  const int pct = static_cast<int>(std::lround(100 * std::clamp(linear_fraction, 0.0, 1.0)));
  return "fp8 peak for the linear layers' " + std::to_string(pct) + "% of the FLOPs, " + t.attention + " peak for the rest";
}

void derive_mfu(json& timing, const PrecisionTraits& t, const std::string& gemm_dtype, const std::string& device_name,
                int64_t world) {
  auto num = [](const json& v) { return v.is_number() ? v.get<double>() : 0.0; };
  const double samples_per_s = num(timing.value("samples_per_s", json()));
  const double flops = samples_per_s * num(timing.value("flops_per_sample", json()));
  const double attention = num(timing.value("attention_flops_per_sample", json()));
  const double per_sample = num(timing.value("flops_per_sample", json()));
  const double linear_fraction = per_sample > 0 ? 1.0 - attention / per_sample : 1.0;
  const json measured = timing.value("gemm_peaks_flops_per_s", json::object());
  const PeakOf measured_peak = [&](const std::string& d) -> std::optional<double> {
    if (measured.contains(d) && measured[d].is_number() && measured[d].get<double>() > 0) return measured[d].get<double>();
    return std::nullopt;
  };
  const PeakOf sheet_peak = [&](const std::string& d) { return datasheet_peak_flops(device_name, d); };
  const auto peak = mfu_peak_flops(t, gemm_dtype, linear_fraction, measured_peak);
  const auto sheet = mfu_peak_flops(t, gemm_dtype, linear_fraction, sheet_peak);
  const double w = static_cast<double>(std::max<int64_t>(world, 1));
  auto ratio = [&](double f, const std::optional<double>& p) { return p && *p > 0 && f > 0 ? json(f / (*p * w)) : json(nullptr); };
  timing["compute_dtype"] = gemm_dtype;
  timing["mfu_peak"] = mfu_peak_name(t, gemm_dtype, linear_fraction);
  timing["flops_per_s"] = flops;
  timing["peak_flops_per_s"] = peak ? json(*peak) : json(nullptr);
  timing["mfu"] = ratio(flops, peak);
  if (timing.contains("causal") && timing["causal"].is_object()) {
    const double causal = samples_per_s * num(timing["causal"].value("flops_per_sample", json()));
    timing["causal"]["flops_per_s"] = causal;
    timing["causal"]["mfu"] = ratio(causal, peak);
  }
  // HFU counts what the hardware did, recomputation included.
  timing["hfu"] = ratio(samples_per_s * (per_sample + num(timing.value("recompute_flops_per_sample", json()))), peak);
  timing["datasheet_peak_flops_per_s"] = sheet ? json(*sheet) : json(nullptr);
  timing["mfu_datasheet"] = ratio(flops, sheet);
}

ExpectedModelState expected_model_state(const PrecisionTraits& t, const std::string& level, int64_t psi, int64_t N,
                                        int optimizer_words, const std::string& reduce) {
  const double n = static_cast<double>(std::max<int64_t>(N, 1)), x = static_cast<double>(psi);
  const int K = optimizer_words * dtype_bytes(t.optimizer_state);
  auto s = [](int v) { return std::to_string(v); };
  ExpectedModelState e;
  double bytes = 0;
  if (t.master.empty()) {
    const int P = dtype_bytes(t.params);
    if (level == "zero1") {
      bytes = 2.0 * P * x + K * x / n;
      e.formula = "(" + s(P) + "+" + s(P) + ")Ψ + " + s(K) + "Ψ/N";
    } else if (level == "zero2") {
      bytes = P * x + (P + K) * x / n;
      e.formula = s(P) + "Ψ + (" + s(P) + "+" + s(K) + ")Ψ/N";
    } else if (level == "zero3") {
      bytes = (2.0 * P + K) * x / n;
      e.formula = "(" + s(P) + "+" + s(P) + "+" + s(K) + ")Ψ/N";
    } else {
      bytes = (2.0 * P + K) * x;
      e.formula = "(" + s(P) + "+" + s(P) + "+" + s(K) + ")Ψ";
    }
  } else {
    // The master and its gradient in the master's dtype (the reduced gradient is stored in it), the
    // compute copy in `params` where the level keeps it between steps (zero1, zero2).
    const int C = dtype_bytes(t.params), M = dtype_bytes(t.master), G = M;
    if (level == "zero1") {
      // The full gradient buffer in reduce_dtype; the slice's own fp32 gradient only where they differ.
      const int A = dtype_bytes(reduce.empty() ? t.reduce : reduce), S = A == M ? 0 : M;
      bytes = (C + A) * x + (M + S + K) * x / n;
      e.formula = "(" + s(C) + "+" + s(A) + ")Ψ + (" + s(M) + (S ? "+" + s(S) : "") + "+" + s(K) + ")Ψ/N";
    } else if (level == "zero2") {
      bytes = C * x + (G + M + K) * x / n;
      e.formula = s(C) + "Ψ + (" + s(M) + "+" + s(G) + "+" + s(K) + ")Ψ/N";
    } else if (level == "zero3") {
      bytes = (M + G + K) * x / n;
      e.formula = "(" + s(M) + "+" + s(G) + "+" + s(K) + ")Ψ/N";
    } else {
      bytes = static_cast<double>(M + G + K) * x;
      e.formula = "(" + s(M) + "+" + s(G) + "+" + s(K) + ")Ψ";
    }
  }
  e.bytes = static_cast<int64_t>(std::llround(bytes));
  return e;
}

}  // namespace trainscope
