#pragma once
// `trainscope plan --check DIR`: every ok training cell of a results folder predicted from its own
// configuration (and the machine's measured hardware, for time), beside what the cell measured.
#include <string>

#include "core/config.hpp"

namespace trainscope::plan {

// The comparison for one report: per cell, predicted and measured memory (and step time when a
// hardware profile is given), the signed errors, and the distribution of each error.
json check_report(const json& report, const json& hardware);

// The text table of a check.
std::string render_check(const json& check);

}  // namespace trainscope::plan
