#include "runners/commands/suite_run.hpp"

#include <sys/stat.h>

#include <chrono>
#include <optional>
#include <cmath>
#include <cstdio>
#include <algorithm>
#include <filesystem>
#include <map>

#include "core/errors.hpp"
#include "core/units.hpp"
#include "probes/device/env.hpp"
#include "probes/trace/trace.hpp"
#include "reports/render/render.hpp"
#include "reports/report.hpp"
#include "runners/process/cell.hpp"
#include "runners/process/folder_lock.hpp"
#include "runners/commands/frontier.hpp"
#include "runners/process/isolation.hpp"
#include "runners/process/launch.hpp"
#include "suites/suite_file.hpp"
#include "suites/train.hpp"

namespace trainscope::runners {
namespace fs = std::filesystem;
namespace {

std::string file_stem(const std::string& cell_name) {
  std::string s = cell_name;
  for (char& ch : s)
    if (ch == '/' || ch == ' ' || ch == '=') ch = '_';
  return s;
}

// A previous result of the same cell and configuration that finished (for --resume).
bool reusable(const std::string& path, const json& config, json& cell) {
  if (!fs::exists(path)) return false;
  try {
    cell = reports::read_json_file(path);
  } catch (const UsageError&) {
    return false;
  }
  return cell.value("config", json()) == config && cell.value("status", "") != "failed" &&
         cell.value("status", "") != "timeout";
}

// Whether a cell's process may be a fork of this one rather than a fresh start of the binary (see
// InProcess, runners/process/isolation.hpp). Not where LibTorch sees a GPU: CUDA cannot be used in a
// child forked after its parent initialised it (resolving device `auto` does). TRAINSCOPE_CELL_EXEC=1
// starts every cell afresh, as on a GPU machine. This process ran no tensor work before (an OpenMP team
// made here would hang a forked child's first parallel region).
bool cells_may_fork() {
  static const bool may = [] {
    const char* exec = std::getenv("TRAINSCOPE_CELL_EXEC");
    return !(exec && *exec && std::string(exec) != "0") && !torch::cuda::is_available();
  }();
  return may;
}

// Runs one cell in a child process and returns its result, whatever happened to the process.
json run_isolated(const std::string& name, const json& config, const std::string& device, const std::string& stem,
                  double timeout_s) {
  reports::write_json_atomic(stem + ".spec.json", {{"name", name}, {"config", config}, {"device", device}});
  fs::remove(stem + ".json");
  InProcess in_process;
  if (cells_may_fork()) in_process = [stem] { return cell_main(stem + ".spec.json", stem + ".json"); };
  const ChildOutcome r = run_child({self_exe(), "_cell", "--spec", stem + ".spec.json", "--result", stem + ".json"},
                                   stem + ".log", timeout_s, in_process);
  json cell;
  if (r.kind == ChildOutcome::Kind::Exited && fs::exists(stem + ".json")) {
    cell = reports::read_json_file(stem + ".json");
  } else {
    const std::string status = r.kind == ChildOutcome::Kind::TimedOut ? "timeout" : "failed";
    std::string reason = describe(r, timeout_s);
    const std::string said = last_line(stem + ".log");
    if (!said.empty() && r.kind != ChildOutcome::Kind::TimedOut) reason += ": " + said;
    cell = cell_without_metrics(name, config, device, status, reason);
    reports::write_json_atomic(stem + ".json", cell);
  }
  cell["wall_s"] = r.wall_s;
  cell["log"] = fs::path(stem + ".log").filename().string();
  return cell;
}

// A failed rank's story: how its process ended, and what its result or its log said.
std::string rank_failure(const ChildOutcome& o, double timeout_s, const std::string& result, const std::string& log) {
  std::string why = describe(o, timeout_s);
  if (o.kind == ChildOutcome::Kind::TimedOut || o.kind == ChildOutcome::Kind::Stopped) return why;
  std::string said;
  if (fs::exists(result)) {
    try {
      said = reports::read_json_file(result).value("reason", "");
    } catch (const std::exception&) {
    }
  }
  if (said.empty()) said = last_line(log);
  return said.empty() ? why : why + ": " + said;
}

// How long past its collective timeout a launched rank may take to report its outcome to rank 0: its
// cell process ends within the timeout, then writes its result and exits.
constexpr double kOutcomeGrace_s = 10;

// One rank's outcome as the cell reports it: its status, whether a signal ended it, when its error came
// (failed_at, from its result file) and why.
json rank_outcome(const ChildOutcome& o, int rank, double timeout_s, const std::string& result, const std::string& log) {
  const bool ok = o.kind == ChildOutcome::Kind::Exited && o.exit_code == 0;
  std::string status = o.kind == ChildOutcome::Kind::TimedOut ? "timeout" : ok ? "ok" : "failed";
  if (o.kind == ChildOutcome::Kind::Exited && o.exit_code == kRankOom) status = "oom";
  if (o.kind == ChildOutcome::Kind::Stopped) status = "stopped";
  json failed_at = nullptr;
  if (!ok && fs::exists(result)) {
    try {
      failed_at = reports::read_json_file(result).value("failed_at", json(nullptr));
    } catch (const std::exception&) {
    }
  }
  return {{"rank", rank}, {"ok", ok}, {"status", status}, {"signaled", o.kind == ChildOutcome::Kind::Signaled},
          {"failed_at", failed_at}, {"reason", ok ? "" : rank_failure(o, timeout_s, result, log)}, {"wall_s", o.wall_s}};
}

// Under an external launcher, rank 0's process collects the other ranks' outcomes from the store, all
// within one deadline (a lost node's ranks are waited for once, not one after the other). A rank whose
// `trainscope run` died or hangs sent none: the cell says so and the suite goes on. Returns the nodes
// whose ranks went silent, with those ranks.
json collect_outcomes(std::vector<json>& outcomes, RendezvousStore& store, const std::string& prefix, int world,
                      double collective_timeout) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(collective_timeout + kOutcomeGrace_s);
  const auto left = [&deadline] {
    return std::max(1.0, std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count());
  };
  std::map<std::string, std::vector<int>> silent;  // host -> ranks that sent no outcome
  for (int r = 1; r < world; ++r) {
    try {
      outcomes.push_back(json::parse(store.get(prefix + "outcome/" + std::to_string(r), left())));
    } catch (const std::exception& e) {
      std::string host = "?";
      try {
        host = store.get(prefix + "host/" + std::to_string(r), 1.0);
      } catch (const std::exception&) {
      }
      silent[host].push_back(r);
      outcomes.push_back({{"rank", r}, {"ok", false}, {"status", "failed"}, {"signaled", false}, {"failed_at", nullptr},
                          {"wall_s", nullptr}, {"host", host}, {"reason", std::string("sent no outcome: ") + e.what()}});
    }
  }
  json lost_nodes = json::array();
  for (const auto& [host, ranks] : silent) lost_nodes.push_back({{"host", host}, {"ranks", ranks}});
  return lost_nodes;
}

// The cause among the failed ranks: one killed by a signal, else the one whose error came first (the
// others fail on the connection it broke), else the first seen. Null when none failed.
const json* culprit_of(const std::vector<json>& outcomes) {
  const json* culprit = nullptr;
  auto when = [](const json& o) { return o["failed_at"].is_number() ? o["failed_at"].get<double>() : 1e300; };
  for (const auto& o : outcomes) {
    if (o["status"] != "failed" && o["status"] != "oom") continue;
    if (!culprit || (o["signaled"].get<bool>() && !(*culprit)["signaled"].get<bool>()) ||
        (o["signaled"] == (*culprit)["signaled"] && when(o) < when(*culprit)))
      culprit = &o;
  }
  return culprit;
}

// Why a multi-rank cell failed, in one line: a lost node first (the cause the others' connection errors
// point at), then the culprit rank, then the ranks that had not failed and were stopped.
std::string failure_reason(const json& culprit, const std::vector<json>& outcomes, const json& lost_nodes, int world,
                           double collective_timeout) {
  std::string reason = "rank " + std::to_string(culprit["rank"].get<int>()) + " " + culprit["reason"].get<std::string>() +
                       " (world of " + std::to_string(world) + ")";
  std::string stopped;
  for (const auto& o : outcomes)
    if (o["status"] == "stopped") stopped += (stopped.empty() ? "" : ", ") + std::to_string(o["rank"].get<int>());
  if (!stopped.empty()) reason += "; rank(s) " + stopped + " had not failed and were stopped (a rank that hangs looks like this)";
  std::string lost;
  for (const auto& n : lost_nodes) {
    std::string list;
    for (const auto& r : n["ranks"]) list += (list.empty() ? "" : ", ") + std::to_string(r.get<int>());
    lost += (lost.empty() ? "" : "; ") + std::string("node ") + n["host"].get<std::string>() + " (rank" +
            (n["ranks"].size() > 1 ? "s " : " ") + list + ") sent no outcome within " +
            format_fixed(collective_timeout + kOutcomeGrace_s, 0) + " s: the node or its launcher was lost";
  }
  return lost.empty() ? reason : lost + "; " + reason;
}

// The ranks of a multi-rank cell that this process runs: all of them (local launch) or its own
// (external launch). Returns the cell on the process that holds rank 0, this rank's outcome elsewhere.
json run_ranks(const std::string& name, const json& config, const std::string& device, const std::string& stem,
               double timeout_s, const Launch& launch, RendezvousStore& store, const std::string& prefix) {
  const int world = config["world_size"].get<int>();
  const double collective_timeout = config["collective_timeout_s"].get<double>();
  std::vector<int> mine;
  if (launch.external())
    mine.push_back(launch.rank);
  else
    for (int r = 0; r < world; ++r) mine.push_back(r);
  auto rank_file = [&](int r, const char* ext) { return stem + ".rank" + std::to_string(r) + ext; };
  const std::string spec = launch.external() ? rank_file(launch.rank, ".spec.json") : stem + ".spec.json";
  reports::write_json_atomic(spec, {{"name", name}, {"config", config}, {"device", device}});
  const std::string where = store.host() + ":" + std::to_string(store.port());
  std::vector<std::vector<std::string>> argvs;
  std::vector<std::string> logs;
  std::vector<InProcess> in_process;
  for (int r : mine) {
    fs::remove(rank_file(r, ".json"));
    const CellRank rk{r, world, launch.external() ? launch.local_rank : r,
                      launch.external() ? launch.local_world_size : world, store.host(), store.port(), prefix};
    argvs.push_back({self_exe(), "_cell", "--spec", spec, "--result", rank_file(r, ".json"), "--rank", std::to_string(r),
                     "--world", std::to_string(world), "--local-rank", std::to_string(rk.local_rank), "--local-world",
                     std::to_string(rk.local_world), "--store", where, "--prefix", prefix});
    logs.push_back(rank_file(r, ".log"));
    if (cells_may_fork()) in_process.push_back([spec, result = rank_file(r, ".json"), rk] { return cell_main(spec, result, rk); });
  }
  // Under a launcher each rank says where it runs before it starts, so that rank 0 can name the node of
  // ranks that never report back (a node lost mid-step).
  if (launch.external()) store.set(prefix + "host/" + std::to_string(launch.rank), host_name());
  const GroupOutcome g = run_children(argvs, logs, timeout_s, 1.0, in_process);

  // Every rank's outcome; under an external launcher they meet in the store, where rank 0's process
  // collects them.
  std::vector<json> outcomes;
  for (size_t i = 0; i < mine.size(); ++i)
    outcomes.push_back(rank_outcome(g.children[i], mine[i], timeout_s, rank_file(mine[i], ".json"), logs[i]));
  json lost_nodes = json::array();  // hosts whose ranks all went silent under a launcher
  if (launch.external()) {
    store.set(prefix + "outcome/" + std::to_string(launch.rank), outcomes[0].dump());
    if (launch.rank != 0)  // this rank's own outcome; rank 0's process builds the cell
      return json{{"status", outcomes[0]["status"]}, {"reason", outcomes[0]["reason"]}, {"wall_s", g.wall_s}};
    lost_nodes = collect_outcomes(outcomes, store, prefix, world, collective_timeout);
  }

  const json* culprit = culprit_of(outcomes);
  const bool timed_out = std::any_of(outcomes.begin(), outcomes.end(), [](const json& o) { return o["status"] == "timeout"; });
  json cell;
  if (!culprit && !timed_out && fs::exists(rank_file(0, ".json"))) {
    cell = reports::read_json_file(rank_file(0, ".json"));
  } else if (culprit) {
    cell = cell_without_metrics(name, config, device, (*culprit)["status"].get<std::string>(),
                                failure_reason(*culprit, outcomes, lost_nodes, world, collective_timeout));
    if (!lost_nodes.empty()) cell["lost_nodes"] = lost_nodes;
  } else {
    cell = cell_without_metrics(name, config, device, "timeout",
                                describe(ChildOutcome{ChildOutcome::Kind::TimedOut}, timeout_s) + " (" + std::to_string(world) + " ranks)");
  }
  cell["rank_outcomes"] = outcomes;
  cell["wall_s"] = g.wall_s;
  cell["log"] = fs::path(rank_file(0, ".log")).filename().string();
  reports::write_json_atomic(stem + ".json", cell);
  return cell;
}

// The cell's timeline: its ranks' trace files (the first repetition's) merged into traces/<cell>.json.
void write_cell_trace(const std::string& out, const std::string& stem, int world) {
  std::vector<std::string> files;
  if (world > 1)
    for (int r = 0; r < world; ++r) files.push_back(trace_path(stem + ".rank" + std::to_string(r) + ".json"));
  else
    files.push_back(trace_path(stem + ".json"));
  fs::create_directories(out + "/traces");
  probes::merge_traces(files, out + "/traces/" + fs::path(stem).filename().string() + ".json");
}

// N runs of one cell (each in its own process) as one cell: a run that did not end ok stands for the
// cell; otherwise the run with the median step time does, with every run's figures in `repetitions`.
json merge_repetitions(std::vector<json> runs) {
  if (runs.size() == 1) return runs[0];
  double wall = 0;
  for (const auto& r : runs) wall += r.value("wall_s", 0.0);
  json reps{{"count", runs.size()}};
  json p50 = json::array(), rate = json::array(), peak = json::array(), status = json::array();
  for (const auto& r : runs) {
    p50.push_back(reports::value_at(r, {"metrics", "timing", "step_time_s", "p50"}));
    rate.push_back(reports::value_at(r, {"metrics", "timing", "samples_per_s"}));
    peak.push_back(reports::value_at(r, {"metrics", "memory", "peak_bytes"}));
    status.push_back(r.value("status", "failed"));
  }
  reps["status"] = status;
  reps["step_time_p50_s"] = p50;
  reps["samples_per_s"] = rate;
  reps["peak_bytes"] = peak;
  size_t pick = 0;
  for (size_t i = 0; i < runs.size(); ++i)
    if (runs[i].value("status", "") != "ok") {
      pick = i;
      break;
    }
  if (runs[pick].value("status", "") == "ok") {
    // The median run: its figures are the cell's; the spread says how far the runs are apart.
    std::vector<std::pair<double, size_t>> order;
    for (size_t i = 0; i < runs.size(); ++i) order.emplace_back(p50[i].is_number() ? p50[i].get<double>() : INFINITY, i);
    std::sort(order.begin(), order.end());
    pick = order[order.size() / 2].second;
    const double lo = order.front().first, hi = order.back().first, mid = order[order.size() / 2].first;
    reps["median_step_time_p50_s"] = mid;
    reps["spread"] = mid > 0 && std::isfinite(hi) ? json((hi - lo) / mid) : json(nullptr);
  }
  reps["representative"] = pick;
  json cell = runs[pick];
  cell["repetitions"] = reps;
  cell["wall_s"] = wall;
  return cell;
}

// Why this launch cannot run a cell's ranks ("" when it can).
std::string launch_reason(const RunConfig& c, const std::optional<Launch>& external, int nproc) {
  if (external) {
    if (c.world_size != external->world_size)
      return "this " + external->source + " launch has " + std::to_string(external->world_size) +
             " ranks; the cell wants world_size " + std::to_string(c.world_size) + " (--set world_size=" +
             std::to_string(external->world_size) + " runs it here)";
    return "";
  }
  if (c.world_size > nproc)
    return "needs " + std::to_string(c.world_size) + " ranks: run with --nproc " + std::to_string(c.world_size) +
           " or more, or under torchrun / srun / mpirun";
  return "";
}

// The frontier: for each distinct configuration (batch size aside) of the chosen models, the largest
// batch that trains under the budget, each try a short run in its own process(es). A multi-rank
// configuration tries with all its ranks (each under the budget, as each GPU has its own memory): a
// batch fits when every rank ends ok, and the peak that counts is the largest rank's.
json run_frontier(const json& spec, const std::vector<suites::Cell>& cells, const std::string& budget,
                  const std::string& out, const std::optional<Launch>& external, int nproc, const Launch& launch,
                  RendezvousStore& store) {
  json results = json::array();
  std::vector<json> seen;
  fs::create_directories(out + "/frontier");
  for (const auto& c : cells) {
    const json& models = spec["models"];
    if (!models.empty() && std::find(models.begin(), models.end(), json(c.config.model)) == models.end()) continue;
    const json names = spec.value("cells", json::array());
    if (!names.empty() && std::find(names.begin(), names.end(), json(c.name)) == names.end()) continue;
    RunConfig base = c.config;
    base.batch_size = 1;
    base.steps = spec["steps"];
    base.warmup_steps = 1;
    base.eval = false;
    base.overflow_every = 0;
    base.memory_budget = budget;
    if (std::find(seen.begin(), seen.end(), base.to_json()) != seen.end()) continue;
    seen.push_back(base.to_json());
    const std::string device = suites::resolve_device(base.device);
    const int world = static_cast<int>(base.world_size);
    const std::string label = reports::frontier_label(base.to_json());
    if (!suites::unsupported_reason(base, device).empty() || interrupted()) continue;
    // Under an external launcher every rank would have to walk the same search; its ranks run the
    // suite's cells only.
    const std::string why = world == 1 ? ""
                            : external ? "the multi-rank frontier runs local ranks only (not under " + external->source + ")"
                                       : world > nproc ? launch_reason(base, std::nullopt, nproc) : "";
    if (!why.empty()) {
      std::printf("frontier %s: skipped (%s)\n", label.c_str(), why.c_str());
      continue;
    }
    std::printf("frontier %s under %s: ", label.c_str(), budget.c_str());
    std::fflush(stdout);
    std::map<int64_t, json> tried;
    std::string error;
    const FrontierResult f = frontier_search(
        [&](int64_t bs) {
          if (!error.empty() || interrupted()) return false;
          RunConfig cfg = base;
          cfg.batch_size = bs;
          const std::string name = label + "/bs" + std::to_string(bs);
          const std::string stem = out + "/frontier/" + file_stem(label) + "_bs" + std::to_string(bs);
          json cell;
          if (world > 1) {
            try {
              cell = run_ranks(name, cfg.to_json(), device, stem, cfg.timeout_s, launch, store,
                               "trainscope/frontier/" + std::to_string(results.size()) + "/bs" + std::to_string(bs) + "/");
            } catch (const std::exception& e) {
              const std::string what = e.what();
              cell = cell_without_metrics(name, cfg.to_json(), device, "failed", what.substr(0, what.find('\n')));
            }
          } else {
            cell = run_isolated(name, cfg.to_json(), device, stem, cfg.timeout_s);
          }
          const std::string status = cell["status"];
          std::printf("%lld:%s ", static_cast<long long>(bs), status.c_str());
          std::fflush(stdout);
          if (status != "ok" && status != "oom") error = "batch " + std::to_string(bs) + " " + status + ": " + cell.value("reason", "");
          tried[bs] = cell;
          return status == "ok";
        },
        spec["start"], spec["limit"]);
    json entry{{"model", base.model}, {"precision", base.precision}, {"checkpoint", base.checkpoint},
               {"parallel", base.parallel}, {"world_size", world},
               {"budget", budget}, {"largest_batch", f.largest_fit},
               {"first_failing_batch", f.first_fail > 0 ? json(f.first_fail) : json(nullptr)}};
    json tries = json::array();
    for (const auto& [bs, ok] : f.tries) tries.push_back({bs, tried[bs]["status"]});
    entry["tries"] = tries;
    entry["samples_per_s"] = nullptr;
    entry["step_time_s"] = nullptr;
    entry["peak_bytes"] = nullptr;
    entry["peak_rank"] = nullptr;
    if (f.largest_fit > 0) {
      const json& fit = tried[f.largest_fit];
      const json& m = fit["metrics"];
      entry["samples_per_s"] = m["timing"]["samples_per_s"];
      entry["step_time_s"] = reports::value_at(m, {"timing", "step_time_s", "p50"});
      entry["peak_bytes"] = m["memory"]["peak_bytes"];
      entry["peak_rank"] = 0;
      for (const auto& r : fit.value("ranks", json::array()))  // the largest rank's peak
        if (r["peak_bytes"].is_number() &&
            (!entry["peak_bytes"].is_number() || r["peak_bytes"].get<double>() > entry["peak_bytes"].get<double>())) {
          entry["peak_bytes"] = r["peak_bytes"];
          entry["peak_rank"] = r["rank"];
        }
    }
    if (!error.empty()) entry["error"] = error;
    std::printf("-> %lld\n", static_cast<long long>(f.largest_fit));
    results.push_back(entry);
  }
  return results;
}

}  // namespace

int trace_command(const std::string& dir) {
  const json report = reports::read_report(dir);
  const std::string out = fs::is_directory(dir) ? dir : fs::path(dir).parent_path().string();
  int written = 0;
  for (const auto& c : report["cells"]) {
    const std::string stem = out + "/cells/" + file_stem(c["name"]);
    const int world = c["config"].value("world_size", 1);
    const bool any = fs::exists(trace_path(stem + ".json")) || fs::exists(trace_path(stem + ".rank0.json"));
    if (!any) continue;
    write_cell_trace(out, stem, world);
    std::printf("%s/traces/%s.json\n", out.c_str(), file_stem(c["name"]).c_str());
    ++written;
  }
  if (written == 0) throw UsageError(dir + ": no cell has a timeline (run with --trace)");
  return 0;
}

namespace {

// The suite as asked for: overrides applied, cells expanded and filtered, the device checked; an empty
// selection, a frontier naming a missing cell or a device that is not here is an error before anything runs.
std::vector<suites::Cell> prepare_suite(const RunOptions& o, suites::Suite& suite) {
  suite = suites::load_suite(o.suite);
  if (!o.device.empty()) suites::apply_override(suite, "device", o.device);
  if (!o.memory_budget.empty()) suites::apply_override(suite, "memory_budget", o.memory_budget);
  for (const auto& [key, text] : o.sets) suites::apply_override(suite, key, parse_value(key, text));
  if (o.repeat > 0) suite.repeat = o.repeat;
  std::vector<suites::Cell> cells = suites::expand(suite, o.filter);
  if (cells.empty()) throw UsageError("no cell of suite '" + suite.name + "' matches --filter '" + o.filter + "'");
  if (suite.frontier.is_object() && o.filter.empty())
    for (const auto& n : suite.frontier.value("cells", json::array()))
      if (std::none_of(cells.begin(), cells.end(), [&](const suites::Cell& c) { return c.name == n.get<std::string>(); }))
        throw UsageError(suite.source + ": frontier.cells: no cell named '" + n.get<std::string>() + "'");
  // A device asked for by name that is not here is an error before anything runs, not a run whose
  // every cell is skipped (which a CI job would read as a pass).
  if (!o.device.empty() && o.device != "auto" && o.device != "cpu") {
    const std::string why = suites::device_unavailable(suites::resolve_device(o.device));
    if (!why.empty()) throw UsageError("--device " + o.device + ": " + why);
  }
  return cells;
}

// Which incarnation of the ranks this is: torchrun's elastic agent restarts every rank after a
// failure, on the same agent store, where the old incarnation's Gloo addresses are still written.
// TORCHELASTIC_RESTART_COUNT cannot name a fresh key space (it is per agent: an agent restarted by
// another's failure keeps 0), but each restart respawns every rank once, so a counter per rank agrees
// across ranks; its value prefixes the cells' keys.
int64_t launch_incarnation(const std::optional<Launch>& external, RendezvousStore& store) {
  if (!external || external->source != "torchrun") return 1;
  try {
    return store.add("trainscope/incarnation/" + std::to_string(external->rank), 1);
  } catch (const std::exception&) {
    return 1;  // no store (a port taken, rank 0 unreachable): each multi-rank cell fails on it and says why
  }
}

// What every cell of one run shares: where it writes, how its ranks were launched.
struct RunContext {
  std::string out;
  std::optional<Launch> external;
  Launch launch;
  RendezvousStore* store = nullptr;
  int64_t incarnation = 1;
  bool writer = true;  // this process writes the files (not a rank other than 0 of an external launch)
  std::string restart() const { return std::to_string(incarnation); }
};

// One repetition of a cell: its ranks through the rendezvous, or one isolated process.
json run_repetition(const suites::Cell& c, size_t index, int rep, const std::string& device, const std::string& rstem,
                    const RunContext& x) {
  const json config = c.config.to_json();
  if (c.config.world_size <= 1) return run_isolated(c.name, config, device, rstem, c.config.timeout_s);
  const std::string prefix = "trainscope/" + x.restart() + "/cell" + std::to_string(index) + "/rep" + std::to_string(rep) + "/";
  try {
    json run = run_ranks(c.name, config, device, rstem, c.config.timeout_s, x.launch, *x.store, prefix);
    // Ran by ranks torchrun restarted after a failure: the cell says how many times.
    if (x.incarnation > 1) run["launch_restarts"] = x.incarnation - 1;
    return run;
  } catch (const std::exception& e) {
    // The rendezvous itself failed (a port taken, rank 0 unreachable): this cell says so, the report
    // keeps it and the suite goes on.
    const std::string what = e.what();
    json run = cell_without_metrics(c.name, config, device, "failed", what.substr(0, what.find('\n')));
    if (x.writer) reports::write_json_atomic(rstem + ".json", run);
    return run;
  }
}

// Every repetition of a cell, each in its own process (and files of its own; the first keeps the
// cell's stem), merged into the cell's result. `own_failure`: a repetition this process ran failed.
json run_repetitions(const suites::Cell& c, size_t index, int repeat, const std::string& device, const std::string& stem,
                     const RunContext& x, bool& own_failure) {
  std::vector<json> runs;
  for (int rep = 0; rep < repeat && !interrupted(); ++rep) {
    const std::string rstem = rep == 0 ? stem : stem + ".rep" + std::to_string(rep);
    runs.push_back(run_repetition(c, index, rep, device, rstem, x));
    const std::string status = runs.back().value("status", "");
    own_failure = own_failure || status == "failed" || status == "timeout";
    if (repeat > 1) {
      std::printf("%s%s", rep == 0 ? "" : " ", runs.back().value("status", "?").c_str());
      std::fflush(stdout);
    }
  }
  if (repeat > 1) std::printf(" -> ");
  json cell = merge_repetitions(runs);
  if (x.writer && repeat > 1) {
    // The first run's own result keeps its name with .rep0; the cell's file becomes the merged one.
    if (fs::exists(stem + ".json")) fs::copy_file(stem + ".json", stem + ".rep0.json", fs::copy_options::overwrite_existing);
    reports::write_json_atomic(stem + ".json", cell);
  }
  return cell;
}

// One cell: skipped (and why), taken from the previous run (--resume), or run. `ran`: it was run here.
json run_cell(const suites::Cell& c, size_t index, const RunOptions& o, int repeat, const RunContext& x, bool& own_failure,
              std::string& note, bool& ran) {
  const std::string device = suites::resolve_device(c.config.device);
  const json config = c.config.to_json();
  const std::string stem = x.out + "/cells/" + file_stem(c.name);
  std::string why = suites::unsupported_reason(c.config, device);
  if (why.empty() && (c.config.world_size > 1 || x.external)) why = launch_reason(c.config, x.external, o.nproc);
  json cell;
  ran = false;
  if (!why.empty()) {
    cell = cell_without_metrics(c.name, config, device, "skipped", why);
    if (x.writer) reports::write_json_atomic(stem + ".json", cell);
  } else if (o.resume && x.writer && !x.external && reusable(stem + ".json", config, cell)) {
    note = " (from the previous run)";
  } else {
    cell = run_repetitions(c, index, repeat, device, stem, x, own_failure);
    ran = true;
  }
  if (x.writer && c.config.trace && cell.value("status", "") != "skipped")
    write_cell_trace(x.out, stem, static_cast<int>(c.config.world_size));
  return cell;
}

// The line that ends a cell's progress line: its status and time, the run's elapsed time and what is left.
void print_cell_end(const json& cell, const std::string& note, double elapsed, double ran_s, int ran, size_t left) {
  const std::string eta = ran > 0 && left > 0 ? ", ~" + format_seconds(ran_s / ran * static_cast<double>(left)) + " left" : "";
  std::printf("%s%s%s (elapsed %s%s)\n", cell["status"].get<std::string>().c_str(),
              cell.contains("wall_s") ? (" in " + format_seconds(cell["wall_s"].get<double>())).c_str() : "",
              note.c_str(), format_seconds(elapsed).c_str(), eta.c_str());
  if (cell["status"] != "ok" && cell["status"] != "skipped") std::printf("      %s\n", cell["reason"].get<std::string>().c_str());
  std::fflush(stdout);
}

// A rank other than 0 of an external launch, after the last cell. A failed cell fails this rank too, so
// that the launcher sees it (torchrun restarts the ranks only when one of them fails), but only once
// rank 0 has written the report: srun -K1 and torchrun stop every rank when one exits non-zero, and rank
// 0 must not be stopped mid-write.
int follower_exit(const RunContext& x, bool own_failure, const std::string& written_key) {
  std::printf("rank %d: done; rank 0 writes the report\n", x.launch.rank);
  if (interrupted()) return 130;
  if (!own_failure) return 0;
  try {
    x.store->get(written_key, 120);
  } catch (const std::exception&) {
  }
  return 1;
}

// The run's exit status from its report: 1 when a cell failed (other than one its suite expects to go
// wrong) or when every cell was skipped, 0 otherwise.
int run_exit_status(const json& report, const std::vector<json>& results) {
  bool any_ran = false;
  for (const auto& c : results) {
    // A cell its suite expects to go wrong (a pitfall's `wrong` cell, an [expect] entry) shows the
    // mistake: that is its result, not the run's failure.
    if (reports::shown_as_expected(report, c)) continue;
    if (c["status"] != "ok" && c["status"] != "skipped") return 1;
    any_ran = any_ran || c["status"] == "ok";
  }
  if (!any_ran) {
    // Nothing measured is not a pass: a CI job on a machine that lost its GPU must go red.
    std::printf("every cell was skipped: nothing ran (the reasons are in the table)\n");
    return 1;
  }
  return 0;
}

}  // namespace

int run_suite(const RunOptions& o) {
  suites::Suite suite;
  const std::vector<suites::Cell> cells = prepare_suite(o, suite);
  RunContext x;
  x.external = detect_launch(process_env());
  x.launch = x.external ? *x.external : Launch{};
  // Every rank of an external launch names the same folder: rank 0's default, without a clock.
  x.out = !o.out.empty() ? o.out : x.external ? "results/" + x.external->source + "-" + suite.name : "results/" + utc_now(true);
  const std::string& out = x.out;
  fs::create_directories(out + "/cells");
  install_interrupt_handler();
  RendezvousStore store(x.launch);  // served (rank 0) or reached on first use
  x.store = &store;
  x.writer = !x.external || x.external->rank == 0;
  // The writer holds the folder for the whole run: two runs into one folder would mix their reports.
  std::optional<FolderLock> lock;
  if (x.writer) lock.emplace(out);
  if (x.external) std::printf("%s\n", x.external->describe().c_str());
  x.incarnation = launch_incarnation(x.external, store);

  json env = probes::collect_env();
  if (x.external)  // which launcher started the ranks: the report names it beside the nodes they ran on
    env["launch"] = {{"source", x.external->source}, {"world_size", x.external->world_size},
                     {"local_world_size", x.external->local_world_size}, {"restarts", x.incarnation - 1}};
  // A cell's wall time includes its process's start: a fork's few milliseconds or the binary's 0.3-0.4 s.
  env["cell_processes"] = cells_may_fork() ? "forked" : "started";
  for (const auto& w : env["warnings"]) std::fprintf(stderr, "warning: %s\n", w.get<std::string>().c_str());
  const json suite_json = suites::suite_to_json(suite);
  const std::string report_path = out + "/report.json";
  std::printf("trainscope %s: suite %s, %zu cell(s) -> %s\n", env["trainscope"]["version"].get<std::string>().c_str(),
              suite.name.c_str(), cells.size(), report_path.c_str());
  std::fflush(stdout);

  std::vector<json> results;
  bool own_failure = false;  // a cell this rank's process ran failed or timed out
  const std::string written_key = "trainscope/" + x.restart() + "/report-written";
  const auto start = std::chrono::steady_clock::now();
  double ran_s = 0;
  int ran = 0;
  for (size_t i = 0; i < cells.size() && !interrupted(); ++i) {
    const auto& c = cells[i];
    const std::string ranks = c.config.world_size > 1 ? " x " + std::to_string(c.config.world_size) + " ranks" : "";
    std::printf("[%zu/%zu] %s on %s%s ... ", i + 1, cells.size(), c.name.c_str(), suites::resolve_device(c.config.device).c_str(),
                ranks.c_str());
    std::fflush(stdout);
    std::string note;
    bool was_run = false;
    const json cell = run_cell(c, i, o, suite.repeat, x, own_failure, note, was_run);
    if (was_run) {
      ran_s += cell.value("wall_s", 0.0);
      ++ran;
    }
    if (x.writer) {
      results.push_back(cell);
      reports::write_json_atomic(report_path, reports::make_report(env, suite_json, results));
    }
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    print_cell_end(cell, note, elapsed, ran_s, ran, cells.size() - i - 1);
  }
  if (!x.writer) return follower_exit(x, own_failure, written_key);

  json frontier;
  if (!interrupted() && (!suite.frontier.is_null() || o.frontier)) {
    json spec = suite.frontier.is_null() ? json{{"budget", "none"}, {"steps", 3}, {"start", 8}, {"limit", 4096},
                                                {"models", json::array()}}
                                         : suite.frontier;
    const std::string budget = o.memory_budget.empty() ? spec["budget"].get<std::string>() : o.memory_budget;
    if (budget == "none") throw UsageError("the frontier needs a budget: [frontier] budget in the suite, or --memory-budget");
    frontier = run_frontier(spec, cells, budget, out, x.external, o.nproc, x.launch, store);
  }
  const json report = reports::make_report(env, suite_json, results, frontier);
  reports::write_json_atomic(report_path, report);
  reports::write_renderings(report, out);  // report.md and report.html beside it
  if (x.external) {
    try {
      store.set(written_key, "1");  // the other ranks may now exit, failed ones with 1
    } catch (const std::exception&) {
    }
  }
  const std::string summary = reports::render_summary(report);
  std::printf("\n%s\nreport: %s\n", summary.c_str(), report_path.c_str());
  if (interrupted()) {
    std::printf("interrupted: %zu of %zu cells recorded; rerun with --resume --out %s to finish\n",
                results.size(), cells.size(), out.c_str());
    return 130;
  }
  return run_exit_status(report, results);
}

}  // namespace trainscope::runners
