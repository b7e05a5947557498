#include "runners/commands/cli.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>

#include <CLI/CLI.hpp>
#include <torch/cuda.h>

#include "core/build_info.hpp"
#include "core/devices.hpp"
#include "core/units.hpp"
#include "core/errors.hpp"
#include "core/model_shape.hpp"
#include "probes/device/env.hpp"
#include "probes/device/gpu.hpp"
#include "reports/compare.hpp"
#include "reports/render/render.hpp"
#include "reports/report.hpp"
#include "runners/process/cell.hpp"
#include "runners/process/folder_lock.hpp"
#include "runners/process/launch.hpp"
#include "runners/commands/parity.hpp"
#include "runners/commands/ab.hpp"
#include "runners/commands/history.hpp"
#include "runners/commands/plan.hpp"
#include "runners/commands/suite_run.hpp"
#include "suites/models/data.hpp"
#include "suites/hardware/measure.hpp"
#include "suites/suite_file.hpp"
#include "suites/train.hpp"

namespace trainscope::runners {
namespace {

int list_command() {
  std::printf("suites (built in; or pass a .toml file to --suite):\n");
  for (const auto& name : suites::builtin_suite_names()) {
    const suites::Suite s = suites::load_suite(name);
    std::printf("  %-12s %s\n", name.c_str(), s.description.c_str());
    for (const auto& a : s.axes) {
      std::string values;
      for (const auto& v : a.values) values += (values.empty() ? "" : ", ") + (v.is_string() ? v.get<std::string>() : v.dump());
      std::printf("      %-12s %s\n", a.key.c_str(), values.c_str());
    }
  }

  const json gpu = probes::gpu_inventory();
  const bool cuda = torch::cuda::is_available();
  const std::string cuda_note = cuda ? std::to_string(torch::cuda::device_count()) + " GPU(s) visible to LibTorch"
                                     : "no: " + gpu.value("status", std::string("LibTorch sees no GPU"));
  std::printf("\nthis machine:\n  device cpu   yes\n  device cuda  %s\n", cuda_note.c_str());
  std::printf("  fashion-mnist %s\n", suites::fashion_mnist_available()
                                          ? ("yes (" + suites::fashion_mnist_dir() + ")").c_str()
                                          : "no: apt-get install dataset-fashion-mnist");
  // What the ranks would use: the launcher this process runs under, else local processes.
  std::string ranks = "local processes (--nproc N), Gloo";
  try {
    if (const auto l = detect_launch(process_env())) ranks = l->describe();
  } catch (const UsageError& e) {
    ranks = std::string("launcher variables are inconsistent: ") + e.what();
  }
  std::printf("  ranks        %s%s\n", ranks.c_str(), cuda ? "; NCCL on CUDA" : "");

  std::printf("\nmodels (a suite defines its own under [models.NAME]; --set layers=24 overrides a dimension):\n");
  std::printf("  %-12s %-6s %6s %7s %5s %3s %6s %6s %6s %4s %15s %13s %13s  %s\n", "name", "family", "layers", "d_model",
              "heads", "kv", "ffn", "seq", "vocab", "tied", "parameters", "GFLOP/token", "(causal)", "");
  for (const auto& p : suites::model_presets()) {
    int64_t params = analytic_decoder_parameters(p);
    if (params == 0) {  // image models: counted on the built model, for Fashion-MNIST's 1x28x28 and 10 classes
      torch::NoGradGuard no_grad;
      params = suites::make_model(p, suites::DataShape{})->analytic_parameters();
    }
    auto dim = [](int64_t v) { return v > 0 ? std::to_string(v) : std::string("-"); };
    const bool lm = p.language_model();
    auto tflop = [&](FlopConvention c) { return lm ? format_fixed(decoder_flops_per_token(p, c) / 1e9, 3) : std::string("-"); };
    std::printf("  %-12s %-6s %6s %7s %5s %3s %6s %6s %6s %4s %15s %13s %13s  %s\n", p.name.c_str(), p.family.c_str(),
                dim(p.layers).c_str(), dim(p.width).c_str(), dim(p.heads).c_str(), dim(p.kv_heads).c_str(),
                dim(p.ffn).c_str(), dim(lm ? p.seq_len : 0).c_str(), dim(p.vocab).c_str(), lm ? (p.tied ? "yes" : "no") : "-",
                with_thousands(params).c_str(), tflop(FlopConvention::Full).c_str(), tflop(FlopConvention::Causal).c_str(),
                p.summary.c_str());
  }

  std::printf("\nconfiguration keys (suite [base], [axes], [when.*] and --set key=value):\n");
  RunConfig probe;
  for (const auto& k : config_keys()) {
    std::string values;
    if (k.kind == KeyKind::Choice) {
      for (const auto& c : k.choices) {
        probe = RunConfig{};
        std::string note;
        if (k.name == "precision") {
          probe.precision = c;
          const std::string why = suites::unsupported_reason(probe, cuda ? "cuda:0" : "cpu");
          note = why.empty() ? "" : " (not here)";
        }
        values += (values.empty() ? "" : ", ") + c + note;
      }
    } else {
      values = "default " + (k.default_value.is_string() ? k.default_value.get<std::string>() : k.default_value.dump());
    }
    std::printf("  %-13s %s\n  %-13s   %s\n", k.name.c_str(), k.help.c_str(), "", values.c_str());
  }
  return 0;
}

// `trainscope peak`: the achievable GEMM FLOP/s per dtype on one device, as a table and JSON.
int peak_command(const std::string& requested, std::vector<std::string> dtypes, bool thorough, const std::string& out) {
  const std::string device = suites::resolve_device(requested);
  if (const std::string why = suites::device_unavailable(device); !why.empty()) throw UsageError(why);
  if (dtypes.empty()) dtypes = suites::peak_dtypes(device);
  for (const auto& d : dtypes)
    if (suites::gemm_unsupported("cuda", d).rfind("unknown", 0) == 0) throw UsageError(suites::gemm_unsupported("cuda", d));
  probes::configure_threads(0);
  json results = json::array();
  std::printf("GEMM peak on %s (%s)%s\n", device.c_str(), device_name(device).c_str(), thorough ? ", thorough sweep" : "");
  std::printf("%-6s %14s %18s %14s %14s %12s %10s\n", "dtype", "TFLOPS (mean)", "best shape", "median", "max",
              "datasheet", "of sheet");
  for (const auto& dtype : dtypes) {
    const json r = suites::gemm_peak(device, dtype, thorough);
    results.push_back(r);
    if (r.contains("skipped")) {
      std::printf("%-6s skipped: %s\n", dtype.c_str(), r["skipped"].get<std::string>().c_str());
      continue;
    }
    const json& s = r["best_shape"];
    const std::string shape = std::to_string(s[0].get<int64_t>()) + "x" + std::to_string(s[1].get<int64_t>()) + "x" +
                              std::to_string(s[2].get<int64_t>());
    auto tf = [](const json& v) { return v.is_number() ? format_fixed(v.get<double>() / 1e12, 2) : std::string("-"); };
    const std::string frac = r["fraction_of_datasheet"].is_number()
                                 ? format_fixed(100 * r["fraction_of_datasheet"].get<double>(), 1) + "%" : "-";
    std::printf("%-6s %14s %18s %14s %14s %12s %10s\n", dtype.c_str(), tf(r["achievable_flops_per_s"]).c_str(),
                shape.c_str(), tf(r["best_median_flops_per_s"]).c_str(), tf(r["best_max_flops_per_s"]).c_str(),
                tf(r["datasheet_flops_per_s"]).c_str(), frac.c_str());
  }
  if (!out.empty()) {
    reports::write_json_atomic(out, json{{"device", device}, {"device_name", device_name(device)}, {"gemm", results}});
    std::printf("written: %s\n", out.c_str());
  }
  return 0;
}

struct ReportArgs {
  std::string dir;
  bool rederive = false;
  std::vector<std::string> hardware;
};

// `trainscope report DIR`: re-renders DIR/report.json; with --rederive, first derives its cells' MFU again
// from their raw measurements under this version's definitions and writes the report back.
int report_command(const ReportArgs& a) {
  json report = reports::read_report(a.dir);
  namespace fs = std::filesystem;
  std::string folder = fs::is_directory(a.dir) ? a.dir : fs::path(a.dir).parent_path().string();
  if (folder.empty()) folder = ".";
  if (!a.hardware.empty() && !a.rederive) throw UsageError("report: --hardware goes with --rederive");
  if (a.rederive) {
    json hardware;
    std::string source;
    for (const auto& h : a.hardware) {
      const json r = reports::read_report(h);
      if (hardware.is_null()) hardware = r;
      else for (const auto& c : r.value("cells", json::array())) hardware["cells"].push_back(c);
      source += (source.empty() ? "" : " + ") + h;
    }
    if (!hardware.is_null()) hardware["source"] = source;
    const FolderLock lock(folder);
    report = reports::rederive_report(report, hardware);
    reports::write_json_atomic((fs::path(folder) / "report.json").string(), report);
  }
  reports::write_renderings(report, folder);
  std::printf("suite %s, created %s, trainscope %s (%s)\n\n", report["suite"].value("name", "?").c_str(),
              report["created"].get<std::string>().c_str(), report["trainscope"].value("version", "?").c_str(),
              report["trainscope"].value("commit", "?").c_str());
  std::printf("%s", reports::render_summary(report).c_str());
  std::printf("\nwritten: %s%s/report.md, %s/report.html\n", a.rederive ? (folder + "/report.json (derived again), ").c_str() : "",
              folder.c_str(), folder.c_str());
  return 0;
}

struct CompareArgs {
  std::string base, next, format = "text";
  double min_effect_pct = 5, alpha = 0.05, memory_tolerance_pct = 1;
  bool exact_loss = false, no_colour = false;
};

// `trainscope compare BASE NEW`: 0 no regression, 1 a regression, 3 inconclusive (a change that could
// not be decided), 2 bad input (read_report throws).
int compare_command(const CompareArgs& a) {
  const json base = reports::read_report(a.base), next = reports::read_report(a.next);
  reports::CompareOptions o;
  o.min_effect = a.min_effect_pct / 100;
  o.alpha = a.alpha;
  o.memory_tolerance = a.memory_tolerance_pct / 100;
  o.exact_loss = a.exact_loss;
  const json cmp = reports::compare_reports(base, next, o);
  const std::string md = reports::render_compare_markdown(cmp);
  if (a.format == "json") std::cout << cmp.dump(2) << "\n";
  else if (a.format == "md") std::cout << md;
  else std::cout << reports::render_compare_text(cmp, !a.no_colour && isatty(STDOUT_FILENO) && !std::getenv("NO_COLOR"));
  // In a GitHub Actions job the Markdown also goes to the job's summary page.
  if (const char* summary = std::getenv("GITHUB_STEP_SUMMARY"); summary && *summary) {
    std::ofstream f(summary, std::ios::app);
    f << md << "\n";
  }
  return cmp["regressions"].get<int>() > 0 ? 1 : cmp["inconclusive"].get<int>() > 0 ? 3 : 0;
}

// "key=value" -> pair; one-line error otherwise.
std::pair<std::string, std::string> split_set(const std::string& kv) {
  const auto eq = kv.find('=');
  if (eq == std::string::npos || eq == 0) throw UsageError("--set expects key=value, got '" + kv + "'");
  return {kv.substr(0, eq), kv.substr(eq + 1)};
}

// The command line: each command's options bound into its own state, and what it does once parsed.
class Cli {
 public:
  Cli() {
    app_.set_version_flag("--version", std::string(version()) + " (" + commit() + ")");
    app_.require_subcommand(1);
    add_run();
    add_info();
    add_compare();
    add_parity();
    add_peak();
    add_plan();
    add_ab();
    add_history();
    add_cell();
  }
  int main(int argc, char** argv);

 private:
  void command(CLI::App* sub, std::function<int()> run) { commands_.emplace_back(sub, std::move(run)); }
  void add_run();
  void add_info();  // list, env, report, trace, export
  void add_compare();
  void add_parity();
  void add_peak();
  void add_plan();
  void add_ab();
  void add_history();
  void add_cell();

  CLI::App app_{"trainscope: benchmarks and diagnostics for deep-learning training"};
  std::vector<std::pair<CLI::App*, std::function<int()>>> commands_;
};

// --device-file FILE: a device the table does not know, for this process and the cells it starts.
void add_device_file(CLI::App* sub, std::string& path) {
  sub->add_option("--device-file", path,
                  "a TOML file describing a GPU the device table does not know (docs/plan.md#devices): its memory, "
                  "bandwidths and dense peaks");
}

void Cli::add_run() {
  struct State {
    RunOptions run;
    std::vector<std::string> sets;
    std::string steps, warmup, seed, threads, device_file;
    bool trace = false;
  };
  auto st = std::make_shared<State>();
  auto* c = app_.add_subcommand("run", "Run a suite: every cell in its own process; writes report.json");
  c->add_option("--suite", st->run.suite, "built-in suite name or path to a .toml suite file")->capture_default_str();
  c->add_option("--device", st->run.device, "auto | cpu | cuda | cuda:<index> (default: the suite's, else auto)");
  c->add_option("--out", st->run.out, "output folder (default results/<UTC timestamp>)");
  c->add_option("--steps", st->steps, "measured steps per cell (overrides the suite)");
  c->add_option("--warmup", st->warmup, "warm-up steps per cell");
  c->add_option("--seed", st->seed, "seed of every generator");
  c->add_option("--threads", st->threads, "intra-op CPU threads (0: one per core)");
  c->add_option("--set", st->sets, "override any configuration key: --set key=value (repeatable)");
  c->add_option("--filter", st->run.filter, "regular expression on cell names");
  c->add_flag("--resume", st->run.resume, "reuse finished cells found in --out");
  c->add_option("--memory-budget", st->run.memory_budget, "refuse tensor allocations past SIZE (512MiB, 2GB): cells that exceed it end as oom");
  c->add_flag("--frontier", st->run.frontier, "also search the largest batch that fits the budget, per policy");
  c->add_option("--nproc", st->run.nproc,
                "local ranks allowed per cell: cells with world_size up to N run as N processes (default 1; under "
                "torchrun/srun/mpirun the launcher decides)")
      ->check(CLI::Range(1, 1024));
  c->add_option("--repeat", st->run.repeat,
                "runs of each cell, each in its own process: the cell reports every run and their spread (default: the "
                "suite's `repeat`, else 1)")
      ->check(CLI::Range(1, 100));
  c->add_flag("--trace", st->trace, "write a Perfetto / Chrome trace per cell (traces/<cell>.json): steps, phases, "
                                    "collectives, memory and loss-scale counters, one process per rank");
  add_device_file(c, st->device_file);
  command(c, [st] {
    if (!st->device_file.empty()) use_device_file(st->device_file);
    for (const auto& [key, value] : {std::pair<const char*, std::string*>{"steps", &st->steps}, {"warmup_steps", &st->warmup},
                                     {"seed", &st->seed}, {"threads", &st->threads}})
      if (!value->empty()) st->run.sets.emplace_back(key, *value);
    if (st->trace) st->run.sets.emplace_back("trace", "true");
    for (const auto& kv : st->sets) st->run.sets.push_back(split_set(kv));
    return run_suite(st->run);
  });
}

void Cli::add_info() {
  command(app_.add_subcommand("list", "Suites, axes and values, and what this build supports here"), [] { return list_command(); });
  command(app_.add_subcommand("env", "Hardware and software inventory as JSON"), [] {
    std::cout << probes::collect_env().dump(2) << "\n";
    return 0;
  });
  auto report = std::make_shared<ReportArgs>();
  auto* r = app_.add_subcommand("report", "Re-render the summary, report.md and report.html of a results folder from its JSON");
  r->add_option("dir", report->dir, "results folder or report.json")->required();
  r->add_flag("--rederive", report->rederive,
              "first derive each cell's MFU and peaks again from its raw measurements with this version's definitions, "
              "and write report.json back");
  r->add_option("--hardware", report->hardware,
                "with --rederive: results folder of the hardware suite on the same machine, for GEMM peaks a cell did not measure");
  command(r, [report] { return report_command(*report); });
  auto trace_dir = std::make_shared<std::string>();
  auto* t = app_.add_subcommand("trace", "Merge each cell's rank timelines of a results folder into traces/<cell>.json");
  t->add_option("dir", *trace_dir, "results folder")->required();
  command(t, [trace_dir] { return trace_command(*trace_dir); });
  auto exported = std::make_shared<std::pair<std::string, bool>>();
  auto* e = app_.add_subcommand("export", "Write a report's figures for dashboards");
  e->add_option("report", exported->first, "report.json or its folder")->required();
  e->add_flag("--bmf", exported->second, "Bencher Metric Format: latency (ns), throughput, peak memory per cell")->required();
  command(e, [exported] {
    std::cout << reports::export_bmf(reports::read_report(exported->first)).dump(2) << "\n";
    return 0;
  });
}

void Cli::add_compare() {
  auto a = std::make_shared<CompareArgs>();
  auto* c = app_.add_subcommand(
      "compare", "Compare two runs (reports or results folders): per cell and metric a verdict; exit 1 on a regression, 3 when a change could not be decided");
  c->add_option("base", a->base, "the baseline: report.json or its folder")->required();
  c->add_option("new", a->next, "the run to judge: report.json or its folder")->required();
  c->add_option("--format", a->format, "text (a table), md (a pull-request comment) or json")->check(CLI::IsMember({"text", "md", "json"}));
  c->add_option("--min-effect", a->min_effect_pct, "smallest time change in percent that can be a regression (doubled without 3 repetitions)")
      ->check(CLI::Range(0.0, 1000.0))->capture_default_str();
  c->add_option("--alpha", a->alpha, "significance level of the one-sided Mann-Whitney U test")->check(CLI::Range(1e-9, 0.5))->capture_default_str();
  c->add_option("--memory-tolerance", a->memory_tolerance_pct, "peak memory increase in percent that is a regression")
      ->check(CLI::Range(0.0, 1000.0))->capture_default_str();
  c->add_flag("--exact-loss", a->exact_loss, "deterministic runs: every step's loss must be identical");
  c->add_flag("--no-color", a->no_colour, "no ANSI colours (also when NO_COLOR is set or not a terminal)");
  command(c, [a] { return compare_command(*a); });
}

void Cli::add_parity() {
  struct State {
    ParityOptions parity;
    std::vector<std::string> sets;
  };
  auto st = std::make_shared<State>();
  st->parity.run.suite = "parity";
  st->parity.run.nproc = 4;  // the hsdp row: two shard groups of two ranks
  auto* c = app_.add_subcommand(
      "parity", "Run a suite (default: parity), then PyTorch's own DDP, FSDP2, ZeRO, checkpointing, GradScaler and "
                "autocast on what each cell trained on: both sides' numbers in the report; exit 1 on a difference");
  c->add_option("--suite", st->parity.run.suite, "built-in suite name or .toml file whose cells set parity_dump")->capture_default_str();
  c->add_option("--out", st->parity.run.out, "output folder (default results/parity-<UTC timestamp>)");
  c->add_option("--filter", st->parity.run.filter, "regular expression on cell names");
  c->add_option("--nproc", st->parity.run.nproc, "local ranks allowed per cell")->check(CLI::Range(1, 1024))->capture_default_str();
  c->add_option("--set", st->sets, "override any configuration key: --set key=value (repeatable)");
  c->add_option("--python", st->parity.python, std::string("Python with the torch wheel (default ") + parity_python() + ")");
  c->add_option("--reference", st->parity.reference, std::string("folder of reference.py (default ") + parity_reference_dir() + ")");
  command(c, [st] {
    for (const auto& kv : st->sets) st->parity.run.sets.push_back(split_set(kv));
    return parity_command(st->parity);
  });
}

void Cli::add_peak() {
  struct State {
    std::string device = "auto", out;
    std::vector<std::string> dtypes;
    bool thorough = false;
  };
  auto st = std::make_shared<State>();
  auto* c = app_.add_subcommand("peak", "Achievable GEMM FLOP/s per dtype (mamf-finder's method), against the datasheet");
  c->add_option("--device", st->device, "auto | cpu | cuda | cuda:<index>")->capture_default_str();
  c->add_option("--dtypes", st->dtypes, "fp32 tf32 bf16 fp16 fp8 fp64 (default: what the device has)");
  c->add_flag("--thorough", st->thorough, "the long shape sweep");
  c->add_option("--out", st->out, "also write the results as JSON to this file");
  command(c, [st] { return peak_command(st->device, st->dtypes, st->thorough, st->out); });
}

void Cli::add_plan() {
  struct State {
    PlanArgs plan;
    std::vector<std::string> sets;
    std::string device_file;
  };
  auto st = std::make_shared<State>();
  PlanArgs& p = st->plan;
  auto* c = app_.add_subcommand("plan", "Will a model fit on a cluster, how fast, with which settings: predicted, or checked against a results folder");
  c->add_option("--check", p.check, "a results folder: predict each of its cells and print predicted beside measured");
  c->add_flag("--into-report", p.into_report, "with --check: store each cell's comparison in the folder's report.json and re-render report.md and report.html");
  c->add_option("--model", p.model, "a preset (trainscope list) or a family with --set dimensions")->capture_default_str();
  c->add_option("--gpus-per-node", p.gpus_per_node, "GPUs per node")->capture_default_str();
  c->add_option("--nodes", p.nodes, "nodes")->capture_default_str();
  std::string devices;
  for (const auto& k : device_keys()) devices += (devices.empty() ? "" : ", ") + k;
  c->add_option("--device", p.device, "the GPU's datasheet: " + devices)->capture_default_str();
  add_device_file(c, st->device_file);
  c->add_option("--seq", p.seq, "sequence length (default: the model's)");
  c->add_option("--global-batch", p.global_batch, "tokens per optimizer step: 1048576, 4M (x 2^20), 512K (default 1M)");
  c->add_option("--memory-headroom", p.headroom, "device memory kept free (context, workspaces, fragmentation)")->capture_default_str();
  c->add_option("--set", st->sets, "fix an axis (precision, parallel, checkpoint, attention, batch_size) or a model dimension: --set key=value");
  c->add_option("--out", p.out, "also write plan.json, plan.md and plan.html into this folder");
  c->add_option("--hardware", p.hardware,
                "results folder of `trainscope run --suite hardware` on the device: its measured GEMM, memory and collective "
                "figures (repeatable: a collectives cell run across the cluster's nodes adds the two levels)");
  c->add_option("--format", p.format, "text | md | json")->check(CLI::IsMember({"text", "md", "json"}));
  command(c, [st] {
    if (!st->device_file.empty()) use_device_file(st->device_file);
    for (const auto& kv : st->sets) st->plan.sets.push_back(split_set(kv));
    return plan_command(st->plan);
  });
}

void Cli::add_ab() {
  struct State {
    AbArgs ab;
    std::vector<std::string> base_sets, new_sets;
  };
  auto st = std::make_shared<State>();
  AbArgs& ab = st->ab;
  auto* c = app_.add_subcommand("ab", "Pre-merge gate: two builds' cells interleaved in ABBA blocks on this runner, paired statistics; exit 0 pass, 1 regression, 3 inconclusive");
  c->add_option("--base", ab.base, "the base build's trainscope binary")->required();
  c->add_option("--new", ab.fresh, "the new build's trainscope binary (the same one: an A/A run)")->required();
  c->add_option("--suite", ab.suite, "suite whose cells gate (built-in or a file both builds read)")->capture_default_str();
  c->add_option("--filter", ab.filter, "regular expression on cell names");
  c->add_option("--blocks", ab.blocks, "ABBA blocks to start with (at least the fewest that can decide: 2^-n <= alpha / cells)")->capture_default_str();
  c->add_option("--max-blocks", ab.max_blocks, "blocks at most, 2 more at a time while inconclusive")->capture_default_str();
  c->add_option("--per-side", ab.per_side, "processes per side in each block (ABBA at 2, ABBAAB at 3): more removes more slow processes on a noisy runner")
      ->check(CLI::Range(1, 8))
      ->capture_default_str();
  c->add_option("--min-effect", ab.min_effect, "the smallest slowdown that counts as a regression")->capture_default_str();
  c->add_option("--alpha", ab.alpha, "significance level over all cells (Holm)")->capture_default_str();
  c->add_option("--base-set", st->base_sets, "a setting for the base side only: --base-set key=value");
  c->add_option("--new-set", st->new_sets, "a setting for the new side only (--new-set inject=slow:10 measures the gate's power)");
  c->add_option("--nproc", ab.nproc, "local ranks for multi-rank cells")->capture_default_str();
  c->add_option("--out", ab.out, "folder for every slot's report and ab.json (default results/ab-<UTC>)");
  c->add_option("--format", ab.format, "text | md | json")->check(CLI::IsMember({"text", "md", "json"}));
  command(c, [st] {
    for (const auto& kv : st->base_sets) st->ab.base_sets.push_back(split_set(kv));
    for (const auto& kv : st->new_sets) st->ab.new_sets.push_back(split_set(kv));
    return ab_command(st->ab);
  });
}

void Cli::add_history() {
  auto h = std::make_shared<HistoryArgs>();
  auto* c = app_.add_subcommand("history", "Post-merge trend: one metric per cell over many stored reports, change points flagged (E-divisive means)");
  c->add_option("paths", h->paths, "reports, results folders, or folders searched for report.json")->required();
  c->add_option("--metric", h->metric, "step_time | throughput | peak_memory")
      ->check(CLI::IsMember({"step_time", "throughput", "peak_memory"}))->capture_default_str();
  c->add_option("--filter", h->filter, "regular expression on cell names");
  c->add_option("--min-effect", h->min_effect, "a change point whose medians differ less is not flagged")->capture_default_str();
  c->add_option("--alpha", h->alpha, "the permutation test's level")->capture_default_str();
  c->add_option("--format", h->format, "text | md | json")->check(CLI::IsMember({"text", "md", "json"}));
  command(c, [h] { return history_command(*h); });
}

void Cli::add_cell() {
  struct State {
    std::string spec, result, store;  // store: host:port
    CellRank rank;
  };
  auto st = std::make_shared<State>();
  auto* c = app_.add_subcommand("_cell", "");  // hidden: one cell in a child process
  c->group("");
  c->add_option("--spec", st->spec)->required();
  c->add_option("--result", st->result)->required();
  c->add_option("--rank", st->rank.rank);
  c->add_option("--world", st->rank.world);
  c->add_option("--local-rank", st->rank.local_rank);
  c->add_option("--local-world", st->rank.local_world);
  c->add_option("--store", st->store);
  c->add_option("--prefix", st->rank.prefix);
  command(c, [st] {
    if (const size_t colon = st->store.rfind(':'); colon != std::string::npos) {
      st->rank.store_host = st->store.substr(0, colon);
      st->rank.store_port = std::stoi(st->store.substr(colon + 1));
    }
    return cell_main(st->spec, st->result, st->rank);
  });
}

int Cli::main(int argc, char** argv) {
  // CLI11 would call a stray word "extra arguments"; name it and the commands instead.
  if (argc > 1 && argv[1][0] != '-') {
    const std::string word = argv[1];
    bool known = false;
    for (const auto* sub : app_.get_subcommands({})) known = known || sub->check_name(word);
    if (!known) {
      std::fprintf(stderr, "trainscope: error: unknown command '%s' (allowed: run, list, env, report, compare, ab, history, parity, peak, plan, export, trace)\n", word.c_str());
      return 2;
    }
  }
  try {
    app_.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app_.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app_.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app_.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "trainscope: error: %s (see trainscope --help)\n", e.what());
    return 2;
  }
  try {
    for (const auto& [sub, run] : commands_)
      if (sub->parsed()) return run();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "trainscope: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    std::fprintf(stderr, "trainscope: error: %s\n", what.substr(0, what.find('\n')).c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int cli_main(int argc, char** argv) {
  Cli cli;
  return cli.main(argc, argv);
}

}  // namespace trainscope::runners
