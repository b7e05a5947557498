#include "core/stats.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

namespace trainscope {

static double percentile(const std::vector<double>& sorted, double q) {
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}

Summary summarize(std::vector<double> values) {
  Summary s;
  s.count = static_cast<int64_t>(values.size());
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  s.p50 = percentile(values, 0.50);
  s.p90 = percentile(values, 0.90);
  s.p99 = percentile(values, 0.99);
  s.min = values.front();
  s.max = values.back();
  s.mean = std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
  if (values.size() > 1) {
    double sq = 0;
    for (double v : values) sq += (v - s.mean) * (v - s.mean);
    s.stdev = std::sqrt(sq / static_cast<double>(values.size() - 1));
  }
  return s;
}

json to_json(const Summary& s) {
  return json{{"p50", s.p50}, {"p90", s.p90},   {"p99", s.p99}, {"mean", s.mean},
              {"stdev", s.stdev}, {"min", s.min}, {"max", s.max}, {"count", s.count}};
}

double mann_whitney_greater_p(const std::vector<double>& a, const std::vector<double>& b) {
  const size_t na = a.size(), nb = b.size();
  if (na == 0 || nb == 0) return std::nan("");
  // Ranks of the pooled sample (average ranks for ties), and the tie-correction term.
  std::vector<std::pair<double, int>> pooled;
  for (double v : a) pooled.emplace_back(v, 0);
  for (double v : b) pooled.emplace_back(v, 1);
  std::sort(pooled.begin(), pooled.end());
  const double n = static_cast<double>(na + nb);
  double rank_sum_b = 0, tie_term = 0;
  bool ties = false;
  for (size_t i = 0; i < pooled.size();) {
    size_t j = i;
    while (j < pooled.size() && pooled[j].first == pooled[i].first) ++j;
    const double t = static_cast<double>(j - i), avg_rank = (static_cast<double>(i + j) + 1.0) / 2.0;
    if (t > 1) ties = true;
    tie_term += t * t * t - t;
    for (size_t k = i; k < j; ++k)
      if (pooled[k].second == 1) rank_sum_b += avg_rank;
    i = j;
  }
  // U_b: how many (a, b) pairs have b above a (ties count half).
  const double u = rank_sum_b - static_cast<double>(nb) * (static_cast<double>(nb) + 1) / 2.0;
  if (!ties && na * nb <= 2500) {
    // Exact: the number of arrangements with U >= u among all C(n, nb), by the usual recurrence
    // on f(i, j, k) = arrangements of i a's and j b's with U = k.
    const size_t max_u = na * nb;
    std::vector<std::vector<double>> prev(nb + 1, std::vector<double>(max_u + 1, 0.0)), cur = prev;
    // f(0, j, 0) = 1: j b's and no a's give U = 0.
    for (size_t j = 0; j <= nb; ++j) prev[j][0] = 1;
    for (size_t i = 1; i <= na; ++i) {
      for (size_t j = 0; j <= nb; ++j) {
        std::fill(cur[j].begin(), cur[j].end(), 0.0);
        for (size_t k = 0; k <= max_u; ++k) {
          // The largest value is an a (adds nothing to U) or a b (above all i a's: adds i).
          double v = prev[j][k];
          if (j > 0 && k >= i) v += cur[j - 1][k - i];
          cur[j][k] = v;
        }
      }
      std::swap(prev, cur);
    }
    double total = 0, tail = 0;
    const auto threshold = static_cast<size_t>(std::llround(u));
    for (size_t k = 0; k <= max_u; ++k) {
      total += prev[nb][k];
      if (k >= threshold) tail += prev[nb][k];
    }
    return tail / total;
  }
  const double mean = static_cast<double>(na) * static_cast<double>(nb) / 2.0;
  const double var = static_cast<double>(na) * static_cast<double>(nb) / 12.0 * ((n + 1) - tie_term / (n * (n - 1)));
  if (var <= 0) return 1.0;  // every value equal: no evidence either way
  const double z = (u - mean - 0.5) / std::sqrt(var);
  return 0.5 * std::erfc(z / std::sqrt(2.0));
}

namespace {

// P(W+ >= w) under the null for the given integer rank weights (each in or out with probability 1/2).
double signed_rank_upper_tail(const std::vector<int64_t>& weights, int64_t w) {
  int64_t total = 0;
  for (int64_t r : weights) total += r;
  std::vector<double> ways(static_cast<size_t>(total + 1), 0.0);
  ways[0] = 1;
  for (int64_t r : weights)
    for (int64_t s = total; s >= r; --s) ways[static_cast<size_t>(s)] += ways[static_cast<size_t>(s - r)];
  double tail = 0, all = 0;
  for (int64_t s = 0; s <= total; ++s) {
    all += ways[static_cast<size_t>(s)];
    if (s >= w) tail += ways[static_cast<size_t>(s)];
  }
  return tail / all;
}

std::vector<double> walsh_averages(const std::vector<double>& d) {
  std::vector<double> w;
  for (size_t i = 0; i < d.size(); ++i)
    for (size_t j = i; j < d.size(); ++j) w.push_back(0.5 * (d[i] + d[j]));
  std::sort(w.begin(), w.end());
  return w;
}

}  // namespace

double wilcoxon_signed_rank_greater_p(const std::vector<double>& d) {
  std::vector<double> nz;
  for (double v : d)
    if (v != 0 && std::isfinite(v)) nz.push_back(v);
  if (nz.empty()) return d.empty() ? std::nan("") : 1.0;
  // Doubled average ranks of |d| (integers even with ties), and W+ (doubled) of the positive ones.
  std::vector<size_t> order(nz.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return std::fabs(nz[a]) < std::fabs(nz[b]); });
  std::vector<int64_t> rank2(nz.size());
  for (size_t i = 0; i < order.size();) {
    size_t j = i;
    while (j + 1 < order.size() && std::fabs(nz[order[j + 1]]) == std::fabs(nz[order[i]])) ++j;
    const int64_t doubled = static_cast<int64_t>(i + 1 + j + 1);  // twice the average of ranks i+1..j+1
    for (size_t k = i; k <= j; ++k) rank2[order[k]] = doubled;
    i = j + 1;
  }
  int64_t w = 0;
  for (size_t i = 0; i < nz.size(); ++i)
    if (nz[i] > 0) w += rank2[i];
  return signed_rank_upper_tail(rank2, w);
}

double hodges_lehmann(const std::vector<double>& d) {
  if (d.empty()) return std::nan("");
  const std::vector<double> w = walsh_averages(d);
  const size_t m = w.size();
  return m % 2 ? w[m / 2] : 0.5 * (w[m / 2 - 1] + w[m / 2]);
}

double hodges_lehmann_upper(const std::vector<double>& d, double alpha) {
  if (d.empty()) return std::nan("");
  const std::vector<double> w = walsh_averages(d);
  const int64_t n = static_cast<int64_t>(d.size()), m = static_cast<int64_t>(w.size());
  // The null distribution of W+ (ranks 1..n): the largest c with P(W+ >= m - c + 1) <= alpha makes
  // the c-th largest Walsh average the upper bound (Hollander & Wolfe's construction).
  std::vector<int64_t> ranks(static_cast<size_t>(n));
  std::iota(ranks.begin(), ranks.end(), 1);
  int64_t c = 0;
  for (int64_t k = 1; k <= m; ++k) {
    if (signed_rank_upper_tail(ranks, m - k + 1) <= alpha) c = k;
    else break;
  }
  if (c == 0) return std::numeric_limits<double>::infinity();  // too few pairs for this level
  return w[static_cast<size_t>(m - c)];
}

std::vector<double> holm_adjust(const std::vector<double>& p) {
  const size_t k = p.size();
  std::vector<size_t> order(k);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return p[a] < p[b]; });
  std::vector<double> out(k);
  double running = 0;
  for (size_t i = 0; i < k; ++i) {
    running = std::max(running, std::min(1.0, static_cast<double>(k - i) * p[order[i]]));
    out[order[i]] = running;
  }
  return out;
}

double final_loss_of(const std::vector<double>& step_losses, int64_t steps) {
  steps = std::min<int64_t>(steps, static_cast<int64_t>(step_losses.size()));
  const int64_t from = std::max<int64_t>(0, steps - 10);
  if (steps <= from) return std::nan("");
  double sum = 0;
  for (int64_t i = from; i < steps; ++i) sum += step_losses[static_cast<size_t>(i)];
  return sum / static_cast<double>(steps - from);
}

namespace {

// The largest E-divisive statistic over the splits of x[0..n) with both sides at least min_size:
// Q(t) = m k / (m + k) (2/(m k) sum|a - b| - sum_within_a / C(m,2) - sum_within_b / C(k,2)), from a
// prefix table of |x_i - x_j| so that every split costs O(1) and a series O(n^2).
std::pair<size_t, double> best_split(const std::vector<double>& x, size_t min_size) {
  const size_t n = x.size();
  std::vector<double> P((n + 1) * (n + 1), 0.0);
  auto at = [&](size_t i, size_t j) -> double& { return P[i * (n + 1) + j]; };
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j < n; ++j) at(i + 1, j + 1) = at(i, j + 1) + at(i + 1, j) - at(i, j) + std::fabs(x[i] - x[j]);
  auto block = [&](size_t i0, size_t i1, size_t j0, size_t j1) { return at(i1, j1) - at(i0, j1) - at(i1, j0) + at(i0, j0); };
  size_t best = 0;
  double best_q = -INFINITY;
  for (size_t t = min_size; t + min_size <= n; ++t) {
    const double m = static_cast<double>(t), k = static_cast<double>(n - t);
    const double between = block(0, t, t, n), within_a = block(0, t, 0, t) / 2, within_b = block(t, n, t, n) / 2;
    const double e = 2 * between / (m * k) - within_a / (m * (m - 1) / 2) - within_b / (k * (k - 1) / 2);
    const double q = m * k / (m + k) * e;
    if (q > best_q) best_q = q, best = t;
  }
  return {best, best_q};
}

void segment(const std::vector<double>& x, size_t begin, size_t end, double alpha, int permutations, size_t min_size,
             std::mt19937_64& rng, std::vector<ChangePoint>& found) {
  if (end - begin < 2 * min_size) return;
  std::vector<double> part(x.begin() + static_cast<std::ptrdiff_t>(begin), x.begin() + static_cast<std::ptrdiff_t>(end));
  const auto [t, q] = best_split(part, min_size);
  int as_large = 0;
  for (int r = 0; r < permutations; ++r) {
    for (size_t i = part.size() - 1; i > 0; --i) std::swap(part[i], part[rng() % (i + 1)]);  // Fisher-Yates
    as_large += best_split(part, min_size).second >= q;
  }
  const double p = (1.0 + as_large) / (1.0 + permutations);
  if (p > alpha) return;
  found.push_back({begin + t, p});
  segment(x, begin, begin + t, alpha, permutations, min_size, rng, found);
  segment(x, begin + t, end, alpha, permutations, min_size, rng, found);
}

}  // namespace

std::vector<ChangePoint> e_divisive_change_points(const std::vector<double>& x, double alpha, int permutations, size_t min_size) {
  std::vector<ChangePoint> found;
  for (double v : x)
    if (!std::isfinite(v)) return found;
  std::mt19937_64 rng(0x7ea1);
  segment(x, 0, x.size(), alpha, permutations, std::max<size_t>(min_size, 2), rng, found);
  std::sort(found.begin(), found.end(), [](const ChangePoint& a, const ChangePoint& b) { return a.index < b.index; });
  return found;
}

}  // namespace trainscope
