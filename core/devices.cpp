#include "core/devices.hpp"

#include <torch/cuda.h>

#include <cstdlib>
#include <fstream>
#include <mutex>
#include <set>

#include <toml++/toml.h>

#include "core/errors.hpp"

#ifdef TRAINSCOPE_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace trainscope {
namespace {

constexpr double GB = 1e9, TF = 1e12, MiB = 1024.0 * 1024.0;

// Memory is the total the driver reports (what the caching allocator can have), where a source shows
// it: datasheets round it to "80 GB", and an H100 SXM reports 81,559 MiB (85.5e9 bytes), 7% more.
// H100 SXM, A100 80/40 GB: nvidia-smi's totals listed in modal-labs/modal-client PR 2797; H200: what
// trainscope's env recorded on one (tests/data/h200/hardware/report.json); B200: nvidia-smi in
// NVIDIA/TensorRT-LLM issue 10278. The others: the datasheet's GB (a lower bound).

std::map<std::string, double> peaks(double fp32, double tf32, double bf16, double fp8) {
  std::map<std::string, double> p;
  if (fp32 > 0) p["fp32"] = fp32 * TF;
  if (tf32 > 0) p["tf32"] = tf32 * TF;
  if (bf16 > 0) p["bf16"] = p["fp16"] = bf16 * TF;  // the same tensor cores
  if (fp8 > 0) p["fp8"] = fp8 * TF;
  return p;
}

std::vector<DeviceFacts> built_in() {
  const char* nvlink4 = "NVLink 4 (900 GB/s both ways)";
  return {
      {"H100-SXM", {"NVIDIA H100 80GB HBM3"}, "SXM5, 80 GB HBM3, 700 W", 81559 * MiB, 3350 * GB, peaks(67, 494.5, 989, 1979),
       450 * GB, nvlink4, 50 * GB, 700, {{"bf16", 0.803}, {"fp8", 0.709}}, "nvidia.com H100 SXM datasheet, dense"},
      // Meta's H100s, on which torchtitan's published runs were made (Liang et al. 2024, "TorchTitan",
      // arXiv 2410.06511, section 3.1): HBM2e and a lower TDP; "the actual peak TFLOPs should be between
      // SXM and NVL, and we don't know the exact value". The NVL's dense peak is taken (the lower bound),
      // HBM2e at the PCIe part's bandwidth.
      {"H100-HBM2e-96GB", {}, "SXM, 96 GB HBM2e, 500 W (torchtitan's): peak between the NVL's and the SXM's, NVL's taken",
       96 * GB, 2000 * GB, peaks(60, 417.5, 835, 1670), 450 * GB, nvlink4, 50 * GB, 500, {},
       "TorchTitan paper (arXiv 2410.06511) for the part; H100 NVL datasheet's dense peak as its lower bound"},
      {"H100-PCIe", {"NVIDIA H100 PCIe"}, "PCIe, 80 GB HBM2e, 350 W", 80 * GB, 2000 * GB, peaks(51, 378, 756, 1513),
       300 * GB, "NVLink bridge (600 GB/s both ways)", 50 * GB, 350, {}, "nvidia.com H100 PCIe datasheet, dense"},
      {"H200", {"NVIDIA H200"}, "SXM, 141 GB HBM3e, 700 W", 150109880320.0, 4800 * GB, peaks(67, 494.5, 989, 1979), 450 * GB,
       nvlink4, 50 * GB, 700, {{"bf16", 0.803}, {"fp8", 0.734}}, "nvidia.com H200 SXM datasheet, dense"},
      {"A100-80GB", {"NVIDIA A100-SXM4-80GB"}, "SXM4, 80 GB HBM2e, 400 W", 81920 * MiB, 2039 * GB, peaks(19.5, 156, 312, 0),
       300 * GB, "NVLink 3 (600 GB/s both ways)", 25 * GB, 400, {{"bf16", 0.869}}, "nvidia.com A100 datasheet, dense"},
      {"A100-40GB", {"NVIDIA A100-SXM4-40GB"}, "SXM4, 40 GB HBM2, 400 W", 40960 * MiB, 1555 * GB, peaks(19.5, 156, 312, 0),
       300 * GB, "NVLink 3 (600 GB/s both ways)", 25 * GB, 400, {{"bf16", 0.869}}, "nvidia.com A100 datasheet, dense"},
      {"B200", {"NVIDIA B200"}, "HGX B200, 180 GB HBM3e, 1000 W", 183359 * MiB, 8000 * GB, peaks(0, 1100, 2250, 4500), 900 * GB,
       "NVLink 5 (1.8 TB/s both ways)", 50 * GB, 1000, {}, "nvidia.com HGX B200 datasheet, dense, per GPU"},
      {"MI300X", {"AMD Instinct MI300X"}, "OAM, 192 GB HBM3, 750 W", 192 * GB, 5300 * GB, peaks(163.4, 653.7, 1307.4, 2614.9),
       448 * GB, "Infinity Fabric (896 GB/s both ways)", 50 * GB, 750, {{"bf16", 0.514}}, "amd.com MI300X datasheet, dense"},
  };
}

std::vector<DeviceFacts> load_table() {
  std::vector<DeviceFacts> t = built_in();
  const char* file = std::getenv("TRAINSCOPE_DEVICE_FILE");
  if (file && *file) {
    DeviceFacts d = read_device_file(file);
    bool replaced = false;
    for (auto& e : t)
      if (e.key == d.key) e = d, replaced = true;
    if (!replaced) t.push_back(d);
  }
  return t;
}

std::mutex g_table_mutex;
std::vector<DeviceFacts>& table_storage() {
  static std::vector<DeviceFacts> t = load_table();
  return t;
}

}  // namespace

const std::vector<DeviceFacts>& device_table() {
  std::lock_guard<std::mutex> lock(g_table_mutex);
  return table_storage();
}

const DeviceFacts* find_device(const std::string& name) {
  for (const auto& d : device_table()) {
    if (d.key == name) return &d;
    for (const auto& n : d.driver_names)
      if (n == name) return &d;
  }
  return nullptr;
}

std::vector<std::string> device_keys() {
  std::vector<std::string> out;
  for (const auto& d : device_table()) out.push_back(d.key);
  return out;
}

DeviceFacts read_device_file(const std::string& path) {
  auto bad = [&](const std::string& why) { return UsageError("--device-file " + path + ": " + why); };
  toml::table t;
  try {
    t = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw bad(std::string(e.description()) + " (line " + std::to_string(e.source().begin.line) + ")");
  }
  static const std::set<std::string> allowed = {"name", "driver_names", "variant", "memory_gb", "hbm_gbps", "peak_tflops",
                                                "link_gbps", "link", "network_gbps", "tdp_w", "source"};
  for (const auto& [k, v] : t)
    if (!allowed.count(std::string(k.str())))
      throw bad("unknown key '" + std::string(k.str()) +
                "' (allowed: name, driver_names, variant, memory_gb, hbm_gbps, peak_tflops, link_gbps, link, network_gbps, tdp_w, source)");
  auto number = [&](const char* key, bool required) -> double {
    const auto* n = t.get(key);
    if (!n) {
      if (required) throw bad("missing '" + std::string(key) + "'");
      return 0;
    }
    if (auto v = n->value<double>(); v && *v >= 0) return *v;
    throw bad("'" + std::string(key) + "' must be a number >= 0");
  };
  DeviceFacts d;
  const auto* name = t.get_as<std::string>("name");
  if (!name || name->get().empty()) throw bad("missing 'name' (the key `plan --device` will take)");
  d.key = name->get();
  if (const auto* names = t.get_as<toml::array>("driver_names"))
    for (const auto& n : *names) {
      const auto* s = n.as_string();
      if (!s) throw bad("'driver_names' must be a list of strings");
      d.driver_names.push_back(s->get());
    }
  if (const auto* v = t.get_as<std::string>("variant")) d.variant = v->get();
  if (const auto* v = t.get_as<std::string>("link")) d.link = v->get();
  d.memory_bytes = number("memory_gb", true) * GB;
  d.hbm_bytes_per_s = number("hbm_gbps", true) * GB;
  d.link_bytes_per_s = number("link_gbps", true) * GB;
  d.network_bytes_per_s = number("network_gbps", false) * GB;
  d.tdp_w = number("tdp_w", false);
  const auto* p = t.get_as<toml::table>("peak_tflops");
  if (!p || p->empty()) throw bad("missing [peak_tflops] (dense TFLOPS per dtype: fp32, tf32, bf16, fp16, fp8)");
  for (const auto& [k, v] : *p) {
    const std::string dtype(k.str());
    if (dtype != "fp32" && dtype != "tf32" && dtype != "bf16" && dtype != "fp16" && dtype != "fp8" && dtype != "fp64")
      throw bad("unknown dtype '" + dtype + "' in [peak_tflops] (fp64, fp32, tf32, bf16, fp16, fp8)");
    const auto tf = v.value<double>();
    if (!tf || *tf <= 0) throw bad("peak_tflops." + dtype + " must be a number > 0");
    d.peak_flops[dtype] = *tf * TF;
  }
  if (d.memory_bytes <= 0 || d.hbm_bytes_per_s <= 0) throw bad("memory_gb and hbm_gbps must be > 0");
  const auto* src = t.get_as<std::string>("source");
  d.source = src ? src->get() : "device file " + path;
  return d;
}

void use_device_file(const std::string& path) {
  read_device_file(path);  // a bad file: one line now, not in every cell
  ::setenv("TRAINSCOPE_DEVICE_FILE", path.c_str(), 1);
  std::lock_guard<std::mutex> lock(g_table_mutex);
  table_storage() = load_table();
}

std::optional<double> datasheet_peak_flops(const std::string& name, const std::string& dtype) {
  const DeviceFacts* d = find_device(name);
  if (!d) return std::nullopt;
  const auto it = d->peak_flops.find(dtype);
  if (it == d->peak_flops.end()) return std::nullopt;
  return it->second;
}

std::string device_name(const std::string& device) {
#ifdef TRAINSCOPE_TORCH_CUDA
  if (device.rfind("cuda", 0) == 0 && torch::cuda::is_available()) {
    const int index = device.size() > 5 ? std::stoi(device.substr(5)) : 0;
    return at::cuda::getDeviceProperties(index)->name;
  }
#endif
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return device;
}

}  // namespace trainscope
