// Distributed training on 2 local ranks over Gloo: every strategy equals one process on the global
// batch, ranks end identical, zero3's per-rank memory shrinks, the RNG probe catches each injected
// fault and stays quiet otherwise, a dead or hung rank fails the cell and leaves nothing behind, and
// torchrun's variables form a group, a taken rendezvous port fails only its cell. Plus the pieces:
// busbw factors, ZeRO formulas, launch detection, cross-rank verdicts.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <toml++/toml.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "cli_support.hpp"
#include "core/precision.hpp"
#include "probes/distributed/comm.hpp"
#include "probes/distributed/rng.hpp"
#include "runners/process/launch.hpp"
#include "suites/parallel/comm.hpp"
#include "suites/parallel/strategies.hpp"
#include "test_support.hpp"

using namespace trainscope;
using namespace trainscope::test;

namespace {

std::vector<torch::Tensor> load_params(const std::string& path) {
  std::vector<torch::Tensor> v;
  torch::load(v, path);
  return v;
}

// A cell's saved parameters (every rank's full ones: joined over tp) equal on its ranks 0 and `last`
// and within `atol` of `expected`.
void expect_ranks_match(const std::string& out, const std::string& cell, int last, const std::vector<torch::Tensor>& expected, double atol) {
  const auto r0 = load_params(out + "/cells/" + cell + ".rank0.params.pt");
  const auto rl = load_params(out + "/cells/" + cell + ".rank" + std::to_string(last) + ".params.pt");
  ASSERT_EQ(r0.size(), expected.size()) << cell;
  ASSERT_EQ(rl.size(), expected.size()) << cell;
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_TRUE(torch::equal(r0[i], rl[i])) << cell << " parameter " << i << ": ranks 0 and " << last << " differ";
    EXPECT_TRUE(torch::allclose(r0[i], expected[i], /*rtol=*/0, atol))
        << cell << " parameter " << i << ": max |diff| " << (r0[i] - expected[i]).abs().max().item<double>();
  }
}

}  // namespace

TEST(Parallel, BusBandwidthFactorsFollowNcclTests) {
  EXPECT_DOUBLE_EQ(probes::bus_factor("all-reduce", 2), 1.0);
  EXPECT_DOUBLE_EQ(probes::bus_factor("all-reduce", 4), 1.5);
  EXPECT_DOUBLE_EQ(probes::bus_factor("all-reduce", 8), 1.75);
  EXPECT_DOUBLE_EQ(probes::bus_factor("all-gather", 4), 0.75);
  EXPECT_DOUBLE_EQ(probes::bus_factor("reduce-scatter", 8), 0.875);
  EXPECT_DOUBLE_EQ(probes::bus_factor("all-to-all", 2), 0.5);
  EXPECT_DOUBLE_EQ(probes::bus_factor("broadcast", 8), 1.0);
  EXPECT_THROW(probes::bus_factor("gossip", 4), std::invalid_argument);
}

TEST(Parallel, ZeroFormulasPerRank) {
  // Ψ = 1000 fp32 parameters with AdamW (P = 4, K = 8) on N = 4 ranks.
  const PrecisionTraits& fp32 = precision_traits("32-true");
  EXPECT_EQ(expected_model_state(fp32, "ddp", 1000, 4, 2).bytes, 16000);
  EXPECT_EQ(expected_model_state(fp32, "zero1", 1000, 4, 2).bytes, 8000 + 2000);
  EXPECT_EQ(expected_model_state(fp32, "zero2", 1000, 4, 2).bytes, 4000 + 3000);
  EXPECT_EQ(expected_model_state(fp32, "zero3", 1000, 4, 2).bytes, 4000);
  EXPECT_EQ(expected_model_state(fp32, "zero2", 1000, 4, 2).formula, "4Ψ + (4+8)Ψ/N");
  EXPECT_EQ(expected_model_state(fp32, "zero3", 1000, 4, 1).formula, "(4+4+4)Ψ/N");  // SGD: one momentum word
  // bf16 weights from fp32 masters, Ψ = 7.5B on N = 64: FSDP2's 16Ψ/N for zero3, Megatron's distributed
  // optimizer 6Ψ + 12Ψ/N for zero1 (its docs: bf16 params, fp32 grads), 2Ψ + 16Ψ/N for zero2, and 16Ψ
  // unsharded (the bf16 copy lives from a unit's forward to its backward only).
  const PrecisionTraits& master = precision_traits("bf16-master");
  const double gb = 1e9, psi = 7.5e9;
  EXPECT_NEAR(expected_model_state(master, "ddp", 7500000000LL, 64, 2).bytes / gb, 16 * psi / gb, 1e-6);
  EXPECT_NEAR(expected_model_state(master, "zero1", 7500000000LL, 64, 2).bytes / gb, (6 + 12.0 / 64) * psi / gb, 1e-6);
  EXPECT_NEAR(expected_model_state(master, "zero2", 7500000000LL, 64, 2).bytes / gb, (2 + 16.0 / 64) * psi / gb, 1e-6);
  EXPECT_NEAR(expected_model_state(master, "zero3", 7500000000LL, 64, 2).bytes / gb, 16.0 / 64 * psi / gb, 1e-6);
  EXPECT_EQ(expected_model_state(master, "zero1", 1000, 4, 2).formula, "(2+4)Ψ + (4+8)Ψ/N");
}

TEST(Parallel, FingerprintSeesEveryBitAndPosition) {
  // 5M floats: more than one chunk of the device-side hash.
  const torch::Tensor a = torch::randn({5 * 1000 * 1000});
  const torch::Tensor b = a.clone();
  EXPECT_EQ(suites::fingerprint(a), suites::fingerprint(b));
  b[4500000] = std::nextafter(b[4500000].item<float>(), 1e9f);  // one ulp, in the second chunk
  EXPECT_NE(suites::fingerprint(a), suites::fingerprint(b));
  const torch::Tensor swapped = a.clone();
  swapped[0] = a[1];
  swapped[1] = a[0];
  EXPECT_NE(suites::fingerprint(a), suites::fingerprint(swapped));  // same values, other places
  EXPECT_NE(suites::fingerprint(a.narrow(0, 0, 3)), suites::fingerprint(a.narrow(0, 0, 4)));
  EXPECT_EQ(suites::fingerprint(torch::tensor({true, false, true})), suites::fingerprint(torch::tensor({true, false, true})));
  EXPECT_NE(suites::fingerprint(torch::tensor({true, false, true})), suites::fingerprint(torch::tensor({true, true, true})));
}

TEST(Parallel, CrossRankVerdicts) {
  auto rank = [](std::vector<std::tuple<std::string, std::string, int, std::string>> rows) {
    json f = json::array();
    for (const auto& [s, c, step, v] : rows) f.push_back({s, c, step, v});
    return json{{"every", 5}, {"fingerprints", f}};
  };
  const json r0 = rank({{"parameters", "must-match", 0, "aa"}, {"parameters", "must-match", 5, "bb"},
                        {"data-samples", "should-differ", 0, "d0"}, {"data-samples", "should-differ", 5, "e0"}});
  const json r1 = rank({{"parameters", "must-match", 0, "aa"}, {"parameters", "must-match", 5, "bb"},
                        {"data-samples", "should-differ", 0, "d1"}, {"data-samples", "should-differ", 5, "e0"}});
  const json r2 = rank({{"parameters", "must-match", 0, "aa"}, {"parameters", "must-match", 5, "XX"},
                        {"data-samples", "should-differ", 0, "d2"}, {"data-samples", "should-differ", 5, "e2"}});
  const json v = probes::compare_rng({r0, r1, r2});
  ASSERT_EQ(v["streams"].size(), 2u);
  EXPECT_EQ(v["violations"], 2);
  const json& params = v["streams"][0];
  EXPECT_EQ(params["verdict"], "violated");
  EXPECT_EQ(params["first_violation_step"], 5);
  EXPECT_EQ(params["ranks"], json::array({2}));  // the odd one out of three
  const json& data = v["streams"][1];
  EXPECT_EQ(data["verdict"], "violated");
  EXPECT_EQ(data["first_violation_step"], 5);
  EXPECT_EQ(data["ranks"], json::array({0, 1}));  // identical samples on ranks 0 and 1
  // Two ranks that agree everywhere: no violation.
  const json clean = probes::compare_rng({r0, r0});
  EXPECT_EQ(clean["streams"][0]["verdict"], "ok");
  EXPECT_EQ(clean["streams"][1]["verdict"], "violated");  // r0 twice draws the same data: caught
}

TEST(Parallel, LaunchVariables) {
  using runners::detect_launch;
  EXPECT_FALSE(detect_launch({{"HOME", "/root"}}).has_value());
  auto t = detect_launch({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "10.0.0.5"},
                          {"MASTER_PORT", "29600"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->source, "torchrun");
  EXPECT_EQ(t->rank, 1);
  EXPECT_EQ(t->world_size, 4);
  EXPECT_EQ(t->master_addr, "10.0.0.5");
  EXPECT_EQ(t->master_port, 29600);
  EXPECT_FALSE(t->serve_store);  // torchrun's agent serves the store
  auto s = detect_launch({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "3"},
                          {"SLURM_JOB_NODELIST", "gpu[07-08,11],cpu1"}});
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->source, "slurm");
  EXPECT_EQ(s->rank, 3);
  EXPECT_EQ(s->master_addr, "gpu07");
  EXPECT_EQ(s->master_port, 29500);
  EXPECT_TRUE(s->serve_store);
  // The tasks on this node (what tells a launch that spans hosts): srun -N 2 -n 4 without
  // --ntasks-per-node gives only the step's tasks per node; one node holds the whole world.
  auto per_node = [](std::map<std::string, std::string> env) {
    env.insert({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}});
    return runners::detect_launch(env)->local_world_size;
  };
  EXPECT_EQ(per_node({{"SLURM_NNODES", "2"}, {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}}), 2);
  EXPECT_EQ(per_node({{"SLURM_NNODES", "2"}, {"SLURM_NTASKS_PER_NODE", "2"}}), 2);
  EXPECT_EQ(per_node({{"SLURM_NNODES", "1"}}), 4);
  EXPECT_EQ(per_node({{"SLURM_STEP_NUM_NODES", "1"}, {"SLURM_NNODES", "3"}}), 4);  // the step's nodes, not the job's
  auto m = detect_launch({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                          {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}});
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->source, "mpirun");
  EXPECT_EQ(m->world_size, 2);
  EXPECT_FALSE(detect_launch({{"RANK", "0"}, {"WORLD_SIZE", "1"}}).has_value());  // a world of one
  EXPECT_NE(error_of([] { detect_launch({{"RANK", "4"}, {"WORLD_SIZE", "4"}}); }).find("outside a world of 4"),
            std::string::npos);
  EXPECT_NE(error_of([] { detect_launch({{"RANK", "x"}, {"WORLD_SIZE", "2"}}); }).find("not an integer"),
            std::string::npos);
  EXPECT_NE(error_of([] { detect_launch({{"RANK", "0"}}); }).find("WORLD_SIZE is not set"), std::string::npos);
  EXPECT_EQ(runners::first_slurm_host("node[01-04,07]"), "node01");
  EXPECT_EQ(runners::first_slurm_host("a,b"), "a");
  EXPECT_EQ(runners::first_slurm_host("solo"), "solo");
}

// K steps of every strategy on 2 ranks against one process on the concatenated global batch.
// In fp64, so that the comparison tests the strategies and not the rounding: the ranks sum their
// gradients in another order than one process does, and AdamW's first steps turn a tiny gradient
// difference into an update difference of up to lr/eps times its size. In fp32 that reached 2.5e-5
// on some CPUs (AVX2 against AVX-512 kernels); in fp64 (unit roundoff 1.1e-16) a gradient summed over
// at most 8 x 64 tokens is off by at most 512 x 1.1e-16 x sum|terms| ~ 6e-14 (sum|terms| <= ~1 for a
// mean cross-entropy), AdamW amplifies that by at most lr/eps = 3e-3/1e-8 = 3e5, so each step moves a
// parameter by at most ~2e-8 differently and six steps by ~1.2e-7: atol 1e-6 holds on any CPU. A
// strategy error (a missed average, a wrong shard) moves parameters by ~lr = 3e-3, 3000x above it.
// With SGD (lr 0.05, momentum 0.9) nothing amplifies: six steps move a parameter by at most
// 0.05 x (1 + 1.9 + ... ) ~ 1 times the gradient error, ~6e-14, so atol 1e-9; a missed average
// doubles a whole update (~0.05 x |g|).
TEST(Parallel, StrategiesEqualOneProcessOnTheGlobalBatch) {
  const SuiteRun run = run_suite_text("equal", R"(
name = "equal"
[base]
model = "gpt-tiny"
precision = "64-true"
warmup_steps = 0
steps = 6
eval = false
overflow_every = 0
lr = 3e-3
save_parameters = true
world_size = 2
batch_size = 4
[axes]
parallel = ["ddp", "zero1", "zero2", "zero3"]
checkpoint = ["none", "full"]
[[cells]]
name = "single"
world_size = 1
batch_size = 8
[[cells]]
name = "zero3-no-prefetch"
parallel = "zero3"
prefetch = false
[[cells]]
name = "ws3"
world_size = 3
parallel = "ddp"
[[cells]]
name = "single-sgd"
world_size = 1
batch_size = 8
optimizer = "sgd"
lr = 0.05
[[cells]]
name = "ddp-sgd"
parallel = "ddp"
optimizer = "sgd"
lr = 0.05
[[cells]]
name = "zero3-sgd"
parallel = "zero3"
optimizer = "sgd"
lr = 0.05
)", "--nproc 2");
  const Result& r = run.result;
  const std::string& out = run.out;
  ASSERT_EQ(r.code, 0) << r.out;
  const json& report = run.report;
  const json ws3 = cell_named(report, "ws3");
  EXPECT_EQ(ws3["status"], "skipped");
  EXPECT_NE(ws3["reason"].get<std::string>().find("--nproc 3"), std::string::npos);
  // Local ranks share this host: one node holding both (tests/multinode checks two).
  const json ddp_cell = cell_named(report, "ddp/ckpt-none");
  EXPECT_EQ(ddp_cell["nodes"], json::array({{{"node", 0}, {"host", report["env"]["host"]}, {"ranks", {0, 1}}}})) << ddp_cell["nodes"].dump();
  EXPECT_EQ(ddp_cell["ranks"][1]["host"], report["env"]["host"]);
  EXPECT_FALSE(report["env"].contains("launch"));  // no launcher: local ranks

  const auto single = load_params(out + "/cells/single.params.pt");
  ASSERT_FALSE(single.empty());
  double worst = 0;
  for (const std::string strategy : {"ddp", "zero1", "zero2", "zero3"}) {
    for (const std::string ckpt : {"none", "full"}) {
      const std::string stem = out + "/cells/" + strategy + "_ckpt-" + ckpt;
      const auto r0 = load_params(stem + ".rank0.params.pt");
      const auto r1 = load_params(stem + ".rank1.params.pt");
      ASSERT_EQ(r0.size(), single.size());
      for (size_t i = 0; i < single.size(); ++i) {
        EXPECT_TRUE(torch::equal(r0[i], r1[i])) << strategy << " parameter " << i << " differs between ranks";
        EXPECT_TRUE(torch::allclose(r0[i], single[i], /*rtol=*/0, /*atol=*/1e-6))
            << strategy << "/" << ckpt << " parameter " << i << ": max |diff| "
            << (r0[i] - single[i]).abs().max().item<double>();
        worst = std::max(worst, (r0[i] - single[i]).abs().max().item<double>());
      }
    }
  }
  // AdamW is blind to a gradient's scale (a missed average over ranks would not show); SGD is not.
  const auto single_sgd = load_params(out + "/cells/single-sgd.params.pt");
  for (const std::string strategy : {"ddp", "zero3"}) {
    const auto p = load_params(out + "/cells/" + strategy + "-sgd.rank0.params.pt");
    ASSERT_EQ(p.size(), single_sgd.size());
    for (size_t i = 0; i < p.size(); ++i) {
      EXPECT_TRUE(torch::allclose(p[i], single_sgd[i], /*rtol=*/0, /*atol=*/1e-9)) << strategy << "-sgd parameter " << i;
      worst = std::max(worst, (p[i] - single_sgd[i]).abs().max().item<double>());
    }
  }
  std::printf("largest |parameter - one process| over the strategies: %.3g\n", worst);
  // zero3's prefetch changes when parameters arrive, never what they are; without it every gather is
  // waited for at once, so none of the communication overlaps.
  const auto prefetched = load_params(out + "/cells/zero3_ckpt-none.rank0.params.pt");
  const auto waited = load_params(out + "/cells/zero3-no-prefetch.rank0.params.pt");
  for (size_t i = 0; i < prefetched.size(); ++i) EXPECT_TRUE(torch::equal(prefetched[i], waited[i])) << i;
  EXPECT_LT(cell_named(report, "zero3-no-prefetch")["metrics"]["comm"]["overlap"].get<double>(), 0.01);

  // Memory per rank: measured beside the ZeRO formulas, and zero3 near half of ddp at 2 ranks.
  auto state = [&](const std::string& name) { return cell_named(report, name)["metrics"]["memory"]; };
  for (const std::string strategy : {"ddp", "zero1", "zero2", "zero3"}) {
    const json m = state(strategy + "/ckpt-none");
    const double measured = m["model_state_total_bytes"], expected = m["expected_model_state_bytes"];
    EXPECT_NEAR(measured / expected, 1.0, 0.01) << strategy;  // padding to equal shards is all that differs
  }
  const double ddp = state("ddp/ckpt-none")["model_state_total_bytes"];
  const double zero3 = state("zero3/ckpt-none")["model_state_total_bytes"];
  EXPECT_NEAR(zero3 / ddp, 0.5, 0.01);
  const double single_state = state("single")["model_state_total_bytes"];
  EXPECT_DOUBLE_EQ(ddp, single_state);
}

// The layout is what runs: `dp_shard = 2` (or `layout = "dp_shard2"`) on 2 ranks is zero3, the same
// collectives in the same order, so the same bits; the cells name their layout.
TEST(Parallel, DpShardLayoutIsZero3BitForBit) {
  const SuiteRun run = run_suite_text("layout", R"(
name = "layout"
[base]
model = "gpt-tiny"
warmup_steps = 0
steps = 4
eval = false
overflow_every = 0
save_parameters = true
batch_size = 4
dropout = 0.1
[[cells]]
name = "zero3"
parallel = "zero3"
world_size = 2
[[cells]]
name = "dp_shard"
dp_shard = 2
[[cells]]
name = "layout-key"
layout = "dp_shard2"
)", "--nproc 2");
  ASSERT_EQ(run.result.code, 0) << run.result.out;
  const auto zero3 = load_params(run.out + "/cells/zero3.rank0.params.pt");
  for (const std::string other : {"dp_shard", "layout-key"}) {
    const json cell = cell_named(run.report, other);
    EXPECT_EQ(cell["config"]["world_size"], 2) << "the layout's product sets the world size";
    EXPECT_EQ(cell["layout"]["name"], "dp_shard2");
    EXPECT_EQ(cell["layout"]["sharding"], "zero3");
    const auto p = load_params(run.out + "/cells/" + other + ".rank0.params.pt");
    ASSERT_EQ(p.size(), zero3.size());
    for (size_t i = 0; i < p.size(); ++i) EXPECT_TRUE(torch::equal(p[i], zero3[i])) << other << " parameter " << i;
    EXPECT_EQ(cell["metrics"]["quality"]["step_losses"], cell_named(run.report, "zero3")["metrics"]["quality"]["step_losses"]) << other;
  }
  EXPECT_EQ(cell_named(run.report, "zero3")["layout"]["dp_shard"], 2);
}

// Without a GPU a cell's processes are forks of `trainscope run` (no second load of LibTorch); with
// TRAINSCOPE_CELL_EXEC=1, as on a GPU machine, they start afresh from the binary. The same training either
// way, bit for bit, for one process and for ranks, and the same memory to the byte: a collective's tensors
// are freed on the training thread (suites/parallel/comm.cpp: release_on_this_thread), never whenever
// Gloo's thread drops the finished work, so a rank's peak does not depend on which thread ran first.
TEST(Parallel, ForkedAndFreshCellProcessesTrainTheSame) {
  const std::string suite = write("started.toml", R"(
name = "started"
[base]
model = "gpt-tiny"
warmup_steps = 0
steps = 3
eval = false
overflow_every = 0
save_parameters = true
batch_size = 4
dropout = 0.1
[[cells]]
name = "one"
[[cells]]
name = "zero3"
parallel = "zero3"
world_size = 2
)");
  std::map<std::string, json> report;
  for (const std::string how : {"forked", "started"}) {
    const std::string out = tmp("started-" + how);
    const std::string env = how == "started" ? "TRAINSCOPE_CELL_EXEC=1 " : "";
    const Result r = sh("rm -rf " + out + " && " + env + bin() + " run --suite " + suite + " --nproc 2 --out " + out);
    ASSERT_EQ(r.code, 0) << r.out;
    report[how] = read_json(out + "/report.json");
    EXPECT_EQ(report[how]["env"]["cell_processes"], how);
  }
  for (const std::string cell : {"one", "zero3"}) {
    const std::string params = cell == "one" ? "/cells/one.params.pt" : "/cells/zero3.rank0.params.pt";
    const auto forked = load_params(tmp("started-forked") + params), fresh = load_params(tmp("started-started") + params);
    ASSERT_EQ(forked.size(), fresh.size()) << cell;
    for (size_t i = 0; i < forked.size(); ++i) EXPECT_TRUE(torch::equal(forked[i], fresh[i])) << cell << " parameter " << i;
    EXPECT_EQ(cell_named(report["forked"], cell)["metrics"]["quality"]["step_losses"],
              cell_named(report["started"], cell)["metrics"]["quality"]["step_losses"]) << cell;
    for (const char* bytes : {"peak_bytes", "activation_bytes", "step_peak_bytes"})
      EXPECT_EQ(cell_named(report["forked"], cell)["metrics"]["memory"][bytes], cell_named(report["started"], cell)["metrics"]["memory"][bytes])
          << cell << " " << bytes;
  }
}

// The pipeline tests' runs: a 4-layer untied Llama in fp64, 3 SGD steps of 4 micro-batches per rank.
const std::string kPipelineBase = "model = \"my-llama\"\n" + kExactBase + "batch_size = 8\npp_microbatches = 4\n";
constexpr const char* kPipelineLlama = R"([models.my-llama]
family = "llama"
layers = 4
d_model = 32
heads = 4
kv_heads = 2
ffn = 64
seq_len = 16
vocab = 256
tied = false
)";
// The two runs compared: the other dimension alone on 2 ranks accumulating the micro-batches, and with
// pp 2 on 4 ranks.
constexpr const char* kAccumulateAndPipeline = R"(
[[cells]]
name = "accumulate"
world_size = 2
[[cells]]
name = "1f1b"
pp = 2
world_size = 4
)";

// FSDP inside each pipeline stage: pp 2 x dp_shard 2 on 4 ranks against dp_shard 2 alone accumulating
// the same 4 micro-batches per rank on 2 ranks, and the 3-D pp 2 x dp_shard 2 x tp 2 on 8 ranks against
// dp_shard 2 x tp 2 on 4. Both average the same gradients over the same two
// data-parallel ranks; the stage keeps its blocks gathered and reduce-scatters their summed gradient once,
// (sum_j a_j + sum_j b_j) / 2, where accumulation reduce-scatters each micro-batch's, sum_j (a_j + b_j) / 2:
// 2m = 8 fp64 terms reassociated per step, at most 8 x 2^-53 of the gradient's size, over 2 SGD steps of
// lr 0.05 (atol 1e-12). With grad_clip the norm sums each stage's shards over dp_shard, then the stages
// over pp, in fp64 like the one it is compared with. Both pipelines' ranks end with the same whole model.
// zb-1p likewise (its W the sharded blocks' second backward).
TEST(Parallel, PipelineWithFsdpEqualsFsdpAccumulatingTheMicroBatches) {
  const SuiteRun run = run_suite_text("pipeline-fsdp", R"(
name = "pipeline-fsdp"
[base]
)" + kPipelineBase + R"(
dp_shard = 2
)" + kPipelineLlama + kAccumulateAndPipeline + R"(
[[cells]]
name = "1f1b-full"
pp = 2
world_size = 4
checkpoint = "full"
[[cells]]
name = "accumulate-clip"
world_size = 2
grad_clip = 0.05
[[cells]]
name = "1f1b-clip"
pp = 2
world_size = 4
grad_clip = 0.05
[[cells]]
name = "3d/accumulate"
tp = 2
world_size = 4
[[cells]]
name = "3d/1f1b"
tp = 2
pp = 2
world_size = 8
[[cells]]
name = "zb"
pp = 2
world_size = 4
pp_schedule = "zb-1p"
[[cells]]
name = "bf16/1f1b"
pp = 2
world_size = 4
precision = "bf16-master"
[[cells]]
name = "bf16/zb-full"
pp = 2
world_size = 4
precision = "bf16-master"
pp_schedule = "zb-1p"
checkpoint = "full"
)", "--nproc 8");
  ASSERT_EQ(run.result.code, 0) << run.result.out;
  // The clipped cells' norm: each stage's shards summed over dp_shard, then the stages over pp. The 3-D
  // cells (pp 2 x dp_shard 2 x tp 2 on 8 ranks) against dp_shard 2 x tp 2 accumulating on 4.
  const std::map<std::string, std::string> against{{"1f1b", "accumulate"},           {"1f1b-full", "accumulate"},
                                                   {"1f1b-clip", "accumulate-clip"}, {"3d_1f1b", "3d_accumulate"},
                                                   {"zb", "accumulate"}};
  for (const auto& [cell, reference] : against) {
    const auto one = load_params(run.out + "/cells/" + reference + ".rank0.params.pt");
    ASSERT_FALSE(one.empty());
    const auto pp = load_params(run.out + "/cells/" + cell + ".rank0.params.pt");
    const auto last = load_params(run.out + "/cells/" + cell + ".rank3.params.pt");  // another pipeline's rank
    ASSERT_EQ(pp.size(), one.size()) << cell;
    ASSERT_EQ(last.size(), one.size()) << cell;
    for (size_t i = 0; i < one.size(); ++i) {
      EXPECT_TRUE(torch::allclose(pp[i], one[i], /*rtol=*/0, /*atol=*/1e-12)) << cell << " parameter " << i << ": max |diff| "
                                                                                 << (pp[i] - one[i]).abs().max().item<double>();
      EXPECT_TRUE(torch::equal(last[i], pp[i])) << cell << " rank 3 parameter " << i;
    }
  }
  // zb-1p's W (the sharded blocks' second backward, then their deferred reduction) adds each micro-batch's
  // gradients into the unsharded ones in 1f1b's order: under bf16 with fp32 masters, with a checkpointed
  // block recomputed for I and again for W, the same bits as 1f1b.
  const auto bf16 = load_params(run.out + "/cells/bf16_1f1b.rank0.params.pt"), bf16_zb = load_params(run.out + "/cells/bf16_zb-full.rank0.params.pt");
  ASSERT_EQ(bf16.size(), bf16_zb.size());
  for (size_t i = 0; i < bf16.size(); ++i) EXPECT_TRUE(torch::equal(bf16[i], bf16_zb[i])) << "bf16-master parameter " << i;
  EXPECT_EQ(cell_named(run.report, "1f1b")["layout"]["name"], "pp2-dp_shard2");
  EXPECT_EQ(cell_named(run.report, "3d/1f1b")["layout"]["name"], "pp2-dp_shard2-tp2");
  // The planner replays the stage's kept blocks and deferred reduction (plan/step.cpp: kept_unit_block):
  // both stages' model state exact, rank 0's peak within the planner's worst-case target (10%).
  const Result check = ts("plan --check " + run.out + " --format json");
  ASSERT_EQ(check.code, 0) << check.out;
  const json rows = json::parse(check.out)["cells"];
  int planned = 0;
  for (const auto& row : rows) {
    if (row["cell"].get<std::string>().find("1f1b") == std::string::npos && row["cell"].get<std::string>().find("zb") == std::string::npos) continue;
    ++planned;
    EXPECT_EQ(row["model_state_error"], 0.0) << row.dump();
    EXPECT_EQ(row.value("last_stage_model_state_error", -1.0), 0.0) << row.dump();  // rank 2 (3-D: 4), the first pipeline's last stage
    EXPECT_LE(std::fabs(row["peak_error"].get<double>()), 0.10) << row.dump();
  }
  EXPECT_EQ(planned, 7);
}

// Tensor parallelism inside each pipeline stage: pp 2 x tp 2 on 4 ranks against tp 2 alone accumulating
// the same 4 micro-batches on 2 ranks, with and without sequence parallelism (the hidden states between
// the stages then each tp rank's S / 2 of them). Each tp pair of a stage runs the same shards of the same
// layers on the same micro-batch, its two-rank sums are a + b in either run, and the gradients accumulate
// in the same order: the parameters are equal bit for bit.
TEST(Parallel, PipelineWithTensorParallelEqualsTensorParallelAccumulating) {
  const SuiteRun run = run_suite_text("pipeline-tp", R"(
name = "pipeline-tp"
[base]
)" + kPipelineBase + R"(
tp = 2
rng_every = 1
)" + kPipelineLlama + kAccumulateAndPipeline + R"(
[[cells]]
name = "sp/accumulate"
world_size = 2
sequence_parallel = true
[[cells]]
name = "sp/1f1b"
pp = 2
world_size = 4
sequence_parallel = true
[[cells]]
name = "clip/accumulate"
world_size = 2
grad_clip = 0.05
[[cells]]
name = "clip/1f1b"
pp = 2
world_size = 4
grad_clip = 0.05
[[cells]]
name = "zb"
pp = 2
world_size = 4
pp_schedule = "zb-1p"
[[cells]]
name = "sp/zb"
pp = 2
world_size = 4
sequence_parallel = true
pp_schedule = "zb-1p"
)", "--nproc 4");
  ASSERT_EQ(run.result.code, 0) << run.result.out;
  // Clipped, the norm sums each stage's tp shards over tp, then the stages over pp: a reassociation of
  // the fp64 sum of squares (atol 1e-12, as the other reassociations here).
  const auto clipped = load_params(run.out + "/cells/clip_accumulate.rank0.params.pt");
  for (const std::string rank : {"rank0", "rank3"}) {
    const auto pp = load_params(run.out + "/cells/clip_1f1b." + rank + ".params.pt");
    ASSERT_EQ(pp.size(), clipped.size()) << rank;
    for (size_t i = 0; i < pp.size(); ++i)
      EXPECT_TRUE(torch::allclose(pp[i], clipped[i], /*rtol=*/0, /*atol=*/1e-12)) << "clip " << rank << " parameter " << i;
  }
  for (const std::string prefix : {"", "sp_"}) {
    const auto one = load_params(run.out + "/cells/" + prefix + "accumulate.rank0.params.pt");
    ASSERT_FALSE(one.empty());
    for (const std::string rank : {"1f1b.rank0", "1f1b.rank3", "zb.rank0", "zb.rank3"}) {  // zb-1p: its W from the tp layers' meets
      const auto pp = load_params(run.out + "/cells/" + prefix + rank + ".params.pt");
      ASSERT_EQ(pp.size(), one.size()) << prefix << rank;
      for (size_t i = 0; i < one.size(); ++i)
        EXPECT_TRUE(torch::equal(pp[i], one[i])) << prefix << rank << " parameter " << i << ": max |diff| "
                                                 << (pp[i] - one[i]).abs().max().item<double>();
    }
  }
  EXPECT_EQ(cell_named(run.report, "1f1b")["layout"]["name"], "pp2-tp2");
  // Every rank's generators are told apart by its stage and tp rank: no RNG finding.
  EXPECT_EQ(cell_named(run.report, "sp/1f1b")["metrics"]["rng"].value("violations", -1), 0) << cell_named(run.report, "sp/1f1b")["metrics"]["rng"].dump();
}

// A layout that cannot run is one line and exit 2 before any rank starts: degrees whose product is not
// the world size, a degree the model cannot take, a dimension (or a setting under tp) this build does not implement.
TEST(Parallel, BadLayoutsAreOneLineErrors) {
  for (const auto& [sets, says] : std::vector<std::pair<std::string, std::string>>{
           {"--set dp_shard=2 --set world_size=4", "needs 2 ranks"},
           {"--set layout=dp_shard2-tp3", "does not divide the 4 attention heads"},
           {"--set layout=dp2", "expected dimensions joined by '-'"},
           {"--set parallel=zero3 --set dp_replicate=2 --set world_size=4", "means dp_shard4"},
           {"--set layout=dp_shard2 --set dp_shard=4", "has dp_shard 2, but dp_shard = 4"},
           {"--set pp=2 --set dp_replicate=2", "pp with other dimensions than tp and dp_shard at zero3 (layout pp2-dp_replicate2) is not implemented"},
           {"--set pp=2 --set pp_microbatches=3", "pp_microbatches 3 does not divide batch_size"},
           {"--set pp=2 --set pp_schedule=interleaved-1f1b", "4 pipeline stages (pp 2 x pp_virtual 2) are more than the 2 layers"},
           {"--set cp=2 --set pp=2", "cp with pp (layout pp2-cp2) is not implemented"}}) {
    const Result r = ts("run --suite quick --filter gpt-tiny/32-true --nproc 4 --out " + tmp("bad-layout") + " " + sets);
    EXPECT_EQ(r.code, 2) << sets << "\n" << r.out;
    EXPECT_NE(r.out.find(says), std::string::npos) << sets << "\n" << r.out;
    EXPECT_LE(lines(r.out), 2) << sets << "\n" << r.out;
  }
}

// GPT under tensor parallelism (its fused q, k, v split by heads and fc by columns, proj and fc_proj by
// rows with their biases added after the reduction, the tied head and the loss on vocabulary shards)
// equals one process on the same batch: in fp64 the split only reorders sums, the bound of
// StrategiesEqualOneProcessOnTheGlobalBatch (atol 1e-6 after six AdamW steps); a wrong split (q, k, v by
// plain row blocks, a bias added on both ranks) moves parameters by ~lr = 3e-3. Dropout inside the tp
// region (attention's heads; with sequence parallelism every shard) draws from Megatron's
// model-parallel generator, different on the tp ranks; a recomputed block draws the same masks again
// (checkpoint_check: recomputation equal to the forward, on both attention paths); one model-parallel
// seed for all tp ranks (tp-same-dropout-seed) is caught by the RNG probe. sp_regather (Megatron's
// re-gathering in backward) trains the same model with the activations and communication it predicts.
TEST(Parallel, GptTensorParallelEqualsOneProcessAndSplitsItsDropout) {
  const SuiteRun run = run_suite_text("gpt-tp", R"(
name = "gpt-tp"
[base]
model = "gpt-tiny"
precision = "64-true"
warmup_steps = 0
steps = 6
eval = false
overflow_every = 0
lr = 3e-3
save_parameters = true
batch_size = 8
rng_every = 2
[[cells]]
name = "single"
[[cells]]
name = "tp2"
tp = 2
[[cells]]
name = "tp2-sp"
tp = 2
sequence_parallel = true
[[cells]]
name = "tp2-sp-full"
tp = 2
sequence_parallel = true
checkpoint = "full"
[[cells]]
name = "clip/single"
grad_clip = 0.05
optimizer = "sgd"
lr = 0.05
[[cells]]
name = "clip/tp2-sp"
tp = 2
sequence_parallel = true
grad_clip = 0.05
optimizer = "sgd"
lr = 0.05
[[cells]]
name = "tp2-sp-regather"
tp = 2
sequence_parallel = true
sp_regather = true
[[cells]]
name = "dropout/tp2-sp-regather-full"
tp = 2
sequence_parallel = true
sp_regather = true
checkpoint = "full"
dropout = 0.1
checkpoint_check = true
[[cells]]
name = "dropout/tp2-sp-full"
tp = 2
sequence_parallel = true
checkpoint = "full"
dropout = 0.1
checkpoint_check = true
[[cells]]
name = "dropout/tp2-sdpa-full"
tp = 2
attention = "sdpa"
checkpoint = "full"
dropout = 0.1
checkpoint_check = true
[[cells]]
name = "dropout/tp2-same-seed"
tp = 2
dropout = 0.1
inject = "tp-same-dropout-seed"
)", "--nproc 2");
  ASSERT_EQ(run.result.code, 0) << run.result.out;
  const auto single = load_params(run.out + "/cells/single.params.pt");
  ASSERT_FALSE(single.empty());
  for (const std::string cell : {"tp2", "tp2-sp", "tp2-sp-full", "tp2-sp-regather"}) expect_ranks_match(run.out, cell, 1, single, 1e-6);
  // grad_clip under tp: the norm of the whole gradient (split parameters summed over the ranks, whole
  // ones once), as one process clips it; with SGD the clip (0.05, below the gradient's norm) scales every
  // update, so a norm with a part counted twice or left out moves the parameters by a factor of it.
  const auto clipped = load_params(run.out + "/cells/clip_single.params.pt");
  expect_ranks_match(run.out, "clip_tp2-sp", 1, clipped, 1e-6);
  auto tp_stream = [](const json& cell) {
    for (const auto& s : cell["metrics"]["rng"]["streams"])
      if (s["name"].get<std::string>().rfind("tp-dropout-generator", 0) == 0) return s;
    ADD_FAILURE() << cell["name"] << " has no tp-dropout-generator stream";
    return json::object();
  };
  // Megatron's re-gathering keeps each column-parallel input's sequence shard instead of the gathered
  // input (2 per block and the head's: 2L + 1 = 5 of [B, S, D] = 8 x 64 x 64 fp64 values, 262,144 B each,
  // of which a shard is half) and all-gathers each once more in backward.
  const double gathered = 8.0 * 64 * 64 * 8, enters = 5;
  auto metric = [&](const char* name) { return cell_named(run.report, name)["metrics"]; };
  EXPECT_EQ(metric("tp2-sp")["memory"]["activation_bytes"].get<double>() - metric("tp2-sp-regather")["memory"]["activation_bytes"].get<double>(),
            enters * gathered / 2);
  // Exact because no tensor of a step dies on Gloo's thread: a reduce-scatter's whole input, left to the
  // work that thread holds, would be freed whenever it gets to it, before or after the step's peak.
  for (const char* cell : {"tp2-sp", "tp2-sp-regather"}) EXPECT_EQ(metric(cell)["memory"]["freed_off_thread_bytes"], 0) << cell;
  EXPECT_EQ(metric("tp2-sp-regather")["comm"]["dimensions"]["tp"]["bytes"].get<double>() - metric("tp2-sp")["comm"]["dimensions"]["tp"]["bytes"].get<double>(),
            enters * gathered);
  // Throughput: the tp pair steps through one data-parallel slice of 8 sequences, each device doing half
  // of its work; MFU divides the global FLOP/s by both devices' peaks.
  const json t = metric("tp2")["timing"];
  EXPECT_NEAR(t["samples_per_s"].get<double>(), 8 / t["step_time_s"]["mean"].get<double>(), 1e-9 * t["samples_per_s"].get<double>());
  EXPECT_NEAR(t["samples_per_s_per_device"].get<double>(), t["samples_per_s"].get<double>() / 2, 1e-9 * t["samples_per_s"].get<double>());
  EXPECT_NEAR(t["mfu"].get<double>(), t["samples_per_s"].get<double>() * t["flops_per_sample"].get<double>() / (2 * t["peak_flops_per_s"].get<double>()),
              1e-9);
  for (const char* name : {"dropout/tp2-sp-full", "dropout/tp2-sdpa-full", "dropout/tp2-sp-regather-full"}) {
    const json cell = cell_named(run.report, name);
    EXPECT_EQ(cell["status"], "ok") << name;
    EXPECT_GT(cell["checkpoint_determinism"]["compared"].get<int64_t>(), 0) << name;
    EXPECT_EQ(cell["checkpoint_determinism"]["max_abs_diff"].get<double>(), 0.0) << name;
    EXPECT_EQ(cell["metrics"]["rng"]["violations"], 0) << name;
    EXPECT_EQ(tp_stream(cell)["verdict"], "ok") << name;
  }
  const json same = cell_named(run.report, "dropout/tp2-same-seed");
  EXPECT_EQ(same["metrics"]["rng"]["violations"], 1) << same["metrics"]["rng"].dump();
  EXPECT_EQ(tp_stream(same)["verdict"], "violated");
  EXPECT_EQ(tp_stream(same)["ranks"], json::array({0, 1}));
}

// Pipeline parallelism on 2 ranks, each schedule against one process accumulating the same 4
// micro-batches' gradients: every stage runs the same layers on the same micro-batch as the one process,
// the boundary's hidden states and gradients travel as exact bits, and each parameter's gradient
// accumulates micro-batch by micro-batch in the same order (the schedules backward 0..3 on every stage),
// so the parameters are equal bit for bit (an untied Llama: nothing is summed across ranks). A tied head
// (GPT, under each schedule) is the one exception: its two halves, the embedding's on the first stage's
// rank and the head's on the last's, are summed once per step rather than per micro-batch, a
// reassociation of 2m = 8 fp64 terms: at most 8 x 2^-53 of the gradient's size per step (atol 1e-12
// over these 3 SGD steps of lr 0.05).
// zb-1p's split backward (I, then W from the nodes where the weights meet the input's path) runs the
// same kernels on the same gradients, under every checkpoint policy (a checkpointed block recomputed once
// for I and once for W, selective-op serving its kept outputs to both).
// Each rank's measured in-flight peak equals the schedule's replay, and so does the bubble's formula.
TEST(Parallel, PipelineSchedulesEqualOneProcessAccumulatingTheMicroBatches) {
  const SuiteRun run = run_suite_text("pipeline", R"(
name = "pipeline"
[base]
)" + kPipelineBase + kPipelineLlama + R"(
[[cells]]
name = "accumulate"
[[cells]]
name = "gpipe"
pp = 2
pp_schedule = "gpipe"
[[cells]]
name = "1f1b"
pp = 2
[[cells]]
name = "interleaved"
pp = 2
pp_schedule = "interleaved-1f1b"
[[cells]]
name = "1f1b-full"
pp = 2
checkpoint = "full"
[[cells]]
name = "1f1b-split"
pp = 2
pp_split = "1,3"
[[cells]]
name = "zb"
pp = 2
pp_schedule = "zb-1p"
[[cells]]
name = "zb-interleaved"
pp = 2
pp_schedule = "zb-1p"
pp_virtual = 2
[[cells]]
name = "zb-full"
pp = 2
pp_schedule = "zb-1p"
checkpoint = "full"
[[cells]]
name = "zb-selective-op"
pp = 2
pp_schedule = "zb-1p"
pp_virtual = 2
checkpoint = "selective-op"
[[cells]]
name = "bf16/1f1b"
pp = 2
precision = "bf16-master"
[[cells]]
name = "bf16/zb"
pp = 2
pp_schedule = "zb-1p"
precision = "bf16-master"
[[cells]]
name = "gpt/accumulate"
model = "gpt-tiny"
batch_size = 4
[[cells]]
name = "gpt/1f1b"
model = "gpt-tiny"
batch_size = 4
pp = 2
grad_clip = 0.05
[[cells]]
name = "gpt/accumulate-clip"
model = "gpt-tiny"
batch_size = 4
grad_clip = 0.05
[[cells]]
name = "gpt/gpipe"
model = "gpt-tiny"
batch_size = 4
pp = 2
pp_schedule = "gpipe"
grad_clip = 0.05
[[cells]]
name = "gpt/zb"
model = "gpt-tiny"
batch_size = 4
pp = 2
pp_schedule = "zb-1p"
grad_clip = 0.05
[[cells]]
name = "gpt4/accumulate-clip"
model = "gpt-tiny"
layers = 4
batch_size = 4
grad_clip = 0.05
[[cells]]
name = "gpt4/interleaved"
model = "gpt-tiny"
layers = 4
batch_size = 4
pp = 2
pp_schedule = "interleaved-1f1b"
grad_clip = 0.05
[[cells]]
name = "gpt4/zb-interleaved"
model = "gpt-tiny"
layers = 4
batch_size = 4
pp = 2
pp_schedule = "zb-1p"
pp_virtual = 2
grad_clip = 0.05
)", "--nproc 2");
  ASSERT_EQ(run.result.code, 0) << run.result.out;
  const Result valid = validate_report(run.out + "/report.json");  // the pipeline section and the send/recv rows
  EXPECT_EQ(valid.code, 0) << valid.out;
  // Every rank saves the whole model, each stage's parameters broadcast from its rank: the two equal.
  auto joined = [&](const std::string& cell) {
    const std::vector<torch::Tensor> out = load_params(run.out + "/cells/" + cell + ".rank0.params.pt");
    const auto r1 = load_params(run.out + "/cells/" + cell + ".rank1.params.pt");
    EXPECT_EQ(out.size(), r1.size()) << cell;
    for (size_t i = 0; i < out.size() && i < r1.size(); ++i)
      EXPECT_TRUE(out[i].numel() > 0 && torch::equal(out[i], r1[i])) << cell << " parameter " << i;
    return out;
  };
  const auto one = load_params(run.out + "/cells/accumulate.params.pt");
  ASSERT_FALSE(one.empty());
  for (const std::string cell : {"gpipe", "1f1b", "interleaved", "1f1b-full", "1f1b-split", "zb", "zb-interleaved", "zb-full", "zb-selective-op"}) {
    const auto pp = joined(cell);
    ASSERT_EQ(pp.size(), one.size()) << cell;
    for (size_t i = 0; i < one.size(); ++i)
      EXPECT_TRUE(torch::equal(pp[i], one[i])) << cell << " parameter " << i << ": max |diff| " << (pp[i] - one[i]).abs().max().item<double>();
    EXPECT_EQ(cell_named(run.report, cell)["metrics"]["quality"]["final_loss"], cell_named(run.report, "accumulate")["metrics"]["quality"]["final_loss"]) << cell;
  }
  // fp32 masters on one rank per stage (each block's unit reduces its own gradient in backward): zb-1p's
  // W takes it there, in 1f1b's order, the same bits.
  const auto bf16 = joined("bf16_1f1b"), bf16_zb = joined("bf16_zb");
  ASSERT_EQ(bf16.size(), bf16_zb.size());
  for (size_t i = 0; i < bf16.size(); ++i) EXPECT_TRUE(torch::equal(bf16[i], bf16_zb[i])) << "bf16-master parameter " << i;
  // GPT (a tied head) under every schedule, against one process on the same layers.
  const std::map<std::string, std::string> gpt_against{{"gpt_1f1b", "gpt_accumulate-clip"}, {"gpt_gpipe", "gpt_accumulate-clip"},
                                                       {"gpt_zb", "gpt_accumulate-clip"}, {"gpt4_interleaved", "gpt4_accumulate-clip"},
                                                       {"gpt4_zb-interleaved", "gpt4_accumulate-clip"}};
  for (const auto& [cell, reference] : gpt_against) {
    const auto gpt_one = load_params(run.out + "/cells/" + reference + ".params.pt");
    const auto gpt_pp = joined(cell);
    ASSERT_EQ(gpt_pp.size(), gpt_one.size()) << cell;
    for (size_t i = 0; i < gpt_one.size(); ++i)
      EXPECT_TRUE(torch::allclose(gpt_pp[i], gpt_one[i], /*rtol=*/0, /*atol=*/1e-12)) << cell << " parameter " << i;
  }
  // In flight on ranks 0 and 1 (p = 2, m = 4): gpipe m, 1f1b p - r, interleaved (v = 2) 2(p-1-r) + (v-1)p + 1
  // chunks, zb-1p pv until their W; bubbles (p-1)/m, (p-1)/vm and zb-1p's (p-1)/3vm. The bytes: every
  // micro-batch's [2, 16, 32] fp64 hidden states (8 KiB) one way and their gradient back over each
  // boundary a rank touches (1, or 3 with two stages per rank).
  const std::map<std::string, std::array<double, 5>> expect{{"gpipe", {4, 4, 0.25, 1}},       {"1f1b", {2, 1, 0.25, 1}},
                                                            {"interleaved", {5, 3, 0.125, 3}}, {"zb", {2, 2, 0.25 / 3, 1}},
                                                            {"zb-interleaved", {4, 4, 0.125 / 3, 3}}};
  for (const auto& [cell, e] : expect)
    for (int r = 0; r < 2; ++r) {
      const json rank = read_json(run.out + "/cells/" + cell + ".rank" + std::to_string(r) + ".json");
      const json p = rank["metrics"]["timing"]["pipeline"];
      EXPECT_EQ(p["in_flight_microbatches"]["measured"], e[static_cast<size_t>(r)]) << cell << " rank " << r << p.dump();
      EXPECT_EQ(p["in_flight_microbatches"]["formula"], e[static_cast<size_t>(r)]) << cell << " rank " << r;
      EXPECT_DOUBLE_EQ(p["bubble"]["formula"].get<double>(), e[2]) << cell;
      EXPECT_GE(p["bubble"]["measured"].get<double>(), 0.0) << cell;
      EXPECT_EQ(p["p2p_bytes_per_step"].get<double>(), e[3] * 2 * 4 * (2 * 16 * 32 * 8)) << cell << " rank " << r;
    }
}

// hsdp on 4 ranks in two shard groups of 2: each block's gradients reduce-scattered within the group,
// each slice then all-reduced with the other group's, so K steps still equal one process on the
// global batch of 16 (fp64, as the test above: a mean over 2 then over 2 rounds differently from one
// over 4 by ~1e-16 relative, far inside its atol; a missed average over the replicas halves or doubles
// SGD's whole update, ~0.05 x |g|). Per rank it holds the model state of zero3 over 2, not over 4.
TEST(Parallel, HsdpEqualsOneProcessAndShardsWithinItsGroup) {
  const SuiteRun run = run_suite_text("hsdp", R"(
name = "hsdp"
[base]
model = "gpt-tiny"
precision = "64-true"
warmup_steps = 0
steps = 6
eval = false
overflow_every = 0
save_parameters = true
optimizer = "sgd"
lr = 0.05
world_size = 4
batch_size = 4
[[cells]]
name = "single"
world_size = 1
batch_size = 16
[[cells]]
name = "hsdp"
parallel = "hsdp"
hsdp_shard_size = 2
[[cells]]
name = "zero3"
parallel = "zero3"
)", "--nproc 4");
  ASSERT_EQ(run.result.code, 0) << run.result.out;
  const json& report = run.report;
  // A shard size that does not divide the ranks is a layout that cannot be: one line, before any rank.
  const Result bad = ts("run --suite quick --filter gpt-tiny --out " + tmp("hsdp-bad") +
                        " --set parallel=hsdp --set world_size=4 --set hsdp_shard_size=3 --nproc 4");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("hsdp_shard_size 3 does not divide the 4 data-parallel ranks"), std::string::npos) << bad.out;

  const auto single = load_params(run.out + "/cells/single.params.pt");
  ASSERT_FALSE(single.empty());
  std::vector<std::vector<torch::Tensor>> ranks;
  for (int r = 0; r < 4; ++r) ranks.push_back(load_params(run.out + "/cells/hsdp.rank" + std::to_string(r) + ".params.pt"));
  for (size_t i = 0; i < single.size(); ++i) {
    for (int r = 1; r < 4; ++r) EXPECT_TRUE(torch::equal(ranks[0][i], ranks[r][i])) << "rank " << r << " parameter " << i;
    EXPECT_TRUE(torch::allclose(ranks[0][i], single[i], /*rtol=*/0, /*atol=*/1e-9))
        << "parameter " << i << ": max |diff| " << (ranks[0][i] - single[i]).abs().max().item<double>();
  }

  // The gathers and reduce-scatters run in the shard group, the gradient slices' all-reduce in the
  // replica group; this host holds all four ranks, so both groups are intra-node.
  const json hsdp = cell_named(report, "hsdp");
  ASSERT_EQ(hsdp["status"], "ok") << hsdp.dump();
  std::set<std::string> ops;
  for (const json& row : hsdp["metrics"]["comm"]["collectives"]) {
    ASSERT_TRUE(row.contains("level")) << row.dump();
    EXPECT_EQ(row["level"], "intra-node");
    EXPECT_EQ(row["group_size"], 2) << row.dump();
    ops.insert(row["op"].get<std::string>());
  }
  EXPECT_EQ(ops, (std::set<std::string>{"all-gather", "reduce-scatter", "all-reduce"}));
  for (const json& row : cell_named(report, "zero3")["metrics"]["comm"]["collectives"]) {
    EXPECT_FALSE(row.contains("level")) << row.dump();
    EXPECT_NE(row["op"], "all-reduce");  // zero3 reduce-scatters over the world, nothing more
  }
  // Model state: zero3's formula over the shard group (N = 2), twice zero3's over 4 ranks.
  const json m = hsdp["metrics"]["memory"];
  EXPECT_EQ(m["expected_model_state_formula"], "(8+8+8)Ψ/N");
  EXPECT_NEAR(m["model_state_total_bytes"].get<double>() / m["expected_model_state_bytes"].get<double>(), 1.0, 0.01);
  const double z3 = cell_named(report, "zero3")["metrics"]["memory"]["model_state_total_bytes"];
  EXPECT_NEAR(m["model_state_total_bytes"].get<double>() / z3, 2.0, 0.02);
}

// grad_clip under tp composed with data parallelism: each optimizer tensor (a parameter, or a slice of
// a flat buffer) counts the ranges of the parameters its rank counts (split ones on both tp ranks,
// whole ones on tp rank 0), summed over the gradient slices' group and then over tp: the norm of the
// whole gradient, as one process takes it. fp64 with SGD and a clip (0.05) below the gradient's norm, so
// that the norm scales every update: one process and each layout then differ only by the order of the
// sums (~1e-16 relative; atol 1e-9 as the hsdp test above), while a part counted twice or left out (a
// whole parameter on both tp ranks, a missing sum over the slices) changes the norm by at least the
// smallest parameter's share of it and so moves the parameters by far more.
TEST(Parallel, TensorParallelClipsTheWholeGradientUnderEveryLayout) {
  const SuiteRun run = run_suite_text("tp-clip", R"(
name = "tp-clip"
[base]
model = "gpt-tiny"
precision = "64-true"
warmup_steps = 0
steps = 4
eval = false
overflow_every = 0
save_parameters = true
optimizer = "sgd"
lr = 0.05
grad_clip = 0.05
batch_size = 4
[[cells]]
name = "single"
batch_size = 8
[[cells]]
name = "dp_shard2-tp2"
layout = "dp_shard2-tp2"
[[cells]]
name = "dp_shard2-tp2-zero2"
layout = "dp_shard2-tp2-zero2"
sequence_parallel = true
[[cells]]
name = "dp_replicate2-tp2"
layout = "dp_replicate2-tp2"
)", "--nproc 4");
  ASSERT_EQ(run.result.code, 0) << run.result.out;
  const auto single = load_params(run.out + "/cells/single.params.pt");
  ASSERT_FALSE(single.empty());
  for (const std::string cell : {"dp_shard2-tp2", "dp_shard2-tp2-zero2", "dp_replicate2-tp2"}) expect_ranks_match(run.out, cell, 3, single, 1e-9);
}

// zero1 reduces as DDP does: bucket by bucket during backward (c10d's Reducer); zero2 reduces each
// bucket to the ranks owning its part of the flat buffer, also during backward (DeepSpeed's
// overlap_comm). With small buckets the collectives are several, they add up to the gradient bytes
// once, and part of their time overlaps backward.
TEST(Parallel, Zero1AndZero2ReduceBucketsDuringBackward) {
  const auto run = run_suite_text("zero12-buckets", R"(
name = "zero12-buckets"
[base]
model = "gpt-tiny"
batch_size = 4
warmup_steps = 1
steps = 4
eval = false
overflow_every = 0
world_size = 2
bucket_mb = 0.25
[axes]
parallel = ["zero1", "zero2"]
)", "--nproc 2");
  ASSERT_EQ(run.result.code, 0) << run.result.out;
  for (const auto& [name, op] : {std::pair<std::string, std::string>{"zero1", "all-reduce"}, {"zero2", "reduce-scatter"}}) {
    const json comm = cell_named(run.report, name)["metrics"]["comm"];
    int64_t bucket_bytes = 0, buckets = 0;
    for (const auto& c : comm["collectives"]) {
      if (c["op"] != op) continue;
      EXPECT_EQ(c["count"], 4) << name << ": " << c.dump();  // once per measured step
      bucket_bytes += c["bytes"].get<int64_t>();
      ++buckets;
    }
    EXPECT_GE(buckets, 2) << name;
    EXPECT_EQ(bucket_bytes, 120576 * 4) << name;  // every fp32 gradient of gpt-tiny, once
    EXPECT_GT(comm["overlap"].get<double>(), 0.0) << name;
  }
}

// The device clock (NCCL's CUDA events on a GPU; here a fixed clock on Gloo's works): a blocking
// collective reports the device time of its works, all of it exposed; an asynchronous one is held
// until flush() and reported with the device time, its exposed part capped at it; a clock that throws
// leaves the host's figure; without a clock report_after reports at once. 2^-7 s is exact in binary,
// so sums of a few of them compare with ==.
TEST(Parallel, DeviceClockTimesCollectivesAndHoldsAsyncOnesUntilFlush) {
  constexpr double kTick = 1.0 / 128;
  c10d::TCPStoreOptions opts;
  opts.port = 0;
  opts.isServer = true;
  opts.waitWorkers = false;
  auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
  const int port = server->getPort();
  std::vector<CollectiveInfo> seen[2];
  size_t before_flush[2] = {0, 0};
  auto rank = [&](int r) {
    suites::Communicator comm(suites::Rendezvous{"127.0.0.1", port, "clock", r, 2}, "gloo", torch::Device("cpu"), 30);
    comm.set_observer([&seen, r](const CollectiveInfo& c) { seen[r].push_back(c); });
    comm.set_device_clock([](const c10d::Work&) { return kTick; });
    comm.set_step(3);
    torch::Tensor t = torch::ones({1000});
    comm.all_reduce(t, /*average=*/false);                        // 1 work
    comm.broadcast({torch::ones({8}), torch::ones({4}), torch::ones({2})}, 0);  // 3 works
    std::vector<torch::Tensor> v{torch::ones({16})};
    auto work = comm.process_group()->allreduce(v);
    work->wait();
    comm.report_after(CollectiveInfo{"all-reduce", 64, 2, 9.0, 5.0, 3, 0.0, "", ""}, {work});
    before_flush[r] = seen[r].size();
    comm.flush();
    comm.set_device_clock([](const c10d::Work&) -> double { throw std::runtime_error("no events"); });
    comm.all_reduce(t, /*average=*/false);
    comm.set_device_clock(nullptr);
    comm.report_after(CollectiveInfo{"all-reduce", 64, 2, 9.0, 5.0, 4, 0.0, "", ""}, {work});
  };
  std::thread t0(rank, 0), t1(rank, 1);
  t0.join();
  t1.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(seen[r].size(), 5u) << r;
    EXPECT_EQ(before_flush[r], 2u) << r;  // the asynchronous one waited for flush()
    EXPECT_EQ(seen[r][0].seconds, kTick);
    EXPECT_EQ(seen[r][0].exposed_s, kTick);
    EXPECT_EQ(seen[r][0].bytes, 4000);
    EXPECT_EQ(seen[r][1].op, "broadcast");
    EXPECT_EQ(seen[r][1].seconds, 3 * kTick);
    EXPECT_EQ(seen[r][2].seconds, kTick);
    EXPECT_EQ(seen[r][2].exposed_s, kTick);  // min(host 5 s, device)
    EXPECT_EQ(seen[r][2].step, 3);
    EXPECT_GT(seen[r][2].end_s, 0.0);         // when the host had it, for the trace
    EXPECT_NE(seen[r][3].seconds, kTick);     // the clock threw: the host's measurement
    EXPECT_GT(seen[r][3].seconds, 0.0);
    EXPECT_EQ(seen[r][4].seconds, 9.0);       // no clock: as given, at once
    EXPECT_EQ(seen[r][4].step, 4);
  }
}

// The same path through training: with the fixed clock every collective of ddp (the reducer's
// buckets), zero2 (its per-owner reduces) and zero3 (blocking and prefetched gathers, reduce-scatter)
// is reported with whole ticks, 1 to world_size per collective (Gloo emulates a flat all-gather with
// one broadcast per rank, a zero2 bucket reduces to its 1 or 2 owners; a row's mean may mix the two),
// and never exposes more than it took.
TEST(Parallel, TrainingReportsTheDeviceClocksDurations) {
  constexpr double kTick = 1.0 / 128;
  setenv("TRAINSCOPE_FAKE_DEVICE_CLOCK_S", "0.0078125", 1);
  const auto run = run_suite_text("device-clock", R"(
name = "device-clock"
[base]
model = "gpt-tiny"
batch_size = 4
warmup_steps = 1
steps = 3
eval = false
overflow_every = 0
world_size = 2
bucket_mb = 0.25
[axes]
parallel = ["ddp", "zero2", "zero3"]
)", "--nproc 2");
  unsetenv("TRAINSCOPE_FAKE_DEVICE_CLOCK_S");
  ASSERT_EQ(run.result.code, 0) << run.result.out;
  for (const std::string name : {"ddp", "zero2", "zero3"}) {
    const json comm = cell_named(run.report, name)["metrics"]["comm"];
    EXPECT_NE(comm["implementation"].get<std::string>().find("fixed device clock"), std::string::npos) << comm.dump();
    ASSERT_FALSE(comm["collectives"].empty()) << name;
    double per_step = 0;
    for (const auto& c : comm["collectives"]) {
      const double ticks = c["time_s"].get<double>() / kTick;  // a mean over the row's count
      const double total = ticks * c["count"].get<double>();
      EXPECT_NEAR(total, std::round(total), 1e-9) << name << ": " << c.dump();
      EXPECT_GE(ticks, 1.0) << name << ": " << c.dump();
      EXPECT_LE(ticks, 2.0) << name << ": " << c.dump();
      if (name == "ddp") {
        EXPECT_EQ(ticks, 1.0) << c.dump();  // one all-reduce per bucket
      }
      per_step += c["time_s"].get<double>() * c["count"].get<double>() / 3;
    }
    EXPECT_NEAR(comm["comm_time_s"].get<double>(), per_step, 1e-12) << name;
    EXPECT_LE(comm["exposed_comm_time_s"].get<double>(), comm["comm_time_s"].get<double>()) << name;
    EXPECT_GE(comm["overlap"].get<double>(), 0.0) << name;
  }
}

// The frontier across ranks: each try runs both ranks, each under the per-rank budget (as each GPU
// has its own memory); a batch fits when every rank ends ok, and the peak that counts is the largest
// rank's. The search is a bisection, so it ends on adjacent batches: the largest fit and the first oom.
TEST(Parallel, FrontierSearchesMultiRankCellsOnTheLargestRanksPeak) {
  const auto run = run_suite_text("frontier-ranks", R"(
name = "frontier-ranks"
[base]
model = "gpt-tiny"
batch_size = 8
warmup_steps = 1
steps = 2
eval = false
overflow_every = 0
[axes]
checkpoint = ["none"]
[[cells]]
name = "zero3/ws2"
parallel = "zero3"
world_size = 2
[frontier]
budget = "24MiB"
cells = ["zero3/ws2"]
steps = 2
start = 16
limit = 512
)", "--nproc 2");
  ASSERT_EQ(run.result.code, 0) << run.result.out;
  const json& frontier = run.report["frontier"];
  ASSERT_EQ(frontier.size(), 1u) << frontier.dump();  // only the listed cell is searched
  const json& f = frontier[0];
  EXPECT_EQ(f["world_size"], 2);
  EXPECT_EQ(f["parallel"], "zero3");
  const int64_t fit = f["largest_batch"], fail = f["first_failing_batch"];
  ASSERT_GT(fit, 0) << f.dump();
  EXPECT_EQ(fail, fit + 1) << f.dump();
  for (const auto& t : f["tries"]) EXPECT_EQ(t[1], t[0].get<int64_t>() <= fit ? "ok" : "oom") << t.dump();
  EXPECT_LE(f["peak_bytes"].get<double>(), 24.0 * 1024 * 1024);
  // The peak is the largest of the fitting try's ranks.
  const json cell = read_json(run.out + "/frontier/gpt-tiny_32-true_zero3_ws2_ckpt-none_bs" + std::to_string(fit) + ".json");
  double largest = 0;
  for (const auto& r : cell["ranks"]) largest = std::max(largest, r["peak_bytes"].get<double>());
  EXPECT_EQ(f["peak_bytes"].get<double>(), largest);
  EXPECT_EQ(cell["ranks"][f["peak_rank"].get<int>()]["peak_bytes"].get<double>(), largest);
  EXPECT_NE(run.result.out.find("frontier gpt-tiny/32-true/zero3/ws2/ckpt-none under 24MiB"), std::string::npos) << run.result.out;
}

// The strategies with the other techniques: autocast, fp16 emulation with the loss scaler, bf16
// weights, checkpoint policies, global-norm clipping, a CNN's BatchNorm blocks.
TEST(Parallel, StrategiesComposeWithPrecisionAndCheckpointing) {
  const SuiteRun run = run_suite_text("compose", R"(
name = "compose"
[base]
warmup_steps = 1
steps = 5
eval = false
overflow_every = 2
world_size = 2
batch_size = 8
parallel = "ddp"
[axes]
model = ["gpt-tiny"]
[[cells]]
name = "ddp/bf16-mixed/gpt"
model = "gpt-tiny"
precision = "bf16-mixed"
[[cells]]
name = "zero2/16-mixed/mlp"
parallel = "zero2"
model = "mlp-tiny"
precision = "16-mixed"
[[cells]]
name = "zero3/bf16-true/selective/gpt"
parallel = "zero3"
model = "gpt-tiny"
precision = "bf16-true"
checkpoint = "selective"
[[cells]]
name = "zero1/clip/sgd/cnn"
parallel = "zero1"
model = "cnn-tiny"
data = "synthetic-images"
grad_clip = 0.5
optimizer = "sgd"
[[cells]]
name = "zero3/every2/cnn"
parallel = "zero3"
model = "cnn-tiny"
data = "synthetic-images"
checkpoint = "every:2"
[[cells]]
name = "ddp/bf16-true"
model = "mlp-tiny"
precision = "bf16-true"
)", "--nproc 2");
  const Result& r = run.result;
  ASSERT_EQ(r.code, 0) << r.out;
  const json& report = run.report;
  // ddp/bf16-true: DDP's buckets hold bf16 gradients, which Gloo all-reduces natively in LibTorch 2.x.
  for (const std::string name : {"ddp/bf16-mixed/gpt", "zero2/16-mixed/mlp", "zero3/bf16-true/selective/gpt",
                                 "zero1/clip/sgd/cnn", "zero3/every2/cnn", "ddp/bf16-true"}) {
    const json c = cell_named(report, name);
    ASSERT_EQ(c["status"], "ok") << name << ": " << c.value("reason", "");
    EXPECT_TRUE(std::isfinite(c["metrics"]["quality"]["final_loss"].get<double>())) << name;
    const json& m = c["metrics"]["memory"];
    EXPECT_NEAR(m["model_state_total_bytes"].get<double>() / m["expected_model_state_bytes"].get<double>(), 1.0, 0.02)
        << name;
    EXPECT_EQ(c["metrics"]["rng"]["violations"], 0) << name;
  }
  EXPECT_EQ(cell_named(report, "zero2/16-mixed/mlp")["emulated"], true);
  EXPECT_EQ(cell_named(report, "ddp/bf16-true")["metrics"]["memory"]["model_state_bytes"]["grads"].get<int64_t>(),
            cell_named(report, "ddp/bf16-true")["model"]["parameters"].get<int64_t>() * 2);  // bf16 gradients
}

// Llama under every precision this CPU runs, every parallel strategy and every checkpoint policy, with a
// model of the suite's own (tied head, one K/V head) beside the preset.
TEST(Parallel, LlamaComposesWithEveryPrecisionStrategyAndPolicy) {
  const SuiteRun run = run_suite_text("llama-compose", R"(
name = "llama-compose"
[base]
warmup_steps = 1
steps = 4
eval = false
overflow_every = 2
world_size = 2
batch_size = 4
model = "llama-tiny"
data = "synthetic-tokens"
[models.my-llama]
family = "llama"
layers = 3
d_model = 32
heads = 4
kv_heads = 1
ffn = 96
seq_len = 32
vocab = 256
tied = true
[axes]
parallel = ["ddp", "zero1", "zero2", "zero3"]
[[cells]]
name = "single/my-llama/64-true"
parallel = "single"
world_size = 1
model = "my-llama"
precision = "64-true"
[[cells]]
name = "single/16-mixed-noscale/every2"
parallel = "single"
world_size = 1
precision = "16-mixed-noscale"
checkpoint = "every:2"
[[cells]]
name = "ddp/bf16-mixed/full/sdpa"
parallel = "ddp"
precision = "bf16-mixed"
checkpoint = "full"
attention = "sdpa"
[[cells]]
name = "zero1/16-mixed/selective"
parallel = "zero1"
precision = "16-mixed"
checkpoint = "selective"
[[cells]]
name = "zero2/bf16-true/selective/sdpa"
parallel = "zero2"
precision = "bf16-true"
checkpoint = "selective"
attention = "sdpa"
[[cells]]
name = "zero3/my-llama/bf16-mixed/every2"
parallel = "zero3"
model = "my-llama"
precision = "bf16-mixed"
checkpoint = "every:2"
# Tensor parallelism under each precision family and checkpoint policy; my-llama's one key/value head
# stays whole on both tp ranks and its head is its vocabulary-split embedding.
[[cells]]
name = "tp2-sp/bf16-master/selective-op/sdpa"
parallel = "single"
tp = 2
sequence_parallel = true
precision = "bf16-master"
checkpoint = "selective-op"
attention = "sdpa"
[[cells]]
name = "tp2/my-llama/bf16-mixed/full"
parallel = "single"
tp = 2
model = "my-llama"
precision = "bf16-mixed"
checkpoint = "full"
[[cells]]
name = "tp2-sp/16-mixed/every2"
parallel = "single"
tp = 2
sequence_parallel = true
precision = "16-mixed"
checkpoint = "every:2"
[[cells]]
name = "tp2/bf16-true/selective"
parallel = "single"
tp = 2
precision = "bf16-true"
checkpoint = "selective"
)", "--nproc 2");
  ASSERT_EQ(run.result.code, 0) << run.result.out;
  const json& report = run.report;
  for (const std::string name : {"ddp", "zero1", "zero2", "zero3", "single/my-llama/64-true", "single/16-mixed-noscale/every2",
                                 "ddp/bf16-mixed/full/sdpa", "zero1/16-mixed/selective", "zero2/bf16-true/selective/sdpa",
                                 "zero3/my-llama/bf16-mixed/every2", "tp2-sp/bf16-master/selective-op/sdpa", "tp2/my-llama/bf16-mixed/full",
                                 "tp2-sp/16-mixed/every2", "tp2/bf16-true/selective"}) {
    const json c = cell_named(report, name);
    ASSERT_EQ(c["status"], "ok") << name << ": " << c.value("reason", "");
    EXPECT_TRUE(std::isfinite(c["metrics"]["quality"]["final_loss"].get<double>())) << name;
    const json& m = c["metrics"]["memory"];
    EXPECT_NEAR(m["model_state_total_bytes"].get<double>() / m["expected_model_state_bytes"].get<double>(), 1.0, 0.02)
        << name;
    EXPECT_EQ(c["model"]["parameters"], c["model"]["analytic_parameters"]) << name;
    if (c["config"]["world_size"] == 2) {
      EXPECT_EQ(c["metrics"]["rng"]["violations"], 0) << name;
    }
  }
  // The suite's own model ran with its dimensions; its head is its embedding.
  const json mine = cell_named(report, "zero3/my-llama/bf16-mixed/every2")["model"];
  EXPECT_EQ(mine["shape"]["layers"], 3);
  EXPECT_EQ(mine["shape"]["kv_heads"], 1);
  EXPECT_EQ(mine["parameters"], 256 * 32 + 3 * (32 * 32 + 2 * 32 * 8 + 32 * 32 + 3 * 32 * 96 + 2 * 32) + 32);
  EXPECT_NE(cell_named(report, "ddp/bf16-mixed/full/sdpa")["model"]["attention_backend"], "eager");
  EXPECT_EQ(cell_named(report, "zero3")["model"]["attention_backend"], "eager");  // auto at seq 64 on a CPU
  EXPECT_EQ(cell_named(report, "zero1/16-mixed/selective")["emulated"], true);
}

TEST(Parallel, RngProbeCatchesEachInjectedFaultAndNothingElse) {
  const SuiteRun run = run_suite_text("rng", R"(
name = "rng"
[base]
warmup_steps = 1
steps = 6
rng_every = 2
eval = false
overflow_every = 0
world_size = 2
parallel = "ddp"
[axes]
model = ["gpt-tiny", "mlp-tiny"]
inject = ["none", "same-data-seed", "skip-broadcast", "rank-dropout-seed"]
[when.model.gpt-tiny]
batch_size = 4
dropout = 0.1
[when.model.mlp-tiny]
batch_size = 16
augment = true
)", "--nproc 2");
  const Result& r = run.result;
  const std::string& out = run.out;
  ASSERT_EQ(r.code, 0) << r.out;
  const json& report = run.report;
  const Result valid = validate_report(out + "/report.json");
  EXPECT_EQ(valid.code, 0) << valid.out;  // comm, rng and ranks as the schema says
  for (const std::string model : {"gpt-tiny", "mlp-tiny"}) {
    const json clean = cell_named(report, model + "/inject=none");
    EXPECT_EQ(clean["metrics"]["rng"]["violations"], 0) << clean["metrics"]["rng"].dump();
    EXPECT_GT(rng_stream(clean, "parameters")["steps_compared"].get<int>(), 1);

    const json same = cell_named(report, model + "/inject=same-data-seed");
    EXPECT_EQ(rng_stream(same, "data-samples")["verdict"], "violated");
    EXPECT_EQ(rng_stream(same, "data-samples")["first_violation_step"], 0);
    EXPECT_EQ(rng_stream(same, "data-samples")["ranks"], json::array({0, 1}));
    EXPECT_NE(rng_stream(same, "data-samples")["detail"].get<std::string>().find("no diversity"), std::string::npos);
    EXPECT_EQ(rng_stream(same, "parameters")["verdict"], "ok");

    const json skip = cell_named(report, model + "/inject=skip-broadcast");
    EXPECT_EQ(rng_stream(skip, "initial-weights")["verdict"], "violated");
    EXPECT_EQ(rng_stream(skip, "initial-weights")["first_violation_step"], 0);
    EXPECT_EQ(rng_stream(skip, "parameters")["verdict"], "violated");  // DDP averages gradients, not weights
    EXPECT_EQ(rng_stream(skip, "data-samples")["verdict"], "ok");

    // The consequence: the ranks' weights are measured apart (largest |difference| of one value).
    // Clean ranks agree bit for bit (DDP's averaged gradient is the same bytes everywhere), so their
    // spread is exactly 0 at every sampled step; each rank's own initialisation of a layer draws
    // values of the init's scale (~1/sqrt(fan_in) >= 1/sqrt(784)), which the identical updates never
    // bring together, so the faulty spread stays well above 1e-3 to the end.
    const json& clean_spread = clean["metrics"]["rng"]["parameter_spread"];
    ASSERT_TRUE(clean_spread.is_object()) << clean["metrics"]["rng"].dump();
    EXPECT_EQ(clean_spread["max"].get<double>(), 0.0);
    EXPECT_EQ(clean_spread["by_step"].size(), rng_stream(clean, "parameters")["steps_compared"].get<size_t>() + 1);
    const json& skip_spread = skip["metrics"]["rng"]["parameter_spread"];
    EXPECT_GT(skip_spread["final"].get<double>(), 1e-3) << skip_spread.dump();
    EXPECT_EQ(skip_spread["first_nonzero_step"], 0);
    EXPECT_EQ(same["metrics"]["rng"]["parameter_spread"]["max"].get<double>(), 0.0);  // weights agree; data does not
  }
  const json mlp_same = cell_named(report, "mlp-tiny/inject=same-data-seed");
  EXPECT_EQ(rng_stream(mlp_same, "augmentation")["verdict"], "violated");
  EXPECT_EQ(rng_stream(cell_named(report, "mlp-tiny/inject=none"), "augmentation")["verdict"], "ok");
  const json dropout = cell_named(report, "gpt-tiny/inject=rank-dropout-seed");
  EXPECT_EQ(rng_stream(dropout, "dropout-masks")["verdict"], "violated");
  EXPECT_EQ(rng_stream(dropout, "dropout-masks")["first_violation_step"], 0);
  EXPECT_EQ(rng_stream(dropout, "initial-weights")["verdict"], "ok");
  EXPECT_EQ(rng_stream(cell_named(report, "gpt-tiny/inject=none"), "dropout-masks")["verdict"], "ok");
}

TEST(Parallel, DeadOrHungRankFailsTheCellAndLeavesNoProcess) {
  const SuiteRun run = run_suite_text("death", R"(
name = "death"
[base]
model = "mlp-tiny"
batch_size = 16
warmup_steps = 1
steps = 6
eval = false
overflow_every = 0
world_size = 2
parallel = "ddp"
inject_rank = 1
inject_step = 3
collective_timeout_s = 5
timeout_s = 120
[axes]
inject = ["crash", "hang", "none"]
# Under tensor parallelism every layer waits on the other tp rank: the same outcomes, from its group.
[[cells]]
name = "tp2/inject=crash"
model = "gpt-tiny"
parallel = "single"
tp = 2
batch_size = 4
inject = "crash"
[[cells]]
name = "tp2/inject=hang"
model = "gpt-tiny"
parallel = "single"
tp = 2
batch_size = 4
inject = "hang"
# A pipeline stage waits on its neighbour's hidden states or gradients: the same outcomes.
[[cells]]
name = "pp2/inject=crash"
model = "gpt-tiny"
parallel = "single"
pp = 2
batch_size = 4
inject = "crash"
[[cells]]
name = "pp2/inject=hang"
model = "gpt-tiny"
parallel = "single"
pp = 2
batch_size = 4
inject = "hang"
)", "--nproc 2");
  const Result& r = run.result;
  const std::string& out = run.out;
  EXPECT_EQ(r.code, 1) << r.out;  // a failed cell, the report written
  for (const char* name : {"tp2/inject=crash", "tp2/inject=hang", "pp2/inject=crash", "pp2/inject=hang"}) {
    const json cell = cell_named(run.report, name);
    EXPECT_EQ(cell["status"], "failed") << name;
    EXPECT_LT(cell["wall_s"].get<double>(), 60.0) << name;
    EXPECT_NE(cell["reason"].get<std::string>().find("rank"), std::string::npos) << cell["reason"];
  }
  for (const char* tp_or_pp : {"tp2", "pp2"}) {
    const std::string name = std::string(tp_or_pp);
    EXPECT_NE(cell_named(run.report, name + "/inject=crash")["reason"].get<std::string>().find("rank 1 killed by signal 11"), std::string::npos);
    EXPECT_NE(cell_named(run.report, name + "/inject=hang")["reason"].get<std::string>().find("rank(s) 1 had not failed and were stopped"),
              std::string::npos);
  }
  const json& report = run.report;
  const json crash = cell_named(report, "inject=crash");
  EXPECT_EQ(crash["status"], "failed");
  EXPECT_NE(crash["reason"].get<std::string>().find("rank 1 killed by signal 11 (SIGSEGV)"), std::string::npos)
      << crash["reason"];
  const json hang = cell_named(report, "inject=hang");
  EXPECT_EQ(hang["status"], "failed");
  // Rank 0 gives up in its collective after collective_timeout_s, long before the cell's timeout.
  EXPECT_LT(hang["wall_s"].get<double>(), 60.0);
  EXPECT_NE(hang["reason"].get<std::string>().find("rank(s) 1 had not failed and were stopped"), std::string::npos)
      << hang["reason"];
  EXPECT_EQ(cell_named(report, "inject=none")["status"], "ok");
  EXPECT_EQ(processes_mentioning(out), 0);
}

namespace {

const char* kLaunchedSuite = R"(
name = "launched"
[base]
model = "mlp-tiny"
batch_size = 16
warmup_steps = 1
steps = 4
eval = false
overflow_every = 0
world_size = 2
parallel = "ddp"
)";

// The report a real launcher's two ranks wrote: one ok cell with both ranks and no RNG violation.
void expect_launched_report(const std::string& out, const Result& r, const std::string& source) {
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(source + ": rank 1 of 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 1: done; rank 0 writes the report"), std::string::npos) << r.out;
  const json cell = cell_named(read_json(out + "/report.json"), "launched");
  EXPECT_EQ(cell["status"], "ok") << cell.dump();
  EXPECT_EQ(cell["ranks"].size(), 2u);
  EXPECT_EQ(cell["ranks"][1]["status"], "ok");
  EXPECT_EQ(cell["metrics"]["rng"]["violations"], 0);
  EXPECT_EQ(validate_report(out + "/report.json").code, 0);
}

}  // namespace

// What `torchrun --nproc-per-node 2 --no-python trainscope run ...` sets, set by hand: the two
// processes form one group, rank 0 writes the report with the merged cell.
TEST(Parallel, TorchrunVariablesFormTheGroup) {
  // The launched suite and a one-process cell, which a 2-rank launch must skip (listed cells are the
  // suite's only cells: the base one is listed too).
  const std::string suite = write("torchrun.toml", std::string(kLaunchedSuite) + R"(
[[cells]]
name = "launched"
[[cells]]
name = "alone"
world_size = 1
parallel = "single"
)");
  const std::string out = tmp("torchrun");
  sh("rm -rf " + out);
  const std::string env = "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(runners::free_local_port()) +
                          " WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 ";
  const std::string cmd = bin() + " run --suite " + suite + " --out " + out;
  // Both ranks' exit codes count; rank 1's output is printed after rank 0's.
  const Result r = sh("RANK=1 LOCAL_RANK=1 " + env + cmd + " > " + out + ".rank1.txt 2>&1 & pid=$!; RANK=0 LOCAL_RANK=0 " +
                      env + cmd + "; rc=$?; wait $pid; rc1=$?; cat " + out + ".rank1.txt; exit $((rc + rc1))");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("torchrun: rank 1 of 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 1: done; rank 0 writes the report"), std::string::npos) << r.out;
  const json report = read_json(out + "/report.json");
  const json cell = cell_named(report, "launched");  // the suite's one matrix cell
  EXPECT_EQ(cell["status"], "ok") << cell.dump();
  EXPECT_EQ(cell["ranks"].size(), 2u);
  EXPECT_EQ(cell["metrics"]["rng"]["violations"], 0);
  // Launcher variables that do not make a world: one line, exit 2, nothing run.
  const Result bad = sh("RANK=5 WORLD_SIZE=2 " + cmd);
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("rank 5 is outside a world of 2"), std::string::npos) << bad.out;
  EXPECT_EQ(lines(bad.out), 1) << bad.out;
  const json alone = cell_named(report, "alone");
  EXPECT_EQ(alone["status"], "skipped");  // the launch has 2 ranks
  EXPECT_NE(alone["reason"].get<std::string>().find("torchrun launch has 2 ranks"), std::string::npos);
}


// The wheel's own torchrun starts the two ranks (its agent store, its variables).
TEST(Parallel, RealTorchrunLaunchesTwoRanks) {
  const std::string torchrun = std::string(kTorchVenv) + "/bin/torchrun";
  if (std::string(kTorchVenv).empty() || access(torchrun.c_str(), X_OK) != 0)
    GTEST_SKIP() << "no torchrun: this build uses a LibTorch without the project's virtual environment";
  const std::string suite = write("launched.toml", kLaunchedSuite), out = tmp("torchrun-real");
  sh("rm -rf " + out);
  const Result r = sh(torchrun + " --nproc-per-node 2 --master-addr 127.0.0.1 --master-port " +
                      std::to_string(runners::free_local_port()) + " --no-python " + bin() + " run --suite " + suite +
                      " --out " + out);
  expect_launched_report(out, r, "torchrun");
}

// Debian's Open MPI starts the two ranks (OMPI_COMM_WORLD_*; the rendezvous address is ours to give).
TEST(Parallel, RealMpirunLaunchesTwoRanks) {
  if (sh("command -v mpirun").code != 0) GTEST_SKIP() << "no mpirun (apt-get install openmpi-bin)";
  const std::string suite = write("launched.toml", kLaunchedSuite), out = tmp("mpirun-real");
  sh("rm -rf " + out);
  // Root is refused unless allowed; two ranks on a machine that may have fewer cores than that.
  const Result r = sh("mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=" +
                      std::to_string(runners::free_local_port()) + " " + bin() + " run --suite " + suite +
                      " --out " + out);
  expect_launched_report(out, r, "mpirun");
}

// A local multi-rank run listens on loopback only: the rendezvous store has no authentication, so an
// address beyond the machine would let anyone who reaches it write keys into the job.
TEST(Parallel, ALocalRunListensOnLoopbackOnly) {
  if (sh("command -v ss").code != 0) GTEST_SKIP() << "no ss (apt-get install iproute2)";
  const std::string suite = write("listen.toml", R"(
name = "listen"
[base]
model = "mlp"
batch_size = 64
warmup_steps = 1
steps = 400
eval = false
overflow_every = 0
world_size = 2
parallel = "ddp"
)");
  const std::string out = tmp("listen");
  sh("rm -rf " + out);
  sh(bin() + " run --nproc 2 --suite " + suite + " --out " + out + " > " + out + ".txt 2>&1 & echo $! > " + out + ".pid");
  // Poll until the ranks are up (each rank's Gloo listens too), then keep every listening socket of a
  // trainscope process seen while the run lasts.
  std::set<std::string> seen;
  for (int i = 0; i < 200 && sh("kill -0 $(cat " + out + ".pid)").code == 0; ++i) {
    const Result ss = sh("ss -Hltnp | grep '\"trainscope\"' | awk '{print $4}'");
    std::istringstream lines_in(ss.out);
    for (std::string addr; std::getline(lines_in, addr);)
      if (!addr.empty()) seen.insert(addr);
    if (seen.size() >= 3) break;  // the parent's store and both ranks
    usleep(100 * 1000);
  }
  sh("while kill -0 $(cat " + out + ".pid) 2>/dev/null; do sleep 0.2; done");
  ASSERT_GE(seen.size(), 3u) << "expected the store and two ranks listening; saw " << seen.size();
  for (const auto& addr : seen) EXPECT_EQ(addr.rfind("127.0.0.1:", 0), 0u) << "listening on " << addr;
  EXPECT_EQ(cell_named(read_json(out + "/report.json"), "listen")["status"], "ok");
}

// A rendezvous that cannot be served (the port is taken) fails the cell, not the run: the report
// keeps the cell with the reason.
TEST(Parallel, ATakenRendezvousPortFailsTheCellAndKeepsTheReport) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const std::string suite = write("busy.toml", R"(
name = "busy"
[base]
model = "mlp-tiny"
batch_size = 16
steps = 2
warmup_steps = 1
eval = false
world_size = 2
parallel = "ddp"
)");
  const std::string out = tmp("busy");
  sh("rm -rf " + out);
  const Result r = sh("RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(ntohs(a.sin_port)) + " " +
                      bin() + " run --suite " + suite + " --out " + out);
  close(fd);
  EXPECT_EQ(r.code, 1) << r.out;
  const json cell = cell_named(read_json(out + "/report.json"), "busy");
  EXPECT_EQ(cell["status"], "failed");
  EXPECT_NE(cell["reason"].get<std::string>().find("cannot serve the rendezvous store"), std::string::npos)
      << cell["reason"];
}

// --trace: one Perfetto / Chrome trace per cell, one process per rank, the events in the Trace Event
// grammar, spans nested strictly on each track (Perfetto lays out nothing else), collectives on the
// communication track with bytes and busbw, and `trainscope trace DIR` writing it again.
TEST(Parallel, TraceHasOneProcessPerRankAndSpansNestPerTrack) {
  const SuiteRun run = run_suite_text("trace", std::string(kLaunchedSuite), "--nproc 2 --trace");
  ASSERT_EQ(run.result.code, 0) << run.result.out;
  const std::string path = run.out + "/traces/launched.json";
  const json trace = read_json(path);
  std::map<std::pair<int, int>, std::vector<std::pair<double, double>>> spans;  // (pid, tid) -> [begin, end]
  std::set<int> named_processes;
  int collectives = 0, steps = 0;
  for (const auto& e : trace["traceEvents"]) {
    const std::string ph = e.at("ph");
    ASSERT_TRUE(ph == "X" || ph == "C" || ph == "M") << e.dump();
    ASSERT_TRUE(e.at("pid").is_number_integer()) << e.dump();
    ASSERT_TRUE(e.at("name").is_string()) << e.dump();
    if (ph == "M" && e["name"] == "process_name") named_processes.insert(e["pid"].get<int>());
    if (ph == "C") {
      ASSERT_TRUE(e.at("ts").is_number() && e.at("args").is_object()) << e.dump();
    }
    if (ph != "X") continue;
    ASSERT_GE(e.at("dur").get<double>(), 0.0);
    spans[{e["pid"], e["tid"]}].emplace_back(e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>());
    if (e["tid"] == 2) {
      ++collectives;
      EXPECT_GT(e["args"]["bytes"].get<int64_t>(), 0) << e.dump();
      EXPECT_TRUE(e["args"].contains("busbw_gbps")) << e.dump();
    }
    if (e["name"].get<std::string>().rfind("ProfilerStep#", 0) == 0) ++steps;
  }
  EXPECT_EQ(named_processes, (std::set<int>{0, 1}));
  EXPECT_EQ(steps, 2 * 5);  // 1 warm-up + 4 measured steps on each rank
  EXPECT_GT(collectives, 0);
  // Strict nesting per track: sorted by begin (longer first), every span lies inside the innermost
  // open span or after it; 1 us of slack for the clock's rounding.
  for (auto& [track, list] : spans) {
    if (track.second == 2) continue;  // DDP's buckets overlap each other on the communication track
    std::sort(list.begin(), list.end(), [](auto& a, auto& b) { return a.first < b.first || (a.first == b.first && a.second > b.second); });
    std::vector<std::pair<double, double>> open;
    for (const auto& s : list) {
      while (!open.empty() && s.first >= open.back().second - 1) open.pop_back();
      if (!open.empty()) {
        EXPECT_LE(s.second, open.back().second + 1) << "track " << track.first << "/" << track.second;
      }
      open.push_back(s);
    }
  }
  sh("rm -rf " + run.out + "/traces");
  const Result again = ts("trace " + run.out);
  EXPECT_EQ(again.code, 0) << again.out;
  EXPECT_EQ(read_json(path)["traceEvents"].size(), trace["traceEvents"].size());
}

// The built-in pitfalls suite end to end, its SSL cells shortened: each mistake made, detected and fixed
// in one run. The first three are exact on any CPU (a non-finite loss, fingerprints, the allocator's byte
// count against the budget); the fourth is a training outcome, so what is asserted is that both paths
// were measured at every label fraction and that reusing the encoder is charged its pre-training, which
// one label subset per fraction and a tenth of the SSL steps show as well as the suite's own (about 50 s
// less here).
namespace {
std::string pitfalls_with_short_ssl_cells() {
  toml::table suite = toml::parse_file(source_dir() + "/suites/catalog/pitfalls.toml");
  int shortened = 0;
  for (auto& node : *suite["cells"].as_array()) {
    toml::table& cell = *node.as_table();
    if (cell["name"].value_or(std::string()).rfind("ssl/", 0) != 0) continue;
    for (const char* key : {"steps", "finetune_steps", "scratch_steps", "eval_bank"})
      if (auto* n = cell.get_as<int64_t>(key); n && n->get() >= 10) *n = n->get() / 10, ++shortened;
  }
  EXPECT_GT(shortened, 0) << "pitfalls.toml has no SSL cell to shorten: shorten its SSL cells here again";
  std::ostringstream toml;
  toml << suite;
  return toml.str();
}
}  // namespace

TEST(Parallel, PitfallsSuiteReproducesEachMistakeWithItsFix) {
  const std::string suite = write("pitfalls.toml", pitfalls_with_short_ssl_cells());
  const std::string out = tmp("pitfalls");
  sh("rm -rf " + out);
  const Result r = ts("run --suite " + suite + " --nproc 2 --set label_seeds=1 --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  const json report = read_json(out + "/report.json");
  const Result valid = validate_report(out + "/report.json");
  EXPECT_EQ(valid.code, 0) << valid.out;
  expect_reports_for_people(out);
  ASSERT_EQ(report["pitfalls"].size(), 4u);
  std::map<std::string, json> by_kind;
  for (const auto& p : report["pitfalls"]) by_kind[p["kind"]] = p;
  for (const char* kind : {"fp16-range", "rng", "memory"})
    EXPECT_EQ(by_kind[kind]["reproduced"], true) << by_kind[kind].dump(1);
  EXPECT_EQ(cell_named(report, "memory/zero3/none/bs80")["status"], "oom");
  EXPECT_EQ(cell_named(report, "memory/zero3/full/bs80")["status"], "ok");
  // The multi-rank frontier of the three policies: recomputing more fits more.
  std::map<std::string, int64_t> largest;
  for (const auto& f : report["frontier"]) largest[f["checkpoint"]] = f["largest_batch"];
  EXPECT_LT(largest["none"], 80);
  EXPECT_GE(largest["full"], 80);
  EXPECT_GT(largest["full"], largest["every:2"]);
  EXPECT_GT(largest["every:2"], largest["none"]);
  const json& ssl = by_kind["ssl-data"];
  EXPECT_NE(ssl["saw"].dump().find("at 1% labels the pretrained encoder scores"), std::string::npos) << ssl.dump(1);
  EXPECT_NE(ssl["saw"].dump().find("at 10% labels the pretrained encoder scores"), std::string::npos) << ssl.dump(1);
  const double upstream = cell_named(report, "ssl/pretrain-60k")["metrics"]["ssl"]["pretrain"]["wall_s"];
  for (const auto& e : report["ssl"]["label_efficiency"])
    if (e["cell"] == "ssl/pretrained-60k") {
      EXPECT_GE(e["ssl_cost_s_mean"].get<double>(), upstream);
    }
  std::ifstream md(out + "/report.md");
  const std::string text((std::istreambuf_iterator<char>(md)), std::istreambuf_iterator<char>());
  for (const char* title : {"### 1. fp16 gives non-finite losses", "### 2. RNG not coordinated", "### 3. Full sharding",
                            "### 4. Self-supervised pre-training on little data"})
    EXPECT_NE(text.find(title), std::string::npos) << title;
}
