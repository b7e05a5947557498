#include "suites/hardware/measure.hpp"

#include <algorithm>
#include <chrono>
#include <functional>
#include <tuple>

#include <unistd.h>

#include "core/devices.hpp"
#include "core/stats.hpp"
#include "suites/models/models.hpp"
#include "suites/parallel/comm.hpp"

#ifdef TRAINSCOPE_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/Sleep.h>
#endif

namespace trainscope::suites {
namespace {

bool is_cuda(const std::string& device) { return device.rfind("cuda", 0) == 0; }

torch::ScalarType scalar_of(const std::string& dtype) {
  if (dtype == "bf16") return torch::kBFloat16;
  if (dtype == "fp16") return torch::kHalf;
  if (dtype == "fp64") return torch::kDouble;
  return torch::kFloat;  // fp32, tf32 (fp32 storage, TF32 tensor cores), and fp8's source
}

void sync(const std::string& device) {
  if (is_cuda(device)) torch::cuda::synchronize();
}

// Seconds of one call of `fn`: CUDA events on the current stream on a GPU, the host clock on CPU.
template <typename Fn>
double time_once(const std::string& device, Fn&& fn) {
#ifdef TRAINSCOPE_TORCH_CUDA
  if (is_cuda(device)) {
    at::cuda::CUDAEvent start(cudaEventDefault), end(cudaEventDefault);
    auto stream = at::cuda::getCurrentCUDAStream();
    start.record(stream);
    fn();
    end.record(stream);
    end.synchronize();
    return start.elapsed_time(end) / 1e3;
  }
#endif
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Seconds the device spends on one call of `fn`, without the host's launch latency: on a GPU the
// stream is first kept busy (a ~50 us spin kernel) so that the call is queued before its start event
// fires, as it is inside a training step where the host runs ahead of the GPU. Small kernels timed
// by time_once measure the host's dispatch instead (~5-10 us a call), which the planner counts
// separately, per operator. On CPU the same as time_once.
template <typename Fn>
double time_queued(const std::string& device, Fn&& fn) {
#ifdef TRAINSCOPE_TORCH_CUDA
  if (is_cuda(device)) at::cuda::sleep(100000);  // ~50 us at the H100's 1.98 GHz, longer at lower clocks
#endif
  return time_once(device, std::forward<Fn>(fn));
}

json shape_json(const GemmShape& s) { return {s.m, s.n, s.k}; }

}  // namespace

std::vector<std::string> peak_dtypes(const std::string& device) {
  if (is_cuda(device)) return {"fp32", "tf32", "bf16", "fp16", "fp8"};
  return {"fp32", "bf16", "fp16"};
}

std::string gemm_unsupported(const std::string& device, const std::string& dtype) {
  const auto dtypes = peak_dtypes("cuda");
  if (std::find(dtypes.begin(), dtypes.end(), dtype) == dtypes.end() && dtype != "fp64")
    return "unknown dtype '" + dtype + "' (fp32, tf32, bf16, fp16, fp8, fp64)";
  if (!is_cuda(device)) {
    if (dtype == "tf32") return "tf32 is a CUDA tensor-core mode; this is " + device;
    if (dtype == "fp8") return "fp8 GEMMs (at::_scaled_mm) need a CUDA GPU of compute capability 8.9 or newer";
    return "";
  }
#ifdef TRAINSCOPE_TORCH_CUDA
  if (!torch::cuda::is_available()) return "no CUDA device visible to LibTorch";
  const auto* p = at::cuda::getDeviceProperties(device.size() > 5 ? std::stoi(device.substr(5)) : 0);
  const int cc = p->major * 10 + p->minor;
  if (dtype == "fp8" && cc < 89) return "fp8 needs compute capability 8.9 or newer; this GPU has " + std::to_string(p->major) + "." + std::to_string(p->minor);
  if ((dtype == "tf32" || dtype == "bf16") && cc < 80) return dtype + " needs compute capability 8.0 or newer";
  return "";
#else
  return "this build's LibTorch has no CUDA";
#endif
}

std::vector<GemmShape> peak_shapes(const std::string& device, bool thorough) {
  std::vector<GemmShape> out;
  if (!is_cuda(device)) {
    // A CPU reaches its peak at modest sizes; 2 cores cannot afford a GPU-sized sweep.
    for (int64_t m : thorough ? std::vector<int64_t>{256, 512, 1024, 1536, 2048} : std::vector<int64_t>{256, 512, 1024})
      out.push_back({m, 1024, 1024});
    return out;
  }
  // Around the best published shapes (mamf-finder's H100/H200 rows: 2048x2048x13312, 1280x4096x12032,
  // 1024x9216x14336): m swept in multiples of 256 at two (n, k); thorough sweeps all three dims.
  if (!thorough) {
    for (int64_t m : {1024, 1280, 2048, 4096, 8192}) {
      out.push_back({m, 4096, 12032});
      out.push_back({m, 2048, 13312});
    }
    return out;
  }
  for (int64_t m = 1024; m <= 16384; m += 1024)
    for (int64_t n = 1024; n <= 16384; n += 3072)
      for (int64_t k = 4096; k <= 16384; k += 4096) out.push_back({m, n, k});
  return out;
}

GemmTiming time_gemm(const std::string& device, const std::string& dtype, const GemmShape& s, int warmup, int iterations) {
  torch::NoGradGuard no_grad;
  auto& ctx = at::globalContext();
  const bool tf32_before = ctx.allowTF32CuBLAS();
  ctx.setAllowTF32CuBLAS(dtype == "tf32");
  const auto opts = torch::TensorOptions().dtype(scalar_of(dtype)).device(device);
  torch::Tensor a = torch::randn({s.m, s.k}, opts), b = torch::randn({s.n, s.k}, opts).t(), c;
  std::function<void()> run;
  if (dtype == "fp8") {
    // mamf-finder's fp8: e4m3 operands, fp32 scalar scales of 1, the product in bf16.
    a = a.to(torch::kFloat8_e4m3fn);
    b = torch::randn({s.n, s.k}, opts).to(torch::kFloat8_e4m3fn).t();
    const auto one = torch::ones({}, torch::TensorOptions().dtype(torch::kFloat).device(device));
    run = [a, b, one] { at::_scaled_mm(a, b, one, one, std::nullopt, std::nullopt, torch::kBFloat16); };
  } else {
    c = torch::empty({s.m, s.n}, opts);
    run = [a, b, c]() mutable { torch::mm_out(c, a, b); };
  }
  // Between iterations a 256 MiB write evicts the operands from L2 on a GPU (mamf-finder); a CPU's
  // caches are smaller than these operands anyway.
  torch::Tensor flush = is_cuda(device) ? torch::empty({256 << 20}, torch::TensorOptions().dtype(torch::kUInt8).device(device)) : torch::Tensor();
  for (int i = 0; i < warmup; ++i) run();
  sync(device);
  std::vector<double> rates;
  const double flops = 2.0 * static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.k);
  for (int i = 0; i < iterations; ++i) {
    if (flush.defined()) flush.zero_();
    const double t = time_once(device, run);
    if (t > 0) rates.push_back(flops / t);
  }
  ctx.setAllowTF32CuBLAS(tf32_before);
  const Summary st = summarize(rates);
  GemmTiming g{s};
  g.iterations = static_cast<int>(st.count);
  g.mean = st.mean;
  g.median = st.p50;
  g.max = st.max;
  return g;
}

// SDPA's fused causal attention as training runs it (flash, memory-efficient or cuDNN, whichever
// PyTorch picks; on a CPU its flash kernel), forward and backward per shape [1, heads, S, Dh]: the
// planner's rate for attention, where the kernel never writes the S x S scores and is neither a batched
// GEMM nor a softmax (on a CPU the bf16 kernel measured 2x slower than the eager path's GEMMs and
// softmax, which the planner would otherwise assume). FLOPs: forward 4 S^2 Dh per head, halved for the
// causal mask; backward 2.5x the forward (five S x S x Dh products against two), FlashAttention's
// convention.
json fused_attention(const std::string& device, const std::string& dtype) {
  json out = json::array();
  const auto o = torch::TensorOptions().dtype(scalar_of(dtype)).device(device);
  // The shapes of the models each device trains: the GPU presets at seq 512-4096; on a CPU the CI
  // models' (llama-tiny: 8 x 4 heads of 64 x 16; llama-small: 8 x 8 heads of 256 x 32) and larger.
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes =
      is_cuda(device) ? std::vector<std::tuple<int64_t, int64_t, int64_t>>{{32, 512, 64}, {32, 1024, 64}, {32, 2048, 64}, {32, 2048, 128}, {16, 4096, 128}}
                      : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{32, 64, 16}, {64, 128, 32}, {64, 256, 32}, {32, 512, 64}};
  for (const auto& [heads, s, dh] : shapes) {
    torch::AutoGradMode grad(true);
    torch::Tensor q = torch::randn({1, heads, s, dh}, o).requires_grad_(true), k = torch::randn({1, heads, s, dh}, o).requires_grad_(true),
                  v = torch::randn({1, heads, s, dh}, o).requires_grad_(true), g = torch::randn({1, heads, s, dh}, o);
    auto forward = [&] { return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true); };
    for (int i = 0; i < 3; ++i) forward().backward(g);
    sync(device);
    std::vector<double> fwd, bwd;
    for (int i = 0; i < 10; ++i) {
      torch::Tensor y;
      fwd.push_back(time_queued(device, [&] { y = forward(); }));
      bwd.push_back(time_queued(device, [&] { y.backward(g); }));
    }
    const double flops = 4.0 * static_cast<double>(heads * s * s * dh) / 2, f = summarize(fwd).p50, b = summarize(bwd).p50;
    out.push_back({{"heads", heads}, {"seq", s}, {"head_dim", dh}, {"causal", true}, {"forward_flops", flops},
                   {"forward_s", f}, {"backward_s", b}, {"forward_flops_per_s", f > 0 ? flops / f : 0.0},
                   {"backward_flops_per_s", b > 0 ? 2.5 * flops / b : 0.0}, {"backend", sdpa_backend(q, k, v, true, false)}});
  }
  return out;
}

json gemm_peak(const std::string& device, const std::string& dtype, bool thorough) {
  json out{{"dtype", dtype}};
  if (const std::string why = gemm_unsupported(device, dtype); !why.empty()) {
    out["skipped"] = why;
    return out;
  }
  const bool cuda = is_cuda(device);
  // GPU: mamf-finder's 50 warm-up and 100 timed iterations; CPU: a GEMM takes milliseconds, not us.
  const int warmup = cuda ? 50 : 2, iterations = cuda ? 100 : 8;
  json shapes = json::array();
  GemmTiming best_mean, best_median, best_max;
  for (const auto& s : peak_shapes(device, thorough)) {
    const GemmTiming g = time_gemm(device, dtype, s, warmup, iterations);
    shapes.push_back({{"shape", shape_json(s)}, {"mean_flops_per_s", g.mean}, {"median_flops_per_s", g.median},
                      {"max_flops_per_s", g.max}, {"iterations", g.iterations}});
    if (g.mean > best_mean.mean) best_mean = g;
    if (g.median > best_median.median) best_median = g;
    if (g.max > best_max.max) best_max = g;
  }
  out["method"] = "mamf-finder: torch.mm(A, B^T view) per shape, " + std::to_string(warmup) + " warm-up + " +
                  std::to_string(iterations) + " timed iterations" + (cuda ? " with an L2 flush, CUDA events" : ", host clock");
  out["achievable_flops_per_s"] = best_mean.mean;  // the published statistic: the best shape's mean
  out["best_shape"] = shape_json(best_mean.shape);
  out["best_median_flops_per_s"] = best_median.median;
  out["best_max_flops_per_s"] = best_max.max;
  out["shapes"] = shapes;
  // The planner's efficiency curve: GEMMs of the sizes training runs (m tokens x d x d), achieved
  // FLOP/s by size, median of the timed iterations.
  json curve = json::array();
  const int64_t m = cuda ? 8192 : 2048;
  for (int64_t d : cuda ? std::vector<int64_t>{256, 512, 1024, 2048, 4096, 8192} : std::vector<int64_t>{32, 64, 128, 256, 512, 1024}) {
    const GemmShape s{m, d, d};
    const GemmTiming g = time_gemm(device, dtype, s, warmup, iterations);
    curve.push_back({{"shape", shape_json(s)}, {"median_flops_per_s", g.median}});
  }
  out["curve"] = curve;
  // Batched small GEMMs, as attention runs them (batch x S x S x Dh): achieved FLOP/s by the FLOPs
  // of one call.
  json batched = json::array();
  if (dtype != "fp8") {
    for (const auto& [b, s, dh] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{128, 64, 16}, {64, 256, 32}, {16, 1024, 64}}) {
      torch::NoGradGuard no_grad;
      const auto o = torch::TensorOptions().dtype(scalar_of(dtype)).device(device);
      torch::Tensor q = torch::randn({b, s, dh}, o), k = torch::randn({b, dh, s}, o), r = torch::empty({b, s, s}, o);
      for (int i = 0; i < warmup; ++i) torch::bmm_out(r, q, k);
      sync(device);
      std::vector<double> rates;
      const double flops = 2.0 * static_cast<double>(b * s * s * dh);
      for (int i = 0; i < iterations; ++i) {
        const double t = time_queued(device, [&] { torch::bmm_out(r, q, k); });
        if (t > 0) rates.push_back(flops / t);
      }
      batched.push_back({{"batch", b}, {"shape", {s, s, dh}}, {"median_flops_per_s", summarize(rates).p50}});
    }
  }
  out["batched_curve"] = batched;
  if (dtype == "fp32" || dtype == "bf16" || (cuda && dtype == "fp16")) out["attention"] = fused_attention(device, dtype);
  const std::string name = device_name(device);
  out["device_name"] = name;
  if (const auto peak = datasheet_peak_flops(name, dtype)) {
    out["datasheet_flops_per_s"] = *peak;
    out["fraction_of_datasheet"] = best_mean.mean / *peak;
  } else {
    out["datasheet_flops_per_s"] = nullptr;
    out["fraction_of_datasheet"] = nullptr;
  }
  return out;
}

json memory_bandwidth(const std::string& device) {
  torch::NoGradGuard no_grad;
  const bool cuda = is_cuda(device);
  const int64_t bytes = cuda ? (int64_t{2} << 30) : (int64_t{256} << 20);
  const auto opts = torch::TensorOptions().dtype(torch::kUInt8).device(device);
  torch::Tensor src = torch::ones({bytes}, opts), dst = torch::empty({bytes}, opts);
  dst.copy_(src);  // warm-up: pages touched, kernels loaded
  sync(device);
  std::vector<double> rates;
  for (int i = 0; i < (cuda ? 20 : 5); ++i) {
    const double t = time_once(device, [&] { dst.copy_(src); });
    if (t > 0) rates.push_back(2.0 * static_cast<double>(bytes) / t);  // read + write
  }
  const Summary st = summarize(rates);
  const double best = st.max;
  // The planner's bandwidth curve (copies of cache- to memory-sized buffers) and the cost of one
  // operator: a forward op on a one-element tensor that wants a gradient (dispatch, output, autograd
  // node), and one backward node (medians).
  json curve = json::array();
  for (int64_t b : cuda ? std::vector<int64_t>{1 << 20, 16 << 20, 256 << 20} : std::vector<int64_t>{256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20}) {
    torch::Tensor s2 = torch::ones({b}, opts), d2 = torch::empty({b}, opts);
    d2.copy_(s2);
    sync(device);
    std::vector<double> r2;
    for (int i = 0; i < 7; ++i) {
      const double t = time_queued(device, [&] { d2.copy_(s2); });
      if (t > 0) r2.push_back(2.0 * static_cast<double>(b) / t);
    }
    curve.push_back({{"bytes", b}, {"median_gbps", summarize(r2).p50 / 1e9}});
  }
  double op_s = 0, node_s = 0;
  {
    torch::AutoGradMode grad(true);
    const int n = 400;
    torch::Tensor x = torch::ones({1}, torch::TensorOptions().device(device).requires_grad(true));
    std::vector<double> fwd, bwd;
    for (int rep = 0; rep < 5; ++rep) {
      torch::Tensor y;
      const double tf = time_once(device, [&] {
        y = x;
        for (int i = 0; i < n; ++i) y = y * 1.0001;
      });
      const double tb = time_once(device, [&] { y.backward(); });
      fwd.push_back(tf / n);
      bwd.push_back(tb / n);
      x.mutable_grad() = torch::Tensor();
    }
    op_s = summarize(fwd).p50;
    node_s = summarize(bwd).p50;
  }
  // Compute-bound elementwise kernels, elements per second forward and backward, per dtype and size
  // (64K to 4M elements: the activations of small and large cells): the activations (GELU), softmax,
  // LayerNorm and the random draw of dropout.
  json elementwise = json::object();
  for (const auto& dt : std::vector<std::string>{"fp32", "bf16"}) {
    json sizes = json::array();
    for (const int64_t rows : cuda ? std::vector<int64_t>{256, 4096, 65536} : std::vector<int64_t>{64, 256, 1024, 4096}) {
      const auto o = torch::TensorOptions().dtype(scalar_of(dt)).device(device);
      const int64_t cols = 1024, n = rows * cols;
      // As in a training step, operands come from memory, not from the cache: each call takes the
      // next of a set of buffers larger than the caches together (>= 64 MiB).
      const int64_t bytes = n * (dt == "fp32" ? 4 : 2);
      const int64_t copies = std::max<int64_t>(2, (int64_t{64} << 20) / bytes);
      std::vector<torch::Tensor> xs, gs;
      for (int64_t i = 0; i < copies; ++i) {
        xs.push_back(torch::randn({rows, cols}, o));
        gs.push_back(torch::randn({rows, cols}, o));
      }
      torch::Tensor x, g, w = torch::ones({cols}, o), b = torch::zeros({cols}, o);
      size_t next = 0;
      auto rate = [&](const std::function<void()>& fn) {
        std::vector<double> r;
        for (int i = 0; i < 8; ++i) {
          x = xs[next % xs.size()];
          g = gs[next % gs.size()];
          ++next;
          if (i == 0) {
            fn();
            continue;
          }
          const double t = time_queued(device, fn);
          if (t > 0) r.push_back(static_cast<double>(n) / t);
        }
        return summarize(r).p50;
      };
      torch::NoGradGuard no_grad;
      x = xs[0];
      const torch::Tensor sm = torch::softmax(x, -1);
      const auto ln = at::native_layer_norm(x, {cols}, w, b, 1e-5);
      sizes.push_back(
          {{"elements", n},
           {"activation", {{"forward", rate([&] { at::gelu(x); })}, {"backward", rate([&] { at::gelu_backward(g, x); })}}},
           {"softmax", {{"forward", rate([&] { torch::softmax(x, -1); })},
                        {"backward", rate([&] { at::_softmax_backward_data(g, sm, -1, sm.scalar_type()); })}}},
           {"norm", {{"forward", rate([&] { at::native_layer_norm(x, {cols}, w, b, 1e-5); })},
                     {"backward", rate([&] {
                        at::native_layer_norm_backward(g, x, {cols}, std::get<1>(ln), std::get<2>(ln), w, b, {true, true, true});
                      })}}},
           {"random", {{"forward", rate([&] { torch::empty_like(x).bernoulli_(0.9); })}, {"backward", nullptr}}}});
    }
    elementwise[dt] = sizes;
  }
  json out{{"curve", curve}, {"op_overhead_s", op_s}, {"backward_node_s", node_s}, {"elementwise_elements_per_s", elementwise},
           {"method", "copy_ of a " + std::to_string(bytes >> 20) + " MiB buffer, bytes read + written per second, best of " +
                          std::to_string(rates.size())},
           {"bytes", bytes},
           {"bandwidth_gbps", best / 1e9},
           {"median_gbps", st.p50 / 1e9}};
  const std::string name = device_name(device);
  out["device_name"] = name;
  if (const DeviceFacts* d = find_device(name)) {
    out["datasheet_gbps"] = d->hbm_bytes_per_s / 1e9;
    out["fraction_of_datasheet"] = best / d->hbm_bytes_per_s;
  } else {
    out["datasheet_gbps"] = nullptr;
    out["fraction_of_datasheet"] = nullptr;
  }
  return out;
}

json copy_bandwidth(const std::string& device) {
  if (!is_cuda(device)) return json{{"skipped", "host-device copies need a GPU; this cell runs on " + device}};
  torch::NoGradGuard no_grad;
  const int64_t bytes = int64_t{1} << 30;
  torch::Tensor host = torch::ones({bytes}, torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(true));
  torch::Tensor dev = torch::empty({bytes}, torch::TensorOptions().dtype(torch::kUInt8).device(device));
  auto rate = [&](bool to_device) {
    std::vector<double> r;
    for (int i = 0; i < 6; ++i) {
      const double t = time_once(device, [&] { to_device ? dev.copy_(host, true) : host.copy_(dev, true); });
      if (i > 0 && t > 0) r.push_back(static_cast<double>(bytes) / t / 1e9);
    }
    return summarize(r).max;
  };
  return json{{"method", "1 GiB through pinned host memory, best of 5 after one warm-up"},
              {"bytes", bytes},
              {"host_to_device_gbps", rate(true)},
              {"device_to_host_gbps", rate(false)}};
}

namespace {

// nccl-tests' bus-bandwidth factor for an op over n ranks.
double busbw_factor(const std::string& op, double n) { return op == "all-reduce" ? 2 * (n - 1) / n : (n - 1) / n; }

// The two levels of a cluster, each measured on its own groups: within a node (every node's ranks
// together) and across nodes (the ranks with the same local index, one per node), all groups of a
// level at once, as a hierarchical collective runs them. Rank 0's groups' rows (time per call on the
// host clock, algbw, busbw by nccl-tests' factors); null when the ranks do not span 2 hosts or more
// with as many ranks on each.
json collective_levels(Communicator& comm, const std::string& device, int warmup, int iterations) {
  const int me = comm.rank();
  const std::vector<std::vector<int>> nodes = comm.ranks_by_host();
  std::vector<std::string> names;
  for (const auto& n : nodes) names.push_back(comm.store_get("hosts/" + std::to_string(n.front())));
  const size_t per = nodes[0].size();
  if (nodes.size() < 2 || std::any_of(nodes.begin(), nodes.end(), [per](const auto& n) { return n.size() != per; })) return nullptr;
  size_t my_node = 0, my_index = 0;
  for (size_t n = 0; n < nodes.size(); ++n)
    for (size_t i = 0; i < per; ++i)
      if (nodes[n][i] == me) my_node = n, my_index = i;
  json rows = json::array();
  const int64_t largest = is_cuda(device) ? (int64_t{1} << 30) : (int64_t{16} << 20);
  for (const std::string level : {"intra-node", "inter-node"}) {
    std::vector<int> group;
    if (level == "intra-node") {
      group = nodes[my_node];
    } else {
      for (const auto& n : nodes) group.push_back(n[my_index]);
    }
    if (group.size() < 2) continue;
    const std::string tag = level + std::to_string(level == "intra-node" ? my_node : my_index);
    std::unique_ptr<Communicator> sub = comm.split(group, tag);
    const double n = static_cast<double>(group.size());
    for (int64_t bytes = 1024; bytes <= largest; bytes *= 4) {
      const int64_t count = bytes / 4 / static_cast<int64_t>(group.size()) * static_cast<int64_t>(group.size());
      const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(device);
      torch::Tensor full = torch::ones({count}, opts), shard = torch::ones({count / static_cast<int64_t>(group.size())}, opts);
      for (const std::string op : {"all-reduce", "all-gather", "reduce-scatter"}) {
        double total = 0;
        for (int it = 0; it < warmup + iterations; ++it) {
          const auto t0 = std::chrono::steady_clock::now();
          if (op == "all-reduce") sub->all_reduce(full, false, false);
          else if (op == "all-gather") sub->all_gather(full, shard);
          else sub->reduce_scatter(shard, full, false);
          sync(device);
          if (it >= warmup) total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        }
        const double t = total / iterations, algbw = static_cast<double>(count * 4) / t / 1e9;
        rows.push_back({{"level", level}, {"group_size", group.size()}, {"op", op}, {"bytes", count * 4}, {"time_s", t},
                        {"algbw_gbps", algbw}, {"busbw_gbps", algbw * busbw_factor(op, n)}});
      }
    }
    comm.barrier();  // one level at a time
  }
  return {{"nodes", nodes.size()}, {"ranks_per_node", per}, {"hosts", names}, {"rows", rows}};
}

}  // namespace

json collectives_sweep(Communicator& comm, const std::string& device, int warmup, int iterations) {
  torch::NoGradGuard no_grad;
  const int64_t world = comm.world_size();
  const int64_t largest = is_cuda(device) ? (int64_t{1} << 30) : (int64_t{64} << 20);
  for (int64_t bytes = 1024; bytes <= largest; bytes *= 4) {
    const int64_t n = bytes / 4 / world * world;  // divisible into equal shards
    const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(device);
    torch::Tensor full = torch::ones({n}, opts), shard = torch::ones({n / world}, opts);
    for (int it = 0; it < warmup + iterations; ++it) {
      comm.set_step(it);
      comm.all_reduce(full, /*average=*/false);
      comm.all_gather(full, shard);
      comm.reduce_scatter(shard, full, /*average=*/false);
    }
  }
  comm.set_step(-1);
  return collective_levels(comm, device, warmup, iterations);
}

}  // namespace trainscope::suites
