// Suite files, configuration values and axis expansion.
#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <tuple>

#include <gtest/gtest.h>

#include "cli_support.hpp"
#include "test_support.hpp"

#include "core/devices.hpp"
#include "core/errors.hpp"
#include "core/layout.hpp"
#include "core/model_shape.hpp"
#include "core/pipeline.hpp"
#include "core/precision.hpp"
#include "suites/suite_file.hpp"

using namespace trainscope;
using namespace trainscope::suites;

using trainscope::test::error_of;

namespace {

const char* kSuite = R"(
# a comment
name = "demo"
description = "two axes"
[base]
steps = 7
lr = 0.01
[axes]
precision = ["32-true", "bf16-mixed"]
model = ["mlp-tiny", "gpt-tiny", "cnn-tiny"]
batch_size = [8, 16]
[when.model.gpt-tiny]
lr = 0.003
)";

}  // namespace

TEST(SuiteFile, ExpandsAxesInFileOrderWithLabels) {
  const Suite s = parse_suite(kSuite, "demo.toml");
  ASSERT_EQ(s.axes.size(), 3u);
  EXPECT_EQ(s.axes[0].key, "precision");  // file order, not toml++'s sorted order
  EXPECT_EQ(s.axes[1].key, "model");
  const auto cells = expand(s);
  ASSERT_EQ(cells.size(), 12u);
  EXPECT_EQ(cells[0].name, "32-true/mlp-tiny/bs8");
  EXPECT_EQ(cells[1].name, "32-true/mlp-tiny/bs16");
  EXPECT_EQ(cells[11].name, "bf16-mixed/cnn-tiny/bs16");
  EXPECT_EQ(cells[1].config.batch_size, 16);
  EXPECT_EQ(cells[0].config.steps, 7);
  EXPECT_DOUBLE_EQ(cells[0].config.lr, 0.01);
  EXPECT_DOUBLE_EQ(cells[2].config.lr, 0.003);  // the gpt-tiny cell gets its `when` setting
  EXPECT_EQ(cells[2].config.model, "gpt-tiny");
}

TEST(SuiteFile, FilterAndOverrides) {
  Suite s = parse_suite(kSuite, "demo.toml");
  EXPECT_EQ(expand(s, "gpt-tiny/bs16$").size(), 2u);
  apply_override(s, "precision", "bf16-mixed");  // an axis collapses to the one value
  apply_override(s, "lr", 0.5);                  // beats base and `when`
  const auto cells = expand(s);
  ASSERT_EQ(cells.size(), 6u);
  for (const auto& c : cells) {
    EXPECT_EQ(c.config.precision, "bf16-mixed");
    EXPECT_DOUBLE_EQ(c.config.lr, 0.5);
  }
  EXPECT_NE(error_of([&] { expand(s, "(unclosed"); }).find("bad --filter"), std::string::npos);
}

TEST(SuiteFile, ErrorsNameTheKeyAndTheAllowedValues) {
  auto parse = [](const std::string& text) { return error_of([&] { parse_suite(text, "bad.toml"); }); };
  EXPECT_NE(parse("name='x'\n[base]\nbatchsize = 3\n").find("unknown key 'batchsize'"), std::string::npos);
  EXPECT_NE(parse("name='x'\n[base]\nbatchsize = 3\n").find("allowed: model, family, layers"), std::string::npos);
  const std::string bad_value = parse("name='x'\n[axes]\nprecision = ['fp16']\n");
  EXPECT_NE(bad_value.find("unknown precision 'fp16'"), std::string::npos) << bad_value;
  EXPECT_NE(bad_value.find("32-true, tf32, bf16-mixed"), std::string::npos) << bad_value;
  EXPECT_NE(parse("name='x'\n[base]\nsteps = 0\n").find("must be at least 1"), std::string::npos);
  EXPECT_NE(parse("name='x'\n[base]\nsteps = 'ten'\n").find("expected an integer"), std::string::npos);
  EXPECT_NE(parse("name='x'\n[axes]\nmodel = []\n").find("non-empty list"), std::string::npos);
  EXPECT_NE(parse("name='x'\n[when.model.mlp]\nlr=1\n").find("not an axis"), std::string::npos);
  EXPECT_NE(parse("name='x'\n[axes]\nmodel=['mlp']\n[when.model.cnn]\nlr=1\n").find("not a value of axis"),
            std::string::npos);
  EXPECT_NE(parse("name='x'\nextra = 1\n").find("unknown key"), std::string::npos);
  EXPECT_NE(parse("[base]\nsteps=1\n").find("missing 'name'"), std::string::npos);
  // A TOML syntax error names the line and column.
  EXPECT_NE(parse("name = 'x'\n[base\n").find("bad.toml:2:"), std::string::npos);
  EXPECT_NE(error_of([] { load_suite("no-such-suite"); }).find("built-in: checkpointing, gate, hardware, llama, long-context, parallel, parity, pitfalls, precision, quick, ssl"), std::string::npos);
}

TEST(SuiteFile, ExtraCellsBesideTheMatrix) {
  const Suite s = parse_suite(std::string(kSuite) + R"(
[[cells]]
name = "mlp/16-mixed/stress"
model = "mlp"
precision = "16-mixed"
loss_multiplier = 1e8
)", "demo.toml");
  const auto cells = expand(s);
  ASSERT_EQ(cells.size(), 13u);
  EXPECT_EQ(cells.back().name, "mlp/16-mixed/stress");
  EXPECT_EQ(cells.back().config.precision, "16-mixed");
  EXPECT_DOUBLE_EQ(cells.back().config.loss_multiplier, 1e8);
  EXPECT_EQ(cells.back().config.steps, 7);  // the base applies
  EXPECT_EQ(expand(s, "stress").size(), 1u);
  EXPECT_NE(error_of([] { parse_suite("name='x'\n[[cells]]\nmodel='mlp'\n", "c.toml"); }).find("needs a name"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_suite("name='x'\n[[cells]]\nname='a'\nprecision='fp4'\n", "c.toml"); })
                .find("unknown precision 'fp4'"),
            std::string::npos);
}

// [[pitfalls]] name cells of the suite and a kind the report knows; each mistake is one line naming it.
TEST(SuiteFile, PitfallsAreCheckedAgainstTheSuitesCells) {
  const std::string base = std::string(kSuite) + "[[cells]]\nname = \"stress\"\nloss_multiplier = 1e8\n";
  const Suite s = parse_suite(base + R"(
[[pitfalls]]
id = "p1"
kind = "fp16-range"
title = "fp16"
wrong = ["stress"]
fix = ["bf16-mixed/mlp-tiny/bs8"]
)", "p.toml");
  ASSERT_EQ(s.pitfalls.size(), 1u);
  EXPECT_EQ(s.pitfalls[0]["fix"], json::array({"bf16-mixed/mlp-tiny/bs8"}));  // a matrix cell counts
  EXPECT_EQ(suite_to_json(s)["pitfalls"][0]["id"], "p1");
  EXPECT_FALSE(suite_to_json(parse_suite(kSuite, "d.toml")).contains("pitfalls"));
  auto err = [&](const std::string& text) { return error_of([&] { parse_suite(base + text, "p.toml"); }); };
  EXPECT_NE(err("[[pitfalls]]\nid='a'\nkind='fp4'\nwrong=['stress']\nfix=['stress']\n").find("unknown pitfall kind 'fp4' (allowed: fp16-range, rng, memory, ssl-data)"),
            std::string::npos);
  EXPECT_NE(err("[[pitfalls]]\nid='a'\nkind='rng'\nwrong=['stres']\nfix=['stress']\n").find("pitfalls[0].wrong: no cell named 'stres'"),
            std::string::npos);
  EXPECT_NE(err("[[pitfalls]]\nid='a'\nkind='rng'\nwrong=['stress']\n").find("needs 'wrong' and 'fix' cells"), std::string::npos);
  EXPECT_NE(err("[[pitfalls]]\nkind='rng'\nwrong=['stress']\nfix=['stress']\n").find("needs an id"), std::string::npos);
  EXPECT_NE(err("[[pitfalls]]\nid='a'\nwhy='x'\n").find("pitfalls[0].why: unknown key"), std::string::npos);
  EXPECT_NE(err("[frontier]\ncells=[1]\n").find("frontier.cells: expected a list of cell names"), std::string::npos);
}

TEST(Config, ValuesAreCheckedAndParsed) {
  EXPECT_EQ(parse_value("batch_size", "32"), json(32));
  EXPECT_EQ(parse_value("eval", "false"), json(false));
  EXPECT_DOUBLE_EQ(parse_value("lr", "1e-3").get<double>(), 1e-3);
  EXPECT_NE(error_of([] { parse_value("batch_size", "32x"); }).find("expected a number"), std::string::npos);
  EXPECT_NE(error_of([] { parse_value("batch_size", "2.5"); }).find("expected an integer"), std::string::npos);
  EXPECT_NE(error_of([] { parse_value("device", "gpu"); }).find("allowed: auto, cpu, cuda"), std::string::npos);
  EXPECT_EQ(parse_value("device", "cuda:3"), json("cuda:3"));
  EXPECT_NE(error_of([] { parse_value("lr", "-1"); }).find("finite number >= 0"), std::string::npos);
  EXPECT_NE(error_of([] { RunConfig::from_json(json{{"stepz", 1}}); }).find("unknown key 'stepz'"), std::string::npos);
  // Round trip through JSON keeps every field.
  RunConfig c;
  c.model = "gpt-tiny";
  c.batch_size = 3;
  c.lr = 0.25;
  c.eval = false;
  EXPECT_EQ(RunConfig::from_json(c.to_json()).to_json(), c.to_json());
}

TEST(Config, BuiltinSuitesParse) {
  for (const auto& name : builtin_suite_names()) {
    const Suite s = load_suite(name);
    EXPECT_EQ(s.name, name);
    EXPECT_FALSE(expand(s).empty()) << name;
  }
  const auto quick = expand(load_suite("quick"));
  ASSERT_EQ(quick.size(), 4u);
  const auto precision = expand(load_suite("precision"));
  const auto ckpt = expand(load_suite("checkpointing"));
  ASSERT_EQ(ckpt.size(), 20u);  // 2 models x 5 policies x 2 batch sizes
  EXPECT_EQ(ckpt[2].name, "gpt-tiny/ckpt-full/bs16");
  EXPECT_EQ(load_suite("checkpointing").frontier["budget"], "64MiB");
  const Suite pitfalls = load_suite("pitfalls");
  ASSERT_EQ(pitfalls.pitfalls.size(), 4u);  // one of each kind, in the issue's order
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(pitfalls.pitfalls[i]["kind"], pitfall_kinds()[i]);
  ASSERT_EQ(precision.size(), 19u);  // 2 models x 8 modes + 3 stress cells
  EXPECT_EQ(precision[5].name, "mlp/16-mixed-noscale");
  EXPECT_EQ(quick[0].name, "mlp/32-true");
  EXPECT_EQ(quick[3].name, "gpt-tiny/bf16-mixed");
}

// A suite of listed cells and no axes runs those cells alone: its base is what they start from.
TEST(Suite, ListedCellsWithoutAxesLeaveTheBaseOut) {
  const auto cells = expand(parse_suite("name='x'\n[base]\nmodel='gpt-tiny'\nsteps=3\n[[cells]]\nname='a'\nbatch_size=4\n"
                                        "[[cells]]\nname='b'\nmodel='mlp'\n", "c.toml"));
  ASSERT_EQ(cells.size(), 2u);
  EXPECT_EQ(cells[0].name, "a");
  EXPECT_EQ(cells[0].config.model, "gpt-tiny");
  EXPECT_EQ(cells[0].config.steps, 3);
  EXPECT_EQ(cells[1].config.model, "mlp");
  ASSERT_EQ(expand(parse_suite("name='x'\n[base]\nmodel='mlp'\n", "c.toml")).size(), 1u);  // no cells: the base is one
}

// Model shapes as data: a suite's own model by its dimensions, a preset's dimension overridden per cell,
// and every inconsistency a one-line error before anything runs.
TEST(ModelShapes, ASuiteDefinesItsOwnModelAndACellOverridesADimension) {
  const Suite s = parse_suite(R"(
name = "shapes"
[axes]
model = ["my-llama", "llama-tiny"]
[models.my-llama]
family = "llama"
layers = 3
d_model = 48
heads = 6
kv_heads = 2
ffn = 128
seq_len = 32
vocab = 300
tied = true
[[cells]]
name = "deeper"
model = "my-llama"
layers = 5
)", "shapes.toml");
  const auto cells = expand(s);
  ASSERT_EQ(cells.size(), 3u);
  EXPECT_EQ(cells[0].name, "my-llama");
  const ModelShape mine = resolve_model(cells[0].config);
  EXPECT_EQ(mine.family, "llama");
  EXPECT_EQ(mine.layers, 3);
  EXPECT_EQ(mine.head_dim(), 8);
  EXPECT_TRUE(mine.tied);
  EXPECT_DOUBLE_EQ(mine.rope_theta, 500000.0);  // the family's default where the table is silent
  // Counted by hand: embedding 300x48, per layer q 48x48, k and v 48x16, o 48x48, 3 x 48x128, 2 norms,
  // the final norm; the head is the embedding.
  const int64_t layer = 48 * 48 + 2 * 48 * 16 + 48 * 48 + 3 * 48 * 128 + 2 * 48;
  EXPECT_EQ(analytic_decoder_parameters(mine), 300 * 48 + 3 * layer + 48);
  EXPECT_EQ(resolve_model(cells[2].config).layers, 5);  // the cell's own setting beats the table
  EXPECT_EQ(resolve_model(cells[1].config).layers, 2);  // the preset is untouched

  Suite over = s;
  apply_override(over, "layers", json(4));  // --set layers=4: every cell
  for (const auto& c : expand(over)) EXPECT_EQ(resolve_model(c.config).layers, 4) << c.name;
  EXPECT_EQ(suite_to_json(s)["models"]["my-llama"]["kv_heads"], 2);
}

TEST(ModelShapes, InconsistentDimensionsAreOneLineErrors) {
  auto parse = [](const std::string& text) { return error_of([&] { parse_suite("name='x'\n" + text, "bad.toml"); }); };
  const std::string own = "[axes]\nmodel=['m']\n[models.m]\nfamily='llama'\nlayers=2\nffn=64\nseq_len=16\nvocab=256\n";
  EXPECT_NE(parse(own + "d_model=50\nheads=4\n").find("d_model 50 is not divisible by heads 4"), std::string::npos);
  EXPECT_NE(parse(own + "d_model=64\nheads=4\nkv_heads=3\n").find("heads 4 is not divisible by kv_heads 3"),
            std::string::npos);
  EXPECT_NE(parse(own + "d_model=60\nheads=4\n").find("head_dim 15 must be even"), std::string::npos);
  EXPECT_NE(parse(own + "heads=4\n").find("d_model must be given"), std::string::npos);
  EXPECT_NE(parse("[axes]\nmodel=['m']\n[models.m]\nfamily='mamba'\n").find("unknown family 'mamba'"), std::string::npos);
  EXPECT_NE(parse("[axes]\nmodel=['m']\n[models.m]\nlayers=2\n").find("needs its family"), std::string::npos);
  EXPECT_NE(parse("[models.m]\nfamily='llama'\nlr=1\n").find("not a model dimension"), std::string::npos);
  EXPECT_NE(parse("[models.gpt-tiny]\nfamily='gpt'\n").find("a preset's name"), std::string::npos);
  EXPECT_NE(parse("[axes]\nmodel=['nope']\n").find("unknown model 'nope'"), std::string::npos);
  EXPECT_NE(parse("[base]\nmodel='mlp'\nlayers=3\n").find("takes no dimension keys"), std::string::npos);
  EXPECT_NE(parse("[base]\nmodel='gpt-tiny'\nkv_heads=2\n").find("llama dimension"), std::string::npos);
  EXPECT_NE(parse("[base]\nmodel='llama-tiny'\nheads=3\n").find("not divisible by heads 3"), std::string::npos);
  EXPECT_NE(parse("[base]\nmodel='llama-tiny'\nfamily='gpt'\n").find("is a llama preset"), std::string::npos);
  // One line each.
  EXPECT_EQ(parse(own + "d_model=50\nheads=4\n").find('\n'), std::string::npos);
}

// ---- the precision table ----------------------------------------------------------------------------

TEST(Precision, OneRowPerModeAndTheKeyOffersExactlyThem) {
  EXPECT_EQ(key_spec("precision").choices, precision_names());
  for (const auto& t : precision_table()) {
    for (const std::string& d : {t.params, t.grads, t.reduce, t.optimizer_state, t.gemm, t.attention, t.norms})
      EXPECT_GT(dtype_bytes(d), 0) << t.name << ": " << d;
    EXPECT_FALSE(t.summary.empty()) << t.name;
  }
  EXPECT_THAT_ERROR(precision_traits("bf17-mixed"), "unknown precision 'bf17-mixed'");
}

TEST(Precision, WhatEachModeComputesIn) {
  // 16-mixed runs fp16 GEMMs on a GPU (its MFU is against the fp16 peak) and fp32 ones when emulated on a CPU.
  const PrecisionTraits& fp16 = precision_traits("16-mixed");
  EXPECT_EQ(compute_dtype(fp16, /*cuda=*/true), "fp16");
  EXPECT_EQ(compute_dtype(fp16, /*cuda=*/false), "fp32");
  EXPECT_EQ(compute_dtype(fp16, /*cuda=*/false, "autocast"), "fp16");
  const PrecisionTraits& master = precision_traits("bf16-master");
  EXPECT_EQ(master.params, "bf16");
  EXPECT_EQ(master.master, "fp32");
  EXPECT_EQ(master.reduce, "fp32");
  EXPECT_TRUE(master.autocast.empty());  // no autocast: bf16 weights, bf16 forward
  EXPECT_EQ(compute_dtype(master, false), "bf16");
  // Among equals the planner names what teams run: bf16 from fp32 masters before autocast.
  EXPECT_LT(master.preference, precision_traits("bf16-mixed").preference);
}

TEST(Precision, MfuPeakConvention) {
  const PeakOf h100 = [](const std::string& d) -> std::optional<double> {
    if (d == "bf16" || d == "fp16") return 989e12;
    if (d == "fp8") return 1979e12;
    return std::nullopt;
  };
  EXPECT_DOUBLE_EQ(*mfu_peak_flops(precision_traits("bf16-mixed"), "bf16", 0.9, h100), 989e12);
  EXPECT_DOUBLE_EQ(*mfu_peak_flops(precision_traits("16-mixed"), "fp16", 0.9, h100), 989e12);
  EXPECT_FALSE(mfu_peak_flops(precision_traits("32-true"), "fp32", 0.9, h100).has_value());  // no fp32 peak known: no MFU
  // fp8: the linear layers' FLOPs at the fp8 peak, attention's at bf16's: the time at peak, harmonic.
  const double f = 0.9, expected = 1.0 / (f / 1979e12 + (1 - f) / 989e12);
  EXPECT_NEAR(*mfu_peak_flops(precision_traits("fp8"), "fp8", f, h100), expected, 1.0);
  EXPECT_GT(expected, 989e12);
  EXPECT_LT(expected, 1979e12);
}

TEST(Precision, DeriveMfuFromRawFields) {
  json timing = {{"samples_per_s", 100.0}, {"flops_per_sample", 1e12}, {"attention_flops_per_sample", 0.0},
                 {"recompute_flops_per_sample", 5e11}, {"causal", {{"flops_per_sample", 8e11}}},
                 {"gemm_peaks_flops_per_s", {{"fp16", 5e14}}}};
  derive_mfu(timing, precision_traits("16-mixed"), "fp16", "NVIDIA H200", 2);
  EXPECT_DOUBLE_EQ(timing["flops_per_s"].get<double>(), 1e14);
  EXPECT_DOUBLE_EQ(timing["peak_flops_per_s"].get<double>(), 5e14);
  EXPECT_DOUBLE_EQ(timing["mfu"].get<double>(), 1e14 / (5e14 * 2));  // the peak of every rank
  EXPECT_DOUBLE_EQ(timing["hfu"].get<double>(), 1.5e14 / (5e14 * 2));
  EXPECT_DOUBLE_EQ(timing["causal"]["mfu"].get<double>(), 0.8e14 / (5e14 * 2));
  EXPECT_DOUBLE_EQ(timing["datasheet_peak_flops_per_s"].get<double>(), 989e12);  // the H200's dense fp16
  EXPECT_DOUBLE_EQ(timing["mfu_datasheet"].get<double>(), 1e14 / (989e12 * 2));
  EXPECT_EQ(timing["compute_dtype"], "fp16");
  // A peak not measured in the GEMMs' dtype is no MFU (an fp32 peak under fp16 GEMMs would overstate it).
  json other = timing;
  other["gemm_peaks_flops_per_s"] = {{"fp32", 5e13}};
  derive_mfu(other, precision_traits("16-mixed"), "fp16", "NVIDIA H200", 2);
  EXPECT_TRUE(other["mfu"].is_null());
  EXPECT_FALSE(other["mfu_datasheet"].is_null());
}

// ---- the parallel layout ----------------------------------------------------------------------------

TEST(Layout, NamesParseBack) {
  for (const std::string n : {"single", "dp_shard2", "dp_replicate2-dp_shard4", "dp_shard4-tp2", "pp4-dp_shard2-cp2-tp8",
                              "dp_shard2-zero1", "dp_replicate8"})
    EXPECT_EQ(parse_layout(n).name(), n);
  EXPECT_EQ(parse_layout("tp2-dp_shard4").name(), "dp_shard4-tp2");  // printed in mesh order
  EXPECT_EQ(parse_layout("pp2-dp_shard2-cp2-tp2").world(), 16);
  EXPECT_THAT_ERROR(parse_layout("dp2"), "expected dimensions joined by '-'");
  EXPECT_THAT_ERROR(parse_layout("tp2-tp4"), "tp is given twice");
  EXPECT_THAT_ERROR(parse_layout("tp2-zero1"), "zero1 shards over dp_shard");
}

TEST(Layout, TheShorthandIsTheDataParallelDimensions) {
  auto layout = [](const std::string& parallel, int64_t world, int64_t shard = 0) {
    RunConfig c;
    c.parallel = parallel;
    c.world_size = world;
    c.hsdp_shard_size = shard;
    return resolve_layout(c);
  };
  EXPECT_EQ(layout("ddp", 4).name(), "dp_replicate4");
  EXPECT_EQ(layout("zero3", 4).name(), "dp_shard4");
  EXPECT_EQ(layout("zero1", 4).name(), "dp_shard4-zero1");
  EXPECT_EQ(layout("zero1", 4).strategy(), "zero1");
  EXPECT_EQ(layout("hsdp", 8, 4).name(), "dp_replicate2-dp_shard4");
  EXPECT_EQ(layout("hsdp", 8, 4).strategy(), "hsdp");
  EXPECT_TRUE(layout("hsdp", 8).shard_by_host);  // a node's ranks: known at launch
  EXPECT_EQ(layout("single", 1).name(), "single");
  RunConfig c;
  c.parallel = "zero3";
  c.world_size = 8;
  c.tp = 2;  // the shorthand takes the ranks tp leaves
  EXPECT_EQ(resolve_layout(c).name(), "dp_shard4-tp2");
  c.world_size = 7;
  EXPECT_THAT_ERROR(resolve_layout(c), "not a multiple of tp x pp x cp = 2");
}

TEST(Layout, TheConfigurationChecksIt) {
  // Degrees alone set the world size; degrees and a world size that disagree are an error.
  const RunConfig c = RunConfig::from_json({{"model", "gpt-tiny"}, {"dp_replicate", 2}, {"dp_shard", 2}});
  EXPECT_EQ(c.world_size, 4);
  EXPECT_EQ(resolve_layout(c).strategy(), "hsdp");
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "gpt-tiny"}, {"dp_shard", 2}, {"world_size", 3}}), "needs 2 ranks");
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "gpt-tiny"}, {"layout", "tp3"}}), "does not divide the 4 attention heads");
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "llama-tiny"}, {"layout", "cp3"}}), "2 x cp equal chunks");
  EXPECT_EQ(RunConfig::from_json({{"model", "gpt-tiny"}, {"tp", 2}}).world_size, 2);
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "vit-tiny"}, {"tp", 2}}), "vit models have none");
  EXPECT_EQ(RunConfig::from_json({{"model", "llama-tiny"}, {"cp", 2}}).world_size, 2);
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "llama-tiny"}, {"cp", 2}, {"pp", 2}, {"batch_size", 4}}), "cp with pp (layout pp2-cp2)");
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "llama-tiny"}, {"cp", 2}, {"cp_method", "ulysses"}}), "ulysses");
  EXPECT_EQ(RunConfig::from_json({{"model", "llama-tiny"}, {"pp", 2}, {"tp", 2}, {"batch_size", 4}}).world_size, 4);
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "llama-tiny"}, {"pp", 2}, {"dp_replicate", 2}}),
                    "pp with other dimensions than tp and dp_shard at zero3 (layout pp2-dp_replicate2)");
  EXPECT_EQ(RunConfig::from_json({{"model", "llama-tiny"}, {"pp", 2}, {"tp", 2}, {"batch_size", 4}, {"grad_clip", 1.0}}).grad_clip, 1.0);
  EXPECT_EQ(RunConfig::from_json({{"model", "llama-tiny"}, {"pp", 2}, {"batch_size", 4}}).world_size, 2);
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "llama-tiny"}, {"pp_virtual", 2}}), "pp_schedule and pp_virtual need pp > 1");
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "llama-tiny"}, {"pp_microbatches", 4}, {"method", "simclr"}}), "cuts the batch");
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "llama-tiny"}, {"pp_microbatches", 2}, {"parallel", "ddp"}, {"world_size", 2}}),
                    "pp_microbatches > 1 with other dimensions than tp and dp_shard at zero3 (layout dp_replicate2)");
  EXPECT_EQ(RunConfig::from_json({{"model", "llama-tiny"}, {"tp", 2}, {"sequence_parallel", true}}).world_size, 2);
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "llama-tiny"}, {"sequence_parallel", true}}), "needs tp > 1");
  EXPECT_EQ(RunConfig::from_json({{"model", "llama-tiny"}, {"tp", 2}, {"grad_clip", 1.0}}).grad_clip, 1.0);
  EXPECT_EQ(RunConfig::from_json({{"model", "llama-tiny"}, {"layout", "dp_shard2-tp2"}, {"precision", "bf16-master"}, {"grad_clip", 1.0}}).grad_clip,
            1.0);
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "llama-tiny"}, {"tp", 2}, {"sp_regather", true}}), "needs sequence_parallel = true");
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "llama-tiny"}, {"tp", 2}, {"sequence_parallel", true}, {"sp_regather", true},
                                          {"precision", "bf16-mixed"}}), "not under autocast (bf16-mixed)");
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "gpt-tiny"}, {"dp_replicate", 2}, {"dp_shard", 2}, {"parallel", "zero2"},
                                          {"world_size", 4}}), "means dp_shard4");
  EXPECT_THAT_ERROR(RunConfig::from_json({{"reduce_dtype", "bf16"}}), "applies to precisions with fp32 masters");
  EXPECT_THAT_ERROR(RunConfig::from_json({{"reshard_after_forward", "sometimes"}}), "expected true, false or a group size");
  EXPECT_EQ(axis_label("layout", "dp_shard2-tp2"), "dp_shard2-tp2");
  EXPECT_EQ(axis_label("tp", 2), "tp2");
}

// ---- devices ----------------------------------------------------------------------------------------

TEST(Devices, AFileAddsADeviceAndBadFilesAreOneLine) {
  const std::string dir = trainscope::test::scratch("devices");
  const std::string good = dir + "/gb200.toml";
  std::ofstream(good) << "name = \"GB200\"\ndriver_names = [\"NVIDIA GB200\"]\nmemory_gb = 186\nhbm_gbps = 8000\n"
                         "link_gbps = 900\nlink = \"NVLink 5\"\n[peak_tflops]\nbf16 = 2500\nfp8 = 5000\n";
  const DeviceFacts d = read_device_file(good);
  EXPECT_EQ(d.key, "GB200");
  EXPECT_DOUBLE_EQ(d.peak_flops.at("fp8"), 5000e12);
  EXPECT_DOUBLE_EQ(d.memory_bytes, 186e9);
  use_device_file(good);
  ASSERT_NE(find_device("NVIDIA GB200"), nullptr);
  EXPECT_EQ(find_device("GB200"), find_device("NVIDIA GB200"));
  EXPECT_NE(find_device("H100-SXM"), nullptr);  // the built-in rows stay
  for (const auto& [text, says] : std::vector<std::pair<std::string, std::string>>{
           {"memory_gb = 80\nhbm_gbps = 1\nlink_gbps = 1\n[peak_tflops]\nbf16 = 1\n", "missing 'name'"},
           {"name = \"x\"\nmemory_gb = 80\nhbm_gbps = 1\nlink_gbps = 1\n", "missing [peak_tflops]"},
           {"name = \"x\"\nmemory_gb = 80\nhbm_gbps = 1\nlink_gbps = 1\nwatts = 3\n[peak_tflops]\nbf16 = 1\n", "unknown key 'watts'"},
           {"name = \"x\"\nmemory_gb = 80\nhbm_gbps = 1\nlink_gbps = 1\n[peak_tflops]\nfp4 = 1\n", "unknown dtype 'fp4'"},
           {"name = \"x\"\nmemory_gb = \"lots\"\n", "'memory_gb' must be a number"},
           {"name = [", "--device-file"}}) {
    const std::string path = dir + "/bad.toml";
    std::ofstream(path) << text;
    EXPECT_THAT_ERROR(read_device_file(path), says);
  }
}

// Each schedule with its default stages per rank, and zb-1p interleaved (two per rank).
static std::vector<std::pair<std::string, int64_t>> every_schedule() {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const std::string& name : trainscope::pipeline::schedule_names()) out.emplace_back(name, trainscope::pipeline::default_stages_per_rank(name));
  out.emplace_back("zb-1p", 2);
  return out;
}

// Pipeline schedules as data (core/pipeline.hpp), replayed on equal unit costs (F = 1, B = 2, or I = W =
// 1) with free transfers: the bubbles of Narayanan et al. 2021, Section 2.2 ((p-1)/m; interleaved
// (p-1)/vm) and Qi et al. 2023's ZB-H1 ((p-1)/3m) come out exactly (sums of small integers: exact in a
// double), and so do the in-flight peaks torch's own schedules showed on 2 ranks (tp-pp-cp notes, 3.2).
TEST(PipelineSchedule, ReplayGivesTheBubbleAndInFlightFormulas) {
  using namespace trainscope::pipeline;
  const Costs unit{1, 1, 1, 0};
  for (int64_t p : {2, 4, 8})
    for (int64_t m : {2 * p, 4 * p}) {
      const std::string at = "p " + std::to_string(p) + ", m " + std::to_string(m);
      const double pm = static_cast<double>(p - 1) / static_cast<double>(m);
      const Replay gpipe = replay(make_schedule("gpipe", p, m, 1), unit);
      const Replay one = replay(make_schedule("1f1b", p, m, 1), unit);
      const Replay zb = replay(make_schedule("zb-1p", p, m, 1), unit);
      EXPECT_DOUBLE_EQ(gpipe.bubble(), pm) << at;
      EXPECT_DOUBLE_EQ(one.bubble(), pm) << at;
      EXPECT_DOUBLE_EQ(zb.bubble(), pm / 3) << at;
      for (int64_t r = 0; r < p; ++r) {
        EXPECT_EQ(gpipe.peak_in_flight[r], m) << at;
        EXPECT_EQ(one.peak_in_flight[r], p - r) << at << " rank " << r;
        EXPECT_EQ(zb.peak_in_flight[r], p) << at << " rank " << r;
      }
      for (int64_t v : {2, 4}) {
        const Replay inter = replay(make_schedule("interleaved-1f1b", p, m, v), unit);
        EXPECT_DOUBLE_EQ(inter.bubble(), pm / static_cast<double>(v)) << at << " v " << v;
        for (int64_t r = 0; r < p; ++r)  // chunks: Megatron's warm-up + 1
          EXPECT_EQ(inter.peak_in_flight[r], std::min(m * v, 2 * (p - 1 - r) + (v - 1) * p + 1)) << at << " v " << v << " rank " << r;
        // Interleaved zero bubble: a third of interleaved 1F1B's bubble, p stages' worth (pv chunks) in
        // flight on every rank until their W (the notes' replay of torch's table at p 4, m 8: 0.0625, 8).
        const Replay zbv = replay(make_schedule("zb-1p", p, m, v), unit);
        EXPECT_DOUBLE_EQ(zbv.bubble(), pm / static_cast<double>(3 * v)) << at << " v " << v;
        for (int64_t r = 0; r < p; ++r) EXPECT_EQ(zbv.peak_in_flight[r], p * v) << at << " v " << v << " rank " << r;
      }
    }
  // A transfer between ranks delays each hop of gpipe's forward and backward waves (stage s runs
  // micro-batch i's forward at s(F + c) + iF): its makespan grows by 2(p-1) transfers.
  const Replay slow = replay(make_schedule("gpipe", 4, 8, 1), Costs{1, 1, 1, 0.5});
  EXPECT_DOUBLE_EQ(slow.makespan, replay(make_schedule("gpipe", 4, 8, 1), unit).makespan + 2 * 3 * 0.5);
}

// The multi-stage schedules are torch's own tables, action for action on every rank: interleaved-1f1b is
// ScheduleInterleaved1F1B's, zb-1p ScheduleInterleavedZeroBubble's at one, two and four stages per rank
// (tests/parity/schedule_tables.py builds torch's on mock stages, as its schedule visualiser does), with
// micro-batches fewer than, equal to and several times the ranks.
TEST(PipelineSchedule, TheInterleavedAndZeroBubbleTablesAreTorchs) {
  using namespace trainscope::pipeline;
  if (std::string(test::kTorchVenv).empty()) GTEST_SKIP() << "no project virtual environment (a LibTorch of your own)";
  std::vector<std::tuple<std::string, int64_t, int64_t, int64_t>> specs;
  for (int64_t p : {2, 4})
    for (int64_t m : {p, 2 * p, 4 * p}) {
      for (int64_t v : {1, 2, 4}) specs.emplace_back("zb-1p", p, m, v);
      for (int64_t v : {2, 4}) specs.emplace_back("interleaved-1f1b", p, m, v);
    }
  specs.emplace_back("zb-1p", 4, 2, 1);  // fewer micro-batches than ranks
  std::string args;
  const auto key = [](const auto& t) {
    return std::get<0>(t) + "/" + std::to_string(std::get<1>(t)) + "/" + std::to_string(std::get<2>(t)) + "/" + std::to_string(std::get<3>(t));
  };
  for (const auto& t : specs) args += " " + key(t);
  const test::Result r = test::sh(std::string(test::kTorchVenv) + "/bin/python " + test::source_dir() + "/tests/parity/schedule_tables.py" + args);
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json torch_tables = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  for (const auto& t : specs) {
    const Schedule s = make_schedule(std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t));
    for (int64_t rank = 0; rank < s.ranks; ++rank)
      EXPECT_EQ(format_actions(s.actions[rank]), torch_tables.at(key(t)).at(rank).get<std::string>()) << key(t) << " rank " << rank;
  }
}

// A send's buffer goes once the table shows its receiver has it. 1F1B on 2 ranks, 4 micro-batches:
// rank 0's forwards (F0 F1 B0 F2 B1 F3 B2 B3) go after their micro-batch's backward (GPipe's after the
// first backward, which proves them all received); rank 1's input
// gradients (F0 B0 F1 B1 F2 B2 F3 B3) after the next forward it receives, which rank 0 sent after taking
// them; the last two at the step's end. For every schedule and any costs, the receiver has started
// (received) before the releasing action ends.
TEST(PipelineSchedule, SendsAreReleasedOnceReceived) {
  using namespace trainscope::pipeline;
  const Schedule s = make_schedule("1f1b", 2, 4, 1);
  EXPECT_EQ(send_release(s)[0], (std::vector<int64_t>{2, 4, -1, 6, -1, 7, -1, -1}));
  EXPECT_EQ(send_release(s)[1], (std::vector<int64_t>{-1, 4, -1, 6, -1, 8, -1, 8}));
  for (const auto& [name, v] : every_schedule()) {
    const int64_t p = 4, m = default_microbatches(name, p);
    const Schedule t = make_schedule(name, p, m, v);
    const std::vector<std::vector<int64_t>> release = send_release(t);
    for (const Costs& c : {Costs{1, 1, 1, 0}, Costs{1, 3, 2, 0.7}, Costs{2, 0.5, 0.5, 5}}) {
      const Replay run = replay(t, c);
      std::map<std::tuple<int64_t, Op, int64_t>, double> start;
      for (int64_t r = 0; r < p; ++r)
        for (size_t k = 0; k < t.actions[r].size(); ++k) start[{t.actions[r][k].stage, t.actions[r][k].op, t.actions[r][k].microbatch}] = run.start[r][k];
      const Op backward = name == "zb-1p" ? Op::BackwardInput : Op::Backward;
      for (int64_t r = 0; r < p; ++r)
        for (size_t i = 0; i < t.actions[r].size(); ++i) {
          const int64_t k = release[r][i];
          const Action& a = t.actions[r][i];
          if (k < 0 || k == static_cast<int64_t>(t.actions[r].size())) continue;
          const Action& at = t.actions[r][static_cast<size_t>(k)];
          const double took = at.op == Op::Forward         ? c.forward
                              : at.op == Op::BackwardInput ? c.backward_input
                              : at.op == Op::Backward      ? c.backward_input + c.backward_weight
                                                           : c.backward_weight;
          const double end = run.start[r][static_cast<size_t>(k)] + took;
          const double received = a.op == Op::Forward ? start[{a.stage + 1, Op::Forward, a.microbatch}] : start[{a.stage - 1, backward, a.microbatch}];
          EXPECT_LE(received, end) << name << " rank " << r << " action " << i;
          if (a.op == Op::Forward) {  // at the latest at its own backward, which the returned gradient proves received
            const auto own = std::find_if(t.actions[r].begin(), t.actions[r].end(), [&](const Action& x) {
              return x.stage == a.stage && x.op == backward && x.microbatch == a.microbatch;
            });
            EXPECT_LE(k, own - t.actions[r].begin()) << name;
          }
        }
    }
  }
}

// Stages cut the layers evenly when they can; otherwise the first and last stages (which also run the
// embedding and the head) hold one layer fewer, the last first: Llama 3 405B's 126 layers on 16 stages
// are 7, 8 x 14, 7 (the Llama 3 paper, Section 3.3.2).
TEST(PipelineSchedule, StagesCutTheLayers) {
  using trainscope::pipeline::stage_layers;
  const auto sizes = [](int64_t layers, int64_t stages) {
    std::vector<int64_t> out;
    int64_t next = 0;
    for (const auto& [first, last] : stage_layers(layers, stages)) {
      EXPECT_EQ(first, next) << "contiguous";
      out.push_back(last - first);
      next = last;
    }
    EXPECT_EQ(next, layers);
    return out;
  };
  EXPECT_EQ(sizes(8, 4), (std::vector<int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(sizes(10, 4), (std::vector<int64_t>{2, 3, 3, 2}));
  EXPECT_EQ(sizes(7, 4), (std::vector<int64_t>{2, 2, 2, 1}));
  std::vector<int64_t> llama405(16, 8);
  llama405.front() = llama405.back() = 7;
  EXPECT_EQ(sizes(126, 16), llama405);
  EXPECT_THAT_ERROR(stage_layers(2, 4), "4 pipeline stages are more than the 2 layers");
  // pp_split moves the cuts; a split that is not one positive count per stage adding up to the layers is one line.
  EXPECT_EQ(stage_layers(8, 4, {1, 3, 3, 1}), (std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 4}, {4, 7}, {7, 8}}));
  EXPECT_THAT_ERROR(stage_layers(8, 4, {3, 3, 2}), "pp_split: 3 counts adding up to 8; expected one count >= 1 for each of the 4 stages");
  EXPECT_THAT_ERROR(stage_layers(8, 4, {4, 4, 0, 0}), "expected one count >= 1");
  EXPECT_THAT_ERROR(stage_layers(8, 2, {3, 4}), "adding up to the 8 layers");
  using trainscope::RunConfig;
  EXPECT_EQ(RunConfig::from_json({{"model", "llama-tiny"}, {"pp", 2}, {"pp_split", "1,1"}, {"batch_size", 4}}).pp_split, "1,1");
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "llama-tiny"}, {"pp", 2}, {"pp_split", "2"}}), "pp_split: 1 counts adding up to 2");
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "llama-tiny"}, {"pp", 2}, {"pp_split", "one,1"}}), "expected layer counts joined by commas");
  EXPECT_THAT_ERROR(RunConfig::from_json({{"model", "llama-tiny"}, {"pp_split", "1,1"}}), "pp_split cuts the layers into pipeline stages: it needs pp > 1");
}

// Every table runs each (stage, F/B or F/I/W, micro-batch) exactly once, on the rank that holds the
// stage; a table out of order is a deadlock the replay names; numbers a schedule cannot take are one line.
TEST(PipelineSchedule, TablesAreCompleteAndBadOnesAreCaught) {
  using namespace trainscope::pipeline;
  for (const auto& [name, v] : every_schedule()) {
    const int64_t p = 4, m = default_microbatches(name, p);
    const Schedule s = make_schedule(name, p, m, v);
    std::set<std::tuple<int64_t, int, int64_t>> seen;
    for (int64_t r = 0; r < p; ++r)
      for (const Action& a : s.actions[r]) {
        EXPECT_EQ(s.rank_of(a.stage), r) << name;
        EXPECT_TRUE(seen.insert({a.stage, static_cast<int>(a.op), a.microbatch}).second) << name << " repeats an action";
      }
    EXPECT_EQ(seen.size(), static_cast<size_t>(p * v * m * (name == "zb-1p" ? 3 : 2))) << name;
  }
  Schedule bad = make_schedule("1f1b", 2, 2, 1);
  std::swap(bad.actions[1][0], bad.actions[1][2]);  // rank 1: F1, B0 (before F0: stuck), F0, B1
  try {
    replay(bad, {});
    ADD_FAILURE() << "the replay ran a table that deadlocks";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("deadlocks: rank 0 at B0 of stage 0, rank 1 at B0 of stage 1"), std::string::npos) << e.what();
  }
  EXPECT_THAT_ERROR(make_schedule("interleaved-1f1b", 4, 6, 2), "pp_microbatches 6 is not a multiple of pp 4");
  EXPECT_THAT_ERROR(make_schedule("1f1b", 2, 4, 2), "pp_virtual 2 needs interleaved-1f1b or zb-1p");
  EXPECT_THAT_ERROR(make_schedule("zb-1p", 4, 6, 2), "zb-1p with several stages per rank takes micro-batches in groups of pp");
  EXPECT_THAT_ERROR(make_schedule("dualpipe", 2, 4, 1), "expected gpipe, 1f1b, interleaved-1f1b or zb-1p");
}
