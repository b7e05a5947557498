#include "plan/device.hpp"

#include <algorithm>
#include <cmath>

#include "core/devices.hpp"
#include "core/errors.hpp"
#include "plan/calibrate.hpp"

namespace trainscope::plan {

double Curve::at(double x) const {
  if (points.empty()) return 0;
  if (x <= points.front().first) return points.front().second;
  if (x >= points.back().first) return points.back().second;
  for (size_t i = 1; i < points.size(); ++i) {
    if (x > points[i].first) continue;
    const auto [x0, y0] = points[i - 1];
    const auto [x1, y1] = points[i];
    const double f = (std::log(x) - std::log(x0)) / (std::log(x1) - std::log(x0));
    return std::exp(std::log(y0) + f * (std::log(y1) - std::log(y0)));
  }
  return points.back().second;
}

const ConvScratch::Shape* ConvScratch::nearest(int64_t in_channels, int64_t out_channels, int64_t kernel, int64_t stride) const {
  bool same_path = false;
  for (const Shape& s : shapes) same_path = same_path || (s.kernel == kernel && s.stride == stride);
  const Shape* best = nullptr;
  double distance = 1e300;
  for (const Shape& s : shapes) {
    if (s.in_channels <= 0 || s.out_channels <= 0) continue;
    if (same_path && (s.kernel != kernel || s.stride != stride)) continue;
    const double di = std::log(s.in_channels / static_cast<double>(std::max<int64_t>(1, in_channels)));
    const double dout = std::log(s.out_channels / static_cast<double>(std::max<int64_t>(1, out_channels)));
    if (di * di + dout * dout < distance) distance = di * di + dout * dout, best = &s;
  }
  return best;
}

double DeviceProfile::gemm_seconds(const std::string& dtype, double m, double n, double k, double batch) const {
  const double flops = 2.0 * m * n * k;
  double rate = gemm_rate.at(dtype);
  if (auto b = batched_curve.find(dtype); batch > 1 && b != batched_curve.end() && !b->second.empty()) {
    rate = b->second.at(flops * batch);
  } else if (auto c = gemm_curve.find(dtype); c != gemm_curve.end() && !c->second.empty()) {
    rate = c->second.at(flops);
  }
  // Roofline: a GEMM also reads its operands and writes its product at least once.
  const double elem = dtype == "fp32" || dtype == "tf32" ? 4 : dtype == "fp8" ? 1 : 2;
  const double bytes = (m * k + k * n + m * n) * elem;
  return batch * std::max(flops / rate, memory_seconds(bytes));
}

double DeviceProfile::memory_seconds(double bytes) const { return bytes > 0 ? bytes / bandwidth.at(bytes) : 0; }

double DeviceProfile::elementwise_seconds(const std::string& kind, double elements, int elem, bool backward, bool on_chip) const {
  if (auto d = elementwise.find(elem == 4 ? "fp32" : "bf16"); d != elementwise.end()) {
    if (auto k = d->second.find(kind); k != d->second.end()) {
      const Curve& c = backward ? k->second.second : k->second.first;
      if (!c.empty()) return elements / c.at(elements);
    }
  }
  if (on_chip) return 0;
  // Roofline: read the input (and the gradient), write the output.
  return memory_seconds(elements * elem * (backward ? 3 : 2));
}

std::pair<double, double> DeviceProfile::attention_seconds(const std::string& dtype, double heads, double seq, double head_dim) const {
  const auto a = attention.find(dtype);
  if (a == attention.end() || a->second.first.empty() || a->second.second.empty()) return {0, 0};
  const double flops = 4.0 * heads * seq * seq * head_dim / 2;  // causal: half the S x S products
  return {flops / a->second.first.at(flops), 2.5 * flops / a->second.second.at(flops)};
}

double DeviceProfile::collective_seconds(const std::string& op, double bytes, int64_t ranks, bool inter) const {
  if (ranks < 2 || bytes <= 0) return 0;
  const double n = static_cast<double>(ranks);
  const double factor = op == "all-reduce" ? 2 * (n - 1) / n : (n - 1) / n;
  double bw;
  if (inter) {
    bw = inter_busbw;
  } else {
    const std::map<std::string, Curve>* curves = &busbw;
    double nearest = 1e300;
    for (const auto& [world, c] : busbw_by_world) {
      const double distance = std::fabs(std::log(static_cast<double>(world) / n));
      if (distance < nearest) nearest = distance, curves = &c;
    }
    auto c = curves->find(op);
    if (c == curves->end()) c = curves->find("all-reduce");
    bw = c != curves->end() ? c->second.at(bytes) : 0;
  }
  if (bw <= 0) return 0;
  return (inter ? inter_latency_s : latency_s) + bytes * factor / bw;
}

json DeviceProfile::to_json() const {
  json gemm = json::object();
  for (const auto& [d, r] : gemm_rate) gemm[d] = {{"rate_flops_per_s", r}, {"peak_flops_per_s", peak_flops.count(d) ? json(peak_flops.at(d)) : json()}};
  json calibration = json::object();
  for (const auto& [dtype, c] : in_step) {
    json kinds = json::object();
    for (const auto& [kind, f] : c.factor) kinds[kind] = {{"forward", f.first}, {"backward", f.second}};
    calibration[dtype] = {{"kinds", kinds},
                          {"kernels", {{"forward", c.kernels_forward}, {"backward", c.kernels_backward}}},
                          {"operator_s", c.op_s},
                          {"backward_node_s", c.node_s},
                          {"optimizer", c.optimizer},
                          {"cells", c.cells}};
  }
  return {{"name", name},
          {"source", source},
          {"in_step", in_step.empty() ? json() : calibration},
          {"gpu", gpu},
          {"memory_bytes", memory_bytes},
          {"gemm", gemm},
          {"bandwidth_bytes_per_s", bandwidth.empty() ? json() : json(bandwidth.points.back().second)},
          {"op_overhead_s", op_overhead_s},
          {"collective_latency_s", latency_s},
          {"inter_node_busbw_bytes_per_s", inter_busbw},
          {"sources", sources}};
}

namespace {

Curve flat(double v) { return Curve{{{1.0, v}}}; }

}  // namespace

std::vector<std::string> datasheet_devices() { return device_keys(); }

DeviceProfile datasheet_profile(const std::string& name) {
  const DeviceFacts* f = find_device(name);
  if (!f) {
    std::string known;
    for (const auto& n : datasheet_devices()) known += (known.empty() ? "" : ", ") + n;
    throw UsageError("plan: unknown device '" + name + "' (datasheet: " + known +
                     "; --device-file FILE for another, or --hardware DIR with a measured report)");
  }
  DeviceProfile d;
  d.name = f->key;
  d.source = "datasheet";
  d.gpu = true;
  d.memory_bytes = static_cast<int64_t>(f->memory_bytes);
  // Achievable fractions of the dense peak: PyTorch's runtime estimator presets (0.75 for 16-bit,
  // 0.5 for fp32 on H100); fp8 as 16-bit. Memory-bound kernels at 80% of HBM bandwidth.
  for (const auto& [dt, peak] : f->peak_flops) {
    const double eff = dt == "fp32" || dt == "tf32" || dt == "fp64" ? 0.5 : 0.75;
    d.peak_flops[dt] = peak;
    d.gemm_rate[dt] = peak * eff;
  }
  d.bandwidth = flat(f->hbm_bytes_per_s * 0.8);
  // Within a node: the GPU link at 80% (nccl-tests' bus bandwidth on NVLink systems), 10 us per
  // collective; across nodes: the NIC at 80%, 20 us.
  for (const char* op : {"all-reduce", "all-gather", "reduce-scatter"}) d.busbw[op] = flat(f->link_bytes_per_s * 0.8);
  d.latency_s = 10e-6;
  d.inter_busbw = (f->network_bytes_per_s > 0 ? f->network_bytes_per_s : 50e9) * 0.8;
  d.inter_latency_s = 20e-6;
  d.op_overhead_s = 0;  // launches are asynchronous: hidden behind kernels of these sizes
  d.sources = {{"memory", "datasheet capacity (" + f->variant + ")"},
               {"gemm", "datasheet dense peak x 0.75 (16-bit, fp8) or 0.5 (fp32, tf32): PyTorch's runtime-estimator presets"},
               {"bandwidth", "datasheet HBM x 0.8 (assumed)"},
               {"intra_node", f->link + " per direction x 0.8, 10 us per collective (assumed)"},
               {"inter_node", "one NIC per GPU x 0.8, 20 us per collective (assumed)"},
               {"peak", "datasheet dense peak (MFU is against it): " + f->source}};
  return d;
}

namespace {

// The hardware suite's measured scratch: oneDNN's convolution workspace per shape, batch norm's
// backward temporary over its input, and the GPU GEMM library's persistent workspace.
void read_workspaces(DeviceProfile& d, const json& hw, const std::string& source) {
  if (hw.contains("conv_workspace")) {
    for (const auto& w : hw["conv_workspace"]) {
      const double out = w.value("output_bytes", 0.0);
      if (out > 0)
        d.conv_workspace.shapes.push_back({w.value("in_channels", 0.0), w.value("out_channels", 0.0), w.value("kernel", int64_t{3}),
                                           w.value("stride", int64_t{1}), w.value("forward_bytes", 0.0) / out,
                                           w.value("backward_bytes", 0.0) / out});
    }
    d.sources["conv_workspace"] = "measured oneDNN convolution scratch per shape, the nearest channels' (" + source + ")";
  }
  if (hw.contains("batch_norm_workspace")) {
    double ratio = 0;
    int n = 0;
    for (const auto& w : hw["batch_norm_workspace"])
      if (w.value("input_bytes", 0.0) > 0) ratio += w.value("backward_bytes", 0.0) / w["input_bytes"].get<double>(), ++n;
    if (n > 0) d.batch_norm_backward_ratio = ratio / n;
    d.sources["batch_norm_workspace"] = "measured batch norm backward temporary over its input (" + source + ")";
  }
  if (hw.contains("gemm_workspace_bytes")) d.gpu_gemm_workspace = hw["gemm_workspace_bytes"].get<int64_t>();
}

// A GEMM sweep's points (FLOPs of the shape, times its batch where it has one; the median rate), sorted.
Curve gemm_curve(const json& rows) {
  Curve c;
  for (const auto& p : rows) {
    const auto s = p["shape"];
    const double flops = 2.0 * p.value("batch", 1.0) * s[0].get<double>() * s[1].get<double>() * s[2].get<double>();
    if (p["median_flops_per_s"].get<double>() > 0) c.points.emplace_back(flops, p["median_flops_per_s"].get<double>());
  }
  std::sort(c.points.begin(), c.points.end());
  return c;
}

// One dtype's GEMM measurements: the achievable and datasheet peaks, the rate by size (single and
// batched), the CPU's GEMM scratch by k and the fused attention's forward and backward rates by size.
void read_gemm(DeviceProfile& d, const json& g, const std::string& source) {
  const std::string dt = g["dtype"];
  d.name = g.value("device_name", d.name);
  d.gemm_rate[dt] = g["achievable_flops_per_s"].get<double>();
  d.peak_flops[dt] = g.value("datasheet_flops_per_s", json()).is_number() ? g["datasheet_flops_per_s"].get<double>()
                                                                          : g["achievable_flops_per_s"].get<double>();
  json sizes = g.value("curve", json::array());
  for (const auto& p : g.value("shapes", json::array())) sizes.push_back(p);
  d.gemm_curve[dt] = gemm_curve(sizes);
  if (Curve bc = gemm_curve(g.value("batched_curve", json::array())); !bc.empty()) d.batched_curve[dt] = bc;
  Curve ws;
  for (const auto& p : g.value("workspace", json::array()))
    if (p["bytes"].get<double>() > 0) ws.points.emplace_back(p["k"].get<double>(), p["bytes"].get<double>());
  std::sort(ws.points.begin(), ws.points.end());
  if (!ws.empty()) d.gemm_workspace[dt] = ws;
  std::pair<Curve, Curve> att;
  for (const auto& p : g.value("attention", json::array())) {
    const double flops = p.value("forward_flops", 0.0), f = p.value("forward_flops_per_s", 0.0), b = p.value("backward_flops_per_s", 0.0);
    if (flops > 0 && f > 0 && b > 0) {
      att.first.points.emplace_back(flops, f);
      att.second.points.emplace_back(flops, b);
    }
  }
  std::sort(att.first.points.begin(), att.first.points.end());
  std::sort(att.second.points.begin(), att.second.points.end());
  if (!att.first.empty()) {
    d.attention[dt] = att;
    d.sources["attention"] = "measured fused causal attention (SDPA) forward and backward by size (" + source + ")";
  }
}

// The memory measurements: copy bandwidth by size, the cost per operator and per backward node, and the
// elementwise kinds' rates by size, forward and backward.
void read_memory(DeviceProfile& d, const json& mem, const std::string& source) {
  Curve c;
  for (const auto& p : mem.value("curve", json::array())) c.points.emplace_back(p["bytes"].get<double>(), p["median_gbps"].get<double>() * 1e9);
  if (c.points.empty() && mem.contains("bandwidth_gbps")) c.points.emplace_back(1.0, mem["bandwidth_gbps"].get<double>() * 1e9);
  std::sort(c.points.begin(), c.points.end());
  d.bandwidth = c;
  d.op_overhead_s = mem.value("op_overhead_s", 0.0);
  const json rates = mem.value("elementwise_elements_per_s", json::object());  // held: items() does not extend its life
  for (const auto& [dt, sizes] : rates.items()) {
    if (!sizes.is_array()) continue;
    for (const auto& s : sizes)
      for (const auto& [kind, r] : s.items()) {
        if (kind == "elements") continue;
        const double n = s["elements"].get<double>();
        auto& [f, b] = d.elementwise[dt][kind];
        if (r.value("forward", json()).is_number()) f.points.emplace_back(n, r["forward"].get<double>());
        if (r.value("backward", json()).is_number()) b.points.emplace_back(n, r["backward"].get<double>());
      }
  }
  for (auto& [dt, kinds] : d.elementwise)
    for (auto& [kind, fb] : kinds) {
      std::sort(fb.first.points.begin(), fb.first.points.end());
      std::sort(fb.second.points.begin(), fb.second.points.end());
    }
  d.backward_node_s = mem.value("backward_node_s", 0.0);
  d.sources["bandwidth"] = "measured copy bandwidth by size (" + source + ")";
  d.sources["op_overhead"] = "measured per-operator and per-backward-node cost (" + source + ")";
}

// Run across nodes, the collectives cell also measured each level on its own groups: within a node the
// curves come from those (the world's sweep crossed the nodes); across, the largest all-reduce's bus
// bandwidth and the smallest one's time (Calculon's and the datasheet profile's two numbers).
void read_levels(DeviceProfile& d, const json& levels, const std::string& source) {
  std::map<std::string, Curve> intra;
  double largest = 0, smallest = 1e300;
  for (const auto& row : levels.value("rows", json::array())) {
    const double bytes = row.value("bytes", 0.0), bw = row.value("busbw_gbps", 0.0) * 1e9;
    if (row.value("level", "") == "intra-node") {
      if (bw > 0) intra[row["op"]].points.emplace_back(bytes, bw);
    } else if (row.value("op", "") == "all-reduce") {
      if (bytes > largest) largest = bytes, d.inter_busbw = bw;
      if (bytes < smallest) smallest = bytes, d.inter_latency_s = row.value("time_s", 0.0);
    }
  }
  for (auto& [op, c] : intra) std::sort(c.points.begin(), c.points.end());
  if (!intra.empty()) {
    d.busbw = intra;
    d.busbw_by_world.clear();  // the world's sweep crossed the nodes
  }
  d.sources["intra_node"] = "measured within a node on the cluster, bus bandwidth by size (" + source + ")";
  d.sources["inter_node"] = "measured across nodes on the cluster: the largest all-reduce's bus bandwidth, the "
                            "smallest one's time as latency (" + source + ")";
}

// The collectives cell: bus bandwidth by size per op for its world, and its levels where it has them.
void read_collectives(DeviceProfile& d, const json& cell, const std::string& source) {
  const json& m = cell["metrics"];
  std::map<std::string, Curve> curves;
  for (const auto& c : m["comm"].value("collectives", json::array())) {
    const double bw = c.value("busbw_gbps", 0.0) * 1e9;
    if (bw > 0) curves[c["op"]].points.emplace_back(c["bytes"].get<double>(), bw);
  }
  for (auto& [op, c] : curves) std::sort(c.points.begin(), c.points.end());
  const int64_t world = cell["config"].value("world_size", int64_t{2});
  d.busbw_by_world[world] = curves;
  // The default (collectives the sweeps do not bracket, the levels below): the smallest world's.
  if (d.busbw.empty() || world <= d.busbw_by_world.begin()->first) d.busbw = curves;
  d.latency_s = 0;  // the measured bus bandwidth by size already carries the latency
  d.sources["intra_node"] = "measured collectives sweep, bus bandwidth by size (" + source + ")";
  const json levels = m.value("hardware", json::object()).value("collectives", json::object()).value("levels", json());
  if (levels.is_object()) read_levels(d, levels, source);
}

}  // namespace

DeviceProfile measured_profile(const json& report, const std::string& source) {
  DeviceProfile d;
  d.source = source;
  const json env = report.value("env", json::object());
  d.memory_bytes = env.value("memory_bytes", int64_t{0});
  bool any = false;
  for (const auto& cell : report.value("cells", json::array())) {
    if (cell.value("status", "") != "ok" || !cell.contains("metrics")) continue;
    const json& m = cell["metrics"];
    d.gpu = cell.value("config", json::object()).value("device", "cpu").rfind("cuda", 0) == 0;
    if (d.gpu) {  // the GPU's memory, not the host's
      const json gpus = env.value("gpus", json::array());
      if (!gpus.empty() && gpus[0].contains("memory_bytes")) d.memory_bytes = gpus[0]["memory_bytes"].get<int64_t>();
    }
    const json hw = m.value("hardware", json::object());
    read_workspaces(d, hw, source);
    if (hw.contains("gemm")) {
      for (const auto& g : hw["gemm"])
        if (!g.contains("skipped") && g.contains("achievable_flops_per_s")) read_gemm(d, g, source), any = true;
      d.sources["gemm"] = "measured GEMM sweep and size curve (" + source + ")";
      d.sources["peak"] = "the datasheet's dense peak where the device is known, else the measured GEMM peak";
    }
    if (hw.contains("memory")) read_memory(d, hw["memory"], source);
    if (m.contains("comm") && cell.value("config", json::object()).value("kind", "") == "collectives") read_collectives(d, cell, source);
    if (const auto cores = env.value("cpu", json::object()).value("logical_cores", int64_t{0}); cores > 0) d.cores = cores;
  }
  if (!any) throw UsageError("plan: " + source + " has no GEMM measurements (run: trainscope run --suite hardware)");
  if (d.bandwidth.empty()) throw UsageError("plan: " + source + " has no memory-bandwidth measurement (run: trainscope run --suite hardware)");
  calibrate_in_step(d, report);
  return d;
}

}  // namespace trainscope::plan
