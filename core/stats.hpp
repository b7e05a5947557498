#pragma once
// Summary statistics of a sample (step times and the like), as docs/metrics.md defines them.
#include <cstdint>
#include <vector>

#include "core/config.hpp"

namespace trainscope {

struct Summary {
  double p50 = 0, p90 = 0, p99 = 0, mean = 0, stdev = 0, min = 0, max = 0;
  int64_t count = 0;
};

// Percentiles by linear interpolation between closest ranks (numpy's default); stdev is the
// sample standard deviation (n-1). An empty sample gives count 0 and zeros.
Summary summarize(std::vector<double> values);
json to_json(const Summary& s);  // {"p50","p90","p99","mean","stdev","min","max","count"}

// Mann-Whitney U test of "b tends to be larger than a" (one-sided): the p-value, exact (by counting
// the arrangements) when there are no ties and na x nb <= 2500, else the normal approximation with
// the tie correction and a continuity correction. NaN when a side is empty.
double mann_whitney_greater_p(const std::vector<double>& a, const std::vector<double>& b);

// Paired differences d (e.g. per-block log ratios new/base), for the CI gate:
// - the one-sided Wilcoxon signed-rank p-value of "d tends to be positive", exact (zeros dropped, tied
//   |d| given their average rank, the null distribution counted over every sign assignment);
// - the Hodges-Lehmann estimate (median of the Walsh averages (d_i + d_j) / 2, i <= j) and its exact
//   one-sided upper confidence bound at level 1 - alpha (the Walsh average whose rank the signed-rank
//   distribution gives).
// NaN for an empty sample. n up to 60.
double wilcoxon_signed_rank_greater_p(const std::vector<double>& d);
double hodges_lehmann(const std::vector<double>& d);
double hodges_lehmann_upper(const std::vector<double>& d, double alpha);
// Holm's step-down adjustment of a family of p-values (same order as given).
std::vector<double> holm_adjust(const std::vector<double>& p);

// Change points of a series (a metric over many runs of main, in order) by E-divisive means
// (Matteson & James 2014, the method of Hunter / Apache Otava): the split that maximises the energy
// distance between the two sides, kept when a permutation test (`permutations` shuffles of the
// segment, a fixed seed: the same series gives the same answer) gives p <= alpha, then the same
// within each side (binary segmentation). Segments are at least `min_size` long. Returned sorted: the
// index of the first value after each change.
struct ChangePoint {
  size_t index = 0;
  double p = 1;
};
std::vector<ChangePoint> e_divisive_change_points(const std::vector<double>& x, double alpha = 0.01,
                                                  int permutations = 199, size_t min_size = 4);

// The final loss of a run that stopped after `steps` steps: the mean of the losses of its last (up
// to) 10 steps. NaN when there is none or one of them is not finite.
double final_loss_of(const std::vector<double>& step_losses, int64_t steps);

}  // namespace trainscope
