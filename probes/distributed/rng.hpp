#pragma once
// RNG-divergence probe: per rank, at step 0 and every `rng_every` steps, fingerprints of the
// parameters after synchronisation, of the generators the replicated model draws from, and of what
// the rank's data stream produced (core/hooks.hpp: Fingerprint). Rank 0 compares the ranks' records:
// a must-match stream that differs, or a should-differ stream that is identical on two ranks, is a
// violation naming the stream, the first step and the ranks.
#include <cstdint>
#include <vector>

#include "core/hooks.hpp"

namespace trainscope::probes {

class RngProbe : public Probe {
 public:
  explicit RngProbe(int64_t every) : every_(every) {}
  std::string name() const override { return "rng"; }
  void run_begin(const RunInfo& info) override;
  bool wants_fingerprints(int64_t step) const override {
    return step == 0 || (every_ > 0 && step % every_ == 0) || step == last_step_;
  }
  void fingerprint(const Fingerprint& f) override { records_.push_back(f); }
  void parameter_spread(int64_t step, double d) override { spread_.emplace_back(step, d); }
  json section() const override;  // this rank's records

 private:
  int64_t every_;
  int64_t last_step_ = -1;
  std::vector<Fingerprint> records_;
  std::vector<std::pair<int64_t, double>> spread_;
};

// The cell's verdicts from every rank's section, in rank order:
// {"streams": [{"name","class","verdict","first_violation_step","ranks","steps_compared","detail"}],
//  "violations": n, "parameter_spread": {"max", "final", "first_nonzero_step", "by_step": [[step, d]]}}
// The spread is the consequence a fingerprint cannot show: how far apart (largest |difference| of one
// parameter value) the ranks' weights are. Every rank measures the same value; rank 0's is kept.
json compare_rng(const std::vector<json>& rank_sections);

}  // namespace trainscope::probes
