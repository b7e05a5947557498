#pragma once
// In-step calibration of a CPU profile (docs/plan.md, "Step time"). On a CPU the hardware suite's
// rates, measured on operators run alone, are not what the same operators achieve between the step's
// others (1.3-3.5x slower there: operands out of cache, intra-op threads woken for each, strided copies).
// The hardware suite therefore also trains a few calibration models (shapes no planned cell has)
// with `operator_times` on: the self time of each operator kind inside their steps. Per GEMM
// dtype and kind, the planner divides what those steps took by what this profile predicts for the
// same cells; what the steps spent outside any kernel, over the operators the replay counts, is the
// per-operator (forward) and per-node (backward) cost; the optimizer's phase over its prediction is
// its ratio. Nothing here sees the cells `plan --check` is judged on.
#include "core/config.hpp"
#include "plan/device.hpp"

namespace trainscope::plan {

// Fills `d.in_step` from the calibration cells of `hardware_report` (none: unchanged). A GPU profile
// is left as it is: its kernels are timed on the device (the host's clock around them measures launches).
void calibrate_in_step(DeviceProfile& d, const json& hardware_report);

}  // namespace trainscope::plan
