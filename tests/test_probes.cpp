// Probes: the accounting allocator and memory phases, summary statistics, environment and GPU inventory.
#include <gtest/gtest.h>

#include "core/precision.hpp"
#include <torch/torch.h>

#include "core/stats.hpp"
#include "probes/device/env.hpp"
#include "probes/device/gpu.hpp"
#include "probes/step/memory.hpp"
#include "probes/step/operators.hpp"
#include "probes/step/timing.hpp"

using namespace trainscope;
using namespace trainscope::probes;

TEST(AccountingAllocator, PeakOfAKnownAllocationPattern) {
  AccountingAllocator::install();
  const int64_t base = AccountingAllocator::current();
  AccountingAllocator::reset_peak();
  {
    auto a = torch::empty({1000}, torch::kFloat);   // 4000 B
    auto b = torch::empty({2000}, torch::kFloat);   // 8000 B -> 12000 live
    EXPECT_EQ(AccountingAllocator::current() - base, 12000);
    a = torch::Tensor();                             // 8000 live
    auto c = torch::empty({500}, torch::kDouble);    // 4000 B -> 12000 live again
    auto d = torch::empty({10}, torch::kBFloat16);   // 20 B -> 12020, the peak
    EXPECT_EQ(AccountingAllocator::current() - base, 12020);
  }
  EXPECT_EQ(AccountingAllocator::peak() - base, 12020);
  EXPECT_EQ(AccountingAllocator::current(), base);
}

TEST(MemoryProbe, PhasePeaksAndActivationBytes) {
  AccountingAllocator::install();
  RunConfig cfg;
  RunInfo info;
  info.config = &cfg;
  info.device = "cpu";
  MemoryProbe probe;
  auto params = torch::empty({256}, torch::kFloat);  // 1 KiB live before the run
  probe.run_begin(info);
  StepInfo s;
  s.measured = true;
  probe.step_begin(s);
  {
    auto act = torch::empty({1024}, torch::kFloat);  // forward keeps 4 KiB of activations
    probe.forward_end(s);
    auto grad = torch::empty({2048}, torch::kFloat);  // backward peaks at 4 KiB + 8 KiB
  }
  probe.backward_end(s);
  { auto state = torch::empty({512}, torch::kFloat); }  // optimizer: 2 KiB transient
  probe.optimizer_end(s);
  probe.run_end(RunEnd{1, ModelStateBytes{1024, 0, 0, 1024, "(4+4+8)Ψ"}});
  const json j = probe.section();
  const int64_t base = j["baseline_bytes"];
  EXPECT_EQ(j["phase_peak_bytes"]["forward"].get<int64_t>() - base, 4096);
  EXPECT_EQ(j["phase_peak_bytes"]["backward"].get<int64_t>() - base, 4096 + 8192);
  EXPECT_EQ(j["phase_peak_bytes"]["optimizer"].get<int64_t>() - base, 2048);
  EXPECT_EQ(j["peak_bytes"].get<int64_t>() - base, 4096 + 8192);
  EXPECT_EQ(j["activation_bytes"].get<int64_t>(), 4096);
  EXPECT_EQ(j["model_state_difference_bytes"].get<int64_t>(), 0);
}

TEST(OperatorTimes, KindsByName) {
  EXPECT_EQ(operator_kind("aten::addmm"), "gemm");
  EXPECT_EQ(operator_kind("aten::bmm"), "gemm");
  EXPECT_EQ(operator_kind("aten::convolution_backward"), "conv");
  EXPECT_EQ(operator_kind("aten::_scaled_dot_product_flash_attention_for_cpu_backward"), "attention");
  EXPECT_EQ(operator_kind("aten::gelu_backward"), "activation");
  EXPECT_EQ(operator_kind("aten::_log_softmax_backward_data"), "softmax");
  EXPECT_EQ(operator_kind("aten::native_layer_norm"), "norm");
  EXPECT_EQ(operator_kind("aten::bernoulli_"), "random");
  EXPECT_EQ(operator_kind("aten::copy_"), "memory");      // a kernel of no other kind: memory-bound
  EXPECT_EQ(operator_kind("aten::masked_fill_"), "memory");
  EXPECT_EQ(operator_kind("aten::linear"), "dispatch");   // composite: its addmm does the work
  EXPECT_EQ(operator_kind("aten::view"), "dispatch");
}

// One warm-up step (not recorded), one profiled step (every other measured step) and one timed by
// the phases' walls: the profiled step's operators counted by kind, exactly.
TEST(OperatorTimes, SelfTimeByKindOnTheProfiledStepsOnly) {
  OperatorTimeProbe probe;
  const auto a = torch::randn({128, 128}).requires_grad_(), w = torch::randn({128, 128}).requires_grad_();
  for (int64_t step = 0; step < 3; ++step) {
    StepInfo s;
    s.step = step;
    s.measured = step > 0;
    probe.step_begin(s);
    const auto loss = torch::gelu(torch::mm(a, w)).sum();
    probe.forward_end(s);
    loss.backward();
    probe.backward_end(s);
    {
      torch::NoGradGuard no_grad;
      a.sub_(a.grad() * 1e-3);
    }
    probe.optimizer_end(s);
    probe.step_end(s);
  }
  const json j = probe.section();
  EXPECT_EQ(j["profiled_steps"], 1);
  EXPECT_EQ(j["unprofiled_steps"], 1);
  EXPECT_EQ(j["calls"]["forward"]["gemm"].get<double>(), 1.0);        // mm
  EXPECT_EQ(j["calls"]["forward"]["activation"].get<double>(), 1.0);  // gelu
  EXPECT_EQ(j["calls"]["backward"]["gemm"].get<double>(), 2.0);       // mm's two gradients
  EXPECT_EQ(j["calls"]["backward"]["activation"].get<double>(), 1.0); // gelu_backward
  EXPECT_EQ(j["calls"]["optimizer"]["gemm"].get<double>(), 0.0);
  EXPECT_GT(j["self_s"]["forward"]["gemm"].get<double>(), 0.0);
  EXPECT_GT(j["self_s"]["backward"]["gemm"].get<double>(), 0.0);
  for (const char* phase : {"forward", "backward", "optimizer"}) EXPECT_GT(j["phase_wall_s"][phase].get<double>(), 0.0) << phase;
}

TEST(Stats, PercentilesLikeNumpy) {
  std::vector<double> v;
  for (int i = 100; i >= 1; --i) v.push_back(i);  // unsorted input
  const Summary s = summarize(v);
  EXPECT_EQ(s.count, 100);
  EXPECT_DOUBLE_EQ(s.p50, 50.5);
  EXPECT_NEAR(s.p90, 90.1, 1e-9);
  EXPECT_NEAR(s.p99, 99.01, 1e-9);
  EXPECT_DOUBLE_EQ(s.mean, 50.5);
  EXPECT_NEAR(s.stdev, 29.011491975882016, 1e-9);  // sample stdev (n-1)
  EXPECT_EQ(summarize({}).count, 0);
  EXPECT_DOUBLE_EQ(summarize({3.0}).p99, 3.0);
}

TEST(Timing, GemmPeakIsPositiveAndComputeDtypeFollowsPrecision) {
  EXPECT_EQ(compute_dtype(precision_traits("bf16-mixed"), false), "bf16");
  EXPECT_EQ(compute_dtype(precision_traits("32-true"), true), "fp32");
  EXPECT_GT(measure_gemm_peak("cpu", "fp32", 1), 1e8);  // even the reference BLAS does 0.1 GFLOP/s
}

TEST(Env, InventoryNamesTheBlasAndAgreesWithTorchOnGpus) {
  const json env = collect_env();
  for (const char* k : {"host", "cpu", "memory_bytes", "os", "compiler", "torch", "blas", "cuda", "gpus"})
    EXPECT_TRUE(env.contains(k)) << k;
  // A BLAS that torch mapped, or the one its build configuration names (the wheels link MKL statically).
  EXPECT_NE(env["blas"]["name"], "unknown");
  EXPECT_NE(env["torch"]["cpu_capability"], "unknown");
  EXPECT_GT(env["memory_bytes"].get<int64_t>(), 0);
  const json gpu = gpu_inventory();
  EXPECT_EQ(gpu["device_count"].get<int64_t>() > 0, torch::cuda::is_available());
  // A CUDA LibTorch (the wheel is one) must have switched the CUDA code paths on at configure time.
  const bool torch_is_cuda_build = at::show_config().find("USE_CUDA=ON") != std::string::npos;
  EXPECT_EQ(gpu["torch_cuda_pieces"].get<bool>(), torch_is_cuda_build);
  if (!torch::cuda::is_available()) {
    EXPECT_EQ(gpu["devices"].size(), 0u);
    EXPECT_NE(gpu["status"].get<std::string>().find("no device"), std::string::npos)
        << gpu["status"].get<std::string>();
  }
}

TEST(Env, ThreadsAreSetExplicitly) {
  EXPECT_EQ(configure_threads(1), 1);
  EXPECT_EQ(configure_threads(0), static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
}
