#pragma once
// What trainscope knows of devices: one table, one row per part (variants apart: an H100 with 96 GB
// of HBM2e at 500 W is not the 80 GB SXM datasheet part), read by the planner (plan/device.cpp), the
// reports' datasheet MFU (probes/step/timing.cpp), the hardware suite and the recommendations. A device
// the table does not know comes from a small TOML file (`--device-file`, docs/plan.md#devices).
//
// Peaks are dense (NVIDIA's pages print tf32/bf16/fp16/fp8 "with sparsity": these are half of those);
// links per direction per GPU (half NVIDIA's bidirectional figure); one NIC per GPU across nodes.
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace trainscope {

struct DeviceFacts {
  std::string key;                        // the name `plan --device` takes ("H100-SXM")
  std::vector<std::string> driver_names;  // the names the driver reports, matched exactly
  std::string variant;                    // what tells this part from its siblings
  double memory_bytes = 0;                // the total the driver reports, else the datasheet's GB x 1e9
  double hbm_bytes_per_s = 0;
  std::map<std::string, double> peak_flops;  // dtype -> dense peak, FLOP/s
  double link_bytes_per_s = 0;               // within a node (NVLink, Infinity Fabric), per direction
  std::string link;                          // its name, for the reports
  double network_bytes_per_s = 0;            // per GPU across nodes
  double tdp_w = 0;
  // What mamf-finder measured: the best GEMM shape's mean over the dense peak, per dtype (0: unknown).
  std::map<std::string, double> published_gemm_fraction;
  std::string source;  // where the figures come from
};

// Every known device: the built-in table, then those of $TRAINSCOPE_DEVICE_FILE (set by
// `--device-file`; a file's device replaces a built-in one of the same key).
const std::vector<DeviceFacts>& device_table();
// By key ("H100-SXM") or by the driver's exact name ("NVIDIA H100 80GB HBM3"); nullptr when unknown.
const DeviceFacts* find_device(const std::string& name);
std::vector<std::string> device_keys();

// Reads one device from a TOML file; UsageError (one line, naming the file and the key) on anything
// missing or malformed.
DeviceFacts read_device_file(const std::string& path);
// Makes `path`'s device known to this process and to the cells it starts (it sets
// $TRAINSCOPE_DEVICE_FILE); UsageError on a bad file.
void use_device_file(const std::string& path);

// The dense peak of `dtype` on the device named `name`, if known.
std::optional<double> datasheet_peak_flops(const std::string& name, const std::string& dtype);

// The name of the device a cell runs on ("cuda:0" -> the driver's name; a CPU: its model name, which no
// table row has).
std::string device_name(const std::string& device);

}  // namespace trainscope
