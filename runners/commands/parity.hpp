#pragma once
// `trainscope parity`: run a suite whose cells dump what they trained on (the `parity` suite by
// default), train the same with PyTorch's own implementations (tests/parity/reference.py, on the
// wheel's Python), and put both sides' numbers in the report as each cell's `parity` section.
#include <string>

#include "core/config.hpp"
#include "runners/commands/suite_run.hpp"

namespace trainscope::runners {

struct ParityOptions {
  RunOptions run;          // suite "parity", 2 local ranks unless told otherwise
  std::string python;      // "" -> the build's venv Python
  std::string reference;   // "" -> the source tree's tests/parity
  double timeout_s = 1800; // the whole PyTorch side
};

// 0: every cell ran and every comparison holds (exact, within its tolerance, or an explained design
// difference); 1: a cell failed, a comparison differs or a reference row failed; 2: bad arguments or
// no usable Python/torch/reference (said before anything runs).
int parity_command(ParityOptions options);

// Puts parity.json's rows into the report's cells (`parity`) and a `parity` summary at the top.
void merge_parity(json& report, const json& parity);

}  // namespace trainscope::runners
