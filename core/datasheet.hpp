#pragma once
// Datasheet figures for the devices recognised with certainty: dense (not sparse) peak FLOP/s per dtype
// and the memory bandwidth. Used only on an exact device-name match; any other device has no datasheet
// and its datasheet MFU is null, never a guess.
#include <optional>
#include <string>

#include "core/config.hpp"

namespace trainscope {

struct Datasheet {
  std::string device;      // the name as the driver reports it
  std::string source;      // where the figures come from
  json peak_tflops;        // dtype -> dense TFLOPS (fp32, tf32, bf16, fp16, fp8); a missing dtype: none
  double memory_gbps = 0;  // HBM, GB/s (1e9)
};

// The entry whose `device` equals `name` exactly, if any.
std::optional<Datasheet> datasheet_for(const std::string& name);

// The dense peak of `dtype` on the device named `name` in FLOP/s, if the datasheet has it.
std::optional<double> datasheet_peak_flops(const std::string& name, const std::string& dtype);

// The name of the device a cell runs on ("cuda:0" -> the driver's name; CPUs: the CPU model, which has
// no datasheet entry).
std::string device_name(const std::string& device);

}  // namespace trainscope
