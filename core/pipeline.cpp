#include "core/pipeline.hpp"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <tuple>

#include "core/errors.hpp"

namespace trainscope::pipeline {
namespace {

using Key = std::tuple<int64_t, Op, int64_t>;  // stage, op, micro-batch
Key key(int64_t stage, Op op, int64_t mb) { return {stage, op, mb}; }

// gpipe: every forward, then every backward, micro-batches in order (torch's ScheduleGPipe).
std::vector<Action> gpipe(int64_t r, int64_t m) {
  std::vector<Action> out;
  for (int64_t i = 0; i < m; ++i) out.push_back({r, Op::Forward, i});
  for (int64_t i = 0; i < m; ++i) out.push_back({r, Op::Backward, i});
  return out;
}

// 1f1b: p - r forwards, then a backward and a forward in turn, then the remaining backwards; rank r
// holds at most p - r micro-batches (Narayanan et al. 2021, Section 2.2; torch's Schedule1F1B).
std::vector<Action> one_f_one_b(int64_t r, int64_t p, int64_t m) {
  std::vector<Action> out;
  const int64_t warmup = std::min(m, p - r);
  int64_t f = 0, b = 0;
  while (f < warmup) out.push_back({r, Op::Forward, f++});
  while (b < m) {
    out.push_back({r, Op::Backward, b++});
    if (f < m) out.push_back({r, Op::Forward, f++});
  }
  return out;
}

// interleaved-1f1b (Megatron's get_pp_rank_microbatches; torch's ScheduleInterleaved1F1B): the k-th
// forward on a rank runs chunk (k mod pv) / p of micro-batch group k / pv, p micro-batches a chunk at a
// time; backwards walk the chunks in reverse. Warm-up: 2(p-1-r) + (v-1)p forwards.
std::vector<Action> interleaved(int64_t r, int64_t p, int64_t m, int64_t v) {
  const int64_t total = m * v;
  auto chunk_mb = [&](int64_t k, bool forward) {
    const int64_t in_group = k % (p * v), chunk = in_group / p;
    return std::pair<int64_t, int64_t>{forward ? chunk : v - 1 - chunk, (k / (p * v)) * p + in_group % p};
  };
  auto act = [&](int64_t k, Op op) {
    const auto [chunk, mb] = chunk_mb(k, op == Op::Forward);
    return Action{chunk * p + r, op, mb};
  };
  std::vector<Action> out;
  const int64_t warmup = std::min(total, 2 * (p - 1 - r) + (v - 1) * p);
  int64_t f = 0, b = 0;
  while (f < warmup) out.push_back(act(f++, Op::Forward));
  while (b < total) {
    if (f < total) out.push_back(act(f++, Op::Forward));
    out.push_back(act(b++, Op::Backward));
  }
  return out;
}

// Whether `a` can run once `done` holds what has finished: its input from the previous stage (F), its
// output's gradient from the next (B, I), its own forward (B, I) or input gradient (W).
bool ready(const Action& a, int64_t stages, const std::map<Key, double>& done, bool split) {
  const Op backward = split ? Op::BackwardInput : Op::Backward;
  switch (a.op) {
    case Op::Forward:
      return a.stage == 0 || done.count(key(a.stage - 1, Op::Forward, a.microbatch));
    case Op::Backward:
    case Op::BackwardInput:
      return done.count(key(a.stage, Op::Forward, a.microbatch)) &&
             (a.stage == stages - 1 || done.count(key(a.stage + 1, backward, a.microbatch)));
    case Op::BackwardWeight:
      return done.count(key(a.stage, Op::BackwardInput, a.microbatch));
  }
  return false;
}

// When `a`'s inputs are on its rank: the producers' ends, plus p2p when they ran on another rank.
double arrival(const Action& a, const Schedule& s, const std::map<Key, double>& done, const Costs& c, bool split) {
  auto from = [&](int64_t stage, Op op) {
    const double end = done.at(key(stage, op, a.microbatch));
    return end + (s.rank_of(stage) == s.rank_of(a.stage) ? 0 : c.p2p);
  };
  const Op backward = split ? Op::BackwardInput : Op::Backward;
  double t = 0;
  if (a.op == Op::Forward && a.stage > 0) t = from(a.stage - 1, Op::Forward);
  if ((a.op == Op::Backward || a.op == Op::BackwardInput) && a.stage < s.stages() - 1) t = from(a.stage + 1, backward);
  if (a.op == Op::Backward || a.op == Op::BackwardInput) t = std::max(t, done.at(key(a.stage, Op::Forward, a.microbatch)));
  if (a.op == Op::BackwardWeight) t = done.at(key(a.stage, Op::BackwardInput, a.microbatch));
  return t;
}

double cost(Op op, const Costs& c) {
  switch (op) {
    case Op::Forward: return c.forward;
    case Op::Backward: return c.backward_input + c.backward_weight;
    case Op::BackwardInput: return c.backward_input;
    case Op::BackwardWeight: return c.backward_weight;
  }
  return 0;
}

// zb-1p (Qi et al. 2023's ZB-H1; torch's ScheduleInterleavedZeroBubble, "ZB1P", whose table this is):
// 1F1B with each backward split into I and W. Rank r first runs (v-1) rounds of forwards plus p-1-r,
// then in turn a forward, an I and, from its (r+1)-th I on, the W of its oldest I; the last Ws at the end.
// Micro-batches go through the v stages of a rank in rounds of m / max(1, m/p). The later ranks pass
// input gradients back sooner and the earlier ones fill their waits with weight gradients: on equal F, I
// and W times the bubble is (p-1)/3vm, a third of (interleaved) 1F1B's, and every rank holds at most pv
// micro-batch stages (p stages' worth, 1F1B's first stage) until their W.
std::vector<Action> zero_bubble(int64_t r, int64_t p, int64_t m, int64_t v) {
  const int64_t per_round = m / std::max<int64_t>(1, m / p), total = v * m;
  const int64_t warmup = std::min(total, (v - 1) * per_round + p - 1 - r);
  const auto forward_stage = [&](int64_t k) { return (k / per_round) % v * p + r; };
  const auto backward_stage = [&](int64_t k) { return (v - 1 - (k - warmup) / per_round % v) * p + r; };
  std::map<int64_t, int64_t> next_f, next_i, next_w;  // per stage, its next micro-batch
  std::vector<int64_t> backwards;                      // the k of each I, in order: whose W comes next
  std::vector<Action> out;
  size_t w = 0;
  const auto push_weight = [&] {
    const int64_t s = backward_stage(backwards[w++]);
    out.push_back({s, Op::BackwardWeight, next_w[s]++});
  };
  for (int64_t k = 0; k < total + warmup; ++k) {
    if (k < total) {
      const int64_t s = forward_stage(k);
      out.push_back({s, Op::Forward, next_f[s]++});
    }
    if (k < warmup) continue;
    const int64_t s = backward_stage(k);
    out.push_back({s, Op::BackwardInput, next_i[s]++});
    backwards.push_back(k);
    if (k - warmup >= r) push_weight();
  }
  while (w < backwards.size()) push_weight();
  return out;
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::Forward: return "F";
    case Op::Backward: return "B";
    case Op::BackwardInput: return "I";
    case Op::BackwardWeight: return "W";
  }
  return "?";
}

std::string format_actions(const std::vector<Action>& actions) {
  std::string out;
  for (const Action& a : actions)
    out += (out.empty() ? "" : " ") + std::to_string(a.stage) + op_name(a.op) + std::to_string(a.microbatch);
  return out;
}

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names = {"gpipe", "1f1b", "interleaved-1f1b", "zb-1p"};
  return names;
}

int64_t default_stages_per_rank(const std::string& name) { return name == "interleaved-1f1b" ? 2 : 1; }

int64_t default_microbatches(const std::string&, int64_t ranks) { return 2 * ranks; }

Schedule make_schedule(const std::string& name, int64_t p, int64_t m, int64_t v) {
  const auto n = [](int64_t x) { return std::to_string(x); };
  if (std::find(schedule_names().begin(), schedule_names().end(), name) == schedule_names().end())
    throw UsageError("pp_schedule '" + name + "': expected gpipe, 1f1b, interleaved-1f1b or zb-1p");
  if (p < 1 || m < 1 || v < 1) throw UsageError("a pipeline needs at least one rank, micro-batch and stage per rank");
  if (name == "interleaved-1f1b" && v < 2) throw UsageError("interleaved-1f1b runs several stages per rank: pp_virtual must be at least 2");
  if (v > 1 && name != "interleaved-1f1b" && name != "zb-1p")
    throw UsageError(name + " runs one stage per rank: pp_virtual " + n(v) + " needs interleaved-1f1b or zb-1p");
  if (v > 1 && m % p != 0)
    throw UsageError(name + " with several stages per rank takes micro-batches in groups of pp: pp_microbatches " + n(m) +
                     " is not a multiple of pp " + n(p));
  Schedule s{name, p, v, m, {}, {}};
  for (int64_t r = 0; r < p; ++r)
    s.actions.push_back(name == "gpipe"  ? gpipe(r, m)
                        : name == "1f1b" ? one_f_one_b(r, p, m)
                        : name == "zb-1p" ? zero_bubble(r, p, m, v)
                                         : interleaved(r, p, m, v));
  return s;
}

std::vector<std::pair<int64_t, int64_t>> stage_layers(int64_t layers, int64_t stages, const std::vector<int64_t>& split) {
  const auto n = [](int64_t x) { return std::to_string(x); };
  if (stages < 1 || layers < stages) throw UsageError(n(stages) + " pipeline stages are more than the " + n(layers) + " layers");
  std::vector<int64_t> count = split;
  if (!split.empty()) {
    int64_t sum = 0;
    for (int64_t c : split) sum += c;
    if (static_cast<int64_t>(split.size()) != stages || sum != layers ||
        std::any_of(split.begin(), split.end(), [](int64_t c) { return c < 1; }))
      throw UsageError("pp_split: " + n(static_cast<int64_t>(split.size())) + " counts adding up to " + n(sum) + "; expected one count >= 1 for each of the " +
                       n(stages) + " stages, adding up to the " + n(layers) + " layers");
  } else {
    const int64_t base = (layers + stages - 1) / stages;
    count.assign(static_cast<size_t>(stages), base);
    for (int64_t k = 0, short_by = base * stages - layers; k < short_by; ++k)
      --count[static_cast<size_t>(k % 2 == 0 ? stages - 1 - k / 2 : k / 2)];
  }
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t first = 0;
  for (int64_t c : count) out.emplace_back(first, first + c), first += c;
  return out;
}

Replay replay(const Schedule& s, const Costs& c) {
  const auto P = static_cast<size_t>(s.ranks);
  const bool split = s.name == "zb-1p";
  Replay out;
  out.peak_in_flight.assign(P, 0);
  out.start.assign(P, {});
  std::map<Key, double> done;
  std::vector<size_t> next(P, 0);
  std::vector<double> free(P, 0), busy(P, 0);
  std::vector<int64_t> held(P, 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (size_t r = 0; r < P; ++r) {
      while (next[r] < s.actions[r].size() && ready(s.actions[r][next[r]], s.stages(), done, split)) {
        const Action& a = s.actions[r][next[r]++];
        const double t = std::max(free[r], arrival(a, s, done, c, split));
        out.start[r].push_back(t);
        done[key(a.stage, a.op, a.microbatch)] = free[r] = t + cost(a.op, c);
        busy[r] += cost(a.op, c);
        if (a.op == Op::Forward) out.peak_in_flight[r] = std::max(out.peak_in_flight[r], ++held[r]);
        if (a.op == Op::Backward || a.op == Op::BackwardWeight) --held[r];
        moved = true;
      }
    }
  }
  std::string stuck;
  for (size_t r = 0; r < P; ++r)
    if (next[r] < s.actions[r].size()) {
      const Action& a = s.actions[r][next[r]];
      stuck += (stuck.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + " at " + op_name(a.op) +
               std::to_string(a.microbatch) + " of stage " + std::to_string(a.stage);
    }
  if (!stuck.empty()) throw std::runtime_error("pipeline schedule " + s.name + " deadlocks: " + stuck);
  out.makespan = *std::max_element(free.begin(), free.end());
  out.busy = *std::max_element(busy.begin(), busy.end());
  return out;
}

namespace {

// The rank an action receives from and the producer it receives (none: -1), and the rank it sends to.
struct Transfer {
  int64_t from = -1, to = -1;
  Key producer;
};
Transfer transfer_of(const Action& a, const Schedule& s, bool split) {
  Transfer t;
  const int64_t me = s.rank_of(a.stage), last = s.stages() - 1;
  const Op backward = split ? Op::BackwardInput : Op::Backward;
  if (a.op == Op::Forward) {
    if (a.stage > 0 && s.rank_of(a.stage - 1) != me) t.from = s.rank_of(a.stage - 1), t.producer = key(a.stage - 1, Op::Forward, a.microbatch);
    if (a.stage < last && s.rank_of(a.stage + 1) != me) t.to = s.rank_of(a.stage + 1);
  } else if (a.op == backward) {
    if (a.stage < last && s.rank_of(a.stage + 1) != me) t.from = s.rank_of(a.stage + 1), t.producer = key(a.stage + 1, backward, a.microbatch);
    if (a.stage > 0 && s.rank_of(a.stage - 1) != me) t.to = s.rank_of(a.stage - 1);
  }
  return t;
}

}  // namespace

std::vector<std::vector<int64_t>> send_release(const Schedule& s) {
  const auto P = static_cast<size_t>(s.ranks);
  const bool split = s.name == "zb-1p";
  // Vector clocks in the order the replay runs the actions: clock[r][k][q] = how many of rank q's
  // actions happened before rank r's action k ended.
  std::vector<std::vector<std::vector<int64_t>>> clock(P);
  std::map<Key, std::pair<size_t, size_t>> at;  // a finished action's rank and index
  std::map<Key, double> done;
  std::vector<size_t> next(P, 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (size_t r = 0; r < P; ++r)
      while (next[r] < s.actions[r].size() && ready(s.actions[r][next[r]], s.stages(), done, split)) {
        const Action& a = s.actions[r][next[r]];
        std::vector<int64_t> c = next[r] ? clock[r].back() : std::vector<int64_t>(P, 0);
        if (const Transfer t = transfer_of(a, s, split); t.from >= 0) {
          const auto [q, i] = at.at(t.producer);
          for (size_t x = 0; x < P; ++x) c[x] = std::max(c[x], clock[q][i][x]);
        }
        c[r] = static_cast<int64_t>(++next[r]);
        clock[r].push_back(c);
        const Key k = key(a.stage, a.op, a.microbatch);
        at[k] = {r, next[r] - 1};
        done[k] = 0;
        moved = true;
      }
  }
  replay(s, {});  // a deadlocking table: its one-line error
  std::vector<std::vector<int64_t>> out(P);
  const Op backward = split ? Op::BackwardInput : Op::Backward;
  for (size_t r = 0; r < P; ++r) {
    const auto n = static_cast<int64_t>(s.actions[r].size());
    for (int64_t i = 0; i < n; ++i) {
      const Action& a = s.actions[r][static_cast<size_t>(i)];
      const Transfer t = transfer_of(a, s, split);
      if (t.to < 0) {
        out[r].push_back(-1);
        continue;
      }
      // The receiving action: the next stage's forward, or the previous stage's backward.
      const Key receiver = a.op == Op::Forward ? key(a.stage + 1, Op::Forward, a.microbatch) : key(a.stage - 1, backward, a.microbatch);
      const int64_t received = static_cast<int64_t>(at.at(receiver).second) + 1;
      int64_t k = i + 1;
      while (k < n && clock[r][static_cast<size_t>(k)][static_cast<size_t>(t.to)] < received) ++k;
      out[r].push_back(k);
    }
  }
  return out;
}

}  // namespace trainscope::pipeline
