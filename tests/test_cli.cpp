// The real `trainscope` binary: argument errors, isolation of crashing and hanging cells, the quick
// suite end to end with schema validation, resume.
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "cli_support.hpp"

#include "core/config.hpp"

using trainscope::json;

using namespace trainscope::test;

TEST(Cli, BadArgumentsAreOneLineErrorsWithExit2) {
  struct Case {
    std::string args, expect;
  };
  const std::string malformed = write("malformed.toml", "name = 'x'\n[axes\nmodel = ['mlp']\n");
  const std::string unknown_key = write("unknown-key.toml", "name = 'x'\n[base]\nbatchsize = 8\n");
  const std::vector<Case> cases = {
      {"run --set precision=fp16", "unknown precision 'fp16' (allowed: 32-true, tf32, bf16-mixed, bf16-master, 16-mixed"},
      {"run --set stepz=3", "unknown key 'stepz' (allowed: model, family, layers"},
      // Models: an unknown one, and dimensions that do not fit together, before anything runs.
      {"run --set model=gpt-9000", "unknown model 'gpt-9000' (presets: mlp-tiny"},
      {"run --suite llama --set heads=5", "d_model 64 is not divisible by heads 5"},
      {"run --set checkpoint=half", "unknown checkpoint 'half' (allowed: none, full, every:<k>, selective, selective-op)"},
      {"run --steps ten", "bad value 'ten' for 'steps': expected a number"},
      {"run --device gpu", "unknown device 'gpu' (allowed: auto, cpu, cuda, cuda:<index>)"},
      {"run --set parallel=fsdp", "unknown parallel 'fsdp' (allowed: single, ddp, zero1, zero2, zero3, hsdp)"},
      {"run --nproc 0", "--nproc"},
      {"run --set steps", "--set expects key=value"},
      {"run --suite no-such-suite", "unknown suite 'no-such-suite' (built-in: checkpointing, gate, hardware, llama, long-context, parallel, parity, pitfalls, precision, quick, ssl"},
      {"run --suite " + malformed, "malformed.toml:2:"},
      {"run --suite " + unknown_key, "base.batchsize: unknown key 'batchsize'"},
      {"run --filter 'nothing-matches-this'", "no cell of suite 'quick' matches"},
      {"run --bogus", "--bogus"},
      {"report " + tmp("does-not-exist"), "cannot read"},
      {"frobnicate", "unknown command 'frobnicate' (allowed: run, list, env, report, compare, ab, history, parity, peak, plan, export, trace)"},
      {"run --set inject=slow:abc", "unknown inject 'slow:abc'"},
      {"run --repeat 0", "--repeat"},
      // A device asked for that is not here: an error before anything runs, not an all-skipped pass.
      {"run --device cuda:7", "--device cuda:7: "},
      {"compare " + tmp("does-not-exist") + " " + tmp("does-not-exist"), "cannot read"},
  };
  for (const auto& c : cases) {
    const Result r = ts(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.args << "\n" << r.out;
    EXPECT_EQ(lines(r.out), 1) << c.args << "\n" << r.out;
  }
  const std::string corrupt = write("corrupt-report.json", "{\"schema\": \"trainscope.report/1\", \"cells\": [");
  const Result r = ts("report " + corrupt);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("not valid JSON"), std::string::npos) << r.out;
}

TEST(Cli, HelpListAndEnv) {
  for (const char* sub : {"run", "list", "env", "report", "compare", "export"}) {
    const Result r = ts(std::string(sub) + " --help");
    EXPECT_EQ(r.code, 0) << sub;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << sub;
  }
  const Result list = ts("list");
  EXPECT_EQ(list.code, 0);
  EXPECT_NE(list.out.find("quick"), std::string::npos);
  EXPECT_NE(list.out.find("tf32 (not here)"), std::string::npos) << list.out;  // no GPU in CI
  const Result env = sh(bin() + " env 2>/dev/null");
  ASSERT_EQ(env.code, 0);
  const json j = json::parse(env.out);
  EXPECT_TRUE(j.contains("blas"));
  EXPECT_TRUE(j["cpu"]["flags"].contains("avx512_bf16"));
}

TEST(Cli, CrashAbortExceptionAndHangAreRecordedAndTheSuiteGoesOn) {
  const std::string suite = write("faults.toml", R"(
name = "faults"
[base]
model = "mlp-tiny"
data = "synthetic-images"
steps = 3
warmup_steps = 1
batch_size = 8
timeout_s = 4
[axes]
inject = ["crash", "abort", "hang", "throw", "none"]
)");
  const std::string out = tmp("faults-out");
  sh("rm -rf " + out);
  const Result r = ts("run --suite " + suite + " --out " + out);
  EXPECT_EQ(r.code, 1) << r.out;  // some cells failed
  const json report = read_json(out + "/report.json");
  ASSERT_EQ(report["cells"].size(), 5u) << r.out;
  auto cell = [&](size_t i) { return report["cells"][i]; };
  EXPECT_EQ(cell(0)["status"], "failed");
  EXPECT_NE(cell(0)["reason"].get<std::string>().find("SIGSEGV"), std::string::npos) << cell(0)["reason"];
  EXPECT_EQ(cell(1)["status"], "failed");
  EXPECT_NE(cell(1)["reason"].get<std::string>().find("SIGABRT"), std::string::npos) << cell(1)["reason"];
  EXPECT_EQ(cell(2)["status"], "timeout");
  EXPECT_NE(cell(2)["reason"].get<std::string>().find("timed out after"), std::string::npos);
  EXPECT_GE(cell(2)["wall_s"].get<double>(), 4.0);
  EXPECT_LT(cell(2)["wall_s"].get<double>(), 30.0);
  EXPECT_EQ(cell(3)["status"], "failed");
  EXPECT_NE(cell(3)["reason"].get<std::string>().find("injected exception"), std::string::npos);
  EXPECT_EQ(cell(4)["status"], "ok");  // the suite went on after all of that
  EXPECT_EQ(processes_mentioning(out), 0);  // the hung cell's process group is gone
  EXPECT_NE(r.out.find("[5/5] inject=none"), std::string::npos) << r.out;
  // Every cell's own result file exists too.
  EXPECT_TRUE(std::ifstream(out + "/cells/inject_crash.json").good());
  const json critical = report["recommendations"].back();
  EXPECT_EQ(critical["id"], "run.cells-failed");
  EXPECT_EQ(critical["cells"].size(), 4u);
}

TEST(Cli, QuickSuiteMlpEndToEndValidatesAndReachesAccuracy) {
  const std::string out = tmp("quick-mlp");
  sh("rm -rf " + out);
  const Result r = ts("run --filter '^mlp/' --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("vs 32-true"), std::string::npos) << r.out;  // the summary table
  const json report = read_json(out + "/report.json");
  ASSERT_EQ(report["cells"].size(), 2u);
  for (const auto& c : report["cells"]) {
    ASSERT_EQ(c["status"], "ok") << c.dump();
    const json& m = c["metrics"];
    EXPECT_GE(m["quality"]["accuracy"].get<double>(), 0.80) << c["name"];  // the issue's bar, fp32 and bf16
    const double mean = m["timing"]["step_time_s"]["mean"];
    // Every measured step is timed: all of them, or those run before quick's time budget stopped the
    // cell (a loaded machine).
    EXPECT_EQ(m["timing"]["step_time_s"]["count"].get<int64_t>(),
              c["steps_run"].get<int64_t>() - c["config"]["warmup_steps"].get<int64_t>());
    EXPECT_NEAR(m["timing"]["samples_per_s"].get<double>() * mean, c["config"]["batch_size"].get<double>(), 1e-6);
    EXPECT_NEAR(m["timing"]["flops_per_s"].get<double>(),
                m["timing"]["samples_per_s"].get<double>() * c["model"]["training_flops_per_sample"].get<double>(),
                1e-3 * m["timing"]["flops_per_s"].get<double>());
    EXPECT_GT(m["timing"]["mfu"].get<double>(), 0.0);
    EXPECT_LT(m["timing"]["mfu"].get<double>(), 1.5);
    EXPECT_GT(m["memory"]["peak_bytes"].get<int64_t>(), m["memory"]["activation_bytes"].get<int64_t>());
    EXPECT_EQ(m["memory"]["model_state_difference_bytes"], 0);
    EXPECT_GE(m["quality"]["loss_curve"].size(), 10u);
  }
  const std::string schema = source_dir() + "/reports/schema/report.schema.json";
  const std::string validate = "/usr/bin/python3 " + source_dir() + "/tests/validate_report.py " + schema + " ";
  const Result valid = sh(validate + out + "/report.json");
  EXPECT_EQ(valid.code, 0) << valid.out;
  // The schema does reject what breaks the contract.
  json broken = report;
  broken["cells"][0]["status"] = "finished";
  std::ofstream(tmp("broken.json")) << broken.dump();
  const Result invalid = sh(validate + tmp("broken.json"));
  EXPECT_EQ(invalid.code, 1) << invalid.out;
  EXPECT_NE(invalid.out.find("cells/0/status"), std::string::npos) << invalid.out;

  const Result again = ts("report " + out);
  EXPECT_EQ(again.code, 0);
  EXPECT_NE(again.out.find("mlp/bf16-mixed"), std::string::npos);
}

// The built-in llama suite: llama cells in every precision on both attention paths, on text.
TEST(Cli, LlamaSuiteRunsEveryPrecisionOnBothAttentionPaths) {
  const std::string out = tmp("llama");
  sh("rm -rf " + out);
  const Result r = ts("run --suite llama --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  const json report = read_json(out + "/report.json");
  EXPECT_EQ(validate_report(out + "/report.json").code, 0);
  expect_reports_for_people(out);
  std::set<std::string> seen;
  for (const auto& c : report["cells"]) {
    const std::string precision = c["config"]["precision"], attention = c["config"]["attention"];
    seen.insert(precision + "/" + attention);
    if (precision == "tf32" || precision == "fp8") {  // CUDA only: kept, with the reason
      EXPECT_EQ(c["status"], "skipped") << c["name"];
      continue;
    }
    ASSERT_EQ(c["status"], "ok") << c["name"] << ": " << c.value("reason", "");
    EXPECT_EQ(c["data"], "text");
    EXPECT_EQ(c["model"]["attention_backend"] == "eager", attention == "eager") << c["name"];
    // Byte-level text starts at log(256) = 5.545 and must fall.
    EXPECT_LT(c["metrics"]["quality"]["final_loss"].get<double>(), 5.0) << c["name"];
    const json& t = c["metrics"]["timing"];
    EXPECT_EQ(t["flops_convention"].get<std::string>().rfind("full-attention", 0), 0u);
    EXPECT_LT(t["causal"]["flops_per_sample"].get<double>(), t["flops_per_sample"].get<double>());
  }
  for (const char* p : {"32-true", "tf32", "bf16-mixed", "16-mixed", "bf16-true", "fp8"})
    for (const char* a : {"eager", "sdpa"}) EXPECT_TRUE(seen.count(std::string(p) + "/" + a)) << p << "/" << a;
  // SDPA never keeps the S x S probabilities that eager's backward needs: fewer activation bytes.
  const json eager = cell_named(report, "llama-small/32-true/eager"), sdpa = cell_named(report, "llama-small/32-true/sdpa");
  EXPECT_LT(sdpa["metrics"]["memory"]["activation_bytes"].get<int64_t>(),
            eager["metrics"]["memory"]["activation_bytes"].get<int64_t>());
}

TEST(Cli, PrecisionStressCellsShowScalerAndDivergenceInTheReport) {
  const std::string out = tmp("precision-stress");
  sh("rm -rf " + out);
  const Result r = ts("run --suite precision --filter stress --steps 40 --out " + out);
  // The noscale cell diverges, by design: the suite's [expect] says so, so the run is not failed by it.
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("diverged (expected)"), std::string::npos) << r.out;
  const json report = read_json(out + "/report.json");
  ASSERT_EQ(report["cells"].size(), 3u);
  const json& scaled = report["cells"][1];
  EXPECT_EQ(scaled["name"], "mlp/16-mixed/stress");
  EXPECT_EQ(scaled["status"], "ok");
  EXPECT_TRUE(scaled["emulated"].get<bool>());
  EXPECT_GT(scaled["metrics"]["overflow"]["skipped_steps"].get<int64_t>(), 0);
  EXPECT_GT(scaled["metrics"]["overflow"]["scale_trajectory"].size(), 2u);
  EXPECT_EQ(scaled["numerics"]["reference"], "mlp/32-true/stress");
  const json& noscale = report["cells"][2];
  EXPECT_EQ(noscale["status"], "diverged");
  EXPECT_NE(noscale["reason"].get<std::string>().find("since step 1"), std::string::npos);
  EXPECT_EQ(noscale["numerics"]["verdict"], "diverged");
  std::set<std::string> ids;
  for (const auto& rec : report["recommendations"]) ids.insert(rec["id"].get<std::string>());
  EXPECT_TRUE(ids.count("precision.fp16-loss-scaling")) << report["recommendations"].dump(1);
  EXPECT_TRUE(ids.count("precision.fp16-noscale-diverged")) << report["recommendations"].dump(1);
  const Result valid = validate_report(out + "/report.json");
  EXPECT_EQ(valid.code, 0) << valid.out;
  expect_reports_for_people(out);
}

// [expect]: a cell meant to go wrong that ends ok is a finding (a warning, the run still exits 0); one
// that ends in a status it was not meant to is a failure; [expect] naming no cell, or no status, is
// bad input.
TEST(Cli, ExpectedFailuresAreShownAndAMissedOneIsAFinding) {
  const std::string head = "name = \"expect\"\n[base]\nmodel = \"mlp-tiny\"\nsteps = 3\nwarmup_steps = 1\n"
                           "[axes]\nprecision = [\"32-true\"]\n";
  const std::string out = tmp("expect-missed");
  sh("rm -rf " + out);
  const Result missed = ts("run --suite " + write("expect.toml", head + "[expect]\n\"32-true\" = \"diverged\"\n") + " --out " + out);
  EXPECT_EQ(missed.code, 0) << missed.out;
  const json report = read_json(out + "/report.json");
  EXPECT_EQ(report["suite"]["expect"]["32-true"], json::array({"diverged"}));
  bool found = false;
  for (const auto& rec : report["recommendations"])
    if (rec["id"] == "run.expected-failure-missing") {
      found = true;
      EXPECT_EQ(rec["text"], "32-true was expected to end diverged but ended ok: the mistake it shows was not reproduced here");
    }
  EXPECT_TRUE(found) << report["recommendations"].dump(1);
  for (const auto& [text, error] : std::vector<std::pair<std::string, std::string>>{
           {"[expect]\n\"nope\" = \"diverged\"\n", "expect: no cell named 'nope'"},
           {"[expect]\n\"32-true\" = \"exploded\"\n", "expect.32-true: expected a status"}}) {
    const Result bad = ts("run --suite " + write("expect-bad.toml", head + text));
    EXPECT_EQ(bad.code, 2) << bad.out;
    EXPECT_NE(bad.out.find(error), std::string::npos) << bad.out;
    EXPECT_EQ(lines(bad.out), 1) << bad.out;
  }
}

// One writer per results folder: while a run holds it, a second run (or ab) into it is bad input
// naming the holder's pid, and nothing of the first is touched; a run killed with SIGKILL leaves its
// lock file behind, and the next run is not blocked by it (the kernel dropped the lock).
TEST(Cli, AResultsFolderHasOneWriterAndAStaleLockBlocksNothing) {
  const std::string out = tmp("locked"), pidfile = tmp("locked.pid");
  sh("rm -rf " + out + " " + pidfile);
  const std::string slow = write("lock-slow.toml", "name = \"slow\"\n[base]\nmodel = \"mlp\"\nsteps = 100000\nwarmup_steps = 1\n"
                                                   "time_budget_s = 120\n[axes]\nprecision = [\"32-true\"]\n");
  sh("(" + bin() + " run --suite " + slow + " --out " + out + " > /dev/null 2>&1 & echo $! > " + pidfile + ")");
  const std::string pid = sh("cat " + pidfile).out.substr(0, sh("cat " + pidfile).out.find('\n'));
  // Wait (up to 60 s) until the first run has written its description into the lock.
  ASSERT_EQ(sh("for i in $(seq 600); do grep -q 'pid " + pid + "' " + out + "/.trainscope.lock 2>/dev/null && exit 0; sleep 0.1; done; exit 1").code, 0);
  const Result second = ts("run --suite quick --out " + out);
  EXPECT_EQ(second.code, 2) << second.out;
  EXPECT_EQ(lines(second.out), 1) << second.out;
  EXPECT_NE(second.out.find("in use by another trainscope (pid " + pid), std::string::npos) << second.out;
  const Result gate = ts("ab --base " + bin() + " --new " + bin() + " --suite " + slow + " --out " + out);
  EXPECT_EQ(gate.code, 2) << gate.out;
  EXPECT_NE(gate.out.find("in use by another trainscope"), std::string::npos) << gate.out;
  // SIGKILL the holder (its cell process too): the lock file stays, the lock does not.
  sh("pkill -9 -P " + pid + "; kill -9 " + pid + "; for i in $(seq 100); do kill -0 " + pid + " 2>/dev/null || exit 0; sleep 0.1; done");
  ASSERT_TRUE(std::ifstream(out + "/.trainscope.lock").good());
  const Result third = ts("run --suite " + write("lock-quick.toml", "name = \"after\"\n[base]\nmodel = \"mlp-tiny\"\nsteps = 3\n"
                                                                   "warmup_steps = 1\n[axes]\nprecision = [\"32-true\"]\n") +
                          " --out " + out);
  EXPECT_EQ(third.code, 0) << third.out;
}

TEST(Cli, AnOomCellIsRecordedAndTheNextCellRuns) {
  const std::string out = tmp("oom");
  sh("rm -rf " + out);
  const std::string suite = write("oom.toml", R"(
name = "oom"
[base]
model = "gpt-tiny"
steps = 3
warmup_steps = 1
batch_size = 16
[axes]
memory_budget = ["4MiB", "none"]
)");
  const Result r = ts("run --suite " + suite + " --out " + out);
  EXPECT_EQ(r.code, 1) << r.out;
  const json report = read_json(out + "/report.json");
  ASSERT_EQ(report["cells"].size(), 2u);
  EXPECT_EQ(report["cells"][0]["status"], "oom");
  EXPECT_NE(report["cells"][0]["reason"].get<std::string>().find("out of memory in"), std::string::npos);
  EXPECT_NE(report["cells"][0]["reason"].get<std::string>().find("budget 4194304 bytes"), std::string::npos);
  EXPECT_EQ(report["cells"][1]["status"], "ok");
  const Result bad = ts("run --memory-budget lots");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.out.find("expected none or a size such as 512MiB"), std::string::npos) << bad.out;
}

TEST(Cli, ResumeReusesFinishedCells) {
  const std::string out = tmp("resume");
  sh("rm -rf " + out);
  const std::string args = "run --set model=mlp-tiny --set data=synthetic-images --steps 3 --set batch_size=8 --out " + out;
  const Result first = ts(args);
  ASSERT_EQ(first.code, 0) << first.out;
  const Result second = ts(args + " --resume");
  ASSERT_EQ(second.code, 0) << second.out;
  EXPECT_NE(second.out.find("from the previous run"), std::string::npos) << second.out;
  EXPECT_EQ(read_json(out + "/report.json")["cells"].size(), 2u);
}
